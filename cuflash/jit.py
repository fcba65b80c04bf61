"""Kernel pipeline: spec -> source text -> NVRTC -> cubin -> disk cache -> loaded function.

The one place for compile flags, sources, NVRTC and compile logging; the cache format lives in
cuflash/cache.py, the launches in cuflash/launch.py. A spec (cuflash/plan) names its family (whose
header, entry kernel and parameter struct the registry plan.KERNEL_FAMILIES gives), its template
arguments, threads, CTAs per SM and shared memory: that is all this module needs to build it.

Environment
    CUFLASH_CACHE_DIR   cache folder (cuflash/cache.py)
    CUFLASH_LOG_LEVEL   level of the "cuflash" logger (default INFO: one line per compile)

The cache key hashes every byte NVRTC sees (the generated entry source and every header it
includes, which are handed to NVRTC from memory, never read again from disk), the NVRTC version,
the options, the arch and the cuflash version.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import multiprocessing
import os
import re
import threading
import time
from pathlib import Path

from . import cache, plan
from ._version import __version__

logger = logging.getLogger("cuflash")

# ---------------------------------------------------------------------------------------------
# Flags, logging, sources
# ---------------------------------------------------------------------------------------------

#: Options every compile gets; the arch is added per variant. -Xptxas=-v puts ptxas's register /
#: spill report into the NVRTC log, which is parsed into each cache entry's header.
BASE_OPTIONS = ("-std=c++17", "-Xptxas=-v")

#: The generated entry point of every variant: an extern "C" kernel named after the variant that
#: instantiates its family's templated kernel with the variant's template arguments.
ENTRY_TEMPLATE = (
    '#include "{header}"\n'
    'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks}){cluster}\n'
    "{name}({grid_constant}const cuflash::{params} params) {{\n"
    "    cuflash::{kernel}(params);\n"
    "}}\n"
)


def _configure_logging() -> None:
    level = os.environ.get("CUFLASH_LOG_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[cuflash] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_configure_logging()


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


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def entry_source(spec) -> str:
    family = spec.kernel_family
    cluster = getattr(spec, "cluster", 1)  # CTAs per thread-block cluster, fixed at compile time (cuLaunchKernel honours it)
    return ENTRY_TEMPLATE.format(header=family.header, threads=spec.threads, min_blocks=spec.min_blocks,
                                 cluster=f" __cluster_dims__({cluster}, 1, 1)" if cluster > 1 else "",
                                 name=spec.name, grid_constant="__grid_constant__ " if family.grid_constant else "",
                                 params=family.params, kernel=spec.entry_kernel())  # fmt: skip


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


def source_bundle(spec, src_dir: Path | None = None) -> tuple[str, dict[str, str]]:
    """(entry source, {header name: text}): everything NVRTC will see for ``spec``, read once."""
    text = entry_source(spec)
    return text, included_headers(text, src_dir)


def cache_key(spec, src_dir: Path | None = None, nvrtc: tuple[int, int] | None = None,
              bundle: tuple[str, dict[str, str]] | None = None) -> str:  # fmt: skip
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


def entry_path(spec, key: str) -> Path:
    return cache.cache_dir() / f"{spec.name}-{key}.cubin"


def is_cached(spec) -> bool:
    """Whether the disk cache holds an entry for ``spec`` as this installation would compile it."""
    return entry_path(spec, cache_key(spec)).exists()


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


#: ptxas's notes that it took the asynchrony out of a kernel's wgmma (sm_90a): C7515, every wgmma
#: serialized (a non-wgmma write to an accumulator inside a pipeline stage); C7513, the same for a
#: wgmma's other input registers (the A fragments of P V, session 24's look-ahead: 0.66x); C7517, a
#: wait injected before registers a wgmma still defines are used. Each cost the TMA forward 20% and more.
#: C7512, every wgmma serialized for want of registers (the TMA backward's 128-row query blocks with dV
#: issued before dS^T, as at 64 rows: a wait after each wgmma and 48 bytes parked).
_WGMMA_NOTES = {"wgmma_serialized": "(C7515)", "wgmma_inputs_serialized": "(C7513)", "wgmma_waits_injected": "(C7517)",
                "wgmma_serialized_registers": "(C7512)"}


def parse_ptxas_report(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ptxas -v output (first kernel in the log), and the
    number of each wgmma performance note (_WGMMA_NOTES) where there is one."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(log)
        if m:
            out[key] = int(m.group(1))
    for key, code in _WGMMA_NOTES.items():
        if code in log:
            out[key] = log.count(code)
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
    spec, src_dir: Path | None = None, bundle: tuple[str, dict[str, str]] | None = None,
    extra_options: tuple[str, ...] = (),
) -> tuple[bytes, dict]:
    """Compile ``spec`` with NVRTC (no GPU needed). Returns (cubin, header dict). ``extra_options``
    (e.g. a -D for a diagnostic build) go after the usual ones; such cubins
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
# Compile or load from the disk cache
# ---------------------------------------------------------------------------------------------

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


