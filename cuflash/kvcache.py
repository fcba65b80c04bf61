"""Decode with a KV cache: ``attention_with_kvcache`` (flash-attn's ``flash_attn_with_kvcache``).

Checks happen here, once, with messages that say what to do (cuflash/checks.py); the plan is
cuflash/plan/decode.py, the kernels cuda_src/flash_decode*.cuh. The kernels assume their
preconditions, except that they clamp every length and page index they read from device memory, so
no value of ``cache_seqlens`` / ``block_table`` can make them touch memory outside the caches.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import struct
import threading

import numpy as np

from . import checks, jit, launch, plan, prepared_calls, variants
from .checks import INT32_MAX
from .params import DECODE_PACKER, ROTARY_PACKER

_LOG2_E = math.log2(math.e)

#: The pointer fields that open DecodeParams (q .. block_table) and the length of a one-length call
#: (seqlen_const): all of a record that changes from one call of a signature to the next (_run).
_PTR_FIELDS = ("q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "split_counters", "seqlens",
               "block_table")  # fmt: skip
_PTRS = struct.Struct("<" + "Q" * len(_PTR_FIELDS))
_SEQLEN_CONST = struct.Struct("<i")
_SEQLEN_CONST_OFFSET = DECODE_PACKER.offset("seqlen_const")
assert DECODE_PACKER.names[: len(_PTR_FIELDS)] == _PTR_FIELDS and DECODE_PACKER.offset("q") == 0 \
    and all(DECODE_PACKER.dtype.fields[n][0] == np.uint64 for n in _PTR_FIELDS), \
    "DecodeParams no longer opens with the pointers"  # fmt: skip
assert DECODE_PACKER.dtype.fields["seqlen_const"][0] == np.int32

#: This thread's launch buffer (the driver copies the bytes at launch; one buffer serves every launch).
_ARGS = launch.ARGS
assert DECODE_PACKER.size <= len(_ARGS.buf)


@dataclasses.dataclass(frozen=True, slots=True)
class _Prepared:
    """What the checks and the plan make of one call signature (_signature): the plan's arguments, the
    plan and kernels they gave, the DecodeParams record with its pointers and seqlen_const left 0,
    and what a call still needs."""

    plan_args: tuple  # _plan_and_load's arguments
    dplan: plan.DecodePlan
    fns: tuple  # loaded (attention, append, combine) kernels; None where the plan has no such launch
    record: bytes  # DecodeParams with the pointers and seqlen_const 0 (patched per call, _run)
    attend: bool  # there are query rows (else only the append runs)
    lse_shape: tuple
    capacity: int  # tokens a sequence can hold
    seqlen_new: int
    strides16: bool  # every row of q, the caches and out 16-byte aligned by its strides (pointers per call)
    new_strides16: bool  # ... and of the new tokens k, v
    aligned: bool  # the attention's 16-byte load path was planned
    append_aligned: bool  # the append's 16-byte path was planned
    ws_floats: int  # fp32 elements of the split workspace (partial rows and their lse)
    ws_counters: int  # split counters of the in-kernel merge
    lse_offset: int  # bytes from the partial rows to their lse in the workspace
    merge_in_kernel: bool  # the split kernel merges (else the combine kernel)


_PREPARED = prepared_calls.PreparedCalls(limit=256)  # signatures kept per thread (a serving loop has a handful)
_desc = prepared_calls.desc


def _signature(nd, desc, q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
               return_lse, out, check, policy, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):  # fmt: skip
    """The key under which a call's checks and plan are kept (_Prepared): everything they depend on but
    the pointers and, for one length for all, the length itself (only its 64-token step, which the
    plan sees). None where the call takes the whole way every time: lengths or a block table on the
    host (their values are checked per call), check=True, or arguments of other types (the whole way
    then raises the errors). A decode loop's repeated call skips re-checking what cannot have changed:
    the host time of a step is latency, and on the H200 the checks, the plan lookup and the packing
    of the record took more of it than the launch. ALiBi slopes (a device pointer in the record) take
    the whole way too. ``nd`` is the array type the call's arrays must be and ``desc`` gives an array's
    (shape, strides in bytes, NumPy dtype, device): CuPy's (_desc) here, torch's in cuflash.torch, so a
    torch call finds the preparation its first call made through the CuPy API."""
    if check or type(num_splits) is not int or policy is not None and type(policy) is not plan.DecodePolicy:
        return None
    if alibi_slopes is not None or type(window_size) is not tuple or type(softcap) not in (int, float):
        return None
    if type(q) is not nd or type(k_cache) is not nd or type(v_cache) is not nd:
        return None
    if softmax_scale is not None and type(softmax_scale) is not float:
        return None
    # (desc gives None for an array only the whole way takes: a torch tensor that to_cupy would copy)
    qd, kd, vd = desc(q), desc(k_cache), desc(v_cache)
    if qd is None or kd is None or vd is None:
        return None
    # Every optional array has its slot (None when absent): a paged call and a call whose out happens to look
    # like a block table must not share a key.
    kn = vn = od = bd = None
    new = 0
    if k is not None or v is not None:
        if type(k) is not nd or type(v) is not nd:
            return None
        kn, vn = desc(k), desc(v)
        if kn is None or vn is None:
            return None
        new = kn[0][1] if len(kn[0]) == 4 else 0
    if out is not None:
        if type(out) is not nd or (od := desc(out)) is None:
            return None
    capacity = kd[0][1] if len(kd[0]) == 4 else 0
    if block_table is not None:
        if type(block_table) is not nd or (bd := desc(block_table)) is None:
            return None
        capacity *= bd[0][1] if len(bd[0]) == 2 else 0
    key = [qd, kd, vd, kn, vn, od, bd, bool(causal), softmax_scale, num_splits, bool(return_lse), policy, window_size,
           softcap]
    if cache_seqlens is None:
        key.append(None)
    elif type(cache_seqlens) is int:
        if not 0 <= cache_seqlens <= capacity - new:
            return None  # the whole way raises the error
        key.append(-(-min(cache_seqlens + new, capacity) // 64) * 64)  # the plan's step of the length
    elif type(cache_seqlens) is nd and (ld := desc(cache_seqlens)) is not None:
        key.append(ld)
    else:
        return None
    return tuple(key)


def _run(prep: _Prepared, cupy, device_id: int, q_ptr: int, k_ptr: int, v_ptr: int, kn_ptr: int, vn_ptr: int, out, lse,
         seqlens_dev, bt_dev, seqlen_const: int, return_lse: bool):  # fmt: skip
    """The launches of a prepared call (device_id current): the record with this call's pointers and
    length, the split workspace of this stream."""
    stream = cupy.cuda.get_current_stream().ptr
    o_partial_ptr = counters_ptr = 0
    if prep.ws_floats:
        if cupy.cuda.runtime.streamIsCapturing(stream):
            # A CUDA graph keeps this call's pointers: it gets a workspace of its own (its counters'
            # zero-fill captured with it), never the stream's shared one, which a later call may grow
            # and free, and which another graph captured on the same stream would share. It is kept
            # alive with the others (_CAPTURED): CuPy's pool would hand a freed block out again while
            # the graph still writes it.
            partials = cupy.empty(prep.ws_floats, dtype=cupy.float32)
            counters = cupy.zeros(prep.ws_counters, dtype=cupy.int32)
            with _WORKSPACE_LOCK:
                _CAPTURED.append((partials, counters))
        else:
            partials, counters = _workspace(cupy, device_id, stream, prep.ws_floats, prep.ws_counters)
        o_partial_ptr = partials.data.ptr
        counters_ptr = counters.data.ptr
    _launch(prep, stream, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
            0 if seqlens_dev is None else seqlens_dev.data.ptr, 0 if bt_dev is None else bt_dev.data.ptr, seqlen_const,
            o_partial_ptr, counters_ptr)  # fmt: skip
    return (out, lse) if return_lse else out


def _launch(prep: _Prepared, stream: int, q_ptr: int, k_ptr: int, v_ptr: int, kn_ptr: int, vn_ptr: int, o_ptr: int,
            lse_ptr: int, seqlens_ptr: int, bt_ptr: int, seqlen_const: int, o_partial_ptr: int, counters_ptr: int):  # fmt: skip
    """Patch the prepared record with a call's pointers and length and launch its kernels on ``stream``
    (the device current; o_partial_ptr: the split workspace's partial rows, or 0 without splits)."""
    dplan = prep.dplan
    fn_attn, fn_append, fn_combine = prep.fns
    lse_partial_ptr = o_partial_ptr + prep.lse_offset if o_partial_ptr else 0  # bucket % 32 == 0: 128-byte aligned
    counters_ptr = counters_ptr if prep.merge_in_kernel else 0
    args = _ARGS
    buf = args.buf
    ctypes.memmove(buf, prep.record, len(prep.record))
    _PTRS.pack_into(buf, 0, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr, o_partial_ptr, lse_partial_ptr,
                    counters_ptr, seqlens_ptr, bt_ptr)  # fmt: skip
    _SEQLEN_CONST.pack_into(buf, _SEQLEN_CONST_OFFSET, seqlen_const)
    if dplan.append is not None:  # the attention below reads the new tokens (same stream)
        launch.launch(fn_append, dplan.append, args.argv_ptr, stream)
    if prep.attend:
        launch.launch(fn_attn, dplan.attn, args.argv_ptr, stream)
        if dplan.combine is not None:
            launch.launch(fn_combine, dplan.combine, args.argv_ptr, stream)


def _usable(prep: _Prepared, q_ptr: int, k_ptr: int, v_ptr: int, kn_ptr: int, vn_ptr: int, o_ptr: int) -> bool:
    """Whether a prepared call serves a call with these pointers: they agree with the load paths planned
    (16-byte loads where every row was aligned) and the plan memo still gives the same plan and kernels (a
    cleared or swapped memo, as tests and tools do, plans again)."""
    return (prep.aligned == (prep.strides16 and not (q_ptr | k_ptr | v_ptr | o_ptr) & 15)
            and prep.append_aligned == (prep.new_strides16 and not (k_ptr | v_ptr | kn_ptr | vn_ptr) & 15)
            and (got := _plan_and_load(*prep.plan_args))[0] is prep.dplan and got[1] is prep.fns)  # fmt: skip


def prepared(key) -> _Prepared | None:
    """The preparation of a call signature (_signature) that an earlier call in this thread made, or None."""
    return None if key is None else _PREPARED.calls.get(key)


def run_prepared(prep: _Prepared, device_id: int, stream: int, q_ptr: int, k_ptr: int, v_ptr: int, kn_ptr: int,
                 vn_ptr: int, o_ptr: int, lse_ptr: int, seqlens_ptr: int, bt_ptr: int, seqlen_const: int) -> bool:  # fmt: skip
    """A prepared call by pointers, for callers that hold no CuPy arrays (cuflash.torch's decode step):
    device_id current, ``stream`` a stream handle, out and lse allocated by the caller (q's shape,
    contiguous; prep.lse_shape, float32), ``seqlen_const`` the one length for all (0 with lengths on the
    device, the capacity for full caches). Returns False, having launched nothing, where the call must
    take the whole way (attention_with_kvcache): pointers off the planned load path, a changed plan memo,
    or a split workspace this stream does not have yet (the whole way allocates it from the caller's
    allocator) or cannot share (the stream is capturing a CUDA graph)."""
    if prep.seqlen_new <= 0:
        kn_ptr = vn_ptr = 0
    if not _usable(prep, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr):
        return False
    o_partial_ptr = counters_ptr = 0
    if prep.ws_floats:
        ws = _WORKSPACES.get(_workspace_key(device_id, stream))
        if not _fits(ws, prep.ws_floats, prep.ws_counters):
            return False
        if checks.cupy_module().cuda.runtime.streamIsCapturing(stream):
            return False
        o_partial_ptr, counters_ptr = ws[0].data.ptr, ws[1].data.ptr
    _launch(prep, stream, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr, seqlens_ptr, bt_ptr, seqlen_const,
            o_partial_ptr, counters_ptr)  # fmt: skip
    return True


#: Scratch of the split path per stream (_workspace_key), kept between calls: (fp32 partial rows and
#: lse of the splits, int32 split counters). Calls on one stream run in order, so they can share it;
#: the kernel leaves every counter at 0 when it ends. Grown on demand; free_workspaces() drops them.
_WORKSPACES: dict = {}
#: cudaStreamPerThread: one handle that names a different stream in every host thread.
_PER_THREAD_STREAM = 2


def _workspace_key(device_id: int, stream: int) -> tuple:
    """The key of one stream's workspace: (device, handle), and the thread for the per-thread default
    stream, whose handle is the same in every thread though their streams are not ordered."""
    return device_id, stream, threading.get_ident() if stream == _PER_THREAD_STREAM else 0


def _fits(ws, floats: int, counters: int) -> bool:
    """Whether workspace ``ws`` (or None) holds ``floats`` float32 and ``counters`` int32 elements."""
    return ws is not None and ws[0].size >= floats and ws[1].size >= counters


#: The buffers of calls captured in CUDA graphs (split-KV workspaces, rotated copies), kept until
#: free_workspaces(): a graph replays into them.
_CAPTURED: list = []
_WORKSPACE_LOCK = threading.Lock()


def _workspace(cupy, device_id: int, stream: int, floats: int, counters: int):
    """(partials, counters) of at least ``floats`` float32 and ``counters`` zeroed int32 elements for
    this device and stream (the caller holds the device current)."""
    key = _workspace_key(device_id, stream)
    ws = _WORKSPACES.get(key)
    if not _fits(ws, floats, counters):
        with _WORKSPACE_LOCK:
            old = _WORKSPACES.get(key)
            if old is not None:
                floats, counters = max(floats, old[0].size), max(counters, old[1].size)
            # Allocated on this stream: CuPy's pool reuses the old arrays' blocks only for work on the
            # same stream, ordered after the kernels still reading them; cupy.zeros clears the new
            # counters on this stream before the next kernel.
            ws = (cupy.empty(floats, dtype=cupy.float32), cupy.zeros(counters, dtype=cupy.int32))
            _WORKSPACES[key] = ws
    return ws


def free_workspaces() -> None:
    """Drop the scratch buffers of the split-KV path (per device and stream, and those of calls captured
    in CUDA graphs) back to the pool they came from (CuPy's, or torch's through cuflash.torch). Call it
    only when no captured graph that ran the split path will be replayed again."""
    with _WORKSPACE_LOCK:
        _WORKSPACES.clear()
        _CAPTURED.clear()


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    k=None,
    v=None,
    cache_seqlens=None,
    block_table=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    num_splits: int = 0,
    return_lse: bool = False,
    out=None,
    check: bool = False,
    policy: plan.DecodePolicy | None = None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = False,
    cache_batch_idx=None,
    cache_leftpad=None,
):
    """Attention of a few new query tokens against a KV cache (decode), with flash-attn's semantics.

    q: (batch, seqlen_q, nheads, headdim), seqlen_q small (1 for decode, a few for speculative
    decoding). Caches, float16 or bfloat16 like q, any strides with a contiguous last dimension:
      contiguous: k_cache, v_cache (batch_cache, seqlen_cache, nheads_kv, headdim), batch_cache >= batch;
        sequence b uses cache row b.
      paged: k_cache, v_cache (num_blocks, page_size, nheads_kv, headdim) and block_table int32
        (batch, max_blocks): token t of sequence b lives in page block_table[b, t // page_size], slot
        t % page_size. page_size is any multiple of 16.
    cache_seqlens: tokens already cached per sequence: an int, a sequence / NumPy array of ints, or an
      int32 CuPy array (batch,). None means every cache is full.
    k, v: optional new tokens (batch, seqlen_new, nheads_kv, headdim), written into the caches in
      place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attention;
      sequence b then attends to its first cache_seqlens[b] + seqlen_new tokens. cache_seqlens itself
      is not modified.
    causal: queries aligned to the end: token i sees keys j <= L_b - seqlen_q + i (L_b the attended
      length); a query that sees no key (also every query of an empty sequence) gets 0, lse -inf.
    GQA / MQA: nheads % nheads_kv == 0; query head h reads kv head h // (nheads // nheads_kv), and the
      query heads of one group share a single read of their K/V.
    softmax_scale: defaults to 1 / sqrt(headdim); must be positive.
    window_size, softcap, alibi_slopes: the variants of cuflash.attention, aligned like causal to the
      end of each sequence (query i of sequence b sits at key L_b - seqlen_q + i). With a window the
      splits cover only the keys it holds. (Dropout is a training feature: decode has none.)
    num_splits: key splits per sequence (Flash-Decoding). 0 picks them to fill the GPU
      (cuflash.plan.decode_num_splits); 1 disables splitting; at most 128 and one per 64-key tile.
    return_lse: also return lse, float32 (batch, nheads, seqlen_q), natural log of the softmax sum.
    out: optional output array (shape and dtype of q, last dim contiguous) written in place.
    check: also validate cache_seqlens / block_table given as CuPy arrays (see below).
    policy: tuning only: the decode plan's rules (cuflash.plan.DecodePolicy: split counts, CTAs per SM,
      grids, which kernel merges the splits); None = the defaults, measured best on the H200.

    flash-attn's serving extras:
    rotary_cos, rotary_sin: CuPy arrays of q's dtype (seqlen_ro, rotary_dim / 2), seqlen_ro >= the
      cache capacity: rotary embedding applied to the new k (rotated before it is written to the
      cache) at positions cache_seqlens[b] - cache_leftpad[b] + t, and to q at the same positions when
      causal or windowed, else every query token at cache_seqlens[b] - cache_leftpad[b]. The channels
      from rotary_dim on are not rotated. rotary_interleaved: GPT-J pairs (2i, 2i + 1) instead of
      GPT-NeoX halves (i, i + rotary_dim / 2). q and k are not modified (rotated copies are attended).
    cache_batch_idx: ints (batch,) (host or int32 CuPy): sequence b uses row cache_batch_idx[b] of a
      contiguous cache (not with block_table).
    cache_leftpad: ints (batch,) (host or int32 CuPy): cache positions before cache_leftpad[b] are
      padding, never attended (runs the window kernels).

    Returns out (shape and dtype of q), or (out, lse).

    Validation of lengths and page indices. Values the host can see (an int, a list, a NumPy array)
    are always checked: 0 <= cache_seqlens[b], cache_seqlens[b] + seqlen_new <= capacity (the cache's
    seqlen, or max_blocks * page_size), and the block_table entries a sequence uses lie in
    [0, num_blocks). Values in CuPy arrays live on the GPU: reading them would synchronize the device
    on every decode step, so by default they are not read; check=True reads them (one device
    synchronization) and raises the same errors. Unchecked, the kernels clamp instead: a length into
    [0, capacity], new tokens that would land past the capacity are dropped, a page index into
    [0, num_blocks). Bad values then give wrong numbers for their sequence, never an access outside
    the caches. Shapes, dtypes and devices are always checked.

    Runs on CuPy's current stream and never synchronizes (check=True aside). Launches the append
    kernel (with new tokens) and the split-KV kernel, whose last CTA per sequence and kv head merges
    the splits. With more than one split it uses a scratch buffer per device and stream (partial rows,
    O(splits * batch * nheads * seqlen_q * headdim) floats, and one counter per sequence and kv head),
    kept for the next call; cuflash.kvcache.free_workspaces() releases them. A call with the same
    shapes, strides, dtypes, devices and flags as one before in this thread (a decode loop's next
    step) reuses that call's checks, plan and parameter record: only its pointers and length are
    looked at (_signature), which keeps the host side of a step to ~15-20 us on the H200 machine.
    """
    cupy = checks.cupy_module()
    if rotary_cos is not None or rotary_sin is not None:  # rotate into copies, then attend with those
        q, k = _rotate(cupy, q, k_cache, k, cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved,
                       cache_leftpad, bool(causal) or _windowed(window_size))  # fmt: skip
    extras = cache_batch_idx is not None or cache_leftpad is not None
    # A signature seen before (_signature): only what can change between calls is looked at.
    key = None if extras else _signature(cupy.ndarray, _desc, q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                                         softmax_scale, num_splits, return_lse, out, check, policy, window_size,
                                         softcap, alibi_slopes)  # fmt: skip
    prep = None if key is None else _PREPARED.calls.get(key)
    if prep is not None:
        q_ptr, k_ptr, v_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        kn_ptr, vn_ptr = (k.data.ptr, v.data.ptr) if prep.seqlen_new > 0 else (0, 0)
        device_id = key[0][3]
        with cupy.cuda.Device(device_id):
            if out is None:
                out = cupy.empty(key[0][0], dtype=key[0][2])
            if _usable(prep, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out.data.ptr):  # (else the whole way)
                lse = cupy.empty(prep.lse_shape, dtype=cupy.float32) if return_lse else None
                seqlens_dev = cache_seqlens if type(cache_seqlens) is cupy.ndarray else None
                seqlen_const = prep.capacity if cache_seqlens is None else (0 if seqlens_dev is not None else cache_seqlens)
                return _run(prep, cupy, device_id, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out, lse, seqlens_dev,
                            block_table, seqlen_const, return_lse)  # fmt: skip
    if policy is None:
        policy = plan.DEFAULT_DECODE_POLICY
    elif not isinstance(policy, plan.DecodePolicy):
        raise TypeError(f"policy must be a cuflash.plan.DecodePolicy or None, got {type(policy).__name__}")
    # Every array's shape and strides are read once (checks.geometry): the host time of a decode step counts.
    q_shape, q_strides = checks.geometry("q", q, cupy)
    k_shape, k_strides = checks.geometry("k_cache", k_cache, cupy)
    v_shape, v_strides = checks.geometry("v_cache", v_cache, cupy)
    dtype = q.dtype
    if not (dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch, seqlen_q, nheads, head_dim = q_shape
    if v_shape != k_shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k_shape} and {v_shape}")
    cache_rows, slots, nheads_kv, head_dim_c = k_shape
    if head_dim_c != head_dim:
        raise ValueError(f"q and k_cache must have the same head dim, got {head_dim} and {head_dim_c}")
    if not 1 <= head_dim <= plan.HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim {head_dim} is not supported: cuflash handles head dims 1 to {plan.HEAD_DIM_BUCKETS[-1]}")
    checks.check_head_ratio(nheads, nheads_kv, allow_no_heads=False)
    device_id = q.device.id
    checks.check_on_device(device_id, (("k_cache", k_cache), ("v_cache", v_cache)))

    # Cache layout: capacity = tokens one sequence can hold.
    paged = block_table is not None
    bt_host = bt_dev = None
    if paged:
        page_size = slots
        if page_size < 16 or page_size % 16 != 0:
            raise ValueError(
                f"page size (k_cache.shape[1] of a paged cache) must be a positive multiple of 16, got {page_size}"
            )
        if cache_rows < 1:
            raise ValueError("a paged k_cache needs at least one page (k_cache.shape[0] >= 1)")
        bt_host, bt_dev = checks.block_table_arrays(block_table, batch, device_id, cupy)
        capacity = bt_dev.shape[1] * page_size
    else:
        if cache_rows < batch and cache_batch_idx is None:
            raise ValueError(
                f"k_cache holds {cache_rows} sequences (shape[0]) but q has batch {batch}; sequence b uses cache row b"
            )
        page_size = capacity = slots
    if cache_batch_idx is not None and paged:
        raise ValueError("cache_batch_idx picks rows of a contiguous cache; a paged cache maps sequences with block_table")
    idx_host, idx_dev = _int_array("cache_batch_idx", cache_batch_idx, batch, device_id, cupy, check)
    if idx_host is not None:
        bad = np.flatnonzero((idx_host < 0) | (idx_host >= cache_rows))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_batch_idx[{b}] = {int(idx_host[b])} is not a row of the cache (k_cache has "
                             f"{cache_rows} rows)")  # fmt: skip
    pad_host, pad_dev = _int_array("cache_leftpad", cache_leftpad, batch, device_id, cupy, check)

    # New tokens.
    if (k is None) != (v is None):
        raise ValueError("the new tokens k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        kn_shape, kn_strides = checks.geometry("k", k, cupy)
        vn_shape, vn_strides = checks.geometry("v", v, cupy)
        for name, x in (("k", k), ("v", v)):
            if x.dtype != dtype:
                raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")
            if x.device.id != device_id:
                raise ValueError(f"q is on device {device_id} but {name} is on device {x.device.id}")
        seqlen_new = kn_shape[1]
        want = (batch, seqlen_new, nheads_kv, head_dim)
        if kn_shape != want or vn_shape != want:
            raise ValueError(
                f"new tokens k and v must have shape (batch, seqlen_new, nheads_kv, headdim) = {want}, "
                f"got k {kn_shape} and v {vn_shape}"
            )
    if capacity + seqlen_new > INT32_MAX:
        raise ValueError(f"a sequence can hold at most {INT32_MAX} tokens, got capacity {capacity} + {seqlen_new} new")

    # Lengths: host-visible values are validated; CuPy arrays only with check=True.
    seqlens_dev, seqlen_const, host_lengths = None, 0, None
    if cache_seqlens is None:
        if seqlen_new > 0:
            raise ValueError(
                "cache_seqlens=None means every cache is full, which leaves no room for the new tokens k, v; "
                "pass cache_seqlens (the tokens already cached per sequence)"
            )
        seqlen_const, host_lengths = capacity, np.full(batch, capacity, dtype=np.int64)
    elif isinstance(cache_seqlens, cupy.ndarray):
        checks.check_device_int32("cache_seqlens", cache_seqlens, (batch,), device_id)
        seqlens_dev = cache_seqlens
        if check:
            host_lengths = cache_seqlens.get().astype(np.int64)  # the one synchronization check=True costs
    elif checks.is_int(cache_seqlens):
        seqlen_const = int(cache_seqlens)  # one length for all: a kernel argument, no upload
        if not 0 <= seqlen_const <= capacity - seqlen_new:  # the decode loop's case: no NumPy on the way
            checks.validate_lengths(np.full(max(batch, 1), seqlen_const, dtype=np.int64), seqlen_new, capacity)
    else:
        host_lengths = checks.host_seqlens(cache_seqlens, batch)
    if host_lengths is not None:
        checks.validate_lengths(host_lengths, seqlen_new, capacity)
    if pad_host is not None:
        upper = host_lengths if host_lengths is not None else np.full(batch, seqlen_const if seqlens_dev is None
                                                                      else capacity, dtype=np.int64)  # fmt: skip
        bad = np.flatnonzero((pad_host < 0) | (pad_host > upper))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_leftpad[{b}] = {int(pad_host[b])} must be in [0, cache_seqlens[{b}] = {int(upper[b])}]")
    if cache_seqlens is not None and not isinstance(cache_seqlens, cupy.ndarray) and host_lengths is not None:
        if np.ndim(cache_seqlens) == 0:
            seqlen_const = int(host_lengths[0]) if batch else 0
        else:
            with cupy.cuda.Device(device_id):
                seqlens_dev = cupy.asarray(host_lengths.astype(np.int32))  # validated: fits int32
    if paged and (bt_host is not None or check):
        # A block table the host can see is validated against the lengths, read back from the device
        # where only the device has them (one synchronization, for a table that is uploaded anyway).
        if bt_host is None:
            bt_host = bt_dev.get()
        if host_lengths is not None:
            lengths = host_lengths
        elif seqlens_dev is not None:
            lengths = np.clip(seqlens_dev.get().astype(np.int64), 0, capacity - seqlen_new)  # (unchecked: clamped as the kernels do)
        else:
            lengths = np.full(batch, seqlen_const, dtype=np.int64)
        checks.validate_block_table(bt_host, lengths + seqlen_new, page_size, cache_rows)

    if not checks.is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen to fill the GPU, 1: no split), got {num_splits!r}")
    softmax_scale = checks.resolve_scale(softmax_scale, head_dim)
    var = variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=0.0, rng_state=None, batch=batch, nheads=nheads, seqlen_q=seqlen_q,
                           seqlen_k=capacity, device_id=device_id, cupy=cupy, allow_dropout=False)  # fmt: skip
    if pad_dev is not None and not var.mods & plan.MOD_WINDOW:
        # Left padding is a per-sequence left edge of the keys: the window kernels apply it, with a window
        # open on the left (and causal as its right edge).
        var = dataclasses.replace(var, mods=var.mods | plan.MOD_WINDOW, causal=False,
                                  window=(capacity + seqlen_new, 0 if var.causal else max(seqlen_q, 1)))  # fmt: skip

    with cupy.cuda.Device(device_id):
        if out is None:
            out = cupy.empty(q_shape, dtype=dtype)
            o_strides = out.strides
        else:
            o_strides = checks.check_like_shape("out", out, "q", q_shape, dtype, device_id, cupy)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32) if return_lse else None
        attend = seqlen_q > 0 and nheads > 0  # else only the append (if any) runs
        if batch == 0 or not (attend or seqlen_new > 0):
            return (out, lse) if return_lse else out

        q_ptr, k_ptr, v_ptr, o_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, out.data.ptr
        kn_ptr, vn_ptr = (k.data.ptr, v.data.ptr) if seqlen_new > 0 else (0, 0)
        # Rows 16-byte aligned (_rows_aligned16): the strides' part here, the pointers' part per call.
        # The attention reads the caches and q and writes out; the append reads k, v and writes the caches.
        kv16 = head_dim % 8 == 0 and checks.rows_aligned16(0, k_shape, k_strides) and checks.rows_aligned16(0, v_shape, v_strides)
        strides16 = kv16 and checks.rows_aligned16(0, q_shape, q_strides) and checks.rows_aligned16(0, q_shape, o_strides)
        new_strides16 = seqlen_new > 0 and kv16 and checks.rows_aligned16(0, kn_shape, kn_strides) \
            and checks.rows_aligned16(0, vn_shape, vn_strides)
        aligned = strides16 and not (q_ptr | k_ptr | v_ptr | o_ptr) & 15
        append_aligned = new_strides16 and not (k_ptr | v_ptr | kn_ptr | vn_ptr) & 15
        if host_lengths is not None:
            max_len = min(int(host_lengths.max()) + seqlen_new, capacity)
        elif seqlens_dev is None:
            max_len = min(seqlen_const + seqlen_new, capacity)
        else:
            max_len = capacity  # lengths on the GPU: plan the splits for the longest possible sequence
        # One length for every sequence (no lengths on the GPU): the plan may fill the GPU's slots with tails.
        plan_args = (batch, max(seqlen_q, 1), max(nheads, nheads_kv), nheads_kv, head_dim, checks.DTYPE_NAMES[dtype], aligned,
                     -(-max_len // 64) * 64, int(num_splits), seqlen_new, append_aligned, device_id, policy,
                     seqlens_dev is None, var.mods, var.window[0] if var.mods & plan.MOD_WINDOW else -1)  # fmt: skip
        dplan, fns = _plan_and_load(*plan_args)
        splits = dplan.num_splits
        bucket = dplan.attn.spec.head_dim
        # Split workspace: o_partial (splits, batch, nheads, seqlen_q, bucket), then lse_partial; one
        # counter per (sequence, kv head, row block) where the split kernel merges (null: the combine kernel does).
        rows_out = splits * batch * nheads * seqlen_q if attend and splits > 1 else 0
        merge_in_kernel = dplan.combine is None
        n = q.itemsize  # = every array's (one dtype)
        qs, ks = checks.elem_strides_of(q_strides, n), checks.elem_strides_of(k_strides, n)
        vs, os_ = checks.elem_strides_of(v_strides, n), checks.elem_strides_of(o_strides, n)
        kns, vns = (checks.elem_strides_of(kn_strides, n), checks.elem_strides_of(vn_strides, n)) if seqlen_new > 0 \
            else ((0, 0, 0), (0, 0, 0))
        group = max(nheads, nheads_kv) // nheads_kv
        record = DECODE_PACKER.pack(
            q=0, k=0, v=0, k_new=0, v_new=0, o=0, lse=0, o_partial=0, lse_partial=0, split_counters=0,
            seqlens=0, block_table=0,  # (the pointers: per call, _run)
            cache_batch_idx=0 if idx_dev is None else idx_dev.data.ptr,  # (calls with these two never reuse a record)
            cache_leftpad=0 if pad_dev is None else pad_dev.data.ptr,
            q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
            v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
            k_new_batch_stride=kns[0], k_new_row_stride=kns[1], k_new_head_stride=kns[2],
            v_new_batch_stride=vns[0], v_new_row_stride=vns[1], v_new_head_stride=vns[2],
            o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
            block_table_batch_stride=bt_dev.strides[0] // bt_dev.itemsize if paged else 0,
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, group=group, seqlen_q=seqlen_q,
            rows=group * seqlen_q, head_dim=head_dim, seqlen_const=0, seqlen_new=seqlen_new,
            capacity=capacity, page_size=page_size, num_pages=cache_rows, num_splits=splits,
            num_row_blocks=dplan.num_row_blocks, partial_stride=bucket, is_causal=int(var.causal),
            split_tiles=dplan.split_tiles, split_major=int(dplan.split_major), tail_groups=dplan.tail_groups,
            softmax_scale=var.unit_scale(softmax_scale), scale_log2=var.unit_scale(softmax_scale) * _LOG2_E,
            mod=var.record(softmax_scale),
        )  # fmt: skip
        ws_counters = batch * nheads_kv * dplan.num_row_blocks if rows_out and merge_in_kernel else 0
        prep = _Prepared(
            plan_args=plan_args, dplan=dplan, fns=fns, record=record, attend=attend, lse_shape=(batch, nheads, seqlen_q),
            capacity=capacity, seqlen_new=seqlen_new, strides16=strides16, new_strides16=new_strides16,
            aligned=aligned, append_aligned=append_aligned, ws_floats=rows_out * (bucket + 1), ws_counters=ws_counters,
            lse_offset=4 * rows_out * bucket, merge_in_kernel=merge_in_kernel,
        )  # fmt: skip
        if key is not None:
            _PREPARED.room()[key] = prep
        return _run(prep, cupy, device_id, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out, lse, seqlens_dev, bt_dev,
                    seqlen_const, return_lse)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, aligned, max_seqlen, num_splits, seqlen_new,
                   append_aligned, device_id, policy, uniform_lengths, mods=0, window_left=-1):  # fmt: skip
    """Launch plan and loaded kernels for one call signature (memoized: the host side of a repeated
    decode step is a dictionary lookup; max_seqlen arrives rounded up to 64 tokens, so consecutive
    steps share an entry)."""
    p = plan.plan_decode(
        batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype,
        aligned=aligned, max_seqlen=max_seqlen, num_splits=num_splits, num_sms=jit.device_sm_count(device_id),
        arch=jit.device_arch(device_id), seqlen_new=seqlen_new, append_aligned=append_aligned,
        uniform_lengths=uniform_lengths, policy=policy, mods=mods, window_left=window_left,
    )  # fmt: skip
    fns = tuple(None if launch is None else jit.get_function(launch.spec, device_id)
                for launch in (p.attn, p.append, p.combine))
    return p, fns


