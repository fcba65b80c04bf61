"""tools/bench_ring.py, the multi-GPU benchmark of ring attention, run end to end on the CPU: 2 processes
over gloo with the ops' float64 CPU kernels (tests/torch_cpu_kernels.py) at a tiny size. A check that
the tool spawns its ranks, times the ring and the one-device call and reports them, not a measurement
(the tool is for machines with several GPUs)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (optional extra cuflash[torch])")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_ring


@pytest.mark.parametrize("causal", [True, False])
def test_bench_ring_runs_on_cpu(tmp_path, causal):
    out = tmp_path / "ring.json"
    args = ["--device", "cpu", "--world", "2", "--seqlen", "64", "--heads", "2", "--head-dim", "16", "--repeats", "2",
            "--json", str(out)] + ([] if causal else ["--no-causal"])  # fmt: skip
    res = bench_ring.main(args)
    assert json.loads(out.read_text()) == res
    assert res["world"] == 2 and res["causal"] == causal and res["seqlen"] == 64
    assert len(res["ring"]["times_ms"]) == 2 and res["ring"]["ms"] > 0 and len(res["ring"]["peak_bytes_per_rank"]) == 2
    assert len(res["single"]["times_ms"]) == 2 and res["speedup"] == res["single"]["ms"] / res["ring"]["ms"]
    flops = 3.5 * 4 * 64 * 64 * 2 * 16 * (0.5 if causal else 1.0)  # (the FlashAttention-2 paper's count)
    assert res["ring"]["tflops"] == pytest.approx(flops / res["ring"]["ms"] / 1e9)


def test_bench_ring_refuses_a_length_the_ranks_cannot_split():
    with pytest.raises(SystemExit, match="multiple of 4"):
        bench_ring.main(["--device", "cpu", "--world", "2", "--seqlen", "66"])


@pytest.mark.parametrize("window", [None, ["8", "0"]])
def test_bench_ring_simulates_the_ranks_on_one_device(tmp_path, window):
    """--simulate W: simulate_ring's W ranks in this process against one call, and the bound W x one call /
    simulated (with a window over zigzag slices too)."""
    out = tmp_path / "ring.json"
    args = ["--device", "cpu", "--simulate", "3", "--seqlen", "48", "--heads", "2", "--head-dim", "16", "--repeats", "2",
            "--json", str(out)] + (["--window", *window] if window else [])  # fmt: skip
    res = bench_ring.main(args)
    assert json.loads(out.read_text()) == res
    assert res["simulated"] and res["world"] == 3 and res["window"] == ([8, 0] if window else [-1, -1])
    assert len(res["ring"]["times_ms"]) == 2 and "peak_bytes_per_rank" not in res["ring"] and "speedup" not in res
    assert res["speedup_bound"] == 3 * res["single"]["ms"] / res["ring"]["ms"]
    from cuflash.bench_variants import visible_pairs

    pairs = visible_pairs(48, 48, True, (8, 0)) if window else 48 * 48 / 2  # (a window counts what it leaves)
    assert res["single"]["tflops"] == pytest.approx(3.5 * 4 * pairs * 2 * 16 / res["single"]["ms"] / 1e9)
