"""Public backward API: argument checks, buffers, the three launches of cuda_src/flash_bwd.cuh.

Checks happen here, once; the kernels assume their preconditions.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import jit, plan
from .attention import _DTYPE_NAMES, _aligned16, _check_inputs, _check_like, _cupy, _elem_strides, _launch, _resolve_scale
from .params import BWD_DTYPE, make_record


def attention_backward(
    dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
    deterministic: bool = False, dq=None, dk=None, dv=None,
):  # fmt: skip
    """Gradients (dq, dk, dv) of ``out = attention(q, k, v)`` given ``dout``, with FlashAttention-2.

    dout, out: (batch, seqlen_q, nheads, headdim) like q; out and lse are what
    ``cuflash.attention(q, k, v, causal=..., softmax_scale=..., return_lse=True)`` returned for
    these inputs (lse float32 (batch, nheads, seqlen_q), C-contiguous). q, k, v as in
    ``cuflash.attention``: float16 or bfloat16, any strides with a contiguous last dimension,
    GQA / MQA (dk, dv of a kv head are summed over its query heads), head dims 1 to 256.

    causal, softmax_scale: the values the forward ran with.
    deterministic: False (default) adds the dq partial sums with fp32 atomics in whatever order the
    CTAs run (results may differ in the last bits between runs); True adds them in a fixed order
    (bitwise identical results run after run, somewhat slower; on Hopper it runs the mma.sync main
    kernel instead of the wgmma one).
    dq, dk, dv: optional outputs (shapes and dtypes of q, k, v, last dim contiguous) written in place.

    Runs on CuPy's current stream and never synchronizes. Extra device memory: an fp32 buffer of
    dq's size (rounded up to the head-dim bucket) and two fp32 values per query row.
    """
    return _backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                     deterministic=deterministic, dq=dq, dk=dk, dv=dv)  # fmt: skip


def _backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic, dq, dk, dv,
              tile: plan.BwdTile | plan.BwdSm90Tile | None = None):
    cupy = _cupy()
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id = _check_inputs(q, k, v, cupy)
    softmax_scale = _resolve_scale(softmax_scale, head_dim)
    _check_like("dout", dout, "q", q, device_id, cupy)
    _check_like("out", out, "q", q, device_id, cupy)
    if not isinstance(lse, cupy.ndarray):
        raise TypeError(f"lse must be a cupy.ndarray, got {type(lse).__name__}")
    if lse.shape != (batch, nheads, seqlen_q) or lse.dtype != np.float32:
        raise ValueError(
            f"lse must be float32 of shape (batch, nheads, seqlen_q) = {(batch, nheads, seqlen_q)} as returned by "
            f"cuflash.attention(..., return_lse=True), got {lse.dtype} {lse.shape}"
        )
    if lse.device.id != device_id:
        raise ValueError(f"lse is on device {lse.device.id}, q on device {device_id}")
    if not lse.flags.c_contiguous:
        raise ValueError("lse must be C-contiguous; pass cupy.ascontiguousarray(lse)")

    with cupy.cuda.Device(device_id):
        grads = []
        for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if given is None:
                given = cupy.empty(like.shape, dtype=like.dtype)
            else:
                _check_like(name, given, name[1:], like, device_id, cupy)
            grads.append(given)
        dq, dk, dv = grads
        if batch == 0 or nheads == 0 or head_dim == 0:
            return dq, dk, dv
        if seqlen_q == 0 or seqlen_k == 0:  # no score at all: every gradient is 0
            for x in grads:
                x.fill(0)
            return dq, dk, dv

        aligned = head_dim % 8 == 0 and all(_aligned16(x) for x in (q, k, v, out, dout, dq, dk, dv))
        bp, fns = _plan_and_load(
            batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, _DTYPE_NAMES[q.dtype], bool(causal), aligned,
            device_id, tile, bool(deterministic),
        )  # fmt: skip
        main_tile = bp.main.spec.tile
        dq_tile = main_tile.warp_tiles(bp.dq_accum_cols)["dq"]
        rows = (batch, nheads, bp.seqlen_q_pad)
        lse_log2 = cupy.empty(rows, dtype=cupy.float32)
        dsum = cupy.empty(rows, dtype=cupy.float32)
        dq_accum = cupy.zeros(rows + (bp.dq_accum_cols,), dtype=cupy.float32)
        dq_turn = cupy.zeros((batch, nheads, bp.num_m_blocks), dtype=cupy.int32) if deterministic else None
        strides = {}
        for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
            for kind, s in zip(("batch", "row", "head"), _elem_strides(x)):
                strides[f"{name}_{kind}_stride"] = s
        rec = make_record(
            BWD_DTYPE,
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, dout=dout.data.ptr, lse=lse.data.ptr,
            dq=dq.data.ptr, dk=dk.data.ptr, dv=dv.data.ptr, lse_log2=lse_log2.data.ptr, dsum=dsum.data.ptr,
            dq_accum=dq_accum.data.ptr, dq_turn=dq_turn.data.ptr if deterministic else 0,
            **strides,
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_ratio=nheads // nheads_kv,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, seqlen_q_pad=bp.seqlen_q_pad,
            dq_accum_cols=bp.dq_accum_cols, num_m_blocks=bp.num_m_blocks, deterministic=int(bool(deterministic)),
            block_m=main_tile.block_m, dq_q_warps=main_tile.dq_q_warps, dq_tile_rows=dq_tile[0], dq_tile_cols=dq_tile[1],
            softmax_scale=softmax_scale, scale_log2=softmax_scale * math.log2(math.e),
        )  # fmt: skip
        for launch, fn in zip((bp.pre, bp.main, bp.convert), fns):
            _launch(fn, launch, rec)
    return dq, dk, dv


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id, tile,
                   deterministic):  # fmt: skip
    """Plan and the three loaded kernels for one call signature (memoized, as in the forward)."""
    bp = plan.plan_backward(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), tile=tile,
        deterministic=deterministic,
    )  # fmt: skip
    return bp, tuple(jit.get_function(launch.spec, device_id) for launch in (bp.pre, bp.main, bp.convert))
