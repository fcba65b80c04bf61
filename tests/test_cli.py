"""CPU tests of the command line (cuflash/cli.py): info, precompile, cache list/prune/clear, bench.

No GPU needed: the GPU queries are replaced by fakes where a test needs a definite answer, and
NVRTC compiles for an explicit --arch on the CPU. Every test uses a temporary kernel cache.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path

import cupy
import pytest
from click.testing import CliRunner

from cuflash import cache as kcache
from cuflash import cli, jit, plan
from cuflash._version import __version__

REPO = Path(__file__).resolve().parent.parent

# The cheapest selection that compiles: 3 forward variants (mma.sync with 16-byte vector and with
# element-wise loads, and the Hopper kernel).
SMALL = ["precompile", "--arch", "sm_90a", "--head-dim", "64", "--dtype", "bf16", "--no-causal", "--kernels", "fwd"]
SMALL_NAMES = {plan.fwd_spec(64, "bf16", False, aligned, "sm_90a").name for aligned in (True, False)} | {
    plan.fwd_sm90_spec(64, "bf16", False).name, plan.fwd_sm90_ws_spec(64, "bf16", False).name,
    plan.fwd_sm90_ws_spec(64, "bf16", False, plan.FWD_SM90_WS_SHORT_TILES[64]).name,  # (short keys)
}
N_SMALL = len(SMALL_NAMES)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "kernel-cache"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    monkeypatch.delenv("CUFLASH_LOG_LEVEL", raising=False)
    jit.reset_stats()
    return d


@pytest.fixture
def no_gpu(monkeypatch):
    """Behave like a machine without a usable GPU, whatever this one has."""

    def no_device(*args, **kwargs):
        raise cupy.cuda.runtime.CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_device)
    monkeypatch.setattr(jit, "device_arch", no_device)


def invoke(args, **kwargs):
    return CliRunner().invoke(cli.main, args, catch_exceptions=False, **kwargs)


def entry_names(d: Path) -> set[str]:
    return {e.header["name"] for e in kcache.list_entries() if e.header} if d.is_dir() else set()


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def test_info_without_gpu(cache, no_gpu):
    r = invoke(["info"])
    assert r.exit_code == 0, r.output
    assert "no GPU" in r.output
    assert str(cache) in r.output
    assert "0 entries" in r.output
    assert f"CuPy           {cupy.__version__}" in r.output
    major, minor = jit.nvrtc_version()
    assert f"NVRTC          {major}.{minor}" in r.output


def test_info_on_this_machine_does_not_crash(cache):
    """Whatever the real driver says (here: no driver at all), info reports and exits 0."""
    r = invoke(["info"])
    assert r.exit_code == 0, r.output
    assert "Kernel cache" in r.output and str(cache) in r.output


def test_info_with_a_gpu(cache, monkeypatch):
    rt = cupy.cuda.runtime
    monkeypatch.setattr(rt, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(rt, "driverGetVersion", lambda: 12080)
    monkeypatch.setattr(rt, "getDeviceProperties", lambda i: {"name": b"NVIDIA H200", "major": 9, "minor": 0})
    monkeypatch.setattr(jit, "device_arch", lambda i: plan.arch_for_capability(9, 0))
    r = invoke(["info"])
    assert r.exit_code == 0, r.output
    assert "NVIDIA H200" in r.output and "9.0" in r.output and "sm_90a" in r.output
    assert "CUDA driver    12.8" in r.output
    assert "no GPU" not in r.output


def test_info_counts_cache_entries(cache):
    assert invoke(SMALL).exit_code == 0
    r = invoke(["info"])
    size = sum(p.stat().st_size for p in cache.glob("*.cubin"))
    assert f"{len(SMALL_NAMES)} entries" in r.output
    assert cli.human_size(size) in r.output


@pytest.mark.parametrize(
    "n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"), (3 * 2**30, "3.0 GiB")]
)
def test_human_size(n, text):
    assert cli.human_size(n) == text


# ---------------------------------------------------------------------------------------------
# precompile
# ---------------------------------------------------------------------------------------------


def test_precompile_without_arch_and_without_gpu_asks_for_arch(cache, no_gpu):
    r = invoke(["precompile", "--head-dim", "64"])
    assert r.exit_code == 2, r.output
    assert "--arch" in r.output
    assert not cache.exists() or not list(cache.iterdir())


def test_precompile_compiles_both_load_paths_then_hits_the_cache(cache):
    r = invoke(SMALL)
    assert r.exit_code == 0, r.output
    assert f"{N_SMALL} variants: {N_SMALL} compiled, 0 already cached" in r.output
    assert str(cache) in r.output
    assert jit.stats()["compiles"] == N_SMALL
    assert entry_names(cache) == SMALL_NAMES
    assert len(list(cache.glob("*.cubin"))) == N_SMALL

    jit.reset_stats()
    r = invoke(SMALL)
    assert r.exit_code == 0, r.output
    assert f"{N_SMALL} variants: 0 compiled, {N_SMALL} already cached" in r.output
    assert jit.stats()["compiles"] == 0
    assert jit.stats()["disk_loads"] == N_SMALL
    assert len(list(cache.glob("*.cubin"))) == N_SMALL


def test_precompile_warns_of_serialized_wgmma(cache, monkeypatch):
    """A variant whose compile report holds one of ptxas's wgmma notes gets a warning line after the summary."""
    real = jit.precompile

    def noted(specs, jobs=1, on_done=None):
        out = real(specs, jobs=jobs, on_done=on_done)
        name, how, header = out[0]
        return [(name, how, {**header, "ptxas": {**header["ptxas"], "wgmma_inputs_serialized": 1}})] + out[1:]

    r = invoke(SMALL)
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    monkeypatch.setattr(jit, "precompile", noted)
    r = invoke(SMALL)
    assert r.exit_code == 0, r.output
    assert "warning: ptxas serialized the wgmma of 1 variant(s)" in r.output


def test_precompile_in_parallel(cache):
    args = ["precompile", "--arch", "sm_80", "--head-dim", "32", "--dtype", "fp16", "--no-causal", "-j", "2",
            "--kernels", "fwd"]  # fmt: skip
    r = invoke(args)
    assert r.exit_code == 0, r.output
    assert "2 variants: 2 compiled, 0 already cached" in r.output
    assert jit.stats()["compiles"] == 2
    names = entry_names(cache)
    assert names == {plan.fwd_spec(32, "fp16", False, aligned, "sm_80").name for aligned in (True, False)}
    assert len(names) == 2
    assert not list(cache.glob("*.tmp"))
    r = invoke(args)
    assert "2 variants: 0 compiled, 2 already cached" in r.output


