"""Host-side argument checks shared by the API modules (forward, backward, kvcache): dtypes, shapes,
strides, devices, alignment, the softmax scale, and the decode call's lengths and block tables.

Every check raises TypeError / ValueError naming the argument and saying what to do; the kernels
assume what passes here. Pure NumPy where the values live on the host (tested on the CPU)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .plan import HEAD_DIM_BUCKETS

try:  # CuPy 14's bfloat16 is ml_dtypes.bfloat16
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

#: The array dtypes the kernels take, by their name in kernel variants ("fp16", "bf16").
DTYPE_NAMES = {np.dtype(np.float16): "fp16"}
if BF16 is not None:
    DTYPE_NAMES[BF16] = "bf16"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a variant dtype name: "fp16" -> float16, "bf16" -> ml_dtypes.bfloat16."""
    for dt, n in DTYPE_NAMES.items():
        if n == name:
            return dt
    raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES.values())}, got {name!r}")


_FLT_MAX = float(np.finfo(np.float32).max)
#: Grid limits of the forward and backward launches (gridDim.y = heads, gridDim.z = batch).
MAX_GRID_YZ = 65535
INT32_MAX = 2**31 - 1


def cupy_module():
    """CuPy, or an ImportError that says which extra to install."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "cuflash needs CuPy: pip install 'cuflash[cuda12]' (CUDA 12 driver) or 'cuflash[cuda13]' (CUDA 13 driver)"
        ) from exc
    return cupy


def geometry(name: str, x, cupy) -> tuple[tuple, tuple]:
    """Checks that x is a 4-D float16 / bfloat16 CuPy array contiguous in its last dim, and returns its
    (shape, strides in bytes). Each is read once: a CuPy shape or strides read builds a new tuple
    (~0.2 us on the H200 machine's host), and a decode step's host time is part of its latency."""
    if not isinstance(x, cupy.ndarray):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        hint = " (move it to the GPU with cupy.asarray)" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name} must be a cupy.ndarray, got {kind}{hint}")
    shape = x.shape
    if len(shape) != 4:
        raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape {shape}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; cuflash supports float16 and bfloat16 (ml_dtypes.bfloat16). "
            f"Convert with {name}.astype(cupy.float16)"
        )
    strides = x.strides
    if shape[3] > 1 and strides[3] != x.itemsize and x.size > 0:
        raise ValueError(
            f"{name} must be contiguous in its last (head) dimension, got strides {strides}; "
            f"use cupy.ascontiguousarray({name})"
        )
    return shape, strides


def elem_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) strides of a 4-D array in elements."""
    return elem_strides_of(x.strides, x.itemsize)


def elem_strides_of(strides: tuple, itemsize: int) -> tuple[int, int, int]:
    return strides[0] // itemsize, strides[1] // itemsize, strides[2] // itemsize


def aligned16(x, ptr: int | None = None) -> bool:
    """True when every row of x (each index of its first three dims) starts on a 16-byte boundary, as
    16-byte cp.async loads and stores need. CuPy strides are in bytes; a dim of size 1 may have any
    stride. ptr: x.data.ptr, where the caller has read it already."""
    return rows_aligned16(x.data.ptr if ptr is None else ptr, x.shape, x.strides)


def rows_aligned16(ptr: int, shape: tuple, strides: tuple) -> bool:
    """aligned16 of an array with base pointer ``ptr``, ``shape`` and byte ``strides``."""
    if ptr % 16:
        return False
    for i in range(3):
        if shape[i] > 1 and strides[i] % 16:
            return False
    return True


def check_head_dim(head_dim: int) -> None:
    if head_dim > HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim {head_dim} is not supported: cuflash handles head dims 1 to {HEAD_DIM_BUCKETS[-1]}")


def check_qkv(q, k, v, cupy):
    """Checks q, k, v of a forward or backward call; returns (batch, seqlen_q, seqlen_k, nheads,
    nheads_kv, head_dim, device_id)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        geometry(name, x, cupy)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seqlen_q, nheads, head_dim = q.shape
    batch_k, seqlen_k, nheads_kv, head_dim_k = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if batch_k != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {head_dim_k}")
    check_head_dim(head_dim)
    check_head_ratio(nheads, nheads_kv, allow_no_heads=True)
    device_id = q.device.id
    check_on_device(device_id, (("k", k), ("v", v)))
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"batch and nheads must each be at most {MAX_GRID_YZ}, got {batch} and {nheads}")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id


def check_head_ratio(nheads: int, nheads_kv: int, *, allow_no_heads: bool) -> None:
    """nheads must be a multiple of nheads_kv (GQA / MQA). allow_no_heads: 0 query and 0 kv heads
    (an empty problem) pass too."""
    if nheads_kv == 0 and (nheads > 0 or not allow_no_heads) or nheads_kv > 0 and nheads % nheads_kv != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value heads ({nheads_kv})"
        )


def check_on_device(device_id: int, named_arrays) -> None:
    """Every (name, array) of named_arrays lives on device_id, q's device."""
    for name, x in named_arrays:
        if x.device.id != device_id:
            raise ValueError(f"q is on device {device_id} but {name} is on device {x.device.id}; move them to one device")


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """softmax_scale, or 1 / sqrt(head_dim) for None; must be a positive finite number."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    try:
        softmax_scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"softmax_scale must be a positive finite number (float32), got {softmax_scale!r}") from None
    # The kernels take scale and scale * log2(e) as float32: both must be finite there.
    if not (math.isfinite(softmax_scale) and 0 < softmax_scale * math.log2(math.e) < _FLT_MAX):
        raise ValueError(f"softmax_scale must be a positive finite number (float32), got {softmax_scale}")
    return softmax_scale


def check_like(name: str, x, like_name: str, like, device_id: int, cupy) -> None:
    """x must be a CuPy array of like's shape and dtype, on device_id, contiguous in its last dim."""
    check_like_shape(name, x, like_name, like.shape, like.dtype, device_id, cupy)


def check_like_shape(name: str, x, like_name: str, like_shape: tuple, like_dtype, device_id: int, cupy) -> tuple:
    """check_like against a shape and dtype read before; returns x's strides (bytes)."""
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    shape = x.shape
    if shape != like_shape or x.dtype != like_dtype:
        raise ValueError(
            f"{name} must have {like_name}'s shape {like_shape} and dtype {like_dtype}, got {shape} {x.dtype}"
        )
    if x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id}, {like_name} on device {device_id}")
    strides = x.strides
    if shape and shape[-1] > 1 and strides[-1] != x.itemsize and x.size > 0:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {strides}")
    return strides


