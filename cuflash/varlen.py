"""Packed variable-length batches: ``cuflash.attention_varlen`` and ``attention_varlen_backward``
(flash-attn's ``flash_attn_varlen_func``). Argument checks, the plan (cuflash/plan, with the
MOD_VARLEN bit) and the launches of the forward and backward kernels in their varlen form
(cuda_src/varlen.cuh: a tile scheduler over the real (sequence, tile) pairs).

Layout: q (total_q, nheads, headdim), k / v (total_k, nheads_kv, headdim); sequence b is the rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v
(int32 prefix sums on the device, batch + 1 values). Each sequence is attended on its own, with
causal and windows aligned bottom-right per sequence. lse is (nheads, total_q).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import backward, checks, forward, jit, launch, plan, prepared_calls, variants
from .params import BWD_PACKER, FWD_PACKER, walk_fields

#: Most sequences in one packed batch (the device-side search of varlen.cuh counts in int32 powers of 32).
MAX_SEQUENCES = 2**24


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                     dropout_p: float = 0.0, rng_state=None, seqused_k=None, block_table=None, return_lse: bool = False,
                     out=None, check: bool = False):  # fmt: skip
    """Exact attention of each packed sequence on its own, with FlashAttention-2 on CuPy arrays.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); float16 or bfloat16, one
    dtype, one device, a contiguous last dimension; nheads % nheads_kv == 0; headdim 1..256.
    cu_seqlens_q, cu_seqlens_k: int32 CuPy arrays (batch + 1,) of non-decreasing prefix sums, from 0;
    sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and k / v rows [cu_seqlens_k[b],
    cu_seqlens_k[b + 1]). Zero-length sequences are allowed (a query with no key gets 0, lse -inf).
    max_seqlen_q, max_seqlen_k: the longest sequence of each (flash-attn's arguments; any value >=
    the real maximum is right, and check=True verifies them). A max_seqlen_k within
    plan.SHORT_KEYS for the head dim lets the Hopper forward take its short-key tile (cuflash/plan/forward.py).
    seqused_k: optional int32 CuPy array (batch,): sequence b uses only its first seqused_k[b] keys.
    block_table: paged K/V (chunked prefill against a paged KV cache): k, v are then (num_pages,
    page_size, nheads_kv, headdim) with page_size a multiple of 128, block_table int32 (batch,
    max_pages) (CuPy, or host ints), and key j of sequence b lives in page block_table[b, j //
    page_size], slot j % page_size; sequence b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (or
    seqused_k[b]). A host block_table is validated against those lengths (read back: one
    synchronization); a CuPy one with check=True. Forward only (the backward takes packed k, v).
    causal, softmax_scale, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads)),
    dropout_p, rng_state: as ``cuflash.attention``, per sequence (sequence b is batch index b of
    ALiBi and of the dropout stream).
    check: copy cu_seqlens (and seqused_k) to the host and validate them (a synchronization); without
    it wrong prefix sums give wrong numbers, never an access outside q, k, v, out.
    out: optional output (shape and dtype of q). Rows of q past cu_seqlens_q[-1] belong to no
    sequence: their out rows are not written.

    Returns out; (out, lse) with return_lse (lse float32 (nheads, total_q), natural log); with
    dropout_p > 0 the rng_state last, as ``cuflash.attention``.
    """
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
               dropout_p=dropout_p, rng_state=rng_state, seqused_k=seqused_k, block_table=block_table,
               return_lse=return_lse, out=out, check=check)  # fmt: skip


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, softmax_scale=None,
        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None, seqused_k=None,
        block_table=None, return_lse=False, out=None, check=False,
        tile: plan.Tile | plan.Sm90Tile | None = None):  # fmt: skip
    """``attention_varlen`` with a forced tile (a plan.Tile runs the mma.sync kernel, a plan.Sm90Tile the
    Hopper one); for tests and tuning. tile=None is exactly ``attention_varlen``."""
    cupy = checks.cupy_module()
    # A signature seen before (_signature): only the pointers are looked at (forward.py's prepared path).
    key = None if tile is not None else _signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                                                   seqused_k, block_table, out, check, cupy.ndarray, forward._desc)  # fmt: skip
    prep = prepared(key)
    if prep is not None:
        with cupy.cuda.Device(key[0][0][3]):
            o = cupy.empty(q.shape, dtype=q.dtype) if out is None else out
            lse = cupy.empty(prep.lse_shape, dtype=cupy.float32)
            used = 0 if seqused_k is None else seqused_k.data.ptr
            if forward.run_prepared(prep, cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr,
                                    o.data.ptr, lse.data.ptr, (cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr, used),
                                    _plan_and_load):  # fmt: skip
                return (o, lse) if return_lse else o
        # (else the whole way: pointers off the planned load path, or a changed plan memo)
    g = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, check, cupy,
                      block_table=block_table)  # fmt: skip
    softmax_scale = checks.resolve_scale(softmax_scale, g.head_dim)
    var = variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, rng_state=rng_state, batch=g.batch, nheads=g.nheads,
                           seqlen_q=g.total_q, seqlen_k=g.keys_bound, device_id=g.device_id, cupy=cupy)  # fmt: skip

    def result(out, lse):
        res = (out, lse) if return_lse else (out,)
        if var.rng_state is not None:
            res += (var.rng_state,)
        return res if len(res) > 1 else out

    with cupy.cuda.Device(g.device_id):
        out = checks.output_like(out, q, g.device_id, cupy)
        lse = cupy.empty((g.nheads, g.total_q), dtype=cupy.float32)
        if g.batch == 0 or g.total_q == 0 or g.nheads == 0 or g.head_dim == 0:
            return result(out, lse)
        q4, o4 = q[None], out[None]  # (1, total, heads, d): the 4-D strides helpers
        k4, v4 = (k, v) if g.paged else (k[None], v[None])  # paged: (pages, page_size, heads, d)
        aligned = g.head_dim % 8 == 0 and all(checks.aligned16(x) for x in (q4, k4, v4, o4))
        dtype = checks.DTYPE_NAMES[q.dtype]
        keys_hint = plan.short_keys_hint(max_seqlen_k)  # (longer keys share a plan-cache entry)
        plan_args = (g.batch, g.total_q, g.walk_keys, g.nheads, g.nheads_kv, g.head_dim, dtype, var.causal, aligned,
                     g.device_id, var.mods)  # fmt: skip
        how, fn, maps = forward.load_with_maps(lambda t: _plan_and_load(*plan_args, t, keys_hint, g.paged),
                                               q4, k4, v4, o4, dtype, tile)  # fmt: skip
        if g.paged and k.shape[1] % how.spec.tile.block_n:
            raise ValueError(f"page size {k.shape[1]} is not a multiple of the key tile ({how.spec.tile.block_n} keys) "
                             f"of tile {how.spec.tile} (the planner fits its own tiles to pages: pass tile=None)")  # fmt: skip
        unit = var.unit_scale(softmax_scale)
        qs, ks, vs, os_ = (checks.elem_strides(x) for x in (q4, k4, v4, o4))
        fields = dict(
            q_batch_stride=0, q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0] if g.paged else 0, k_row_stride=ks[1], k_head_stride=ks[2],  # (paged: page stride)
            v_batch_stride=vs[0] if g.paged else 0, v_row_stride=vs[1], v_head_stride=vs[2],
            o_batch_stride=0, o_row_stride=os_[1], o_head_stride=os_[2],
            batch=g.batch, nheads=g.nheads, nheads_kv=g.nheads_kv, head_ratio=g.nheads // g.nheads_kv,
            seqlen_q=g.total_q, seqlen_k=g.total_k, head_dim=g.head_dim, num_m_blocks=how.m_blocks,
            sched_group=how.sched_group, **walk_fields(how.walk),
            softmax_scale=unit, scale_log2=unit * math.log2(math.e),
        )  # fmt: skip
        record = maps + FWD_PACKER.pack(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
                                        mod=var.record(softmax_scale, *g.pointers, paged=g.paged_record), **fields)  # fmt: skip
        launch.launch_record(fn, how, record, cupy.cuda.get_current_stream().ptr)
        # Kept for the signature's next calls (as forward.run keeps its own): the plan the planner made, for
        # pointers on the 16-byte rows the head dim and strides allow.
        if key is not None and aligned == (g.head_dim % 8 == 0 and all(
                checks.rows_aligned16(0, x.shape, x.strides) for x in (q4, k4, v4, o4))) \
                and how is _plan_and_load(*plan_args, None, keys_hint, False)[0]:  # fmt: skip
            _PREPARED.room()[key] = forward.preparation(
                plan_args + (None, keys_hint, False), how, fn,
                FWD_PACKER.pack(q=0, k=0, v=0, o=0, lse=0, mod=var.record(softmax_scale), **fields), dtype,
                (q4, k4, v4, o4), bool(maps), aligned, (g.nheads, g.total_q))  # fmt: skip
    return result(out, lse)


# The prepared path of the packed forward: forward.py's (_Prepared, run_prepared), keyed by the varlen
# arguments too. The prefix sums' values are never looked at on the host without check=True or a host
# block table (both excluded), so their arrays' descriptions are all a signature needs of them; of the
# max_seqlen ints only max_seqlen_k's short-key hint reaches the plan (max_seqlen_q is only checked). So it
# serves calls that repeat their shapes (the number of sequences, the token totals): a loop whose packing
# changes the number of sequences from batch to batch takes the whole way each time.
_PREPARED = prepared_calls.PreparedCalls(limit=256)


def prepared(key) -> forward._Prepared | None:
    """The preparation of a packed call signature (_signature) that an earlier call in this thread made, or None."""
    return None if key is None else _PREPARED.calls.get(key)


def _signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
               softcap, alibi_slopes, dropout_p, seqused_k, block_table, out, check, nd, desc) -> tuple | None:  # fmt: skip
    """The key under which a packed call's checks and plan are kept: forward._signature's (``nd`` the array
    type, ``desc`` an array's description, as there), with the prefix sums' and seqused_k's descriptions and
    plan.short_keys_hint(max_seqlen_k) (what the plan takes of the max_seqlen ints; both must be ints >= 0,
    the whole way's check). None where the call takes the whole way every time: check=True (it reads the
    prefix sums), paged K/V (a block table the host may read), and forward._signature's cases (ALiBi,
    dropout, arguments of other types)."""
    if check is not False or block_table is not None or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int \
            or max_seqlen_q < 0 or max_seqlen_k < 0:  # fmt: skip
        return None
    base = forward._signature(nd, desc, q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                              0, out)  # fmt: skip
    if base is None or type(cu_seqlens_q) is not nd or type(cu_seqlens_k) is not nd:
        return None
    if seqused_k is not None and type(seqused_k) is not nd:
        return None
    cq, ck, used = desc(cu_seqlens_q), desc(cu_seqlens_k), None if seqused_k is None else desc(seqused_k)
    if cq is None or ck is None or (seqused_k is not None and used is None):
        return None
    return base, cq, ck, used, plan.short_keys_hint(max_seqlen_k)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                              *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                              softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, rng_state=None,
                              seqused_k=None, deterministic: bool = False, dq=None, dk=None, dv=None,
                              check: bool = False):  # fmt: skip
    """Gradients (dq, dk, dv) of ``out = attention_varlen(q, k, v, ...)`` given ``dout``.

    dout, out: like q; lse: the forward's (nheads, total_q) float32. Every other argument is the
    forward's (rng_state: the one it returned, with dropout). deterministic, dq, dk, dv: as
    ``cuflash.attention_backward``; deterministic=True also validates the prefix sums on the host as
    check=True does (one synchronization: its ordered dQ additions rely on them). Rows that belong to
    no sequence are not written; with seqused_k, the dk, dv rows of the keys a sequence does not use
    are 0.
    """
    return run_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        dropout_p=dropout_p, rng_state=rng_state, seqused_k=seqused_k, deterministic=deterministic,
                        dq=dq, dk=dk, dv=dv, check=check)  # fmt: skip


def run_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                 softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                 rng_state=None, seqused_k=None, deterministic=False, dq=None, dk=None, dv=None, check=False,
                 tile: plan.BwdTile | plan.BwdSm90Tile | plan.BwdSm90WsTile | None = None):  # fmt: skip
    """``attention_varlen_backward`` with a forced main-kernel tile (as cuflash.backward.run); for tests."""
    cupy = checks.cupy_module()
    # Deterministic mode always validates the prefix sums on the host (one synchronization): with a
    # decreasing cu_seqlens two sequences could share a query block's turn counter, or a key block that
    # should add before it could have no CTA, and the ordered dQ additions would wait forever.
    g = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                      check or bool(deterministic), cupy)  # fmt: skip
    softmax_scale = checks.resolve_scale(softmax_scale, g.head_dim)
    checks.check_like("dout", dout, "q", q, g.device_id, cupy)
    checks.check_like("out", out, "q", q, g.device_id, cupy)
    checks.check_lse(lse, (g.nheads, g.total_q), g.device_id, cupy, layout="(nheads, total_q)",
                     forward="cuflash.attention_varlen")  # fmt: skip
    var = variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, rng_state=rng_state, batch=g.batch, nheads=g.nheads,
                           seqlen_q=g.total_q, seqlen_k=g.total_k, device_id=g.device_id, cupy=cupy,
                           new_rng_state=False)  # fmt: skip

    with cupy.cuda.Device(g.device_id):
        dq, dk, dv = (checks.output_like(given, like, g.device_id, cupy, name, name[1:])
                      for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)))  # fmt: skip
        grads = (dq, dk, dv)
        if g.batch == 0 or g.nheads == 0 or g.head_dim == 0 or g.total_q == 0:
            if g.total_k:  # no query: the keys get no gradient
                dk.fill(0)
                dv.fill(0)
            return grads
        if seqused_k is not None:  # the keys past seqused_k get no gradient and no CTA writes them
            dk.fill(0)
            dv.fill(0)
        arrays = {"q": q, "k": k, "v": v, "o": out, "do": dout, "dq": dq, "dk": dk, "dv": dv}
        four = {name: x[None] for name, x in arrays.items()}
        aligned = g.head_dim % 8 == 0 and all(checks.aligned16(x) for x in four.values())
        dtype = checks.DTYPE_NAMES[q.dtype]
        bp, fns, maps = backward.load_with_maps(
            lambda t: _plan_and_load_bwd(g.batch, g.total_q, g.total_k, g.nheads, g.nheads_kv, g.head_dim, dtype,
                                         var.causal, aligned, g.device_id, bool(deterministic), var.mods, t),
            four["q"], four["k"], four["v"], four["do"], dtype, tile, bool(deterministic))  # fmt: skip
        main_tile = bp.main.spec.tile
        dq_tile = main_tile.warp_tiles(bp.dq_accum_cols)["dq"]
        rows = (1, g.nheads, bp.seqlen_q_pad)
        lse_log2 = cupy.empty(rows, dtype=cupy.float32)
        dsum = cupy.empty(rows, dtype=cupy.float32)
        dq_accum = cupy.empty(rows + (bp.dq_accum_cols,), dtype=cupy.float32)  # (zeroed by the preprocess kernel)
        dq_turn = cupy.zeros((1, g.nheads, bp.num_m_blocks), dtype=cupy.int32) if deterministic else None
        strides = {}
        for name, x in four.items():
            _, row, head = checks.elem_strides(x)
            strides.update({f"{name}_batch_stride": 0, f"{name}_row_stride": row, f"{name}_head_stride": head})
        record = BWD_PACKER.pack(
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, dout=dout.data.ptr, lse=lse.data.ptr,
            dq=dq.data.ptr, dk=dk.data.ptr, dv=dv.data.ptr, lse_log2=lse_log2.data.ptr, dsum=dsum.data.ptr,
            dq_accum=dq_accum.data.ptr, dq_turn=dq_turn.data.ptr if deterministic else 0, item_counter=0,
            **strides,
            batch=g.batch, nheads=g.nheads, nheads_kv=g.nheads_kv, head_ratio=g.nheads // g.nheads_kv,
            seqlen_q=g.total_q, seqlen_k=g.total_k, head_dim=g.head_dim, seqlen_q_pad=bp.seqlen_q_pad,
            dq_accum_cols=bp.dq_accum_cols, num_m_blocks=bp.num_m_blocks, deterministic=int(bool(deterministic)),
            block_m=main_tile.block_m, dq_q_warps=main_tile.dq_q_warps, dq_tile_rows=dq_tile[0], dq_tile_cols=dq_tile[1],
            pre_rows_per_warp=bp.pre_rows_per_warp,
            softmax_scale=softmax_scale, scale_log2=var.unit_scale(softmax_scale) * math.log2(math.e),
            mod=var.record(softmax_scale, *g.pointers),
        )  # fmt: skip
        stream = cupy.cuda.get_current_stream().ptr
        launch.launch_record(fns[0], bp.pre, record, stream)
        launch.launch_record(fns[1], bp.main, maps + record, stream)
        launch.launch_record(fns[2], bp.convert, record, stream)
    return grads


class _Geometry:
    """What the checks found: sizes, q's device and the varlen pointers (cu_seqlens_q, cu_seqlens_k, seqused_k)."""

    __slots__ = ("batch", "total_q", "total_k", "nheads", "nheads_kv", "head_dim", "device_id", "pointers", "paged",
                 "keys_bound", "walk_keys", "paged_record", "block_table_dev")  # fmt: skip