def test_precompile_verbose_prints_registers(cache):
    r = invoke(SMALL + ["-v"])
    assert r.exit_code == 0, r.output
    entries = kcache.list_entries()
    assert {e.header["name"] for e in entries} == SMALL_NAMES
    for e in entries:
        p = e.header["ptxas"]
        assert 0 < p["registers"] <= 255  # from the cubin: present whether or not ptxas's report was
        line = next(ln for ln in r.output.splitlines() if ln.strip().startswith(f"{e.header['name']}:"))
        assert f"{e.header['name']}: {p['registers']} registers" in line
        # spill bytes come only from ptxas's -v report, which NVRTC's own cache (12.9+) can leave out
        assert f"{p.get('spill_stores', '?')} B spill stores" in line
        assert f"{p.get('spill_loads', '?')} B spill loads" in line


@pytest.fixture
def nvrtc_log_empty(monkeypatch):
    """Compile as NVRTC 12.9+ does when its own cache serves a program: no ptxas run, an empty log."""
    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "getProgramLog", lambda prog: "")


def test_precompile_verbose_without_the_ptxas_report(cache, nvrtc_log_empty):
    """The failure seen on the GPU machine (NVRTC 13.0): registers still come from the cubin."""
    r = invoke(SMALL + ["-v"])
    assert r.exit_code == 0, r.output
    assert f"{N_SMALL} variants: {N_SMALL} compiled, 0 already cached" in r.output
    entries = kcache.list_entries()
    assert {e.header["name"] for e in entries} == SMALL_NAMES
    for e in entries:
        p = e.header["ptxas"]
        assert set(p) == {"registers", "stack_frame"} and 0 < p["registers"] <= 255 and p["stack_frame"] >= 0
        assert f"{e.header['name']}: {p['registers']} registers, ? B spill stores, ? B spill loads" in r.output


class _Recorder:
    """Stands in for jit.precompile: records the specs, reports them as compiled."""

    def __init__(self):
        self.specs = []

    def __call__(self, specs, jobs=1, on_done=None):
        self.specs = list(specs)
        results = []
        for s in self.specs:
            res = (s.name, "compiled", {"ptxas": {"registers": 100}, "compile_seconds": 0.0})
            results.append(res)
            if on_done:
                on_done(res)
        return results


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(jit, "precompile", rec)
    return rec


def test_precompile_all_selects_every_variant(cache, recorder):
    r = invoke(["precompile", "--arch", "90a", "--arch", "sm_80", "--arch", "sm_90a", "--all"])
    assert r.exit_code == 0, r.output
    expected = [s for arch in ("sm_90a", "sm_80") for family in cli.KERNEL_FAMILIES.values() for s in family(arch)]
    n_fwd = 2 * len(plan.HEAD_DIM_BUCKETS) * 2 * 2 * 2
    assert len([s for s in expected if s.family == "flash_fwd"]) == n_fwd
    # backward: main kernels as many as the forward, plus preprocess and convert per dtype and load path
    assert len([s for s in expected if s.family in ("flash_bwd", "flash_bwd_pre", "flash_bwd_convert")]) == n_fwd + 2 * 2 * 2 * 2
    # and the Hopper kernels, sm_90a only
    assert len([s for s in expected if s.family == "flash_fwd_sm90"]) == len(plan.FWD_SM90_TILES) * 2 * 2
    assert len([s for s in expected if s.family == "flash_bwd_sm90"]) == len(plan.BWD_SM90_TILES) * 2 * 2
    # (the warp-specialized backward: per dtype and causal flag, plus the persistent one where the planner takes it)
    ws_bwd = [s for s in expected if s.family == "flash_bwd_sm90_ws"]
    assert len(ws_bwd) == len(plan.BWD_SM90_WS_TILES) * 2 * 2 + len(plan.BWD_SM90_WS_PERSISTENT) * 2
    assert {(s.head_dim, s.causal) for s in ws_bwd if s.tile.persistent} == plan.BWD_SM90_WS_PERSISTENT
    assert recorder.specs == expected
    assert f"{len(expected)} variants: {len(expected)} compiled" in r.output
    # not a terminal (CI logs, image builds): progress as lines, the first and the last item at least
    # (the recorder takes no time, so nothing in between)
    lines = [line for line in r.stderr.splitlines() if line.startswith("Compiling kernels: ")]
    assert [line.split()[2] for line in lines] == [f"1/{len(expected)}", f"{len(expected)}/{len(expected)}"], lines


@pytest.mark.parametrize(
    "flags, dtypes, causals",
    [
        ([], {"fp16", "bf16"}, {False, True}),
        (["--dtype", "fp16"], {"fp16"}, {False, True}),
        (["--dtype", "bf16", "--causal"], {"bf16"}, {True}),
        (["--dtype", "both", "--no-causal"], {"fp16", "bf16"}, {False}),
        (["--both-causal"], {"fp16", "bf16"}, {False, True}),
    ],
)
def test_precompile_selection_flags(cache, recorder, flags, dtypes, causals):
    r = invoke(["precompile", "--arch", "sm_86", "--head-dim", "100", "--head-dim", "128", "--head-dim", "33",
                "--kernels", "fwd"] + flags)  # fmt: skip
    assert r.exit_code == 0, r.output
    specs = recorder.specs
    assert {s.head_dim for s in specs} == {64, 128}  # 100 -> 128, 33 -> 64, duplicates removed
    assert {s.dtype for s in specs} == dtypes
    assert {s.causal for s in specs} == causals
    assert {s.aligned for s in specs} == {True, False}
    assert {s.arch for s in specs} == {"sm_86"}
    assert len(specs) == len(set(specs)) == 2 * len(dtypes) * len(causals) * 2


def test_precompile_variant_combination(cache, recorder):
    """--variant builds the kernels of that combination of variants (decode without dropout); window
    kernels only non-causal (a window carries causal in its right edge)."""
    r = invoke(["precompile", "--arch", "sm_90a", "--head-dim", "128", "--dtype", "bf16", "--variant", "window",
                "--variant", "softcap", "--variant", "dropout"])  # fmt: skip
    assert r.exit_code == 0, r.output
    main = [s for s in recorder.specs if s.family in ("flash_fwd", "flash_fwd_sm90", "flash_bwd", "flash_bwd_sm90")]
    assert {s.mods for s in main} == {plan.MOD_WINDOW | plan.MOD_SOFTCAP | plan.MOD_DROPOUT}
    assert {s.causal for s in main} == {False}
    assert {s.mods for s in recorder.specs if s.family == "flash_decode"} == {plan.MOD_WINDOW | plan.MOD_SOFTCAP}
    assert len(recorder.specs) == len(set(recorder.specs))
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "64", "--kernels", "fwd", "--variant", "alibi", "--causal"])
    assert r.exit_code == 0 and {(s.mods, s.causal) for s in recorder.specs} == {(plan.MOD_ALIBI, True)}
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "64", "--variant", "rotary"])
    assert r.exit_code == 2 and "rotary" in r.output


