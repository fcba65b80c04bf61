"""CPU tests of the kernel pipeline (cuflash/jit.py: key, compile log, ptxas report) and its disk
cache (cuflash/cache.py: entry format, atomic writes, damage, concurrency, pruning), and of the launch
path (cuflash/launch.py, driver calls faked).

NVRTC compiles on the CPU (no GPU, no driver). Every test uses a temporary cache folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from cuflash import cache as kcache
from cuflash import jit, launch, plan
from cuflash._version import __version__

REPO = Path(__file__).resolve().parent.parent
NVRTC = (12, 9)  # a fixed version for key tests: the key must not depend on the machine's NVRTC
#: A cheap variant to compile (~0.5 s).
CHEAP = plan.fwd_spec(32, "fp16", False, True, "sm_80")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "kernel-cache"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    jit.reset_stats()
    return d


@pytest.fixture(scope="module")
def compiled_with_log():
    """(cubin, header, NVRTC log) of CHEAP, compiled once for the module; the log is caught on its
    way into jit (it is empty when NVRTC 12.9+ serves the program from its own cache)."""
    from cupy.cuda import nvrtc

    logs = []
    real = nvrtc.getProgramLog

    def spy(prog):
        logs.append(real(prog))
        return logs[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nvrtc, "getProgramLog", spy)
        cubin, header = jit.compile_cubin(CHEAP)
    assert len(logs) == 1
    return cubin, header, logs[0]


@pytest.fixture(scope="module")
def compiled(compiled_with_log):
    """(cubin, header, encoded entry) of CHEAP, compiled once for the module."""
    cubin, header, _ = compiled_with_log
    return cubin, header, kcache.encode_entry(cubin, header)


class ListHandler(logging.Handler):
    """Keeps every record it is handed (of every level)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _capture(level=None):
    """The "cuflash" logger's records (jit does not propagate to the root logger), at ``level`` or, with
    None, at the logger's own level; restored after."""
    h = ListHandler()
    log = logging.getLogger("cuflash")
    old = log.level
    if level is not None:
        log.setLevel(level)
    log.addHandler(h)
    yield h.records
    log.removeHandler(h)
    log.setLevel(old)


@pytest.fixture
def records():
    """Log records of the "cuflash" logger at INFO and above."""
    yield from _capture(logging.INFO)


def copy_sources(tmp_path) -> Path:
    dst = tmp_path / "cuda_src"
    shutil.copytree(jit.source_dir(), dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Cache key
# ---------------------------------------------------------------------------------------------


def test_key_is_stable(tmp_path, monkeypatch):
    src = copy_sources(tmp_path)
    k = jit.cache_key(CHEAP, nvrtc=NVRTC)
    assert jit.cache_key(CHEAP, nvrtc=NVRTC) == k
    assert jit.cache_key(plan.fwd_spec(32, "fp16", False, True, "sm_80"), nvrtc=NVRTC) == k  # equal spec
    assert jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC) == k  # byte-identical copy of the sources
    (src / "unrelated.cuh").write_text("#error never included\n")  # not reachable from the entry
    assert jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC) == k
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "elsewhere"))  # location is not part of it
    assert jit.cache_key(CHEAP, nvrtc=NVRTC) == k
    assert jit.cache_key(CHEAP) == jit.cache_key(CHEAP, nvrtc=jit.nvrtc_version())


def _positions(text: str) -> list[int]:
    """Spread-out byte positions of ``text`` outside #include lines (a changed include name would
    make the header missing, a different failure)."""
    n = len(text)
    out = []
    for p in sorted({0, 1, n // 7, n // 3, n // 2, 2 * n // 3, 6 * n // 7, n - 2, n - 1}):
        line_start = text.rfind("\n", 0, p) + 1
        line_end = text.find("\n", p)
        if "#include" in text[line_start : line_end if line_end >= 0 else n]:
            p = line_end + 1 if 0 <= line_end < n - 1 else line_start - 1
        out.append(p)
    return sorted(set(out))


@pytest.mark.parametrize("header", ["params.h", "primitives.cuh", "flash_fwd.cuh"])
def test_key_changes_with_any_byte_of_any_header(tmp_path, header):
    src = copy_sources(tmp_path)
    base = jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC)
    path = src / header
    original = path.read_bytes()
    seen = {base}
    positions = _positions(original.decode())
    assert len(positions) >= 5
    for p in positions:
        changed = bytearray(original)
        changed[p] = ord("y") if changed[p] == ord("x") else ord("x")
        path.write_bytes(bytes(changed))
        key = jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC)
        assert key not in seen, f"changing byte {p} of {header} left the key unchanged"
        seen.add(key)
    path.write_bytes(original + b" ")  # one trailing byte
    assert jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC) not in seen
    path.write_bytes(original)
    assert jit.cache_key(CHEAP, src_dir=src, nvrtc=NVRTC) == base


def test_key_changes_with_arch_nvrtc_version_and_options(monkeypatch):
    base = jit.cache_key(CHEAP, nvrtc=NVRTC)
    others = {
        "arch": jit.cache_key(plan.fwd_spec(32, "fp16", False, True, "sm_86"), nvrtc=NVRTC),
        "arch 90a": jit.cache_key(plan.fwd_spec(32, "fp16", False, True, "sm_90a"), nvrtc=NVRTC),
        "nvrtc minor": jit.cache_key(CHEAP, nvrtc=(12, 8)),
        "nvrtc major": jit.cache_key(CHEAP, nvrtc=(13, 9)),
    }
    monkeypatch.setattr(jit, "BASE_OPTIONS", jit.BASE_OPTIONS + ("-lineinfo",))
    others["options"] = jit.cache_key(CHEAP, nvrtc=NVRTC)
    monkeypatch.undo()
    monkeypatch.setattr(jit, "__version__", "0.0.0+other")
    others["cuflash version"] = jit.cache_key(CHEAP, nvrtc=NVRTC)
    for what, key in others.items():
        assert key != base, what
    assert len(set(others.values())) == len(others)


