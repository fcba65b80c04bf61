"""tools/trace_fwd.py on the CPU: its reading of the trace buffer and of the marks, its event numbers
against the kernel's, and the diagnostic build (-DCUFLASH_TRACE) compiling without local memory."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cuflash import jit, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_fwd


def _marks(n_tiles, t0=0):
    """One item of the overlapped schedule with n_tiles key tiles, 10 ns per phase."""
    names = ["item", "Q", "K", "S", "softmax"] + ["K", "V", "S", "softmax", "PV"] * (n_tiles - 1) + ["V", "PV", "epilogue"]
    num = {v: k for k, v in trace_fwd.EVENTS.items()}
    return [(num[n], t0 + 10 * i) for i, n in enumerate(names)]


def test_consumer_phases_of_two_items():
    rows = trace_fwd.consumer_phases(_marks(4) + _marks(1, t0=1000))
    assert [r["tiles"] for r in rows] == [4, 1]
    first, second = rows
    assert first["item"] == 10 * (4 + 5 * 3 + 3) and second["item"] == 10 * 7
    assert all(first[k] == 10 for k in ("wait Q", "wait K0", "S0", "softmax0", "last wait V", "last P V", "epilogue"))
    assert all(first[k] == 30 for k in ("loop wait K", "loop wait V", "loop S", "loop softmax", "loop P V"))
    assert "loop S" not in second and second["between items"] == 1000 - 10 * 22


def test_an_item_cut_short_is_left_out():
    assert trace_fwd.consumer_phases(_marks(3)[:-2]) == []


def test_decode_reads_the_layout_of_trace_cuh():
    layout = trace_fwd.trace_layout()  # (also: EVENTS numbered as the kernel's FwdTraceEvent)
    ctas, roles, per_role = layout
    words = np.zeros(ctas * roles * per_role, dtype=np.uint64)
    base = (3 * roles + 1) * per_role  # CTA 3, consumer warpgroup 0
    words[base] = (255 << 56) | 17  # the SM mark
    # three marks: globaltimer 1000, 1000, 2000 ns (a coarse timer), clock 500, 1500, 2500 cycles
    for i, (ev, gt, clk) in enumerate(((10, 1000, 500), (11, 1000, 1500), (12, 2000, 2500))):
        words[base + 1 + 2 * i] = (ev << 56) | gt
        words[base + 2 + 2 * i] = clk
    assert trace_fwd.decode(words, layout) == {(3, 1): (17, [(10, 1000), (11, 1500), (12, 2000)])}
    assert "smallest step 1000 ns" in trace_fwd.timer_report(words, layout)
    assert "SM clock 2.000 GHz" in trace_fwd.timer_report(words, layout)


def test_tile_option():
    W = plan.Sm90WsTile
    assert trace_fwd.parse_tile("128,128,persistent,notma", None) == W(128, 128, pingpong=False, persistent=True,
                                                                          tma_store=False)  # fmt: skip
    assert trace_fwd.parse_tile("128,128,persistent,notma,lookahead", None) == W(128, 128, pingpong=False, persistent=True,
                                                                             tma_store=False, look_ahead=True)
    assert trace_fwd.parse_tile("128,128,persistent,notma,strided", None) == W(128, 128, pingpong=False, persistent=True,
                                                                           tma_store=False, paired=False)
    assert trace_fwd.parse_tile(None, W(192, 128)) == W(192, 128)
    with pytest.raises(SystemExit):
        trace_fwd.parse_tile("128,128,fast", None)


def test_the_traced_build_compiles_without_local_memory():
    """The diagnostic build of the short-key tile (marks in every loop) compiles for sm_90a and keeps
    the plain build's registers: no spills, so its timeline is the kernel's."""
    spec = plan.fwd_sm90_ws_spec(128, "bf16", True, tile=plan.FWD_SM90_WS_SHORT_TILES[128])
    _, header = jit.compile_cubin(spec, extra_options=("-DCUFLASH_TRACE",))
    assert header["ptxas"]["stack_frame"] == 0 and header["ptxas"].get("spill_stores", 0) == 0


def test_a_kernel_override_needs_its_tile():
    """forward.run(kernel=) launches a given build in place of the planned one only with the tile it was
    built for: without tile= the planner could pick (or fall back to) another variant."""
    from cuflash import forward

    with pytest.raises(ValueError, match="kernel= needs tile="):
        forward.run(None, None, None, kernel=object())