def test_precompile_kernel_families(cache, recorder):
    """--kernels bwd builds the backward's main, preprocess and convert kernels for the selection only."""
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "128", "--dtype", "fp16", "--causal", "--kernels", "bwd"])
    assert r.exit_code == 0, r.output
    assert recorder.specs == plan.all_bwd_specs("sm_80", head_dims=(128,), dtypes=("fp16",), causals=(True,))
    assert {s.family for s in recorder.specs} == {"flash_bwd", "flash_bwd_pre", "flash_bwd_convert"}
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "128", "--kernels", "fwd", "--kernels", "bwd"])
    assert {s.family for s in recorder.specs} == {"flash_fwd", "flash_bwd", "flash_bwd_pre", "flash_bwd_convert"}
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "128", "--kernels", "sideways"])
    assert r.exit_code == 2 and "sideways" in r.output


def test_precompile_defaults_to_the_gpu_arch(cache, recorder, monkeypatch):
    monkeypatch.setattr(jit, "device_arch", lambda i: "sm_89")
    r = invoke(["precompile", "--head-dim", "64"])
    assert r.exit_code == 0, r.output
    assert recorder.specs and {s.arch for s in recorder.specs} == {"sm_89"}


def test_precompile_needs_head_dim_or_all(cache, recorder):
    r = invoke(["precompile", "--arch", "sm_80"])
    assert r.exit_code == 2
    assert "--head-dim" in r.output and "--all" in r.output
    assert recorder.specs == []


@pytest.mark.parametrize(
    "args, word",
    [
        (["--arch", "sm_70", "--head-dim", "64"], "sm_70"),
        (["--arch", "sm_75", "--head-dim", "64"], "sm_75"),
        (["--arch", "sm_99", "--head-dim", "64"], "sm_99"),
        (["--arch", "sm_100a", "--head-dim", "64"], "sm_100a"),
        (["--arch", "sm_80", "--arch", "sm_99", "--head-dim", "64"], "sm_99"),
        (["--arch", "foo", "--head-dim", "64"], "foo"),
        (["--arch", "sm_80", "--head-dim", "300"], "300"),
        (["--arch", "sm_80", "--head-dim", "0"], "head dim"),
        (["--arch", "sm_80", "--head-dim", "64", "--dtype", "fp32"], "fp32"),
        (["--arch", "sm_80", "--head-dim", "64", "--all"], "--all"),
        (["--arch", "sm_80", "--all", "-j", "0"], "jobs"),
    ],
)
def test_precompile_bad_options_are_usage_errors(cache, recorder, args, word):
    r = invoke(["precompile"] + args)
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.output and word in r.output
    assert recorder.specs == []


@pytest.mark.parametrize("arch", ["sm_99", "sm_75", "sm_100a", "9.9"])
def test_precompile_unknown_arch_names_the_known_targets(cache, recorder, arch):
    """An arch NVRTC might accept but cuflash never loads is refused before anything is compiled, with
    the list of the targets cuflash builds."""
    r = invoke(["precompile", "--arch", arch, "--head-dim", "64"])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--arch'" in r.output and f"unsupported arch {arch!r}" in r.output
    for known in ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100", "sm_103", "sm_120"):
        assert known in r.output
    assert recorder.specs == [] and not cache.exists()


@pytest.mark.parametrize("arch", ["sm_90", "90", "9.0", "compute_90", "sm_90a"])
def test_precompile_sm_90_builds_the_sm_90a_variants(cache, recorder, arch):
    """A Hopper GPU loads sm_90a cubins (plan.arch_for_capability): --arch sm_90 builds those, never
    a cache of sm_90 entries no process would load."""
    r = invoke(["precompile", "--arch", arch, "--head-dim", "64", "--dtype", "bf16", "--no-causal"])
    assert r.exit_code == 0, r.output
    assert recorder.specs and {s.arch for s in recorder.specs} == {"sm_90a"}
    assert recorder.specs == [s for family in cli.KERNEL_FAMILIES.values()
                              for s in family("sm_90a", head_dims=(64,), dtypes=("bf16",), causals=(False,))]  # fmt: skip
    assert {"flash_fwd_sm90", "flash_bwd_sm90"} <= {s.family for s in recorder.specs}  # the Hopper kernels too
    assert all(s.name.endswith("_sm90a") for s in recorder.specs)


