"""cuflash as a Hugging Face transformers attention implementation (transformers >= 5, optional).

    import cuflash.torch.transformers as cft
    cft.register()                                              # once per process; returns "cufa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cufa", dtype=torch.bfloat16)
    # or model.set_attn_implementation("cufa") on a loaded model

The name is "cufa", not "cuflash": transformers takes every implementation name that contains
"flash" for one of its flash-attention packages and tries to fetch it from the Hugging Face Hub.

``register`` adds ``attention_forward`` to transformers' attention-function registry and, for its
masks, transformers' own flash-attention mask function (None when nothing is padded, else the 2-D
padding mask). What the model's config asks for reaches the kernels as flash-attn arguments:

- padding (a 2-D attention mask with zeros): the padded tokens are dropped and the sequences run
  packed through ``flash_attn_varlen_func`` (left padding in generation included; in cross-attention
  and for a single new token every query is kept, the mask being the keys'), then scattered back; padding-free batches (``position_ids`` that restart, batch 1, or ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` kwargs from a flattening collator) run packed the same way;
- per-layer sliding windows (Mistral, Gemma 2/3, Qwen2): ``window_size = (sliding_window - 1, ...)``,
  transformers' convention (a window of ``sliding_window`` tokens counting the query's own);
- logit softcapping (Gemma 2): ``softcap``; the model's ``scaling``, ``is_causal`` and training dropout;
  ``deterministic`` (a kwarg, else ``FLASH_ATTENTION_DETERMINISTIC=1`` as for transformers' flash path);
- the generation cache: transformers' caches hand over the keys and values of every past token, and
  causal attention aligned bottom-right (flash-attn's convention) lets the new tokens see all of them.

What it cannot do raises: ``output_attentions`` (no probabilities are ever written), attention sinks
(``s_aux``), float32 activations outside autocast (the kernels run float16 / bfloat16).
"""
from __future__ import annotations

import os

import torch

from . import interface
from .bert_padding import index_first_axis, pad_input, unpad_input

NAME = "cufa"  # without "flash" (see the module docstring)

__all__ = ["NAME", "attention_forward", "register"]


def register(name: str = NAME) -> str:
    """Registers cuflash with transformers as ``attn_implementation=name`` (idempotent); returns name."""
    if "flash" in name:
        raise ValueError(f"transformers fetches every attention implementation named '*flash*' from the Hub; "
                         f"register cuflash under a name without 'flash' (the default is {NAME!r}), got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError(
            "cuflash.torch.transformers.register needs transformers >= 5 (its AttentionInterface registry): "
            "pip install 'transformers>=5'"
        ) from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _half_dtype(query: torch.Tensor) -> torch.dtype:
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    raise TypeError(
        f"cuflash attention runs float16 / bfloat16, got {query.dtype} activations: load the model with "
        "dtype=torch.bfloat16 (or float16), or run it under torch.autocast('cuda', dtype=torch.bfloat16)"
    )


def _cu_from_position_ids(position_ids: torch.Tensor):
    """Packed sequences of one row restart their positions: cu_seqlens from the restarts."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == pos.min(), as_tuple=False).reshape(-1).to(torch.int32)
    cu = torch.cat((starts, torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)))
    return cu, int(cu.diff().max().item())


def _is_packed(position_ids, batch: int) -> bool:
    if position_ids is None or batch != 1 or position_ids.shape[-1] < 2:
        return False
    pos = position_ids.reshape(-1)
    return bool((pos[1:] - pos[:-1] != 1).any().item())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-function contract: query (batch, nheads, q_len, headdim), key / value
    (batch, nheads_kv, kv_len, headdim); returns (out (batch, q_len, nheads, headdim), None)."""
    if kwargs.get("output_attentions", False):
        raise ValueError("cuflash attention never writes the attention probabilities: output_attentions=True needs "
                         "attn_implementation='eager'")  # fmt: skip
    if kwargs.get("s_aux") is not None:
        raise ValueError("cuflash attention has no attention sinks (s_aux): use attn_implementation='eager' or 'sdpa'")
    dtype = _half_dtype(query)
    batch, _, q_len, head_dim = query.shape
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))  # flash-attn layout, views
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: the kernels take one head dim; pad v, crop the output
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    deterministic = kwargs.get("deterministic")
    if deterministic is None:  # transformers' flash-attention switch, honoured the same way
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    args = dict(
        dropout_p=float(dropout), softmax_scale=scaling, causal=causal, softcap=float(softcap or 0.0),
        window_size=(sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1),
        deterministic=bool(deterministic),
    )  # fmt: skip

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None:  # padding: drop it, run packed, scatter back
        if attention_mask.dim() != 2:
            raise ValueError(f"cuflash attention takes transformers' 2-D padding mask, got shape "
                             f"{tuple(attention_mask.shape)} (register() sets the mask function that makes it)")  # fmt: skip
        mask = attention_mask.bool()
        kv_len = mask.shape[1]
        k, v = k[:, :kv_len], v[:, :kv_len]  # a static cache holds more slots than tokens seen
        k_unpad, idx_k, cu_k, max_k, _ = unpad_input(k, mask)
        v_unpad = index_first_axis(v.reshape(-1, *v.shape[2:]), idx_k)
        # transformers passes one 2-D mask: the keys'. In self-attention it is the queries' too; in
        # cross-attention (a decoder's non-causal attention to the encoder) every query is real.
        cross = not causal and bool(getattr(module, "is_decoder", False))
        if q_len == kv_len and not cross:  # self-attention over the same tokens
            q_unpad, idx_q, cu_q, max_q = index_first_axis(q.reshape(-1, *q.shape[2:]), idx_k), idx_k, cu_k, max_k
        elif causal and q_len > 1:  # the queries are the last q_len positions (left padding in generation)
            q_unpad, idx_q, cu_q, max_q, _ = unpad_input(q, mask[:, -q_len:])
        else:  # one new token, or cross-attention: every query is real
            q_unpad, idx_q, max_q = q.reshape(-1, *q.shape[2:]), torch.arange(batch * q_len, device=q.device), q_len
            cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
        out = interface.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **args)
        out = pad_input(out, idx_q, batch, q_len)
    elif all(x is not None for x in (cu_q, cu_k, max_q, max_k)) or _is_packed(position_ids, batch):
        if cu_q is None or cu_k is None or max_q is None or max_k is None:
            cu_q, max_q = _cu_from_position_ids(position_ids)
            cu_k, max_k = cu_q, max_q
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        out = interface.flash_attn_varlen_func(*flat, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **args)
        out = out.view(batch, q_len, *out.shape[1:])
    else:
        out = interface.flash_attn_func(q, k, v, **args)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None
