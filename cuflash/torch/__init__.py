"""cuflash on PyTorch: flash-attn's functions, torch custom ops, and a Hugging Face attention backend.

    from cuflash.torch import flash_attn_func             # was: from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # q: (batch, seqlen_q, nheads, headdim)
    out.sum().backward()

- cuflash.torch.interface: flash-attn 2's public functions with their signatures (flash_attn_func,
  the packed and varlen forms, flash_attn_with_kvcache), and cuflash's own ``attention`` /
  ``attention_varlen``; re-exported here.
- cuflash.torch.ops: the torch custom ops underneath (``torch.ops.cuflash.*``), with fake
  implementations and autograd, so torch.compile(fullgraph=True) traces them and CUDA graphs capture them.
- cuflash.torch.bert_padding: flash-attn's ``unpad_input`` / ``pad_input`` helpers for varlen.
- cuflash.torch.transformers: ``register()`` makes ``attn_implementation="cufa"`` available to
  transformers models (imported on demand; transformers is optional).

Tensors cross to CuPy and back without a copy (by pointer); the kernels run on the tensors' device
and torch's current stream, with memory from torch's caching allocator. Layout is flash-attn's
(batch, seqlen, nheads, headdim), not SDPA's (batch, nheads, seqlen, headdim): pass
``x.transpose(1, 2)`` views from SDPA code. torch is an optional dependency (``pip install 'cuflash[torch]'``).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "cuflash.torch needs PyTorch with CUDA: pip install 'cuflash[torch]' (or install torch yourself); "
        "the CuPy API (cuflash.attention, cuflash.attention_backward) works without it"
    ) from exc

from . import ops  # noqa: F401  (registers torch.ops.cuflash.*)
from .interface import (
    attention,
    attention_varlen,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "attention", "attention_varlen", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]  # fmt: skip
