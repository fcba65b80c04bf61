"""PyTorch bridge: ``cuflash.torch.attention`` as a differentiable op on torch CUDA tensors.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)   # q: (batch, seqlen_q, nheads, headdim)
    out.sum().backward()                                   # q.grad, k.grad, v.grad from cuflash

Tensors cross to CuPy and back through DLPack without a copy, and the kernels run on PyTorch's
current CUDA stream. Layout is flash-attn's (batch, seqlen, nheads, headdim), not SDPA's
(batch, nheads, seqlen, headdim): pass ``x.transpose(1, 2)`` views from SDPA code. torch is an
optional dependency (``pip install 'cuflash[torch]'``).
"""
from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "cuflash.torch needs PyTorch with CUDA: pip install 'cuflash[torch]' (or install torch yourself); "
        "the CuPy API (cuflash.attention, cuflash.attention_backward) works without it"
    ) from exc

from .backward import attention_backward as _attention_backward
from .checks import cupy_module as _cupy
from .forward import attention as _attention

__all__ = ["attention"]


def _to_cupy(t: "torch.Tensor"):
    t = t.detach()  # DLPack exports no autograd history; the memory is shared either way
    if t.stride(-1) != 1:  # the kernels need a contiguous last dimension; anything else is copied once
        t = t.contiguous()
    return _cupy().from_dlpack(t)


def _stream():
    """CuPy view of PyTorch's current CUDA stream (so both libraries order their work the same)."""
    return _cupy().cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_cuda:
                raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
        with torch.cuda.device(q.device), _stream():
            out, lse = _attention(
                _to_cupy(q), _to_cupy(k), _to_cupy(v), causal=causal, softmax_scale=softmax_scale, return_lse=True
            )
            out_t, lse_t = torch.from_dlpack(out), torch.from_dlpack(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.cuda.device(q.device), _stream():
            dq, dk, dv = _attention_backward(
                _to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out), _cupy().from_dlpack(lse),
                causal=ctx.causal, softmax_scale=ctx.softmax_scale, deterministic=ctx.deterministic,
            )  # fmt: skip
            grads = tuple(torch.from_dlpack(x) for x in (dq, dk, dv))
        return grads + (None, None, None)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, deterministic: bool = False):
    """Exact attention with FlashAttention-2 forward and backward on torch CUDA tensors.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); float16 or
    bfloat16; nheads % nheads_kv == 0 (GQA / MQA); headdim 1..256. Same conventions as
    ``cuflash.attention`` (causal aligned bottom-right, softmax_scale default 1/sqrt(headdim));
    ``deterministic`` makes the backward bitwise reproducible. Returns out (batch, seqlen_q, nheads,
    headdim).
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("q, k, v must be torch tensors (use cuflash.attention for CuPy arrays)")
    return _Attention.apply(q, k, v, bool(causal), softmax_scale, bool(deterministic))
