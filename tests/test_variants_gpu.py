"""GPU tests of the attention variants (sliding window, softcap, ALiBi, dropout) on every kernel family:
the mma.sync and (on Hopper) wgmma forward and backward, and decode, against the float64 reference
(cuflash.reference) with DESIGN.md's rules (outputs and lse 2x, gradients 3x the plain low-precision
error). Dropout is also checked element by element against the reference's Philox mask."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_util import DTYPES, check_backward, check_forward, check_lse, random_qkv, to_f64

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))


def _arch():
    from cuflash import jit

    return jit.device_arch(0)


def _slopes(rng, batch, nheads, per_batch: bool):
    """ALiBi slopes as models use them (2^(-8 i / n)), jittered, float32 on the device."""
    import cupy

    base = 2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads)
    shape = (batch, nheads) if per_batch else (nheads,)
    return cupy.asarray((base * rng.uniform(0.5, 1.5, size=shape)).astype(np.float32))


def _variants(rng, case):
    v = dict(window_size=case["window"], softcap=case["softcap"], dropout_p=case["dropout_p"], diag_shift=case["shift"])
    if case["alibi"] is not None:
        v["alibi_slopes"] = _slopes(rng, case["batch"], case["nheads"], case["alibi"] == "batch")
    return v


@st.composite
def variant_cases(draw):
    dtype = draw(st.sampled_from(["bf16", "fp16"]))
    head_dim = draw(st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 256)))
    nheads_kv = draw(st.integers(1, 2))
    nheads = nheads_kv * draw(st.sampled_from([1, 2, 4]))
    seqlen_q = draw(st.integers(1, 400))
    seqlen_k = draw(st.integers(1, 400))
    left = draw(st.one_of(st.just(-1), st.integers(0, seqlen_k + 8)))
    right = draw(st.one_of(st.just(-1), st.integers(0, seqlen_q + 8)))
    case = dict(
        dtype=dtype, head_dim=head_dim, nheads=nheads, nheads_kv=nheads_kv, batch=draw(st.integers(1, 2)),
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=draw(st.booleans()), window=(left, right),
        shift=draw(st.one_of(st.just(0), st.just(0), st.integers(-seqlen_q - 8, seqlen_k + 8))),
        softcap=draw(st.one_of(st.just(0.0), st.floats(1.0, 50.0))),
        alibi=draw(st.sampled_from([None, "heads", "batch"])),
        dropout_p=draw(st.one_of(st.just(0.0), st.floats(0.05, 0.6))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        layout=draw(st.sampled_from(["bshd", "bhsd"])),
        kernel=draw(st.sampled_from(["plan", "mma.sync"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip
    if case["window"] == (-1, -1) and not case["softcap"] and case["alibi"] is None and not case["dropout_p"]:
        case["softcap"] = 30.0  # every case runs at least one variant
    return case


def _inputs(case):
    rng = np.random.default_rng(case["seed"])
    q, k, v = random_qkv(rng, case["batch"], case["seqlen_q"], case["seqlen_k"], case["nheads"], case["nheads_kv"],
                         case["head_dim"], case["dtype"], layout_q=case["layout"], layout_kv=case["layout"])  # fmt: skip
    return rng, q, k, v


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=variant_cases())
def test_forward_variants_property(case):
    """Every variant drawn together with causal, GQA/MQA, ragged lengths, sq != sk, any head dim, both
    dtypes, strided inputs; the planner's kernel (wgmma on Hopper where it applies) or the mma.sync one."""
    from cuflash import plan

    rng, q, k, v = _inputs(case)
    tile = plan.fwd_tile(plan.head_dim_bucket(case["head_dim"]), _arch()) if case["kernel"] == "mma.sync" else None
    check_forward(q, k, v, causal=case["causal"], softmax_scale=case["scale"], dtype=case["dtype"], tile=tile,
                  what=str(case), **_variants(rng, case))  # fmt: skip


