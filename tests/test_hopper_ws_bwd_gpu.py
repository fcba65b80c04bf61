"""GPU tests of what is particular to the warp-specialized TMA backward (cuda_src/flash_bwd_sm90_ws.cuh):
ring depths around the walk's length (1 query block, exactly the ring, one past it, many), GQA walks
over several heads, head dims whose last 64-column box sticks out of the tensor, CTAs whose key block
no query sees (a window), strided inputs, the fallback where no tensor map describes an input,
agreement with the cp.async Hopper kernel on the same data, and packed (varlen) batches whose tiles
stick out into rows of NaN.
Skipped without a GPU; these need sm_90a."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_util import check_backward, packed_with_gaps, poison_rows, random_qkv, to_f64

pytestmark = pytest.mark.gpu


def _hopper():
    from cuflash import jit

    if jit.device_arch(0) != "sm_90a":
        pytest.skip("the TMA kernel runs on sm_90a only")


@pytest.mark.parametrize("head_dim,stages", [(128, 2), (128, 3), (64, 2), (64, 3), (64, 4), (256, 2)])  # (4 at hd128, 3 at 256: too much smem)
@pytest.mark.parametrize("sq", [1, 64, 128, 192, 700])  # query blocks per head: 1, 1, 2, 3, 11
@pytest.mark.parametrize("causal", [False, True])
def test_ring_depths(head_dim, stages, sq, causal):
    """Each ring depth with walks of 1, stages, stages + 1 and many query blocks, GQA (2 query heads per
    kv head: the walk crosses heads), against the float64 reference."""
    _hopper()
    from cuflash.plan import BwdSm90WsTile

    rng = np.random.default_rng(sq + stages)
    q, k, v = random_qkv(rng, 2, sq, 300, 4, 2, head_dim, "bf16")
    tile = BwdSm90WsTile(block_n=64 if head_dim == 256 else 128, stages=stages)
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, what=f"{tile} sq={sq}")


@pytest.mark.parametrize("head_dim", [40, 48, 64, 104, 120, 128, 240, 248])  # buckets 64, 128 and 256
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_head_dims_inside_a_box(head_dim, dtype):
    """Head dims below the bucket: the last 64-column box sticks out of the tensor (TMA fills zeros)."""
    _hopper()
    from cuflash import plan

    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(rng, 1, 333, 257, 2, 1, head_dim, dtype)
    tile = plan.BWD_SM90_WS_TILES[plan.head_dim_bucket(head_dim)]
    check_backward(q, k, v, causal=True, dtype=dtype, tile=tile, rng=rng, what=f"hd{head_dim}")


def test_key_blocks_no_query_sees():
    """A window that leaves whole key blocks unseen: those CTAs load nothing and write dK = dV = 0."""
    _hopper()
    from cuflash import plan

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 100, 900, 2, 2, 64, "bf16")  # queries see keys 800 + i - 50 .. 800 + i
    check_backward(q, k, v, causal=True, dtype="bf16", tile=plan.BWD_SM90_WS_TILES[64], rng=rng,
                   window_size=(50, 0), what="window leaves key blocks unseen")  # fmt: skip


def _persistent(head_dim, stages=None):
    import dataclasses

    from cuflash import plan

    tile = dataclasses.replace(plan.BWD_SM90_WS_TILES[head_dim], persistent=True)
    return dataclasses.replace(tile, stages=stages) if stages else tile


@pytest.mark.parametrize("head_dim,stages", [(64, None), (64, 2), (128, None), (128, 3)])
@pytest.mark.parametrize("sq", [50, 300])  # a walk of 1 query block (shorter than the ring), and of 5
@pytest.mark.parametrize("causal", [False, True])  # (causal, bottom-right: every key block is seen, the walks shorten)
def test_persistent_walks_many_items(head_dim, stages, sq, causal):
    """The persistent backward with more items (key blocks x kv heads x sequences) than SMs, so CTAs walk
    2 or more (the later ones from the counter): 16 key blocks (the last ragged) x 4 kv heads x 3 = 192, GQA;
    the next item's first query blocks and K, V load while this one finishes. Deterministic mode refuses the persistent tile
    (its turns would wait across CTAs) and the planner gives it the per-key-block launch."""
    _hopper()
    from cuflash import backward

    tile = _persistent(head_dim, stages)
    rng = np.random.default_rng(sq + head_dim)
    q, k, v = random_qkv(rng, 3, sq, 2000, 8, 4, head_dim, "bf16")
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, what=f"{tile} sq={sq} causal={causal}")
    import cuflash

    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="deterministic=True runs the per-key-block backward"):
        backward.run(out, q, k, v, out, lse, deterministic=True, tile=tile)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_causal_counter(head_dim):
    """Causal, 4 key blocks of 128 per sequence x 4 kv heads x 9 = 144 items on 132 CTAs: the last 12 items go
    to whichever CTAs take them from the counter first; a second call on the same inputs gives the same dK
    and dV bit for bit (each item is one CTA's; the preprocess zeroed the counter again, else the second
    call's CTAs would skip the counter's items); and a grid of fewer CTAs than SMs (one sequence: 16 items,
    none from the counter), fp16."""
    _hopper()
    import cupy

    import cuflash
    from cuflash import backward

    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(rng, 9, 512, 512, 8, 4, head_dim, "bf16")
    check_backward(q, k, v, causal=True, dtype="bf16", tile=_persistent(head_dim), rng=rng, what="causal, counter")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.asarray(rng.standard_normal(out.shape), dtype=out.dtype)
    first = backward.run(dout, q, k, v, out, lse, causal=True, tile=_persistent(head_dim))
    again = backward.run(dout, q, k, v, out, lse, causal=True, tile=_persistent(head_dim))
    for name, a, b in zip(("dk", "dv"), first[1:], again[1:]):
        assert bool(cupy.all(a.view(cupy.uint16) == b.view(cupy.uint16))), f"{name} differs between two calls"
    q, k, v = random_qkv(rng, 1, 500, 512, 8, 4, head_dim, "fp16")
    check_backward(q, k, v, causal=True, dtype="fp16", tile=_persistent(head_dim), rng=rng, what="causal, 16 items")


def test_persistent_items_no_query_sees_and_variants():
    """Persistent CTAs whose items mix key blocks no query sees (a window: nothing loaded, dK = dV = 0) with
    seen ones, so the K / V and ring phases skip items; and the score variants (softcap, ALiBi, dropout: its
    keep bits by sequence and head) on items walked by one CTA after another."""
    _hopper()
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 100, 3000, 4, 4, 64, "bf16")  # 24 key blocks x 4 x 2 = 192 items
    check_backward(q, k, v, causal=False, dtype="bf16", tile=_persistent(64), rng=rng, window_size=(50, 0),
                   what="window leaves key blocks unseen")  # fmt: skip
    q, k, v = random_qkv(rng, 3, 200, 1500, 8, 4, 128, "bf16")  # 12 x 4 x 3 = 144 items
    import cupy

    slopes = cupy.asarray(rng.uniform(0.01, 0.1, size=(3, 8)).astype(np.float32))  # (per sequence and head)
    check_backward(q, k, v, causal=False, dtype="bf16", tile=_persistent(128), rng=rng, softcap=20.0,
                   alibi_slopes=slopes, what="softcap + ALiBi")  # fmt: skip
    check_backward(q, k, v, causal=False, dtype="bf16", tile=_persistent(128), rng=rng, dropout_p=0.1,
                   what="dropout")  # fmt: skip


def test_strided_inputs():
    """q, k, v and dout as slices of wider tensors (row strides of several heads' width)."""
    _hopper()
    import cupy

    from cuflash import plan
    from cuflash.checks import BF16

    rng = np.random.default_rng(7)
    big = cupy.asarray(rng.standard_normal((2, 400, 6, 128), dtype=np.float32).astype(BF16))
    q, k, v = big[:, :, 0:2], big[:, :, 2:3], big[:, :, 4:5]
    check_backward(q, k, v, causal=False, dtype="bf16", tile=plan.BWD_SM90_WS_TILES[128], rng=rng, what="strided")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_agrees_with_the_cp_async_kernel(head_dim):
    """The TMA kernel and the cp.async Hopper kernel compute the same sums (at head dim 128 in the same
    order per element; at 256 from P and dS in bf16 both): their gradients agree to rounding of the
    final bf16 (dQ's atomic order aside)."""
    _hopper()
    import cupy

    import cuflash
    from cuflash import backward, plan

    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 1000, 1000, 4, 2, head_dim, "bf16")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    a = backward.run(dout, q, k, v, out, lse, causal=True, tile=plan.BWD_SM90_WS_TILES[head_dim])
    b = backward.run(dout, q, k, v, out, lse, causal=True, tile=plan.BWD_SM90_TILES[head_dim])
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        x, y = to_f64(x), to_f64(y)
        scale = np.abs(y).max()
        assert np.abs(x - y).max() <= 2e-2 * scale, name  # a few bf16 ulps of the largest value


