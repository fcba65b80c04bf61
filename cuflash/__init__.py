"""cuflash: FlashAttention-2 on CuPy arrays, kernels compiled at run time by NVRTC.

Public API::

    out = cuflash.attention(q, k, v, causal=False, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths)
    out = cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...)

See README.md for the conventions (layout, GQA, causal alignment, lse) and cuflash.reference for
the float64 oracle the kernels are tested against. Layers, top to bottom: the API modules
(forward, backward, kvcache, varlen) with their checks (checks); planning (plan); the JIT and its disk
cache (jit, cache); launches (launch); records (params).
"""
from ._version import __version__
from .backward import attention_backward
from .forward import attention
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen, attention_varlen_backward

__all__ = ["__version__", "attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache"]
