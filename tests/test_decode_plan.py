"""CPU tests of decode with a KV cache: tiles, specs, launch plans, the split heuristic and its
DecodePolicy, the argument checks that need no GPU, the CLI hand-over, and a float64 model of the
kernels' decomposition.

No GPU: cuflash/plan is pure; one test compiles a static_assert snippet with NVRTC on the CPU.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from pathlib import Path
import types

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import checks, cli, jit, kvcache, params, plan, reference
from cuflash.plan import decode as pdecode
from nvrtc_util import compile_static_asserts

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_86": 100 * 1024, "sm_89": 100 * 1024, "sm_90a": 228 * 1024}
H200_SMS = 132
#: The decode plan's tunables as the planner uses them by default.
P = plan.DEFAULT_DECODE_POLICY


def _per_sm(n: int) -> plan.DecodePolicy:
    """The default policy with the split kernel's CTAs per SM forced to n."""
    return plan.DecodePolicy(ctas_per_sm=n)


# ---------------------------------------------------------------------------------------------
# Tiles and specs
# ---------------------------------------------------------------------------------------------


def test_every_bucket_has_a_decode_tile():
    assert set(plan.DECODE_TILES) == set(plan.HEAD_DIM_BUCKETS)


@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_hopper_keeps_the_table_rows_for_one_slab(bucket):
    assert plan.decode_tile(bucket, 1, "sm_90a") == plan.DECODE_TILES[bucket]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_decode_tiles_fit_every_arch(arch, bucket):
    options = plan.decode_m_slabs_options(bucket, arch)
    assert 1 in options and 2 in options  # decode (1 slab) and small groups run everywhere
    for m in options:
        t = plan.decode_tile(bucket, m, arch)
        smem = plan.decode_smem_bytes(bucket, m, t)
        assert smem <= plan.max_smem_bytes(arch)
        assert t.min_blocks * (smem + 1024) <= SMEM_PER_SM[arch]  # the occupancy the launch bounds ask for
        assert t.stages >= 1 and t.block_n % (16 * (4 // m)) == 0  # DecodeConfig's static_asserts
        if t.min_blocks > 1:
            assert t.stages >= 2


def test_in_flight_bytes_of_the_hopper_tiles():
    """Every Hopper row keeps >= 32 KB of K/V loads in flight per SM (the table's design rule)."""
    for bucket, t in plan.DECODE_TILES.items():
        tile_bytes = 2 * t.block_n * bucket * 2  # K and V of one tile
        assert (t.stages - 1) * t.min_blocks * tile_bytes >= 32 * 1024, bucket


def test_decode_smem_formula():
    t = plan.DecodeTile(64, 3, 2)
    stride = 136  # padded Q rows (and the fp32 merge rows)
    kv_stride = 128  # hd128 K/V rows: unpadded, chunks XOR-swizzled
    q, ml, pipe = 2 * 16 * stride, 8 * 64, 2 * 2 * 3 * 64 * kv_stride
    assert plan.decode_smem_bytes(128, 1, t) == q + ml + pipe
    # A single stage is smaller than the fp32 merge buffer of the warp columns, which then sets the size.
    t1 = plan.DecodeTile(64, 1, 1)
    assert plan.decode_smem_bytes(128, 1, t1) == q + ml + max(2 * 2 * 64 * kv_stride, 4 * 64 * stride)
    # Buckets that are not whole 128-byte groups keep padded K/V rows.
    assert plan.decode_kv_row_elements(96, 1) == 104 and plan.decode_kv_row_elements(192, 4) == 192
    assert plan.decode_kv_row_elements(256, 1) == 256 and plan.decode_kv_row_elements(256, 2) == 264
    assert plan.decode_smem_bytes(96, 1, t) == 2 * 16 * 104 + 8 * 64 + 2 * 2 * 3 * 64 * 104


def test_all_decode_specs():
    specs = plan.all_decode_specs("sm_90a")
    assert len(specs) == len(set(specs))
    fam = lambda f: [s for s in specs if s.family == f]  # noqa: E731
    column = [s for s in fam("flash_decode") if not s.cta_loads and not s.tail_grid]
    assert len(column) == len(plan.HEAD_DIM_BUCKETS) * 2 * 2 * 3
    # CTA loads where the plan spaces a tile sized for 3+ CTAs per SM to 2 (long splits): on sm_90a
    # the hd128 tile (2 stages, 3 per SM) with 1 and 2 slabs (4 slabs fit only 2 per SM)
    cta = [s for s in fam("flash_decode") if s.cta_loads and not s.tail_grid]
    assert {(s.head_dim, s.m_slabs, s.tile.min_blocks) for s in cta} == {(128, 1, 3), (128, 2, 3)}
    assert len(cta) == 2 * 2 * 2 and all(s.name.split("_mb3_")[1].startswith("cta_") for s in cta)
    assert not any(s.cta_loads for s in plan.all_decode_specs("sm_80") if s.family == "flash_decode")  # hd128 fits only 2 per SM there
    # The tail-split grid's variants: hd128, one slab, column and CTA loads, sm_90+ only.
    tail = [s for s in fam("flash_decode") if s.tail_grid]
    assert {(s.head_dim, s.m_slabs, s.cta_loads) for s in tail} == {(128, 1, False), (128, 1, True)}
    assert len(tail) == 2 * 2 * 2 and all("_tail_" in s.name for s in tail)
    assert not any(s.tail_grid for s in plan.all_decode_specs("sm_80") if s.family == "flash_decode")
    assert {s.aligned for s in fam("flash_decode_append")} == {True, False}
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    few = plan.all_decode_specs("sm_80", head_dims=(100, 128), dtypes=("bf16",), causals=(True,), aligned=(True,))
    assert {s.head_dim for s in few if s.family == "flash_decode"} == {128}
    # three slab counts, two combine kernels (bucket 128: wide, lean), one append, two rotary (both layouts)
    assert len(few) == 3 + 2 + 1 + 2
    assert {s.name for s in few if s.family == "rotary"} == {"rotary_bf16_halves_sm80", "rotary_bf16_interleaved_sm80"}
    assert [s for s in few if s.family == "flash_decode_combine"] == [plan.DecodeCombineSpec(128, "bf16", "sm_80"),
                                                                      plan.DecodeCombineSpec(128, "bf16", "sm_80", True)]


def _uniform_plan(b, L, h_kv, arch="sm_90a", num_sms=132, *, nheads=32, seqlen_q=1, head_dim=128, dtype="bf16",
                  **kw):  # fmt: skip
    """plan_decode for one length L (after any append) in every sequence, 16-byte rows where head_dim % 8 == 0."""
    return plan.plan_decode(batch=b, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=h_kv, head_dim=head_dim, dtype=dtype,
                            aligned=head_dim % 8 == 0, max_seqlen=-(-L // 64) * 64, num_splits=kw.pop("num_splits", 0),
                            num_sms=num_sms, arch=arch, uniform_lengths=kw.pop("uniform_lengths", True), **kw)  # fmt: skip


def test_filled_grid_where_the_split_grid_leaves_slots_empty():
    # b=1 L=128k h_kv=32: 8 splits x 32 heads = 256 CTAs on 264 slots -> 8 long splits of 249 tiles and a
    # tail of 56 per head, split-major (the tails start last), 4 rounds of 8 tails in the 8 free slots
    p = _uniform_plan(1, 131072, 32)
    assert p.split_major and p.num_splits == 9 and p.split_tiles == 249 and p.attn.grid == (32, 1, 9)
    assert p.ctas_per_sm == 2 and p.combine is None and p.num_row_blocks == 1
    assert p.attn.smem_bytes == plan.decode_launch_smem(p.attn.spec.smem_bytes, 2, "sm_90a")  # 2 per SM
    classic = _uniform_plan(1, 131072, 32, uniform_lengths=False)
    assert not classic.split_major and classic.split_tiles == 0 and classic.attn.grid == (8, 32, 1)
    assert classic.attn.spec == p.attn.spec  # the same kernel, another grid and split length
    # one split per sequence: only from policy.fill_min_unsplit_tiles tiles (the tail adds a merge)
    p = _uniform_plan(8, 16384, 32)
    assert p.split_major and p.num_splits == 2 and p.attn.grid == (32, 8, 2) and p.split_tiles == 249
    assert not _uniform_plan(8, 4096, 32).split_major
    # ... and where its last wave is nearly full (8 of 264 slots free at b=8 L=8k h_kv=32, 16 at b=64
    # L=8k h_kv=8: under policy.fill_unsplit_min_free) only from policy.fill_min_unsplit_tiles_full tiles
    assert not _uniform_plan(8, 8192, 32).split_major and not _uniform_plan(64, 8192, 8).split_major
    assert _uniform_plan(64, 16384, 8).split_major and _uniform_plan(64, 8192, 32).split_major  # 249 tiles; 64 free
    assert _uniform_plan(8, 8192, 32).attn.grid == (1, 32, 8)  # one whole split per group, cuDNN's grid
    # The rule picks how a one-split count runs, not the count: b=63 L=8k h_kv=8 (504 groups, 24 slots
    # free) stays one whole split, where pricing the refused fill would have tipped the model to a
    # filled grid of 2 long splits (not measured).
    p = _uniform_plan(63, 8192, 8)
    assert (p.num_splits, p.split_major, p.tail_groups) == (1, False, 0)
    assert _uniform_plan(8, 32768, 8).split_major  # GQA: 4 splits x 64 groups = 256
    # long splits in several waves, the last one short of the slots: b=8 L=128k h_kv=32, 8 splits x 256
    # groups = 2048 CTAs, 7.76 waves of 264: 64 free slots in the last, 4 rounds of tails of 56 tiles
    p = _uniform_plan(8, 131072, 32)
    assert p.split_major and p.num_splits == 9 and p.split_tiles == 249 and p.attn.grid == (32, 8, 9)
    assert _uniform_plan(8, 131072, 32, uniform_lengths=False).attn.grid == (8, 32, 8)
    assert _uniform_plan(64, 16384, 32).num_splits == 2  # 1 split: 2048 CTAs, 7.76 waves, tails of 7
    # whole waves, short CTAs, a given split count or CTAs per SM, ragged lengths, sm_80
    assert _uniform_plan(33, 8192, 8, uniform_lengths=False).attn.grid == (1, 8, 33)  # 264 CTAs: no free slot
    for p in (_uniform_plan(33, 8192, 8), _uniform_plan(1, 16384, 32),
              _uniform_plan(1, 131072, 32, num_splits=8), _uniform_plan(1, 131072, 32, policy=_per_sm(2)),
              _uniform_plan(1, 131072, 32, uniform_lengths=False), _uniform_plan(1, 0, 32),
              _uniform_plan(1, 131072, 32, arch="sm_80", num_sms=108)):  # fmt: skip
        assert not p.split_major and p.split_tiles == 0


def test_split_count_counts_the_filled_grid():
    """With one length for all the split count is chosen with the filled grid's long splits in the
    model: b=64 L=128k h_kv=8, 17 equal splits (the plain model's choice, 8704 CTAs in 33 waves of
    264) become 8 long splits of 249 tiles in 16 waves and a tail per group in the last one."""
    assert _uniform_plan(64, 131072, 8, uniform_lengths=False).num_splits == 17
    p = _uniform_plan(64, 131072, 8)
    assert p.split_major and p.num_splits == 9 and p.split_tiles == 249
    # the model's inputs: without filled_tiles the plain count, with it the filled one
    kw = dict(ctas=512, n_tiles=2048, slots=264, min_tiles=4, max_tiles=256)
    assert plan.decode_num_splits(**kw) == 17
    assert plan.decode_num_splits(**kw, filled_tiles=lambda s: 249 if s == 8 else None) == 8


def test_no_filled_grid_where_every_tail_has_a_free_slot():
    """rounds == 1 (as many free slots as groups): the tail would be as long as a long split, i.e. one
    more equal split; the plan keeps equal splits there (b=1 L=32k h_kv=32 with 7 splits: 224 CTAs,
    40 free slots for 32 tails)."""
    spec = plan.decode_spec(128, "bf16", True, 1, "sm_90a")
    assert pdecode._filled_grid(32, 512, 7, 2, 1, 1, spec, 132, P) is None
    assert pdecode._filled_grid(32, 512, 8, 2, 1, 1, spec, 132, P) == (9, 63)


@pytest.mark.parametrize("groups, n_tiles, splits, num_sms", [
    (32, 2048, 8, 132), (256, 256, 1, 132), (64, 512, 4, 132), (32, 512, 8, 132), (100, 1000, 1, 60),
    (100, 1000, 1, 51), (3, 4000, 20, 31), (256, 2048, 8, 132), (512, 512, 2, 132), (2048, 256, 1, 132)])  # fmt: skip
def test_filled_grid_tails_end_before_the_long_splits(groups, n_tiles, splits, num_sms):
    """Every tile in one split (the long ones, then the tail with the rest), and the tails, started in
    rounds in the free slots, need no more tiles than one long split."""
    spec = plan.decode_spec(128, "bf16", True, 1, "sm_90a")
    got = pdecode._filled_grid(groups, n_tiles, splits, 2, 1, 1, spec, num_sms, P)
    assert got is not None
    total, long_tiles = got
    assert total == splits + 1
    tail = n_tiles - splits * long_tiles
    assert 1 <= tail <= long_tiles  # the kernel's last split: [splits * long_tiles, n_tiles)
    waves = -(-splits * groups // (num_sms * 2))
    free = waves * num_sms * 2 - splits * groups  # in the long splits' last wave
    assert -(-groups // free) * tail <= long_tiles


def test_the_gpu_tests_shapes_take_the_filled_grid_on_the_h200():
    """tests/test_decode_gpu.py's filled-grid cases skip where the plan does not fill the slots: on the
    H200 (132 SMs, sm_90a) with the tests' policy (FILLED_POLICY: lowered thresholds), every one of
    them does; with the default policy, none of the small ones would (the policy is what gets there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_decode_gpu as g

    assert g.FILLED_POLICY == dataclasses.replace(P, fill_min_unsplit_tiles=1, fill_min_unsplit_tiles_full=1,
                                                  long_cta_keys=1)  # fmt: skip

    def filled(batch, seqlen_q, nheads, nheads_kv, head_dim, L, new=0, dtype="bf16", policy=g.FILLED_POLICY):
        return _uniform_plan(batch, L, nheads_kv, nheads=nheads, seqlen_q=seqlen_q, head_dim=head_dim, dtype=dtype,
                             seqlen_new=new, policy=policy).split_major  # fmt: skip

    for batch, nheads, nheads_kv, seqlen_q, _, L in g.FILLED_CASES:
        assert filled(batch, seqlen_q, nheads, nheads_kv, 128, L), (batch, nheads, nheads_kv, seqlen_q, L)
        assert not filled(batch, seqlen_q, nheads, nheads_kv, 128, L, policy=P), (batch, nheads, nheads_kv, L)
    batch, nheads, nheads_kv, cached, capacity = g.FILLED_LAYOUT_CASE
    for dtype, hd in (("fp16", 64), ("bf16", 96), ("bf16", 128)):
        for L, new in ((cached, 0), (cached + 3, 3), (capacity, 0), (-(-capacity // 48) * 48, 0)):
            assert filled(batch, 1, nheads, nheads_kv, hd, L, new, dtype), (dtype, hd, L, new)
    batch, nheads, nheads_kv, L = g.FILLED_REPEAT_CASE
    assert filled(batch, 1, nheads, nheads_kv, 128, L)
    assert filled(1, 1, 32, 32, 128, 32768, policy=P)  # test_filled_grid_at_a_bench_shape, default policy


def test_tail_split_where_the_last_wave_of_whole_groups_is_partial():
    # b=46 L=4k h_kv=32: 1472 whole groups of 64 tiles at 2 per SM are 5 waves of 264 and 152 left over
    # (58% of a wave); those 152 in 5 splits of 13 tiles (760 CTAs) started last, on the kTailGrid variant.
    p = _uniform_plan(46, 4096, 32)
    assert (p.num_splits, p.tail_groups, p.ctas_per_sm) == (5, 152, 2)
    assert p.attn.grid == (1472 - 152 + 5 * 152, 1, 1) and not p.split_major and p.split_tiles == 0
    assert p.attn.spec.tail_grid and p.attn.spec.cta_loads and p.attn.spec.name.endswith("_cta_tail_vec16_sm90a")
    assert p.combine is None  # merged in the kernel: one row x 5 splits
    # b=58 L=4k h_kv=32 runs 3 per SM (column loads): 4 waves of 396 and 272 left over (69%).
    p = _uniform_plan(58, 4096, 32)
    assert (p.num_splits, p.tail_groups, p.ctas_per_sm) == (4, 272, 3) and not p.attn.spec.cta_loads
    # Not where the lengths are not one known length, nor with a given split count or CTAs per SM, nor
    # before sm_90, nor at other head dims (no variant measured).
    for q in (_uniform_plan(46, 4096, 32, uniform_lengths=False), _uniform_plan(46, 4096, 32, num_splits=1),
              _uniform_plan(46, 4096, 32, policy=_per_sm(2)), _uniform_plan(46, 4096, 32, arch="sm_80", num_sms=108),
              _uniform_plan(46, 4096, 32, head_dim=64)):
        assert q.tail_groups == 0 and not q.attn.spec.tail_grid and q.attn.grid[1:] != (1, 1), q
    # The last wave fuller than policy.tail_split_max_fill: b=72 L=4k h_kv=32 (192 of 264, 73%; at 3 per
    # SM 324 of 396), b=60 L=4k h_kv=8 (216, 82%, after one whole wave).
    assert _uniform_plan(72, 4096, 32).tail_groups == 0 and _uniform_plan(60, 4096, 8).tail_groups == 0
    assert _uniform_plan(128, 1024, 32).tail_groups == 0  # 16 tiles a group: below policy.tail_split_min_tiles


def test_deep_grid_runs_whole_groups_at_three_per_sm_with_a_tail_split():
    # b=64 L=4k h_kv=32: 2048 groups of 64 tiles; at 2 per SM (the long splits' spacing) 7 waves and 200
    # left (76%, no tail split); at the tile's 3 per SM 5 waves of 396 and 68 left, split 5 ways.
    p = _uniform_plan(64, 4096, 32)
    assert (p.num_splits, p.tail_groups, p.ctas_per_sm) == (5, 68, 3) and p.attn.spec.tail_grid
    assert not p.attn.spec.cta_loads and p.attn.smem_bytes == p.attn.spec.smem_bytes  # 3 per SM: no padding
    # Where the split model alone split every group: b=64 L=2k h_kv=32 (2 splits), b=200 L=4k h_kv=8 (4).
    assert (_uniform_plan(64, 2048, 32).num_splits, _uniform_plan(64, 2048, 32).tail_groups) == (5, 68)
    p = _uniform_plan(200, 4096, 8)
    assert (p.num_splits, p.tail_groups, p.ctas_per_sm) == (16, 16, 3)
    with_model = _uniform_plan(200, 4096, 8, uniform_lengths=False)  # no tail split: the split model's plan
    assert with_model.num_splits == 4 and with_model.tail_groups == 0
    # Not taken: fewer than policy.deep_min_waves waves at 3 per SM (b=40: 1280 groups = 3 waves of 396 and
    # 92, which the tail split would take), groups over policy.deep_max_keys (b=64 L=8k: the filled grid
    # stays), no tail split at 3 per SM (b=72 L=4k: 324 of 396 left), a given split count or CTAs per SM,
    # sm_80 (its hd128 tile holds 2 CTAs per SM, and it has no kTailGrid), a tile of 2 per SM (hd64).
    spec = plan.decode_spec(128, "bf16", True, 1, "sm_90a")
    assert pdecode._tail_split(1280, 64, 3, 1, 1, spec, 132, P) == (4, 92) and not pdecode._deep_grid(1280, 64, 1, 1, spec, 132, P)
    assert _uniform_plan(40, 4096, 32).ctas_per_sm == 2 and _uniform_plan(64, 8192, 32).split_major
    assert _uniform_plan(72, 4096, 32).ctas_per_sm == 2
    # Nor where the split model's plan is already whole groups with a tail split: b=128 L=4k h_kv=32 keeps
    # 15 waves of 264 and 136 groups in 5 splits at 2 per SM, though the deep grid's test holds there.
    p = _uniform_plan(128, 4096, 32)
    assert (p.num_splits, p.tail_groups, p.ctas_per_sm) == (5, 136, 2)
    assert pdecode._deep_grid(128 * 32, 64, 1, 1, plan.decode_spec(128, "bf16", True, 1, "sm_90a"), 132, P)
    for q in (_uniform_plan(64, 4096, 32, num_splits=1), _uniform_plan(64, 4096, 32, policy=_per_sm(2)),
              _uniform_plan(64, 4096, 32, arch="sm_80", num_sms=108), _uniform_plan(64, 4096, 32, head_dim=64)):
        assert q.tail_groups == 0 and q.ctas_per_sm == 2, q
    assert pdecode._deep_grid(2048, 64, 1, 1, spec, 132, P) and not pdecode._deep_grid(2048, 65, 1, 1, spec, 132, P)
    assert pdecode._deep_grid(1584 + 1, 64, 1, 1, spec, 132, P) and not pdecode._deep_grid(1583, 64, 1, 1, spec, 132, P)
    assert not pdecode._deep_grid(1584 * 2, 64, 1, 1, spec, 132, P)  # whole waves: nothing for a tail split


def test_tail_split_model():
    spec = plan.decode_spec(128, "bf16", True, 1, "sm_90a")
    # 1856 groups = 7 waves of 264 + 8: the 8 go into 16 splits of 4 tiles (the fewest keys a split gets).
    assert pdecode._tail_split(1856, 64, 2, 1, 1, spec, 132, P) == (16, 8)
    assert pdecode._tail_split(2112, 64, 2, 1, 1, spec, 132, P) is None  # 8 whole waves: nothing left over
    assert pdecode._tail_split(400, 64, 2, 1, 1, spec, 132, P) is None  # one whole wave before: too few
    assert pdecode._tail_split(1856, 64, 2, 2, 1, spec, 132, P) is None  # row blocks
    assert pdecode._tail_split(1856, 31, 2, 1, 1, spec, 132, P) is None  # below policy.tail_split_min_tiles
    assert pdecode._tail_split(1848 + 185, 64, 2, 1, 1, spec, 132, P) is None  # 185 > 0.7 x 264 left over
    assert pdecode._tail_split(1848 + 184, 64, 2, 1, 1, spec, 132, P) is not None
    # Merged in the kernel only: 12 packed rows x at most 5 splits (64 partial rows).
    assert pdecode._tail_split(1856, 64, 2, 1, 12, spec, 132, P) == (5, 8)
    for other in (plan.decode_spec(128, "bf16", True, 1, "sm_80"), plan.decode_spec(64, "bf16", True, 1, "sm_90a"),
                  plan.decode_spec(128, "bf16", True, 2, "sm_90a")):
        assert pdecode._tail_split(1856, 64, 2, 1, 1, other, 132, P) is None  # no kTailGrid variant
    # Every candidate's split CTAs cover the tail groups' tiles, and the rules hold.
    for groups, n_tiles, per_sm in ((1856, 64, 2), (1984, 64, 2), (5000, 33, 3), (700, 200, 2), (1000, 40, 3)):
        got = pdecode._tail_split(groups, n_tiles, per_sm, 1, 1, spec, 132, P)
        if got is None:
            continue
        s, tail = got
        slots = 132 * per_sm
        assert tail == groups % slots and 2 <= s <= n_tiles // 4 and s * -(-n_tiles // s) >= n_tiles
        assert tail <= P.tail_split_max_fill * slots and groups // slots >= P.tail_split_min_waves
        waves, over = groups // slots, P.cta_overhead_tiles
        split_cost = waves * (n_tiles + over) + -(-tail * s // slots) * (-(-n_tiles // s) + over) + over
        assert split_cost <= (1 - P.tail_split_min_gain) * (waves + 1) * (n_tiles + over)


def test_the_gpu_tests_shapes_take_the_tail_split_on_the_h200():
    """tests/test_decode_gpu.py's tail-split cases skip where the plan does not take it: on the H200
    (132 SMs, sm_90a) with the tests' policy (TAIL_POLICY: lowered thresholds), every one of them does."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_decode_gpu as g

    assert g.TAIL_POLICY == dataclasses.replace(P, tail_split_min_gain=-math.inf, tail_split_max_fill=1.0,
                                                tail_split_min_waves=1, tail_split_min_tiles=1,
                                                min_keys_per_split=64)  # fmt: skip

    def tail(batch, seqlen_q, nheads, nheads_kv, head_dim, L, new=0, dtype="bf16", policy=g.TAIL_POLICY):
        return _uniform_plan(batch, L, nheads_kv, nheads=nheads, seqlen_q=seqlen_q, head_dim=head_dim, dtype=dtype,
                             seqlen_new=new, policy=policy)  # fmt: skip

    loads = set()
    for batch, nheads, nheads_kv, seqlen_q, _, L in g.TAIL_CASES:
        p = tail(batch, seqlen_q, nheads, nheads_kv, 128, L)
        assert p.tail_groups > 0, (batch, nheads, nheads_kv, seqlen_q, L)
        loads.add(p.attn.spec.cta_loads)
    assert loads == {False, True}  # both load paths
    assert not any(tail(b, sq, h, hk, 128, L, policy=P).tail_groups for b, h, hk, sq, _, L in g.TAIL_CASES)
    batch, nheads, nheads_kv, cached, capacity = g.TAIL_LAYOUT_CASE
    for dtype, hd in g.TAIL_DTYPES:
        for L, new in ((cached, 0), (cached + 3, 3), (capacity, 0), (-(-capacity // 48) * 48, 0)):
            p = tail(batch, 1, nheads, nheads_kv, hd, L, new, dtype)
            assert p.tail_groups > 0 and p.attn.spec.tail_grid, (dtype, hd, L, new)


@pytest.mark.parametrize("bucket", sorted(plan.DECODE_TILES))
def test_filled_tile_count_matches_the_kernel(bucket):
    """The plan counts tiles from max_seqlen rounded up to 64 keys, the kernel from L itself: the same
    count for every tile width in DECODE_TILES (split_tiles assumes it)."""
    bn = plan.DECODE_TILES[bucket].block_n
    for L in list(range(1, 600)) + [4095, 4096, 4097, 131071, 131072]:
        assert -(-(-(-L // 64) * 64) // bn) == -(-L // bn)


def test_decode_names_spell_every_template_argument():
    s = plan.decode_spec(100, "bf16", False, 2, "sm_90a")
    t = s.tile
    assert s.name == f"flash_decode_hd128_bf16_ms2_bn{t.block_n}_st{t.stages}_mb{t.min_blocks}_scalar_sm90a"
    assert s.template_args() == f"128, {t.block_n}, 2, {t.stages}, true, false, false, false"
    cta = dataclasses.replace(s, cta_loads=True)
    assert cta.name == f"flash_decode_hd128_bf16_ms2_bn{t.block_n}_st{t.stages}_mb{t.min_blocks}_cta_scalar_sm90a"
    assert cta.template_args() == f"128, {t.block_n}, 2, {t.stages}, true, false, true, false"
    tail = dataclasses.replace(cta, m_slabs=1, tail_grid=True)
    assert tail.name == f"flash_decode_hd128_bf16_ms1_bn{t.block_n}_st{t.stages}_mb{t.min_blocks}_cta_tail_scalar_sm90a"
    assert tail.template_args() == f"128, {t.block_n}, 1, {t.stages}, true, false, true, true"
    assert plan.DecodeAppendSpec(True, "sm_86").name == "flash_decode_append_vec16_sm86"
    assert plan.DecodeAppendSpec(True, "sm_86").template_args() == "true"
    c = plan.DecodeCombineSpec(96, "fp16", "sm_90a")
    assert c.name == "flash_decode_combine_hd96_fp16_sm90a" and c.template_args() == "96, false, 32"
    assert c.min_blocks == 1
    lean = plan.DecodeCombineSpec(256, "bf16", "sm_80", lean=True)
    assert lean.name == "flash_decode_combine_hd256_bf16_lean_sm80" and lean.template_args() == "256, true, 4"
    assert lean.min_blocks == plan.DECODE_COMBINE_LEAN_CTAS_PER_SM
    assert plan.DecodeCombineSpec(256, "bf16", "sm_80").template_args() == "256, true, 16"  # two float4 columns a lane
    for spec in (s, cta, plan.DecodeAppendSpec(False, "sm_90a"), c, lean):
        assert spec.kernel_family is plan.KERNEL_FAMILIES[spec.family]
        assert spec.name in jit.entry_source(spec) and spec.entry_kernel() in jit.entry_source(spec)
        assert f"cuflash::{spec.kernel_family.params} params" in jit.entry_source(spec)
        assert spec.threads == 128 and spec.min_blocks >= 1 and spec.smem_bytes >= 0
        hash(spec)


def test_decode_spec_rejects():
    with pytest.raises(ValueError, match="16-byte"):
        plan.decode_spec(100, "bf16", True, 1, "sm_90a")
    with pytest.raises(ValueError, match="dtype"):
        plan.decode_spec(128, "fp32", True, 1, "sm_90a")
    with pytest.raises(ValueError, match="m_slabs"):
        plan.decode_spec(128, "bf16", True, 3, "sm_90a")
    with pytest.raises(ValueError, match="head dim"):
        plan.decode_spec(257, "bf16", False, 1, "sm_90a")


def test_template_args_and_smem_match_the_kernel_config():
    """NVRTC checks, per variant, that template_args() lands every value on the DecodeConfig parameter
    it names and that DecodeConfig::kSmemBytes is the plan's smem_bytes (no GPU needed)."""
    lines = ['#include "flash_decode.cuh"']
    for arch in ("sm_80", "sm_86", "sm_90a"):
        for s in plan.all_decode_specs(arch, dtypes=("bf16", "fp16")):
            if s.family != "flash_decode":
                continue
            t = s.tile
            c = f"cuflash::DecodeConfig<{s.template_args()}>"
            bf16 = "true" if s.dtype == "bf16" else "false"
            aligned = "true" if s.aligned else "false"
            cta = "true" if s.cta_loads or t.stages == 1 else "false"  # one stage: always CTA loads
            tail = "true" if s.tail_grid else "false"
            lines.append(
                f"static_assert({c}::kHeadDim == {s.head_dim} && {c}::kBlockN == {t.block_n} && "
                f"{c}::kMSlabs == {s.m_slabs} && {c}::kStages == {t.stages} && {c}::kIsBF16 == {bf16} && "
                f"{c}::kAligned == {aligned} && {c}::kCtaLoads == {cta} && {c}::kTailGrid == {tail}, "
                f"\"{s.name}: template argument order\");"
            )
            lines.append(f'static_assert({c}::kSmemBytes == {s.smem_bytes}, "{s.name}: shared memory");')
    compile_static_asserts(lines, "decode_config_check.cu")


# ---------------------------------------------------------------------------------------------
# Split heuristic and launch plans
# ---------------------------------------------------------------------------------------------


def _plan(**kw):
    args = dict(batch=1, seqlen_q=1, nheads=32, nheads_kv=32, head_dim=128, dtype="bf16", aligned=True,
                max_seqlen=32768, num_splits=0, num_sms=H200_SMS, arch="sm_90a")  # fmt: skip
    args.update(kw)
    return plan.plan_decode(**args)


@pytest.mark.parametrize("batch, nheads_kv, seqlen", [(b, h, s) for b in (1, 8, 64) for h in (32, 8)
                                                      for s in (4096, 16384, 131072)]
                         + [(3, 32, 16384), (6, 8, 32768), (6, 32, 8192), (3, 32, 12288)])  # fmt: skip
def test_auto_splits_fill_the_h200(batch, nheads_kv, seqlen):
    p = _plan(batch=batch, nheads_kv=nheads_kv, max_seqlen=seqlen)
    ctas = p.attn.grid[0] * p.attn.grid[1] * p.attn.grid[2]
    slots = H200_SMS * p.ctas_per_sm
    keys_per_split = -(-seqlen // p.num_splits)
    assert 1 <= p.num_splits <= plan.MAX_DECODE_SPLITS
    assert keys_per_split >= P.min_keys_per_split or p.num_splits == 1
    assert keys_per_split <= P.max_keys_per_split
    # Spaced out (2 CTAs per SM at hd128) only with long splits; short ones run as many per SM as fit
    # (3). The count is chosen for the CTAs per SM it runs at (the wave checks below use those slots).
    assert (P.long_ctas_per_sm, p.attn.spec.min_blocks) == (2, 3) and p.ctas_per_sm in (2, 3)
    if p.ctas_per_sm == 2:
        assert keys_per_split >= P.long_cta_keys
    if keys_per_split < P.long_cta_keys:
        assert p.ctas_per_sm == 3
    # Nearly every resident CTA slot gets work (the wave model may trade the last few slots for one tile
    # less per split), unless the minimum keys per split forbid more splits ...
    assert ctas >= 0.85 * slots or p.num_splits >= seqlen // P.min_keys_per_split
    # ... and the last wave is not mostly empty.
    waves = ctas / slots
    assert waves <= 1 or waves / math.ceil(waves) >= 0.75


def test_auto_splits_examples():
    # hd128: 3 CTAs per SM (396 slots on the H200) where a split streams < 3072 keys, else 2 (264 slots)
    assert _plan(batch=1, nheads_kv=32, max_seqlen=8192).num_splits == 12  # 32 CTAs -> 384 of 396 slots
    p = _plan(batch=1, nheads_kv=32, max_seqlen=32768)
    assert (p.num_splits, p.ctas_per_sm) == (8, 2)  # 32 CTAs -> 256 of 264 slots, 4096 keys each
    p = _plan(batch=8, nheads_kv=32, max_seqlen=4096)
    assert (p.num_splits, p.ctas_per_sm) == (1, 2)  # 256 CTAs of 4096 keys: one wave at 2 per SM (cuDNN's grid)
    p = _plan(batch=8, nheads_kv=8, max_seqlen=4096)
    assert (p.num_splits, p.ctas_per_sm) == (6, 3)  # at 2 per SM 4 splits of 1024 keys: short, so 3 per SM
    p = _plan(batch=8, nheads_kv=32, max_seqlen=131072)
    assert (p.num_splits, p.ctas_per_sm) == (8, 2)  # at most 16k keys a split
    assert _plan(batch=1, nheads_kv=8, max_seqlen=4096).num_splits == 16  # capped by 256 keys per split
    assert _plan(max_seqlen=100).num_splits == 1  # two tiles: nothing to split
    assert _plan(max_seqlen=0).num_splits == 1
    # explicit split counts get the same spacing rule
    assert _plan(num_splits=1, max_seqlen=4096).ctas_per_sm == 2 and _plan(num_splits=2, max_seqlen=4096).ctas_per_sm == 3
    # head dims whose tile holds 2 CTAs per SM (hd64) are never padded
    p = _plan(head_dim=64, batch=8, max_seqlen=4096)
    assert p.ctas_per_sm == p.attn.spec.min_blocks == 2 and p.attn.smem_bytes == p.attn.spec.smem_bytes


def test_unsplit_wave_runs_whole_groups_one_per_sm():
    """Where the groups give one CTA to at least 95% of the SMs and no SM a second (128 of the H200's
    132), with groups of 3072 to 16384 keys and one length for all, the plan runs them unsplit, one per
    SM (shared memory padded), whatever the split model chose (3 splits at 3 per SM, a filled grid)."""
    for batch, nheads_kv, seqlen in [(16, 8, 4096), (16, 8, 8192), (32, 4, 4096), (16, 8, 16384), (126, 1, 3072)]:
        nheads = 4 * nheads_kv  # 4 query heads a kv head: one 16-row slab
        p = _plan(batch=batch, nheads=nheads, nheads_kv=nheads_kv, max_seqlen=seqlen, uniform_lengths=True)
        assert (p.num_splits, p.ctas_per_sm, p.split_major, p.tail_groups) == (1, 1, False, 0), (batch, seqlen, p)
        assert p.attn.grid == (1, nheads_kv, batch) and p.combine is None
        assert p.attn.smem_bytes == plan.decode_launch_smem(p.attn.spec.smem_bytes, 1, "sm_90a")
        assert not p.attn.spec.cta_loads
        # Ragged or device lengths (max_seqlen a bound): the longest sequence's groups would run whole.
        assert _plan(batch=batch, nheads=nheads, nheads_kv=nheads_kv, max_seqlen=seqlen).ctas_per_sm != 1
    # The bounds: 125 groups (< 95% of 132 SMs) or 133 (two on one SM); groups of 2048 or 16448 keys.
    for batch, seqlen in [(125, 4096), (133, 4096), (128, 2048), (128, 16448)]:
        p = _plan(batch=batch, nheads_kv=1, nheads=4, max_seqlen=seqlen, uniform_lengths=True)
        assert p.ctas_per_sm != 1, (batch, seqlen, p)
    assert _plan(batch=126, nheads_kv=1, nheads=4, max_seqlen=4096, uniform_lengths=True).ctas_per_sm == 1
    # Only with the plan's own split count and CTAs per SM, on sm_90+, for hd128 aligned one-slab calls.
    base = dict(batch=16, nheads_kv=8, max_seqlen=4096, uniform_lengths=True)
    assert _plan(**base, num_splits=1).ctas_per_sm == 2
    assert _plan(**base, policy=_per_sm(3)).ctas_per_sm == 3
    assert _plan(**base, arch="sm_80", num_sms=128).ctas_per_sm != 1
    assert _plan(**base, head_dim=64).ctas_per_sm != 1
    assert _plan(**base, aligned=False).ctas_per_sm != 1
    assert _plan(**dict(base, nheads=256)).ctas_per_sm != 1  # 32 rows: two slabs
    assert _plan(**base, seqlen_q=4).ctas_per_sm == 1  # 4 heads x 4 tokens: 16 rows, one slab
    # Its size depends on the SMs: 64 groups fill a GPU of 66 SMs, not one of 132.
    assert _plan(**dict(base, batch=8), num_sms=66).ctas_per_sm == 1
    assert _plan(**dict(base, batch=8)).ctas_per_sm != 1


def test_ctas_per_sm_pads_the_split_kernels_shared_memory():
    """Fewer split CTAs per SM than the tile holds: the launch asks for just enough shared memory that
    exactly that many fit (the driver's 1 KB per CTA included), never more than a CTA may have."""
    arch = "sm_90a"
    p3 = _plan(num_splits=4, max_seqlen=8192)  # splits of 2048 keys: short, as many per SM as fit
    assert p3.ctas_per_sm == 3 == p3.attn.spec.min_blocks and p3.attn.smem_bytes == p3.attn.spec.smem_bytes
    assert _plan(num_splits=4, max_seqlen=8192, policy=_per_sm(3)) == p3
    for c in (1, 2):
        p = _plan(num_splits=4, max_seqlen=8192, policy=_per_sm(c))
        smem = p.attn.smem_bytes
        assert p.ctas_per_sm == c and p.attn.grid == p3.attn.grid
        # spaced to 2 per SM (the long-split rule's count) the CTAs load each tile together
        assert p.attn.spec.cta_loads == (c == 2) and dataclasses.replace(p.attn.spec, cta_loads=False) == p3.attn.spec
        assert p.attn.spec.smem_bytes <= smem <= plan.max_smem_bytes(arch)
        assert c * (smem + 1024) <= plan.smem_per_sm_bytes(arch) < (c + 1) * (smem + 1024)
    # the split heuristic fills the slots there are: 32 (sequence, kv head) CTAs at 2 per SM -> 8 splits
    assert _plan(policy=_per_sm(2), max_seqlen=8192).num_splits == 8 and _plan(max_seqlen=8192).num_splits == 12
    assert _plan(policy=_per_sm(3)).ctas_per_sm == 3 and _plan(policy=_per_sm(3)).num_splits == 12
    for bad in (4, -1, True):  # 4: more than the tile holds (the plan says); -1, True: the policy refuses them
        with pytest.raises(ValueError, match="ctas_per_sm"):
            _plan(policy=_per_sm(bad))
    with pytest.raises(ValueError, match="ctas_per_sm"):
        plan.decode_launch_smem(1000, 0, arch)
    assert plan.decode_launch_smem(200_000, 2, arch) == 200_000  # already fewer per SM: unchanged
    # a loaded split kernel may be launched with up to the per-CTA maximum; other kernels their own
    assert p3.attn.spec.launch_smem_limit == plan.max_smem_bytes(arch) >= _plan(num_splits=4, policy=_per_sm(1)).attn.smem_bytes
    fwd = plan.fwd_spec(128, "bf16", False, True, "sm_80")
    assert fwd.launch_smem_limit == fwd.smem_bytes


def test_explicit_splits():
    assert _plan(num_splits=1).num_splits == 1
    assert _plan(num_splits=7).num_splits == 7
    assert _plan(num_splits=1000).num_splits == plan.MAX_DECODE_SPLITS
    assert _plan(num_splits=50, max_seqlen=640).num_splits == 10  # at most one split per 64-key tile


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 4096), st.integers(1, 600), st.integers(1, 8),
       st.sampled_from([0, 1, 7, 256]))  # fmt: skip
def test_heuristic_bounds(ctas, n_tiles, slots, min_tiles, max_tiles):
    s = plan.decode_num_splits(ctas=ctas, n_tiles=n_tiles, slots=slots, min_tiles=min_tiles, max_tiles=max_tiles)
    s_max = max(1, min(plan.MAX_DECODE_SPLITS, n_tiles // min_tiles))
    s_min = min(s_max, -(-n_tiles // max_tiles)) if max_tiles else 1
    assert s_min <= s <= s_max
    assert max_tiles == 0 or s == s_max or -(-n_tiles // s) <= max_tiles
    cost = lambda x: -(-ctas * x // slots) * (-(-n_tiles // x) + P.cta_overhead_tiles)  # noqa: E731
    assert cost(s) <= 1.02 * min(cost(x) for x in range(s_min, s_max + 1))
    if ctas % slots == 0 and s_min == 1:  # whole waves already: a split only adds per-CTA cost
        assert s == 1
    with pytest.raises(ValueError):
        plan.decode_num_splits(ctas=ctas, n_tiles=n_tiles, slots=slots, min_tiles=min_tiles, max_tiles=-1)


def test_plan_grids_and_kernels():
    p = _plan(batch=3, nheads=32, nheads_kv=8, max_seqlen=8192, num_splits=4)
    assert p.attn.grid == (4, 8, 3) and p.attn.block == (128, 1, 1)
    assert p.attn.spec.m_slabs == 1 and p.num_row_blocks == 1
    assert p.append is None
    p1 = _plan(num_splits=1, seqlen_new=3, append_aligned=True)
    assert p1.num_splits == 1
    assert p1.append.spec == plan.DecodeAppendSpec(True, "sm_90a")
    assert p1.append.grid == (-(-1 * 3 * 32 * 16 // 128), 1, 1)  # one thread per 16-byte chunk
    assert _plan(seqlen_new=2, head_dim=100, aligned=False).append.spec.aligned is False


def test_programmatic_dependent_launch_from_sm90():
    """Every decode launch (append, split kernel, combine) asks for programmatic dependent launch where
    griddepcontrol exists (sm_90+), and none before; the forward kernels never do."""
    for arch, want in (("sm_80", False), ("sm_86", False), ("sm_89", False), ("sm_90a", True), ("sm_100", True)):
        p = _plan(arch=arch, num_splits=128, nheads=32, nheads_kv=1, max_seqlen=65536, seqlen_new=2,
                  append_aligned=True)  # fmt: skip
        assert p.combine is not None, "this plan should merge in the combine kernel"
        assert (p.append.pdl, p.attn.pdl, p.combine.pdl) == (want, want, want), arch
    assert plan.Launch(plan.fwd_spec(128, "bf16", False, True, "sm_90a"), (1, 1, 1), (128, 1, 1), 0).pdl is False


def test_which_combine_kernel():
    """The lean combine kernel where each warp's splits fit its one batch (up to 16 splits), or where
    the wide kernel's CTAs (2 per SM, one per output row) would not all fit one wave; else the wide."""
    lean_splits = plan.DECODE_COMBINE_LEAN_BATCH * 4
    assert plan.decode_combine_lean(10**6, 1, 132) and plan.decode_combine_lean(1, lean_splits, 132)
    assert not plan.decode_combine_lean(264, lean_splits + 1, 132) and plan.decode_combine_lean(265, lean_splits + 1, 132)
    assert not plan.decode_combine_lean(216, 128, 108) and plan.decode_combine_lean(217, 128, 108)
    # MQA at batch 128: 4096 output rows of 3 splits (the combine kernel: 32 rows x 3 splits > 64)
    p = _uniform_plan(128, 4096, 1)
    assert p.combine is not None and p.combine.spec.lean and p.combine.grid == (128 * 32, 1, 1)
    assert p.combine.spec.min_blocks == plan.DECODE_COMBINE_LEAN_CTAS_PER_SM
    # GQA at batch 1 with 8 kv heads and 64k keys: 32 output rows of 49 splits stay wide
    p = _uniform_plan(1, 65536, 8)
    assert p.combine is not None and not p.combine.spec.lean and p.num_splits > lean_splits


def test_who_merges_the_splits():
    """The last split CTA of a group merges up to policy.in_kernel_merge_max partial rows (its rows x
    the splits); beyond, the combine kernel runs after the split kernel, one CTA per output row."""
    cap = P.in_kernel_merge_max
    assert not plan.decode_separate_combine(1, 1) and not plan.decode_separate_combine(cap, 1)
    assert not plan.decode_separate_combine(1, cap) and plan.decode_separate_combine(1, cap + 1)
    assert not plan.decode_separate_combine(4, cap // 4) and plan.decode_separate_combine(4, cap // 4 + 1)
    assert _plan(num_splits=1).combine is None
    assert _plan(nheads=32, nheads_kv=32, num_splits=12).combine is None  # MHA: 1 row x 12 splits
    p = _plan(batch=3, nheads=32, nheads_kv=8, seqlen_q=2, num_splits=49)  # 8 rows x 49 splits
    assert p.combine.spec == plan.DecodeCombineSpec(128, "bf16", "sm_90a")  # wide: 192 rows, 13 splits a warp
    assert p.combine.grid == (3 * 32 * 2, 1, 1) and p.combine.block == (128, 1, 1)
    assert _plan(nheads=16 * 8, nheads_kv=8, num_splits=cap // 16).combine is None  # 16 rows per CTA
    assert _plan(nheads=16 * 8, nheads_kv=8, num_splits=cap // 16 + 1).combine is not None
    assert _plan(head_dim=100, dtype="fp16", aligned=False, nheads=8, nheads_kv=8, num_splits=100).combine.spec.head_dim == 128


@pytest.mark.parametrize("group, seqlen_q, m_slabs, row_blocks", [
    (1, 1, 1, 1), (4, 1, 1, 1), (16, 1, 1, 1), (8, 2, 1, 1), (4, 5, 2, 1), (32, 1, 2, 1), (8, 4, 2, 1),
    (16, 4, 4, 1), (32, 3, 4, 2), (64, 4, 4, 4),
])  # fmt: skip
def test_packed_rows(group, seqlen_q, m_slabs, row_blocks):
    p = _plan(nheads=8 * group, nheads_kv=8, seqlen_q=seqlen_q, num_splits=2)
    assert (p.attn.spec.m_slabs, p.num_row_blocks) == (m_slabs, row_blocks)
    assert p.attn.grid == (2 * row_blocks, 8, 1)


def test_plan_decode_rejects():
    with pytest.raises(ValueError, match="multiple"):
        _plan(nheads=12, nheads_kv=8)
    with pytest.raises(ValueError, match="non-empty"):
        _plan(batch=0)
    with pytest.raises(ValueError, match=">= 0"):
        _plan(num_splits=-1)
    with pytest.raises(ValueError, match="65535"):
        _plan(batch=70000)


# ---------------------------------------------------------------------------------------------
# DecodePolicy: every decode tunable, passed explicitly
# ---------------------------------------------------------------------------------------------

#: Module globals the decode tunables used to be (patched by tests and tools); DecodePolicy's fields now.
_OLD_TUNABLE_PREFIXES = ("DECODE_FILL", "DECODE_TAIL", "DECODE_DEEP", "DECODE_ONE_WAVE", "DECODE_LONG", "DECODE_IN_KERNEL",
                         "DECODE_CTA_OVERHEAD", "DECODE_COMBINE_WIDE")  # fmt: skip


def test_the_policy_holds_every_decode_tunable():
    """No decode tunable is left as a module global of the planner (a global patched by one caller
    would change every other caller's plans): the constants left are the kernels' own."""
    from cuflash.plan import decode_kernels

    for mod in (plan, pdecode, decode_kernels):
        names = [n for n in dir(mod) if n.startswith(_OLD_TUNABLE_PREFIXES)
                 or n in ("MIN_DECODE_KEYS_PER_SPLIT", "MAX_DECODE_KEYS_PER_SPLIT")]  # fmt: skip
        assert names == [], (mod.__name__, names)
    kernel_constants = {"DECODE_THREADS", "DECODE_M_SLABS", "MAX_DECODE_SPLITS", "DECODE_COMBINE_LEAN_BATCH",
                        "DECODE_COMBINE_LEAN_CTAS_PER_SM", "DECODE_TILES"}  # fmt: skip
    assert {n for n in plan.__all__ if "DECODE" in n and n.isupper()} == kernel_constants | {"DEFAULT_DECODE_POLICY"}
    fields = {f.name for f in dataclasses.fields(plan.DecodePolicy)}
    assert {"min_keys_per_split", "max_keys_per_split", "cta_overhead_tiles", "long_cta_keys", "long_ctas_per_sm",
            "ctas_per_sm", "in_kernel_merge_max", "combine_wide_ctas_per_sm", "combine", "fill_min_unsplit_tiles",
            "fill_unsplit_min_free", "fill_min_unsplit_tiles_full", "tail_split_buckets", "tail_split_max_fill",
            "tail_split_min_waves", "tail_split_min_tiles", "tail_split_min_gain", "deep_min_waves", "deep_max_keys",
            "one_wave_buckets", "one_wave_min_fill"} == fields  # fmt: skip


def test_the_default_policy():
    assert P == plan.DecodePolicy() and hash(P) == hash(plan.DecodePolicy())
    assert (P.ctas_per_sm, P.combine) == (0, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.ctas_per_sm = 2  # shared by every call: it cannot be changed in place
    q = dataclasses.replace(P, in_kernel_merge_max=0)
    assert q != P and q.in_kernel_merge_max == 0 and P.in_kernel_merge_max == 64
    assert {q: 1}[dataclasses.replace(P, in_kernel_merge_max=0)] == 1  # hashable by value (a memo key)


@pytest.mark.parametrize("fields, match", [
    (dict(combine="fast"), "combine must be 'auto', 'lean' or 'wide'"), (dict(combine=None), "combine"),
    (dict(combine="Lean"), "combine"), (dict(ctas_per_sm=-1), "ctas_per_sm must be an int >= 0"),
    (dict(ctas_per_sm=True), "ctas_per_sm"), (dict(ctas_per_sm=False), "ctas_per_sm"),
    (dict(ctas_per_sm=1.0), "ctas_per_sm"), (dict(ctas_per_sm="2"), "ctas_per_sm"),
    (dict(min_keys_per_split=0), "min_keys_per_split must be an int >= 1"),
    (dict(long_ctas_per_sm=0), "long_ctas_per_sm"), (dict(cta_overhead_tiles=-1), "cta_overhead_tiles must be an int >= 0"),
    (dict(max_keys_per_split=-1), "max_keys_per_split"), (dict(max_keys_per_split=0), "max_keys_per_split"),
    (dict(deep_max_keys=2.5), "deep_max_keys"),
    (dict(tail_split_max_fill=1.5), r"tail_split_max_fill must be a number in \[0, 1\]"),
    (dict(one_wave_min_fill=float("nan")), "one_wave_min_fill"), (dict(tail_split_min_gain=2), "tail_split_min_gain"),
    (dict(tail_split_min_gain=float("nan")), "tail_split_min_gain"),
    (dict(tail_split_buckets=128), "tail_split_buckets must be a sequence"),
    (dict(one_wave_buckets=("128",)), "one_wave_buckets"),
])  # fmt: skip
def test_policy_rejects(fields, match):
    with pytest.raises(ValueError, match=match):
        plan.DecodePolicy(**fields)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(P, **fields)


def test_policy_takes_numpy_numbers():
    """A sweep tool's NumPy values are numbers too."""
    p = plan.DecodePolicy(long_cta_keys=np.int64(4096), tail_split_max_fill=np.float32(0.5), tail_split_buckets=np.array([128]))
    assert p.long_cta_keys == 4096 and p.tail_split_buckets == (128,) and hash(p) is not None


def test_policy_bucket_lists_become_tuples():
    """Buckets given as a list are stored as a tuple, so the policy stays hashable (it keys the plan memo
    and the prepared calls); a negative minimum gain takes the tail split whatever the model says."""
    p = plan.DecodePolicy(tail_split_buckets=[128, 64], one_wave_buckets=[], tail_split_min_gain=-float("inf"))
    assert p.tail_split_buckets == (128, 64) and p.one_wave_buckets == () and hash(p) == hash(dataclasses.replace(p))


def test_forced_ctas_per_sm_is_checked_against_the_tile():
    """A policy can ask for any CTAs per SM; the plan refuses more than the variant's tile holds."""
    p = _plan(policy=_per_sm(3))
    assert p.attn.spec.tile.min_blocks == 3 and p.ctas_per_sm == 3
    with pytest.raises(ValueError, match=r"ctas_per_sm must be 0 \(the tile's\) or 1\.\.3, got 4"):
        _plan(policy=_per_sm(4))
    with pytest.raises(ValueError, match=r"1\.\.2, got 3"):
        _plan(head_dim=64, policy=_per_sm(3))  # the hd64 tile holds 2


def test_the_policy_decides_who_merges_and_which_combine_kernel_runs():
    """in_kernel_merge_max and combine, as the GPU tests force them (tests/gpu_util.py merge_policy)."""
    in_kernel, combine = plan.DecodePolicy(in_kernel_merge_max=1 << 30), plan.DecodePolicy(in_kernel_merge_max=0)
    assert not plan.decode_separate_combine(1, 2) and plan.decode_separate_combine(1, 2, combine)
    assert plan.decode_separate_combine(16, 70) and not plan.decode_separate_combine(16, 70, in_kernel)
    assert not plan.decode_separate_combine(16, 1, combine)  # one split: nothing to merge
    assert _plan(num_splits=12).combine is None and _plan(num_splits=12, policy=combine).combine is not None
    big = dict(batch=3, nheads=32, nheads_kv=8, seqlen_q=2, num_splits=49)  # 8 rows x 49 splits
    assert _plan(**big).combine is not None and _plan(**big, policy=in_kernel).combine is None
    # the combine kernel's variant: auto (the plan's), forced lean, forced wide
    lean, wide = (dataclasses.replace(combine, combine=c) for c in ("lean", "wide"))
    assert not plan.decode_combine_lean(1, 100, 132) and plan.decode_combine_lean(1, 100, 132, lean)
    assert plan.decode_combine_lean(10**6, 1, 132) and not plan.decode_combine_lean(10**6, 1, 132, wide)
    assert plan.decode_combine_lean(265, 17, 132) and not plan.decode_combine_lean(265, 17, 132, plan.DecodePolicy(
        combine_wide_ctas_per_sm=3))  # 3 wide CTAs per SM: 396 rows in one wave
    for policy, want in ((combine, False), (lean, True), (wide, False)):
        p = _plan(**big, policy=policy)
        assert p.combine.spec.lean == want and p.combine.spec.min_blocks == (8 if want else 1), policy.combine
    assert _uniform_plan(128, 4096, 1).combine.spec.lean and not _uniform_plan(128, 4096, 1, policy=wide).combine.spec.lean


def test_the_policy_reaches_every_planning_rule():
    """Each group of tunables changes the plans it names (the planner reads the policy it is given,
    nothing else): split counts, CTAs per SM, CTA loads, the filled, tail-split, deep and unsplit grids."""
    r = dataclasses.replace
    # split count: fewer keys per split allowed -> more splits; a cap on keys per split -> more splits too
    assert _plan(max_seqlen=4096, batch=1, nheads_kv=8).num_splits == 16
    assert _plan(max_seqlen=4096, batch=1, nheads_kv=8, policy=r(P, min_keys_per_split=128)).num_splits > 16
    assert _plan(max_seqlen=131072, batch=8, policy=r(P, max_keys_per_split=4096)).num_splits >= 32
    # CTAs per SM: long splits spaced to long_ctas_per_sm, with CTA loads where that is below the tile's
    p = _plan(max_seqlen=32768)
    assert (p.ctas_per_sm, p.attn.spec.cta_loads) == (2, True)
    p = _plan(max_seqlen=32768, policy=r(P, long_cta_keys=1 << 20))  # never long: as many per SM as fit
    assert (p.ctas_per_sm, p.attn.spec.cta_loads) == (3, False)
    tile = plan.decode_spec(128, "bf16", True, 1, "sm_90a").tile
    assert plan.decode_cta_loads(tile, 2) and not plan.decode_cta_loads(tile, 1)
    assert plan.decode_cta_loads(tile, 1, r(P, long_ctas_per_sm=1)) and not plan.decode_cta_loads(tile, 2, r(P, long_ctas_per_sm=1))
    # the grids of one length for all
    assert _uniform_plan(8, 16384, 32).split_major
    assert not _uniform_plan(8, 16384, 32, policy=r(P, fill_min_unsplit_tiles=1000,
                                                    fill_min_unsplit_tiles_full=1000)).split_major  # fmt: skip
    assert _uniform_plan(8, 8192, 32, policy=r(P, fill_min_unsplit_tiles_full=96)).split_major  # 124 tiles
    assert _uniform_plan(46, 4096, 32).tail_groups == 152
    assert _uniform_plan(46, 4096, 32, policy=r(P, tail_split_buckets=())).tail_groups == 0
    assert _uniform_plan(46, 4096, 32, policy=r(P, tail_split_min_gain=0.9)).tail_groups == 0
    assert not plan.decode_tail_grid_variant(64, 1, "sm_90a") and plan.decode_tail_grid_variant(
        64, 1, "sm_90a", r(P, tail_split_buckets=(64, 128)))  # fmt: skip
    assert _uniform_plan(64, 4096, 32).ctas_per_sm == 3  # the deep grid
    assert _uniform_plan(64, 4096, 32, policy=r(P, deep_min_waves=100)).ctas_per_sm == 2
    base = dict(batch=16, nheads=32, nheads_kv=8, max_seqlen=4096, uniform_lengths=True)
    assert _plan(**base).ctas_per_sm == 1  # the unsplit wave
    assert _plan(**base, policy=r(P, one_wave_buckets=())).ctas_per_sm != 1
    assert _plan(**base, policy=r(P, one_wave_min_fill=1.0)).ctas_per_sm != 1  # 128 of 132 SMs is not all


def test_all_decode_specs_follow_the_policy():
    """precompile builds what a policy can launch: the tail-grid variants for its tail_split_buckets,
    the CTA-load variants for its long_ctas_per_sm."""
    default = set(plan.all_decode_specs("sm_90a", dtypes=("bf16",)))
    wider = set(plan.all_decode_specs("sm_90a", dtypes=("bf16",), policy=dataclasses.replace(
        P, tail_split_buckets=(64, 128))))  # fmt: skip
    extra = wider - default
    assert extra and {(s.head_dim, s.m_slabs, s.tail_grid) for s in extra} == {(64, 1, True)} and default < wider
    none = set(plan.all_decode_specs("sm_90a", dtypes=("bf16",), policy=dataclasses.replace(P, tail_split_buckets=())))
    assert not any(s.family == "flash_decode" and s.tail_grid for s in none)
    spaced = set(plan.all_decode_specs("sm_90a", dtypes=("bf16",), policy=dataclasses.replace(P, long_ctas_per_sm=1)))
    assert {s.head_dim for s in spaced if s.family == "flash_decode" and s.cta_loads} == set(plan.HEAD_DIM_BUCKETS) - {
        224, 256}  # every tile of 2+ CTAs per SM and 2+ stages, spaced to 1  # fmt: skip


def test_attention_with_kvcache_policy_must_be_a_decode_policy():
    """The policy is checked before anything else is looked at (no GPU needed: the arrays are not even
    CuPy arrays, which the next check would refuse)."""
    import cuflash

    q = np.zeros((1, 1, 4, 64), np.float16)
    kc = np.zeros((1, 64, 2, 64), np.float16)
    for bad in ({"ctas_per_sm": 2}, "lean", 2, dataclasses.asdict(P)):
        with pytest.raises(TypeError, match="policy must be a cuflash.plan.DecodePolicy or None, got"):
            cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=1, policy=bad)
    for good in (None, P, _per_sm(1), _PolicySubclass()):  # accepted: the array checks come next
        with pytest.raises(TypeError, match="q must be a cupy.ndarray, got numpy.ndarray"):
            cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=1, policy=good)


def test_the_policy_is_part_of_the_plan_memo(monkeypatch):
    """kvcache._plan_and_load keeps one plan per policy (by value): two calls differing only in their
    policy get their own plans, equal policies share one (device queries and kernel loads faked)."""
    monkeypatch.setattr(jit, "device_arch", lambda dev: "sm_90a")
    monkeypatch.setattr(jit, "device_sm_count", lambda dev: H200_SMS)
    monkeypatch.setattr(jit, "get_function", lambda spec, dev: ("loaded", spec.name))
    kvcache._plan_and_load.cache_clear()
    try:
        args = (3, 1, 32, 8, 128, "bf16", True, 8192, 49, 0, False, 0)
        merged_in_kernel = plan.DecodePolicy(in_kernel_merge_max=1 << 30)
        p_default, fns = kvcache._plan_and_load(*args, P, False, 0, -1)  # (as kvcache calls it: every argument)
        assert p_default.combine is not None and fns[2] == ("loaded", p_default.combine.spec.name)
        p_kernel, fns = kvcache._plan_and_load(*args, merged_in_kernel, False, 0, -1)
        assert p_kernel.combine is None and fns[2] is None
        assert kvcache._plan_and_load(*args, plan.DecodePolicy(in_kernel_merge_max=1 << 30), False, 0, -1)[0] is p_kernel
        assert kvcache._plan_and_load(*args, plan.DecodePolicy(), False, 0, -1)[0] is p_default
        assert p_default == plan.plan_decode(batch=3, seqlen_q=1, nheads=32, nheads_kv=8, head_dim=128, dtype="bf16",
                                             aligned=True, max_seqlen=8192, num_splits=49, num_sms=H200_SMS,
                                             arch="sm_90a")  # fmt: skip
    finally:
        kvcache._plan_and_load.cache_clear()


# ---------------------------------------------------------------------------------------------
# Argument checks that need no GPU (kvcache's host-side helpers)
# ---------------------------------------------------------------------------------------------


def test_validate_lengths():
    checks.validate_lengths(np.array([0, 5, 100]), 0, 100)
    checks.validate_lengths(np.array([0, 5, 97]), 3, 100)
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -1"):
        checks.validate_lengths(np.array([0, -1]), 0, 100)
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 101 exceeds the cache capacity of 100"):
        checks.validate_lengths(np.array([0, 5, 101]), 0, 100)
    with pytest.raises(ValueError, match=r"3 new tokens do not fit: cache_seqlens\[0\] = 98 \+ 3"):
        checks.validate_lengths(np.array([98, 0]), 3, 100)


def test_validate_block_table():
    bt = np.array([[3, 1, -1, 99], [0, 2, 2, 7]])
    checks.validate_block_table(bt, np.array([32, 48]), page_size=16, num_pages=4)  # padding past the end is fine
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -1 is not a page of the cache \(k_cache has 4 pages"):
        checks.validate_block_table(bt, np.array([33, 0]), page_size=16, num_pages=4)
    with pytest.raises(ValueError, match=r"block_table\[1, 3\] = 7"):
        checks.validate_block_table(bt, np.array([0, 64]), page_size=16, num_pages=4)


def test_host_seqlens():
    assert checks.host_seqlens(5, 3).tolist() == [5, 5, 5]
    assert checks.host_seqlens([1, 2, 3], 3).tolist() == [1, 2, 3]
    assert checks.host_seqlens(np.array([1, 2], dtype=np.int16), 2).dtype == np.int64
    with pytest.raises(ValueError, match=r"shape \(batch,\) = \(3,\)"):
        checks.host_seqlens([1, 2], 3)
    with pytest.raises(TypeError, match="integers"):
        checks.host_seqlens([1.5, 2.0], 2)


def test_dtype_names_scale_and_ints():
    """The small host checks of cuflash/checks.py the API modules share."""
    import ml_dtypes

    assert checks.BF16 == np.dtype(ml_dtypes.bfloat16)
    assert checks.DTYPE_NAMES == {np.dtype(np.float16): "fp16", checks.BF16: "bf16"}
    assert checks.numpy_dtype("fp16") == np.float16 and checks.numpy_dtype("bf16") == checks.BF16
    for name in ("fp32", "float16", "", "BF16"):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16'\]"):
            checks.numpy_dtype(name)
    assert checks.resolve_scale(None, 64) == 0.125 and checks.resolve_scale(2, 64) == 2.0
    assert type(checks.resolve_scale(np.float32(0.5), 64)) is float
    assert checks.resolve_scale(1e38, 64) == 1e38
    for bad in (0.0, -1.0, float("nan"), float("inf"), 3e38, 1e300, "a", [1.0]):  # the kernels take it as float32
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
            checks.resolve_scale(bad, 64)
    for yes in (0, 3, np.int32(3), np.int64(-1)):
        assert checks.is_int(yes), yes
    for no in (True, np.bool_(True), 3.0, "3", None, np.float32(3)):
        assert not checks.is_int(no), no


def test_api_signature_is_flash_attn_compatible():
    sig = inspect.signature(kvcache.attention_with_kvcache).parameters
    assert list(sig)[:3] == ["q", "k_cache", "v_cache"]
    # flash-attn's keywords, cuflash's out / check, and the tuning-only policy (None: the defaults)
    defaults = {n: p.default for n, p in sig.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert defaults == dict(k=None, v=None, cache_seqlens=None, block_table=None, causal=False, softmax_scale=None,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0, return_lse=False,
                            out=None, check=False, policy=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=False, cache_batch_idx=None, cache_leftpad=None)  # fmt: skip
    assert not any(n.startswith("_") for n in sig)  # no private keywords (the old _ctas_per_sm is policy now)
    import cuflash

    assert cuflash.attention_with_kvcache is kvcache.attention_with_kvcache


# ---------------------------------------------------------------------------------------------
# CLI: precompile builds the decode kernels, bench --decode hands over to cuflash.bench_decode
# ---------------------------------------------------------------------------------------------


def test_precompile_builds_decode_variants(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    seen = []

    def recorder(specs, jobs=1, on_done=None):
        seen.extend(specs)
        return [(s.name, "compiled", {"ptxas": {}}) for s in specs]

    monkeypatch.setattr(jit, "precompile", recorder)
    r = CliRunner().invoke(cli.main, ["precompile", "--arch", "sm_90a", "--head-dim", "128", "--dtype", "bf16",
                                      "--kernels", "decode"], catch_exceptions=False)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert seen == plan.all_decode_specs("sm_90a", head_dims=(128,), dtypes=("bf16",))
    assert {s.family for s in seen} == {"flash_decode", "flash_decode_combine", "flash_decode_append", "rotary"}


@pytest.fixture
def fake_decode_bench(monkeypatch):
    """A stand-in cuflash.bench_decode recording cli_main's keywords, on a machine that claims a GPU."""
    calls = []
    mod = types.ModuleType("cuflash.bench_decode")
    mod.cli_main = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "cuflash.bench_decode", mod)
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli, "plot_problem", lambda path: None)  # matplotlib or not (CI has none)
    return calls


def test_bench_decode_defaults(fake_decode_bench):
    r = CliRunner().invoke(cli.main, ["bench", "--decode"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert fake_decode_bench == [dict(head_dim=None, cache_len=None, batch=None, kv_heads=None, dtype="bf16",
                                      repeats=30, peers=True, json_path=None, plot_path=None)]  # fmt: skip


def test_bench_decode_options(fake_decode_bench, tmp_path):
    r = CliRunner().invoke(cli.main, ["bench", "--decode", "--batch", "2", "--batch", "4", "--kv-heads", "8",
                                      "--seqlen", "1024", "--head-dim", "64", "--dtype", "fp16", "--no-peers",
                                      "--repeats", "3", "--json", str(tmp_path / "d.json"), "--plot",
                                      str(tmp_path / "d.png")],
                           catch_exceptions=False)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert fake_decode_bench == [dict(head_dim=(64,), cache_len=(1024,), batch=(2, 4), kv_heads=(8,), dtype="fp16",
                                      repeats=3, peers=False, json_path=str(tmp_path / "d.json"),
                                      plot_path=str(tmp_path / "d.png"))]  # fmt: skip


def test_bench_decode_only_options_need_decode(fake_decode_bench):
    r = CliRunner().invoke(cli.main, ["bench", "--batch", "2"])
    assert r.exit_code == 2 and "--decode" in r.output
    assert fake_decode_bench == []


def test_bench_decode_signature_matches_the_module():
    from cuflash import bench_decode

    params = inspect.signature(bench_decode.cli_main).parameters
    assert {"head_dim", "cache_len", "batch", "kv_heads", "dtype", "repeats", "peers", "json_path",
            "plot_path"} <= set(params)  # fmt: skip
    assert all(p.default is not inspect.Parameter.empty for p in params.values())
    assert bench_decode.kv_bytes(8, 32768, 32, 128) == 2 * 8 * 32768 * 32 * 128 * 2


# ---------------------------------------------------------------------------------------------
# A float64 model of the kernels' decomposition, against the reference
# ---------------------------------------------------------------------------------------------


def model_decode(q, k_cache, v_cache, lengths, *, causal, scale, num_splits, block_n, m_slabs):
    """What flash_decode.cuh computes, step for step, in float64: packed query rows per kv head,
    num_splits key splits of whole block_n-key tiles, 4 // m_slabs warp columns per tile each with its
    own online softmax (base 2, scale folded in), the warp-column merge, then the merge of the splits."""
    batch, seqlen_q, nheads, _ = q.shape
    nheads_kv = k_cache.shape[2]
    group = nheads // nheads_kv
    rows = group * seqlen_q
    warps_n, keys_per_warp = 4 // m_slabs, block_n // (4 // m_slabs)
    log2e = 1 / math.log(2)
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        L = lengths[b]
        n_tiles = -(-L // block_n)
        tps = -(-n_tiles // num_splits)
        for hk in range(nheads_kv):
            r = np.arange(rows)
            i, h = r // group, hk * group + r % group  # packed row r = token i, head hk * group + j
            qr = q[b, i, h]
            limit = np.minimum(L, L - seqlen_q + 1 + i) if causal else np.full(rows, L)
            parts = []  # (O_s normalized, lse_s) per split
            for s in range(num_splits):
                m_w = np.full((warps_n, rows), -np.inf)
                l_w = np.zeros((warps_n, rows))
                o_w = np.zeros((warps_n, rows, q.shape[3]))
                for tile in range(s * tps, min((s + 1) * tps, n_tiles)):
                    for wn in range(warps_n):
                        n0 = tile * block_n + wn * keys_per_warp
                        keys = np.arange(n0, n0 + keys_per_warp)
                        kk = np.where((keys < L)[:, None], k_cache[b, np.minimum(keys, L - 1), hk], 0)
                        vv = np.where((keys < L)[:, None], v_cache[b, np.minimum(keys, L - 1), hk], 0)
                        S = qr @ kk.T
                        S[keys[None, :] >= limit[:, None]] = -np.inf
                        m_new = np.maximum(m_w[wn], S.max(axis=1))
                        m_sc = np.where(m_new == -np.inf, 0, m_new * scale * log2e)
                        P = np.exp2(S * scale * log2e - m_sc[:, None])
                        corr = np.exp2(m_w[wn] * scale * log2e - m_sc)
                        l_w[wn] = l_w[wn] * corr + P.sum(axis=1)
                        o_w[wn] = o_w[wn] * corr[:, None] + P @ vv
                        m_w[wn] = m_new
                m_all = m_w.max(axis=0)
                m_sc = np.where(m_all == -np.inf, 0, m_all * scale * log2e)
                fac = np.exp2(m_w * scale * log2e - m_sc)
                l_all = (l_w * fac).sum(axis=0)
                inv = np.where(l_all > 0, 1 / np.where(l_all > 0, l_all, 1), 0)
                o_s = (o_w * (fac * inv)[:, :, None]).sum(axis=0)
                with np.errstate(divide="ignore"):
                    lse_s = np.where(l_all > 0, m_all * scale + np.log(np.where(l_all > 0, l_all, 1)), -np.inf)
                parts.append((o_s, lse_s))
            lses = np.stack([p[1] for p in parts])
            m = lses.max(axis=0)
            m0 = np.where(m == -np.inf, 0, m)
            ssum = np.where(lses == -np.inf, 0, np.exp(lses - m0)).sum(axis=0)
            with np.errstate(divide="ignore"):
                lse_f = np.where(ssum > 0, m0 + np.log(np.where(ssum > 0, ssum, 1)), -np.inf)
            w = np.where(lses == -np.inf, 0, np.exp(lses - np.where(lse_f == -np.inf, 0, lse_f)))
            out[b, i, h] = sum(w[s][:, None] * parts[s][0] for s in range(num_splits))
            lse[b, h, i] = lse_f
    return out, lse


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_model_of_the_decomposition_matches_the_reference(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    batch = data.draw(st.integers(1, 3))
    nheads_kv = data.draw(st.integers(1, 2))
    group = data.draw(st.sampled_from([1, 2, 4]))
    seqlen_q = data.draw(st.integers(1, 4))
    d = data.draw(st.sampled_from([8, 16]))
    cap = data.draw(st.integers(1, 300))
    lengths = np.array([data.draw(st.integers(0, cap)) for _ in range(batch)])
    causal = data.draw(st.booleans())
    num_splits = data.draw(st.integers(1, 6))
    block_n = data.draw(st.sampled_from([64, 128]))
    m_slabs = data.draw(st.sampled_from([1, 2, 4]))
    q = rng.standard_normal((batch, seqlen_q, nheads_kv * group, d))
    kc = rng.standard_normal((batch, cap, nheads_kv, d))
    vc = rng.standard_normal((batch, cap, nheads_kv, d))
    out, lse = model_decode(q, kc, vc, lengths, causal=causal, scale=0.3, num_splits=num_splits, block_n=block_n,
                            m_slabs=m_slabs)  # fmt: skip
    ref, ref_lse, _, _ = reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=causal,
                                                         softmax_scale=0.3)  # fmt: skip
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-12)


@pytest.mark.parametrize("packer, dtype", [(params.DECODE_PACKER, params.DECODE_DTYPE),
                                           (params.FWD_PACKER, params.FWD_DTYPE), (params.BWD_PACKER, params.BWD_DTYPE)])
def test_packed_record_matches_make_record(packer, dtype):
    """The struct-packed records (params.RecordPacker: what forward, backward and kvcache launch with)
    have exactly the bytes of params.make_record, padding included, for values that fill every field's
    width; a missing or unknown field is a KeyError, as in make_record."""
    rng = np.random.default_rng(0)
    limits = {np.dtype(np.uint64): (0, 2**64), np.dtype(np.int64): (-(2**63), 2**63), np.dtype(np.int32): (-(2**31), 2**31),
              np.dtype(np.uint32): (0, 2**32)}  # fmt: skip

    def value(kind):
        if kind.names:  # a nested struct (ModParams): the tuple of its fields
            return tuple(value(kind.fields[n][0]) for n in kind.names)
        if kind.kind == "f":
            return float(rng.uniform(-1e6, 1e6))
        lo, hi = limits[kind]
        return int(rng.integers(lo, hi, dtype=np.uint64 if lo == 0 else np.int64))

    for _ in range(3):
        values = {name: value(dtype.fields[name][0]) for name in dtype.names}
        packed = packer.pack(**values)
        assert type(packed) is bytes and len(packed) == packer.size == dtype.itemsize
        assert packed == params.make_record(dtype, **values).tobytes()
        assert np.frombuffer(packed, dtype=dtype)[0].tolist() == params.make_record(dtype, **values).tolist()
    assert packer.names == dtype.names and all(packer.offset(n) == dtype.fields[n][1] for n in dtype.names)
    first = dtype.names[0]
    for bad in ({k: v for k, v in values.items() if k != first}, {**values, "seqlen_extra": 3}):
        with pytest.raises(KeyError, match="missing|unknown"):
            packer.pack(**bad)
        with pytest.raises(KeyError):
            params.make_record(dtype, **bad)
    with pytest.raises(KeyError, match=f"missing \\['{first}'\\] / unknown \\['seqlen_extra'\\]"):
        packer.pack(**{k: v for k, v in values.items() if k != first}, seqlen_extra=3)


# ---------------------------------------------------------------------------------------------
# 16-byte row alignment (which load path a call takes)
# ---------------------------------------------------------------------------------------------


def _fake_array(ptr, shape, strides):
    from types import SimpleNamespace

    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), shape=shape, strides=strides)


def test_aligned16_reads_byte_strides():
    """CuPy strides are bytes: a row stride of 8 bytes is misaligned even though 8 elements of a
    2-byte dtype would not be (the check once multiplied the byte strides by the item size)."""
    d = 64
    dense = _fake_array(4096, (2, 5, 3, d), (5 * 3 * d * 2, 3 * d * 2, d * 2, 2))
    assert checks.aligned16(dense)
    padded = _fake_array(4096, (2, 5, 3, d), (5 * 3 * (d + 4) * 2, 3 * (d + 4) * 2, (d + 4) * 2, 2))  # 136-byte heads
    assert not checks.aligned16(padded)
    assert not checks.aligned16(dense, ptr=4096 + 8)  # the base pointer counts too
    one_head = _fake_array(4096, (2, 5, 1, d), (5 * (d + 4) * 2 * 2, (d + 4) * 2 * 2, 8, 2))  # size-1 dim: any stride
    assert checks.aligned16(one_head)
    # rows_aligned16: the same rule from a pointer, a shape and strides (kvcache checks the strides once
    # per signature with pointer 0 and the pointers per call)
    for x in (dense, padded, one_head):
        assert checks.rows_aligned16(0, x.shape, x.strides) == checks.aligned16(x)
    assert not checks.rows_aligned16(8, dense.shape, dense.strides)


@pytest.mark.parametrize("nheads, nheads_kv, forward_ok, decode_ok", [
    (8, 2, True, True), (8, 8, True, True), (8, 3, False, False), (4, 0, False, False), (0, 0, True, False),
])  # fmt: skip
def test_head_ratio_check(nheads, nheads_kv, forward_ok, decode_ok):
    """The forward accepts an empty problem with no heads at all; decode always needs kv heads."""
    for allow, ok in ((True, forward_ok), (False, decode_ok)):
        if ok:
            checks.check_head_ratio(nheads, nheads_kv, allow_no_heads=allow)
        else:
            with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
                checks.check_head_ratio(nheads, nheads_kv, allow_no_heads=allow)


def test_output_like_allocates_or_checks():
    """The forward and decode share one rule for ``out``: None gives a new array like q, anything
    else must match q (a fake CuPy namespace, so the rule runs without a GPU)."""
    from types import SimpleNamespace

    import numpy as np

    class FakeArray(SimpleNamespace):
        pass

    def empty(shape, dtype):
        return FakeArray(shape=shape, dtype=np.dtype(dtype), device=SimpleNamespace(id=0), size=int(np.prod(shape)),
                         strides=None, itemsize=np.dtype(dtype).itemsize, made=True)  # fmt: skip

    fake_cupy = SimpleNamespace(ndarray=FakeArray, empty=empty)
    q = FakeArray(shape=(2, 1, 4, 64), dtype=np.dtype(np.float16), device=SimpleNamespace(id=0), size=512,
                  strides=(512, 512, 128, 2), itemsize=2)  # fmt: skip
    new = checks.output_like(None, q, 0, fake_cupy)
    assert new.made and new.shape == q.shape and new.dtype == q.dtype
    same = FakeArray(**vars(q))
    assert checks.output_like(same, q, 0, fake_cupy) is same
    with pytest.raises(TypeError, match="out must be a cupy.ndarray"):
        checks.output_like(np.zeros(q.shape, np.float16), q, 0, fake_cupy)
    with pytest.raises(ValueError, match="out must have q's shape"):
        checks.output_like(FakeArray(**{**vars(q), "shape": (2, 1, 4, 32)}), q, 0, fake_cupy)
    with pytest.raises(ValueError, match="out is on device 1"):
        checks.output_like(FakeArray(**{**vars(q), "device": SimpleNamespace(id=1)}), q, 0, fake_cupy)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        checks.output_like(FakeArray(**{**vars(q), "strides": (1024, 1024, 256, 4)}), q, 0, fake_cupy)
    with pytest.raises(ValueError, match="dk must have k's shape"):  # the backward's names
        checks.output_like(FakeArray(**{**vars(q), "shape": (2, 1, 4, 32)}), q, 0, fake_cupy, "dk", "k")


def test_long_splits_load_each_tile_as_a_cta():
    """plan.decode_cta_loads: the hd128 split CTAs the plan spaces to 2 per SM (long splits, filled grids
    included) load each K/V tile as a CTA; those at 3 per SM, and tiles sized for 2 per SM, per key column."""
    for b, L, h_kv in ((8, 4096, 32), (1, 131072, 32), (64, 16384, 8)):
        p = _uniform_plan(b, L, h_kv)
        assert p.ctas_per_sm == 2 < p.attn.spec.min_blocks and p.attn.spec.cta_loads, (b, L, h_kv, p)
    assert _uniform_plan(1, 131072, 32).split_major  # a filled grid, with CTA loads
    for b, L, h_kv in ((1, 16384, 32), (8, 8192, 8)):
        p = _uniform_plan(b, L, h_kv)
        assert p.ctas_per_sm == 3 == p.attn.spec.min_blocks and not p.attn.spec.cta_loads, (b, L, h_kv, p)
    p = _uniform_plan(8, 4096, 32, head_dim=64)  # the hd64 tile holds 2 per SM: never spaced
    assert p.ctas_per_sm == 2 == p.attn.spec.min_blocks and not p.attn.spec.cta_loads
    assert not _uniform_plan(8, 4096, 32, policy=_per_sm(1)).attn.spec.cta_loads  # 1 per SM: not measured, column loads
    one_stage = plan.DecodeTile(64, 1, 3)
    assert not plan.decode_cta_loads(one_stage, 2)  # a one-stage ring always loads as a CTA (kCtaLoads in the kernel)


class _PolicySubclass(plan.DecodePolicy):
    """A DecodePolicy of another type: valid for the planner, but not a key kvcache trusts by value."""


def test_call_signature_of_the_prepared_path():
    """kvcache._signature, the key under which a decode call's checks and plan are kept: pointers and a
    length within the same 64-token step give the same key; every static property (strides, dtype,
    device, flags, scale, new tokens, block table, the length's step, the policy) another; calls whose
    values must be checked each time (host lengths or block table, check=True) or whose arguments would
    fail a check get None (the whole way, which raises). A fake CuPy namespace, so it runs without a GPU."""
    import numpy as np

    from fake_arrays import FakeArray
    from fake_arrays import fake_array as arr

    q, kc, vc = arr((2, 1, 8, 64)), arr((2, 1000, 2, 64)), arr((2, 1000, 2, 64))
    base = dict(k=None, v=None, cache_seqlens=700, block_table=None, causal=False, softmax_scale=0.125, num_splits=0,
                return_lse=False, out=None, check=False, policy=None)  # fmt: skip

    def sig(q=q, kc=kc, vc=vc, **kw):
        return kvcache._signature(FakeArray, kvcache._desc, q, kc, vc, **{**base, **kw})

    key = sig()
    assert key is not None and hash(key) is not None
    assert sig(q=arr((2, 1, 8, 64), ptr=8192), cache_seqlens=704) == key  # pointers, the same step of 64
    # a policy is part of the key by value: an equal one built anew finds the same prepared call
    assert sig(policy=_per_sm(2)) == sig(policy=plan.DecodePolicy(ctas_per_sm=2)) != sig(policy=_per_sm(1))
    for changed in (dict(q=arr((2, 1, 8, 64), strides=(2048, 1024, 128, 2))), dict(q=arr((2, 1, 8, 64), device=1)),
                    dict(kc=arr((2, 1000, 2, 64), dtype=np.float32)), dict(causal=True), dict(softmax_scale=0.1),
                    dict(num_splits=3), dict(return_lse=True), dict(policy=_per_sm(2)), dict(out=arr((2, 1, 8, 64))),
                    dict(cache_seqlens=705), dict(cache_seqlens=None), dict(cache_seqlens=arr((2,), np.int32)),
                    dict(k=arr((2, 1, 2, 64)), v=arr((2, 1, 2, 64))),
                    dict(block_table=arr((2, 4), np.int32)), dict(window_size=(64, 0)), dict(softcap=30.0)):  # fmt: skip
        other = sig(**changed)
        assert other is not None and other != key, changed
    for whole_way in (dict(check=True), dict(cache_seqlens=[700, 700]), dict(cache_seqlens=np.int32(700)),
                      dict(cache_seqlens=True), dict(cache_seqlens=-1), dict(cache_seqlens=1001),
                      dict(cache_seqlens=1000, k=arr((2, 1, 2, 64)), v=arr((2, 1, 2, 64))),
                      dict(block_table=np.zeros((2, 4), np.int32)), dict(softmax_scale=np.float32(0.125)),
                      dict(q=np.zeros((2, 1, 8, 64), np.float16)), dict(k=arr((2, 1, 2, 64))), dict(num_splits=True),
                      dict(out=np.zeros((2, 1, 8, 64), np.float16)), dict(policy={"ctas_per_sm": 2}),
                      dict(policy=_PolicySubclass()), dict(alibi_slopes=arr((8,), np.float32)),
                      dict(window_size=[64, 0])):  # fmt: skip
        assert sig(**whole_way) is None, whole_way
    lens_dev = arr((2,), np.int32)
    # Optional arrays keep their own slots: a paged call and one whose out looks like its block table differ.
    assert sig(block_table=arr((2, 4), np.int32), cache_seqlens=lens_dev) != sig(out=arr((2, 4), np.int32),
                                                                               cache_seqlens=lens_dev)  # fmt: skip
    # An array its desc refuses (cuflash.torch's: a tensor to_cupy would copy) sends the call the whole way.
    for refused in (q, kc, vc):
        assert kvcache._signature(FakeArray, lambda x, r=refused: None if x is r else kvcache._desc(x), q, kc, vc,
                                  **base) is None  # fmt: skip
    kn, lens, table = arr((2, 1, 2, 64)), arr((2,), np.int32), arr((2, 4), np.int32)  # fmt: skip
    for refused in (kn, lens, table):
        assert kvcache._signature(FakeArray, lambda x, r=refused: None if x is r else kvcache._desc(x), q, kc, vc,
                                  **{**base, "k": kn, "v": arr((2, 1, 2, 64)), "cache_seqlens": lens,
                                     "block_table": table}) is None  # fmt: skip
    # A paged cache's capacity is its pages per sequence x the page size: 4 x 1000 here.
    assert sig(block_table=arr((2, 4), np.int32), cache_seqlens=3999) is not None


def test_split_workspaces_are_keyed_per_stream_and_per_thread_on_the_per_thread_stream():
    """The split path's scratch is shared by the calls of one stream (they run in order). The per-thread
    default stream (handle 2) is a different stream in each host thread: its workspaces are per thread too."""
    import threading

    from cuflash import kvcache

    here = {h: kvcache._workspace_key(0, h) for h in (0, 2, 0x7F00)}
    there = {}
    t = threading.Thread(target=lambda: there.update({h: kvcache._workspace_key(0, h) for h in (0, 2, 0x7F00)}))
    t.start()
    t.join()
    assert here[0] == there[0] and here[0x7F00] == there[0x7F00]  # one stream, whatever thread calls
    assert here[2] != there[2]
    assert kvcache._workspace_key(1, 0) != here[0]  # and per device
