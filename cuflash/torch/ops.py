"""cuflash's kernels as torch custom ops (``torch.ops.cuflash.*``), with fake implementations and autograd.

Registered with ``torch.library.custom_op``, so ``torch.compile`` traces through them without graph
breaks (the fake implementations give the output shapes without running anything), autograd works
eagerly and compiled, and ``torch.library.opcheck`` can test them. Each op converts its tensors to
CuPy views (by pointer, no copy) and calls the CuPy API inside ``_bridge.call``: the tensors' device,
torch's current stream, torch's caching allocator. The forward ops draw dropout's random state from
torch's generator, so they carry the ``nondeterministic_seeded`` tag that marks random ops (dead-code
elimination and reordering respect it; AOT autograd's CSE pass keeps its own list of random aten ops,
so two identical dropout calls in one compiled graph may still be merged).

    cuflash::fwd         dense forward                       -> out, lse, rng_state
    cuflash::bwd         dense backward                      -> dq, dk, dv
    cuflash::varlen_fwd  packed variable-length forward      -> out, lse, rng_state
    cuflash::varlen_bwd  packed variable-length backward     -> dq, dk, dv
    cuflash::fwd_kvcache decode against a KV cache; appends k, v into k_cache, v_cache in place -> out, lse

rng_state is an int64 CUDA tensor (2,): dropout's Philox (seed, offset), drawn from torch's CUDA
generator by the forward and replayed by the backward (zeros without dropout; the backward reads it only
when dropout_p > 0, so any int64 tensor may stand in there, e.g. ring attention's empty one).
window_size travels as two ints (-1 = unbounded). The user-facing functions with flash-attn's signatures are in
cuflash.torch.interface.

Eager calls skip the dispatcher where nothing needs it: ``forward`` (the dense forward: the implementation
directly without gradients, ``_Dense`` with them), ``varlen_forward`` (the packed one, ``_Varlen`` with
gradients) and ``kvcache``; a repeated dense or packed forward or decode call launches from the tensors'
pointers (``_fwd_prepared``, ``_varlen_prepared``, ``_kvcache_prepared``; docs/design/torch.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from .. import backward as _backward
from .. import forward as _forward
from .. import kvcache as _kvcache
from .. import varlen as _varlen
from . import _bridge

__all__ = ["fwd", "forward", "bwd", "varlen_fwd", "varlen_forward", "varlen_bwd", "fwd_kvcache", "kvcache"]


def _rng(dropout_p: float, device) -> tuple[int, int] | None:
    return _bridge.draw_rng(device) if dropout_p > 0 else None


def _grad_out(dout: Optional[Tensor], out: Tensor) -> Tensor:
    # Only lse was used downstream: out's gradient is zero (lse itself carries no gradient, as in flash-attn).
    return torch.zeros_like(out) if dout is None else dout


# Dense forward / backward.


_SEEDED = (torch.Tag.nondeterministic_seeded,)


def _prepared_outputs(prep, key, q):
    """The device index, out and lse (torch's allocator) of a prepared call, or None where nothing is prepared
    (``prep`` None) or its device is not the current one: the part the dense and packed forwards and the
    decode step share. ``key``: the call's dense key (q's description first)."""
    if prep is None:
        return None
    index = key[0][3]
    if torch.cuda.current_device() != index:
        return None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return index, out, torch.empty(prep.lse_shape, dtype=torch.float32, device=q.device)


def _fwd_prepared(q, k, v, softmax_scale, causal, window_left, window_right, softcap, diag_shift):
    """A dense forward whose signature an earlier call in this thread prepared (cuflash.forward._signature),
    launched from the tensors' pointers: no CuPy arrays, no stream or allocator switch, out and lse from
    torch's allocator. None where the call takes the whole way (a first call, its device not the current
    one, pointers off the planned load path, ALiBi or dropout, a tensor to_cupy would copy)."""
    key = _forward._signature(Tensor, _bridge.desc, q, k, v, causal, softmax_scale, (window_left, window_right),
                              softcap, None, 0.0, diag_shift, None)  # fmt: skip
    prep = _forward.prepared(key)
    outputs = _prepared_outputs(prep, key, q)
    if outputs is None:
        return None
    index, out, lse = outputs
    if not _forward.run_prepared(prep, _bridge.raw_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                 out.data_ptr(), lse.data_ptr()):  # fmt: skip
        return None
    return out, lse, _bridge.rng_tensor(None, q.device)


def _fwd_impl(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
              deterministic, diag_shift=0):  # fmt: skip
    if alibi_slopes is None and dropout_p == 0:
        done = _fwd_prepared(q, k, v, softmax_scale, causal, window_left, window_right, softcap, diag_shift)
        if done is not None:
            return done
    rng = _rng(dropout_p, q.device)
    with _bridge.call(q.device):
        out, lse = _forward.attention(
            _bridge.to_cupy(q, "q"), _bridge.to_cupy(k, "k"), _bridge.to_cupy(v, "v"), causal=causal,
            softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_bridge.to_cupy_opt(alibi_slopes, "alibi_slopes"), dropout_p=dropout_p, rng_state=rng,
            return_lse=True, diag_shift=diag_shift,
        )[:2]  # fmt: skip  (with dropout the rng_state comes last: the one passed in)
        return _bridge.to_torch(out), _bridge.to_torch(lse), _bridge.rng_tensor(rng, q.device)


@torch.library.custom_op("cuflash::fwd", mutates_args=(), device_types="cuda", tags=_SEEDED)
def fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], dropout_p: float,
        softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool, diag_shift: int = 0) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Dense FlashAttention-2 forward; ``deterministic`` is kept for the backward. ``diag_shift``: see
    cuflash.attention (ring attention's chunk pairs)."""
    return _fwd_impl(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                     deterministic, diag_shift)  # fmt: skip