@pytest.fixture
def cache_below_a_file(tmp_path, monkeypatch):
    """CUFLASH_CACHE_DIR pointing below a regular file: no process can create it (root included, whom a
    read-only mode would not stop). Returns (the file, its bytes)."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"a regular file")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(afile / "cache"))
    monkeypatch.delenv("CUFLASH_LOG_LEVEL", raising=False)
    jit.reset_stats()
    return afile


def test_precompile_into_an_unwritable_cache_fails_first(cache_below_a_file, tmp_path):
    """precompile checks the cache before compiling anything: a clear error, exit code 1, no NVRTC run,
    nothing written anywhere."""
    r = invoke(SMALL)
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the kernel cache "), r.output
    assert str(cache_below_a_file / "cache") in lines[0]
    assert "is not writable" in lines[0] and "set CUFLASH_CACHE_DIR to a writable folder" in lines[0]
    assert "Traceback" not in r.output and "Compiling kernels" not in r.output
    assert jit.stats()["compiles"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and cache_below_a_file.read_bytes() == b"a regular file"


def test_precompile_of_a_full_read_only_cache_only_reports(cache, monkeypatch):
    """A cache that already holds every variant asked for (e.g. baked into an image, read-only) is not
    written to: precompile reports them cached and exits 0, even where a write would fail."""
    assert invoke(SMALL).exit_code == 0
    monkeypatch.setattr(kcache, "check_writable", lambda *a: (_ for _ in ()).throw(kcache.CacheWriteError("read-only")))
    r = invoke(SMALL)
    assert r.exit_code == 0, r.output
    assert f"{N_SMALL} variants: 0 compiled, {N_SMALL} already cached" in r.output


def test_precompile_arch_this_nvrtc_does_not_know(cache, recorder, monkeypatch):
    """A shipped arch the installed NVRTC cannot compile for is a usage error naming what it can."""
    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "getSupportedArchs", lambda: (50, 75, 80, 86, 89, 90))  # (sm_50, sm_75: not cuflash's)
    r = invoke(["precompile", "--arch", "sm_120", "--all"])
    assert r.exit_code == 2 and "cannot compile for sm_120 (of cuflash's targets it knows sm_80, sm_86, sm_89, sm_90a)" \
        in r.output, r.output
    assert recorder.specs == []
    assert invoke(["precompile", "--arch", "sm_90", "--head-dim", "64"]).exit_code == 0


def test_precompile_into_an_unwritable_cache_never_calls_the_compiler(cache_below_a_file, recorder):
    r = invoke(["precompile", "--arch", "sm_80", "--all", "-j", "4"])
    assert r.exit_code == 1 and "is not writable" in r.output
    assert recorder.specs == []


def test_precompile_stops_when_the_cache_fills_up(cache, cache_full_after_one_entry):
    """An entry that cannot be written (the disk filled up after the first) is an error: exit code 1
    with the reason, not a warning and a run that leaves the cache incomplete."""
    r = invoke(["precompile", "--arch", "sm_80", "--head-dim", "32", "--dtype", "fp16", "--no-causal", "--kernels",
                "fwd"])  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "Error: could not write the kernel cache entry" in r.output and "No space left on device" in r.output
    assert "variants:" not in r.output  # no summary claiming success
    assert len(list(cache.glob("*.cubin"))) == 1 and not list(cache.glob("*.tmp"))


def test_precompile_reports_compile_errors(cache, monkeypatch):
    log = "flash_fwd.cuh(12): error: identifier 'oops' is undefined"

    def failing(specs, jobs=1, on_done=None):
        raise jit.CompileError(f"NVRTC failed to compile {specs[0].name}:\n{log}")

    monkeypatch.setattr(jit, "precompile", failing)
    r = invoke(SMALL)
    assert r.exit_code == 1
    assert log in r.output
    assert plan.fwd_spec(64, "bf16", False, True, "sm_90a").name in r.output  # the first selected variant


def test_precompile_restores_log_level(cache, recorder):
    level = jit.logger.level
    assert invoke(SMALL).exit_code == 0
    assert jit.logger.level == level
    assert "CUFLASH_LOG_LEVEL" not in os.environ


# ---------------------------------------------------------------------------------------------
# cache list / clear
# ---------------------------------------------------------------------------------------------


def test_cache_list_empty(cache):
    r = invoke(["cache", "list"])
    assert r.exit_code == 0
    assert "empty" in r.output and str(cache) in r.output


def _list_rows(output: str) -> dict[str, list[str]]:
    """Columns of `cache list` rows by variant name (variant, arch, regs, spill B, size..., nvrtc)."""
    return {ln.split()[0]: ln.split() for ln in output.splitlines() if ln.startswith("flash_fwd_")}


def test_cache_list_and_clear(cache):
    assert invoke(SMALL).exit_code == 0
    r = invoke(["cache", "list"])
    assert r.exit_code == 0, r.output
    rows = _list_rows(r.output)
    assert set(rows) == SMALL_NAMES
    headers = {e.header["name"]: e.header for e in kcache.list_entries()}
    major, minor = jit.nvrtc_version()
    for name in SMALL_NAMES:
        cols = rows[name]
        assert cols[1] == "sm_90a"
        assert cols[2] == str(headers[name]["ptxas"]["registers"])
        assert cols[-1] == f"{major}.{minor}"
    assert f"{len(SMALL_NAMES)} entries (0 damaged)" in r.output

    r = invoke(["cache", "clear", "--yes"])
    assert r.exit_code == 0
    assert f"Removed {N_SMALL} files" in r.output
    assert not list(cache.iterdir())
    assert "empty" in invoke(["cache", "list"]).output


def test_cache_list_does_not_claim_zero_spills_without_the_ptxas_report(cache, nvrtc_log_empty):
    assert invoke(SMALL).exit_code == 0
    assert all("spill_stores" not in e.header["ptxas"] for e in kcache.list_entries())
    rows = _list_rows(invoke(["cache", "list"]).output)
    assert set(rows) == SMALL_NAMES
    assert {cols[3] for cols in rows.values()} == {"?"}


def test_cache_list_shows_damaged_entries(cache):
    assert invoke(SMALL).exit_code == 0
    victim = sorted(cache.glob("*.cubin"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    r = invoke(["cache", "list"])
    assert r.exit_code == 0
    line = next(ln for ln in r.output.splitlines() if ln.startswith(victim.name))
    assert "DAMAGED" in line and "checksum" in line
    assert f"{len(SMALL_NAMES)} entries (1 damaged)" in r.output


def test_cache_clear_asks_first(cache):
    assert invoke(SMALL).exit_code == 0
    r = CliRunner().invoke(cli.main, ["cache", "clear"], input="n\n")
    assert r.exit_code == 1  # aborted
    assert len(list(cache.glob("*.cubin"))) == N_SMALL
    r = CliRunner().invoke(cli.main, ["cache", "clear"], input="y\n")
    assert r.exit_code == 0
    assert f"Removed {N_SMALL} files" in r.output
    assert not list(cache.glob("*.cubin"))


# ---------------------------------------------------------------------------------------------
# cache prune
# ---------------------------------------------------------------------------------------------


def _entry(d: Path, name: str, *, version=__version__, nvrtc=None, age_s=0.0) -> Path:
    """A cache entry of 2000 "cubin" bytes (prune never loads it) written age_s seconds ago."""
    header = {"name": name, "arch": "sm_80", "nvrtc": list(nvrtc or jit.nvrtc_version()), "cuflash": version}
    path = d / f"{name}-0123456789abcdef01234567.cubin"
    kcache.write_atomic(path, kcache.encode_entry(b"\x7fELF" + bytes(2000), header))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


@pytest.fixture
def pruneable(cache):
    """Two good entries, a damaged one, one of another cuflash version, one of another NVRTC version,
    a temporary file left by a killed compile two hours ago and one being written now."""
    good = [_entry(cache, "good_one"), _entry(cache, "good_two")]
    bad = {"version": _entry(cache, "old_version", version="0.0.1"),
           "nvrtc": _entry(cache, "old_nvrtc", nvrtc=(11, 8))}  # fmt: skip
    bad["damaged"] = cache / "damaged-0123.cubin"
    bad["damaged"].write_bytes(good[0].read_bytes()[:300])
    bad["tmp"] = cache / "good_one-0123.cubin.abc123.tmp"
    bad["tmp"].write_bytes(b"half")
    os.utime(bad["tmp"], (time.time() - 7200, time.time() - 7200))
    fresh = cache / "good_two-0123.cubin.def456.tmp"
    fresh.write_bytes(b"being written")
    return good, bad, fresh


def test_cache_prune(cache, pruneable):
    good, bad, fresh = pruneable
    freed = sum(p.stat().st_size for k, p in bad.items() if k != "tmp")
    r = invoke(["cache", "prune"])
    assert r.exit_code == 0, r.output
    kept = cli.human_size(sum(p.stat().st_size for p in good))
    assert r.output.strip() == f"Removed 4 files ({cli.human_size(freed)}); kept 2 entries ({kept}) in {cache}."
    assert sorted(p.name for p in cache.iterdir()) == sorted([good[0].name, good[1].name, fresh.name])
    r = invoke(["cache", "prune"])
    assert r.output.startswith("Removed 0 files (0 B); kept 2 entries")
    assert "2 entries (0 damaged)" in invoke(["cache", "list"]).output


def test_cache_prune_verbose_says_why(cache, pruneable):
    _, bad, _ = pruneable
    r = invoke(["cache", "prune", "-v"])
    assert r.exit_code == 0, r.output
    why = {}
    for line in r.output.splitlines():
        if line.startswith("  removed "):
            name, reason = line[len("  removed "):].split(": ", 1)
            why[name] = reason
    assert why[bad["version"].name] == "built by cuflash 0.0.1"
    assert why[bad["nvrtc"].name] == "built by NVRTC 11.8"
    assert why[bad["damaged"].name].startswith("damaged (checksum mismatch")
    assert why[bad["tmp"].name] == "temporary file of an interrupted compile"
    assert len(why) == 4 and r.output.splitlines()[-1].startswith("Removed 4 files")


def test_cache_prune_to_a_size_removes_the_least_recently_used(cache):
    entries = {age: _entry(cache, f"entry_{age:05d}", age_s=age) for age in (10, 100, 1000, 10000)}  # one size
    size = entries[10].stat().st_size
    r = invoke(["cache", "prune", "--max-size", str(2 * size + 100), "-v"])
    assert r.exit_code == 0, r.output
    assert f"  removed {entries[1000].name}: least recently used beyond the size cap" in r.output
    assert f"  removed {entries[10000].name}: least recently used beyond the size cap" in r.output
    assert sorted(p.name for p in cache.iterdir()) == sorted([entries[10].name, entries[100].name])
    r = invoke(["cache", "prune", "--max-size", "1KiB"])
    assert r.exit_code == 0 and r.output.startswith("Removed 2 files") and not list(cache.iterdir())


@pytest.mark.parametrize("size", ["lots", "-1", "5 XB", "GiB", ""])
def test_cache_prune_bad_size_is_a_usage_error(cache, size):
    _entry(cache, "good_one")
    r = invoke(["cache", "prune", "--max-size", size])
    assert r.exit_code == 2, r.output
    assert "Invalid value for --max-size: not a size" in r.output
    assert len(list(cache.glob("*.cubin"))) == 1


@pytest.mark.parametrize("text, n", [
    ("123456", 123456), ("0", 0), ("512B", 512), ("10k", 10 * 1024), ("10K", 10 * 1024), ("10kb", 10_000),
    ("10KiB", 10 * 1024), ("500 MB", 500_000_000), ("3M", 3 * 2**20), ("3MiB", 3 * 2**20), ("2GiB", 2 * 2**30),
    ("1.5G", int(1.5 * 2**30)), ("2 gb", 2 * 10**9),
])  # fmt: skip
def test_parse_size(text, n):
    assert cli.parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "-1", "5 XB", "GiB", "", "1.2.3M", "10 KiBs", "inf", "1e400", "nan", "-inf"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        cli.parse_size(text)


# ---------------------------------------------------------------------------------------------
# bench (the benchmark itself is cuflash/bench.py; only the hand-over is tested here)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_bench(monkeypatch):
    """A stand-in cuflash.bench recording cli_main's keywords, on a machine that claims a usable GPU."""
    calls = []
    mod = types.ModuleType("cuflash.bench")
    mod.cli_main = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "cuflash.bench", mod)
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli, "plot_problem", lambda path: None)  # matplotlib or not (CI has none)
    return calls


