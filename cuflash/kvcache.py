"""Decode with a KV cache: ``attention_with_kvcache`` (flash-attn's ``flash_attn_with_kvcache``).

Checks happen here, once, with messages that say what to do; the kernels (cuda_src/flash_decode.cuh)
assume their preconditions, except that they clamp every length and page index they read from
device memory, so no value of ``cache_seqlens`` / ``block_table`` can make them touch memory outside
the caches.
"""
from __future__ import annotations

import ctypes
import functools
import math
import numbers
import struct
import threading

import numpy as np

from . import jit, plan
from .attention import (
    _DTYPE_NAMES, _check_head_ratio, _check_like_shape, _check_on_device, _cupy, _elem_strides_of, _geometry,
    _resolve_scale, _rows_aligned16,
)
from .params import DECODE_DTYPE

_INT32_MAX = 2**31 - 1
_LOG2_E = math.log2(math.e)

#: DecodeParams packed by field name with one precompiled struct (a decode step is a few microseconds
#: of GPU time: the host side must stay small). Same bytes as params.make_record(DECODE_DTYPE, ...).
_STRUCT_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}
_LAST = DECODE_DTYPE.fields[DECODE_DTYPE.names[-1]]
_TAIL_PAD = DECODE_DTYPE.itemsize - _LAST[1] - _LAST[0].itemsize  # the struct's size rounds up to its alignment
_RECORD = struct.Struct("<" + "".join(_STRUCT_CODES[DECODE_DTYPE.fields[n][0]] for n in DECODE_DTYPE.names)
                        + "x" * _TAIL_PAD)  # fmt: skip
_NAMES = DECODE_DTYPE.names
assert _RECORD.size == DECODE_DTYPE.itemsize, "DecodeParams has padding the packed record does not reproduce"


def _make_packer():
    """pack(buf, *, <every DecodeParams field>): the fields by name, packed into the writable buffer
    ``buf`` in DECODE_DTYPE's order with the precompiled struct. Generated from DECODE_DTYPE.names, so
    the order lives in one place; Python's keyword binding rejects a missing or an unknown field
    (TypeError). A dict of the fields walked by name cost ~3 us more per call."""
    fields = ", ".join(_NAMES)
    namespace = {"pack_into": _RECORD.pack_into}
    exec(f"def pack(buf, *, {fields}):\n    pack_into(buf, 0, {fields})\n", namespace)
    return namespace["pack"]


_pack = _make_packer()


def _record(**values) -> np.ndarray:
    """The DecodeParams record (0-d, DECODE_DTYPE) that _pack writes, for inspection and tests."""
    buf = bytearray(_RECORD.size)
    _pack(buf, **values)
    return np.frombuffer(bytes(buf), dtype=DECODE_DTYPE)[0:1].reshape(())


class _LaunchArgs(threading.local):
    """This thread's DecodeParams bytes and the void*[1] argument array cuLaunchKernel reads. The
    driver copies the bytes at launch, so one buffer serves every launch of every call."""

    def __init__(self):
        self.buf = ctypes.create_string_buffer(_RECORD.size)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self.argv)


_ARGS = _LaunchArgs()

#: The pointer fields that open DecodeParams (q .. block_table) and the length of a one-length call
#: (seqlen_const): all of a record that changes from one call of a signature to the next (_run).
_PTR_FIELDS = ("q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "split_counters", "seqlens",
               "block_table")  # fmt: skip
_PTRS = struct.Struct("<" + "Q" * len(_PTR_FIELDS))
_SEQLEN_CONST = struct.Struct("<i")
_SEQLEN_CONST_OFFSET = DECODE_DTYPE.fields["seqlen_const"][1]
assert _NAMES[: len(_PTR_FIELDS)] == _PTR_FIELDS and DECODE_DTYPE.fields["q"][1] == 0 \
    and all(DECODE_DTYPE.fields[n][0] == np.uint64 for n in _PTR_FIELDS), "DecodeParams no longer opens with the pointers"
assert DECODE_DTYPE.fields["seqlen_const"][0] == np.int32