@fwd.register_fake
def _(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic,
      diag_shift=0):  # fmt: skip
    b, s, h, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))  # fmt: skip


def _eager() -> bool:
    """Whether this call runs eagerly: torch neither traces nor transforms it (torch.compile, fake
    tensors, a dispatch mode, torch.jit.trace, vmap), so an op's implementation may run directly."""
    return (not torch.compiler.is_compiling() and _current_dispatch_mode() is None and not torch.jit.is_tracing()
            and not torch._C._are_functorch_transforms_active())  # fmt: skip


def _eager_forward(ctx, impl, setup, inputs):
    """The forward of an eager autograd.Function (_Dense, _Varlen): the op's implementation and its
    registered setup_context, rng_state not differentiable."""
    result = impl(*inputs)
    setup(ctx, inputs, result)
    ctx.mark_non_differentiable(result[2])
    return result


def _backward_run(impl, op):
    """What an eager autograd.Function's backward runs: the implementation only where nothing records the
    backward. A double backward (create_graph=True) or compiled autograd takes the op, which has no autograd
    of its own, so gradients of these gradients raise there, as through the op, instead of silently missing
    attention's second-order term."""
    return impl if _eager() and not torch.is_grad_enabled() else op


class _Dense(torch.autograd.Function):
    """``fwd`` and its registered autograd (``_fwd_setup``, ``_fwd_backward``) for eager calls: the same
    implementations, saved tensors and gradients, without the dispatcher's and the custom op's autograd
    wrapper's per-call work, most of a short training call's host time (tools/torch_host_overhead.py).
    The backward takes the op where torch records it (_backward_run)."""

    @staticmethod
    def forward(ctx, *inputs):
        return _eager_forward(ctx, _fwd_impl, _fwd_setup, inputs)

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        return _dense_grads(ctx, dout, _backward_run(_bwd_impl, bwd))


def _plain(args, tensors_at: tuple) -> bool:
    """Whether the optional tensor arguments at ``tensors_at`` are None or plain torch.Tensor (a loop: a
    generator under all() costs a short eager call ~0.2 us more)."""
    for i in tensors_at:
        a = args[i]
        if a is not None and type(a) is not torch.Tensor:
            return False
    return True


def _eager_or_op(op, impl, function, alibi_at: int, tensors_at: tuple, q, k, v, args):
    """An attention forward for a caller: in eager mode ``impl`` directly (no gradient needed) or through
    the autograd.Function ``function`` (gradients), else the custom ``op`` (torch.compile, fake tensors, a
    dispatch mode, vmap, tensor subclasses: q, k, v or any optional tensor argument at ``tensors_at`` in
    args). args[alibi_at] is the ALiBi slopes: a gradient they need makes the call an autograd one, as the
    op's does."""
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and _eager() \
            and _plain(args, tensors_at):  # fmt: skip
        alibi = args[alibi_at]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or alibi is not None and alibi.requires_grad):  # fmt: skip
            return function.apply(q, k, v, *args)
        return impl(q, k, v, *args)
    return op(q, k, v, *args)


