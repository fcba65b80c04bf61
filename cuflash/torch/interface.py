"""flash-attn's public functions on cuflash's kernels: same names, signatures, defaults and returns.

Code written against flash-attn 2 runs after one changed import line::

    from flash_attn import flash_attn_func, flash_attn_varlen_func      # before
    from cuflash.torch import flash_attn_func, flash_attn_varlen_func   # after

Every function is differentiable (except flash_attn_with_kvcache, an inference call, and the paged
varlen forward), runs on its tensors' device and torch's current stream, and is built on the custom
ops of cuflash.torch.ops, so torch.compile(fullgraph=True) traces it. Arguments cuflash cannot honour
raise an error that names them: ``return_attn_probs=True`` with ``dropout_p > 0`` (cuflash never
writes the probability matrix; without dropout flash-attn returns None in its place too, and so does
cuflash). Also here: ``attention`` and ``attention_varlen``, cuflash's own keyword-first spelling of
the same calls.
"""
from __future__ import annotations

import operator

import torch

from . import ops

__all__ = [
    "attention", "attention_varlen", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]  # fmt: skip


def _tensor(name: str, t, optional: bool = False):
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__} (use cuflash's CuPy API for CuPy arrays)")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    return t


def _half(named) -> None:
    """The attention inputs share one dtype, float16 or bfloat16 (the kernels' types)."""
    dtypes = {t.dtype for _, t in named}
    name, first = named[0]
    if first.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name} has dtype {first.dtype}; cuflash runs float16 and bfloat16: cast with "
                        f"{name}.to(torch.bfloat16) (or run under torch.autocast)")  # fmt: skip
    if len(dtypes) > 1:
        raise TypeError("the attention inputs must share one dtype, got " +
                        ", ".join(f"{n} {t.dtype}" for n, t in named))  # fmt: skip


def _unpack(name: str, x, layout: str):
    """The parts of a packed tensor: ``layout`` names its dims, one of them "3" or "2" (the packed axis)."""
    _tensor(name, x)
    dims = layout.split(", ")
    axis = dims.index("3") if "3" in dims else dims.index("2")
    if x.dim() != len(dims) or x.shape[axis] != int(dims[axis]):
        raise ValueError(f"{name} must be ({layout}), got shape {tuple(x.shape)}")
    return x.unbind(axis)


def _window(window_size) -> tuple[int, int]:
    """The torch layer's window_size as two ints (anything int() takes, as flash-attn does), each >= -1."""
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, -1 = unbounded; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size values must be >= -1 (-1: unbounded), got {window_size!r}")
    return left, right


def _dropout(dropout_p, return_attn_probs: bool) -> float:
    p = _float("dropout_p", dropout_p)
    if return_attn_probs and p > 0:
        raise ValueError(
            "return_attn_probs=True with dropout_p > 0 is not supported: cuflash never writes the attention "
            "probabilities (flash-attn returns them only to test its dropout); cuflash.reference.dropout_keep_mask "
            "rebuilds the dropout mask instead. With dropout_p=0, return_attn_probs gives (out, lse, None) as in flash-attn"
        )
    return p