@settings(max_examples=max(EXAMPLES * 2 // 3, 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=variant_cases())
def test_backward_variants_property(case):
    """The gradients of the same cases (3x rule), the Hopper backward or the mma.sync one."""
    from cuflash import plan

    rng, q, k, v = _inputs(case)
    tile = plan.bwd_tile(plan.head_dim_bucket(case["head_dim"]), _arch()) if case["kernel"] == "mma.sync" else None
    check_backward(q, k, v, causal=case["causal"], softmax_scale=case["scale"], dtype=case["dtype"], tile=tile,
                   rng=rng, what=str(case), **_variants(rng, case))  # fmt: skip


def _kernels(head_dim, op, dropout=False, softcap=False):
    """The tiles to force for op "fwd" or "bwd": the mma.sync kernel's, and on Hopper the wgmma ones'
    where they exist (the cp.async and the warp-specialized TMA kernels; with ``dropout`` the forward's
    as the planner takes it: its own tile at head dims 64 and 128, key tiles of a multiple of 32,
    plan.ws_default_tile)."""
    from cuflash import plan

    arch = _arch()
    tile_of, hopper = (plan.fwd_tile, plan.FWD_SM90_TILES) if op == "fwd" else (plan.bwd_tile, plan.BWD_SM90_TILES)
    tiles = [tile_of(plan.head_dim_bucket(head_dim), arch)]
    if arch == "sm_90a" and head_dim in hopper:
        tiles.append(hopper[head_dim])
    if arch == "sm_90a" and op == "fwd" and head_dim in plan.FWD_SM90_WS_TILES:  # the warp-specialized one too
        mods = plan.MOD_DROPOUT if dropout else 0
        tiles.append(plan.ws_default_tile(head_dim, mods))
    if arch == "sm_90a" and op == "bwd" and head_dim in plan.BWD_SM90_WS_TILES:
        ws = plan.BWD_SM90_WS_TILES[head_dim]
        tiles.append(dataclasses.replace(ws, block_m=64))  # (head dim 64's softcap calls run 64 rows)
        if ws.block_m != 64 and not softcap:  # the planned wide query blocks (refused with softcap)
            tiles.append(ws)
    return tiles


def _forward_kernels(head_dim, dropout=False):
    return _kernels(head_dim, "fwd", dropout)


def _backward_kernels(head_dim, softcap=False):
    return _kernels(head_dim, "bwd", softcap=softcap)


@pytest.mark.parametrize("sq,sk,window,causal", [
    (300, 100, (0, 0), False),      # rows i < 200 have d < 0: no key at all (out 0, lse -inf)
    (100, 300, (10, 0), False),     # a narrow band
    (257, 257, (5000, 5000), False),  # wider than the sequence: plain attention
    (257, 300, (64, -1), True),     # window + causal
    (300, 257, (-1, 0), False),     # (-1, 0) is causal
    (1, 700, (63, 0), False),       # one query: decode-like
    (700, 1, (0, -1), False),
    (513, 1025, (200, 17), False),
])  # fmt: skip
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_window_edges_on_every_kernel(sq, sk, window, causal, head_dim):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 1, head_dim, "bf16")
    for tile in _forward_kernels(head_dim):
        check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, window_size=window, what=f"{tile}")
    for tile in _backward_kernels(head_dim):
        check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, window_size=window, what=f"{tile}")


@pytest.mark.parametrize("sq,sk,shift,window,causal,alibi", [
    (256, 256, -256, (-1, -1), True, False),   # every key after every query: no row sees a key
    (256, 256, 256, (-1, -1), True, True),     # every key before: ALiBi's distances shifted, nothing masked
    (200, 300, 77, (-1, -1), True, True),      # a shifted causal diagonal (the window kernels) with ALiBi
    (300, 200, -50, (40, 10), False, False),   # a shifted band
    (257, 257, 130, (100, 0), True, True),     # a ring's chunk pair: window + causal + ALiBi
    (128, 384, -128, (-1, -1), False, True),   # ALiBi alone, not causal
])  # fmt: skip
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_shifted_diagonal_on_every_kernel(sq, sk, shift, window, causal, alibi, head_dim):
    """diag_shift (ring attention's chunk pairs): the causal mask, the window and ALiBi aligned to
    i + seqlen_k - seqlen_q + diag_shift, on every forward and backward kernel, against the reference."""
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, head_dim, "bf16")
    variants = dict(window_size=window, diag_shift=shift)
    if alibi:
        variants["alibi_slopes"] = _slopes(rng, 2, 4, False)
    for tile in _forward_kernels(head_dim):
        check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, what=f"{tile}", **variants)
    for tile in _backward_kernels(head_dim):
        check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, what=f"{tile}", **variants)
    for det in (False, True):  # the deterministic backward's dQ turns follow the shifted window too
        check_backward(q, k, v, causal=causal, dtype="bf16", deterministic=det, what=f"det={det}", **variants)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 160])
def test_softcap_alibi_dropout_on_every_kernel(dtype, head_dim):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 333, 300, 4, 2, head_dim, dtype)
    q *= 3  # scores large enough for the softcap to bend them
    slopes = _slopes(rng, 2, 4, True)
    for variants in (dict(softcap=20.0), dict(alibi_slopes=slopes, causal=True), dict(dropout_p=0.2),
                     dict(softcap=30.0, alibi_slopes=slopes, dropout_p=0.1, window_size=(100, 3))):  # fmt: skip
        causal = variants.pop("causal", False)
        for tile in _forward_kernels(head_dim, dropout="dropout_p" in variants):
            check_forward(q, k, v, causal=causal, dtype=dtype, tile=tile, what=f"{tile} {variants}", **variants)
        for tile in _backward_kernels(head_dim, softcap="softcap" in variants):
            check_backward(q, k, v, causal=causal, dtype=dtype, tile=tile, what=f"{tile} {variants}", **variants)