def test_key_differs_for_every_variant():
    specs = plan.all_fwd_specs("sm_80") + plan.all_fwd_specs("sm_90a")
    t = CHEAP.tile
    specs += [
        plan.with_tile(CHEAP, dataclasses.replace(t, block_m=64)),
        plan.with_tile(CHEAP, dataclasses.replace(t, block_n=64)),
        plan.with_tile(CHEAP, dataclasses.replace(t, warps=8)),
        plan.with_tile(CHEAP, dataclasses.replace(t, q_in_regs=not t.q_in_regs)),
        plan.with_tile(CHEAP, dataclasses.replace(t, min_blocks=3 - t.min_blocks)),
        plan.with_tile(CHEAP, dataclasses.replace(t, stages=3 - t.stages)),
    ]
    assert len(set(specs)) == len(specs)
    keys = [jit.cache_key(s, nvrtc=NVRTC) for s in specs]
    assert len(set(keys)) == len(specs)
    # and the entry file name spells the variant
    assert jit.entry_path(CHEAP, keys[0]).name == f"{CHEAP.name}-{keys[0]}.cubin"


# ---------------------------------------------------------------------------------------------
# included_headers
# ---------------------------------------------------------------------------------------------


def test_included_headers_of_the_forward_entry():
    text = jit.entry_source(CHEAP)
    assert CHEAP.name in text and CHEAP.template_args() in text
    headers = jit.included_headers(text)
    assert {"flash_fwd.cuh", "primitives.cuh", "params.h"} <= set(headers)
    for name, body in headers.items():
        assert body == (jit.source_dir() / name).read_text()


def test_included_headers_follows_chains_and_cycles(tmp_path):
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n#include <cuda_fp16.h>\n')
    (tmp_path / "b.h").write_text('  #  include "sub/c.h"\n// #include "commented_out.h"\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.h").write_text('#include "a.h"\nint c;\n')  # cycle back to a.h
    headers = jit.included_headers('#include "a.h"\n', tmp_path)
    assert list(headers) == ["a.h", "b.h", "sub/c.h"]
    assert headers["sub/c.h"] == '#include "a.h"\nint c;\n'


def test_included_headers_missing_file(tmp_path):
    src = copy_sources(tmp_path)
    (src / "params.h").unlink()
    with pytest.raises(FileNotFoundError, match="params.h"):
        jit.included_headers(jit.entry_source(CHEAP), src)


# ---------------------------------------------------------------------------------------------
# Entry format
# ---------------------------------------------------------------------------------------------


def test_entry_round_trip():
    header = {"name": "x", "ptxas": {"registers": 3}, "nvrtc": [12, 9]}
    cubin = bytes(range(256)) * 3
    assert kcache.decode_entry(kcache.encode_entry(cubin, header)) == (cubin, header)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"garbage",
        b"\x7fELF" + b"\0" * 200,  # a bare cubin is not an entry
        kcache._MAGIC,
        kcache._MAGIC + b"\0" * 36,
        kcache._MAGIC + b"\0" * 400,
        kcache.encode_entry(b"", {"name": "no cubin"}),
    ],
)
def test_decode_rejects_garbage(blob):
    with pytest.raises(ValueError):
        kcache.decode_entry(blob)


@settings(deadline=None, max_examples=200)
@given(prefix=st.sampled_from([b"", b"CUFLASH-CUBIN-1\n"]), body=st.binary(max_size=300))
def test_decode_rejects_random_bytes(prefix, body):
    with pytest.raises(ValueError):
        kcache.decode_entry(prefix + body)


@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_decode_detects_every_single_byte_change(data):
    blob = kcache.encode_entry(b"\x7fELF" + bytes(range(100)), {"name": "v", "arch": "sm_80"})
    i = data.draw(st.integers(0, len(blob) - 1), label="position")
    delta = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(blob)
    bad[i] ^= delta
    with pytest.raises(ValueError):
        kcache.decode_entry(bytes(bad))
    cut = data.draw(st.integers(0, len(blob) - 1), label="truncate to")
    with pytest.raises(ValueError):
        kcache.decode_entry(blob[:cut])


# ---------------------------------------------------------------------------------------------
# get_cubin: hits, damage, read-only caches
# ---------------------------------------------------------------------------------------------


def test_compile_then_hit(cache, compiled, records):
    cubin, header, how = jit.get_cubin(CHEAP)
    assert how == "compiled"
    assert cubin == compiled[0]  # NVRTC is deterministic
    assert header["name"] == CHEAP.name and header["arch"] == "sm_80"
    assert header["nvrtc"] == list(jit.nvrtc_version())
    assert 0 < header["ptxas"]["registers"] <= 255
    assert jit.stats()["compiles"] == 1
    files = list(cache.iterdir())
    assert [f.name for f in files] == [jit.entry_path(CHEAP, jit.cache_key(CHEAP)).name]

    compile_lines = [r for r in records if r.getMessage().startswith(f"compiled {CHEAP.name} in ")]
    assert len(compile_lines) == 1 and compile_lines[0].levelno == logging.INFO
    assert f"({header['ptxas']['registers']} registers, " in compile_lines[0].getMessage()

    records.clear()
    cubin2, header2, how2 = jit.get_cubin(CHEAP)
    assert (cubin2, header2, how2) == (cubin, header, "cache")
    assert jit.stats() == {"compiles": 1, "disk_loads": 1, "module_loads": 0, "corrupt_entries": 0}
    assert not [r for r in records if r.getMessage().startswith("compiled")]