def _int(name: str, x) -> int:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be an int, got a tensor of shape {tuple(x.shape)}")
        return int(x.item())
    try:
        return int(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int, got {x!r}") from None


def _float(name: str, x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None


def _scale(softmax_scale) -> float | None:
    return None if softmax_scale is None else _float("softmax_scale", softmax_scale)


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):  # fmt: skip
    p = _dropout(dropout_p, return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t)
    _half((("q", q), ("k", k), ("v", v)))
    _tensor("alibi_slopes", alibi_slopes, optional=True)
    left, right = _window(window_size)
    out, lse, _ = ops.forward(q, k, v, alibi_slopes, p, _scale(softmax_scale), bool(causal), left, right,
                              _float("softcap", softcap), bool(deterministic))  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """Attention of q (batch, seqlen_q, nheads, headdim) against k, v (batch, seqlen_k, nheads_k,
    headdim); float16 / bfloat16, headdim 1..256, nheads % nheads_k == 0 (GQA / MQA). causal is
    aligned to the bottom-right corner; window_size (left, right) keeps keys j with i + seqlen_k -
    seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; softcap > 0 caps the scores; alibi_slopes
    float32 (nheads,) or (batch, nheads); dropout_p draws its Philox stream from torch's CUDA generator;
    deterministic makes the backward reproducible. Returns out (batch, seqlen_q, nheads, headdim), or
    (out, softmax_lse (batch, nheads, seqlen_q) float32, None) with return_attn_probs."""
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)  # fmt: skip


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """``flash_attn_func`` on qkv (batch, seqlen, 3, nheads, headdim); the gradient is qkv's."""
    q, k, v = _unpack("qkv", qkv, "batch, seqlen, 3, nheads, headdim")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)  # fmt: skip


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """``flash_attn_func`` on q and kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, "batch, seqlen_k, 2, nheads_k, headdim")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)  # fmt: skip


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None,
            seqused_k=None):  # fmt: skip
    p = _dropout(dropout_p, return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _tensor(name, t)
    _half((("q", q), ("k", k), ("v", v)))
    for name, t in (("alibi_slopes", alibi_slopes), ("block_table", block_table), ("seqused_k", seqused_k)):
        _tensor(name, t, optional=True)
    left, right = _window(window_size)
    out, lse, _ = ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, _int("max_seqlen_q", max_seqlen_q),
                                     _int("max_seqlen_k", max_seqlen_k), seqused_k, block_table, alibi_slopes, p,
                                     _scale(softmax_scale), bool(causal), left, right, _float("softcap", softcap),
                                     bool(deterministic))  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):  # fmt: skip
    """Attention of each packed sequence on its own: q (total_q, nheads, headdim), k, v (total_k,
    nheads_k, headdim), cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) prefix sums; variants as
    ``flash_attn_func``. block_table (int32 (batch, max_pages)) makes k, v paged caches (num_pages,
    page_size, nheads_k, headdim), page_size a multiple of 128, forward only. Returns out (total_q,
    nheads, headdim), or (out, softmax_lse (nheads, total_q), None) with return_attn_probs."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)  # fmt: skip


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):  # fmt: skip
    """``flash_attn_varlen_func`` on qkv (total, 3, nheads, headdim) with one cu_seqlens / max_seqlen."""
    q, k, v = _unpack("qkv", qkv, "total, 3, nheads, headdim")
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """``flash_attn_varlen_func`` on q and kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, "total_k, 2, nheads_k, headdim")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):  # fmt: skip
    """Decode: q (batch, seqlen_q, nheads, headdim) against k_cache, v_cache (batch_cache, seqlen_cache,
    nheads_k, headdim), or paged (num_blocks, page_size, nheads_k, headdim) with block_table int32
    (batch, max_blocks), page_size a multiple of 16. New tokens k, v (batch, seqlen_new, nheads_k,
    headdim) are written into the caches in place (the caller's tensors see them) at cache_seqlens[b]
    onward, after the rotary embedding of rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) when
    given. cache_seqlens: an int or an int32 tensor (batch,), None = full caches (not updated by the
    call); cache_batch_idx, cache_leftpad: int32 tensors (batch,). Returns out, or (out, softmax_lse
    (batch, nheads, seqlen_q)) with return_softmax_lse. No autograd (an inference call); capturable in
    a CUDA graph once warmed up (pass cache_seqlens as a tensor so replays see new lengths)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t)
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together, or neither")
    _half((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + ((("k", k), ("v", v)) if k is not None else ()))
    named = (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
             ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table),
             ("alibi_slopes", alibi_slopes))  # fmt: skip
    for name, t in named:
        _tensor(name, t, optional=True)
    lengths, length_int = None, -1  # a tensor (batch,), or one int for every sequence (-1: full caches)
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = _tensor("cache_seqlens", cache_seqlens)
    elif cache_seqlens is not None:
        try:
            length_int = operator.index(cache_seqlens)
        except TypeError:
            raise ValueError(f"cache_seqlens must be an int or an int32 tensor (batch,), got {cache_seqlens!r}") from None
        if length_int < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
    left, right = _window(window_size)
    out, lse = ops.kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths, length_int,
                               cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                               _scale(softmax_scale), bool(causal), left, right, _float("softcap", softcap),
                               bool(rotary_interleaved), _int("num_splits", num_splits))  # fmt: skip
    return (out, lse) if return_softmax_lse else out


# cuflash's own keyword-first spelling (the bridge's API before the flash-attn names).


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
              softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, deterministic: bool = False):  # fmt: skip
    """``cuflash.attention`` on torch CUDA tensors with autograd: ``flash_attn_func`` with cuflash's
    argument order. Returns out (batch, seqlen_q, nheads, headdim)."""
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, False)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                     dropout_p: float = 0.0, seqused_k=None, deterministic: bool = False):  # fmt: skip
    """``cuflash.attention_varlen`` on torch CUDA tensors with autograd (``flash_attn_varlen_func``
    with cuflash's argument order, plus seqused_k: an int32 tensor (batch,), sequence b uses its first
    seqused_k[b] keys). Returns out (total_q, nheads, headdim)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, False, seqused_k=seqused_k)  # fmt: skip