def _recovered_mask(out, seqlen_k, p):
    """From attention with q = k = 0 (P = 1 / seqlen_k everywhere) and one-hot V rows (v[j] = e_j):
    out[b, i, h, j] = keep(i, j) / (keep probability * seqlen_k), so the keep mask is out > half that."""
    from cuflash import reference

    return to_f64(out) * seqlen_k * reference.keep_probability(p) > 0.5


@pytest.mark.parametrize("head_dim,seqlen", [(256, 200), (128, 128), (200, 200), (64, 64)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_is_the_reference_philox_stream(head_dim, seqlen, p):
    """Forward: the mask the kernels apply is exactly reference.dropout_keep_mask (every element, both
    kernel families), and the keep rate is reference.keep_probability(p), 1 - p rounded to a 256th
    (within 5 standard deviations). Backward: dV = P^T dO
    with one-hot dO rows reads the transposed mask, which the backward regenerates through warp
    shuffles: exactly the same mask."""
    import cupy

    from cuflash import backward, forward, reference

    batch, nheads = 2, 3
    q = cupy.zeros((batch, seqlen, nheads, head_dim), dtype=DTYPES["bf16"])
    k = cupy.zeros_like(q)
    eye = np.zeros((seqlen, head_dim), dtype=np.float32)
    eye[np.arange(seqlen), np.arange(seqlen)] = 1
    v = cupy.asarray(np.broadcast_to(eye[None, :, None, :], q.shape).astype(DTYPES["bf16"]))
    state = (0x1234_5678_9ABC_DEF0, 7 << 32 | 5)
    want = np.stack([np.stack([reference.dropout_keep_mask(state, b, h, nheads, p, 0, seqlen, seqlen)
                               for h in range(nheads)], axis=1) for b in range(batch)])  # (b, i, h, j)  # fmt: skip
    for tile in _forward_kernels(head_dim, dropout=True):
        out, lse, got_state = forward.run(q, k, v, dropout_p=p, rng_state=state, return_lse=True, tile=tile)
        assert got_state == state
        mask = _recovered_mask(out[..., :seqlen], seqlen, p)
        assert (mask == want).all(), f"{tile}: {(mask != want).sum()} elements differ from the reference mask"
        check_lse(lse, np.full(lse.shape, np.log(seqlen)))
    n = want.size
    rate, keep = want.mean(), reference.keep_probability(p)
    assert abs(rate - keep) < 5 * np.sqrt(keep * (1 - keep) / n), f"keep rate {rate:.4f} vs {keep}"
    # Backward: dO = one-hot rows (dO[i] = e_i): dV[j, i] = Pd[i, j] = keep(i, j) / (keep probability seqlen).
    out, lse, _ = forward.run(q, k, v, dropout_p=p, rng_state=state, return_lse=True)
    dout = v.copy()
    for tile in _backward_kernels(head_dim):
        dq, dk, dv = backward.run(dout, q, k, v, out, lse, dropout_p=p, rng_state=state, tile=tile)
        mask_t = _recovered_mask(dv[..., :seqlen], seqlen, p)  # (b, j, h, i)
        got = mask_t.transpose(0, 3, 2, 1)  # (b, i, h, j)
        assert (got == want).all(), f"{tile}: backward mask differs in {(got != want).sum()} elements"


def test_dropout_draws_a_fresh_stream_and_replays_a_given_one():
    import cuflash

    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 64, 64, 2, 2, 64, "fp16")
    o1, s1 = cuflash.attention(q, k, v, dropout_p=0.3)
    o2, s2 = cuflash.attention(q, k, v, dropout_p=0.3)
    assert s1 != s2 and not (to_f64(o1) == to_f64(o2)).all()
    o3, s3 = cuflash.attention(q, k, v, dropout_p=0.3, rng_state=s1)
    assert s3 == s1 and (to_f64(o3) == to_f64(o1)).all()


def test_bad_variant_arguments_name_the_argument():
    import cupy

    import cuflash

    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 16, 16, 4, 2, 64, "bf16")
    good = cupy.ones(4, dtype=cupy.float32)
    for kwargs, match in [
        (dict(window_size=(-2, 0)), "window_size"), (dict(window_size=(1,)), "window_size"),
        (dict(window_size=(1.5, 0)), "window_size"), (dict(softcap=-1.0), "softcap"),
        (dict(softcap=float("nan")), "softcap"), (dict(alibi_slopes=cupy.ones(3, dtype=cupy.float32)), "alibi_slopes"),
        (dict(alibi_slopes=good.astype(cupy.float16)), "alibi_slopes"), (dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes"),
        (dict(alibi_slopes=cupy.ones((3, 4), dtype=cupy.float32)), "alibi_slopes"),
        (dict(dropout_p=1.0), "dropout_p"), (dict(dropout_p=-0.1), "dropout_p"),
        (dict(dropout_p=0.1, rng_state=(1,)), "rng_state"), (dict(dropout_p=0.1, rng_state=(-1, 0)), "rng_state"),
    ]:  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=match):
            cuflash.attention(q, k, v, **kwargs)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="rng_state"):
        cuflash.attention_backward(q, q, k, v, out, lse, dropout_p=0.1)
    kc = cupy.zeros((2, 64, 2, 64), dtype=q.dtype)
    with pytest.raises(TypeError, match="dropout_p"):
        cuflash.attention_with_kvcache(q[:, :1], kc, kc, cache_seqlens=10, dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap"):
        cuflash.attention_with_kvcache(q[:, :1], kc, kc, cache_seqlens=10, softcap=-3.0)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("head_dim,dtype", [(128, "bf16"), (64, "fp16"), (96, "bf16"), (256, "bf16")])
def test_decode_variants(paged, num_splits, head_dim, dtype):
    """Decode with a window, softcap and ALiBi (each alone and all together), ragged lengths, GQA, two
    query tokens, split or not, contiguous or paged, against reference.attention_with_kvcache."""
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng()
    batch, nheads, nheads_kv, seqlen_q, capacity = 3, 8, 2, 2, 1024
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, nheads, head_dim), dtype=np.float32).astype(DTYPES[dtype]))
    kc = cupy.asarray(rng.standard_normal((batch, capacity, nheads_kv, head_dim), dtype=np.float32).astype(DTYPES[dtype]))
    vc = cupy.asarray(rng.standard_normal((batch, capacity, nheads_kv, head_dim), dtype=np.float32).astype(DTYPES[dtype]))
    lengths = np.array([1000, 37, 513])
    k_seq, v_seq = kc, vc  # contiguous per sequence (the plain runs read these)
    kwargs, block_table = {}, None
    if paged:
        page = 64
        n_pages = batch * capacity // page
        perm = rng.permutation(n_pages).astype(np.int32)
        block_table = cupy.asarray(perm.reshape(batch, capacity // page))
        kc = cupy.empty((n_pages, page, nheads_kv, head_dim), dtype=k_seq.dtype)
        vc = cupy.empty_like(kc)
        kc[cupy.asarray(perm)] = k_seq.reshape(n_pages, page, nheads_kv, head_dim)
        vc[cupy.asarray(perm)] = v_seq.reshape(n_pages, page, nheads_kv, head_dim)
        kwargs["block_table"] = block_table
    slopes = _slopes(rng, batch, nheads, True)
    for variants in (dict(window_size=(100, 0)), dict(window_size=(700, -1), causal=True), dict(softcap=15.0),
                     dict(alibi_slopes=slopes, causal=True),
                     dict(window_size=(300, 0), softcap=30.0, alibi_slopes=slopes[0])):  # fmt: skip
        causal = variants.pop("causal", False)
        out, lse = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cupy.asarray(lengths.astype(np.int32)),
                                                  causal=causal, num_splits=num_splits, return_lse=True, **kwargs,
                                                  **variants)  # fmt: skip
        ref, ref_lse, _, _ = reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=causal,
                                                              block_table=block_table, **variants)  # fmt: skip
        plains = []
        for b in range(batch):
            per_seq = dict(variants)
            if "alibi_slopes" in per_seq:
                per_seq["alibi_slopes"] = per_seq["alibi_slopes"].reshape(-1, nheads)[-1 if per_seq["alibi_slopes"].ndim == 1 else b]
            L = int(lengths[b])
            plains.append(reference.plain_attention_bar(q[b:b + 1], k_seq[b:b + 1, :L], v_seq[b:b + 1, :L], ref[b:b + 1],
                                                        causal=causal, dtype=DTYPES[dtype], **per_seq)[0])  # fmt: skip
        plain = np.stack(plains)
        got = to_f64(out)
        assert reference.within_tolerance(got, ref, plain), (
            f"{variants}: error {reference.max_abs_error(got, ref):.3g} vs plain {reference.max_abs_error(plain, ref):.3g}")
        check_lse(lse, ref_lse, str(variants))
