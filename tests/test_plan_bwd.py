"""CPU tests of the backward planning layer (cuflash/plan.py: BwdTile, BWD_TILES, plan_backward)."""
from __future__ import annotations

import dataclasses

import numpy as np

import pytest

from cuflash import plan
from nvrtc_util import compile_static_asserts

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120")


@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_tuned_tiles_follow_the_layout_rules_and_fit_hopper(bucket):
    t = plan.BWD_TILES[bucket]
    assert t.valid_for(bucket)
    assert plan.bwd_smem_bytes(bucket, t) <= plan.max_smem_bytes("sm_90a")
    assert plan.bwd_tile(bucket, "sm_90a") == t  # the tuned row is what the H200 runs
    assert t.registers(bucket)["dkdv"] <= 128


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_every_arch_gets_a_tile_that_fits(arch, bucket):
    t = plan.bwd_tile(bucket, arch)
    assert t.valid_for(bucket)
    assert plan.bwd_smem_bytes(bucket, t) <= plan.max_smem_bytes(arch)


def test_warp_tiles_and_registers_of_the_hd128_tile():
    t = plan.BWD_TILES[128]
    assert t.warp_tiles(128) == {"scores": (32, 32), "dkdv": (32, 64), "dq": (32, 32)}
    assert t.registers(128) == {"dkdv": 128, "scores": 64, "dq": 32}


@pytest.mark.parametrize(
    "change",
    [dict(stages=3), dict(block_m=40), dict(s_key_warps=3), dict(kv_key_warps=16), dict(dq_q_warps=8)],
)
def test_layout_rule_violations_are_rejected(change):
    bad = dataclasses.replace(plan.BWD_TILES[128], **change)
    assert not bad.valid_for(128)
    with pytest.raises(ValueError, match="layout rules"):
        plan.bwd_spec(128, "bf16", False, True, "sm_90a", tile=bad)


def test_smem_formula_matches_the_kernel_layout():
    t = plan.BWD_TILES[128]  # K, V: 128 x 136; Q, dO: 2 stages of 64 x 136; P, dS: 128 x 72; lse, D
    assert plan.bwd_smem_bytes(128, t) == 2 * (2 * 128 * 136 + 2 * 2 * 64 * 136 + 2 * 128 * 72) + 4 * 2 * 2 * 64


