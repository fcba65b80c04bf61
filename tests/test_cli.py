"""CPU tests of the command line (cuflash/cli.py): info, precompile, cache list/clear, bench.

No GPU needed: the GPU queries are replaced by fakes where a test needs a definite answer, and
NVRTC compiles for an explicit --arch on the CPU. Every test uses a temporary kernel cache.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import cupy
import pytest
from click.testing import CliRunner

from cuflash import cli, jit, plan

REPO = Path(__file__).resolve().parent.parent

# The cheapest selection that compiles: 3 forward variants (mma.sync with 16-byte vector and with
# element-wise loads, and the Hopper kernel).
SMALL = ["precompile", "--arch", "sm_90a", "--head-dim", "64", "--dtype", "bf16", "--no-causal", "--kernels", "fwd"]
SMALL_NAMES = {plan.fwd_spec(64, "bf16", False, aligned, "sm_90a").name for aligned in (True, False)} | {
    plan.fwd_sm90_spec(64, "bf16", False).name
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
    return {e.header["name"] for e in jit.list_cache() if e.header} if d.is_dir() else set()


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
    entries = jit.list_cache()
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
    entries = jit.list_cache()
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
    assert recorder.specs == expected
    assert f"{len(expected)} variants: {len(expected)} compiled" in r.output


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
    headers = {e.header["name"]: e.header for e in jit.list_cache()}
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
    assert all("spill_stores" not in e.header["ptxas"] for e in jit.list_cache())
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
# bench (the benchmark itself is cuflash/bench.py; only the hand-over is tested here)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_bench(monkeypatch):
    calls = []
    mod = types.ModuleType("cuflash.bench")
    mod.cli_main = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "cuflash.bench", mod)
    return calls


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
    passed = {p.name for p in cli.bench.params} - set(cli.DECODE_ONLY_OPTIONS)  # --decode's go to bench_decode
    assert passed <= set(params)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    assert required <= passed


def test_bench_without_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuflash.bench", None)  # makes the import fail
    r = invoke(["bench"])
    assert r.exit_code == 1
    assert "cuflash.bench" in r.output


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