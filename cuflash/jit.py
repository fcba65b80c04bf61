"""Kernel pipeline: KernelSpec -> source text -> NVRTC -> cubin -> disk cache -> loaded function.

The one place for compile flags, cache paths, environment variables and compile logging.

Environment
    CUFLASH_CACHE_DIR   cache folder (default: $XDG_CACHE_HOME/cuflash or ~/.cache/cuflash)
    CUFLASH_LOG_LEVEL   level of the "cuflash" logger (default INFO: one line per compile)
    CUFLASH_PDL         0 turns off programmatic dependent launch of the decode kernels (default on
                        from sm_90; see launch)

Cache entries are single files ``<variant name>-<key>.cubin`` holding a checksum, a JSON header
(variant, arch, NVRTC version, ptxas register/spill report, compile seconds) and the cubin. The
key hashes every byte NVRTC sees (the generated entry source and every header it includes, which
are handed to NVRTC from memory, never read again from disk), the NVRTC version, the options, the
arch and the cuflash version. Entries are written to a temporary file and renamed into place, so
concurrent compiles of one variant both succeed and the last rename wins; there are no locks to
go stale. An entry whose checksum does not match is deleted and rebuilt.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import plan
from ._version import __version__

logger = logging.getLogger("cuflash")

# ---------------------------------------------------------------------------------------------
# Environment and flags
# ---------------------------------------------------------------------------------------------

#: Options every compile gets; the arch is added per variant. -Xptxas=-v puts ptxas's register /
#: spill report into the NVRTC log, which is parsed into each cache entry's header.
BASE_OPTIONS = ("-std=c++17", "-Xptxas=-v")

#: Generated entry point per kernel family: an extern "C" wrapper named after the variant, which
#: instantiates the templated kernel with the variant's arguments. A spec of any family provides
#: family, name, arch, threads, min_blocks, smem_bytes and template_args() (see plan.KernelSpec).
ENTRY_TEMPLATES = {
    "flash_fwd": (
        '#include "flash_fwd.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::FwdParams params) {{\n"
        "    cuflash::flash_fwd_kernel<cuflash::FwdConfig<{template_args}>>(params);\n"
        "}}\n"
    ),
    "flash_fwd_sm90": (
        '#include "flash_fwd_sm90.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::FwdParams params) {{\n"
        "    cuflash::flash_fwd_sm90_kernel<cuflash::Sm90FwdConfig<{template_args}>>(params);\n"
        "}}\n"
    ),
    "flash_bwd": (
        '#include "flash_bwd.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::BwdParams params) {{\n"
        "    cuflash::flash_bwd_kernel<cuflash::BwdConfig<{template_args}>>(params);\n"
        "}}\n"
    ),
    "flash_bwd_sm90": (
        '#include "flash_bwd_sm90.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::BwdParams params) {{\n"
        "    cuflash::flash_bwd_sm90_kernel<cuflash::Sm90BwdConfig<{template_args}>>(params);\n"
        "}}\n"
    ),
    "flash_bwd_pre": (
        '#include "flash_bwd.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::BwdParams params) {{\n"
        "    cuflash::flash_bwd_pre_kernel<{template_args}>(params);\n"
        "}}\n"
    ),
    "flash_bwd_convert": (
        '#include "flash_bwd.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::BwdParams params) {{\n"
        "    cuflash::flash_bwd_convert_kernel<{template_args}>(params);\n"
        "}}\n"
    ),
    "flash_decode": (
        '#include "flash_decode.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::DecodeParams params) {{\n"
        "    cuflash::flash_decode_kernel<cuflash::DecodeConfig<{template_args}>>(params);\n"
        "}}\n"
    ),
    "flash_decode_combine": (
        '#include "flash_decode_combine.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::DecodeParams params) {{\n"
        "    cuflash::flash_decode_combine_kernel<{template_args}>(params);\n"
        "}}\n"
    ),
    "flash_decode_append": (
        '#include "flash_decode_append.cuh"\n'
        'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})\n'
        "{name}(const cuflash::DecodeParams params) {{\n"
        "    cuflash::flash_decode_append_kernel<{template_args}>(params);\n"
        "}}\n"
    ),
}

_MAGIC = b"CUFLASH-CUBIN-1\n"


def _configure_logging() -> None:
    level = os.environ.get("CUFLASH_LOG_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[cuflash] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_configure_logging()


def cache_dir() -> Path:
    """Folder of the disk cache (created on first write)."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuflash"