def _damage(kind: str, blob: bytes) -> bytes:
    n = len(kcache._MAGIC)
    if kind == "empty":
        return b""
    if kind == "truncated":
        return blob[: len(blob) // 2]
    if kind == "last byte missing":
        return blob[:-1]
    if kind == "extra bytes":
        return blob + b"\0"
    pos = {"magic": 3, "checksum": n + 5, "header": n + 32 + 10, "cubin": len(blob) - 100}[kind]
    bad = bytearray(blob)
    bad[pos] ^= 0x40
    return bytes(bad)


@pytest.mark.parametrize("kind", ["empty", "truncated", "last byte missing", "extra bytes", "magic", "checksum", "header", "cubin"])
def test_damaged_entry_is_recompiled(cache, compiled, records, kind):
    cubin, _, blob = compiled
    path = jit.entry_path(CHEAP, jit.cache_key(CHEAP))
    path.parent.mkdir(parents=True)
    path.write_bytes(_damage(kind, blob))

    got, header, how = jit.get_cubin(CHEAP)
    assert how == "compiled" and got == cubin
    s = jit.stats()
    assert s["corrupt_entries"] == 1 and s["compiles"] == 1 and s["disk_loads"] == 0
    assert any(r.levelno == logging.WARNING and "damaged" in r.getMessage() for r in records)
    assert kcache.decode_entry(path.read_bytes())[0] == cubin  # rewritten whole
    assert [p.name for p in cache.iterdir()] == [path.name]
    assert jit.get_cubin(CHEAP)[2] == "cache"


def test_damaged_entry_is_deleted_even_if_rewrite_fails(cache, compiled, monkeypatch):
    path = jit.entry_path(CHEAP, jit.cache_key(CHEAP))
    path.parent.mkdir(parents=True)
    path.write_bytes(compiled[2][:-10])

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kcache, "write_atomic", refuse)
    cubin, _, how = jit.get_cubin(CHEAP)
    assert how == "compiled" and cubin == compiled[0]
    assert not path.exists()
    assert jit.stats()["corrupt_entries"] == 1


def test_failed_write_leaves_no_partial_file(cache, monkeypatch):
    path = cache / "x.cubin"

    def crash(src, dst):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        kcache.write_atomic(path, b"data")
    assert list(cache.iterdir()) == []


def test_stale_temporary_files_are_harmless(cache, compiled):
    cache.mkdir()
    stale = cache / f"{CHEAP.name}-deadbeef.cubin.abc123.tmp"
    stale.write_bytes(compiled[2][:50])  # what a writer killed mid-write leaves behind
    assert jit.get_cubin(CHEAP)[2] == "compiled"
    assert jit.get_cubin(CHEAP)[2] == "cache"
    assert len(kcache.list_entries()) == 1  # temporary files are not entries
    assert kcache.clear() == 2
    assert list(cache.iterdir()) == []


def _check_read_only_result(cache, compiled, records, result):
    cubin, header, how = result
    assert how == "compiled" and cubin == compiled[0] and header["name"] == CHEAP.name
    assert any(r.levelno == logging.WARNING and "could not write" in r.getMessage() for r in records)
    assert not list(cache.glob("*.cubin")) and not list(cache.glob("*.tmp"))


def test_read_only_cache_dir(cache, compiled, records):
    cache.mkdir()
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(cache, os.W_OK):
            pytest.skip("running as root: a read-only mode does not stop writes")
        _check_read_only_result(cache, compiled, records, jit.get_cubin(CHEAP))
    finally:
        cache.chmod(stat.S_IRWXU)


def test_unwritable_cache_dir_simulated(cache, compiled, records, monkeypatch):
    """The same as above for root: creating the temporary file fails with EACCES."""
    cache.mkdir()

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache))

    monkeypatch.setattr(kcache.tempfile, "mkstemp", denied)
    _check_read_only_result(cache, compiled, records, jit.get_cubin(CHEAP))


def test_damaged_entry_in_read_only_cache(cache, compiled, records, monkeypatch):
    """A damaged entry that cannot be deleted (read-only cache) still yields a cubin."""
    path = jit.entry_path(CHEAP, jit.cache_key(CHEAP))
    cache.mkdir()
    path.write_bytes(b"junk")
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.parent == cache:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache))

    monkeypatch.setattr(kcache.tempfile, "mkstemp", denied)
    cubin, _, how = jit.get_cubin(CHEAP)
    assert how == "compiled" and cubin == compiled[0]
    assert jit.stats()["corrupt_entries"] == 1
    assert any(r.levelno == logging.WARNING and "could not write" in r.getMessage() for r in records)
    assert path.read_bytes() == b"junk"  # left alone: nothing could be done about it


# ---------------------------------------------------------------------------------------------
# Writes that fail: a warning for a process that only needs the kernel, an error for precompile
# ---------------------------------------------------------------------------------------------


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_failed_cache_write_is_only_a_warning_without_require(cache, compiled, records, monkeypatch):
    monkeypatch.setattr(kcache, "write_atomic", _no_space)
    cubin, header, how = jit.get_cubin(CHEAP)
    assert how == "compiled" and cubin == compiled[0] and header["name"] == CHEAP.name
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not write" in warnings[0].getMessage()
    assert "No space left" in warnings[0].getMessage()


def test_failed_cache_write_raises_with_require_cache_write(cache, compiled, records, monkeypatch):
    monkeypatch.setattr(kcache, "write_atomic", _no_space)
    with pytest.raises(kcache.CacheWriteError, match="No space left on device") as info:
        jit.get_cubin(CHEAP, require_cache_write=True)
    assert "CUFLASH_CACHE_DIR" in str(info.value) and CHEAP.name in str(info.value)
    assert isinstance(info.value, OSError)
    assert not [r for r in records if r.levelno >= logging.WARNING]  # an error, not a warning as well