def test_bench_plot_problems_are_usage_errors_before_the_run(fake_bench, monkeypatch, tmp_path):
    """--plot that could not be drawn fails at once (exit 2, nothing run), not after the benchmark."""
    monkeypatch.undo()  # the real plot_problem, with the fake module and GPU back below
    monkeypatch.setitem(sys.modules, "cuflash.bench", types.SimpleNamespace(cli_main=lambda **kw: fake_bench.append(kw)))
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    r = invoke(["bench", "--plot", str(tmp_path / "no-such-folder" / "f.png")])
    missing_mpl = importlib.util.find_spec("matplotlib") is None
    assert r.exit_code == 2 and ("needs matplotlib" if missing_mpl else "does not exist") in r.output, r.output
    monkeypatch.setattr(cli, "plot_problem", lambda path: "--plot needs matplotlib: pip install 'cuflash[plot]'")
    r = invoke(["bench", "--plot", str(tmp_path / "f.png")])
    assert r.exit_code == 2 and "--plot needs matplotlib: pip install 'cuflash[plot]'" in r.output
    assert fake_bench == []
    assert cli.plot_problem(str(tmp_path / "nowhere" / "f.png")) is not None


def test_bench_window_without_the_window_variant_is_a_usage_error(fake_bench):
    """--window sizes only the window variant's benchmark: elsewhere it would be silently ignored."""
    for extra in ([], ["--variant", "softcap"], ["--decode"]):
        r = invoke(["bench", "--window", "5", *extra])
        assert r.exit_code == 2 and "--window applies to --variant window (or all) only" in r.output, (extra, r.output)
    assert fake_bench == []