def _geometry3(name: str, x, cupy) -> tuple:
    """x: a 3-D (total, heads, headdim) float16 / bfloat16 CuPy array contiguous in its last dim."""
    if isinstance(x, cupy.ndarray) and x.ndim != 3:
        raise ValueError(f"{name} must be 3-D (total_tokens, nheads, headdim) for varlen, got shape {x.shape}")
    return checks.geometry(name, x[None] if isinstance(x, cupy.ndarray) else x, cupy)


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, check, cupy,
                  block_table=None) -> _Geometry:  # fmt: skip
    paged = block_table is not None
    _geometry3("q", q, cupy)
    for name, x in (("k", k), ("v", v)):
        if paged:
            checks.geometry(name, x, cupy)  # (num_pages, page_size, nheads_kv, headdim)
        else:
            _geometry3(name, x, cupy)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    total_q, nheads, head_dim = q.shape
    if paged:
        num_pages, page_size, nheads_kv, head_dim_k = k.shape
        total_k = num_pages * page_size
        if page_size < 1 or page_size % plan.PAGE_KEYS:  # (plan.fit_key_tile keeps paged key tiles within a page)
            raise ValueError(f"page size (k.shape[1] with block_table) must be a positive multiple of {plan.PAGE_KEYS} "
                             f"(every key tile stays in one page), got {page_size}")  # fmt: skip
    else:
        total_k, nheads_kv, head_dim_k = k.shape
    if head_dim_k != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {head_dim_k}")
    checks.check_head_dim(head_dim)
    checks.check_head_ratio(nheads, nheads_kv, allow_no_heads=True)
    device_id = q.device.id
    checks.check_on_device(device_id, (("k", k), ("v", v)))
    if nheads > checks.MAX_GRID_YZ:
        raise ValueError(f"nheads must be at most {checks.MAX_GRID_YZ}, got {nheads}")
    if max(total_q, total_k) > checks.INT32_MAX:
        raise ValueError(f"at most {checks.INT32_MAX} packed tokens, got total_q {total_q}, total_k {total_k}")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_cu(name, x, device_id, cupy)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 values, got {cu_seqlens_q.shape[0]} "
                         f"and {cu_seqlens_k.shape[0]}")  # fmt: skip
    batch = cu_seqlens_q.shape[0] - 1
    if batch > MAX_SEQUENCES:
        raise ValueError(f"at most {MAX_SEQUENCES} sequences per packed batch, got {batch}")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not checks.is_int(x) or x < 0:
            raise ValueError(f"{name} must be an int >= 0 (the longest sequence), got {x!r}")
    if seqused_k is not None:
        if not isinstance(seqused_k, cupy.ndarray):
            raise TypeError(f"seqused_k must be an int32 cupy.ndarray (batch,) on q's device, got {type(seqused_k).__name__}")
        checks.check_device_int32("seqused_k", seqused_k, (batch,), device_id)
    g = _Geometry()
    g.paged, g.paged_record, g.block_table_dev = paged, (0, 0, 0, 0, 0), None
    keys_bound = total_k  # the most keys a sequence can have
    walk_keys = total_k  # the most keys one head's walk reads, all sequences together (sizes the L2 groups)
    if paged:
        bt_host, bt_dev = checks.block_table_arrays(block_table, batch, device_id, cupy)
        capacity = bt_dev.shape[1] * page_size
        if capacity > checks.INT32_MAX:
            raise ValueError(f"block_table covers {capacity} tokens per sequence; at most {checks.INT32_MAX}")
        keys_bound = capacity
        walk_keys = min(batch * capacity, num_pages * page_size)  # (per head: every sequence's pages, within the cache)
        # cu_seqlens_k then count each sequence's keys; the kernels clamp them to the capacity, never to a total.
        total_k = checks.INT32_MAX
        if bt_host is not None or check:  # a table the host can see is validated against the lengths
            lengths = _validate(cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k, int(max_seqlen_q),
                                int(max_seqlen_k), check_q=check)  # fmt: skip
            over = np.flatnonzero(lengths > capacity)
            if over.size:
                b = int(over[0])
                raise ValueError(f"sequence {b} has {int(lengths[b])} keys, more than its block_table row holds "
                                 f"({bt_dev.shape[1]} pages x {page_size})")  # fmt: skip
            checks.validate_block_table(bt_host if bt_host is not None else bt_dev.get(), lengths, page_size, num_pages)
        g.paged_record = (bt_dev.data.ptr, bt_dev.strides[0] // bt_dev.itemsize, page_size, num_pages, capacity)
        g.block_table_dev = bt_dev  # (kept alive for the launch)
    elif check:
        _validate(cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k))
    g.batch, g.total_q, g.total_k, g.nheads, g.nheads_kv, g.head_dim, g.device_id = (
        batch, total_q, total_k, nheads, nheads_kv, head_dim, device_id)  # fmt: skip
    g.keys_bound, g.walk_keys = keys_bound, walk_keys
    g.pointers = (cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr, 0 if seqused_k is None else seqused_k.data.ptr)
    return g