def test_precompile_raises_when_a_write_fails_midway(cache, cache_full_after_one_entry):
    """jit.precompile's whole point is the cache: the first entry that cannot be written (the disk
    filled up after the first variant) stops it with cache.CacheWriteError; what was written stays."""
    other = plan.fwd_spec(32, "fp16", False, False, "sm_80")  # CHEAP's element-wise twin
    done = []
    with pytest.raises(kcache.CacheWriteError, match="could not write the kernel cache entry"):
        jit.precompile([CHEAP, other], on_done=done.append)
    assert [r[0] for r in done] == [CHEAP.name]  # the first one was reported done, the second never
    assert [e.header["name"] for e in kcache.list_entries()] == [CHEAP.name]
    assert not list(cache.glob("*.tmp"))


def test_check_writable(tmp_path):
    d = tmp_path / "new" / "cache"
    assert kcache.check_writable(d) == d and d.is_dir()
    assert list(d.iterdir()) == []  # the probe file is gone
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for bad in (afile, afile / "cache"):  # a file, and a folder that would have to live inside one
        with pytest.raises(kcache.CacheWriteError, match="is not writable") as info:
            kcache.check_writable(bad)
        assert str(bad) in str(info.value) and "CUFLASH_CACHE_DIR" in str(info.value)
    assert afile.read_text() == "not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "new"]


def test_check_writable_defaults_to_the_cache_dir(cache):
    assert kcache.cache_dir() == cache and not cache.exists()
    assert kcache.check_writable() == cache and cache.is_dir()


def test_loading_an_entry_marks_it_used(cache, compiled):
    """A cache hit refreshes the entry's mtime: prune(max_bytes=...) removes the least recently used."""
    path = jit.entry_path(CHEAP, jit.cache_key(CHEAP))
    kcache.write_atomic(path, compiled[2])
    old = time.time() - 30 * 86400
    os.utime(path, (old, old))
    assert jit.get_cubin(CHEAP)[2] == "cache"
    assert path.stat().st_mtime > old + 29 * 86400
    (entry,) = kcache.list_entries()
    assert entry.mtime == path.stat().st_mtime


# ---------------------------------------------------------------------------------------------
# cache.prune: entries that can never be loaded again, stale temporary files, a size cap
# ---------------------------------------------------------------------------------------------

_NVRTC_HERE = (12, 9)


def _entry(d: Path, name: str, *, version=__version__, nvrtc=_NVRTC_HERE, size=1000, age_s=0.0) -> Path:
    """A cache entry file (any non-empty bytes serve as its cubin) written age_s seconds ago."""
    header = {"name": name, "arch": "sm_80", "nvrtc": list(nvrtc), "cuflash": version}
    path = d / f"{name}-0123456789abcdef01234567.cubin"
    kcache.write_atomic(path, kcache.encode_entry(b"\x7fELF" + bytes(size), header))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _prune(d, **kw):
    return kcache.prune(version=__version__, nvrtc=_NVRTC_HERE, d=d, **kw)


def test_prune_removes_what_can_never_be_loaded(tmp_path):
    d = tmp_path / "c"
    good = [_entry(d, "good_a"), _entry(d, "good_b", age_s=86400 * 400)]  # old but loadable: kept
    other_version = _entry(d, "other_version", version="0.0.1")
    other_nvrtc = _entry(d, "other_nvrtc", nvrtc=(11, 8))
    other_minor = _entry(d, "other_minor", nvrtc=(12, 8))
    damaged = d / "damaged-0123.cubin"
    damaged.write_bytes(good[0].read_bytes()[:-5])
    garbage = d / "garbage-0123.cubin"
    garbage.write_bytes(b"junk")
    stale_tmp = d / "good_a-0123.cubin.k2j3h4.tmp"
    stale_tmp.write_bytes(b"half an entry")
    os.utime(stale_tmp, (time.time() - 7200, time.time() - 7200))
    fresh_tmp = d / "good_b-0123.cubin.x9y8z7.tmp"  # a compile writing right now
    fresh_tmp.write_bytes(b"being written")
    unrelated = d / "README.txt"
    unrelated.write_text("not ours")
    sizes = {p.name: p.stat().st_size for p in d.iterdir()}

    r = _prune(d)
    reasons = dict(r.removed)
    assert set(reasons) == {other_version.name, other_nvrtc.name, other_minor.name, damaged.name, garbage.name,
                            stale_tmp.name}  # fmt: skip
    assert reasons[other_version.name] == "built by cuflash 0.0.1"
    assert reasons[other_nvrtc.name] == "built by NVRTC 11.8" and reasons[other_minor.name] == "built by NVRTC 12.8"
    assert reasons[damaged.name].startswith("damaged (checksum") and reasons[garbage.name].startswith("damaged (")
    assert reasons[stale_tmp.name] == "temporary file of an interrupted compile"
    assert sorted(p.name for p in d.iterdir()) == sorted([good[0].name, good[1].name, fresh_tmp.name, unrelated.name])
    assert (r.kept, r.kept_bytes) == (2, sizes[good[0].name] + sizes[good[1].name])
    assert r.freed_bytes == sum(sizes[n] for n in reasons)
    assert _prune(d).removed == []  # nothing left to do
    assert kcache.prune(version="0.0.1", nvrtc=_NVRTC_HERE, d=d).kept == 0  # another installation's view


def test_prune_skips_what_it_cannot_remove(tmp_path, monkeypatch):
    """A file prune may not delete (a shared, read-only cache) is left and not counted; no exception."""
    d = tmp_path / "c"
    keep = _entry(d, "other_version", version="0.0.1")
    gone = _entry(d, "other_nvrtc", nvrtc=(11, 8))
    real_unlink = Path.unlink

    def unlink(self, *args, **kw):
        if self.name == keep.name:
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, *args, **kw)

    monkeypatch.setattr(Path, "unlink", unlink)
    r = _prune(d)
    assert [name for name, _ in r.removed] == [gone.name] and keep.exists() and not gone.exists()
    assert kcache.clear(d) == 0 and keep.exists()


