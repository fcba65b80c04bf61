"""The forward: ``cuflash.attention``. Argument checks (cuflash/checks.py), output allocation, the plan
(cuflash/plan/forward.py) and the launch of cuda_src/flash_fwd.cuh (or, on Hopper, flash_fwd_sm90_ws.cuh with
its tensor maps, cuflash/tma.py).

The kernels assume their preconditions (see the header comment of cuda_src/flash_fwd.cuh); every
check happens here, once, with a message that says what to do.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import struct

import numpy as np

from . import checks, jit, launch, plan, prepared_calls, tma, variants
from .params import FWD_PACKER, MOD_DTYPE, walk_fields

#: The pointer fields that open FwdParams (after the TMA kernel's tensor maps): all of a dense record that
#: changes from one call of a signature to the next (run_prepared; a packed one's three more: _VARLEN_PTRS).
_PTR_FIELDS = ("q", "k", "v", "o", "lse")
_PTRS = struct.Struct("<" + "Q" * len(_PTR_FIELDS))
assert FWD_PACKER.names[: len(_PTR_FIELDS)] == _PTR_FIELDS and FWD_PACKER.offset("q") == 0 \
    and all(FWD_PACKER.dtype.fields[n][0] == np.uint64 for n in _PTR_FIELDS), \
    "FwdParams no longer opens with the pointers"  # fmt: skip
#: A packed (varlen) call's other per-call pointers: cu_seqlens_q, cu_seqlens_k and seqused_k, side by side
#: in the record's ModParams (run_prepared's varlen_ptrs).
_VARLEN_PTRS = struct.Struct("<QQQ")
_VARLEN_AT = FWD_PACKER.offset("mod") + MOD_DTYPE.fields["cu_seqlens_q"][1]
assert [MOD_DTYPE.fields[n][1] for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")] == \
    [MOD_DTYPE.fields["cu_seqlens_q"][1] + 8 * i for i in range(3)], "ModParams' varlen pointers are no longer side by side"


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
    # A signature seen before (_signature): only the pointers are looked at.
    key = None if tile is not None else _signature(cupy.ndarray, _desc, q, k, v, causal, softmax_scale, window_size,
                                                   softcap, alibi_slopes, dropout_p, diag_shift, out)  # fmt: skip
    prep = prepared(key)
    if prep is not None:
        device_id = key[0][3]
        with cupy.cuda.Device(device_id):
            o = cupy.empty(key[0][0], dtype=key[0][2]) if out is None else out
            lse = cupy.empty(prep.lse_shape, dtype=cupy.float32)
            if run_prepared(prep, cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr,
                            lse.data.ptr):  # fmt: skip
                return (o, lse) if return_lse else o
        # (else the whole way: pointers off the planned load path, or a changed plan memo)
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

        strides16 = all(checks.rows_aligned16(0, x.shape, x.strides) for x in (q, k, v, out))  # (pointers aside)
        aligned = head_dim % 8 == 0 and strides16 and not (q.data.ptr | k.data.ptr | v.data.ptr | out.data.ptr) & 15
        dtype = checks.DTYPE_NAMES[q.dtype]
        plan_args = (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, var.causal, aligned, device_id)
        how, fn, maps = load_with_maps(lambda t: _plan_and_load(*plan_args, t, var.mods), q, k, v, out, dtype, tile)
        if kernel is not None:
            fn = kernel
        unit = var.unit_scale(softmax_scale)  # the softmax's scale: softcap with softcap
        qs, ks, vs, os_ = (checks.elem_strides(x) for x in (q, k, v, out))
        fields = dict(
            q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
            v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
            o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_ratio=nheads // nheads_kv,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, num_m_blocks=how.m_blocks,
            sched_group=how.sched_group, **walk_fields(how.walk),
            softmax_scale=unit, scale_log2=unit * math.log2(math.e), mod=var.record(softmax_scale),
        )  # fmt: skip
        record = maps + FWD_PACKER.pack(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
                                        **fields)  # fmt: skip
        stream = cupy.cuda.get_current_stream().ptr
        launch.launch_record(fn, how, record, stream)
        # Kept for the signature's next calls: the plan the planner made (not a fallback's), for pointers on
        # the 16-byte rows the head dim and strides allow (a call 8 bytes off must not replace the aligned plan).
        if key is not None and aligned == (head_dim % 8 == 0 and strides16) \
                and how is _plan_and_load(*plan_args, None, var.mods)[0]:  # fmt: skip
            _PREPARED.room()[key] = preparation(plan_args + (None, var.mods), how, fn,
                                                FWD_PACKER.pack(q=0, k=0, v=0, o=0, lse=0, **fields), dtype,
                                                (q, k, v, out), bool(maps), aligned, (batch, nheads, seqlen_q))  # fmt: skip
    return result(out, lse)


# The prepared path: a call signature seen before skips its checks, plan lookup and packing.


@dataclasses.dataclass(frozen=True, slots=True)
class _Prepared:
    """What the checks and the plan make of one call signature (_signature): the plan's arguments and
    the plan and kernel they gave, the FwdParams record with its pointers left 0, and what a call still
    needs: the tensor maps' geometry (the maps hold the pointers: encoded per call, tma.encode's cache
    keeps those of pointers seen before) and the load path the pointers must agree with."""

    plan_args: tuple  # _plan_and_load's arguments
    how: plan.Launch
    fn: object  # the loaded kernel
    record: bytes  # FwdParams with q, k, v, o, lse 0 (patched per call)
    dtype: str  # "fp16" | "bf16"
    maps: tuple  # (shape, element strides, box rows) of the q, k, v (and o) tensor maps; () without TMA
    zero_maps: int  # maps left zero after those (the output map of a kernel that stores O without TMA)
    aligned: bool  # the 16-byte load path was planned: the head dim and strides allow it, so the pointers must too
    lse_shape: tuple


def preparation(plan_args: tuple, how, fn, record: bytes, dtype: str, arrays: tuple, maps: bool, aligned: bool,
                lse_shape: tuple) -> _Prepared:
    """The _Prepared of a call the whole way just launched (forward.run, varlen.run): ``record`` its FwdParams
    with the per-call pointers 0, ``arrays`` its 4-D q, k, v, out views, ``maps`` whether its kernel takes
    tensor maps (their geometry is kept as tma.fwd_maps encodes them)."""
    t = how.spec.tile
    boxes = tma.fwd_boxes(t.block_m, t.block_n, t.tma_store, t.cluster) if maps else ()
    return _Prepared(plan_args=plan_args, how=how, fn=fn, record=record, dtype=dtype,
                     maps=tuple((tuple(x.shape), tuple(st // tma.ELEMENT_BYTES for st in x.strides), rows)
                                for x, rows in zip(arrays, boxes)),
                     zero_maps=4 - len(boxes) if maps else 0, aligned=aligned, lse_shape=lse_shape)  # fmt: skip


_PREPARED = prepared_calls.PreparedCalls(limit=256)  # signatures kept per thread (a model has a handful of attention shapes)
_desc = prepared_calls.desc


def _signature(nd, desc, q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, diag_shift,
               out) -> tuple | None:  # fmt: skip
    """The key under which a call's checks and plan are kept (_Prepared): everything they depend on but
    the pointers. None where the call takes the whole way every time: ALiBi (a device pointer in the
    record), dropout (a seed per call), arguments of other types (the whole way then raises the errors).
    ``nd`` is the array type the call's arrays must be and ``desc`` gives an array's (shape, strides in
    bytes, NumPy dtype, device): CuPy's (_desc) here, torch's in cuflash.torch, so a torch call finds the
    preparation its first call made through the CuPy API. Only calls the whole way completed are ever
    kept, so a key found was checked."""
    if alibi_slopes is not None or type(dropout_p) not in (int, float) or dropout_p != 0:
        return None
    if type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int \
            or type(window_size[1]) is not int:  # fmt: skip
        return None
    if type(softcap) not in (int, float) or type(diag_shift) is not int or type(causal) is not bool:
        return None
    if softmax_scale is not None and type(softmax_scale) is not float:
        return None
    if type(q) is not nd or type(k) is not nd or type(v) is not nd:
        return None
    qd, kd, vd = desc(q), desc(k), desc(v)
    if qd is None or kd is None or vd is None:
        return None
    od = None
    if out is not None and (type(out) is not nd or (od := desc(out)) is None):
        return None
    return qd, kd, vd, od, causal, softmax_scale, window_size, softcap, diag_shift


def prepared(key) -> _Prepared | None:
    """The preparation of a call signature (_signature) that an earlier call in this thread made, or None."""
    return None if key is None else _PREPARED.calls.get(key)


def run_prepared(prep: _Prepared, stream: int, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int,
                 varlen_ptrs: tuple | None = None, load=None) -> bool:  # fmt: skip
    """Launch a prepared call by pointers (its device current, ``stream`` a stream handle, out and lse
    allocated by the caller: out as the signature describes it, or q's shape contiguous where it had
    none; lse float32 prep.lse_shape contiguous). Returns False, having launched nothing, where the call
    must take the whole way: pointers off the planned load path (16-byte rows, tensor maps), or a plan
    memo that no longer gives this plan (tests and tools clear or swap it). A packed call (cuflash/varlen.py)
    gives ``varlen_ptrs`` (cu_seqlens_q, cu_seqlens_k, seqused_k or 0) and its plan memo as ``load``."""
    if prep.aligned and (q_ptr | k_ptr | v_ptr | o_ptr) & 15:
        return False
    got = (load or _plan_and_load)(*prep.plan_args)
    if got[0] is not prep.how or got[1] is not prep.fn:
        return False
    maps = b""
    if prep.maps:
        try:
            maps = b"".join(tma.encode(ptr, shape, strides, prep.dtype, rows)
                            for ptr, (shape, strides, rows) in zip((q_ptr, k_ptr, v_ptr, o_ptr), prep.maps))
        except tma.TensorMapError:
            return False
        maps += bytes(tma.MAP_BYTES) * prep.zero_maps
    args = launch.ARGS
    data = maps + prep.record
    ctypes.memmove(args.buf, data, len(data))
    _PTRS.pack_into(args.buf, len(maps), q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr)
    if varlen_ptrs is not None:
        _VARLEN_PTRS.pack_into(args.buf, len(maps) + _VARLEN_AT, *varlen_ptrs)
    launch.launch(prep.fn, prep.how, args.argv_ptr, stream)
    return True


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
