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
from .varlen import attention_varlen as _attention_varlen
from .varlen import attention_varlen_backward as _attention_varlen_backward

__all__ = ["attention", "attention_varlen"]


def _to_cupy(t: "torch.Tensor"):
    t = t.detach()  # DLPack exports no autograd history; the memory is shared either way
    if t.stride(-1) != 1:  # the kernels need a contiguous last dimension; anything else is copied once
        t = t.contiguous()
    return _cupy().from_dlpack(t)


def _stream():
    """CuPy view of PyTorch's current CUDA stream (so both libraries order their work the same): through
    the CUDA stream protocol where CuPy has Stream.from_external (CuPy 14 deprecates ExternalStream)."""
    cp = _cupy()
    stream = torch.cuda.current_stream()
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream)


def _rng_state(device: "torch.device") -> tuple[int, int]:
    """A (seed, offset) for cuflash's dropout from torch's CUDA generator of ``device``: its seed, and an
    offset reserved by advancing the generator (so torch.manual_seed makes runs reproducible and
    successive calls draw different masks)."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "cuflash dropout under CUDA graph capture: the Philox seed and offset are host values baked into "
            "the captured launch, so every replay would drop the same elements; capture with dropout_p=0, "
            "or run the dropout step outside the graph"
        )
    offset = gen.get_offset()
    gen.set_offset(offset + 4)  # torch's Philox offsets move in steps of 4
    return gen.initial_seed() & (2**64 - 1), int(offset)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_cuda:
                raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
        rng_state = _rng_state(q.device) if isinstance(dropout_p, float) and dropout_p > 0 else None
        with torch.cuda.device(q.device), _stream():
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            res = _attention(
                _to_cupy(q), _to_cupy(k), _to_cupy(v), causal=causal, softmax_scale=softmax_scale,
                window_size=window_size, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p,
                rng_state=rng_state, return_lse=True,
            )  # fmt: skip
            out_t, lse_t = torch.from_dlpack(res[0]), torch.from_dlpack(res[1])
        ctx.save_for_backward(q, k, v, out_t, lse_t, alibi_slopes)
        ctx.args = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                        dropout_p=dropout_p, rng_state=rng_state, deterministic=deterministic)  # fmt: skip
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        with torch.cuda.device(q.device), _stream():
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            dq, dk, dv = _attention_backward(
                _to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out), _cupy().from_dlpack(lse),
                alibi_slopes=slopes, **ctx.args,
            )  # fmt: skip
            grads = tuple(torch.from_dlpack(x) for x in (dq, dk, dv))
        return grads + (None,) * 7


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
              softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, deterministic: bool = False):  # fmt: skip
    """Exact attention with FlashAttention-2 forward and backward on torch CUDA tensors.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); float16 or
    bfloat16; nheads % nheads_kv == 0 (GQA / MQA); headdim 1..256. Same conventions as
    ``cuflash.attention`` (causal aligned bottom-right, softmax_scale default 1/sqrt(headdim)), and
    its variants: window_size, softcap, alibi_slopes (a float32 CUDA tensor (nheads,) or (batch,
    nheads); no gradient), dropout_p (the Philox seed and offset come from torch's CUDA generator of
    q's device, so torch.manual_seed makes a run reproducible; the backward replays the same mask).
    ``deterministic`` makes the backward bitwise reproducible. Returns out (batch, seqlen_q, nheads,
    headdim).
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("q, k, v must be torch tensors (use cuflash.attention for CuPy arrays)")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch tensor on q's device, got {type(alibi_slopes).__name__}")
    window = tuple(window_size) if isinstance(window_size, (list, tuple)) else window_size
    dropout_p = float(dropout_p) if isinstance(dropout_p, (int, float)) else dropout_p  # (the checks name it)
    return _Attention.apply(q, k, v, bool(causal), softmax_scale, window, softcap, alibi_slopes, dropout_p,
                            bool(deterministic))  # fmt: skip


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
                softcap, alibi_slopes, dropout_p, seqused_k, deterministic):  # fmt: skip
        for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not t.is_cuda:
                raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
        rng_state = _rng_state(q.device) if isinstance(dropout_p, float) and dropout_p > 0 else None
        with torch.cuda.device(q.device), _stream():
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            used = None if seqused_k is None else _to_cupy(seqused_k)
            res = _attention_varlen(
                _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(cu_seqlens_q), _to_cupy(cu_seqlens_k), max_seqlen_q,
                max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                alibi_slopes=slopes, dropout_p=dropout_p, rng_state=rng_state, seqused_k=used, return_lse=True,
            )  # fmt: skip
            out_t, lse_t = torch.from_dlpack(res[0]), torch.from_dlpack(res[1])
        ctx.save_for_backward(q, k, v, out_t, lse_t, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k)
        ctx.args = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                        dropout_p=dropout_p, rng_state=rng_state, deterministic=deterministic)  # fmt: skip
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, alibi_slopes, seqused_k = ctx.saved_tensors
        with torch.cuda.device(q.device), _stream():
            slopes = None if alibi_slopes is None else _to_cupy(alibi_slopes)
            used = None if seqused_k is None else _to_cupy(seqused_k)
            dq, dk, dv = _attention_varlen_backward(
                _to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out), _cupy().from_dlpack(lse),
                _to_cupy(cu_q), _to_cupy(cu_k), *ctx.max_seqlens, alibi_slopes=slopes, seqused_k=used, **ctx.args,
            )  # fmt: skip
            grads = tuple(torch.from_dlpack(x) for x in (dq, dk, dv))
        return grads + (None,) * 12


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                     dropout_p: float = 0.0, seqused_k=None, deterministic: bool = False):  # fmt: skip
    """``cuflash.attention_varlen`` on torch CUDA tensors, with autograd: packed sequences q (total_q,
    nheads, headdim), k, v (total_k, nheads_kv, headdim), cu_seqlens_q / cu_seqlens_k int32 CUDA
    tensors (batch + 1,) of prefix sums, seqused_k an optional int32 CUDA tensor (batch,). Variants and
    dropout as ``attention``. Returns out (total_q, nheads, headdim)."""
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor (use cuflash.attention_varlen for CuPy arrays)")
    for name, t in (("alibi_slopes", alibi_slopes), ("seqused_k", seqused_k)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor on q's device, got {type(t).__name__}")
    window = tuple(window_size) if isinstance(window_size, (list, tuple)) else window_size
    dropout_p = float(dropout_p) if isinstance(dropout_p, (int, float)) else dropout_p
    return _AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
                                  softmax_scale, window, softcap, alibi_slopes, dropout_p, seqused_k,
                                  bool(deterministic))  # fmt: skip