def test_bench_from_json_and_json_together_is_a_usage_error(fake_bench, tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text("{}")
    r = invoke(["bench", "--from-json", str(saved), "--json", str(tmp_path / "new.json")])
    assert r.exit_code == 2 and "use one of them" in r.output and fake_bench == []


def test_bench_defaults(fake_bench):
    r = invoke(["bench"])
    assert r.exit_code == 0, r.output
    assert fake_bench == [
        dict(head_dim=(64, 128, 256), seqlen=(512, 1024, 2048, 4096, 8192, 16384), tokens=16384, hidden=2048,
             dtype="bf16", causal="both", op="fwd", repeats=30, peers=True, json_path=None, plot_path=None)
    ]


def test_bench_options(fake_bench, tmp_path):
    r = invoke(["bench", "--head-dim", "128", "--seqlen", "1024", "--seqlen", "2048", "--tokens", "4096",
                "--hidden", "1024", "--dtype", "both", "--causal", "--repeats", "5", "--no-peers",
                "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), "--op", "fwd+bwd"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert fake_bench == [
        dict(head_dim=(128,), seqlen=(1024, 2048), tokens=4096, hidden=1024, dtype="both", causal="causal",
             op="fwd+bwd", repeats=5, peers=False, json_path=str(tmp_path / "r.json"), plot_path=str(tmp_path / "r.png"))
    ]
    r = invoke(["bench", "--no-causal"])
    assert fake_bench[-1]["causal"] == "no-causal"


def test_bench_signature_matches_the_benchmark_module():
    """The keywords the CLI passes are accepted by the real cuflash.bench.cli_main."""
    import inspect

    bench = pytest.importorskip("cuflash.bench")
    params = inspect.signature(bench.cli_main).parameters
    # --decode's options go to bench_decode, --from-json's are handled by the CLI (replot)
    passed = ({p.name for p in cli.bench.params} - set(cli.DECODE_ONLY_OPTIONS) - set(cli.REPLOT_OPTIONS)
              - set(cli.VARIANT_ONLY_OPTIONS) - set(cli.VARLEN_ONLY_OPTIONS) - set(cli.E2E_ONLY_OPTIONS))  # fmt: skip
    assert passed <= set(params)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    assert required <= passed
    assert {p.name for p in cli.bench.params} >= set(cli.DECODE_ONLY_OPTIONS) | set(cli.REPLOT_OPTIONS)
    from cuflash import bench_decode, bench_variants

    # --variant: bench_variants.cli_main takes the prefill options, "variants" and "window"
    variant_params = inspect.signature(bench_variants.cli_main).parameters
    assert passed | {"variants", "window"} <= set(variant_params)
    assert {n for n, p in variant_params.items() if p.default is inspect.Parameter.empty} <= passed | {"variants"}
    assert set(cli.BENCH_VARIANTS) == set(bench_variants.VARIANTS)
    # --varlen: bench_varlen.cli_main takes the prefill options but --seqlen, which becomes "means"
    from cuflash import bench_varlen

    varlen_params = inspect.signature(bench_varlen.cli_main).parameters
    assert (passed - {"seqlen"}) | {"means"} <= set(varlen_params)
    assert {n for n, p in varlen_params.items() if p.default is inspect.Parameter.empty} <= passed
    for mod in (bench, bench_decode, bench_variants, bench_varlen):  # the CLI calls replot(json_path, plot_path)
        replot = inspect.signature(mod.replot).parameters
        assert list(replot)[:2] == ["json_path", "plot_path"], mod.__name__
        assert all(p.default is not inspect.Parameter.empty for p in list(replot.values())[2:])


def test_bench_without_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuflash.bench", None)  # makes the import fail
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    r = invoke(["bench"])
    assert r.exit_code == 1
    assert "cuflash.bench" in r.output


# ---------------------------------------------------------------------------------------------
# bench without a GPU: one line, exit code 1, no traceback (and --from-json, which needs none)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_bench_modules(monkeypatch):
    """Benchmark modules that fail the test if the CLI hands over to them."""
    for name in ("cuflash.bench", "cuflash.bench_decode"):
        mod = types.ModuleType(name)

        def refuse(*args, **kwargs):
            raise AssertionError("the benchmark ran without a GPU")

        mod.cli_main = mod.replot = refuse
        monkeypatch.setitem(sys.modules, name, mod)


def _assert_needs_a_gpu(r, reason=None):
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    assert lines[0].startswith("Error: cuflash bench needs a CUDA GPU ("), lines[0]
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)  # click's exit, nothing raised
    if reason is not None:
        assert f"({reason})" in lines[0]


@pytest.mark.parametrize("decode", [[], ["--decode"]])
def test_bench_on_this_machine_without_a_gpu(decode, no_bench_modules):
    """The real gpu_problem on this machine (no GPU, or no driver for it)."""
    if cli.gpu_problem() is None:
        pytest.skip("this machine has a usable GPU")
    _assert_needs_a_gpu(invoke(["bench", *decode]))


@pytest.mark.parametrize("decode", [[], ["--decode"]])
def test_bench_without_a_device(decode, no_gpu, no_bench_modules):
    """gpu_problem itself, with the CUDA runtime reporting no device (as on any GPU-less machine)."""
    r = invoke(["bench", *decode, "--head-dim", "128"])
    _assert_needs_a_gpu(r, "CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected")


@pytest.mark.parametrize("decode", [[], ["--decode"]])
def test_bench_with_a_gpu_problem(decode, monkeypatch, no_bench_modules):
    monkeypatch.setattr(cli, "gpu_problem", lambda: "no CUDA GPU is visible")
    _assert_needs_a_gpu(invoke(["bench", *decode]), "no CUDA GPU is visible")


def test_gpu_problem(monkeypatch):
    rt = cupy.cuda.runtime
    monkeypatch.setattr(rt, "getDeviceCount", lambda: 0)
    assert cli.gpu_problem() == "no CUDA GPU is visible"
    monkeypatch.setattr(rt, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0))
    monkeypatch.setattr(jit, "device_arch", lambda i: plan.arch_for_capability(7, 5))  # a Turing GPU
    assert cli.gpu_problem().startswith("RuntimeError: cuflash needs a GPU of compute capability 8.0 or newer")
    monkeypatch.setattr(jit, "device_arch", lambda i: "sm_90a")
    assert cli.gpu_problem() is None


ENV = {"gpu": "NVIDIA H200", "compute_capability": "90", "sm_count": 132, "cuflash": __version__, "cupy": "14.0.0",
       "nvrtc": "12.9", "driver": 12080, "python": "3.11.9", "date": "2026-12-01 12:00:00"}  # fmt: skip