def test_prune_without_an_nvrtc_version_keeps_every_nvrtc(tmp_path):
    d = tmp_path / "c"
    _entry(d, "a", nvrtc=(11, 8))
    _entry(d, "b", nvrtc=(13, 0))
    r = kcache.prune(version=__version__, nvrtc=None, d=d)
    assert r.removed == [] and r.kept == 2


def test_prune_to_a_size_removes_the_least_recently_used(tmp_path):
    d = tmp_path / "c"
    # names of one length: entries of one size (written in another order than their last use)
    old, new, oldest, mid = (_entry(d, n, size=1000, age_s=a) for n, a in (("e_c", 1000), ("e_a", 10),
                                                                          ("e_d", 10000), ("e_b", 100)))  # fmt: skip
    size = new.stat().st_size
    assert all(p.stat().st_size == size for p in (mid, old, oldest))
    r = _prune(d, max_bytes=2 * size + size // 2)
    assert r.removed == [(old.name, "least recently used beyond the size cap"),
                         (oldest.name, "least recently used beyond the size cap")]  # fmt: skip
    assert (r.kept, r.kept_bytes, r.freed_bytes) == (2, 2 * size, 2 * size)
    assert sorted(p.name for p in d.iterdir()) == sorted([new.name, mid.name])
    assert _prune(d, max_bytes=2 * size).removed == []  # exactly at the cap
    r = _prune(d, max_bytes=0)
    assert r.kept == 0 and {p.name for p in d.iterdir()} == set()


def test_prune_to_a_size_keeps_a_smaller_older_entry_that_fits(tmp_path):
    d = tmp_path / "c"
    big_new = _entry(d, "big_new", size=5000, age_s=1)
    bigger_mid = _entry(d, "bigger_mid", size=8000, age_s=50)
    small_old = _entry(d, "small_old", size=100, age_s=500)
    r = _prune(d, max_bytes=big_new.stat().st_size + small_old.stat().st_size)
    assert [n for n, _ in r.removed] == [bigger_mid.name]
    assert r.kept == 2


def test_prune_of_a_missing_folder(tmp_path):
    r = _prune(tmp_path / "nowhere", max_bytes=10)
    assert (r.removed, r.kept, r.kept_bytes, r.freed_bytes) == ([], 0, 0, 0)
    assert not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------------------------------------
# Several processes compiling one variant at once
# ---------------------------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import hashlib, sys, time
    from pathlib import Path
    from cuflash import jit, plan
    spec = plan.fwd_spec(32, "fp16", False, True, "sm_80")
    jit.cache_key(spec)  # loads NVRTC: the slow part happens before the start signal
    Path(sys.argv[1]).touch()
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.002)
    cubin, header, how = jit.get_cubin(spec)
    print(how, hashlib.sha256(cubin).hexdigest())
    """
)


def test_concurrent_compiles_of_one_variant(cache, tmp_path, compiled):
    n = 4
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), CUFLASH_LOG_LEVEL="WARNING")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"ready{i}"), str(go)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(n)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in range(n)):
            assert all(p.poll() is None for p in procs), "a worker died before the start signal"
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    want = hashlib.sha256(compiled[0]).hexdigest()
    hows = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        how, digest = out.split()
        assert how in ("compiled", "cache") and digest == want
        hows.append(how)
    assert "compiled" in hows
    files = sorted(p.name for p in cache.iterdir())
    assert files == [jit.entry_path(CHEAP, jit.cache_key(CHEAP)).name]
    assert kcache.decode_entry((cache / files[0]).read_bytes())[0] == compiled[0]


# ---------------------------------------------------------------------------------------------
# Logging and ptxas report
# ---------------------------------------------------------------------------------------------


def test_log_level_from_environment(monkeypatch):
    old = jit.logger.level
    try:
        monkeypatch.delenv("CUFLASH_LOG_LEVEL", raising=False)
        jit._configure_logging()
        assert jit.logger.level == logging.INFO
        monkeypatch.setenv("CUFLASH_LOG_LEVEL", "warning")
        jit._configure_logging()
        assert jit.logger.level == logging.WARNING
        assert len(jit.logger.handlers) >= 1 and jit.logger.propagate is False
    finally:
        jit.logger.setLevel(old)


@pytest.fixture
def all_records():
    """Every record the "cuflash" logger lets through at its own level (set from CUFLASH_LOG_LEVEL by
    jit._configure_logging, as at import); the handler itself takes every level."""
    yield from _capture()


_COMPILED_LINE = r"compiled {name} in \d+\.\ds \((\d+|\?) registers, (\d+|\?) bytes spilled\)"


def test_one_info_line_per_compile_at_the_default_level(cache, all_records, monkeypatch):
    """The compile log at the default level: exactly one INFO record per compile, "compiled <name> in
    X.Xs (R registers, S bytes spilled)"; a cache hit logs nothing. With CUFLASH_LOG_LEVEL=DEBUG the
    "compiling ..." line comes first."""
    monkeypatch.delenv("CUFLASH_LOG_LEVEL", raising=False)
    jit._configure_logging()
    cubin, header, how = jit.get_cubin(CHEAP)
    assert how == "compiled"
    assert [r.levelno for r in all_records] == [logging.INFO]
    msg = all_records[0].getMessage()
    m = re.fullmatch(_COMPILED_LINE.format(name=re.escape(CHEAP.name)), msg)
    assert m, msg
    assert m.group(1) == str(header["ptxas"]["registers"])
    assert m.group(2) == str(header["ptxas"].get("spill_stores", "?"))
    del all_records[:]
    assert jit.get_cubin(CHEAP)[2] == "cache" and all_records == []

    monkeypatch.setenv("CUFLASH_LOG_LEVEL", "DEBUG")
    jit._configure_logging()
    jit.entry_path(CHEAP, jit.cache_key(CHEAP)).unlink()
    assert jit.get_cubin(CHEAP)[2] == "compiled"
    assert [r.levelno for r in all_records] == [logging.DEBUG, logging.INFO]
    assert all_records[0].getMessage().startswith(f"compiling {CHEAP.name}")
    assert re.fullmatch(_COMPILED_LINE.format(name=re.escape(CHEAP.name)), all_records[1].getMessage())


_LOGGED = plan.fwd_spec(64, "bf16", False, False, "sm_80").name
PTXAS_LOG = f"""\
ptxas info    : 76 bytes gmem, 176 bytes cmem[4]
ptxas info    : Compiling entry function '{_LOGGED}' for 'sm_80'
ptxas info    : Function properties for {_LOGGED}
ptxas         .     32 bytes stack frame, 24 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 32 bytes cumulative stack size, 528 bytes cmem[0]
ptxas info    : Compile time = 276.694 ms
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 360 bytes cmem[0]
\x00"""


def test_parse_ptxas_report():
    assert jit.parse_ptxas_report(PTXAS_LOG) == {
        "registers": 255,
        "stack_frame": 32,
        "spill_stores": 24,
        "spill_loads": 40,
    }
    assert jit.parse_ptxas_report("") == {}
    assert jit.parse_ptxas_report("ptxas info    : Used 96 registers, 384 bytes cmem[0]") == {"registers": 96}
    serialized = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                  "due to non wgmma instructions defining accumulator registers of a wgmma between start and end of "
                  "the pipeline stage in the function 'k'\nptxas info    : Used 168 registers, used 1 barriers")  # fmt: skip
    assert jit.parse_ptxas_report(serialized) == {"registers": 168, "wgmma_serialized": 1}
    inputs = ("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized "
              "due to non wgmma instructions defining input registers of a wgmma between start and end of the "
              "pipeline stage in the function 'k'\nptxas info    : Used 168 registers, used 1 barriers")  # fmt: skip
    assert jit.parse_ptxas_report(inputs) == {"registers": 168, "wgmma_inputs_serialized": 1}
    registers = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                 "due to insufficient register resources for the function 'k'\nptxas info    : Used 168 registers")
    assert jit.parse_ptxas_report(registers) == {"registers": 168, "wgmma_serialized_registers": 1}


_WAIT_INJECTED_KERNEL = r"""
#include "wgmma.cuh"
// {nonce}: a wgmma's accumulators rewritten (on one branch) while the wgmma may still run
extern "C" __global__ void __launch_bounds__(128) probe(float* out, unsigned long long da, unsigned long long db, int flag) {{
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    cuflash::wgmma_ss_n32_bf16<0, 0>(d, da, db, true);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    if (flag) {{
#pragma unroll
        for (int i = 0; i < 16; ++i) d[i] = 0.f;
    }}
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    cuflash::wgmma_ss_n32_bf16<0, 0>(d, da, db, true);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) s += d[i];
    out[threadIdx.x] = s;
}}
"""


def test_a_wgmma_wait_ptxas_injects_is_reported():
    """ptxas's note that it made a wgmma wait (C7517) reaches the report from a real NVRTC log, so the
    budget tests (test_compile_variants.py) catch a kernel whose wgmma no longer run asynchronously."""
    cubin, log = _nvrtc_compile(_WAIT_INJECTED_KERNEL.format(nonce=random.randrange(1 << 30)), "sm_90a")
    report = jit.parse_ptxas_report(log)
    assert "registers" in report, f"ptxas did not report (NVRTC cache?):\n{log}"
    assert report.get("wgmma_waits_injected", 0) >= 1, log


def test_compiled_header_carries_the_ptxas_report(compiled_with_log):
    cubin, header, log = compiled_with_log
    p = header["ptxas"]
    # registers and stack frame come from the cubin itself: always there. Spill bytes come only from
    # ptxas's -v report, which is missing when NVRTC (12.9+) serves the program from its own cache.
    assert {"registers", "stack_frame"} <= set(p) <= {"registers", "stack_frame", "spill_stores", "spill_loads"}  # (no wgmma notes)
    assert 0 < p["registers"] <= 255 and p["stack_frame"] >= 0
    assert {k: p[k] for k in ("registers", "stack_frame")} == jit.cubin_resources(cubin)
    report = jit.parse_ptxas_report(log)
    assert {k: v for k, v in p.items() if k.startswith("spill_")} == {
        k: v for k, v in report.items() if k.startswith("spill_")
    }
    if report:  # ptxas ran: its report and the cubin agree
        assert set(report) == {"registers", "stack_frame", "spill_stores", "spill_loads"}
        assert p == report
    assert header["smem_bytes"] == CHEAP.smem_bytes and header["threads"] == CHEAP.threads


def test_compiled_header_without_the_ptxas_report(compiled, monkeypatch):
    """What NVRTC 12.9+ does when its own cache serves the program: no ptxas run, an empty log.
    (On the GPU machine, NVRTC 13.0, this made every header lack "registers".)"""
    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "getProgramLog", lambda prog: "")
    cubin, header = jit.compile_cubin(CHEAP)
    assert cubin == compiled[0]
    assert header["ptxas"] == jit.cubin_resources(cubin)
    assert set(header["ptxas"]) == {"registers", "stack_frame"}
    assert {k: compiled[1]["ptxas"][k] for k in ("registers", "stack_frame")} == header["ptxas"]


# ---------------------------------------------------------------------------------------------
# cubin_resources: registers and stack frame from the cubin's .nv.info
# ---------------------------------------------------------------------------------------------


def _nvrtc_compile(source: str, arch: str = "sm_80", extra=()) -> tuple[bytes, str]:
    """(cubin, log) of ``source`` compiled with ptxas -v; cuflash headers may be included."""
    from cupy.cuda import nvrtc

    headers = jit.included_headers(source)
    prog = nvrtc.createProgram(source, "probe.cu", [h.encode() for h in headers.values()], [n.encode() for n in headers])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-Xptxas=-v", f"-arch={arch}", *extra])
        except nvrtc.NVRTCError as exc:
            raise jit.CompileError(nvrtc.getProgramLog(prog)) from exc
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


#: A kernel with a dynamically indexed local array: it must live in local memory (stack frame
#: 64 * 4 bytes). The nonce makes the program new to NVRTC's own cache, so ptxas runs and reports.
_LOCAL_ARRAY_KERNEL = """
extern "C" __global__ void probe_{nonce}(float* out, int i) {{
    float a[64];
    for (int j = 0; j < 64; ++j) a[j] = out[j];
    a[i & 63] += 1.0f;
    out[threadIdx.x] = a[(i >> 6) & 63] + {nonce}.0f;
}}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_cubin_resources_agree_with_ptxas(arch):
    nonce = random.randrange(1 << 30)
    cubin, log = _nvrtc_compile(_LOCAL_ARRAY_KERNEL.format(nonce=nonce), arch)
    report = jit.parse_ptxas_report(log)
    assert {"registers", "stack_frame"} <= set(report), f"ptxas did not report (NVRTC cache?):\n{log}"
    res = jit.cubin_resources(cubin)
    assert res == {"registers": report["registers"], "stack_frame": report["stack_frame"]}
    assert res["stack_frame"] >= 64 * 4  # the local array
    assert 1 <= res["registers"] <= 255