class _Prepared:
    """What the checks and the plan make of one call signature (_signature): the plan's arguments, the
    plan and kernels they gave, the DecodeParams record with its pointers and seqlen_const left 0,
    and what a call still needs."""

    __slots__ = ("plan_args", "dplan", "fns", "record", "attend", "lse_shape", "capacity", "seqlen_new", "strides16",
                 "new_strides16", "aligned", "append_aligned", "ws_floats", "ws_counters", "lse_offset",
                 "merge_in_kernel")  # fmt: skip

    def __init__(self, *values):
        for name, value in zip(self.__slots__, values, strict=True):
            setattr(self, name, value)


class _PreparedCalls(threading.local):
    def __init__(self):
        self.calls = {}


_PREPARED = _PreparedCalls()
_PREPARED_MAX = 256  # signatures kept per thread (a serving loop has a handful)


def _prepared_calls() -> dict:
    calls = _PREPARED.calls
    if len(calls) >= _PREPARED_MAX:
        calls.clear()
    return calls


def _desc(x) -> tuple:
    """A CuPy array's static description in a signature: shape, strides, dtype, device."""
    return x.shape, x.strides, x.dtype, x.data.device_id


def _signature(cupy, q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
               return_lse, out, check, ctas_per_sm):  # fmt: skip
    """The key under which a call's checks and plan are kept (_Prepared): everything they depend on but
    the pointers and, for one length for all, the length itself (only its 64-token step, which the
    plan sees). None where the call takes the whole way every time: lengths or a block table on the
    host (their values are checked per call), check=True, or arguments of other types (the whole way
    then raises the errors). A decode loop's repeated call skips re-checking what cannot have changed:
    the host time of a step is latency, and on the H200 the checks, the plan lookup and the packing
    of the record took more of it than the launch."""
    nd = cupy.ndarray
    if check or type(num_splits) is not int or type(ctas_per_sm) is not int:
        return None
    if type(q) is not nd or type(k_cache) is not nd or type(v_cache) is not nd:
        return None
    if softmax_scale is not None and type(softmax_scale) is not float:
        return None
    kd = _desc(k_cache)
    key = [_desc(q), kd, _desc(v_cache), bool(causal), softmax_scale, num_splits, bool(return_lse), ctas_per_sm]
    new = 0
    if k is not None or v is not None:
        if type(k) is not nd or type(v) is not nd:
            return None
        kn = _desc(k)
        key += [kn, _desc(v)]
        new = kn[0][1] if len(kn[0]) == 4 else 0
    if out is not None:
        if type(out) is not nd:
            return None
        key.append(_desc(out))
    capacity = kd[0][1] if len(kd[0]) == 4 else 0
    if block_table is not None:
        if type(block_table) is not nd:
            return None
        bd = _desc(block_table)
        key.append(bd)
        capacity *= bd[0][1] if len(bd[0]) == 2 else 0
    if cache_seqlens is None:
        key.append(None)
    elif type(cache_seqlens) is int:
        if not 0 <= cache_seqlens <= capacity - new:
            return None  # the whole way raises the error
        key.append(-(-min(cache_seqlens + new, capacity) // 64) * 64)  # the plan's step of the length
    elif type(cache_seqlens) is nd:
        key.append(_desc(cache_seqlens))
    else:
        return None
    return tuple(key)


def _run(prep: _Prepared, cupy, device_id: int, q_ptr: int, k_ptr: int, v_ptr: int, kn_ptr: int, vn_ptr: int, out, lse,
         seqlens_dev, bt_dev, seqlen_const: int, return_lse: bool):  # fmt: skip
    """The launches of a prepared call (device_id current): the record with this call's pointers and
    length, the split workspace of this stream."""
    dplan = prep.dplan
    fn_attn, fn_append, fn_combine = prep.fns
    stream = cupy.cuda.get_current_stream().ptr
    o_partial_ptr = lse_partial_ptr = counters_ptr = 0
    if prep.ws_floats:
        partials, counters = _workspace(cupy, device_id, stream, prep.ws_floats, prep.ws_counters)
        o_partial_ptr = partials.data.ptr
        counters_ptr = counters.data.ptr if prep.merge_in_kernel else 0
        lse_partial_ptr = o_partial_ptr + prep.lse_offset  # bucket % 32 == 0: 128-byte aligned
    args = _ARGS
    buf = args.buf
    ctypes.memmove(buf, prep.record, len(prep.record))
    _PTRS.pack_into(buf, 0, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
                    o_partial_ptr, lse_partial_ptr, counters_ptr, 0 if seqlens_dev is None else seqlens_dev.data.ptr,
                    0 if bt_dev is None else bt_dev.data.ptr)  # fmt: skip
    _SEQLEN_CONST.pack_into(buf, _SEQLEN_CONST_OFFSET, seqlen_const)
    if dplan.append is not None:  # the attention below reads the new tokens (same stream)
        jit.launch(fn_append, dplan.append, args.argv_ptr, stream)
    if prep.attend:
        jit.launch(fn_attn, dplan.attn, args.argv_ptr, stream)
        if dplan.combine is not None:
            jit.launch(fn_combine, dplan.combine, args.argv_ptr, stream)
    return (out, lse) if return_lse else out

#: Scratch of the split path per (device, stream handle), kept between calls: (fp32 partial rows and
#: lse of the splits, int32 split counters). Calls on one stream run in order, so they can share it;
#: the kernel leaves every counter at 0 when it ends. Grown on demand; free_workspaces() drops them.
_WORKSPACES: dict = {}
_WORKSPACE_LOCK = threading.Lock()


def _workspace(cupy, device_id: int, stream: int, floats: int, counters: int):
    """(partials, counters) of at least ``floats`` float32 and ``counters`` zeroed int32 elements for
    this device and stream (the caller holds the device current)."""
    ws = _WORKSPACES.get((device_id, stream))
    if ws is None or ws[0].size < floats or ws[1].size < counters:
        with _WORKSPACE_LOCK:
            old = _WORKSPACES.get((device_id, stream))
            if old is not None:
                floats, counters = max(floats, old[0].size), max(counters, old[1].size)
            # Allocated on this stream: CuPy's pool reuses the old arrays' blocks only for work on the
            # same stream, ordered after the kernels still reading them; cupy.zeros clears the new
            # counters on this stream before the next kernel.
            ws = (cupy.empty(floats, dtype=cupy.float32), cupy.zeros(counters, dtype=cupy.int32))
            _WORKSPACES[(device_id, stream)] = ws
    return ws


def free_workspaces() -> None:
    """Drop the scratch buffers of the split-KV path (per device and stream) back to CuPy's pool."""
    with _WORKSPACE_LOCK:
        _WORKSPACES.clear()


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
    num_splits: int = 0,
    return_lse: bool = False,
    out=None,
    check: bool = False,
    _ctas_per_sm: int = 0,
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
    num_splits: key splits per sequence (Flash-Decoding). 0 picks them to fill the GPU
      (cuflash.plan.decode_num_splits); 1 disables splitting; at most 128 and one per 64-key tile.
    return_lse: also return lse, float32 (batch, nheads, seqlen_q), natural log of the softmax sum.
    out: optional output array (shape and dtype of q, last dim contiguous) written in place.
    check: also validate cache_seqlens / block_table given as CuPy arrays (see below).
    _ctas_per_sm: tuning only (tools/sweep_splits.py): split-KV CTAs resident per SM, 0 = the plan's.

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
    cupy = _cupy()
    # A signature seen before (_signature): only what can change between calls is looked at.
    key = _signature(cupy, q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                     return_lse, out, check, _ctas_per_sm)  # fmt: skip
    prep = None if key is None else _PREPARED.calls.get(key)
    if prep is not None:
        q_ptr, k_ptr, v_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        kn_ptr, vn_ptr = (k.data.ptr, v.data.ptr) if prep.seqlen_new > 0 else (0, 0)
        device_id = key[0][3]
        with cupy.cuda.Device(device_id):
            if out is None:
                out = cupy.empty(key[0][0], dtype=key[0][2])
            o_ptr = out.data.ptr
            # Kept only while the pointers agree with the load path planned (16-byte loads where every
            # row was aligned) and the plan memo still gives the same plan (a cleared or swapped memo,
            # as tests and tools do, plans again): else the whole way.
            if prep.aligned == (prep.strides16 and not (q_ptr | k_ptr | v_ptr | o_ptr) & 15) and \
                    prep.append_aligned == (prep.new_strides16 and not (k_ptr | v_ptr | kn_ptr | vn_ptr) & 15) and \
                    (got := _plan_and_load(*prep.plan_args))[0] is prep.dplan and got[1] is prep.fns:
                lse = cupy.empty(prep.lse_shape, dtype=cupy.float32) if return_lse else None
                seqlens_dev = cache_seqlens if type(cache_seqlens) is cupy.ndarray else None
                seqlen_const = prep.capacity if cache_seqlens is None else (0 if seqlens_dev is not None else cache_seqlens)
                return _run(prep, cupy, device_id, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out, lse, seqlens_dev,
                            block_table, seqlen_const, return_lse)  # fmt: skip
    if type(_ctas_per_sm) is not int:  # the plan memo would take True for 1
        raise TypeError(f"_ctas_per_sm must be an int, got {_ctas_per_sm!r}")
    # Every array's shape and strides are read once (_geometry): the host time of a decode step counts.
    q_shape, q_strides = _geometry("q", q, cupy)
    k_shape, k_strides = _geometry("k_cache", k_cache, cupy)
    v_shape, v_strides = _geometry("v_cache", v_cache, cupy)
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
    _check_head_ratio(nheads, nheads_kv, allow_no_heads=False)
    device_id = q.device.id
    _check_on_device(device_id, (("k_cache", k_cache), ("v_cache", v_cache)))

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
        bt_host, bt_dev = _block_table_arrays(block_table, batch, device_id, cupy)
        capacity = bt_dev.shape[1] * page_size
    else:
        if cache_rows < batch:
            raise ValueError(
                f"k_cache holds {cache_rows} sequences (shape[0]) but q has batch {batch}; sequence b uses cache row b"
            )
        page_size = capacity = slots

    # New tokens.
    if (k is None) != (v is None):
        raise ValueError("the new tokens k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        kn_shape, kn_strides = _geometry("k", k, cupy)
        vn_shape, vn_strides = _geometry("v", v, cupy)
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
    if capacity + seqlen_new > _INT32_MAX:
        raise ValueError(f"a sequence can hold at most {_INT32_MAX} tokens, got capacity {capacity} + {seqlen_new} new")

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
        _check_device_int32("cache_seqlens", cache_seqlens, (batch,), device_id)
        seqlens_dev = cache_seqlens
        if check:
            host_lengths = cache_seqlens.get().astype(np.int64)  # the one synchronization check=True costs
    elif _is_int(cache_seqlens):
        seqlen_const = int(cache_seqlens)  # one length for all: a kernel argument, no upload
        if not 0 <= seqlen_const <= capacity - seqlen_new:  # the decode loop's case: no NumPy on the way
            validate_lengths(np.full(max(batch, 1), seqlen_const, dtype=np.int64), seqlen_new, capacity)
    else:
        host_lengths = _host_seqlens(cache_seqlens, batch)
    if host_lengths is not None:
        validate_lengths(host_lengths, seqlen_new, capacity)
    if cache_seqlens is not None and not isinstance(cache_seqlens, cupy.ndarray) and host_lengths is not None:
        if np.ndim(cache_seqlens) == 0:
            seqlen_const = int(host_lengths[0]) if batch else 0
        else:
            with cupy.cuda.Device(device_id):
                seqlens_dev = cupy.asarray(host_lengths.astype(np.int32))  # validated: fits int32
    if paged and (bt_host is not None or check) and (host_lengths is not None or seqlens_dev is None):
        if bt_host is None:
            bt_host = bt_dev.get()
        lengths = host_lengths if host_lengths is not None else np.full(batch, seqlen_const, dtype=np.int64)
        validate_block_table(bt_host, lengths + seqlen_new, page_size, cache_rows)

    if not _is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen to fill the GPU, 1: no split), got {num_splits!r}")
    softmax_scale = _resolve_scale(softmax_scale, head_dim)

    with cupy.cuda.Device(device_id):
        if out is None:
            out = cupy.empty(q_shape, dtype=dtype)
            o_strides = out.strides
        else:
            o_strides = _check_like_shape("out", out, "q", q_shape, dtype, device_id, cupy)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32) if return_lse else None
        attend = seqlen_q > 0 and nheads > 0  # else only the append (if any) runs
        if batch == 0 or not (attend or seqlen_new > 0):
            return (out, lse) if return_lse else out

        q_ptr, k_ptr, v_ptr, o_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, out.data.ptr
        kn_ptr, vn_ptr = (k.data.ptr, v.data.ptr) if seqlen_new > 0 else (0, 0)
        # Rows 16-byte aligned (_rows_aligned16): the strides' part here, the pointers' part per call.
        # The attention reads the caches and q and writes out; the append reads k, v and writes the caches.
        kv16 = head_dim % 8 == 0 and _rows_aligned16(0, k_shape, k_strides) and _rows_aligned16(0, v_shape, v_strides)
        strides16 = kv16 and _rows_aligned16(0, q_shape, q_strides) and _rows_aligned16(0, q_shape, o_strides)
        new_strides16 = seqlen_new > 0 and kv16 and _rows_aligned16(0, kn_shape, kn_strides) \
            and _rows_aligned16(0, vn_shape, vn_strides)
        aligned = strides16 and not (q_ptr | k_ptr | v_ptr | o_ptr) & 15
        append_aligned = new_strides16 and not (k_ptr | v_ptr | kn_ptr | vn_ptr) & 15
        if host_lengths is not None:
            max_len = min(int(host_lengths.max()) + seqlen_new, capacity)
        elif seqlens_dev is None:
            max_len = min(seqlen_const + seqlen_new, capacity)
        else:
            max_len = capacity  # lengths on the GPU: plan the splits for the longest possible sequence
        # One length for every sequence (no lengths on the GPU): the plan may fill the GPU's slots with tails.
        plan_args = (batch, max(seqlen_q, 1), max(nheads, nheads_kv), nheads_kv, head_dim, _DTYPE_NAMES[dtype], aligned,
                     -(-max_len // 64) * 64, int(num_splits), seqlen_new, append_aligned, device_id, _ctas_per_sm,
                     seqlens_dev is None)  # fmt: skip
        dplan, fns = _plan_and_load(*plan_args)
        splits = dplan.num_splits
        bucket = dplan.attn.spec.head_dim
        # Split workspace: o_partial (splits, batch, nheads, seqlen_q, bucket), then lse_partial; one
        # counter per (sequence, kv head, row block) where the split kernel merges (null: the combine kernel does).
        rows_out = splits * batch * nheads * seqlen_q if attend and splits > 1 else 0
        merge_in_kernel = dplan.combine is None
        n = q.itemsize  # = every array's (one dtype)
        qs, ks = _elem_strides_of(q_strides, n), _elem_strides_of(k_strides, n)
        vs, os_ = _elem_strides_of(v_strides, n), _elem_strides_of(o_strides, n)
        kns, vns = (_elem_strides_of(kn_strides, n), _elem_strides_of(vn_strides, n)) if seqlen_new > 0 \
            else ((0, 0, 0), (0, 0, 0))
        group = max(nheads, nheads_kv) // nheads_kv
        record = ctypes.create_string_buffer(_RECORD.size)
        _pack(
            record, q=0, k=0, v=0, k_new=0, v_new=0, o=0, lse=0, o_partial=0, lse_partial=0, split_counters=0,
            seqlens=0, block_table=0,  # (the pointers: per call, _run)
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
            num_row_blocks=dplan.num_row_blocks, partial_stride=bucket, is_causal=int(bool(causal)),
            split_tiles=dplan.split_tiles, split_major=int(dplan.split_major), tail_groups=dplan.tail_groups,
            softmax_scale=softmax_scale, scale_log2=softmax_scale * _LOG2_E,
        )  # fmt: skip
        ws_counters = batch * nheads_kv * dplan.num_row_blocks if rows_out and merge_in_kernel else 0
        prep = _Prepared(
            plan_args, dplan, fns, record.raw, attend, (batch, nheads, seqlen_q), capacity, seqlen_new, strides16,
            new_strides16, aligned, append_aligned, rows_out * (bucket + 1), ws_counters, 4 * rows_out * bucket,
            merge_in_kernel,
        )  # fmt: skip
        if key is not None:
            _prepared_calls()[key] = prep
        return _run(prep, cupy, device_id, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, out, lse, seqlens_dev, bt_dev,
                    seqlen_const, return_lse)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Argument helpers (pure NumPy where the values are on the host: tested on the CPU)
# ---------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    """An integer, not a bool (a plain int first: the numbers.Integral abc check costs ~0.5 us)."""
    return type(x) is int or isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _host_int_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64)


def _host_seqlens(cache_seqlens, batch: int) -> np.ndarray:
    """cache_seqlens given on the host (int, sequence, NumPy array) as int64 (batch,)."""
    arr = _host_int_array(cache_seqlens, "cache_seqlens")
    if arr.ndim == 0:
        return np.full(batch, int(arr), dtype=np.int64)
    if arr.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int or have shape (batch,) = ({batch},), got shape {arr.shape}")
    return arr


def validate_lengths(lengths: np.ndarray, seqlen_new: int, capacity: int) -> None:
    """0 <= lengths[b] and lengths[b] + seqlen_new <= capacity for every sequence b (ValueError naming the first bad one)."""
    neg = np.flatnonzero(lengths < 0)
    if neg.size:
        b = int(neg[0])
        raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{b}] = {int(lengths[b])}")
    over = np.flatnonzero(lengths + seqlen_new > capacity)
    if over.size:
        b = int(over[0])
        if seqlen_new:
            raise ValueError(
                f"{seqlen_new} new tokens do not fit: cache_seqlens[{b}] = {int(lengths[b])} + {seqlen_new} exceeds "
                f"the cache capacity of {capacity} tokens per sequence"
            )
        raise ValueError(
            f"cache_seqlens[{b}] = {int(lengths[b])} exceeds the cache capacity of {capacity} tokens per sequence"
        )