def forward(q, k, v, *args):
    """``fwd`` for a caller (_eager_or_op: ``_fwd_impl``, ``_Dense``, the op). The dispatcher's and the
    custom op's per-call work are most of a short prefill's host time (tools/torch_host_overhead.py)."""
    return _eager_or_op(fwd, _fwd_impl, _Dense, 0, (0,), q, k, v, args)


@torch.library.custom_op("cuflash::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, alibi_slopes: Optional[Tensor],
        rng_state: Tensor, dropout_p: float, softmax_scale: Optional[float], causal: bool, window_left: int,
        window_right: int, softcap: float, deterministic: bool, diag_shift: int = 0) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Dense FlashAttention-2 backward of ``fwd``."""
    return _bwd_impl(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, deterministic, diag_shift)  # fmt: skip


def _bwd_impl(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left,
              window_right, softcap, deterministic, diag_shift=0):  # fmt: skip
    rng = _bridge.rng_from_tensor(rng_state) if dropout_p > 0 else None
    with _bridge.call(q.device):
        grads = _backward.attention_backward(
            _bridge.to_cupy(dout, "dout"), _bridge.to_cupy(q, "q"), _bridge.to_cupy(k, "k"), _bridge.to_cupy(v, "v"),
            _bridge.to_cupy(out, "out"), _bridge.to_cupy(lse, "lse"), causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_bridge.to_cupy_opt(alibi_slopes, "alibi_slopes"), dropout_p=dropout_p, rng_state=rng,
            deterministic=deterministic, diag_shift=diag_shift,
        )  # fmt: skip
        return tuple(_bridge.to_torch(g) for g in grads)


@bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
      softcap, deterministic, diag_shift=0):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    """Saves what the backward needs. ``inputs``: fwd's arguments, diag_shift left out where a caller left it
    at its default (_Dense.apply passes what it was given)."""
    q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, wl, wr, softcap, deterministic, *rest = inputs
    diag_shift = rest[0] if rest else 0
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes)  # (no gradient flows to alibi_slopes)
    ctx.args = (dropout_p, softmax_scale, causal, wl, wr, softcap, deterministic, diag_shift)


def _dense_grads(ctx, dout, run):
    """The dense forward's input gradients from what _fwd_setup saved, the backward run by ``run`` (the
    ``bwd`` op or its implementation)."""
    q, k, v, out, lse, rng_state, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = run(_grad_out(dout, out), q, k, v, out, lse, alibi_slopes, rng_state, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _fwd_backward(ctx, dout, dlse, drng):
    return _dense_grads(ctx, dout, bwd)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# Variable-length (packed) forward / backward.


def _varlen_prepared(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                     window_left, window_right, softcap):  # fmt: skip
    """A packed forward whose signature an earlier call in this thread prepared (cuflash.varlen._signature),
    launched from the tensors' pointers as _fwd_prepared launches a dense one. None where the call takes
    the whole way."""
    key = _varlen._signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                             (window_left, window_right), softcap, None, 0.0, seqused_k, None, None, False, Tensor,
                             _bridge.desc)  # fmt: skip
    prep = _varlen.prepared(key)
    outputs = _prepared_outputs(prep, None if key is None else key[0], q)  # (key[0]: the dense part of the key)
    if outputs is None:
        return None
    index, out, lse = outputs
    used = 0 if seqused_k is None else seqused_k.data_ptr()
    if not _forward.run_prepared(prep, _bridge.raw_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                 out.data_ptr(), lse.data_ptr(), (cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), used),
                                 _varlen._plan_and_load):  # fmt: skip
        return None
    return out, lse, _bridge.rng_tensor(None, q.device)


def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                     alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                     deterministic):  # fmt: skip
    if alibi_slopes is None and dropout_p == 0 and block_table is None:
        done = _varlen_prepared(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                softmax_scale, causal, window_left, window_right, softcap)  # fmt: skip
        if done is not None:
            return done
    rng = _rng(dropout_p, q.device)
    with _bridge.call(q.device):
        out, lse = _varlen.attention_varlen(
            _bridge.to_cupy(q, "q"), _bridge.to_cupy(k, "k"), _bridge.to_cupy(v, "v"),
            _bridge.to_cupy(cu_seqlens_q, "cu_seqlens_q"), _bridge.to_cupy(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q,
            max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
            softcap=softcap, alibi_slopes=_bridge.to_cupy_opt(alibi_slopes, "alibi_slopes"), dropout_p=dropout_p,
            rng_state=rng, seqused_k=_bridge.to_cupy_opt(seqused_k, "seqused_k"),
            block_table=_bridge.to_cupy_opt(block_table, "block_table"), return_lse=True,
        )[:2]  # fmt: skip  (with dropout the rng_state comes last: the one passed in)
        return _bridge.to_torch(out), _bridge.to_torch(lse), _bridge.rng_tensor(rng, q.device)


@torch.library.custom_op("cuflash::varlen_fwd", mutates_args=(), device_types="cuda", tags=_SEEDED)
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, seqused_k: Optional[Tensor], block_table: Optional[Tensor],
               alibi_slopes: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float], causal: bool,
               window_left: int, window_right: int, softcap: float,
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Packed variable-length forward (k, v paged when block_table is given)."""
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                            alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                            deterministic)  # fmt: skip


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, alibi_slopes,
      dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic):  # fmt: skip
    total, h, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((h, total), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))  # fmt: skip


