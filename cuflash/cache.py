"""The on-disk kernel cache: one file per compiled variant, written atomically, checked on read.

Environment
    CUFLASH_CACHE_DIR   cache folder (default: $XDG_CACHE_HOME/cuflash or ~/.cache/cuflash)

An entry ``<variant name>-<key>.cubin`` holds a magic line, a SHA-256 checksum, a JSON header
(variant, arch, NVRTC version, cuflash version, ptxas register/spill report, compile seconds) and
the cubin. The key (cuflash/jit.py cache_key) hashes every byte NVRTC sees, so an entry is never
reused for other sources; entries that can no longer match (another cuflash or NVRTC version,
damaged files) are removed by prune(). Entries are written to a temporary file and renamed into
place, so concurrent compiles of one variant both succeed and the last rename wins; there are no
locks to go stale. An entry whose checksum does not match is deleted and rebuilt by the JIT.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"CUFLASH-CUBIN-1\n"


def cache_dir() -> Path:
    """Folder of the disk cache (created on first write)."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuflash"


class CacheWriteError(OSError):
    """The cache folder cannot be written (read-only, full, not a folder)."""


def encode_entry(cubin: bytes, header: dict) -> bytes:
    meta = json.dumps(header, sort_keys=True).encode()
    payload = struct.pack("<I", len(meta)) + meta + cubin
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def decode_entry(blob: bytes) -> tuple[bytes, dict]:
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


def write_atomic(path: Path, data: bytes) -> None:
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


def check_writable(d: Path | None = None) -> Path:
    """The cache folder, created if needed; CacheWriteError (saying what to do) if a file cannot be
    written there."""
    d = d or cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".write-test.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise CacheWriteError(
            f"the kernel cache {d} is not writable ({exc.strerror or exc}); set CUFLASH_CACHE_DIR to a writable folder"
        ) from None
    return d


def touch(path: Path) -> None:
    """Mark an entry as used now (its mtime), for prune(max_bytes=...). Best effort."""
    try:
        os.utime(path)
    except OSError:
        pass


@dataclass
class CacheEntry:
    path: Path
    header: dict | None  # None when the entry is damaged
    size: int
    error: str | None = None
    mtime: float = 0.0  # last written or loaded


def list_entries(d: Path | None = None) -> list[CacheEntry]:
    entries = []
    d = d or cache_dir()
    if not d.is_dir():
        return entries
    for path in sorted(d.glob("*.cubin")):
        try:
            blob = path.read_bytes()
            mtime = path.stat().st_mtime
        except FileNotFoundError:  # removed by another process since the listing
            continue
        try:
            _, header = decode_entry(blob)
            entries.append(CacheEntry(path, header, len(blob), mtime=mtime))
        except ValueError as exc:
            entries.append(CacheEntry(path, None, len(blob), str(exc), mtime=mtime))
    return entries


def _remove(path: Path) -> int:
    """1 if ``path`` was removed; 0 if it was gone already or cannot be removed (a read-only cache:
    prune and clear report what they removed, they do not fail on the rest)."""
    try:
        path.unlink()
        return 1
    except OSError:
        return 0


def clear(d: Path | None = None) -> int:
    """Delete every cache entry (and stray temporary files); returns the number of files removed."""
    d = d or cache_dir()
    if not d.is_dir():
        return 0
    return sum(_remove(p) for p in list(d.glob("*.cubin")) + list(d.glob("*.tmp")))


@dataclass
class PruneResult:
    removed: list  # (file name, reason)
    kept: int
    kept_bytes: int
    freed_bytes: int


def prune(*, version: str, nvrtc: tuple[int, int] | None, max_bytes: int | None = None,
          tmp_age_s: float = 3600.0, d: Path | None = None) -> PruneResult:  # fmt: skip
    """Remove the entries this installation can never load again: damaged ones, and ones built by
    another cuflash ``version`` or another ``nvrtc`` version (None: keep any) than this process would
    use (their key can no longer match); temporary files older than ``tmp_age_s`` (left by a compile
    that was killed). With ``max_bytes``, then keep the most recently used entries that fit in it
    (newest first; an entry that does not fit is removed, an older smaller one may still fit).

    The default folder is shared by every environment of a user: entries another environment (another
    cuflash or NVRTC version) still loads are removed too, and rebuilt there on first use. Entries of
    this version compiled from sources since changed are not recognized as stale (only by the cap)."""
    d = d or cache_dir()
    removed, freed = [], 0
    keep = []
    for e in list_entries(d):
        reason = None
        if e.header is None:
            reason = f"damaged ({e.error})"
        elif e.header.get("cuflash") != version:
            reason = f"built by cuflash {e.header.get('cuflash')}"
        elif nvrtc is not None and tuple(e.header.get("nvrtc", ())) != tuple(nvrtc):
            reason = f"built by NVRTC {'.'.join(map(str, e.header.get('nvrtc', [])))}"
        if reason is None:
            keep.append(e)
        elif _remove(e.path):
            removed.append((e.path.name, reason))
            freed += e.size
    if d.is_dir():
        now = time.time()
        for p in d.glob("*.tmp"):
            try:
                old = now - p.stat().st_mtime > tmp_age_s
            except FileNotFoundError:
                continue
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                continue
            if old and _remove(p):
                removed.append((p.name, "temporary file of an interrupted compile"))
                freed += size
    if max_bytes is not None:
        keep.sort(key=lambda e: e.mtime, reverse=True)  # most recently used first
        total = 0
        kept = []
        for e in keep:
            if total + e.size <= max_bytes:
                total += e.size
                kept.append(e)
            elif _remove(e.path):
                removed.append((e.path.name, "least recently used beyond the size cap"))
                freed += e.size
        keep = kept
    return PruneResult(removed, len(keep), sum(e.size for e in keep), freed)
