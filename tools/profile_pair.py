"""One cuflash forward and one forward of a torch SDPA backend on the same inputs (with --bwd, one
backward of each after them), for ncu:

    ncu --clock-control none -k regex:flash_fwd --section WarpStateStats ... \\
        python tools/profile_pair.py --hd 256 --seqlen 1024
    ncu --clock-control none -k regex:flash_bwd ... python tools/profile_pair.py --bwd
    ncu --clock-control none ... python tools/profile_pair.py --peer cudnn   # against cuDNN (the bar)

--peer: flash (SDPA's FLASH_ATTENTION backend, FlashAttention-2; the default) or cudnn (CUDNN_ATTENTION).
"""
import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="also run one backward of each")
    ap.add_argument("--peer", choices=("flash", "cudnn"), default="flash", help="the SDPA backend to run beside cuflash")
    a = ap.parse_args()
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash
    from cuflash.checks import BF16 as _BF16

    b, h = 16384 // a.seqlen, 2048 // a.hd
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, a.seqlen, h, a.hd), dtype=cupy.float32).astype(_BF16) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, causal=a.causal, return_lse=True)
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    if a.bwd:
        tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
    backend = SDPBackend.FLASH_ATTENTION if a.peer == "flash" else SDPBackend.CUDNN_ATTENTION
    with sdpa_kernel(backend):
        tout = sdpa(tq, tk, tv, is_causal=a.causal)
    if a.bwd:
        dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(_BF16)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=a.causal)
        torch.autograd.grad(tout, (tq, tk, tv), torch.from_dlpack(dout).transpose(1, 2))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