def validate_block_table(block_table: np.ndarray, lengths: np.ndarray, page_size: int, num_pages: int) -> None:
    """Every block_table entry a sequence uses (its first ceil(lengths[b] / page_size) pages) is a page
    of the cache, in [0, num_pages). Entries past a sequence's length are never read (padding is fine)."""
    used = -(-np.asarray(lengths, dtype=np.int64) // page_size)
    cols = np.arange(block_table.shape[1])
    bad = (cols[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache (k_cache has {num_pages} "
            f"pages, indices 0..{num_pages - 1}); sequence {b} uses its first {int(used[b])} entries"
        )


def _check_device_int32(name: str, x, shape: tuple, device_id: int) -> None:
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}; convert with {name}.astype(cupy.int32)")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device_id}")
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.strides}")


def _block_table_arrays(block_table, batch: int, device_id: int, cupy):
    """(host copy or None, int32 CuPy array (batch, max_blocks)) of block_table."""
    if isinstance(block_table, cupy.ndarray):
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, ...), got {block_table.shape}")
        _check_device_int32("block_table", block_table, block_table.shape, device_id)
        return None, block_table
    host = _host_int_array(block_table, "block_table")
    if host.ndim != 2 or host.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, ...), got {host.shape}")
    with cupy.cuda.Device(device_id):
        # Out-of-range entries past a sequence's length are never read; clip so int32 cannot wrap them.
        return host, cupy.asarray(np.clip(host, -1, _INT32_MAX).astype(np.int32))


@functools.lru_cache(maxsize=64)
def _num_sms(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, aligned, max_seqlen, num_splits, seqlen_new,
                   append_aligned, device_id, ctas_per_sm=0, uniform_lengths=False):  # fmt: skip
    """Launch plan and loaded kernels for one call signature (memoized: the host side of a repeated
    decode step is a dictionary lookup; max_seqlen arrives rounded up to 64 tokens, so consecutive
    steps share an entry)."""
    p = plan.plan_decode(
        batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype,
        aligned=aligned, max_seqlen=max_seqlen, num_splits=num_splits, num_sms=_num_sms(device_id),
        arch=jit.device_arch(device_id), seqlen_new=seqlen_new, append_aligned=append_aligned,
        ctas_per_sm=ctas_per_sm, uniform_lengths=uniform_lengths,
    )  # fmt: skip
    fns = tuple(None if launch is None else jit.get_function(launch.spec, device_id)
                for launch in (p.attn, p.append, p.combine))
    return p, fns
