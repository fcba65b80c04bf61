"""tools/ablation.py's planning half on the CPU: which schedules each grid point ablates (derived from the
planner's tile there, every one a kernel the planner's spec checks accept) and the summary table."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cuflash import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ablation

H200 = dict(sm_count=132, l2_bytes=60 * 2**20)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [512, 1024, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_schedules_are_buildable_variants_of_the_planned_tile(head_dim, seqlen, causal):
    s = ablation.fwd_schedules(head_dim, seqlen, causal, **H200)
    names = list(s)
    assert names[0] == "planned" and s["planned"] is None and names[-1] == "no warp specialization"
    assert s["no warp specialization"] == plan.FWD_SM90_TILES[head_dim]
    base = plan.sm90_ws_tile(head_dim, seqlen, causal)
    assert s["no intra-warpgroup overlap"].overlap is False
    for name, tile in s.items():
        if isinstance(tile, plan.Sm90WsTile):
            plan.fwd_sm90_ws_spec(head_dim, "bf16", causal, tile)  # (raises where the kernel cannot be built)
            assert (tile.block_m, tile.block_n) == (base.block_m, base.block_n), name
    assert ("ping-pong" in s) == (base.block_m == 128)
    assert ("look-ahead (candidate)" in s) == (base.persistent and base.block_m == 128)
    assert ("per-tile grid" in s) == base.persistent
    if base.persistent:
        assert s["per-tile grid"].tma_store and not s["per-tile grid"].persistent
    if "persistent grid" in s:  # (on the walk the planner takes for the bucket's persistent tile)
        assert s["persistent grid"].persistent and not base.persistent
        assert s["persistent grid"].paired == plan.FWD_SM90_WS_SHORT_TILES[head_dim].paired
    walk = "strided walk" if base.paired else "paired walk (candidate)"  # (a causal persistent tile's walk flipped)
    assert (walk in s) == (base.persistent and causal)
    if walk in s:
        assert s[walk].persistent and s[walk].paired != base.paired


def test_fwd_schedules_cover_the_persistent_points():
    """The short-key points ablate the persistent tile (hd 64 / 128 at 1024 tokens), the long ones the default."""
    short = ablation.fwd_schedules(128, 1024, False, **H200)
    assert {"per-tile grid", "look-ahead (candidate)", "ping-pong"} <= set(short)
    long = ablation.fwd_schedules(128, 16384, False, **H200)
    assert "persistent grid" in long and "look-ahead (candidate)" not in long
    assert "ping-pong" not in long  # (the default has 3 consumer warpgroups at head dim 128)
    assert "persistent grid" not in ablation.fwd_schedules(256, 16384, True, **H200)  # (no room for O's staging tile)
    # the causal walk: hd 64 and 128 plan the paired one (ablated: strided)
    for d in (64, 128):
        assert "strided walk" in ablation.fwd_schedules(d, 1024, True, **H200)
        assert "paired walk (candidate)" not in ablation.fwd_schedules(d, 1024, True, **H200)
    assert not {"strided walk", "paired walk (candidate)"} & set(short)  # (non-causal: every tile costs the same)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_schedules(head_dim, causal):
    s = ablation.bwd_schedules(head_dim, causal, 132)
    assert list(s)[0] == "planned" and s["no warp specialization"] == plan.BWD_SM90_TILES[head_dim]
    base = plan.bwd_sm90_ws_tile(head_dim, causal, 0, 132)
    flipped = "per-key-block grid" if base.persistent else "persistent grid"
    assert (flipped in s) == (head_dim in (64, 128))
    wide = [n for n in s if "query blocks" in n]
    assert bool(wide) == (head_dim in plan.BWD_SM90_WS_WIDE_ROWS)
    if base.block_m != 64:  # planned wide (head dim 64's 128 rows): the row ablates them back to 64
        assert wide == ["64-row query blocks"] and s[wide[0]].block_m == 64
    for name, tile in s.items():
        if isinstance(tile, plan.BwdSm90WsTile):
            plan.bwd_sm90_ws_spec(head_dim, "bf16", causal, tile)


def test_summarize_medians_and_ratios():
    rows = [{"op": "fwd", "head_dim": 64, "tflops": {"planned": 100.0, "no overlap": 80.0, "cudnn": 125.0, "flash": 50.0}},
            {"op": "fwd", "head_dim": 64, "tflops": {"planned": 200.0, "no overlap": 200.0, "cudnn": 200.0, "flash": 90.0}},
            {"op": "fwd", "head_dim": 64, "tflops": {"planned": 300.0, "no overlap": 150.0, "cudnn": 250.0, "flash": 99.0}}]
    text = ablation.summarize(rows)
    assert "| planned | 1.000 (0.80) [3] |" in text  # 0.8, 1.0, 1.2
    assert "| no overlap | 0.640 (0.60); 0.800x [3] |" in text  # 0.64, 1.0, 0.6 of cuDNN; 0.8, 1.0, 0.5 of planned
    assert "flash" not in text.split("|---|")[1]


def test_from_json_prints_the_saved_runs_tables(tmp_path, monkeypatch, capsys):
    rows = [{"op": "bwd", "head_dim": 128, "tflops": {"planned": 90.0, "wide": 99.0, "cudnn": 100.0}}]
    saved = tmp_path / "ablation.json"
    saved.write_text(json.dumps({"environment": {}, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["ablation.py", "--from-json", str(saved)])
    assert ablation.main() == 0
    out = capsys.readouterr().out
    assert "| planned | 0.900 (0.90) [1] |" in out and "| wide | 0.990 (0.99); 1.100x [1] |" in out