def _check_cu(name: str, x, device_id: int, cupy) -> None:
    if not isinstance(x, cupy.ndarray):
        hint = " (move it to the GPU with cupy.asarray(..., dtype=cupy.int32))" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name} must be an int32 cupy.ndarray on q's device, got {type(x).__name__}{hint}")
    if x.ndim != 1 or x.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 values (prefix sums from 0), got shape {x.shape}")
    checks.check_device_int32(name, x, x.shape, device_id)


def validate_cu_seqlens(name: str, cu: np.ndarray, total: int, max_seqlen: int | None = None) -> np.ndarray:
    """Host copy of a cu_seqlens array: starts at 0, never decreases, ends within the packed total
    (and no sequence longer than max_seqlen); returns the lengths. ValueError naming the first bad entry."""
    cu = np.asarray(cu, dtype=np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0 (prefix sums start at 0), got {int(cu[0])}")
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name} must not decrease: {name}[{b + 1}] = {int(cu[b + 1])} < {name}[{b}] = {int(cu[b])}")
    if cu[-1] > total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the {total} packed rows of the tensor it indexes")
    if max_seqlen is not None and lengths.size and lengths.max() > max_seqlen:
        b = int(np.argmax(lengths))
        which = name.replace("cu_seqlens", "max_seqlen")
        raise ValueError(f"sequence {b} has {int(lengths[b])} rows in {name}, more than {which} = {max_seqlen}")
    return lengths


