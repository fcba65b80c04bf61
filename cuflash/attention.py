"""Public forward API: argument checks, output allocation, launch.

Checks happen here, once, with messages that say what to do; the kernels assume their
preconditions (see the header comment of cuda_src/flash_fwd.cuh).
"""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from . import jit, plan
from .params import FWD_DTYPE, make_record

try:  # CuPy 14's bfloat16 is ml_dtypes.bfloat16
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _BF16 = None

_DTYPE_NAMES = {np.dtype(np.float16): "fp16"}
if _BF16 is not None:
    _DTYPE_NAMES[_BF16] = "bf16"

#: Grid limits of the launch (gridDim.y = heads, gridDim.z = batch).
_MAX_GRID_YZ = 65535


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "cuflash needs CuPy: pip install 'cuflash[cuda12]' (CUDA 12 driver) or 'cuflash[cuda13]' (CUDA 13 driver)"
        ) from exc
    return cupy


def _check_array(name: str, x, cupy) -> None:
    _geometry(name, x, cupy)


def _geometry(name: str, x, cupy) -> tuple[tuple, tuple]:
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
    if x.dtype not in _DTYPE_NAMES:
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


def _elem_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements."""
    return _elem_strides_of(x.strides, x.itemsize)


def _elem_strides_of(strides: tuple, itemsize: int) -> tuple[int, int, int]:
    return strides[0] // itemsize, strides[1] // itemsize, strides[2] // itemsize


def _aligned16(x, ptr: int | None = None) -> bool:
    """True when every row of x (each index of its first three dims) starts on a 16-byte boundary, as
    16-byte cp.async loads and stores need. CuPy strides are in bytes; a dim of size 1 may have any
    stride. ptr: x.data.ptr, where the caller has read it already."""
    return _rows_aligned16(x.data.ptr if ptr is None else ptr, x.shape, x.strides)


def _rows_aligned16(ptr: int, shape: tuple, strides: tuple) -> bool:
    """_aligned16 of an array with base pointer ``ptr``, ``shape`` and byte ``strides``."""
    if ptr % 16:
        return False
    for i in range(3):
        if shape[i] > 1 and strides[i] % 16:
            return False
    return True


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False, out=None):
    """Exact attention ``softmax(scale * q k^T) v`` with FlashAttention-2 on CuPy arrays.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); float16 or
    bfloat16, all the same dtype, on one device; any strides with a contiguous last dimension.
    nheads must be a multiple of nheads_kv (GQA / MQA). headdim from 1 to 256.

    causal: mask aligned to the bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q;
    a query that sees no key gets 0 (and lse -inf).
    softmax_scale: defaults to 1 / sqrt(headdim); must be positive.
    return_lse: also return lse, float32 (batch, nheads, seqlen_q), natural log of the softmax sum.
    out: optional output array (shape and dtype of q, last dim contiguous) written in place.

    Runs on CuPy's current stream and never synchronizes.
    """
    return _forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out)


def _check_inputs(q, k, v, cupy):
    """Checks q, k, v; returns (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, cupy)
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
    if head_dim > plan.HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim {head_dim} is not supported: cuflash handles head dims 1 to {plan.HEAD_DIM_BUCKETS[-1]}")
    _check_head_ratio(nheads, nheads_kv, allow_no_heads=True)
    device_id = q.device.id
    _check_on_device(device_id, (("k", k), ("v", v)))
    if batch > _MAX_GRID_YZ or nheads > _MAX_GRID_YZ:
        raise ValueError(f"batch and nheads must each be at most {_MAX_GRID_YZ}, got {batch} and {nheads}")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id


def _check_head_ratio(nheads: int, nheads_kv: int, *, allow_no_heads: bool) -> None:
    """nheads must be a multiple of nheads_kv (GQA / MQA). allow_no_heads: 0 query and 0 kv heads
    (an empty problem) pass too."""
    if nheads_kv == 0 and (nheads > 0 or not allow_no_heads) or nheads_kv > 0 and nheads % nheads_kv != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value heads ({nheads_kv})"
        )


def _check_on_device(device_id: int, named_arrays) -> None:
    """Every (name, array) of named_arrays lives on device_id, q's device."""
    for name, x in named_arrays:
        if x.device.id != device_id:
            raise ValueError(f"q is on device {device_id} but {name} is on device {x.device.id}; move them to one device")


def _resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return softmax_scale


def _check_like(name: str, x, like_name: str, like, device_id: int, cupy) -> None:
    """x must be a CuPy array of like's shape and dtype, on device_id, contiguous in its last dim."""
    _check_like_shape(name, x, like_name, like.shape, like.dtype, device_id, cupy)


def _check_like_shape(name: str, x, like_name: str, like_shape: tuple, like_dtype, device_id: int, cupy) -> tuple:
    """_check_like against a shape and dtype read before; returns x's strides (bytes)."""
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


def _output_like_q(out, q, device_id: int, cupy):
    """``out`` checked against q (_check_like: shape, dtype, device, contiguous last dim), or a new
    array like q when None. Call with device_id current."""
    if out is None:
        return cupy.empty(q.shape, dtype=q.dtype)
    _check_like("out", out, "q", q, device_id, cupy)
    return out


def _forward(q, k, v, *, causal, softmax_scale, return_lse, out, tile: plan.Tile | None = None):
    cupy = _cupy()
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id = _check_inputs(q, k, v, cupy)
    softmax_scale = _resolve_scale(softmax_scale, head_dim)

    with cupy.cuda.Device(device_id):
        out = _output_like_q(out, q, device_id, cupy)
        lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)

        if batch == 0 or seqlen_q == 0 or nheads == 0 or head_dim == 0:
            return (out, lse) if return_lse else out
        if seqlen_k == 0:  # no query sees any key
            out.fill(0)
            lse.fill(-np.inf)
            return (out, lse) if return_lse else out

        aligned = head_dim % 8 == 0 and all(_aligned16(x) for x in (q, k, v, out))
        launch, fn = _plan_and_load(
            batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, _DTYPE_NAMES[q.dtype], bool(causal), aligned,
            device_id, tile,
        )  # fmt: skip
        qs, ks, vs, os_ = _elem_strides(q), _elem_strides(k), _elem_strides(v), _elem_strides(out)
        rec = make_record(
            FWD_DTYPE,
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
            q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
            k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
            v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
            o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_ratio=nheads // nheads_kv,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, num_m_blocks=launch.grid[0],
            softmax_scale=softmax_scale, scale_log2=softmax_scale * math.log2(math.e),
        )  # fmt: skip
        _launch(fn, launch, rec)
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id, tile):
    """Launch plan and loaded kernel for one call signature (memoized: the host side of a repeated
    call is then a dictionary lookup, not a re-plan)."""
    launch = plan.plan_forward(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), tile=tile,
    )  # fmt: skip
    return launch, jit.get_function(launch.spec, device_id)


def _launch(fn, launch: plan.Launch, rec: np.ndarray) -> None:
    """Launch on CuPy's current stream with the record's bytes as the kernel's by-value struct argument."""
    # The driver copies the argument bytes at launch time; rec and argv stay alive until this returns.
    argv = (ctypes.c_void_p * 1)(rec.ctypes.data)
    jit.launch(fn, launch, ctypes.addressof(argv), _cupy().cuda.get_current_stream().ptr)