def output_like(out, like, device_id: int, cupy, name: str = "out", like_name: str = "q"):
    """``out`` checked against ``like`` (check_like: shape, dtype, device, contiguous last dim), or a
    new array like it when None. Call with device_id current."""
    if out is None:
        return cupy.empty(like.shape, dtype=like.dtype)
    check_like(name, out, like_name, like, device_id, cupy)
    return out


def check_lse(lse, shape: tuple, device_id: int, cupy, layout: str = "(batch, nheads, seqlen_q)",
              forward: str = "cuflash.attention") -> None:  # fmt: skip
    """The forward's lse handed to the backward: float32 of ``shape`` (named ``layout``, returned by
    ``forward``), on the device, C-contiguous."""
    if not isinstance(lse, cupy.ndarray):
        raise TypeError(f"lse must be a cupy.ndarray, got {type(lse).__name__}")
    if lse.shape != shape or lse.dtype != np.float32:
        raise ValueError(
            f"lse must be float32 of shape {layout} = {shape} as returned by "
            f"{forward}(..., return_lse=True), got {lse.dtype} {lse.shape}"
        )
    if lse.device.id != device_id:
        raise ValueError(f"lse is on device {lse.device.id}, q on device {device_id}")
    if not lse.flags.c_contiguous:
        raise ValueError("lse must be C-contiguous; pass cupy.ascontiguousarray(lse)")


# ---------------------------------------------------------------------------------------------
# Decode with a KV cache: lengths and block tables
# ---------------------------------------------------------------------------------------------


def is_int(x) -> bool:
    """An integer, not a bool (a plain int first: the numbers.Integral abc check costs ~0.5 us)."""
    return type(x) is int or isinstance(x, numbers.Integral) and not isinstance(x, bool)


def host_int_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64)


def host_seqlens(cache_seqlens, batch: int) -> np.ndarray:
    """cache_seqlens given on the host (int, sequence, NumPy array) as int64 (batch,)."""
    arr = host_int_array(cache_seqlens, "cache_seqlens")
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


def check_device_int32(name: str, x, shape: tuple, device_id: int) -> None:
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}; convert with {name}.astype(cupy.int32)")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device_id}")
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.strides}")


def block_table_arrays(block_table, batch: int, device_id: int, cupy):
    """(host copy or None, int32 CuPy array (batch, max_blocks)) of block_table."""
    if isinstance(block_table, cupy.ndarray):
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, ...), got {block_table.shape}")
        check_device_int32("block_table", block_table, block_table.shape, device_id)
        return None, block_table
    host = host_int_array(block_table, "block_table")
    if host.ndim != 2 or host.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, ...), got {host.shape}")
    with cupy.cuda.Device(device_id):
        # Out-of-range entries past a sequence's length are never read; clip so int32 cannot wrap them.
        return host, cupy.asarray(np.clip(host, -1, INT32_MAX).astype(np.int32))
