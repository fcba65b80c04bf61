"""Tensor maps (CUtensorMap) for the TMA kernels (cuda_src/tma.cuh, flash_fwd_sm90_ws.cuh,
flash_bwd_sm90_ws.cuh), encoded
on the host by the CUDA driver's cuTensorMapEncodeTiled through ctypes (CuPy does not wrap it).

A map describes a (batch, rows, heads, head_dim) tensor of 2-byte elements, any strides that are
multiples of 16 bytes (the last dimension contiguous), and the box one TMA load copies: 64 columns
(one 128-byte swizzle atom, SWIZZLE_128B) x ``box_rows`` rows of one head. Boxes that stick out of the
tensor are filled with zeros (loads) or clipped (stores). Encoding is host-only work (~1 us in the
driver); the maps of repeated calls with the same tensors are cached.
"""
from __future__ import annotations

import ctypes
import functools

#: cuda.h CUtensorMapDataType / CUtensorMapSwizzle / CUtensorMapL2promotion values used here.
DATA_TYPE = {"fp16": 6, "bf16": 9}
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros
MAP_BYTES = 128
BOX_COLS = 64  # elements: 128 bytes, the swizzle atom (SWIZZLE_128B allows at most 128-byte inner boxes)
ELEMENT_BYTES = 2


class TensorMapError(ValueError):
    """The driver refused to describe a tensor with a tensor map (its strides or alignment)."""


@functools.lru_cache(maxsize=1)
def _encode_tiled():
    """cuTensorMapEncodeTiled from the driver library, or None where there is none (no GPU driver)."""
    for lib in ("libcuda.so.1", "nvcuda.dll"):
        try:
            f = ctypes.CDLL(lib).cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            continue
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]  # fmt: skip
        f.restype = ctypes.c_int
        return f
    return None


def map_geometry(shape: tuple, strides: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Driver dims (innermost first: head_dim, rows, heads, batch) and byte strides (rows, heads, batch)
    of a (batch, rows, heads, head_dim) tensor with element ``strides``. A dimension of size 1 is
    never stepped, so it gets the stride of a packed layout (the driver wants multiples of 16)."""
    batch, rows, heads, dim = (int(x) for x in shape)
    dims = (dim, rows, heads, batch)
    byte_strides = []
    packed = max(dim * ELEMENT_BYTES, 16)
    for size, stride in ((rows, strides[1]), (heads, strides[2]), (batch, strides[0])):
        byte_strides.append(int(stride) * ELEMENT_BYTES if size > 1 else packed)
        packed = byte_strides[-1] * size
    return dims, tuple(byte_strides)


def check_geometry(ptr: int, shape: tuple, strides: tuple) -> str | None:
    """Why a tensor map cannot describe this tensor (the driver's rules), or None when it can."""
    dims, byte_strides = map_geometry(shape, strides)
    if ptr % 16:
        return "the base address is not 16-byte aligned"
    if any(s % 16 or s <= 0 or s >= 2**40 for s in byte_strides):
        return f"byte strides {byte_strides} must be positive multiples of 16 below 2^40"
    if any(d < 1 or d > 2**32 for d in dims):
        return f"dimensions {dims} must be in [1, 2^32]"
    return None


@functools.lru_cache(maxsize=512)
def encode(ptr: int, shape: tuple, strides: tuple, dtype: str, box_rows: int) -> bytes:
    """The 128 bytes of a CUtensorMap for a (batch, rows, heads, head_dim) tensor at device address ``ptr``
    with element ``strides``, boxes of 64 columns x ``box_rows`` rows, 128-byte swizzle, zero fill.
    Raises TensorMapError when the tensor cannot be described (callers then use a kernel without TMA)."""
    why = check_geometry(ptr, shape, strides)
    if why is not None:
        raise TensorMapError(why)
    if not 1 <= box_rows <= 256:
        raise ValueError(f"box_rows must be in [1, 256], got {box_rows}")
    f = _encode_tiled()
    if f is None:
        raise TensorMapError("no CUDA driver library (libcuda) to encode tensor maps with")
    dims, byte_strides = map_geometry(shape, strides)
    raw = ctypes.create_string_buffer(MAP_BYTES + 64)
    addr = ctypes.addressof(raw) + (-ctypes.addressof(raw) % 64)  # CUtensorMap is 64-byte aligned
    rc = f(addr, DATA_TYPE[dtype], 4, ptr, (ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*byte_strides),
           (ctypes.c_uint32 * 4)(BOX_COLS, box_rows, 1, 1), (ctypes.c_uint32 * 4)(1, 1, 1, 1), INTERLEAVE_NONE,
           SWIZZLE_128B, L2_PROMOTION_128B, OOB_FILL_ZEROS)  # fmt: skip
    if rc != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {dims}, byte strides "
                             f"{byte_strides}, box (64, {box_rows})")  # fmt: skip
    return ctypes.string_at(addr, MAP_BYTES)


#: Rows of the output map's box: the warp-specialized forward stores O with TMA one consumer warp's
#: rows at a time (flash_fwd_sm90_ws.cuh kOBoxRows).
O_BOX_ROWS = 16


def fwd_boxes(block_m: int, block_n: int, store_o: bool = True, cluster: int = 1) -> tuple[int, ...]:
    """Rows of the box of each map the warp-specialized forward reads (q, k, v, and o with ``store_o``):
    a query tile, and a key tile split over a cluster of ``cluster`` CTAs (each loads block_n / cluster
    of its rows)."""
    if block_n % cluster:
        raise ValueError(f"block_n ({block_n}) must split evenly over a cluster of {cluster}")
    kv_rows = block_n // cluster
    return (block_m, kv_rows, kv_rows) + ((O_BOX_ROWS,) if store_o else ())


def fwd_maps(q4, k4, v4, o4, dtype: str, block_m: int, block_n: int, store_o: bool = True, cluster: int = 1) -> bytes:
    """The four maps of the warp-specialized forward's parameter block (FwdTmaParams: q, k, v, o), for
    4-D (batch, rows, heads, head_dim) CuPy views (varlen: a batch of 1; paged K/V: (pages,
    page_size, heads, head_dim)). store_o=False (a kernel that writes O with 16-byte stores: the
    persistent tiles, packed batches): the output map is left zero, so it costs no driver call and
    an output no tensor map describes does not matter. ``cluster``: CTAs that share each K/V tile, each
    loading block_n / cluster of its rows (the K and V boxes)."""
    boxes = fwd_boxes(block_m, block_n, store_o, cluster)
    maps = b"".join(encode(x.data.ptr, tuple(x.shape), tuple(s // ELEMENT_BYTES for s in x.strides), dtype, rows)
                    for x, rows in zip((q4, k4, v4, o4), boxes))  # fmt: skip
    return maps + bytes(MAP_BYTES) * (4 - len(boxes))


def bwd_maps(q4, k4, v4, do4, dtype: str, block_m: int, block_n: int) -> bytes:
    """The four maps of the warp-specialized backward's parameter block (BwdTmaParams: q, k, v, dout),
    for 4-D (batch, rows, heads, head_dim) CuPy views."""
    return b"".join(
        encode(x.data.ptr, tuple(x.shape), tuple(s // ELEMENT_BYTES for s in x.strides), dtype, rows)
        for x, rows in ((q4, block_m), (k4, block_n), (v4, block_n), (do4, block_m))
    )  # fmt: skip
