"""cuflash: FlashAttention-2 on CuPy arrays, kernels compiled at run time by NVRTC.

Public API::

    out = cuflash.attention(q, k, v, causal=False, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths)

See README.md for the conventions (layout, GQA, causal alignment, lse) and cuflash.reference for
the float64 oracle the kernels are tested against.
"""
from ._version import __version__
from .attention import attention
from .backward import attention_backward
from .kvcache import attention_with_kvcache

__all__ = ["__version__", "attention", "attention_backward", "attention_with_kvcache"]