@torch.library.custom_op("cuflash::varlen_bwd", mutates_args=(), device_types="cuda")
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor],
               alibi_slopes: Optional[Tensor], rng_state: Tensor, dropout_p: float, softmax_scale: Optional[float],
               causal: bool, window_left: int, window_right: int, softcap: float,
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Packed variable-length backward of ``varlen_fwd`` (packed k, v only)."""
    return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                            alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                            deterministic)  # fmt: skip


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                     alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                     deterministic):  # fmt: skip
    rng = _bridge.rng_from_tensor(rng_state) if dropout_p > 0 else None
    with _bridge.call(q.device):
        grads = _varlen.attention_varlen_backward(
            _bridge.to_cupy(dout, "dout"), _bridge.to_cupy(q, "q"), _bridge.to_cupy(k, "k"), _bridge.to_cupy(v, "v"),
            _bridge.to_cupy(out, "out"), _bridge.to_cupy(lse, "lse"), _bridge.to_cupy(cu_seqlens_q, "cu_seqlens_q"),
            _bridge.to_cupy(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_bridge.to_cupy_opt(alibi_slopes, "alibi_slopes"), dropout_p=dropout_p, rng_state=rng,
            seqused_k=_bridge.to_cupy_opt(seqused_k, "seqused_k"), deterministic=deterministic,
        )  # fmt: skip
        return tuple(_bridge.to_torch(g) for g in grads)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, alibi_slopes,
      rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, block_table, alibi_slopes, dropout_p, softmax_scale, causal, wl, wr,
     softcap, deterministic) = inputs  # fmt: skip
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, seqused_k, alibi_slopes)
    ctx.paged = block_table is not None
    ctx.max_seqlens = (max_q, max_k)
    ctx.args = (dropout_p, softmax_scale, causal, wl, wr, softcap, deterministic)


def _varlen_grads(ctx, dout, run):
    """The packed forward's input gradients from what _varlen_setup saved, the backward run by ``run`` (the
    ``varlen_bwd`` op or its implementation)."""
    if ctx.paged:
        raise RuntimeError(
            "the paged varlen forward (block_table) has no backward, as in flash-attn: call it under "
            "torch.no_grad(), or pass packed k, v for training"
        )
    q, k, v, out, lse, rng_state, cu_q, cu_k, seqused_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = run(_grad_out(dout, out), q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, seqused_k, alibi_slopes,
                     rng_state, *ctx.args)  # fmt: skip
    return (dq, dk, dv) + (None,) * 14


def _varlen_backward(ctx, dout, dlse, drng):
    return _varlen_grads(ctx, dout, varlen_bwd)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


class _Varlen(torch.autograd.Function):
    """``varlen_fwd`` and its registered autograd for eager calls, as _Dense is for ``fwd``."""

    @staticmethod
    def forward(ctx, *inputs):
        return _eager_forward(ctx, _varlen_fwd_impl, _varlen_setup, inputs)

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        return _varlen_grads(ctx, dout, _backward_run(_varlen_bwd_impl, varlen_bwd))


def varlen_forward(q, k, v, *args):
    """``varlen_fwd`` for a caller, as ``forward`` is for ``fwd`` (_eager_or_op: ``_varlen_fwd_impl``,
    ``_Varlen``, the op)."""
    return _eager_or_op(varlen_fwd, _varlen_fwd_impl, _Varlen, 6, (0, 1, 4, 5, 6), q, k, v, args)  # (cu_seqlens, seqused_k, block_table, alibi)


# Decode against a KV cache.


def _kvcache_prepared(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table, softmax_scale, causal,
                      window_left, window_right, softcap, num_splits):  # fmt: skip
    """A decode step whose signature an earlier call in this thread prepared (cuflash.kvcache._signature),
    launched from the tensors' pointers: no CuPy arrays, no stream or allocator switch, out and lse from
    torch's allocator. None where the call takes the whole way (a first call, its device not the current
    one, a stream without its split workspace yet, graph capture with splits, anything the signature
    leaves out: rotary, cache_batch_idx, cache_leftpad, ALiBi)."""
    lengths = cache_seqlens if cache_seqlens is not None else (None if cache_seqlens_int < 0 else cache_seqlens_int)
    key = _kvcache._signature(Tensor, _bridge.desc, q, k_cache, v_cache, k, v, lengths, block_table, causal,
                              softmax_scale, num_splits, True, None, False, None, (window_left, window_right),
                              softcap)  # fmt: skip
    prep = _kvcache.prepared(key)
    outputs = _prepared_outputs(prep, key, q)
    if outputs is None:
        return None
    index, out, lse = outputs
    seqlen_const = prep.capacity if lengths is None else (0 if cache_seqlens is not None else lengths)
    ok = _kvcache.run_prepared(
        prep, index, _bridge.raw_stream(index), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        0 if k is None else k.data_ptr(), 0 if v is None else v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        0 if cache_seqlens is None else cache_seqlens.data_ptr(), 0 if block_table is None else block_table.data_ptr(),
        seqlen_const,
    )  # fmt: skip
    return (out, lse) if ok else None


def _fwd_kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                      cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_left,
                      window_right, softcap, rotary_interleaved, num_splits):  # fmt: skip
    if rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None \
            and alibi_slopes is None:  # fmt: skip
        done = _kvcache_prepared(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table,
                                 softmax_scale, causal, window_left, window_right, softcap, num_splits)  # fmt: skip
        if done is not None:
            return done
    with _bridge.call(q.device):
        lengths = _bridge.to_cupy(cache_seqlens, "cache_seqlens") if cache_seqlens is not None else (
            None if cache_seqlens_int < 0 else cache_seqlens_int)  # fmt: skip
        out, lse = _kvcache.attention_with_kvcache(
            _bridge.to_cupy(q, "q"), _bridge.to_cupy(k_cache, "k_cache", copy_ok=False),
            _bridge.to_cupy(v_cache, "v_cache", copy_ok=False), k=_bridge.to_cupy_opt(k, "k"),
            v=_bridge.to_cupy_opt(v, "v"), cache_seqlens=lengths,
            block_table=_bridge.to_cupy_opt(block_table, "block_table"), causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_bridge.to_cupy_opt(alibi_slopes, "alibi_slopes"), num_splits=num_splits, return_lse=True,
            rotary_cos=_bridge.to_cupy_opt(rotary_cos, "rotary_cos"),
            rotary_sin=_bridge.to_cupy_opt(rotary_sin, "rotary_sin"), rotary_interleaved=rotary_interleaved,
            cache_batch_idx=_bridge.to_cupy_opt(cache_batch_idx, "cache_batch_idx"),
            cache_leftpad=_bridge.to_cupy_opt(cache_leftpad, "cache_leftpad"),
        )  # fmt: skip
        return _bridge.to_torch(out), _bridge.to_torch(lse)


@torch.library.custom_op("cuflash::fwd_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_seqlens_int: int, cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], softmax_scale: Optional[float],
                causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                num_splits: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Attention against a KV cache; new tokens k, v are written into k_cache, v_cache in place first.
    cache_seqlens (int32 (batch,)) wins over cache_seqlens_int; both absent (None, -1): full caches."""
    return _fwd_kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                             cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale, causal,
                             window_left, window_right, softcap, rotary_interleaved, num_splits)  # fmt: skip


def kvcache(*args):
    """``fwd_kvcache`` for a caller: the op while torch traces or transforms (torch.compile, fake
    tensors, a dispatch mode, torch.jit.trace, vmap), else its implementation directly, without the dispatcher's per-call work (alias checks,
    version counters): a decode step's host time is its latency, and the op has no autograd to serve.
    Eager calls lose only the version-counter bump of k_cache / v_cache. (Host time per call on the
    H200 machine: tools/torch_host_overhead.py; docs/history/torch.md has the numbers.)"""
    if type(args[0]) is torch.Tensor and _eager():
        return _fwd_kvcache_impl(*args)
    return fwd_kvcache(*args)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
      rotary_interleaved, num_splits):  # fmt: skip
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)
