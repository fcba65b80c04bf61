"""CPU kernels for torch.ops.cuflash.*, computed by cuflash.reference (float64 NumPy), for the CPU tests
of the PyTorch layer (tests/test_torch_layer_cpu.py).

cuflash's kernels need a GPU; what sits above them (flash-attn's signatures, the packed forms, the
custom ops' schemas, fake implementations and autograd registration, torch.compile tracing, the
transformers integration) does not. Registering these kernels for the CPU lets the CPU suite run all
of that on CPU tensors against the float64 reference. They are a test double, never part of the
package: the real kernels are tested against the same reference on the GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from cuflash import reference

_REGISTERED = False


def _np(t):
    return None if t is None else t.detach().double().numpy()


def _like(x: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).contiguous()


def _variants(alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap) -> dict:
    if dropout_p > 0:
        raise NotImplementedError("the CPU test kernels have no dropout")
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=(wl, wr), softcap=softcap,
                alibi_slopes=_np(alibi_slopes))  # fmt: skip


def _fwd(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap, deterministic, diag_shift=0):
    kw = _variants(alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap)
    out, lse = reference.attention_forward(_np(q), _np(k), _np(v), diag_shift=diag_shift, **kw)
    return _like(out, q.dtype), _like(lse, torch.float32), torch.zeros(2, dtype=torch.int64)


def _bwd(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, wl, wr, softcap,
         deterministic, diag_shift=0):  # fmt: skip
    kw = _variants(alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap)
    # As the kernel: D from the given out, P normalized by the given lse (a ring's block uses the whole's).
    grads = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), out=_np(out), lse=_np(lse),
                                         diag_shift=diag_shift, **kw)  # fmt: skip
    return tuple(_like(g, t.dtype) for g, t in zip(grads, (q, k, v)))


def _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, block_table, alibi_slopes, dropout_p, softmax_scale,
                causal, wl, wr, softcap, deterministic):  # fmt: skip
    if seqused_k is not None or block_table is not None:
        raise NotImplementedError("the CPU test kernels take packed k, v without seqused_k")
    kw = _variants(alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap)
    out, lse = reference.attention_varlen_forward(_np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(), **kw)
    return _like(out, q.dtype), _like(lse, torch.float32), torch.zeros(2, dtype=torch.int64)


def _varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, seqused_k, alibi_slopes, rng_state, dropout_p,
                softmax_scale, causal, wl, wr, softcap, deterministic):  # fmt: skip
    kw = _variants(alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap)
    grads = reference.attention_varlen_backward(_np(dout), _np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(), **kw)
    return tuple(_like(g, t.dtype) for g, t in zip(grads, (q, k, v)))


def _fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, wl, wr, softcap,
                 rotary_interleaved, num_splits):  # fmt: skip
    lengths = cache_seqlens.numpy() if cache_seqlens is not None else (None if cache_seqlens_int < 0 else cache_seqlens_int)
    out, lse, kc, vc = reference.attention_with_kvcache(
        _np(q), _np(k_cache), _np(v_cache), k=_np(k), v=_np(v), cache_seqlens=lengths,
        block_table=None if block_table is None else block_table.numpy(), causal=causal, softmax_scale=softmax_scale,
        window_size=(wl, wr), softcap=softcap, alibi_slopes=_np(alibi_slopes), rotary_cos=_np(rotary_cos),
        rotary_sin=_np(rotary_sin), rotary_interleaved=rotary_interleaved,
        cache_batch_idx=None if cache_batch_idx is None else cache_batch_idx.numpy(),
        cache_leftpad=None if cache_leftpad is None else cache_leftpad.numpy(),
    )  # fmt: skip
    k_cache.copy_(_like(kc, k_cache.dtype))
    v_cache.copy_(_like(vc, v_cache.dtype))
    return _like(out, q.dtype), _like(lse, torch.float32)


def register() -> None:
    """Registers the CPU kernels once per process (a registration cannot be undone; CUDA calls are unaffected)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import cuflash.torch  # noqa: F401  (defines the ops)

    for name, fn in (("fwd", _fwd), ("bwd", _bwd), ("varlen_fwd", _varlen_fwd), ("varlen_bwd", _varlen_bwd),
                     ("fwd_kvcache", _fwd_kvcache)):  # fmt: skip
        torch.library.register_kernel(f"cuflash::{name}", "cpu", fn)
    _REGISTERED = True