def _saved_prefill_run(path: Path) -> Path:
    """What `cuflash bench --json` writes (cuflash.bench.cli_main): the environment and the rows."""
    from cuflash import bench

    rows = [bench.Row("bf16", 128, True, 4096, 4, 16, ms={"cuflash": 1.234, "flash": 1.5},
                      tflops={"cuflash": 333.3, "flash": 277.7}, mem_mb={"cuflash": 0.0}, host_us=12.5),
            bench.Row("fp16", 64, False, 512, 32, 32, op="fwd+bwd", ms={"cuflash": 0.5},
                      tflops={"cuflash": 150.0}, notes={"cudnn": "not supported"}, host_us=20.0)]  # fmt: skip
    path.write_text(json.dumps({"environment": ENV, "rows": [asdict(r) for r in rows]}, indent=1))
    return path


def _saved_decode_run(path: Path) -> Path:
    """What `cuflash bench --decode --json` writes (cuflash.bench_decode.cli_main)."""
    from cuflash import bench_decode as bd

    rows = [bd.DecodeRow("bf16", 128, 8, 32768, 32, 8, kv_gb=bd.row_gb(8, 32768, 8, 128), num_splits=4,
                         ctas_per_sm=2, ms={"cuflash": 0.05, "cudnn": 0.06}, tbps={"cuflash": 4.321, "cudnn": 3.6},
                         host_us=15.0),
            bd.DecodeRow("bf16", 128, 1, 4096, 32, 32, kv_gb=bd.row_gb(1, 4096, 32, 128), num_splits=12,
                         ms={"cuflash": 0.01}, tbps={"cuflash": 3.21}, notes={"flash": "out of memory"})]  # fmt: skip
    pd = [bd.PrefillDecodeRow("bf16", 128, 4096, 32, 8, prefill_ms=1.0, prefill_tflops=300.0, decode_ms=0.01,
                              decode_tbps=3.5)]  # fmt: skip
    path.write_text(json.dumps({"environment": ENV, "bytes_model": bd.BYTES_MODEL, "decode": [asdict(r) for r in rows],
                                "prefill_vs_decode": [asdict(r) for r in pd]}, indent=1))  # fmt: skip
    return path


@pytest.fixture
def gpu_never_asked(monkeypatch):
    def fail():
        raise AssertionError("--from-json must not look for a GPU")

    monkeypatch.setattr(cli, "gpu_problem", fail)


def test_bench_from_json_prints_the_saved_table(tmp_path, gpu_never_asked):
    from cuflash import bench

    path = _saved_prefill_run(tmp_path / "run.json")
    r = invoke(["bench", "--from-json", str(path)])
    assert r.exit_code == 0, r.output
    rows = [bench.Row(**x) for x in json.loads(path.read_text())["rows"]]
    assert r.output.strip() == bench.format_table(rows, ENV).strip()
    assert "GPU NVIDIA H200 (sm 90, 132 SMs)" in r.output and "  333.3   277.7" in r.output
    assert "fwd+bwd" in r.output and "note: cudnn at fwd+bwd fp16 hd64 causal=False s=512: not supported" in r.output
    assert not list(tmp_path.glob("*.png"))


def test_bench_decode_from_json_prints_the_saved_tables(tmp_path, gpu_never_asked):
    from cuflash import bench_decode as bd

    path = _saved_decode_run(tmp_path / "decode.json")
    r = invoke(["bench", "--decode", "--from-json", str(path)])
    assert r.exit_code == 0, r.output
    data = json.loads(path.read_text())
    rows = [bd.DecodeRow(**x) for x in data["decode"]]
    pd = [bd.PrefillDecodeRow(**x) for x in data["prefill_vs_decode"]]
    assert bd.format_decode_table(rows, ENV) in r.output and bd.format_prefill_table(pd) in r.output
    assert "4.321" in r.output or "4.32" in r.output


@pytest.mark.parametrize("decode", [False, True])
def test_bench_from_json_with_plot(tmp_path, gpu_never_asked, decode):
    pytest.importorskip("matplotlib")
    path = (_saved_decode_run if decode else _saved_prefill_run)(tmp_path / "run.json")
    png = tmp_path / "run.png"
    r = invoke(["bench", *(["--decode"] if decode else []), "--from-json", str(path), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"environment": {}}', '{"rows": [{"dtype": "bf16"}]}',
                                     "{}"])  # fmt: skip
def test_bench_from_json_of_something_else(tmp_path, gpu_never_asked, decode, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    r = invoke(["bench", *(["--decode"] if decode else []), "--from-json", str(path)])
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"Error: {path} is not a saved `cuflash bench{' --decode' if decode else ''} --json` run")
    assert "Traceback" not in r.output


def test_bench_from_json_of_the_other_kind(tmp_path, gpu_never_asked):
    """Without a mode flag a saved run is redrawn as the mode that saved it; a mode flag that names
    another kind is a usage error that says which flag the file needs, not a half-printed table."""
    from cuflash import bench, bench_decode as bd

    decode_run = _saved_decode_run(tmp_path / "d.json")
    r = invoke(["bench", "--from-json", str(decode_run)])
    assert r.exit_code == 0, r.output
    assert bd.format_decode_table([bd.DecodeRow(**x) for x in json.loads(decode_run.read_text())["decode"]], ENV) in r.output
    r = invoke(["bench", "--decode", "--from-json", str(_saved_prefill_run(tmp_path / "p.json"))])
    assert r.exit_code == 2 and "holds a `cuflash bench --json` run, not a `cuflash bench --decode` one: leave out " \
        "the mode flag\n" in r.output, r.output
    varlen_run = tmp_path / "v.json"
    bench.save_run(str(varlen_run), ENV, [], benchmark="varlen")
    r = invoke(["bench", "--decode", "--from-json", str(varlen_run)])
    assert r.exit_code == 2 and "leave out the mode flag, or give --varlen" in r.output, r.output
    for kind, extra in (("prefill", {}), ("decode", {"decode": []}), ("variant", {"window_check": {}}),
                        ("varlen", {"benchmark": "varlen"}), ("e2e", {"benchmark": "e2e", "runs": []})):  # fmt: skip
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"environment": ENV, "rows": [], **extra}))
        assert cli.saved_run_kind(str(path)) == kind
    for content in ("{not json", "[1, 2]", '{"rows": []}', '{"environment": {}}'):
        (tmp_path / "x.json").write_text(content)
        assert cli.saved_run_kind(str(tmp_path / "x.json")) is None