def test_default_is_the_tma_kernel_and_falls_back(monkeypatch):
    """The planner's choice for aligned plain batches at head dims 64 / 128 is the TMA kernel; a
    broadcast (stride-0) input no tensor map can describe runs the cp.async kernel instead, and a
    caller that forces the TMA kernel gets the error."""
    _hopper()
    import cupy

    import cuflash
    from cuflash import backward, plan, tma
    from cuflash.checks import BF16

    planned, plan_and_load = [], backward._plan_and_load

    def spy(*args):  # the main kernel of every plan the calls below take, in order
        bp, fns = plan_and_load(*args)
        planned.append(bp.main.spec.family)
        return bp, fns

    monkeypatch.setattr(backward, "_plan_and_load", spy)

    assert plan.plan_backward(batch=1, seqlen_q=64, seqlen_k=64, nheads=2, nheads_kv=2, head_dim=64, dtype="bf16",
                              causal=False, aligned=True, arch="sm_90a").main.spec.family == "flash_bwd_sm90_ws"
    rng = np.random.default_rng(3)
    q = cupy.asarray(rng.standard_normal((1, 64, 2, 64), dtype=np.float32).astype(BF16))
    k = cupy.broadcast_to(cupy.asarray(rng.standard_normal((1, 1, 2, 64), dtype=np.float32).astype(BF16)), (1, 64, 2, 64))
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    with pytest.raises(tma.TensorMapError):
        backward.run(dout, q, k, k, out, lse, tile=plan.BWD_SM90_WS_TILES[64])
    del planned[:]
    dq, dk, dv = cuflash.attention_backward(dout, q, k, k, out, lse)  # the cp.async kernel
    assert planned == ["flash_bwd_sm90_ws", "flash_bwd_sm90"]  # the TMA plan, then its fallback
    want = backward.run(dout, q, k, k, out, lse, tile=plan.BWD_SM90_TILES[64])
    for got, ref in zip((dq, dk, dv), want):
        assert not np.isnan(to_f64(got)).any()
        np.testing.assert_allclose(to_f64(got), to_f64(ref), atol=2e-2, rtol=2e-2)
    # deterministic mode falls back to the mma.sync kernel (the cp.async one has no ordered dQ additions)
    del planned[:]
    a = cuflash.attention_backward(dout, q, k, k, out, lse, deterministic=True)
    assert planned == ["flash_bwd_sm90_ws", "flash_bwd"]
    b = cuflash.attention_backward(dout, q, k, k, out, lse, deterministic=True)
    for x, y, ref in zip(a, b, want):
        assert bool((x.view(cupy.uint16) == y.view(cupy.uint16)).all())
        np.testing.assert_allclose(to_f64(x), to_f64(ref), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_nan_past_the_sequences_stays_out(head_dim, causal):
    """Packed batches: a sequence's last key tile brings the rows after its used keys (seqused_k gaps,
    rows after the last sequence), its last query tile the rows after its queries (here NaN in q, dout
    and out after the last sequence). The TMA kernel zeroes them in shared memory and must give what
    the cp.async kernel (which zero-fills them) gives, with no NaN; GQA, 3 sequences."""
    _hopper()
    from cuflash import plan, varlen

    (q, k, v, dout), cu, used, n, gaps = packed_with_gaps(np.random.default_rng(head_dim + causal), head_dim, (4, 2, 2, 4))
    for x in (k, v):
        for rows in gaps:  # sequence 0's and 1's unused keys, the tail
            poison_rows(x, rows)
    for x in (q, dout):
        poison_rows(x, gaps[-1])
    out, lse = varlen.run(q, k, v, cu, cu, 300, 300, seqused_k=used, causal=causal, return_lse=True)
    poison_rows(out, gaps[-1])
    kw = dict(seqused_k=used, causal=causal)
    got = varlen.run_backward(dout, q, k, v, out, lse, cu, cu, 300, 300, tile=plan.BWD_SM90_WS_TILES[head_dim], **kw)
    want = varlen.run_backward(dout, q, k, v, out, lse, cu, cu, 300, 300, tile=plan.BWD_SM90_TILES[head_dim], **kw)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        x, y = to_f64(x[:n]), to_f64(y[:n])
        assert not np.isnan(x).any(), name
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max(), name


def _wide(head_dim, stages=None, persistent=False):
    """The wide query blocks: 128 rows at head dim 64 (3 stages unless given), 80 at 128 (dQ^T; 2 stages)."""
    from cuflash.plan import BWD_SM90_WS_WIDE_ROWS, BwdSm90WsTile

    rows = BWD_SM90_WS_WIDE_ROWS[head_dim]
    return BwdSm90WsTile(block_m=rows, stages=stages or (3 if rows == 128 else 2), persistent=persistent)


@pytest.mark.parametrize("head_dim,stages", [(64, 2), (64, 3), (128, 2)])
@pytest.mark.parametrize("sq", [1, 80, 129, 300, 700])  # 128-row blocks per head: 1, 1, 2, 3, 6; 80-row: 1, 1, 2, 4, 9
@pytest.mark.parametrize("causal", [False, True])
def test_wide_query_blocks(head_dim, stages, sq, causal):
    """Head dim 64's 128-row query blocks (each consumer warpgroup's dQ part is its own 64 rows, dS^T two
    64-query atoms, P^T packed after dS^T) and head dim 128's 80-row ones (dQ^T, converted by the transposed
    convert kernel): walks of 1 block to more than the ring, ragged last blocks, GQA (the walk crosses heads),
    bf16 and fp16, against the float64 reference."""
    _hopper()
    rng = np.random.default_rng(sq + 10 * stages + head_dim)
    tile = _wide(head_dim, stages)
    for dtype in ("bf16", "fp16"):
        q, k, v = random_qkv(rng, 2, sq, 300, 4, 2, head_dim, dtype)
        check_backward(q, k, v, causal=causal, dtype=dtype, tile=tile, rng=rng, what=f"{tile} {dtype} sq={sq}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_wide_query_blocks_variants_and_deterministic(head_dim, causal):
    """The wide blocks with a window (key blocks no query sees among them), ALiBi and, at 128 rows, dropout
    (dV's P^T dropped from dS^T's P^T; refused at 80 rows), head dims below the bucket (a box sticking out of
    the tensor); softcap is refused (its dS^T P^T differs from dV's); deterministic mode bitwise over 20 runs;
    the persistent grid over more items than SMs."""
    _hopper()
    import cupy

    import cuflash
    from cuflash import backward

    rng = np.random.default_rng(128 + causal + head_dim)
    tile = _wide(head_dim)
    q, k, v = random_qkv(rng, 2, 500, 900, 4, 2, head_dim, "bf16")
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, window_size=(100, 20), what="window")
    slopes = cupy.asarray(rng.uniform(0.01, 0.1, size=(2, 4)).astype(np.float32))
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, alibi_slopes=slopes, what="ALiBi")
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    if head_dim == 64:
        check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, dropout_p=0.15, what="dropout")
    else:
        o_d, lse_d, state = cuflash.attention(q, k, v, causal=causal, dropout_p=0.1, return_lse=True)
        with pytest.raises(ValueError, match="dropout calls run 64-row blocks"):
            backward.run(o_d, q, k, v, o_d, lse_d, causal=causal, dropout_p=0.1, rng_state=state, tile=tile)
    small = head_dim - 24  # 40 / 104
    qs, ks, vs = random_qkv(rng, 1, 333, 257, 2, 1, small, "fp16")
    check_backward(qs, ks, vs, causal=causal, dtype="fp16", tile=tile, rng=rng, what=f"hd{small}")
    with pytest.raises(ValueError, match="softcap calls run 64-row blocks"):
        backward.run(out, q, k, v, out, lse, causal=causal, softcap=20.0, tile=tile)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    first = [x.copy() for x in backward.run(dout, q, k, v, out, lse, causal=causal, deterministic=True, tile=tile)]
    for run in range(20):
        again = backward.run(dout, q, k, v, out, lse, causal=causal, deterministic=True, tile=tile)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} differs on run {run + 1}"
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, rng=rng, deterministic=True, what="deterministic")
    q, k, v = random_qkv(rng, 3, 300, 2000, 8, 4, head_dim, "bf16")  # 16 key blocks x 4 kv heads x 3 = 192 items
    check_backward(q, k, v, causal=causal, dtype="bf16", tile=_wide(head_dim, 2, persistent=True), rng=rng,
                   what="persistent")  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128])