def _validate(cu_q, cu_k, seqused_k, total_q: int, total_k: int, max_q: int, max_k: int, check_q: bool = True):
    """Validate the prefix sums (and seqused_k) on the host; returns the keys each sequence uses."""
    if check_q:
        validate_cu_seqlens("cu_seqlens_q", cu_q.get(), total_q, max_q)
    lengths_k = validate_cu_seqlens("cu_seqlens_k", cu_k.get(), total_k, max_k)
    if seqused_k is not None:
        used = seqused_k.get().astype(np.int64)
        bad = np.flatnonzero((used < 0) | (used > lengths_k))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"seqused_k[{b}] = {int(used[b])} must be in [0, {int(lengths_k[b])}] (sequence {b}'s keys)")
        return used
    return lengths_k


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, total_q, total_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id, mods,
                   tile=None, max_seqlen_k=None, paged=False):  # fmt: skip
    how = plan.plan_forward(
        batch=batch, seqlen_q=total_q, seqlen_k=total_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), tile=tile,
        mods=mods | plan.MOD_VARLEN, sm_count=jit.device_sm_count(device_id), l2_bytes=jit.device_l2_bytes(device_id),
        max_seqlen_k=max_seqlen_k, paged=paged,
    )  # fmt: skip
    return how, jit.get_function(how.spec, device_id)


@functools.lru_cache(maxsize=1024)
def _plan_and_load_bwd(batch, total_q, total_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id,
                       deterministic, mods, tile=None):  # fmt: skip
    bp = plan.plan_backward(
        batch=batch, seqlen_q=total_q, seqlen_k=total_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), deterministic=deterministic,
        tile=tile, mods=mods | plan.MOD_VARLEN,
    )  # fmt: skip
    return bp, tuple(jit.get_function(how.spec, device_id) for how in (bp.pre, bp.main, bp.convert))