def _int_array(name: str, x, batch: int, device_id: int, cupy, check: bool):
    """(host copy or None, int32 CuPy array or None) of an optional per-sequence int argument: a CuPy
    int32 (batch,) array (read back only with check=True) or host ints (validated by the caller, uploaded)."""
    if x is None:
        return None, None
    if isinstance(x, cupy.ndarray):
        checks.check_device_int32(name, x, (batch,), device_id)
        return (x.get().astype(np.int64) if check else None), x
    host = checks.host_int_array(x, name)
    if host.shape != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {host.shape}")
    if np.any(np.abs(host) > INT32_MAX):
        raise ValueError(f"{name} values must fit int32")
    with cupy.cuda.Device(device_id):
        return host, cupy.asarray(host.astype(np.int32))


def _rotate(cupy, q, k_cache, k, cache_seqlens, block_table, cos, sin, interleaved, cache_leftpad, per_token_q):
    """Rotated copies (q, k) of a decode call's queries and new keys (cuda_src/rotary.cuh), at the positions
    flash_attn_with_kvcache uses: new key t of sequence b at cache_seqlens[b] - cache_leftpad[b] + t, the
    queries there too when per_token_q (causal or windowed), else all at cache_seqlens[b] - cache_leftpad[b]."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    q_shape, _ = checks.geometry("q", q, cupy)
    k_shape, _ = checks.geometry("k_cache", k_cache, cupy)
    device_id = q.device.id
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray of q's dtype on q's device, got {type(x).__name__}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device.id != device_id:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {device_id}")
        if x.ndim != 2 or x.shape != cos.shape:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got {cos.shape} "
                             f"and {sin.shape}")  # fmt: skip
        if x.shape[1] > 1 and x.strides[1] != x.itemsize:
            raise ValueError(f"{name} must be contiguous in its last dimension; use cupy.ascontiguousarray({name})")
    head_dim = q_shape[3]
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be in [2, headdim = {head_dim}]")
    bt_shape = np.shape(block_table) if block_table is not None else None
    capacity = k_shape[1] * (bt_shape[1] if bt_shape is not None and len(bt_shape) == 2 else 1 if bt_shape is None else 0)
    seqlen_new = np.shape(k)[1] if k is not None and len(np.shape(k)) == 4 else 0
    # The largest position any valid call rotates at: a new key below the capacity; the queries at most
    # seqlen_q - 1 (per token) past the tokens cached, which are at most capacity - seqlen_new.
    need = max(capacity if seqlen_new else 0, capacity - seqlen_new + (q_shape[1] if per_token_q else 1))
    if seqlen_ro < max(need, 1):
        raise ValueError(f"rotary_cos / rotary_sin have {seqlen_ro} rows; this call can rotate at positions up to "
                         f"{need - 1} (cache capacity {capacity}, {seqlen_new} new tokens, seqlen_q {q_shape[1]}): "
                         f"give at least {max(need, 1)} rows")  # fmt: skip
    batch = q_shape[0]
    seqlens_ptr, seqlen_const, keep = 0, capacity, []
    if isinstance(cache_seqlens, cupy.ndarray):
        checks.check_device_int32("cache_seqlens", cache_seqlens, (batch,), device_id)
        seqlens_ptr = cache_seqlens.data.ptr
    elif checks.is_int(cache_seqlens):
        seqlen_const = int(cache_seqlens)
    elif cache_seqlens is not None:
        host = np.clip(checks.host_seqlens(cache_seqlens, batch), -1, INT32_MAX).astype(np.int32)
        with cupy.cuda.Device(device_id):
            keep.append(cupy.asarray(host))
        seqlens_ptr = keep[-1].data.ptr
    _, pad_dev = _int_array("cache_leftpad", cache_leftpad, batch, device_id, cupy, False)
    dtype = checks.DTYPE_NAMES[q.dtype]
    fn = jit.get_function(plan.RotarySpec(dtype, bool(interleaved), jit.device_arch(device_id)), device_id)

    def rotated(x, per_token):
        shape, strides = checks.geometry("k" if x is k else "q", x, cupy)
        out = cupy.empty(shape, dtype=x.dtype)
        total = int(np.prod(shape))
        if total == 0:
            return out
        xs = checks.elem_strides_of(strides, x.itemsize)
        record = ROTARY_PACKER.pack(
            x=x.data.ptr, out=out.data.ptr, cos=cos.data.ptr, sin=sin.data.ptr, seqlens=seqlens_ptr,
            leftpad=0 if pad_dev is None else pad_dev.data.ptr, x_batch_stride=xs[0], x_row_stride=xs[1],
            x_head_stride=xs[2], cos_row_stride=cos.strides[0] // cos.itemsize, sin_row_stride=sin.strides[0] // sin.itemsize,
            batch=shape[0], seqlen=shape[1], nheads=shape[2], head_dim=shape[3], rotary_dim=rotary_dim,
            seqlen_ro=seqlen_ro, seqlen_const=seqlen_const, capacity=capacity, per_token=int(per_token),
        )  # fmt: skip
        how = plan.Launch(fn_spec, (min(-(-total // plan.DECODE_THREADS), 1 << 16), 1, 1), (plan.DECODE_THREADS, 1, 1), 0)
        launch.launch_record(fn, how, record, stream)
        return out

    fn_spec = plan.RotarySpec(dtype, bool(interleaved), jit.device_arch(device_id))
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.get_current_stream().ptr  # q's device's current stream, where the decode kernels run
        q_rot = rotated(q, per_token_q)
        k_rot = None
        if k is not None:
            kn_shape, _ = checks.geometry("k", k, cupy)
            if k.dtype != q.dtype:
                raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
            k_rot = rotated(k, True)
        if cupy.cuda.runtime.streamIsCapturing(stream):  # a graph replays into these copies: keep them
            with _WORKSPACE_LOCK:
                _CAPTURED.append((q_rot, k_rot, *keep))
    return q_rot, k_rot


def _windowed(window_size) -> bool:
    """Whether window_size asks for a window (anything but (-1, -1); bad values are reported later)."""
    try:
        return tuple(window_size) != (-1, -1)
    except TypeError:
        return True