def test_wide_query_blocks_agree_with_64(head_dim):
    """Wide and 64-row query blocks sum the same products (dV and dK over a block's queries in other
    groupings; dQ^T at 80 rows): their gradients agree to a few bf16 ulps of the largest value; and packed
    batches whose tiles stick out into NaN rows give what the 64-row kernel gives."""
    _hopper()
    import cupy

    import cuflash
    from cuflash import backward, plan, varlen

    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(rng, 2, 1000, 1000, 4, 2, head_dim, "bf16")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    a = backward.run(dout, q, k, v, out, lse, causal=True, tile=_wide(head_dim))
    narrow = dataclasses.replace(plan.BWD_SM90_WS_TILES[head_dim], block_m=64)  # (hd64 plans the wide blocks)
    b = backward.run(dout, q, k, v, out, lse, causal=True, tile=narrow)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        x, y = to_f64(x), to_f64(y)
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max(), name
    (q, k, v, dout), cu, _, n, gaps = packed_with_gaps(rng, head_dim, (4, 2, 2, 4))  # (no seqused_k here)
    for x in (q, k, v, dout):
        poison_rows(x, gaps[-1])
    for causal in (False, True):
        out, lse = varlen.run(q, k, v, cu, cu, 300, 300, causal=causal, return_lse=True)
        poison_rows(out, gaps[-1])
        got = varlen.run_backward(dout, q, k, v, out, lse, cu, cu, 300, 300, causal=causal, tile=_wide(head_dim))
        want = varlen.run_backward(dout, q, k, v, out, lse, cu, cu, 300, 300, causal=causal,
                                   tile=narrow)  # fmt: skip
        for name, x, y in zip(("dq", "dk", "dv"), got, want):
            x, y = to_f64(x[:n]), to_f64(y[:n])
            assert not np.isnan(x).any(), name
            assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max(), name
