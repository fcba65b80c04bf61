"""The forward: ``cuflash.attention``. Argument checks (cuflash/checks.py), output allocation, the plan
(cuflash/plan/forward.py) and the launch of cuda_src/flash_fwd.cuh (or, on Hopper, flash_fwd_sm90_ws.cuh with
its tensor maps, cuflash/tma.py).

The kernels assume their preconditions (see the header comment of cuda_src/flash_fwd.cuh); every
check happens here, once, with a message that says what to do.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import checks, jit, launch, plan, tma, variants
from .params import FWD_PACKER


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
              softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, rng_state=None,
              return_lse: bool = False, out=None, diag_shift: int = 0):  # fmt: skip
    """Exact attention ``softmax(scale * q k^T) v`` with FlashAttention-2 on CuPy arrays.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); float16 or
    bfloat16, all the same dtype, on one device; any strides with a contiguous last dimension.
    nheads must be a multiple of nheads_kv (GQA / MQA). headdim from 1 to 256.

    causal: mask aligned to the bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q;
    a query that sees no key gets 0 (and lse -inf).
    softmax_scale: defaults to 1 / sqrt(headdim); must be positive.
    window_size: (left, right), -1 = unbounded: query i sees keys d - left <= j <= d + right, d = i +
    seqlen_k - seqlen_q (sliding window, aligned like causal; with causal, right is 0). Only the key
    blocks a window touches are visited.
    softcap: > 0 caps the scaled scores: s -> softcap * tanh(s / softcap) (Gemma 2, Grok).
    alibi_slopes: float32 CuPy array (nheads,) or (batch, nheads): adds -slope * |d - j| to the score
    (after the softcap).
    dropout_p: in [0, 1): each probability is kept with probability 1 - dropout_p and scaled by
    1 / (1 - dropout_p), after the normalization. rng_state = (seed, offset) picks the Philox stream;
    None draws a fresh seed. The call then also returns the rng_state it used (pass it to
    attention_backward).
    return_lse: also return lse, float32 (batch, nheads, seqlen_q), natural log of the softmax sum
    (of the softcapped, ALiBi'd scores, before dropout).
    out: optional output array (shape and dtype of q, last dim contiguous) written in place.
    diag_shift: moves the diagonal d of causal, window and ALiBi to i + seqlen_k - seqlen_q + diag_shift:
    for a piece of a longer sequence (query i at position q0 + i, key j at k0 + j of the whole), pass
    q0 - k0 - (seqlen_k - seqlen_q) to get the whole's mask and biases (ring attention's chunk pairs).

    Returns out; (out, lse) with return_lse; with dropout_p > 0, rng_state last: (out, rng_state) or
    (out, lse, rng_state). Runs on CuPy's current stream and never synchronizes.
    """
    return run(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
               alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state, return_lse=return_lse, out=out,
               diag_shift=diag_shift)


def run(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
        softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, rng_state=None, return_lse: bool = False,
        out=None, tile: plan.Tile | plan.Sm90Tile | None = None, kernel=None, diag_shift: int = 0):  # fmt: skip
    """``attention`` with a forced tile (a plan.Tile runs the mma.sync kernel with it, a plan.Sm90Tile
    the Hopper one); for tuning tools and tests. tile=None is exactly ``attention``. ``kernel``: a
    loaded kernel launched in place of the planned one, which must be a build of the same variant
    (tools/trace_fwd.py: a diagnostic build of the forced tile's spec)."""
    if kernel is not None and tile is None:  # (a forced tile never falls back to another kernel)
        raise ValueError("kernel= needs tile=, the tile the kernel was built for")
    cupy = checks.cupy_module()
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id = checks.check_qkv(q, k, v, cupy)
    softmax_scale = checks.resolve_scale(softmax_scale, head_dim)
    var = variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, rng_state=rng_state, batch=batch, nheads=nheads, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, device_id=device_id, cupy=cupy, diag_shift=diag_shift)  # fmt: skip

    def result(out, lse):
        res = (out, lse) if return_lse else (out,)
        if var.rng_state is not None:
            res += (var.rng_state,)
        return res if len(res) > 1 else out

    with cupy.cuda.Device(device_id):
        out = checks.output_like(out, q, device_id, cupy)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)

        if batch == 0 or seqlen_q == 0 or nheads == 0 or head_dim == 0:
            return result(out, lse)
        if seqlen_k == 0:  # no query sees any key
            out.fill(0)
            lse.fill(-np.inf)
            return result(out, lse)

        aligned = head_dim % 8 == 0 and all(checks.aligned16(x) for x in (q, k, v, out))
        dtype = checks.DTYPE_NAMES[q.dtype]
        how, fn, maps = load_with_maps(
            lambda t: _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, var.causal, aligned,
                                     device_id, t, var.mods), q, k, v, out, dtype, tile)  # fmt: skip
        if kernel is not None:
            fn = kernel
        unit = var.unit_scale(softmax_scale)  # the softmax's scale: softcap with softcap
        qs, ks, vs, os_ = (checks.elem_strides(x) for x in (q, k, v, out))
        record = maps + FWD_PACKER.pack(
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
            q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
            v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
            o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_ratio=nheads // nheads_kv,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, num_m_blocks=how.m_blocks,
            sched_group=how.sched_group,
            softmax_scale=unit, scale_log2=unit * math.log2(math.e), mod=var.record(softmax_scale),
        )  # fmt: skip
        launch.launch_record(fn, how, record, cupy.cuda.get_current_stream().ptr)
    return result(out, lse)


def tma_maps(how, q4, k4, v4, o4, dtype: str, forced: bool = False) -> bytes | None:
    """The tensor maps that start the parameter block of the warp-specialized kernel (FwdTmaParams),
    b"" for the other kernels, None where the driver cannot describe an input or the output with a
    tensor map (the caller then plans the cp.async Hopper kernel; with ``forced``, a tile the caller
    gave, the TensorMapError is raised). q4, k4, v4, o4: 4-D (batch, rows, heads, d) views."""
    if how.spec.family != "flash_fwd_sm90_ws":
        return b""
    try:
        t = how.spec.tile
        return tma.fwd_maps(q4, k4, v4, o4, dtype, t.block_m, t.block_n, store_o=t.tma_store, cluster=t.cluster)
    except tma.TensorMapError:
        if forced:  # a tool asked for this kernel: say so rather than time or check another one
            raise
        return None


def load_with_maps(load, q4, k4, v4, o4, dtype: str, tile):
    """Plan and kernel from ``load(tile)`` (a memoized plan-and-load of one call signature) and the
    tensor maps of its parameter block (tma_maps): where no tensor map describes an input or the
    output, plan again with the cp.async Hopper tile (maps b""). Returns (plan, kernel, maps)."""
    how, fn = load(tile)
    maps = tma_maps(how, q4, k4, v4, o4, dtype, forced=tile is not None)
    if maps is None:
        how, fn = load(plan.FWD_SM90_TILES[how.spec.head_dim])
        maps = b""
    return how, fn, maps


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id, tile,
                   mods=0):  # fmt: skip
    """Launch plan and loaded kernel for one call signature (memoized: the host side of a repeated
    call is then a dictionary lookup, not a re-plan)."""
    how = plan.plan_forward(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), tile=tile, mods=mods,
        sm_count=jit.device_sm_count(device_id), l2_bytes=jit.device_l2_bytes(device_id),
    )  # fmt: skip
    return how, jit.get_function(how.spec, device_id)
