"""tools/bwd_layout_model.py on the CPU: in its model of the TMA backward's shared-memory layouts every
GEMM operand of the 64-, 128- and 80-row query blocks is the logical matrix it stands for, and the planner's
dQ layout of each tile carries every dQ accumulator element to its place through dq_accum and the convert
kernel (transposed at 80 rows). The 64-row tiles, which pass on the GPU, keep the model honest."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bwd_layout_model as model  # noqa: E402


@pytest.mark.parametrize("head_dim,block_m", model.TILES)
def test_operands_and_dq_places(head_dim, block_m):
    assert model.check(head_dim, block_m) == []
    wrong, covers = model.dq_roundtrip(head_dim, block_m)
    assert wrong == 0 and covers


def test_the_model_sees_a_misplaced_operand():
    """A dS^T tile read one 64-query atom off (the 128-row blocks' second warpgroup reading the first's
    queries) is not the matrix the dQ GEMM means."""
    sm = model.Smem()
    model.stmatrix_dsT(sm, 0, 128, 128)
    first = model.read(sm, 0, 128 * 128, 1, 64)
    second = model.read(sm, 128 * 128, 128 * 128, 1, 64)
    assert first[5][3] == ("dsT", 3, 5) and second[5][3] == ("dsT", 3, 69) and first != second
