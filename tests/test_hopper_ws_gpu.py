"""GPU tests of what is particular to the warp-specialized TMA forward (cuda_src/flash_fwd_sm90_ws.cuh):
every schedule (overlap, ping-pong, ring depth, 3 consumer warpgroups) around the ring's edge cases,
head dims whose last 64-column box sticks out of the tensor, and varlen tails whose rows past a
sequence's keys hold NaN (TMA reads them; the kernel must not let them reach the output).
Skipped without a GPU; the schedule tests need sm_90a."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_util import NAN_BITS, PACKED_LENGTHS, check_forward, packed_with_gaps, poison_rows, random_qkv, to_f64

pytestmark = pytest.mark.gpu



def _hopper():
    from cuflash import jit

    if jit.device_arch(0) != "sm_90a":
        pytest.skip("the TMA kernel runs on sm_90a only")


def _spy_on_plans(monkeypatch, module) -> list:
    """The plans (Launch) that ``module``'s memoized plan-and-load hands out from now on, in order."""
    launched, plan_and_load = [], module._plan_and_load

    def spy(*args):
        how, fn = plan_and_load(*args)
        launched.append(how)
        return how, fn

    monkeypatch.setattr(module, "_plan_and_load", spy)
    return launched


def _schedules():
    from cuflash.plan import Sm90WsTile as W

    return [W(128, 128), W(128, 128, overlap=False), W(128, 128, pingpong=False), W(128, 128, overlap=False, pingpong=False),
            W(128, 128, 3), W(128, 64, 4), W(192, 64, pingpong=False), W(128, 128, pingpong=False, persistent=True),
            W(128, 128, persistent=True), W(192, 64, pingpong=False, persistent=True),
            W(128, 176, pingpong=False), W(128, 80),  # key tiles not a multiple of 64 (FlashAttention-3's hd128 tile)
            # clusters of 2 sharing K/V by multicast: 300 query rows are 3 tiles of 128 (the last cluster's second
            # CTA only loads), 2 of 192; causal and the window give the two CTAs different key blocks
            W(128, 128, pingpong=False, cluster=2), W(128, 128, cluster=2), W(128, 128, 3, pingpong=False, cluster=2),
            W(192, 64, pingpong=False, cluster=2), W(128, 80, pingpong=False, cluster=2),
            W(128, 128, pingpong=False, persistent=True, cluster=2),
            W(128, 128, pingpong=False, persistent=True, tma_store=False, cluster=2),
            # the next item's first S issued before the epilogue (one item per CTA here: the first S from before
            # the walk, the stand-in S after it; test_look_ahead_walks has several per CTA)
            W(128, 128, pingpong=False, persistent=True, tma_store=False, look_ahead=True),
            W(128, 128, pingpong=False, persistent=True, look_ahead=True),
            W(128, 64, 4, pingpong=False, persistent=True, tma_store=False, look_ahead=True)]  # fmt: skip


@pytest.mark.parametrize("tile", _schedules(), ids=lambda t: f"bm{t.block_m}bn{t.block_n}st{t.stages}ov{int(t.overlap)}"
                         f"pp{int(t.pingpong)}{'persistent' if t.persistent else ''}{'tmao' if t.tma_store else ''}"
                         f"c{t.cluster}{'la' if t.look_ahead else ''}")
@pytest.mark.parametrize("sk", [1, 128, 256, 384, 700])  # 1 key tile, exactly the ring, one past it, ragged
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (100, 30))])
def test_schedules(tile, sk, causal, window):
    """Every schedule against the float64 reference with 1, stages, stages + 1 and ragged key-tile counts,
    and a window whose first visited block is not 0 (the ring starts and ends mid-sequence)."""
    _hopper()
    rng = np.random.default_rng(sk)
    q, k, v = random_qkv(rng, 2, 300, sk, 4, 2, 128, "bf16")
    kw = {"window_size": window} if window else {}
    check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, what=f"{tile} sk={sk}", **kw)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_long_keys_run_in_clusters(head_dim, causal, monkeypatch):
    """From plan.CLUSTER_KEYS keys (none planned since session 17: set to 8192 here) the planner's tile
    runs in clusters of 2 (K/V shared by multicast), not for 3 query tiles (cluster_pays); both against
    the float64 reference, GQA, a partial last key tile."""
    _hopper()
    from cuflash import forward, plan

    monkeypatch.setitem(plan.CLUSTER_KEYS, head_dim, 8192)
    launched = _spy_on_plans(monkeypatch, forward)
    rng = np.random.default_rng(head_dim + causal)
    sk = plan.CLUSTER_KEYS[head_dim] + 77
    rows = plan.FWD_SM90_WS_TILES[head_dim].block_m
    for sq, cluster in ((1000, 2), (3 * rows - 10, 1)):
        q, k, v = random_qkv(rng, 1, sq, sk, 4, 2, head_dim, "bf16")
        check_forward(q, k, v, causal=causal, dtype="bf16", what=f"{sq} x {sk}")
        assert launched[-1].spec.cluster == cluster, (sq, launched[-1].spec.name)