def test_cubin_resources_of_a_kernel_variant(compiled_with_log):
    cubin, header, log = compiled_with_log
    res = jit.cubin_resources(cubin)
    assert set(res) == {"registers", "stack_frame"}
    assert 1 <= res["registers"] <= 255 and res["stack_frame"] >= 0
    report = jit.parse_ptxas_report(log)
    if report:  # present unless NVRTC served the program from its own cache
        assert res == {"registers": report["registers"], "stack_frame": report["stack_frame"]}


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"garbage bytes, not an ELF file at all",
        b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.5\n.target sm_80\n",  # PTX text
        b"\x7fELF\x01\x01\x01" + b"\0" * 100,  # a 32-bit ELF
        kcache._MAGIC + b"\0" * 100,  # a cache entry is not a bare cubin
    ],
)
def test_cubin_resources_rejects_non_elf_bytes(blob):
    with pytest.raises(ValueError):
        jit.cubin_resources(blob)


def test_cubin_resources_rejects_cache_entries(compiled):
    cubin, _, blob = compiled
    with pytest.raises(ValueError):
        jit.cubin_resources(blob)  # the entry wraps the cubin; only the cubin itself is ELF
    assert jit.cubin_resources(cubin)


@pytest.mark.parametrize("keep", [4, 5, 64, "half"])
def test_cubin_resources_rejects_truncated_cubins(compiled, keep):
    cubin = compiled[0]
    with pytest.raises(ValueError):
        jit.cubin_resources(cubin[: len(cubin) // 2 if keep == "half" else keep])


# ---------------------------------------------------------------------------------------------
# FwdConfig in the kernel source against plan (NVRTC front end only: nothing is generated)
# ---------------------------------------------------------------------------------------------


def _fwd_config_checks(specs) -> str:
    lines = ['#include "flash_fwd.cuh"']
    for s in specs:
        cfg = f"cuflash::FwdConfig<{s.template_args()}>"
        lines += [
            f"static_assert({cfg}::kSmemBytes == {s.smem_bytes}, \"{s.name}: smem\");",
            f"static_assert({cfg}::kNThreads == {s.threads}, \"{s.name}: threads\");",
            f"static_assert({cfg}::kStages == {s.tile.stages}, \"{s.name}: stages\");",
        ]
    return "\n".join(lines) + "\n"


def test_fwd_config_matches_plan_for_every_tile():
    """plan.fwd_smem_bytes is what the launch asks for; FwdConfig::kSmemBytes is what the kernel uses."""
    specs = [plan.fwd_spec(d, "bf16", False, True, "sm_80") for d in plan.HEAD_DIM_BUCKETS]
    specs += [plan.with_tile(s, dataclasses.replace(s.tile, stages=3 - s.tile.stages)) for s in specs]
    assert {s.tile.stages for s in specs} == {1, 2}
    _nvrtc_compile(_fwd_config_checks(specs))  # raises on any failed static_assert


def test_fwd_config_checks_can_fail():
    spec = plan.fwd_spec(64, "bf16", False, True, "sm_80")
    wrong = dataclasses.replace(spec, tile=dataclasses.replace(spec.tile, stages=3 - spec.tile.stages))
    src = _fwd_config_checks([spec]).replace(f"== {spec.smem_bytes},", f"== {wrong.smem_bytes},", 1)
    with pytest.raises(jit.CompileError, match="smem"):
        _nvrtc_compile(src)


@pytest.mark.parametrize("stages", [0, 3])
def test_kernel_rejects_other_stage_counts(stages):
    spec = plan.fwd_spec(64, "bf16", False, True, "sm_80")
    spec = plan.with_tile(spec, dataclasses.replace(spec.tile, stages=stages))
    with pytest.raises(jit.CompileError, match="single or double buffered"):
        _nvrtc_compile(f'#include "flash_fwd.cuh"\nconstexpr int n = cuflash::FwdConfig<{spec.template_args()}>::kSmemBytes;\n')


# ---------------------------------------------------------------------------------------------
# Launch path (cuflash/launch.py): programmatic dependent launch and its fallback (driver calls
# faked, no GPU needed)
# ---------------------------------------------------------------------------------------------


class _FakeDriver:
    class CUDADriverError(RuntimeError):
        pass

    def __init__(self, fail=False):
        self.plain, self.fail = [], fail

    def launchKernel(self, fptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):  # noqa: N802 - CuPy's name
        if self.fail:
            raise self.CUDADriverError("plain launch failed")
        self.plain.append(((gx, gy, gz), (bx, by, bz), smem, stream))


def _decode_launch(pdl: bool) -> plan.Launch:
    p = plan.plan_decode(batch=2, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=128, dtype="bf16", aligned=True,
                         max_seqlen=4096, num_splits=3, num_sms=132, arch="sm_90a")  # fmt: skip
    return dataclasses.replace(p.attn, pdl=pdl)


class _Fn:
    ptr = 0x1234


@pytest.fixture
def pdl_setting():
    """launch.set_pdl_enabled, with the process's setting restored after the test."""
    saved = launch.pdl_enabled()
    yield launch.set_pdl_enabled
    launch.set_pdl_enabled(saved)


def test_set_pdl_enabled_returns_the_previous_setting(pdl_setting):
    assert pdl_setting(True) in (True, False)
    assert launch.pdl_enabled() is True
    assert pdl_setting(False) is True and launch.pdl_enabled() is False
    assert pdl_setting(1) is False and launch.pdl_enabled() is True


@pytest.mark.parametrize("rc, plain_ok", [(0, True), (801, True), (801, False)])
def test_pdl_launch_and_its_fallback(monkeypatch, caplog, pdl_setting, rc, plain_ok):
    """A PDL launch goes to cuLaunchKernelEx with the launch's grid, block, shared memory and stream;
    a refused one (CUresult != 0) is launched plainly and turns PDL off for the process with one
    warning; if the plain launch fails too, its error is raised and PDL stays as it was."""
    ex_calls = []

    def fake_ex(cfg, fptr, argv, extra):
        ex_calls.append((tuple(cfg.grid), tuple(cfg.block), cfg.shared_mem_bytes, cfg.stream, cfg.num_attrs,
                         cfg.attrs.contents.id, cfg.attrs.contents.value, fptr, argv))  # fmt: skip
        return rc

    drv = _FakeDriver(fail=not plain_ok)
    monkeypatch.setattr(launch, "_driver", drv)
    monkeypatch.setattr(launch, "_cu_launch_kernel_ex", lambda: fake_ex)
    pdl_setting(True)
    how = _decode_launch(pdl=True)
    caplog.set_level(logging.WARNING, logger="cuflash")
    if not plain_ok:
        with pytest.raises(_FakeDriver.CUDADriverError):
            launch.launch(_Fn(), how, 0xABC, 77)
        assert launch.pdl_enabled() and not drv.plain
        return
    launch.launch(_Fn(), how, 0xABC, 77)
    assert ex_calls == [(how.grid, how.block, how.smem_bytes, 77, 1,
                         launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1, _Fn.ptr, 0xABC)]  # fmt: skip
    if rc == 0:
        assert not drv.plain and launch.pdl_enabled() and not caplog.records
        return
    assert drv.plain == [(how.grid, how.block, how.smem_bytes, 77)]
    assert not launch.pdl_enabled()
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "801" in caplog.records[0].getMessage()
    launch.launch(_Fn(), how, 0xABC, 78)  # from now on plain, without asking the driver again
    assert len(ex_calls) == 1 and drv.plain[-1][3] == 78


def test_launches_without_pdl_never_ask_for_it(monkeypatch, pdl_setting):
    """Launches that do not allow PDL (every non-decode kernel, and decode before sm_90), CUFLASH_PDL=0
    and a driver without cuLaunchKernelEx all take the plain cuLaunchKernel path."""
    def fail_ex(*a):
        raise AssertionError("cuLaunchKernelEx must not be called")

    drv = _FakeDriver()
    monkeypatch.setattr(launch, "_driver", drv)
    monkeypatch.setattr(launch, "_cu_launch_kernel_ex", lambda: fail_ex)
    pdl_setting(True)
    launch.launch(_Fn(), _decode_launch(pdl=False), 0, 1)
    pdl_setting(False)
    launch.launch(_Fn(), _decode_launch(pdl=True), 0, 2)
    pdl_setting(True)
    monkeypatch.setattr(launch, "_cu_launch_kernel_ex", lambda: None)
    launch.launch(_Fn(), _decode_launch(pdl=True), 0, 3)
    assert [c[3] for c in drv.plain] == [1, 2, 3]


def test_launch_record_hands_the_record_bytes_by_address(monkeypatch):
    """launch_record (the forward's and backward's launches) copies the parameter record into this
    thread's buffer and launches with the address of a void*[1] that points at it; a record larger
    than the buffer is refused before anything is launched."""
    import ctypes

    seen = []

    def fake_launch(fn, how, argv_ptr, stream_ptr):
        buf_addr = ctypes.cast(argv_ptr, ctypes.POINTER(ctypes.c_void_p))[0]
        seen.append((fn, how, stream_ptr, ctypes.string_at(buf_addr, 40)))

    monkeypatch.setattr(launch, "launch", fake_launch)
    how = _decode_launch(pdl=False)
    record = bytes(range(40))
    launch.launch_record(_Fn, how, record, 55)
    assert seen == [(_Fn, how, 55, record)]
    launch.launch_record(_Fn, how, bytes(range(100, 140)), 56)  # the buffer is reused: the new bytes
    assert seen[-1][3] == bytes(range(100, 140))
    too_big = bytes(len(launch.ARGS.buf) + 1)
    with pytest.raises(ValueError, match="exceeds"):
        launch.launch_record(_Fn, how, too_big, 57)
    assert len(seen) == 2