def source_dir() -> Path:
    """Folder of the CUDA sources: cuflash/cuda_src in a wheel, <repo>/cuda_src in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "primitives.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuflash kernel sources not found next to {here}; the installation is incomplete")


def compile_options(arch: str) -> tuple[str, ...]:
    return BASE_OPTIONS + (f"-arch={arch}",)


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


# ---------------------------------------------------------------------------------------------
# Source text and cache key
# ---------------------------------------------------------------------------------------------

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def entry_source(spec: plan.KernelSpec) -> str:
    return ENTRY_TEMPLATES[spec.family].format(
        threads=spec.threads, min_blocks=spec.min_blocks, name=spec.name, template_args=spec.template_args()
    )


def included_headers(text: str, src_dir: Path | None = None) -> dict[str, str]:
    """Every quoted #include reachable from ``text``, by name, read from ``src_dir``."""
    src_dir = src_dir or source_dir()
    found: dict[str, str] = {}
    pending = _INCLUDE_RE.findall(text)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = src_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"header {name!r} included by a cuflash kernel is missing from {src_dir}")
        found[name] = path.read_text()
        pending.extend(_INCLUDE_RE.findall(found[name]))
    return dict(sorted(found.items()))


def source_bundle(spec: plan.KernelSpec, src_dir: Path | None = None) -> tuple[str, dict[str, str]]:
    """(entry source, {header name: text}): everything NVRTC will see for ``spec``, read once."""
    text = entry_source(spec)
    return text, included_headers(text, src_dir)


def cache_key(
    spec: plan.KernelSpec,
    src_dir: Path | None = None,
    nvrtc: tuple[int, int] | None = None,
    bundle: tuple[str, dict[str, str]] | None = None,
) -> str:
    text, headers = bundle or source_bundle(spec, src_dir)
    h = hashlib.sha256()
    for part in (
        f"cuflash {__version__}",
        f"nvrtc {nvrtc or nvrtc_version()}",
        f"arch {spec.arch}",
        "options " + " ".join(compile_options(spec.arch)),
        text,
    ):
        h.update(part.encode())
        h.update(b"\0")
    for name, body in headers.items():
        h.update(name.encode() + b"\0" + body.encode() + b"\0")
    return h.hexdigest()[:24]


def entry_path(spec: plan.KernelSpec, key: str) -> Path:
    return cache_dir() / f"{spec.name}-{key}.cubin"


# ---------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------


