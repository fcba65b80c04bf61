"""flash-attn's padding helpers (``flash_attn.bert_padding``), for code that feeds the varlen functions
from padded batches: the same names, arguments and returns (flash-attn 2.7's five-value
``unpad_input``), written on plain torch indexing, so autograd flows through them.

    from cuflash.torch.bert_padding import pad_input, unpad_input   # was: from flash_attn.bert_padding ...
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)
"""
from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``input`` along its first axis: (len(indices), *input.shape[1:])."""
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of first dimension ``first_axis_dim`` (the rest like ``values``) with ``values``
    at rows ``indices``: the inverse of index_first_axis."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """The tokens of a padded batch, packed.

    hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), nonzero = a real token;
    unused_mask: optional (batch, seqlen), nonzero = a slot kept in the packed rows but not used (it
    counts in cu_seqlens, not in seqused). Returns (hidden_states of the kept tokens (total, ...),
    indices of those tokens in the flattened (batch * seqlen) input (int64), cu_seqlens int32
    (batch + 1,), the longest sequence (an int: one synchronization), seqused int32 (batch,): the
    real tokens of each sequence)."""
    keep = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    lengths = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.reshape(-1), as_tuple=False).reshape(-1)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Packed rows (total, ...) back into a padded batch (batch, seqlen, ...), zeros at the padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
