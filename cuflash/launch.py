"""Kernel launches straight to the CUDA driver: a loaded function, a plan.Launch (grid, block,
shared memory, PDL) and the parameter record's bytes. CuPy's generic argument packing costs
microseconds per launch, and a decode step is only a few microseconds of GPU time.

Environment
    CUFLASH_PDL   0 turns off programmatic dependent launch of the kernels written for it (default on
                  from sm_90; see launch)
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

logger = logging.getLogger("cuflash")

_driver = None


class _PdlState:
    """Whether launches that allow it use programmatic dependent launch: CUFLASH_PDL at import, turned
    off for the rest of the process the first time the driver refuses such a launch."""

    enabled = os.environ.get("CUFLASH_PDL", "1").strip() != "0"


def pdl_enabled() -> bool:
    return _PdlState.enabled


def set_pdl_enabled(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for this process; returns the previous setting
    (for tests and A/B tools: the same kernels with and without it)."""
    old, _PdlState.enabled = _PdlState.enabled, bool(enabled)
    return old


class CULaunchAttribute(ctypes.Structure):
    """cuda.h CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (8-aligned)."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_int32),
                ("value_pad", ctypes.c_uint32), ("value_rest", ctypes.c_uint64 * 7)]  # fmt: skip


class CULaunchConfig(ctypes.Structure):
    """cuda.h CUlaunchConfig, the first argument of cuLaunchKernelEx."""

    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("shared_mem_bytes", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(CULaunchAttribute)),
                ("num_attrs", ctypes.c_uint32)]  # fmt: skip


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID
_PDL_ATTRIBUTE = CULaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)


#: (id(launch), stream handle) -> (launch, its CULaunchConfig). Keyed by identity: the plans are
#: memoized, so a decode loop hands the same Launch every step, and hashing the dataclass (its spec,
#: grid, ...) cost more than the rest of the lookup. The entry holds the Launch, so its id stays its own.
_PDL_CONFIGS: dict = {}


def pdl_config(launch, stream_ptr: int) -> CULaunchConfig:
    """The launch configuration cuLaunchKernelEx reads for ``launch`` on a stream, with the attribute
    that allows programmatic dependent launch (built once per launch and stream)."""
    hit = _PDL_CONFIGS.get((id(launch), stream_ptr))
    if hit is not None and hit[0] is launch:
        return hit[1]
    g, b = launch.grid, launch.block
    cfg = CULaunchConfig((ctypes.c_uint32 * 3)(*g), (ctypes.c_uint32 * 3)(*b), launch.smem_bytes, stream_ptr,
                         ctypes.pointer(_PDL_ATTRIBUTE), 1)  # fmt: skip
    if len(_PDL_CONFIGS) >= 256:
        _PDL_CONFIGS.clear()
    _PDL_CONFIGS[(id(launch), stream_ptr)] = (launch, cfg)
    return cfg


@functools.lru_cache(maxsize=1)
def _cu_launch_kernel_ex():
    """The driver's cuLaunchKernelEx through ctypes (CuPy does not wrap it), or None without one."""
    for lib in ("libcuda.so.1", "nvcuda.dll"):
        try:
            f = ctypes.CDLL(lib).cuLaunchKernelEx
        except (OSError, AttributeError):
            continue
        f.argtypes = [ctypes.POINTER(CULaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        return f
    return None


def launch(fn, launch, argv_ptr: int, stream_ptr: int) -> None:
    """Launch a loaded function on the current device: ``argv_ptr`` is the address of the kernel's
    argument array (void*[1] pointing at the parameter struct's bytes, which the driver copies),
    ``stream_ptr`` the stream handle.

    Launches with ``launch.pdl`` go through cuLaunchKernelEx with programmatic stream serialization:
    the kernel may start while the one before it on the stream finishes, and waits for it in
    griddepcontrol.wait before touching global memory (the decode kernels do; the launch gap then
    overlaps the tail of the grid before). Where the driver refuses such a launch, the kernel is
    launched plainly and PDL stays off for the rest of the process (one warning)."""
    global _driver
    if _driver is None:
        from cupy.cuda import driver as _driver
    if launch.pdl and _PdlState.enabled:
        launch_ex = _cu_launch_kernel_ex()
        if launch_ex is not None:
            rc = launch_ex(pdl_config(launch, stream_ptr), fn.ptr, argv_ptr, None)
            if rc == 0:
                return
            # Refused (a driver, a stream capture or a virtualized GPU without programmatic launches):
            # launch it plainly below; if that works, stop asking for the rest of the process (the
            # kernels' griddepcontrol.wait is a no-op without it). If it fails too, its error is raised.
            _plain_launch(fn, launch, argv_ptr, stream_ptr)
            _PdlState.enabled = False
            logger.warning("programmatic dependent launch refused (CUresult %d): decode kernels launch without it", rc)
            return
    _plain_launch(fn, launch, argv_ptr, stream_ptr)


def _plain_launch(fn, launch, argv_ptr: int, stream_ptr: int) -> None:
    g, b = launch.grid, launch.block
    _driver.launchKernel(fn.ptr, g[0], g[1], g[2], b[0], b[1], b[2], launch.smem_bytes, stream_ptr, argv_ptr, 0)


class LaunchArgs(threading.local):
    """This thread's parameter bytes and the void*[1] argument array cuLaunchKernel reads. The driver
    copies the bytes at launch, so one buffer serves every launch of every call. 1024 bytes, 64-byte
    aligned: the TMA kernels' records start with 128-byte tensor maps (CUtensorMap is 64-byte aligned)."""

    def __init__(self, size: int = 1024, align: int = 64):
        self._raw = ctypes.create_string_buffer(size + align)
        offset = -ctypes.addressof(self._raw) % align
        self.buf = (ctypes.c_char * size).from_buffer(self._raw, offset)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self.argv)


#: Every launch's argument buffer (per thread). The decode path writes its record here and patches
#: the pointers in place (cuflash/kvcache.py _run); launch_record copies a whole record in.
ARGS = LaunchArgs()


def launch_record(fn, how, record: bytes, stream_ptr: int) -> None:
    """Launch ``fn`` as ``how`` (a plan.Launch) with ``record`` (a parameter struct's bytes, at most
    LaunchArgs' buffer) as its by-value argument."""
    args = ARGS
    if len(record) > len(args.buf):
        raise ValueError(f"a parameter record of {len(record)} bytes exceeds the {len(args.buf)}-byte launch buffer")
    ctypes.memmove(args.buf, record, len(record))
    launch(fn, how, args.argv_ptr, stream_ptr)