@pytest.mark.parametrize("causal", [False, True])
def test_hd256_short_keys_take_64_key_tiles(causal, monkeypatch):
    """hd256 up to SHORT_KEYS[256] keys runs the planner's short-key tile (per-tile launches, 64-key tiles):
    exactly 8 key tiles, a ragged last one, fewer keys than queries (bottom-right causal), GQA, and one key
    past the limit takes the default tile; all against the float64 reference."""
    _hopper()
    from cuflash import forward, plan

    launched = _spy_on_plans(monkeypatch, forward)
    rng = np.random.default_rng(256 + causal)
    limit = plan.SHORT_KEYS[256][causal]
    for sq, sk, want in ((limit, limit, plan.FWD_SM90_WS_SHORT_TILES[256]), (400, 300, plan.FWD_SM90_WS_SHORT_TILES[256]),
                         (333, limit + 1, plan.FWD_SM90_WS_TILES[256])):  # fmt: skip
        q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, 256, "bf16")
        check_forward(q, k, v, causal=causal, dtype="bf16", what=f"{sq} x {sk}")
        assert launched[-1].spec.tile == want, (sq, sk, launched[-1].spec.name)


@pytest.mark.parametrize("head_dim", [64, 128])  # (256: the O staging tile does not fit next to Q and the ring)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["short", "default"])
def test_persistent_walks_every_tile(head_dim, causal, which):
    """A persistent grid (one CTA per SM) over more tiles than SMs, dense and varlen (empty sequences,
    spare scheduler slots, one long sequence): the same results as one CTA per tile. The tile the planner
    runs persistent (short keys: 2 consumer warpgroups, 16-byte stores), and the default tile made
    persistent (3 consumer warpgroups; TMA stores in the dense half), which the planner does not pick."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import plan, varlen
    from cuflash.checks import BF16

    tile = (plan.FWD_SM90_WS_SHORT_TILES[head_dim] if which == "short"
            else dataclasses.replace(plan.FWD_SM90_WS_TILES[head_dim], persistent=True))  # fmt: skip
    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(rng, 3, 1000, 1100, 16, 4, head_dim, "bf16")  # 8 (192 rows: 6) x 16 x 3 tiles > 132 SMs
    check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, what=f"persistent {tile}")
    lengths = [0, 700, 3, 129, 0, 1500, 64]
    total = sum(lengths)
    q, k, v = (cupy.asarray(rng.standard_normal((total, 8, head_dim), dtype=np.float32).astype(BF16)) for _ in range(3))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    got, lse = varlen.run(q, k, v, cu, cu, 1500, 1500, causal=causal, return_lse=True, tile=tile)
    want, want_lse = varlen.run(q, k, v, cu, cu, 1500, 1500, causal=causal, return_lse=True,
                                tile=dataclasses.replace(tile, persistent=False))  # fmt: skip
    np.testing.assert_allclose(to_f64(got), to_f64(want), atol=1e-2)
    np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)


def persistent_varlen_case(rng, head_dim, causal):
    """A packed batch whose persistent walk gives every CTA about 15 items (60 sequences x 16 heads): spare
    scheduler slots, sequences without queries, without keys, and (causal, more queries than keys) query
    tiles whose rows see no key, so each CTA's producer and consumers skip and empty-write items between
    real ones many times over. The persistent tile's result against the same tile launched one CTA per
    tile; returns the largest difference of out and of lse."""
    import dataclasses

    import cupy

    from cuflash import plan, varlen
    from cuflash.checks import BF16

    lq = rng.integers(0, 300, size=60)
    lk = rng.integers(0, 300, size=60)
    lq[[3, 17]], lk[[5, 40]] = 0, 0  # no queries; no keys
    lq[[8, 30]], lk[[8, 30]] = 290, 20  # causal: the first query tiles see no key
    tile = plan.FWD_SM90_WS_SHORT_TILES[head_dim]
    assert tile.persistent
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in (lq, lk))
    h = 16
    q = cupy.asarray(rng.standard_normal((int(lq.sum()), h, head_dim), dtype=np.float32).astype(BF16))
    k, v = (cupy.asarray(rng.standard_normal((int(lk.sum()), h, head_dim), dtype=np.float32).astype(BF16)) for _ in "kv")
    mq, mk = int(lq.max()), int(lk.max())
    got, lse = varlen.run(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True, tile=tile)
    want, want_lse = varlen.run(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True,
                                tile=dataclasses.replace(tile, persistent=False))  # fmt: skip
    finite = np.isfinite(want_lse.get())
    assert (np.isfinite(lse.get()) == finite).all(), "rows without keys must give lse -inf in both launches"
    return (float(np.abs(to_f64(got) - to_f64(want)).max()),
            float(np.abs(lse.get()[finite] - want_lse.get()[finite]).max()))  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_varlen_walks_many_items(head_dim, causal):
    """The persistent packed forward over ~15 items per CTA with spare scheduler slots and empty items
    (test_persistent_walks_every_tile's packed batch gives a CTA 1-2): the same results as one CTA per tile
    (persistent_varlen_case)."""
    _hopper()
    err_o, err_lse = persistent_varlen_case(np.random.default_rng(head_dim + causal), head_dim, causal)
    assert err_o <= 1e-2 and err_lse <= 1e-3, (err_o, err_lse)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", ["dense", "one-key-tile", "no-key-rows-causal", "no-key-rows-window", "gqa-dropout",
                                  "alibi-softcap"])
@pytest.mark.parametrize("ring", ["planned", "deeper"])  # the planner's tile's ring, or 3 slots (hd64) / 4 of 64 keys (hd128)
def test_look_ahead_walks(head_dim, case, ring):
    """The look-ahead tile (each item's first S issued before the epilogue of the item before; Q in two slots)
    over many items per CTA: against the float64 reference, and bitwise equal to the same persistent tile
    without it (the same products in the same order). Items whose rows see no key (causal with more queries
    than keys; a window) take a stand-in S, in runs of several; the CTA's last item takes one too."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import forward, plan

    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[head_dim], look_ahead=True)
    if ring == "deeper":
        tile = dataclasses.replace(tile, stages=3) if head_dim == 64 else dataclasses.replace(tile, block_n=64, stages=4)
    rng = np.random.default_rng(head_dim + len(case))
    causal, kw = False, {}
    if case == "dense":  # 3 x 16 x 8 query tiles = 384 items on 132 CTAs
        shape = (3, 1000, 1100, 16, 16)
    elif case == "one-key-tile":  # every item a single key tile: its S comes from the item before
        shape = (4, 1100, 100, 16, 16)
    elif case == "no-key-rows-causal":  # 13 of 16 query tiles per pair see no key
        shape, causal = (2, 2000, 300, 32, 8), True
    elif case == "no-key-rows-window":  # rows below 700 see no key, and each row sees 41 keys
        shape, kw = (2, 1600, 900, 24, 24), dict(window_size=(40, 0))
    elif case == "gqa-dropout":
        shape, causal, kw = (3, 1000, 1000, 16, 4), True, dict(dropout_p=0.1, rng_state=(1234, 8))
    else:
        shape, kw = (3, 700, 900, 16, 8), dict(softcap=5.0, alibi_slopes=cupy.asarray(
            rng.uniform(0.01, 0.3, 16).astype(np.float32)))
    q, k, v = random_qkv(rng, *shape, head_dim, "bf16")
    check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, what=f"look-ahead {case}", **kw)
    got = forward.run(q, k, v, causal=causal, tile=tile, return_lse=True, **kw)
    want = forward.run(q, k, v, causal=causal, tile=dataclasses.replace(tile, look_ahead=False), return_lse=True, **kw)
    for g, w in zip(got[:2], want[:2]):
        assert bool((g == w).all()), case


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 5])  # one pair per group; groups of 5 with a last one of 3 (48 pairs)
def test_persistent_walk_in_l2_groups(head_dim, causal, group, monkeypatch):
    """The persistent walk in groups of (head, batch) pairs (FwdParams.sched_group, sized by the L2; here
    a pretended L2 forces small groups, the last one partial): dense (GQA: a group's query heads share kv
    heads) and packed, the same outputs and lse as one CTA per tile."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import forward, jit, plan, varlen
    from cuflash.checks import BF16

    tile = plan.FWD_SM90_WS_SHORT_TILES[head_dim]
    rng = np.random.default_rng(group + head_dim)
    q, k, v = random_qkv(rng, 3, 600, 700, 16, 4, head_dim, "bf16")  # 5 x 16 x 3 = 240 tiles > 132 SMs
    per_pair = 4 * 700 * head_dim / 4  # K/V bytes per query head (4 share a kv head)
    l2 = int((group + 0.5) * per_pair / plan.PERSISTENT_L2_SHARE[causal])
    monkeypatch.setattr(jit, "device_l2_bytes", lambda device_id: l2)  # (reads l2 when called: set again below)
    forward._plan_and_load.cache_clear()  # (plans are memoized per call signature, not per L2 size)
    varlen._plan_and_load.cache_clear()
    try:
        got, lse = forward.run(q, k, v, causal=causal, return_lse=True, tile=tile)
        launched = forward._plan_and_load(3, 600, 700, 16, 4, head_dim, "bf16", causal, True, 0, tile, 0)[0]
        assert launched.sched_group == group
        per_tile = dataclasses.replace(tile, persistent=False)
        want, want_lse = forward.run(q, k, v, causal=causal, return_lse=True, tile=per_tile)
        np.testing.assert_allclose(to_f64(got), to_f64(want), atol=1e-2)
        np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)
        lengths = [0, 500, 3, 129, 0, 700, 64, 300]
        total = sum(lengths)
        q, k, v = (cupy.asarray(rng.standard_normal((total, 8, head_dim), dtype=np.float32).astype(BF16)) for _ in range(3))
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        # Packed: a pair is a head and the K/V bytes per head count every packed key: groups of 3 of the
        # 8 heads (the last of 2) with group 5's setting, of 1 with group 1's.
        heads_per_group = 3 if group > 1 else 1
        l2 = int((heads_per_group + 0.5) * 4 * total * head_dim / plan.PERSISTENT_L2_SHARE[causal])
        assert plan.persistent_group(8, total, head_dim, 1, l2, causal) == heads_per_group
        varlen._plan_and_load.cache_clear()
        got, lse = varlen.run(q, k, v, cu, cu, 700, 700, causal=causal, return_lse=True, tile=tile)
        want, want_lse = varlen.run(q, k, v, cu, cu, 700, 700, causal=causal, return_lse=True, tile=per_tile)
        np.testing.assert_allclose(to_f64(got), to_f64(want), atol=1e-2)
        np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)
    finally:
        forward._plan_and_load.cache_clear()
        varlen._plan_and_load.cache_clear()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [
    (3, 1000, 1000, 16, 4),   # 8 query tiles (even), 48 pairs: 192 units, one whole double round of 132 and 60 left
    (2, 1100, 1100, 8, 8),    # 9 tiles (odd): 64 units, fewer than the CTAs, then the 16 middle tiles
    (4, 2048, 2048, 32, 16),  # 16 tiles, 128 pairs: 1024 units, 7 whole double rounds and 100 left
    (2, 1500, 700, 8, 8),     # bottom-right causal with more queries than keys: 6 of 12 tiles per pair see no key
])  # fmt: skip
def test_paired_walk_takes_every_tile_once(head_dim, shape):
    """The persistent causal walk in heavy/light pairs (Sm90WsTile.paired: query tiles u and m - 1 - u of one
    (head, batch) pair back to back; what is left after the whole double rounds one tile per item, the middle
    tiles of an odd count last) computes every tile once: against the float64 reference, and bitwise equal
    to the strided walk (the same tile products in the same order, on other CTAs), outputs and lse."""
    _hopper()
    import dataclasses

    from cuflash import forward, plan

    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[head_dim], paired=True)  # (the planner's walk, whatever it is)
    assert tile.persistent
    q, k, v = random_qkv(np.random.default_rng(shape[1] + head_dim), *shape, head_dim, "bf16")
    if shape[1] < 2048:  # (the float64 reference on the smaller cases)
        check_forward(q, k, v, causal=True, dtype="bf16", tile=tile, what=f"paired walk {shape}")
    got = forward.run(q, k, v, causal=True, tile=tile, return_lse=True)
    want = forward.run(q, k, v, causal=True, tile=dataclasses.replace(tile, paired=False), return_lse=True)
    for g, w in zip(got, want):
        assert bool((g == w).all()), shape


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_walk_groups_paged_kv(head_dim, causal, monkeypatch):
    """Paged K/V: a head's walk reads every sequence's pages, so the L2 groups are sized from
    min(batch x block_table capacity, the cache's pages x page size) keys (not one sequence's capacity);
    here a pretended L2 makes groups of 3 of 8 heads, with the same outputs and lse as one CTA per tile."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import jit, plan, varlen
    from cuflash.checks import BF16

    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[head_dim], cluster=1)  # (packed batches: no clusters)
    per_tile = dataclasses.replace(tile, persistent=False)
    rng = np.random.default_rng(head_dim + causal)
    lengths, page, h = [0, 500, 3, 129, 0, 700, 64, 300], 128, 8
    pages_of = [-(-n // page) for n in lengths]
    q = cupy.asarray(rng.standard_normal((sum(lengths), h, head_dim), dtype=np.float32).astype(BF16))
    k_pages, v_pages = (cupy.asarray(rng.standard_normal((sum(pages_of), page, h, head_dim), dtype=np.float32).astype(BF16))
                        for _ in range(2))  # fmt: skip
    table = np.full((len(lengths), max(pages_of)), -1, np.int32)
    nxt = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = np.arange(nxt, nxt + n)
        nxt += n
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    walk_keys = min(len(lengths) * max(pages_of) * page, sum(pages_of) * page)  # 17 pages: 2176 < 8 x 768
    l2 = int(3.5 * 4 * walk_keys * head_dim / plan.PERSISTENT_L2_SHARE[causal])
    assert plan.persistent_group(h, walk_keys, head_dim, 1, l2, causal) == 3
    monkeypatch.setattr(jit, "device_l2_bytes", lambda device_id: l2)
    plan_and_load = varlen._plan_and_load
    launched = _spy_on_plans(monkeypatch, varlen)
    plan_and_load.cache_clear()
    try:
        got, lse = varlen.run(q, k_pages, v_pages, cu, cu, 700, 700, block_table=table, causal=causal,
                              return_lse=True, tile=tile)  # fmt: skip
        assert launched[-1].spec.tile == tile and launched[-1].sched_group == 3
        want, want_lse = varlen.run(q, k_pages, v_pages, cu, cu, 700, 700, block_table=table, causal=causal,
                                    return_lse=True, tile=per_tile)  # fmt: skip
        np.testing.assert_allclose(to_f64(got), to_f64(want), atol=1e-2)
        np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)
    finally:
        plan_and_load.cache_clear()


@pytest.mark.parametrize("head_dim", [40, 56, 104, 120, 232, 248])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_partial_last_box(head_dim, dtype):
    """Head dims below their bucket: the last 64-column box reaches past the tensor (zeros there)."""
    _hopper()
    from cuflash import plan

    assert plan.plan_forward(batch=1, seqlen_q=1, seqlen_k=1, nheads=1, nheads_kv=1, head_dim=head_dim, dtype=dtype,
                             causal=False, aligned=True, arch="sm_90a").spec.family == "flash_fwd_sm90_ws"  # fmt: skip
    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(rng, 2, 257, 300, 4, 2, head_dim, dtype)
    for causal in (False, True):
        check_forward(q, k, v, causal=causal, dtype=dtype, what=f"hd{head_dim} causal={causal}")


@pytest.mark.parametrize("head_dim,block_n", [(256, 80), (232, 80), (128, 176), (64, 112)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_key_tiles_of_16_multiples(head_dim, block_n, dtype):
    """Key tiles that are a multiple of 16 but not of 64 (wgmma N 80 .. 176; the swizzle atoms of a
    K/V slot then hold 80 or 176 rows): ragged keys, causal, a window and softcap against the reference."""
    _hopper()
    from cuflash.plan import Sm90WsTile

    tile = Sm90WsTile(128, block_n, pingpong=False)
    rng = np.random.default_rng(block_n)
    q, k, v = random_qkv(rng, 2, 300, 411, 4, 2, head_dim, dtype)
    for kw in ({"causal": False}, {"causal": True}, {"causal": False, "window_size": (150, 40)}, {"causal": True, "softcap": 20.0}):
        check_forward(q, k, v, dtype=dtype, tile=tile, what=f"hd{head_dim} bn{block_n} {kw}", **kw)


@pytest.mark.parametrize("head_dim,persistent,tma_store", [(64, False, True), (120, False, True), (256, False, True),
                                                            (128, False, False), (64, True, True), (128, True, True),
                                                            (128, True, False)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_output_store_stays_in_its_view(head_dim, persistent, tma_store, causal):
    """O leaves the TMA kernel by one TMA store per consumer warp (16 rows x 64 columns per box) or by
    16-byte stores: into a strided view of a larger NaN buffer (padding rows, heads and columns; head
    dim 120: the last box reaches past the columns) the result is the reference's and every element
    outside the view stays NaN, also for the warps of the last query tile that hold no row or a part of
    one (300 rows)."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import forward, plan, reference
    from cuflash.checks import DTYPE_NAMES

    bucket = plan.head_dim_bucket(head_dim)
    tile = dataclasses.replace(plan.FWD_SM90_WS_TILES[bucket], persistent=persistent, tma_store=tma_store)
    rng = np.random.default_rng(head_dim + persistent)
    q, k, v = random_qkv(rng, 2, 300, 333, 4, 2, head_dim, "bf16")
    buf = cupy.empty((2, 307, 5, bucket + 8), dtype=q.dtype)
    buf.view(cupy.uint16).fill(NAN_BITS)
    view = buf[:, :300, :4, :head_dim]
    forward.run(q, k, v, causal=causal, out=view, tile=tile)
    ref, _ = reference.attention_forward(q, k, v, causal=causal)
    plain = reference.plain_attention_bar(q, k, v, ref, causal=causal, dtype=q.dtype)
    assert reference.within_tolerance(to_f64(view), ref, plain), f"{tile} ({DTYPE_NAMES[q.dtype]})"
    outside = np.ones(buf.shape, dtype=bool)
    outside[:, :300, :4, :head_dim] = False
    assert (buf.view(cupy.uint16).get()[outside] == NAN_BITS).all(), f"{tile} wrote outside its output view"


def test_output_without_a_tensor_map_falls_back():
    """An output whose rows run backwards (a negative stride: 16-byte aligned rows, but no tensor map
    describes it) takes the cp.async Hopper kernel, with the same result; forcing the TMA tile raises."""
    _hopper()
    import cupy

    from cuflash import forward, plan, reference, tma

    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 200, 256, 4, 4, 128, "bf16")
    out = cupy.empty_like(q)[:, ::-1]
    forward.run(q, k, v, causal=True, out=out)
    ref, _ = reference.attention_forward(q, k, v, causal=True)
    plain = reference.plain_attention_bar(q, k, v, ref, causal=True, dtype=q.dtype)
    assert reference.within_tolerance(to_f64(out), ref, plain)
    with pytest.raises(tma.TensorMapError):
        forward.run(q, k, v, causal=True, out=out, tile=plan.FWD_SM90_WS_TILES[128])
    # a tile that writes O with 16-byte stores needs no output map: the backwards rows are fine for it
    out2 = cupy.empty_like(q)[:, ::-1]
    forward.run(q, k, v, causal=True, out=out2, tile=plan.FWD_SM90_WS_SHORT_TILES[128])
    assert reference.within_tolerance(to_f64(out2), ref, plain)


@pytest.mark.parametrize("tma_store", [False, True])
def test_persistent_output_over_more_tiles_than_sms(tma_store):
    """A persistent CTA walks several work items: each item's O (16-byte stores, or TMA stores that must
    have read the staged rows before the next item restages them) lands in a strided view of a NaN
    buffer, and nothing outside the view is written, with more items than SMs (8 x 8 heads x 5 tiles)."""
    _hopper()
    import dataclasses

    import cupy

    from cuflash import forward, jit, plan, reference

    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[128], tma_store=tma_store)
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 8, 600, 600, 8, 2, 128, "bf16")
    assert 8 * 8 * -(-600 // tile.block_m) > jit.device_sm_count(0)
    buf = cupy.empty((8, 611, 9, 136), dtype=q.dtype)
    buf.view(cupy.uint16).fill(NAN_BITS)
    view = buf[:, 5:605, :8, :128]
    for causal in (False, True):
        forward.run(q, k, v, causal=causal, out=view, tile=tile)
        ref, _ = reference.attention_forward(q, k, v, causal=causal)
        plain = reference.plain_attention_bar(q, k, v, ref, causal=causal, dtype=q.dtype)
        assert reference.within_tolerance(to_f64(view), ref, plain), (tile, causal)
        outside = np.ones(buf.shape, dtype=bool)
        outside[:, 5:605, :8, :128] = False
        assert (buf.view(cupy.uint16).get()[outside] == NAN_BITS).all(), f"{tile} wrote outside its output view"


@pytest.mark.parametrize("d", [128, 256])  # (256: 80-key tiles, 64 on pages)
def test_varlen_nan_after_the_keys_stays_out(d):
    """Rows past each sequence's used keys (seqused_k tails, the rows after the last sequence, the unused
    slots of a last page) hold NaN: the TMA kernel reads them with the sequence's last key tile and
    must give exactly what the cp.async kernel (which zero-fills them) gives, with no NaN."""
    _hopper()
    import cupy

    from cuflash import plan, varlen
    from cuflash.checks import BF16

    h = 2
    lengths = PACKED_LENGTHS
    (q, k0, v0), cu, used, _, gaps = packed_with_gaps(np.random.default_rng(7), d, (h, h, h))
    k, v = k0.copy(), v0.copy()
    for x in (k, v):
        for rows in gaps:  # sequence 0's unused keys, sequence 1's, past the last sequence
            poison_rows(x, rows)
    old = plan.FWD_SM90_TILES[d]
    for kw in (dict(causal=False), dict(causal=True), dict(causal=False, window_size=(64, 64))):
        got = varlen.run(q, k, v, cu, cu, 300, 300, seqused_k=used, **kw)
        want = varlen.run(q, k, v, cu, cu, 300, 300, seqused_k=used, tile=old, **kw)
        rows = slice(0, sum(lengths))
        assert not np.isnan(to_f64(got[rows])).any(), kw
        np.testing.assert_allclose(to_f64(got[rows]), to_f64(want[rows]), atol=2e-2, err_msg=str(kw))
    # paged: the unwritten slots of each sequence's last page are NaN
    page = 128
    k_pages = cupy.full((8, page, h, d), 0, dtype=BF16)
    k_pages.view("uint16")[...] = NAN_BITS
    v_pages = k_pages.copy()
    table = np.full((3, 3), -1, np.int32)
    start, nxt = np.concatenate([[0], np.cumsum(lengths)]), 0
    for b, n in enumerate(lengths):
        for j in range(-(-n // page)):
            table[b, j] = nxt
            cnt = min(page, n - j * page)
            k_pages[nxt, :cnt] = k0[start[b] + j * page: start[b] + j * page + cnt]
            v_pages[nxt, :cnt] = v0[start[b] + j * page: start[b] + j * page + cnt]
            nxt += 1
    got = varlen.run(q, k_pages, v_pages, cu, cu, 300, 300, block_table=table, causal=True)
    want = varlen.run(q, k0, v0, cu, cu, 300, 300, causal=True, tile=old)
    rows = slice(0, sum(lengths))
    assert not np.isnan(to_f64(got[rows])).any()
    np.testing.assert_allclose(to_f64(got[rows]), to_f64(want[rows]), atol=2e-2)


def test_forced_tile_never_falls_back():
    """A caller that forces the TMA kernel gets it or an error, never another kernel: broadcast
    (stride-0) inputs cannot be described by a tensor map."""
    _hopper()
    import cupy

    from cuflash import forward, plan, tma
    from cuflash.checks import BF16

    q = cupy.asarray(np.ones((1, 64, 2, 64), dtype=BF16))
    k = cupy.broadcast_to(cupy.asarray(np.ones((1, 1, 2, 64), dtype=BF16)), (1, 64, 2, 64))
    with pytest.raises(tma.TensorMapError):
        forward.run(q, k, k, tile=plan.FWD_SM90_WS_TILES[64])
    out = forward.run(q, k, k)  # the planner's choice falls back to the cp.async kernel
    assert float(cupy.abs(out.astype(cupy.float32) - 1).max()) == 0
