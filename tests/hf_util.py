"""What the transformers tests on the CPU (test_torch_layer_cpu.py) and on the GPU (test_transformers_gpu.py)
do alike to their tiny random models."""


def sharpen_queries(model, scale: float) -> None:
    """Multiply every decoder layer's q_proj weights by ``scale``, in place. With the random initialization
    Gemma 2's scores stay far below its softcap, where tanh is the identity and a dropped softcap would pass;
    sharpened queries make the softcap bend them."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