def test_bench_from_json_needs_an_existing_file(tmp_path, gpu_never_asked):
    r = invoke(["bench", "--from-json", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "does not exist" in r.output


# ---------------------------------------------------------------------------------------------
# python -m cuflash
# ---------------------------------------------------------------------------------------------


def test_python_dash_m(cache):
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "cuflash", "cache", "list"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "empty" in r.stdout and str(cache) in r.stdout
    r = subprocess.run([sys.executable, "-m", "cuflash", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0
    for cmd in ("info", "precompile", "cache", "bench"):
        assert cmd in r.stdout


# ---------------------------------------------------------------------------------------------
# The benchmark's timer (cuflash.bench.time_ms) with CUDA events faked: what it calls, in what order
# ---------------------------------------------------------------------------------------------


class _FakeClock:
    """Stands in for CuPy's stream and events: an event records how many calls had been made, and the
    elapsed "time" between two events is the number of calls between them."""

    def __init__(self, log):
        self.log = log

    def stream(self):
        log = self.log

        class Stream:
            def synchronize(self):
                log.append("sync")

        return Stream()

    def event(self):
        log = self.log

        class Event:
            def record(self, stream=None):
                self.at = sum(1 for x in log if x not in ("sync",))

            def synchronize(self):
                pass

        return Event()


@pytest.mark.parametrize("primer", [False, True])
def test_time_ms_rounds_and_primer(monkeypatch, primer):
    from cuflash import bench

    log = []
    clock = _FakeClock(log)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", clock.stream)
    monkeypatch.setattr(cupy.cuda, "Event", clock.event)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: float(b.at - a.at))
    fns = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    ms = bench.time_ms(fns, repeats=4, warmup_s=0.0, calls=5, primer=primer)
    # each sample spans exactly its 5 calls: the primer call and its sync fall outside the events
    assert ms == {"a": 1.0, "b": 1.0, "c": 1.0}
    timed = [x for x in log if x != "sync"][3:]  # after the one warm-up round
    per_sample = 5 + (1 if primer else 0)
    assert len(timed) == 4 * 3 * per_sample
    samples = [timed[i:i + per_sample] for i in range(0, len(timed), per_sample)]
    # the dict's order, reversed every other round, so no function always comes after the same one
    assert [s[0] for s in samples] == ["a", "b", "c", "c", "b", "a"] * 2
    assert all(len(set(s)) == 1 for s in samples)  # a primer call is the same function's


def test_time_ms_one_function_has_no_primer(monkeypatch):
    """The primer only separates different functions; one function timed alone runs no extra calls
    (the bench times the slow naive reference and one-off prefills alone)."""
    from cuflash import bench

    log = []
    clock = _FakeClock(log)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", clock.stream)
    monkeypatch.setattr(cupy.cuda, "Event", clock.event)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: float(b.at - a.at))
    assert bench.time_ms({"only": lambda: log.append("only")}, repeats=3, warmup_s=0.0, calls=2) == {"only": 1.0}
    assert [x for x in log if x != "sync"] == ["only"] * (1 + 3 * 2)

def test_bench_varlen_from_json_and_usage(tmp_path, gpu_never_asked):
    """--varlen: a saved run prints its table (ratios to the even batch and to FlexAttention) without a
    GPU; it does not combine with --decode or --variant."""
    from cuflash import bench, bench_varlen

    rows = [bench.Row("bf16", 128, True, 512, 31, 16, op="fwd", ms={"cuflash": 0.2},
                      tflops={"cuflash": 200.0, "cuflash equal": 210.0, "flex": 150.0}),
            bench.Row("bf16", 128, True, 2048, 7, 16, op="bwd", ms={"cuflash": 1.0},
                      tflops={"cuflash": 300.0, "cuflash equal": 290.0}, notes={"flex": "RuntimeError: no"})]  # fmt: skip
    path = tmp_path / "varlen.json"
    bench.save_run(str(path), ENV, rows, benchmark="varlen")
    r = invoke(["bench", "--varlen", "--from-json", str(path)])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == bench_varlen.format_table(rows, ENV).strip()
    # without the mode flag, and with what sizes a new run only (a redraw ignores it: no error about flags not typed)
    for extra in ([], ["--op", "fwd+bwd"], ["--window", "5"]):
        r = invoke(["bench", "--from-json", str(path), *extra])
        assert r.exit_code == 0 and r.output.strip() == bench_varlen.format_table(rows, ENV).strip(), (extra, r.output)
    assert "fwd: cuflash varlen / cuflash equal over 1 points: median 0.952" in r.output
    assert "fwd: cuflash varlen / flex over 1 points: median 1.333" in r.output
    assert "note: flex at bwd hd128 mean=2048: RuntimeError: no" in r.output
    for extra in (["--decode"], ["--variant", "window"]):
        r = invoke(["bench", "--varlen", *extra])
        assert r.exit_code == 2 and "--varlen" in r.output


def test_bench_varlen_lengths_and_pairs():
    from cuflash import bench_varlen

    for mean in (512, 8192):
        lengths = bench_varlen.draw_lengths(mean, 16384)
        assert sum(lengths) == 16384 and all(1 <= n <= 2 * mean for n in lengths)
        assert lengths == bench_varlen.draw_lengths(mean, 16384)  # seeded: every run the same batch
    assert bench_varlen.pairs([3, 1], causal=True) == 6 + 1 and bench_varlen.pairs([3, 1], causal=False) == 9 + 1


def test_bench_e2e_passes_its_options(monkeypatch):
    """--e2e hands its options to cuflash.bench_e2e.cli_main (keywords it accepts), and refuses the
    options of the other benchmarks."""
    import inspect

    from cuflash import bench_e2e

    got = []
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench_e2e, "cli_main", lambda **kw: got.append(kw))
    r = invoke(["bench", "--e2e", "--model", "gpt-1.3b", "--seqlen", "2048", "--tokens", "8192", "--no-compile",
                "--no-peers"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert got == [dict(models=("gpt-1.3b",), contexts=(2048,), tokens=8192, repeats=5, peers=False,
                        compile_model=False, inference=True, json_path=None, plot_path=None)]  # fmt: skip
    monkeypatch.undo()
    assert set(got[0]) <= set(inspect.signature(bench_e2e.cli_main).parameters)
    assert invoke(["bench", "--e2e", "--varlen"]).exit_code != 0
    assert invoke(["bench", "--model", "gpt-1.3b"]).exit_code != 0


def test_progress_lines_off_a_terminal(capsys):
    """Off a terminal the progress is lines on stderr: the first item, then one per interval, and the last."""
    with cli._progress(5, "Doing") as step:
        for _ in range(5):
            step()
    assert [line.split()[1] for line in capsys.readouterr().err.splitlines()] == ["1/5", "5/5"]
    with cli._progress(3, "Doing", every_s=0.0) as step:
        for _ in range(3):
            step()
    assert [line.split()[1] for line in capsys.readouterr().err.splitlines()] == ["1/3", "2/3", "3/3"]
