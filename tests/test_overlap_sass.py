"""The TMA forward's softmax runs under the previous tile's P V product in the machine code, not only in
the source: ptxas hoisted that product's wait above the softmax in every variant until session 17
(docs/design/forward.md, "Intra-warpgroup overlap"). tools/check_overlap_sass.py compiles with the local
nvcc and reads the SASS with nvdisasm (PyPI: nvidia-cuda-nvdisasm); without either the test skips."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import check_overlap_sass


def _nvdisasm():
    if not shutil.which("nvcc"):
        pytest.skip("nvcc is not installed")
    try:
        exe = check_overlap_sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    if subprocess.run([exe, "--version"], capture_output=True, check=False).returncode:
        pytest.skip("nvdisasm does not run here")
    return exe


def test_exps_under_pv_reads_the_waits():
    sass = "\n".join(["DEPBAR.LE gsb0, 0x1 ;", "MUFU.EX2 R1, R1 ;", "MUFU.EX2 R2, R2 ;", "DEPBAR.LE gsb0, 0x0 ;",
                      "MUFU.EX2 R3, R3 ;", "DEPBAR.LE gsb0, 0x1 ;", "DEPBAR.LE gsb0, 0x0 ;", "MUFU.EX2 R4, R4 ;"])
    assert check_overlap_sass.exps_under_pv(sass) == [2, 0]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,causal,which",
                         [(64, True, "default"), (128, False, "default"), (128, True, "short"), (256, True, "default"),
                          (256, False, "short")])
def test_the_softmax_sits_between_the_two_waits(head_dim, causal, which):
    """A tile's worth of MUFU.EX2 (block_n / 2 per thread) between the S wait and the P V wait."""
    exe = _nvdisasm()
    tile = (plan.FWD_SM90_WS_TILES if which == "default" else plan.FWD_SM90_WS_SHORT_TILES)[head_dim]
    spec = plan.fwd_sm90_ws_spec(head_dim, "bf16", causal, tile)
    name, counts, per_tile = check_overlap_sass.check(spec, exe)
    assert counts and max(counts) >= per_tile, (name, counts, per_tile)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,rows", [(64, 128), (128, 80)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_wide_blocks_exps_under_dp(head_dim, rows, causal):
    """The TMA backward's wide query blocks (128 rows at head dim 64, 80 at 128): P^T's exponentials (rows / 2
    per thread) sit between the S^T wait and the dP^T wait, so they run under dP^T. In the softmax's block
    ptxas had scheduled the dP^T wait above 48 of the 64 at 128 rows; it sits at the head of a branch since."""
    exe = _nvdisasm()
    spec = plan.bwd_sm90_ws_spec(head_dim, "bf16", causal, plan.BwdSm90WsTile(block_m=rows, stages=3 if rows == 128 else 2))
    counts = check_overlap_sass.exps_under_pv(check_overlap_sass.sass_of(spec, exe))
    assert counts and max(counts) >= rows // 2, (spec.name, counts)


def epilogue_under_next_s(sass: str) -> bool:
    """Whether the first 16-byte store of O (STG.E.128) comes after an S = Q K^T issue (HGMMA without .tnspB)
    with no wait for every wgmma (DEPBAR.LE gsb0, 0x0) in between: the epilogue runs while that S is in flight."""
    last_s = None
    for i, line in enumerate(sass.splitlines()):
        if "HGMMA" in line:
            last_s = i if "tnspB" not in line else None
        elif re.search(r"DEPBAR\.LE gsb0, 0x0\b", line):
            last_s = None
        elif "STG.E.128" in line:
            return last_s is not None
    return False


def test_epilogue_under_next_s_reads_the_order():
    s_group = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;", "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;"]
    pv = "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR20].tnspB, R88 ;"
    store = "STG.E.128 desc[UR14][R8.64], R16 ;"
    assert epilogue_under_next_s("\n".join([pv] + s_group + [store]))
    assert not epilogue_under_next_s("\n".join([pv, "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", store]))
    assert not epilogue_under_next_s("\n".join([pv] + s_group + ["WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", store]))


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_look_ahead_issues_the_next_s_before_the_epilogue(head_dim, causal):
    """The look-ahead tile (Sm90WsTile.look_ahead; not planned until measured): the next item's first S is
    issued before the epilogue's stores, which no wait for it precedes, and the loop still keeps a tile's
    exponentials between its two waits. Without the look-ahead the same tile's epilogue follows a wait for
    every wgmma."""
    import dataclasses

    exe = _nvdisasm()
    tile = plan.FWD_SM90_WS_SHORT_TILES[head_dim]
    for la in (True, False):
        sass = check_overlap_sass.sass_of(plan.fwd_sm90_ws_spec(head_dim, "bf16", causal,
                                                                dataclasses.replace(tile, look_ahead=la)), exe)
        assert epilogue_under_next_s(sass) == la, (head_dim, causal, la)
        counts = check_overlap_sass.exps_under_pv(sass)
        assert counts and max(counts) >= tile.block_n // 2, (la, counts)