class CompileError(RuntimeError):
    """NVRTC rejected a kernel variant; the message holds the variant name and NVRTC's log."""


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas_report(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ptxas -v output (first kernel in the log)."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(log)
        if m:
            out[key] = int(m.group(1))
    return out


_EIATTR_REGCOUNT = 0x2F  # .nv.info attribute: registers per thread of a kernel
_EIATTR_FRAME_SIZE = 0x11  # .nv.info attribute: stack frame (local memory) bytes per thread
_EIFMT_SVAL = 0x04  # attribute with a 16-bit size and a payload


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack frame bytes per thread, read from the cubin's ELF .nv.info section.

    Authoritative even when NVRTC serves a program from its own cache (NVRTC 12.9+) and ptxas's
    -v report is then missing from the log. A stack frame > 0 means local memory: spills or
    arrays the compiler could not keep in registers.
    """
    import struct as st

    if len(cubin) < 0x40 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    try:
        return _nv_info_resources(cubin)
    except (IndexError, ValueError, st.error) as exc:
        raise ValueError(f"truncated or malformed cubin ({exc})") from exc


def _nv_info_resources(cubin: bytes) -> dict[str, int]:
    import struct as st

    shoff = st.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = st.unpack_from("<HHH", cubin, 0x3A)
    headers = [st.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off, names_size = headers[shstrndx][4], headers[shstrndx][5]
    names = cubin[names_off : names_off + names_size]
    out: dict[str, int] = {}
    for h in headers:
        if names[h[0] : names.index(b"\0", h[0])] != b".nv.info":
            continue
        off, end = h[4], h[4] + h[5]
        while off + 4 <= end:
            fmt, attr = cubin[off], cubin[off + 1]
            if fmt != _EIFMT_SVAL:
                off += 4
                continue
            size = st.unpack_from("<H", cubin, off + 2)[0]
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                _, value = st.unpack_from("<II", cubin, off + 4)
                key = "registers" if attr == _EIATTR_REGCOUNT else "stack_frame"
                out[key] = max(out.get(key, 0), value)
            off += 4 + size
    return out


def compile_cubin(
    spec: plan.KernelSpec, src_dir: Path | None = None, bundle: tuple[str, dict[str, str]] | None = None,
    extra_options: tuple[str, ...] = (),
) -> tuple[bytes, dict]:
    """Compile ``spec`` with NVRTC (no GPU needed). Returns (cubin, header dict). ``extra_options``
    (e.g. a -D for a diagnostic build, tools/trace_decode.py) go after the usual ones; such cubins
    are never written to the cache."""
    from cupy.cuda import nvrtc

    text, headers = bundle or source_bundle(spec, src_dir)
    options = compile_options(spec.arch) + tuple(extra_options)
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(
        text, f"{spec.name}.cu", [h.encode() for h in headers.values()], [n.encode() for n in headers]
    )
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed to compile {spec.name} ({' '.join(options)}):\n{log}") from exc
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - t0
    header = {
        "name": spec.name,
        "arch": spec.arch,
        "nvrtc": list(nvrtc_version()),
        "cuflash": __version__,
        "options": list(options),
        "compile_seconds": round(seconds, 3),
        "smem_bytes": spec.smem_bytes,
        "threads": spec.threads,
        # ptxas -v (registers, stack frame, spill bytes) when NVRTC ran ptxas; the cubin's own
        # registers / stack frame always (they agree when both are present).
        "ptxas": {**parse_ptxas_report(log), **cubin_resources(cubin)},
        "created": time.time(),
    }
    return cubin, header


# ---------------------------------------------------------------------------------------------
# Disk cache
# ---------------------------------------------------------------------------------------------


def _encode_entry(cubin: bytes, header: dict) -> bytes:
    meta = json.dumps(header, sort_keys=True).encode()
    payload = struct.pack("<I", len(meta)) + meta + cubin
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode_entry(blob: bytes) -> tuple[bytes, dict]:
    """(cubin, header); raises ValueError on a truncated or corrupted entry."""
    n = len(_MAGIC)
    if len(blob) < n + 36 or blob[:n] != _MAGIC:
        raise ValueError("not a cuflash cache entry")
    digest, payload = blob[n : n + 32], blob[n + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupted)")
    (meta_len,) = struct.unpack("<I", payload[:4])
    header = json.loads(payload[4 : 4 + meta_len])
    cubin = payload[4 + meta_len :]
    if not cubin:
        raise ValueError("empty cubin")
    return cubin, header


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


_stats_lock = threading.Lock()
_stats = {"compiles": 0, "disk_loads": 0, "module_loads": 0, "corrupt_entries": 0}


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


def stats() -> dict[str, int]:
    """Counters of this process: NVRTC compiles, cubins read from the disk cache, modules loaded."""
    with _stats_lock:
        return dict(_stats)


def reset_stats() -> None:
    with _stats_lock:
        for k in _stats:
            _stats[k] = 0


def get_cubin(spec: plan.KernelSpec) -> tuple[bytes, dict, str]:
    """Cubin of ``spec`` from the disk cache, compiling (and caching) it if absent or damaged.

    Returns (cubin, header, how) with how in {"cache", "compiled"}.
    """
    bundle = source_bundle(spec)  # read once: the key hashes exactly the bytes that get compiled
    key = cache_key(spec, bundle=bundle)
    path = entry_path(spec, key)
    if path.exists():
        try:
            cubin, header = _decode_entry(path.read_bytes())
            _count("disk_loads")
            return cubin, header, "cache"
        except (ValueError, OSError) as exc:
            _count("corrupt_entries")
            logger.warning("cache entry %s is damaged (%s); recompiling", path.name, exc)
            try:
                path.unlink()
            except OSError:  # gone already, or a read-only cache: the rewrite below will say so
                pass
    logger.info("compiling %s ...", spec.name)
    cubin, header = compile_cubin(spec, bundle=bundle)
    _count("compiles")
    try:
        _write_atomic(path, _encode_entry(cubin, header))
    except OSError as exc:  # a read-only cache still lets the process run
        logger.warning("could not write cache entry %s: %s", path, exc)
    p = header["ptxas"]
    logger.info(
        "compiled %s in %.1fs (%s registers, %s bytes spilled)",
        spec.name,
        header["compile_seconds"],
        p.get("registers", "?"),
        p.get("spill_stores", "?"),
    )
    return cubin, header, "compiled"


@dataclass
class CacheEntry:
    path: Path
    header: dict | None  # None when the entry is damaged
    size: int
    error: str | None = None


def list_cache() -> list[CacheEntry]:
    entries = []
    d = cache_dir()
    if not d.is_dir():
        return entries
    for path in sorted(d.glob("*.cubin")):
        try:
            blob = path.read_bytes()
        except FileNotFoundError:  # removed by another process since the listing
            continue
        try:
            _, header = _decode_entry(blob)
            entries.append(CacheEntry(path, header, len(blob)))
        except ValueError as exc:
            entries.append(CacheEntry(path, None, len(blob), str(exc)))
    return entries


def clear_cache() -> int:
    """Delete every cache entry (and stray temporary files); returns the number of files removed."""
    d = cache_dir()
    if not d.is_dir():
        return 0
    n = 0
    for path in list(d.glob("*.cubin")) + list(d.glob("*.tmp")):
        try:
            path.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation
# ---------------------------------------------------------------------------------------------


def _precompile_one(spec: plan.KernelSpec) -> tuple[str, str, dict]:
    _, header, how = get_cubin(spec)
    return spec.name, how, header


def precompile(specs, jobs: int = 1, on_done=None) -> list[tuple[str, str, dict]]:
    """Compile ``specs`` into the disk cache (no GPU needed). ``on_done(result)`` is called after each.

    With jobs > 1 the compiles run in separate processes (NVRTC holds the interpreter otherwise).
    """
    specs = list(specs)
    results = []
    if jobs <= 1 or len(specs) <= 1:
        for spec in specs:
            r = _precompile_one(spec)
            results.append(r)
            if on_done:
                on_done(r)
        return results
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_precompile_one, s) for s in specs]
        try:
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                _count("compiles" if r[1] == "compiled" else "disk_loads")  # the worker's counters die with it
                results.append(r)
                if on_done:
                    on_done(r)
        except BaseException:
            for f in futures:  # a compile error (or ^C) stops the queued compiles too
                f.cancel()
            raise
    return results


# ---------------------------------------------------------------------------------------------
# Loading on a device
# ---------------------------------------------------------------------------------------------

_functions: dict = {}
_functions_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def device_arch(device_id: int) -> str:
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return plan.arch_for_capability(int(cc[:-1]), int(cc[-1]))


_driver = None

#: Programmatic dependent launch of the launches that allow it (plan.Launch.pdl); CUFLASH_PDL=0: never.
PDL_ENABLED = os.environ.get("CUFLASH_PDL", "1").strip() != "0"


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


def pdl_config(launch: plan.Launch, stream_ptr: int) -> CULaunchConfig:
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


def launch(fn, launch: plan.Launch, argv_ptr: int, stream_ptr: int) -> None:
    """Launch a loaded function on the current device: ``argv_ptr`` is the address of the kernel's
    argument array (void*[1] pointing at the parameter struct's bytes, which the driver copies),
    ``stream_ptr`` the stream handle. Straight to the driver: CuPy's generic argument packing costs
    microseconds per launch, and a decode step is only a few microseconds of GPU time.

    Launches with ``launch.pdl`` go through cuLaunchKernelEx with programmatic stream serialization:
    the kernel may start while the one before it on the stream finishes, and waits for it in
    griddepcontrol.wait before touching global memory (the decode kernels do; the launch gap then
    overlaps the tail of the grid before). Where the driver refuses such a launch, the kernel is
    launched plainly and PDL stays off for the rest of the process (one warning)."""
    global _driver, PDL_ENABLED
    if _driver is None:
        from cupy.cuda import driver as _driver
    if launch.pdl and PDL_ENABLED:
        launch_ex = _cu_launch_kernel_ex()
        if launch_ex is not None:
            rc = launch_ex(pdl_config(launch, stream_ptr), fn.ptr, argv_ptr, None)
            if rc == 0:
                return
            # Refused (a driver, a stream capture or a virtualized GPU without programmatic launches):
            # launch it plainly below; if that works, stop asking for the rest of the process (the
            # kernels' griddepcontrol.wait is a no-op without it). If it fails too, its error is raised.
            _plain_launch(fn, launch, argv_ptr, stream_ptr)
            PDL_ENABLED = False
            logger.warning("programmatic dependent launch refused (CUresult %d): decode kernels launch without it", rc)
            return
    _plain_launch(fn, launch, argv_ptr, stream_ptr)


def _plain_launch(fn, launch: plan.Launch, argv_ptr: int, stream_ptr: int) -> None:
    g, b = launch.grid, launch.block
    _driver.launchKernel(fn.ptr, g[0], g[1], g[2], b[0], b[1], b[2], launch.smem_bytes, stream_ptr, argv_ptr, 0)


def get_function(spec: plan.KernelSpec, device_id: int):
    """Loaded kernel of ``spec`` on ``device_id``: memoized per process and device."""
    key = (spec, device_id)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _functions_lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        import cupy
        from cupy.cuda import driver, function

        cubin, header, _ = get_cubin(spec)
        with cupy.cuda.Device(device_id):
            module = function.Module()
            module.load(cubin)
            fn = module.get_function(spec.name)
            limit = plan.max_launch_smem(spec)
            if limit > 48 * 1024:  # above 48 KB the dynamic limit must be raised first
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit)
        _count("module_loads")
        _functions[key] = fn
        return fn