def test_plan_backward_launches():
    bp = plan.plan_backward(batch=3, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=100,
                            dtype="fp16", causal=True, aligned=False, arch="sm_90a")  # fmt: skip
    t = bp.main.spec.tile
    assert bp.main.spec.head_dim == 128 and bp.main.spec.causal and not bp.main.spec.aligned
    assert bp.main.grid == (-(-700 // t.block_n), 2, 3)  # key blocks x kv heads x batch
    assert bp.num_m_blocks == -(-1000 // t.block_m) and bp.seqlen_q_pad == bp.num_m_blocks * t.block_m
    assert bp.dq_accum_cols == 128
    assert bp.pre.grid == (bp.seqlen_q_pad // 8, 8, 3) and bp.pre.spec.family == "flash_bwd_pre"
    assert bp.convert.grid == (bp.num_m_blocks, 8, 3) and bp.convert.spec.family == "flash_bwd_convert"
    assert bp.main.smem_bytes == plan.bwd_smem_bytes(128, t) and bp.main.block == (t.warps * 32, 1, 1)
    names = {x.spec.name for x in (bp.pre, bp.main, bp.convert)}
    assert "flash_bwd_hd128_fp16_causal_bm64_bn128_w8_mb1_st2_s4kv4dq2_scalar_sm90a" in names


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(seqlen_q=0), "non-empty"), (dict(nheads=6, nheads_kv=4), "multiple"), (dict(head_dim=300), "between 1 and 256"),
     (dict(dtype="fp32"), "dtype")],
)  # fmt: skip
def test_plan_backward_errors(kwargs, match):
    args = dict(batch=1, seqlen_q=10, seqlen_k=10, nheads=4, nheads_kv=2, head_dim=64, dtype="bf16", causal=False,
                aligned=True, arch="sm_90a")  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan.plan_backward(**args)


def test_all_bwd_specs_lists_every_variant_once():
    specs = plan.all_bwd_specs("sm_90a")
    hopper = (len(plan.BWD_SM90_TILES) + len(plan.BWD_SM90_WS_TILES)) * 2 * 2  # buckets x dtype x causal, aligned only
    hopper += len(plan.BWD_SM90_WS_PERSISTENT) * 2  # the persistent warp-specialized backward: x dtype
    assert len(specs) == len(set(specs)) == 8 * 2 * 2 * 2 + 2 * 2 * 2 + hopper  # main + (pre, convert) x dtype x load path
    assert len({s.name for s in specs}) == len(specs)
    assert not [s for s in plan.all_bwd_specs("sm_80") if s.family.startswith("flash_bwd_sm90")]
    # packed batches: both Hopper kernels (the warp-specialized one is the default, the cp.async one its fallback)
    packed = plan.all_bwd_specs("sm_90a", mods=(plan.MOD_VARLEN,))
    ws = [s for s in packed if s.family == "flash_bwd_sm90_ws"]
    assert len(ws) == len(plan.BWD_SM90_WS_TILES) * 2 * 2 and all(s.mods == plan.MOD_VARLEN for s in ws)
    assert [s for s in packed if s.family == "flash_bwd_sm90"]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_backward_for_plain_batches(head_dim, causal):
    """With the SM count, plain batches take the persistent backward where BWD_SM90_WS_PERSISTENT lists the
    head dim and causal flag (hd128 non-causal): one CTA per SM (at most one per key block of every
    kv head and sequence), the tile's persistent flag in the name and template; packed batches, calls with
    a variant, deterministic mode, the other points and plans without the SM count keep one CTA per key
    block. A
    persistent tile is refused where the kernel has none, and in deterministic mode; at hd64 (not planned)
    it runs when given."""
    assert plan.BWD_SM90_WS_PERSISTENT == {(128, False)}
    kw = dict(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=head_dim, dtype="bf16", causal=causal,
              aligned=True, arch="sm_90a")  # fmt: skip
    bp = plan.plan_backward(**kw, sm_count=132)
    t, n = bp.main.spec.tile, plan.BWD_SM90_WS_TILES[head_dim].block_n
    persistent = dataclasses.replace(plan.BWD_SM90_WS_TILES[head_dim], persistent=True)
    if (head_dim, causal) in plan.BWD_SM90_WS_PERSISTENT:
        assert t == persistent
        assert bp.main.grid == (min(-(-700 // n) * 2 * 2, 132), 1, 1) == (24, 1, 1)
        assert plan.plan_backward(**dict(kw, batch=40), sm_count=132).main.grid == (132, 1, 1)
        assert "_persistent_" in bp.main.spec.name and bp.main.spec.template_args().endswith(", true")
        assert bp.main.spec in plan.all_bwd_specs("sm_90a")
        assert bp.main.smem_bytes == plan.plan_backward(**kw).main.smem_bytes + 72  # (+ the item ring)
    else:
        assert t == plan.BWD_SM90_WS_TILES[head_dim] and bp.main.grid == (-(-700 // n), 2, 2)
    if head_dim == 64:  # (not planned, but a given persistent tile runs)
        given = plan.plan_backward(**kw, sm_count=132, tile=persistent)
        assert given.main.spec.tile == persistent and given.main.grid == (24, 1, 1)
        assert given.main.spec not in plan.all_bwd_specs("sm_90a")
    assert not plan.plan_backward(**kw).main.spec.tile.persistent  # (no SM count)
    assert not plan.plan_backward(**kw, sm_count=132, deterministic=True).main.spec.tile.persistent
    assert not plan.plan_backward(**kw, sm_count=132, mods=plan.MOD_VARLEN).main.spec.tile.persistent
    # a variant (causal windows arrive as kernel-causal False with the window bit) keeps the per-key-block grid
    for m in (plan.MOD_WINDOW, plan.MOD_SOFTCAP, plan.MOD_ALIBI, plan.MOD_DROPOUT):
        assert not plan.plan_backward(**kw, sm_count=132, mods=m).main.spec.tile.persistent
    if head_dim == 256:
        with pytest.raises(ValueError, match="head dims 64 and 128 on plain batches"):
            plan.bwd_sm90_ws_spec(head_dim, "bf16", causal, persistent)
    else:
        with pytest.raises(ValueError, match="needs sm_count"):
            plan.plan_backward(**kw, tile=persistent)
        with pytest.raises(ValueError, match="deterministic=True runs the per-key-block backward"):
            plan.plan_backward(**kw, tile=persistent, sm_count=132, deterministic=True)
    with pytest.raises(ValueError, match="head dims 64 and 128 on plain batches"):
        plan.bwd_sm90_ws_spec(head_dim, "bf16", causal, persistent, plan.MOD_VARLEN)


def _bwd_plan(head_dim=128, arch="sm_90a", aligned=True, deterministic=False, tile=None):
    return plan.plan_backward(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=head_dim,
                              dtype="bf16", causal=True, aligned=aligned, arch=arch, tile=tile,
                              deterministic=deterministic)  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 56, 128, 120, 256, 248])
def test_warp_specialized_backward_where_it_can(head_dim):
    bp = _bwd_plan(head_dim)
    spec, t = bp.main.spec, bp.main.spec.tile
    d = spec.head_dim
    st = 3 if d == 64 else 2
    m = 128 if d == 64 else 64  # head dim 64: 128-row query blocks (BWD_SM90_WS_WIDE_ROWS), but for softcap
    n = 64 if d == 256 else 128  # d = 256: the consumer warpgroups split the keys of S and the head dim of dK, dV, dQ
    assert spec.family == "flash_bwd_sm90_ws" and t == plan.BWD_SM90_WS_TILES[d] == plan.BwdSm90WsTile(block_n=n, block_m=m,
                                                                                                       stages=st)  # fmt: skip
    assert bp.main.grid == (-(-700 // n), 2, 2) and bp.main.block == (384, 1, 1)  # producer + 2 consumer warpgroups
    assert bp.num_m_blocks == -(-1000 // m) and bp.seqlen_q_pad == bp.num_m_blocks * m
    # K, V, stages x (Q, dO), 2 dS^T buffers (split: and 2 P^T), stages x (lse_log2, D), 2 + 2 stages mbarriers,
    # 1 KB alignment
    ds_tiles = 2 if n == 64 else 1
    smem = 1024 + 2 * n * d * 2 + 2 * st * m * d * 2 + 2 * ds_tiles * n * m * 2 + st * 8 * m + 8 * (2 + 2 * st)
    assert bp.main.smem_bytes == smem <= 227 * 1024
    # the pair kernel's dQ layout: each warpgroup a head-dim half of 64 rows, or at 128 rows its own 64 rows
    assert t.warp_tiles(d)["dq"] == (16, d if m == 128 else d // 2) and t.dq_q_warps == m // 16 and t.warps == 12
    wide = ", false, 128" if m == 128 else ""
    assert spec.template_args() == f"{d}, true, true, 0, {st}{wide}"
    with_mods = plan.plan_backward(batch=2, seqlen_q=100, seqlen_k=100, nheads=2, nheads_kv=2, head_dim=head_dim,
                                   dtype="fp16", causal=False, aligned=True, arch="sm_90a", mods=plan.MOD_SOFTCAP)  # (no SM count)
    assert with_mods.main.spec.template_args() == f"{d}, false, false, {plan.MOD_SOFTCAP}, {st}"  # 64 rows
    assert with_mods.main.spec.tile == dataclasses.replace(t, block_m=64)
    # packed batches too (scheduler grid, varlen source); the cp.async Hopper kernel when forced; the mma.sync one elsewhere
    packed = plan.plan_backward(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=head_dim,
                                dtype="bf16", causal=True, aligned=True, arch="sm_90a", mods=plan.MOD_VARLEN)
    assert packed.main.spec.family == "flash_bwd_sm90_ws" and packed.main.grid == (700 // n + 2, 2, 1)
    assert packed.main.spec.template_args() == f"{d}, true, true, {plan.MOD_VARLEN}, {st}{wide}"
    assert _bwd_plan(head_dim, tile=plan.BWD_SM90_TILES[d]).main.spec.family == "flash_bwd_sm90"
    assert _bwd_plan(head_dim, deterministic=True).main.spec == spec  # ordered dQ additions on the same kernel
    assert _bwd_plan(head_dim, arch="sm_80").main.spec.family == "flash_bwd"
    assert _bwd_plan(head_dim, aligned=False).main.spec.family == "flash_bwd"
    with pytest.raises(ValueError, match="warp-specialized backward"):
        _bwd_plan(head_dim, tile=plan.BwdSm90WsTile(block_n=n), aligned=False)
    with pytest.raises(ValueError, match="x 64 queries, 2 to 4"):
        _bwd_plan(head_dim, tile=plan.BwdSm90WsTile(block_n=n, stages=5))


@pytest.mark.parametrize("persistent", [False, True])
def test_warp_specialized_backward_128_query_rows(persistent):
    """Head dim 64's 128-row query blocks: each consumer warpgroup's dQ part is its own 64 rows x all 64
    columns (8 warps of 16 rows in the convert kernel's layout), the scratch rows pad to 128, the boxes of
    q and dout are 128 rows; the 64-row tiles' template arguments stay what they were."""
    tile = plan.BwdSm90WsTile(block_m=128, stages=3, persistent=persistent)
    bp = plan.plan_backward(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=64, dtype="bf16",
                            causal=True, aligned=True, arch="sm_90a", tile=tile, sm_count=132)  # fmt: skip
    spec = bp.main.spec
    assert spec.template_args() == f"64, true, true, 0, 3, {'true' if persistent else 'false'}, 128"
    assert "_bm128_" in spec.name
    assert bp.num_m_blocks == 8 and bp.seqlen_q_pad == 1024
    assert tile.dq_q_warps == 8 and tile.warp_tiles(64)["dq"] == (16, 64)
    assert plan.BWD_SM90_WS_TILES[64] == plan.BwdSm90WsTile(block_m=128, stages=3)  # planned but for softcap
    narrow = plan.bwd_sm90_ws_tile(64, causal=False, mods=plan.MOD_SOFTCAP | plan.MOD_WINDOW, sm_count=132)
    assert narrow == plan.BwdSm90WsTile(stages=3) and narrow.dq_q_warps == 4 and narrow.warp_tiles(64)["dq"] == (16, 32)
    assert plan.bwd_sm90_ws_spec(64, "bf16", False, mods=plan.MOD_SOFTCAP).tile == narrow  # the default tile too
    ring = 8 * 4 + 8 + 32 if persistent else 0
    smem = 1024 + 2 * 128 * 64 * 2 + 2 * 3 * 128 * 64 * 2 + 2 * 128 * 128 * 2 + 3 * 1024 + 8 * (2 + 2 * 3) + ring
    assert bp.main.smem_bytes == smem <= 227 * 1024
    for mods in (plan.MOD_WINDOW, plan.MOD_ALIBI, plan.MOD_DROPOUT, plan.MOD_WINDOW | plan.MOD_VARLEN):
        if not (persistent and mods):
            assert plan.bwd_sm90_ws_spec(64, "fp16", False, tile, mods).template_args().endswith(", 128")
    with pytest.raises(ValueError, match="softcap calls run 64-row blocks"):
        plan.bwd_sm90_ws_spec(64, "bf16", False, plan.BwdSm90WsTile(block_m=128), plan.MOD_SOFTCAP)
    for d in (128, 256):
        with pytest.raises(ValueError, match="x 128 queries at head dim 64"):
            plan.bwd_sm90_ws_spec(d, "bf16", False, plan.BwdSm90WsTile(block_m=128, block_n=64 if d == 256 else 128))
    assert not plan.BwdSm90WsTile(block_m=128).dq_transposed
    with pytest.raises(ValueError, match="shared memory"):  # 4 stages of 128-row Q and dO do not fit
        plan.bwd_sm90_ws_spec(64, "bf16", False, plan.BwdSm90WsTile(block_m=128, stages=4))


@pytest.mark.parametrize("persistent", [False, True])
def test_warp_specialized_backward_80_query_rows(persistent):
    """Head dim 128's 80-row query blocks: each consumer warpgroup adds dQ^T (its head-dim half x the 80 rows:
    8 warps of 16 head-dim rows x 80 query columns), which the convert kernel's transposed build reads; dS^T
    takes two 64-query atoms per buffer; scratch rows pad to 80; softcap and dropout are refused."""
    tile = plan.BwdSm90WsTile(block_m=80, persistent=persistent)
    bp = plan.plan_backward(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=128, dtype="bf16",
                            causal=False, aligned=True, arch="sm_90a", tile=tile, sm_count=132)  # fmt: skip
    spec = bp.main.spec
    assert spec.template_args() == f"128, true, false, 0, 2, {'true' if persistent else 'false'}, 80"
    assert bp.num_m_blocks == 13 and bp.seqlen_q_pad == 1040
    assert tile.dq_transposed and tile.dq_q_warps == 8 and tile.warp_tiles(128)["dq"] == (16, 80)
    assert bp.convert.spec.transposed and bp.convert.spec.template_args() == "true, true, false, true"
    assert bp.convert.spec.name == "flash_bwd_convert_bf16_dqT_vec16_sm90a" and bp.convert.grid == (13, 8, 2)
    assert not _bwd_plan(128).convert.spec.transposed and _bwd_plan(128).convert.spec.template_args() == "true, true"
    ring = 8 * 4 + 8 + 32 if persistent else 0
    smem = 1024 + 2 * 128 * 128 * 2 + 2 * 2 * 80 * 128 * 2 + 2 * 2 * 128 * 128 + 2 * 640 + 8 * (2 + 2 * 2) + ring
    assert bp.main.smem_bytes == smem <= 227 * 1024
    packed = plan.plan_backward(batch=2, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=128, dtype="fp16",
                                causal=True, aligned=True, arch="sm_90a", tile=plan.BwdSm90WsTile(block_m=80),
                                mods=plan.MOD_VARLEN)  # fmt: skip
    assert packed.convert.spec.template_args() == "false, true, true, true"
    with pytest.raises(ValueError, match="softcap calls run 64-row blocks"):
        plan.bwd_sm90_ws_spec(128, "bf16", False, plan.BwdSm90WsTile(block_m=80), plan.MOD_SOFTCAP)
    with pytest.raises(ValueError, match="dropout calls run 64-row blocks"):
        plan.bwd_sm90_ws_spec(128, "bf16", False, plan.BwdSm90WsTile(block_m=80), plan.MOD_DROPOUT)
    with pytest.raises(ValueError, match="x 80 at 128"):
        plan.bwd_sm90_ws_spec(64, "bf16", False, plan.BwdSm90WsTile(block_m=80))
    with pytest.raises(ValueError, match="shared memory"):  # 3 stages of 80-row Q and dO do not fit
        plan.bwd_sm90_ws_spec(128, "bf16", False, plan.BwdSm90WsTile(block_m=80, stages=3))


def test_warp_specialized_backward_tile_errors():
    with pytest.raises(ValueError, match="no warp-specialized backward tile"):
        _bwd_plan(192, tile=plan.BwdSm90WsTile())
    with pytest.raises(ValueError, match="64 for head dim 256"):
        _bwd_plan(256, tile=plan.BwdSm90WsTile())
    with pytest.raises(ValueError, match="64 for head dim 256"):
        _bwd_plan(128, tile=plan.BwdSm90WsTile(block_n=64))
    with pytest.raises(ValueError, match="shared memory"):  # 3 stages of 256-column Q and dO do not fit
        _bwd_plan(256, tile=plan.BwdSm90WsTile(block_n=64, stages=3))


@pytest.mark.parametrize("head_dim", [64, 56, 128, 120, 256, 248])
def test_hopper_backward_where_it_can(head_dim):
    bucket = plan.head_dim_bucket(head_dim)
    bp = _bwd_plan(head_dim, tile=plan.BWD_SM90_TILES[bucket])
    spec, t = bp.main.spec, bp.main.spec.tile
    assert spec.family == "flash_bwd_sm90" and t == plan.BWD_SM90_TILES[plan.head_dim_bucket(head_dim)]
    d = spec.head_dim
    n = 64 if d == 256 else 128  # d = 256: the warpgroups split the head dim, 64 keys per CTA
    assert t.block_n == n
    assert bp.main.grid == (-(-700 // n), 2, 2) and bp.main.block == (256, 1, 1)
    assert bp.num_m_blocks == -(-1000 // 64) and bp.seqlen_q_pad == bp.num_m_blocks * 64
    exchange = 64 * 68 * 4 if n == 64 else 0  # fp32 P^T handed from warpgroup 0 to 1
    assert bp.main.smem_bytes == 1024 + 2 * n * d * 2 + 4 * 64 * d * 2 + n * 64 * 2 + exchange + 2 * 2 * 64 * 4
    assert bp.main.smem_bytes <= 227 * 1024
    # the dQ layout the convert kernel is told: 4 warps of 16 rows x a column half per warpgroup
    assert t.warp_tiles(d)["dq"] == (16, d // 2) and t.dq_q_warps == 4 and t.warps == 8
    assert spec.template_args() == f"{d}, {n}, true, true"
    # the mma.sync kernel elsewhere
    want = "flash_bwd_sm90_ws" if bucket in plan.BWD_SM90_WS_TILES else "flash_bwd"  # ordered dQ additions
    assert _bwd_plan(head_dim, deterministic=True).main.spec.family == want
    assert _bwd_plan(head_dim, arch="sm_80").main.spec.family == "flash_bwd"
    assert _bwd_plan(head_dim, aligned=False).main.spec.family == "flash_bwd"


@pytest.mark.parametrize("head_dim", [32, 96, 160, 192, 224])
def test_other_buckets_run_the_mma_sync_backward(head_dim):
    assert _bwd_plan(head_dim).main.spec.family == "flash_bwd"


def test_hopper_backward_tile_errors():
    assert _bwd_plan(128, tile=plan.BwdSm90Tile()).main.spec.family == "flash_bwd_sm90"
    assert _bwd_plan(128, tile=plan.BWD_TILES[128]).main.spec.family == "flash_bwd"
    for kwargs in (dict(arch="sm_80"), dict(aligned=False), dict(deterministic=True)):
        with pytest.raises(ValueError, match="Hopper backward"):
            _bwd_plan(128, tile=plan.BwdSm90Tile(), **kwargs)
    with pytest.raises(ValueError, match="no Hopper backward tile"):
        _bwd_plan(192, tile=plan.BwdSm90Tile())
    with pytest.raises(ValueError, match="128 keys"):
        _bwd_plan(128, tile=plan.BwdSm90Tile(block_n=64))
    with pytest.raises(ValueError, match="64 for head dim 256"):
        _bwd_plan(256, tile=plan.BwdSm90Tile())


# ---------------------------------------------------------------------------------------------
# Packed varlen batches: the scheduler's grids and scratch rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_varlen_backward_plan(arch):
    """Varlen: batch 1 in every grid, the query and key grids are the scheduler's slots (total // block +
    sequences), scratch rows per head are the query slots times block_m, and the aux kernels are the
    varlen ones."""
    bp = plan.plan_backward(batch=5, seqlen_q=1000, seqlen_k=3000, nheads=8, nheads_kv=2, head_dim=128, dtype="bf16",
                            causal=True, aligned=True, arch=arch, mods=plan.MOD_VARLEN)  # fmt: skip
    bm, bn = bp.main.spec.tile.block_m, bp.main.spec.tile.block_n
    assert bp.num_m_blocks == 1000 // bm + 5 and bp.seqlen_q_pad == bp.num_m_blocks * bm
    assert bp.main.grid == (3000 // bn + 5, 2, 1)
    assert bp.convert.grid == (bp.num_m_blocks, 8, 1)
    assert bp.pre.grid == (-(-bp.seqlen_q_pad // 16), 8, 1)  # 8 warps x 2 rows (head dim 128)
    assert bp.pre.spec.varlen and bp.convert.spec.varlen and "_varlen" in bp.pre.spec.name
    assert bp.main.spec.mods == plan.MOD_VARLEN and "_varlen" in bp.main.spec.name
    assert bp.pre.spec.template_args().endswith(", true")
    plain = plan.plan_backward(batch=5, seqlen_q=1000, seqlen_k=3000, nheads=8, nheads_kv=2, head_dim=128, dtype="bf16",
                               causal=True, aligned=True, arch=arch)  # fmt: skip
    assert not plain.pre.spec.varlen and plain.pre.spec.template_args().count(",") == 1  # plain source unchanged
    # No key at all (every sequence empty on the key side) still plans (every CTA is a spare slot).
    assert plan.plan_backward(batch=2, seqlen_q=10, seqlen_k=0, nheads=1, nheads_kv=1, head_dim=64, dtype="fp16",
                              causal=False, aligned=True, arch=arch, mods=plan.MOD_VARLEN).main.grid[0] == 2  # fmt: skip


def test_varlen_tiles_cover_every_sequence():
    """The scheduler's map f(b) = cu[b] // block + b gives each sequence at least ceil(len / block) slots,
    disjoint and in order, all below varlen_tiles (what cuda_src/varlen.cuh relies on)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        block = int(rng.choice([64, 128]))
        lengths = rng.integers(0, 600, size=int(rng.integers(1, 40)))
        cu = np.concatenate([[0], np.cumsum(lengths)])
        f = cu // block + np.arange(cu.size)
        assert (np.diff(f) >= -(-lengths // block)).all()
        assert f[-1] <= plan.varlen_tiles(int(cu[-1]), lengths.size, block)


@pytest.mark.parametrize("head_dim,aligned,rows", [(64, True, 4), (128, True, 2), (256, True, 1), (32, True, 8), (16, True, 8),
                                                  (96, True, 2), (200, True, 1), (64, False, 1)])  # fmt: skip
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_preprocess_rows_per_warp(head_dim, aligned, rows, arch):
    """The preprocess gives a row about one 16-byte chunk per lane (1-8 rows per warp, element-wise 1)
    and its grid covers the padded rows with 8 warps of that many rows; a warp's rows stay in one
    query tile (varlen: each warp searches the scheduler once)."""
    assert plan.bwd_pre_rows_per_warp(head_dim, aligned) == rows
    for mods in (0, plan.MOD_VARLEN):
        bp = plan.plan_backward(batch=3, seqlen_q=1000, seqlen_k=700, nheads=8, nheads_kv=2, head_dim=head_dim, dtype="bf16",
                                causal=True, aligned=aligned, arch=arch, mods=mods)  # fmt: skip
        assert bp.pre_rows_per_warp == rows
        assert bp.pre.grid[:2] == (-(-bp.seqlen_q_pad // (8 * rows)), 8)
        assert bp.seqlen_q_pad % 8 == 0 and bp.main.spec.tile.block_m % 8 == 0


def test_ws_backward_template_and_smem_match_the_kernel_config():
    """NVRTC checks, for every planned warp-specialized backward variant and every ring depth and
    persistent flag that fits at head dims 64 and 128, that template_args() lands the stages and the
    persistent flag on Sm90WsBwdConfig and that its kSmemBytes is the plan's bwd_sm90_ws_smem_bytes (the
    launch's dynamic shared memory; no GPU needed)."""
    specs = [s for s in plan.all_bwd_specs("sm_90a", mods=(0, plan.MOD_VARLEN)) if s.family == "flash_bwd_sm90_ws"]
    for hd in (64, 128):
        for stages in (2, 3, 4):
            for persistent in (False, True):
                for rows in {64, plan.BWD_SM90_WS_TILES[hd].block_m}:  # (softcap: 64 rows only)
                    t = dataclasses.replace(plan.BWD_SM90_WS_TILES[hd], block_m=rows, stages=stages,
                                            persistent=persistent)  # fmt: skip
                    mods = plan.ALL_MODS if rows == 64 else plan.ALL_MODS & ~plan.MOD_SOFTCAP
                    if plan.bwd_sm90_ws_smem_bytes(hd, t) <= plan.max_smem_bytes("sm_90a"):
                        specs.append(plan.bwd_sm90_ws_spec(hd, "fp16", True, t, mods))
    assert any(s.tile.persistent for s in specs) and any(s.tile.stages == 4 for s in specs)
    lines = ['#include "flash_bwd_sm90_ws.cuh"']
    for s in dict.fromkeys(specs):
        c = f"cuflash::Sm90WsBwdConfig<{s.template_args()}>"
        persistent = "true" if s.tile.persistent else "false"
        lines.append(f"static_assert({c}::kHeadDim == {s.head_dim} && {c}::kStages == {s.tile.stages} && "
                     f'{c}::kPersistent == {persistent}, "{s.name}: template argument order");')  # fmt: skip
        lines.append(f'static_assert({c}::kSmemBytes == {s.smem_bytes}, "{s.name}: shared memory");')
    compile_static_asserts(lines, "bwd_ws_config_check.cu")