def get_cubin(spec, *, require_cache_write: bool = False) -> tuple[bytes, dict, str]:
    """Cubin of ``spec`` from the disk cache, compiling (and caching) it if absent or damaged.

    Returns (cubin, header, how) with how in {"cache", "compiled"}. A cache that cannot be written
    is a warning (the process still runs), or cache.CacheWriteError with ``require_cache_write``
    (precompile: its whole point is the cache).
    """
    bundle = source_bundle(spec)  # read once: the key hashes exactly the bytes that get compiled
    key = cache_key(spec, bundle=bundle)
    path = entry_path(spec, key)
    if path.exists():
        try:
            cubin, header = cache.decode_entry(path.read_bytes())
            _count("disk_loads")
            cache.touch(path)
            return cubin, header, "cache"
        except (ValueError, OSError) as exc:
            _count("corrupt_entries")
            logger.warning("cache entry %s is damaged (%s); recompiling", path.name, exc)
            try:
                path.unlink()
            except OSError:  # gone already, or a read-only cache: the rewrite below will say so
                pass
    logger.debug("compiling %s ...", spec.name)
    cubin, header = compile_cubin(spec, bundle=bundle)
    _count("compiles")
    p = header["ptxas"]
    logger.info("compiled %s in %.1fs (%s registers, %s bytes spilled)", spec.name, header["compile_seconds"],
                p.get("registers", "?"), p.get("spill_stores", "?"))  # fmt: skip
    for key in _WGMMA_NOTES:
        if p.get(key):
            logger.warning("%s: ptxas reports %s (%s): its wgmma run in sequence", spec.name, key, _WGMMA_NOTES[key])
    try:
        cache.write_atomic(path, cache.encode_entry(cubin, header))
    except OSError as exc:
        if require_cache_write:
            raise cache.CacheWriteError(
                f"could not write the kernel cache entry {path} ({exc.strerror or exc}); set CUFLASH_CACHE_DIR to a "
                "writable folder"
            ) from None
        logger.warning("could not write cache entry %s: %s", path, exc)  # a read-only cache still lets the process run
    return cubin, header, "compiled"


def _precompile_one(spec) -> tuple[str, str, dict]:
    _, header, how = get_cubin(spec, require_cache_write=True)
    return spec.name, how, header


def precompile(specs, jobs: int = 1, on_done=None) -> list[tuple[str, str, dict]]:
    """Compile ``specs`` into the disk cache (no GPU needed). ``on_done(result)`` is called after each.
    A cache entry that cannot be written raises cache.CacheWriteError.

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


@functools.lru_cache(maxsize=None)
def device_sm_count(device_id: int) -> int:
    """Streaming multiprocessors of the device (the decode plan fills them)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


@functools.lru_cache(maxsize=None)
def device_l2_bytes(device_id: int) -> int:
    """L2 cache bytes of the device (the persistent forward sizes its walk's groups by it)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["l2CacheSize"])


def get_function(spec, device_id: int):
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
            limit = spec.launch_smem_limit
            if limit > 48 * 1024:  # above 48 KB the dynamic limit must be raised first
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit)
        _count("module_loads")
        _functions[key] = fn
        return fn
