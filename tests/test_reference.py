"""CPU tests of the float64 NumPy oracle in cuflash.reference."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cuflash import reference as R

SETTINGS = settings(deadline=None, max_examples=40)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def randn(rng, *shape):
    return rng.standard_normal(shape)


@st.composite
def problems(draw, max_batch=2, max_seq=9, max_kv_heads=2, max_group=2, max_dim=8,
             min_seq=0):
    """Random attention problem: arrays, causal flag and softmax_scale."""
    batch = draw(st.integers(1, max_batch))
    seqlen_q = draw(st.integers(min_seq, max_seq))
    seqlen_k = draw(st.integers(min_seq, max_seq))
    nheads_kv = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    headdim = draw(st.integers(1, max_dim))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = randn(rng, batch, seqlen_q, nheads_kv * group, headdim)
    k = randn(rng, batch, seqlen_k, nheads_kv, headdim)
    v = randn(rng, batch, seqlen_k, nheads_kv, headdim)
    return q, k, v, causal, scale


def direct_attention(q, k, v, causal, scale):
    """Per-element attention with explicit loops and math.exp."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(headdim)
    group = nheads // nheads_kv
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k)
                        if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                s = {j: scale * sum(q[b, i, h, t] * k[b, j, hk, t] for t in range(headdim))
                     for j in keys}
                m = max(s.values())
                w = {j: math.exp(s[j] - m) for j in keys}
                total = sum(w.values())
                lse[b, h, i] = m + math.log(total)
                for t in range(headdim):
                    out[b, i, h, t] = sum(w[j] * v[b, j, hk, t] for j in keys) / total
    return out, lse


def assert_lse_equal(a, b, atol=1e-12):
    assert a.shape == b.shape
    assert np.array_equal(np.isneginf(a), np.isneginf(b))
    finite = np.isfinite(b)
    np.testing.assert_allclose(a[finite], b[finite], rtol=1e-12, atol=atol)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------

@SETTINGS
@given(problems())
def test_forward_matches_direct_formula(problem):
    q, k, v, causal, scale = problem
    out, lse = R.attention_forward(q, k, v, causal=causal, softmax_scale=scale)
    out_d, lse_d = direct_attention(q, k, v, causal, scale)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    np.testing.assert_allclose(out, out_d, rtol=1e-12, atol=1e-12)
    assert_lse_equal(lse, lse_d)


def test_forward_large_scores_are_stable():
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 1, 5, 2, 4), randn(rng, 1, 6, 2, 4), randn(rng, 1, 6, 2, 4)
    out, lse = R.attention_forward(q, k, v, softmax_scale=500.0)
    out_d, lse_d = direct_attention(q, k, v, False, 500.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, out_d, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12)


def test_input_dtypes_strides_and_get():
    rng = np.random.default_rng(2)
    base = randn(rng, 3, 2, 7, 4)                      # a strided view below
    q = base.transpose(1, 2, 0, 3)[:, ::2]             # (2, 4, 3, 4), non-contiguous
    k, v = randn(rng, 2, 5, 3, 4), randn(rng, 2, 5, 3, 4)
    assert not q.flags.c_contiguous
    expected = direct_attention(q, k, v, True, None)
    out, lse = R.attention_forward(q, k, v, causal=True)
    np.testing.assert_allclose(out, expected[0], atol=1e-12)

    class FakeDeviceArray:                             # stands in for a CuPy array
        def __init__(self, a):
            self._a = a

        def get(self):
            return self._a

    out2, _ = R.attention_forward(FakeDeviceArray(q), FakeDeviceArray(k), FakeDeviceArray(v),
                                  causal=True)
    np.testing.assert_array_equal(out2, out)

    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
        out_d, _ = R.attention_forward(qd, kd, vd, causal=True)
        exact = direct_attention(*(x.astype(np.float64) for x in (qd, kd, vd)), True, None)[0]
        assert out_d.dtype == np.float64
        np.testing.assert_allclose(out_d, exact, atol=1e-12)


def test_shape_errors_name_the_argument():
    q, k = np.zeros((1, 3, 2, 4)), np.zeros((1, 5, 1, 4))
    with pytest.raises(ValueError, match=r"v must have shape \(1, 5, 1, 4\)"):
        R.attention_forward(q, k, np.zeros((1, 5, 1, 3)))
    with pytest.raises(ValueError, match=r"k must have shape"):
        R.attention_forward(q, np.zeros((2, 5, 1, 4)), np.zeros((2, 5, 1, 4)))
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        R.attention_forward(np.zeros((1, 3, 3, 4)), np.zeros((1, 5, 2, 4)),
                            np.zeros((1, 5, 2, 4)))
    with pytest.raises(ValueError, match="q must be 4-D"):
        R.attention_forward(np.zeros((3, 2, 4)), k, k)
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 3, 2, 4\)"):
        R.attention_backward(np.zeros((1, 3, 2, 5)), q, k, k)


# ---------------------------------------------------------------------------
# Mask semantics
# ---------------------------------------------------------------------------

def test_visible_mask_rule():
    for sq in range(0, 7):
        for sk in range(0, 7):
            full = R.visible_mask(sq, sk, True)
            assert full.shape == (sq, sk) and full.dtype == bool
            for i in range(sq):
                for j in range(sk):
                    assert full[i, j] == (j <= i + sk - sq)
            assert R.visible_mask(sq, sk, False).all()
            assert R.visible_mask(sq, sk, False).shape == (sq, sk)
            for start in range(sq + 1):
                for stop in range(start, sq + 1):
                    part = R.visible_mask(sq, sk, True, q_start=start, q_stop=stop)
                    np.testing.assert_array_equal(part, full[start:stop])
    with pytest.raises(ValueError):
        R.visible_mask(4, 4, True, q_start=3, q_stop=5)


def test_rows_without_keys_give_zero_and_neg_inf():
    rng = np.random.default_rng(3)
    sq, sk = 6, 3                      # causal: rows 0..2 see nothing
    q, k, v = randn(rng, 2, sq, 2, 4), randn(rng, 2, sk, 1, 4), randn(rng, 2, sk, 1, 4)
    out, lse = R.attention_forward(q, k, v, causal=True)
    assert np.all(out[:, :3] == 0)
    assert np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))
    assert np.all(np.abs(out[:, 3:]).sum(axis=-1) > 0)
    # row 3 sees exactly key 0: out is v[0] and lse is its score
    np.testing.assert_allclose(out[:, 3, 0], v[:, 0, 0])
    np.testing.assert_allclose(lse[:, 0, 3], (q[:, 3, 0] * k[:, 0, 0]).sum(-1) / 2.0)
    dq, dk, dv = R.attention_backward(randn(rng, *q.shape), q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


# ---------------------------------------------------------------------------
# GQA / MQA
# ---------------------------------------------------------------------------

@SETTINGS
@given(problems(max_kv_heads=3, max_group=4, min_seq=1), st.integers(0, 2**32 - 1))
def test_gqa_equals_head_repetition(problem, seed):
    q, k, v, causal, scale = problem
    group = q.shape[2] // k.shape[2]
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    out, lse = R.attention_forward(q, k, v, causal=causal, softmax_scale=scale)
    out_r, lse_r = R.attention_forward(q, k_rep, v_rep, causal=causal, softmax_scale=scale)
    np.testing.assert_allclose(out, out_r, rtol=1e-13, atol=1e-13)
    assert_lse_equal(lse, lse_r)

    dout = randn(np.random.default_rng(seed), *q.shape)
    dq, dk, dv = R.attention_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    dq_r, dk_r, dv_r = R.attention_backward(dout, q, k_rep, v_rep, causal=causal,
                                            softmax_scale=scale)
    b, sk, hkv, d = k.shape
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(b, sk, hkv, group, d).sum(3), atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(b, sk, hkv, group, d).sum(3), atol=1e-12)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------

def numerical_gradients(dout, q, k, v, causal, scale, eps=1e-6):
    """Central differences of loss = sum(out * dout) w.r.t. q, k and v."""
    def loss(q_, k_, v_):
        out, _ = R.attention_forward(q_, k_, v_, causal=causal, softmax_scale=scale)
        return float(np.sum(out * dout))

    arrays = [q.copy(), k.copy(), v.copy()]
    grads = []
    for which, x in enumerate(arrays):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = loss(*arrays)
            x[idx] = orig - eps
            minus = loss(*arrays)
            x[idx] = orig
            g[idx] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


@settings(deadline=None, max_examples=30)
@given(problems(max_batch=1, max_seq=4, max_kv_heads=1, max_group=2, max_dim=3, min_seq=1),
       st.integers(0, 2**32 - 1))
def test_backward_matches_finite_differences(problem, seed):
    q, k, v, causal, scale = problem
    dout = randn(np.random.default_rng(seed), *q.shape)
    analytic = R.attention_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    numeric = numerical_gradients(dout, q, k, v, causal, scale)
    for name, a, n in zip("qkv", analytic, numeric):
        assert a.shape == n.shape and a.dtype == np.float64, name
        np.testing.assert_allclose(a, n, rtol=1e-5, atol=1e-7, err_msg=f"d{name}")


def test_backward_finite_differences_gqa_causal_rectangular():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, 2, 3, 4, 2), randn(rng, 2, 5, 2, 2), randn(rng, 2, 5, 2, 2)
    dout = randn(rng, *q.shape)
    analytic = R.attention_backward(dout, q, k, v, causal=True, softmax_scale=0.7)
    numeric = numerical_gradients(dout, q, k, v, True, 0.7)
    for a, n in zip(analytic, numeric):
        np.testing.assert_allclose(a, n, rtol=1e-5, atol=1e-7)
    # causal alignment: key 4 is seen only by the last query row (i=2)
    assert np.all(analytic[1][:, 4] != 0)


# ---------------------------------------------------------------------------
# Chunking (memory bound)
# ---------------------------------------------------------------------------

def test_chunking_matches_unchunked(monkeypatch):
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, 2, 9, 4, 3), randn(rng, 2, 6, 2, 3), randn(rng, 2, 6, 2, 3)
    dout = randn(rng, *q.shape)
    k_cache, v_cache = randn(rng, 2, 8, 2, 3), randn(rng, 2, 8, 2, 3)

    def run_all():
        return (R.attention_forward(q, k, v, causal=True)
                + R.attention_backward(dout, q, k, v, causal=True)
                + (R.plain_attention(q, k, v, causal=True, dtype=np.float16),)
                + R.plain_attention_backward(dout, q, k, v, causal=True, dtype=np.float16)
                + R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=[7, 3],
                                           causal=True)[:2])

    blocks = []
    original_mask = R.visible_mask

    def spy(seqlen_q, seqlen_k, causal, q_start=0, q_stop=None, window_size=(-1, -1), diag_shift=0):
        m = original_mask(seqlen_q, seqlen_k, causal, q_start, q_stop, window_size, diag_shift)
        blocks.append(m.shape)
        return m

    monkeypatch.setattr(R, "visible_mask", spy)
    unchunked = run_all()
    assert all(rows == 9 for rows, _ in blocks)     # one block per head
    blocks.clear()
    monkeypatch.setattr(R, "MAX_BLOCK_ELEMENTS", 7)
    chunked = run_all()
    assert len(blocks) > 9 * 16
    assert all(rows * cols <= 7 or rows == 1 for rows, cols in blocks)
    assert any(rows == 1 for rows, _ in blocks) and any(rows == 2 for rows, _ in blocks)
    for a, b in zip(chunked, unchunked):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------

def test_kvcache_contiguous_ragged():
    rng = np.random.default_rng(6)
    batch, sq, h, hkv, d, cap = 3, 2, 4, 2, 5, 8
    q = randn(rng, batch, sq, h, d)
    k_cache, v_cache = randn(rng, 4, cap, hkv, d), randn(rng, 4, cap, hkv, d)  # batch_cache > batch
    lens = np.array([5, 0, 8])
    out, lse, kc, vc = R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert out.shape == q.shape and lse.shape == (batch, h, sq)
    np.testing.assert_array_equal(kc, k_cache)
    np.testing.assert_array_equal(vc, v_cache)
    for b in range(batch):
        L = lens[b]
        o_b, l_b = R.attention_forward(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L])
        np.testing.assert_allclose(out[b:b + 1], o_b, rtol=1e-14, atol=1e-14)
        assert_lse_equal(lse[b:b + 1], l_b)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.isfinite(lse[[0, 2]]).all()

    # None = whole cache, an int = same length for every sequence
    out_none, _, _, _ = R.attention_with_kvcache(q, k_cache, v_cache)
    out_int, _, _, _ = R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cap)
    ref_full, _ = R.attention_forward(q, k_cache[:batch], v_cache[:batch])
    np.testing.assert_allclose(out_none, ref_full, atol=1e-14)
    np.testing.assert_allclose(out_int, ref_full, atol=1e-14)
    out_3, _, _, _ = R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)
    ref_3, _ = R.attention_forward(q, k_cache[:batch, :3], v_cache[:batch, :3])
    np.testing.assert_allclose(out_3, ref_3, atol=1e-14)


def to_paged(cache, page_size, rng, extra_blocks=3):
    """Scatter a contiguous cache (batch, cap, hkv, d) into shuffled pages."""
    batch, cap = cache.shape[:2]
    per_seq = cap // page_size
    num_blocks = batch * per_seq + extra_blocks
    order = rng.permutation(num_blocks)
    block_table = order[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    paged = rng.standard_normal((num_blocks, page_size) + cache.shape[2:])  # junk elsewhere
    for b in range(batch):
        for p in range(per_seq):
            paged[block_table[b, p]] = cache[b, p * page_size:(p + 1) * page_size]
    return paged, block_table


def from_paged(paged, block_table):
    return np.stack([np.concatenate([paged[blk] for blk in row]) for row in block_table])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_kvcache_paged_equals_contiguous(causal, seqlen_new):
    rng = np.random.default_rng(7 + seqlen_new)
    batch, sq, h, hkv, d, ps, per_seq = 3, 3, 2, 1, 4, 4, 3
    cap = ps * per_seq
    q = randn(rng, batch, sq, h, d)
    k_cache, v_cache = randn(rng, batch, cap, hkv, d), randn(rng, batch, cap, hkv, d)
    k_new, v_new = randn(rng, batch, seqlen_new, hkv, d), randn(rng, batch, seqlen_new, hkv, d)
    lens = np.array([6, 0, 9])
    kw = dict(k=k_new, v=v_new, cache_seqlens=lens, causal=causal)
    out_c, lse_c, kc_c, vc_c = R.attention_with_kvcache(q, k_cache, v_cache, **kw)
    k_paged, table = to_paged(k_cache, ps, rng)
    v_paged = np.zeros_like(k_paged)
    for b in range(batch):
        for p in range(per_seq):
            v_paged[table[b, p]] = v_cache[b, p * ps:(p + 1) * ps]
    out_p, lse_p, kc_p, vc_p = R.attention_with_kvcache(q, k_paged, v_paged,
                                                        block_table=table, **kw)
    assert kc_p.shape == k_paged.shape
    np.testing.assert_allclose(out_p, out_c, rtol=1e-14, atol=1e-14)
    assert_lse_equal(lse_p, lse_c)
    np.testing.assert_array_equal(from_paged(kc_p, table), kc_c)
    np.testing.assert_array_equal(from_paged(vc_p, table), vc_c)
    unused = np.setdiff1d(np.arange(len(k_paged)), table)
    np.testing.assert_array_equal(kc_p[unused], k_paged[unused])


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float64])
def test_kvcache_append_semantics(cache_dtype):
    rng = np.random.default_rng(8)
    batch, sq, h, hkv, d, cap, new = 3, 1, 4, 2, 3, 10, 3
    q = randn(rng, batch, sq, h, d)
    k_cache = randn(rng, batch, cap, hkv, d).astype(cache_dtype)
    v_cache = randn(rng, batch, cap, hkv, d).astype(cache_dtype)
    k_in, v_in = k_cache.copy(), v_cache.copy()
    k_new, v_new = randn(rng, batch, new, hkv, d), randn(rng, batch, new, hkv, d)
    lens = np.array([4, 0, 7])
    out, lse, kc, vc = R.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                cache_seqlens=lens)
    np.testing.assert_array_equal(k_cache, k_in)       # inputs not mutated
    np.testing.assert_array_equal(v_cache, v_in)
    assert kc.dtype == np.float64 and kc.shape == k_cache.shape
    for b in range(batch):
        L = lens[b]
        expected_k, expected_v = k_cache[b].astype(np.float64), v_cache[b].astype(np.float64)
        expected_k[L:L + new], expected_v[L:L + new] = k_new[b], v_new[b]
        np.testing.assert_array_equal(kc[b], expected_k)
        np.testing.assert_array_equal(vc[b], expected_v)
        o_b, l_b = R.attention_forward(q[b:b + 1], kc[b:b + 1, :L + new], vc[b:b + 1, :L + new])
        np.testing.assert_allclose(out[b:b + 1], o_b, atol=1e-14)
        np.testing.assert_allclose(lse[b:b + 1], l_b, atol=1e-14)


def test_kvcache_causal_decode_seqlen_q_3():
    rng = np.random.default_rng(9)
    batch, sq, h, hkv, d, cap = 3, 3, 2, 2, 4, 7
    q = randn(rng, batch, sq, h, d)
    k_cache, v_cache = randn(rng, batch, cap, hkv, d), randn(rng, batch, cap, hkv, d)
    lens = np.array([7, 2, 4])
    out, lse, _, _ = R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                              causal=True)
    for b in range(batch):
        L = lens[b]
        o_d, l_d = direct_attention(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L],
                                    True, None)
        np.testing.assert_allclose(out[b:b + 1], o_d, atol=1e-12)
        assert_lse_equal(lse[b:b + 1], l_d)
    # L = 2 < seqlen_q: the first query row sees no key
    assert np.all(out[1, 0] == 0) and np.all(np.isneginf(lse[1, :, 0]))
    # causal differs from non-causal on the long sequence
    out_nc, _, _, _ = R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert not np.allclose(out[0, 0], out_nc[0, 0])
    np.testing.assert_allclose(out[0, 2], out_nc[0, 2], atol=1e-14)


def test_kvcache_errors():
    rng = np.random.default_rng(10)
    q = randn(rng, 2, 1, 2, 4)
    k_cache, v_cache = randn(rng, 2, 6, 1, 4), randn(rng, 2, 6, 1, 4)
    k_new, v_new = randn(rng, 2, 2, 1, 4), randn(rng, 2, 2, 1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        R.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=[4, 5])
    with pytest.raises(ValueError, match="do not fit"):
        R.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new)   # cache full
    R.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=[4, 4])
    paged, table = to_paged(k_cache, 3, rng)
    with pytest.raises(ValueError, match="do not fit"):
        R.attention_with_kvcache(q, paged, paged, k=k_new, v=v_new, cache_seqlens=5,
                                 block_table=table)
    with pytest.raises(ValueError, match="k and v"):
        R.attention_with_kvcache(q, k_cache, v_cache, k=k_new)
    with pytest.raises(ValueError, match="batch_cache"):
        R.attention_with_kvcache(randn(rng, 3, 1, 2, 4), k_cache, v_cache)
    with pytest.raises(ValueError, match="cache_seqlens"):
        R.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=[7, 1])
    with pytest.raises(ValueError, match=r"v_cache must have shape"):
        R.attention_with_kvcache(q, k_cache, v_cache[:, :5])


# ---------------------------------------------------------------------------
# Plain low-precision implementation and the pass rule
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, bound", [(np.float16, 5e-3), (ml_dtypes.bfloat16, 4e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_close_to_reference(dtype, bound, causal):
    rng = np.random.default_rng(11)
    q, k, v = randn(rng, 2, 33, 4, 16), randn(rng, 2, 40, 2, 16), randn(rng, 2, 40, 2, 16)
    ref, _ = R.attention_forward(q, k, v, causal=causal)
    plain = R.plain_attention(q, k, v, causal=causal, dtype=dtype)
    assert plain.dtype == np.float64 and plain.shape == ref.shape
    np.testing.assert_array_equal(plain, plain.astype(dtype).astype(np.float64))  # rounded
    err = R.max_abs_error(plain, ref)
    assert 0 < err < bound
    assert R.within_tolerance(plain, ref, plain)
    # a kernel with half the plain error passes; one with 3x fails
    assert R.within_tolerance(ref + 0.5 * err, ref, plain)
    assert not R.within_tolerance(ref + 3 * err, ref, plain)
    assert not R.within_tolerance(ref + 0.1, ref, plain)
    bad = ref.copy()
    bad[0, 1, 2, 3] = np.nan
    assert not R.within_tolerance(bad, ref, plain)
    assert not R.within_tolerance(ref[:, :-1], ref[:, :-1] * 1.0, plain)


@pytest.mark.parametrize("dtype, bound", [(np.float16, 1e-2), (ml_dtypes.bfloat16, 8e-2)])
def test_plain_attention_backward_close_to_reference(dtype, bound):
    rng = np.random.default_rng(12)
    q, k, v = randn(rng, 1, 20, 4, 8), randn(rng, 1, 24, 2, 8), randn(rng, 1, 24, 2, 8)
    dout = randn(rng, *q.shape)
    ref = R.attention_backward(dout, q, k, v, causal=True)
    plain = R.plain_attention_backward(dout, q, k, v, causal=True, dtype=dtype)
    for r, p in zip(ref, plain):
        assert p.shape == r.shape and p.dtype == np.float64
        np.testing.assert_array_equal(p, p.astype(dtype).astype(np.float64))
        assert 0 < R.max_abs_error(p, r) < bound
        assert R.within_tolerance(p, r, p)
        assert not R.within_tolerance(r + 0.5, r, p)


def plain_recipe(q, k, v, causal, dtype):
    """The plain recipe written out directly, one (batch, head) at a time."""
    def rnd(x):
        return x.astype(dtype).astype(np.float32)

    q, k, v = (x.astype(dtype).astype(np.float32) for x in (q, k, v))
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    scale = np.float32(1 / math.sqrt(q.shape[3]))
    out = np.zeros(q.shape, dtype=np.float32)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            S = (q[b, :, h] @ k[b, :, h // group].T) * scale
            if causal:
                S[np.arange(sk)[None, :] > np.arange(sq)[:, None] + sk - sq] = -np.inf
            E = np.exp(S - S.max(axis=1, keepdims=True))
            P = E / E.sum(axis=1, keepdims=True)
            out[b, :, h] = rnd(P) @ v[b, :, h // group]
    return rnd(out).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_plain_attention_follows_the_recipe(dtype):
    rng = np.random.default_rng(14)
    q, k, v = randn(rng, 2, 48, 2, 32), randn(rng, 2, 64, 1, 32), randn(rng, 2, 64, 1, 32)
    plain = R.plain_attention(q, k, v, causal=True, dtype=dtype)
    direct = plain_recipe(q, k, v, True, dtype)
    ulp = np.abs(direct) * float(ml_dtypes.finfo(dtype).eps) + 1e-7
    assert np.all(np.abs(plain - direct) <= ulp)
    # float32 summation order may flip a rare rounding, nothing more
    assert np.mean(plain != direct) < 0.01


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_plain_attention_unnormalized_order_follows_its_recipe(dtype):
    """p_order="unnormalized": E = exp(S - rowmax) rounded, P @ V divided by the unrounded row sum."""
    def rnd(x):
        return x.astype(dtype).astype(np.float32)

    rng = np.random.default_rng(15)
    q, k, v = randn(rng, 1, 40, 2, 32), randn(rng, 1, 50, 1, 32), randn(rng, 1, 50, 1, 32)
    plain = R.plain_attention(q, k, v, dtype=dtype, p_order="unnormalized")
    Q, K, V = (x.astype(dtype).astype(np.float32) for x in (q, k, v))
    direct = np.zeros(q.shape, dtype=np.float32)
    for h in range(2):
        S = (Q[0, :, h] @ K[0, :, 0].T) * np.float32(1 / math.sqrt(32))
        E = np.exp(S - S.max(axis=1, keepdims=True))
        direct[0, :, h] = (rnd(E) @ V[0, :, 0]) / E.sum(axis=1, keepdims=True)
    direct = rnd(direct).astype(np.float64)
    ulp = np.abs(direct) * float(ml_dtypes.finfo(dtype).eps) + 1e-7
    assert np.all(np.abs(plain - direct) <= ulp) and np.mean(plain != direct) < 0.01
    assert not np.array_equal(plain, R.plain_attention(q, k, v, dtype=dtype))  # the two orders differ
    with pytest.raises(ValueError, match="p_order"):
        R.plain_attention(q, k, v, dtype=dtype, p_order="rowwise")


def test_the_bar_is_the_worse_order_of_rounding_p():
    """A decode case the H200 drew (bf16, head dim 1, 4 keys, scale 1.15625): exact 0.62373; the
    kernel (FlashAttention's order) gave 0.621094, 0.68 bf16 ulp away. The normalized order happens
    to round to 0.625 (0.33 ulp), and 2x its error would fail the kernel; the unnormalized order
    gives exactly the kernel's value, and the bar is the worse of the two."""
    bf16 = ml_dtypes.bfloat16
    q = np.array(-0.05737305).reshape(1, 1, 1, 1)
    k = np.array([0.96484375, 1.2265625, -1.1015625, 1.78125]).reshape(1, 4, 1, 1)
    v = np.array([0.9453125, 1.078125, 0.2578125, 0.25585938]).reshape(1, 4, 1, 1)
    ref, _ = R.attention_forward(q, k, v, softmax_scale=1.15625)
    assert abs(float(ref.ravel()[0]) - 0.62373) < 1e-5
    norm = R.plain_attention(q, k, v, softmax_scale=1.15625, dtype=bf16)
    unnorm = R.plain_attention(q, k, v, softmax_scale=1.15625, dtype=bf16, p_order="unnormalized")
    assert norm.ravel()[0] == 0.625 and unnorm.ravel()[0] == 0.62109375
    kernel = np.full((1, 1, 1, 1), 0.62109375)
    assert not R.within_tolerance(kernel, ref, norm)
    bar = R.plain_attention_bar(q, k, v, ref, softmax_scale=1.15625, dtype=bf16)
    assert bar.ravel()[0] == 0.62109375 and R.within_tolerance(kernel, ref, bar)
    # Off by one more bf16 ulp still fails.
    assert not R.within_tolerance(np.full((1, 1, 1, 1), 0.6171875), ref, bar)


def test_worse_of():
    ref = np.zeros(3)
    a, b, c = np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 2.0]), np.array([np.nan, 0.0, 0.0])
    assert R.worse_of([a, b], ref) is b and R.worse_of([b, a], ref) is b
    assert R.worse_of([a, c, b], ref) is c


def test_the_backward_bar_is_the_worse_summation_order_of_d():
    """A backward case the H200 drew (fp16, head dim 128, 30 queries, 1 key, scale 1, Hypothesis seed
    0): one key makes P = 1, O = V and D = dP, so the exact dQ and dK are 0 and every error is the
    rounding of dP - D. The kernel's dK error 3.67e-5 failed 3x the pairwise plain error (7.45e-6) +
    1e-5; D summed left to right, as a loop per row does, leaves ~4x the error, and the bar is the
    worse of the two orders."""
    f16 = np.float16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(f16) for s in ((1, 30, 1, 128), (1, 1, 1, 128),
                                                                            (1, 1, 1, 128)))  # fmt: skip
    out = np.broadcast_to(v, q.shape).astype(f16)  # the forward output with one key: O = V exactly
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(f16)
    refs = R.attention_backward(dout, q, k, v, softmax_scale=1.0)
    assert np.abs(refs[0]).max() == 0 and np.abs(refs[1]).max() == 0
    pair = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16, out=out)
    seq = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16, out=out, d_order="sequential")
    assert abs(R.max_abs_error(pair[1], refs[1]) - 7.45e-6) < 1e-7
    assert R.max_abs_error(seq[1], refs[1]) > 2 * R.max_abs_error(pair[1], refs[1])
    kernel_dk = np.full(refs[1].shape, 0.0)
    kernel_dk.ravel()[25] = -3.6716461181640625e-05
    assert not R.within_tolerance(kernel_dk, refs[1], pair[1], factor=3.0)
    bar = R.plain_attention_backward_bar(dout, q, k, v, refs, softmax_scale=1.0, dtype=f16, out=out)
    tc = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16, out=out, dp_order="tensor_core")
    worst = max((pair, seq, tc), key=lambda g: R.max_abs_error(g[1], refs[1]))
    assert (bar[1] == worst[1]).all() and R.within_tolerance(kernel_dk, refs[1], bar[1], factor=3.0)
    assert R.within_tolerance(kernel_dk, refs[1], seq[1], factor=3.0)  # the left-to-right order alone passes it
    # dV does not involve D or dP: every order gives the same plain dV.
    assert (pair[2] == seq[2]).all() and (pair[2] == tc[2]).all()
    with pytest.raises(ValueError, match="d_order"):
        R.plain_attention_backward(dout, q, k, v, dtype=f16, d_order="tree")
    with pytest.raises(ValueError, match="dp_order"):
        R.plain_attention_backward(dout, q, k, v, dtype=f16, dp_order="tf32")


def test_the_backward_bar_counts_the_tensor_core_accumulation_of_dp():
    """A backward case the H200 drew (fp16, head dim 224, 1 query, 1 key, scale 1, Hypothesis seed 258):
    the exact dQ and dK are 0 and every float32 order of D and dP lands on the same value, so the IEEE
    plains are exact and the bar was 1e-5; the kernel's dP, accumulated on tensor cores, was ~3 float32
    ulps off, and its dQ error 1.54e-5 failed. The tensor-core plain (dP summed 8 products at a time,
    rounded toward zero) is 4 ulps off and sets the bar."""
    f16 = np.float16
    rng = np.random.default_rng(258)
    q, k, v, dout = (rng.standard_normal((1, 1, 1, 224), dtype=np.float32).astype(f16) for _ in range(4))
    out = v.copy()  # one key: O = V exactly
    refs = R.attention_backward(dout, q, k, v, softmax_scale=1.0)
    assert np.abs(refs[0]).max() == 0 and np.abs(refs[1]).max() == 0
    for d_order in ("pairwise", "sequential"):
        g = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16, out=out, d_order=d_order)
        assert R.max_abs_error(g[0], refs[0]) == 0 and R.max_abs_error(g[1], refs[1]) == 0
    kernel_dq = np.zeros(refs[0].shape)
    kernel_dq.ravel()[84] = 1.537799835205078e-05  # the H200's dQ (all other elements 0)
    assert not R.within_tolerance(kernel_dq, refs[0], np.zeros(refs[0].shape), factor=3.0)
    bar = R.plain_attention_backward_bar(dout, q, k, v, refs, softmax_scale=1.0, dtype=f16, out=out)
    assert R.max_abs_error(bar[0], refs[0]) > 0 and R.within_tolerance(kernel_dq, refs[0], bar[0], factor=3.0)
    do, vv = dout[0, 0, 0].astype(np.float32)[None], v[0, 0, 0].astype(np.float32)[:, None]
    ulp = np.spacing(np.float32(24.9))
    assert abs(float(R.tensor_core_matmul(do, vv)[0, 0]) - float((do @ vv)[0, 0])) == 4 * ulp


def test_tensor_core_matmul_rounds_each_block_toward_zero():
    # exact where every partial sum is a float32
    a = np.arange(-12, 12, dtype=np.float32).reshape(2, 12)
    b = np.arange(36, dtype=np.float32).reshape(12, 3) - 17
    assert (R.tensor_core_matmul(a, b) == (a.astype(np.float64) @ b).astype(np.float32)).all()
    # 1 + 3 * 2^-25 in one block, summed exactly: rounded to nearest it is 1 + 2^-23, toward zero 1;
    # likewise negated
    a = np.array([[1, 2**-13, 2**-13, 2**-13], [-1, -(2**-13), -(2**-13), -(2**-13)]], dtype=np.float32)
    b = np.array([[1], [2**-12], [2**-12], [2**-12]], dtype=np.float32)
    assert (a.astype(np.float64) @ b).astype(np.float32).ravel().tolist() == [1 + 2**-23, -1 - 2**-23]
    assert R.tensor_core_matmul(a, b).ravel().tolist() == [1.0, -1.0]
    # rounded every TENSOR_CORE_BLOCK products: 1 + 2^-24 + 2^-24 is the float32 1 + 2^-23 when summed
    # in one block, but 1 when the two 2^-24 fall in two blocks (each partial sum rounded toward zero)
    blk = R.TENSOR_CORE_BLOCK
    a = np.zeros((2, 2 * blk), dtype=np.float32)
    a[:, 0] = 1
    a[0, [1, 2]] = 2**-12  # row 0: both in the first block
    a[1, [1, 1 + blk]] = 2**-12  # row 1: one in each block
    b = np.full((2 * blk, 1), 2**-12, dtype=np.float32)
    b[0, 0] = 1
    assert R.tensor_core_matmul(a, b).ravel().tolist() == [np.float32(1 + 2**-23), 1.0]


def plain_backward_recipe(dout, q, k, v, dtype):
    """Plain non-causal backward written out directly, one (batch, head) at a time."""
    def rnd(x):
        return x.astype(dtype).astype(np.float32)

    dout, q, k, v = (x.astype(dtype).astype(np.float32) for x in (dout, q, k, v))
    group = q.shape[2] // k.shape[2]
    scale = np.float32(1 / math.sqrt(q.shape[3]))
    dq, dk, dv = (np.zeros(x.shape, dtype=np.float32) for x in (q, k, v))
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            Q, K, V, dO = q[b, :, h], k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            E = np.exp((Q @ K.T) * scale - ((Q @ K.T) * scale).max(axis=1, keepdims=True))
            P = E / E.sum(axis=1, keepdims=True)
            O = rnd(rnd(P) @ V)
            dS = rnd(P * (dO @ V.T - np.sum(dO * O, axis=1, keepdims=True)))
            dv[b, :, h // group] += rnd(P).T @ dO
            dq[b, :, h] = (dS @ K) * scale
            dk[b, :, h // group] += (dS.T @ Q) * scale
    return [rnd(x).astype(np.float64) for x in (dq, dk, dv)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_plain_attention_backward_follows_the_recipe(dtype):
    rng = np.random.default_rng(15)
    q, k, v = randn(rng, 2, 40, 4, 16), randn(rng, 2, 48, 2, 16), randn(rng, 2, 48, 2, 16)
    dout = randn(rng, *q.shape)
    plain = R.plain_attention_backward(dout, q, k, v, dtype=dtype)
    direct = plain_backward_recipe(dout, q, k, v, dtype)
    for p, d in zip(plain, direct):
        ulp = np.abs(d) * float(ml_dtypes.finfo(dtype).eps) + 1e-6
        assert np.all(np.abs(p - d) <= ulp)
        assert np.mean(p != d) < 0.02


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_plain_attention_backward_with_the_forward_output_given(dtype):
    """out = the plain forward's output gives the recomputing default; another out changes D only."""
    rng = np.random.default_rng(16)
    q, k, v = randn(rng, 2, 30, 4, 16), randn(rng, 2, 37, 2, 16), randn(rng, 2, 37, 2, 16)
    dout = randn(rng, *q.shape)
    default = R.plain_attention_backward(dout, q, k, v, causal=True, dtype=dtype)
    out = R.plain_attention(q, k, v, causal=True, dtype=dtype)
    given = R.plain_attention_backward(dout, q, k, v, causal=True, dtype=dtype, out=out)
    for a, b in zip(default, given):
        ulp = np.abs(a) * float(ml_dtypes.finfo(dtype).eps) + 1e-6
        assert np.all(np.abs(a - b) <= ulp)
    shifted = out.copy()
    shifted[0, 3, 1] += 0.5  # row 3 of head 1: D changes there
    moved = R.plain_attention_backward(dout, q, k, v, causal=True, dtype=dtype, out=shifted)
    assert np.array_equal(moved[2], given[2])  # dv does not use D
    changed = np.argwhere(np.abs(moved[0] - given[0]).max(axis=3) > 0)  # dq rows (b, s, h) that changed
    assert changed.tolist() == [[0, 3, 1]]
    with pytest.raises(ValueError, match="out must have shape"):
        R.plain_attention_backward(dout, q, k, v, dtype=dtype, out=out[:, :-1])


def test_given_out_removes_the_independent_rounding_of_d():
    """The GPU case that failed the 3x rule: fp16, one query row, two keys, scale 1 (seed 0). A
    flash-style backward (D from the fp16 forward output it is given, emulated here step by step in
    float32) had a dK error 3.4x the plain one while the plain backward recomputed its own O; given
    the same out, the plain error bounds it."""
    f16, f32 = np.float16, np.float32
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 1, 32), dtype=f32).astype(f16)
    k = rng.standard_normal((1, 2, 1, 32), dtype=f32).astype(f16)
    v = rng.standard_normal((1, 2, 1, 32), dtype=f32).astype(f16)
    dout = rng.standard_normal((1, 1, 1, 32), dtype=f32).astype(f16)
    Q, K, V, dO = (x[0, :, 0].astype(f32) for x in (q, k, v, dout))
    S = Q @ K.T
    m = S.max(axis=1, keepdims=True)
    e = np.exp2((S - m) * f32(np.log2(np.e)))
    l = e.sum(axis=1, keepdims=True)
    O16 = ((e.astype(f16).astype(f32) @ V) / l).astype(f16)  # the forward's output, as stored
    lse = m + np.log(l)
    P = np.exp2(S * f32(np.log2(np.e)) - lse * f32(np.log2(np.e)))
    dS = P * (dO @ V.T - (dO * O16.astype(f32)).sum(axis=1, keepdims=True))
    dk = (dS.astype(f16).astype(f32).T @ Q).astype(f16).astype(np.float64)
    ref = R.attention_backward(dout, q, k, v, softmax_scale=1.0)[1][0, :, 0]
    err = np.abs(dk - ref).max()
    recomputed = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16)[1][0, :, 0]
    given = R.plain_attention_backward(dout, q, k, v, softmax_scale=1.0, dtype=f16, out=O16[None, :, None])[1][0, :, 0]
    assert err > 3 * np.abs(recomputed - ref).max() + 1e-5  # what failed
    assert err <= 3 * np.abs(given - ref).max() + 1e-5  # what the comparison now uses


def test_plain_attention_fp16_is_coarser_than_float32_rounding():
    rng = np.random.default_rng(13)
    q, k, v = randn(rng, 1, 16, 2, 8), randn(rng, 1, 16, 2, 8), randn(rng, 1, 16, 2, 8)
    ref, _ = R.attention_forward(q, k, v)
    fp16 = R.max_abs_error(R.plain_attention(q, k, v, dtype=np.float16), ref)
    bf16 = R.max_abs_error(R.plain_attention(q, k, v, dtype=ml_dtypes.bfloat16), ref)
    fp32 = R.max_abs_error(R.plain_attention(q, k, v, dtype=np.float32), ref)
    assert 0 < fp32 < fp16 < bf16


def test_max_abs_error():
    a = np.array([[1.0, 2.0], [3.0, -np.inf]])
    b = np.array([[1.5, 2.0], [2.0, -np.inf]])
    assert R.max_abs_error(a, b) == 1.0               # equal -inf counts as 0
    assert R.max_abs_error(a.astype(np.float16), b) == 1.0
    assert R.max_abs_error(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    c = b.copy()
    c[0, 0] = np.nan
    assert math.isnan(R.max_abs_error(a, c))
    assert math.isnan(R.max_abs_error(c, a))
    assert R.max_abs_error(a, np.zeros((2, 2))) == math.inf
    with pytest.raises(ValueError, match="shape"):
        R.max_abs_error(a, b[:1])


def test_within_tolerance_rule():
    ref = np.zeros(4)
    plain = np.array([0.0, 1e-3, 0.0, 0.0])
    assert R.within_tolerance(np.full(4, 2e-3), ref, plain)
    assert R.within_tolerance(np.full(4, 2e-3 + 9e-6), ref, plain)
    assert not R.within_tolerance(np.full(4, 2e-3 + 2e-5), ref, plain)
    assert R.within_tolerance(np.full(4, 3e-3), ref, plain, factor=3.0)
    assert R.within_tolerance(np.full(4, 1e-6), ref, ref)          # atol only
    assert not R.within_tolerance(np.full(4, 1e-4), ref, ref)
    assert not R.within_tolerance(np.array([0.0, np.nan, 0, 0]), ref, plain)
    assert not R.within_tolerance(ref, ref, np.array([0.0, np.nan, 0, 0]))
    assert not R.within_tolerance(np.zeros(3), ref, plain)
    assert not R.within_tolerance(np.zeros((4, 1)), ref, plain)


# ---------------------------------------------------------------------------
# Empty dimensions
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch, sq, sk", [(0, 3, 4), (2, 0, 4), (2, 3, 0), (0, 0, 0)])
def test_empty_dims(batch, sq, sk):
    h, hkv, d = 4, 2, 3
    q, k, v = np.ones((batch, sq, h, d)), np.ones((batch, sk, hkv, d)), np.ones((batch, sk, hkv, d))
    for causal in (False, True):
        out, lse = R.attention_forward(q, k, v, causal=causal)
        assert out.shape == (batch, sq, h, d) and lse.shape == (batch, h, sq)
        assert np.all(out == 0) and np.all(np.isneginf(lse))
        dq, dk, dv = R.attention_backward(np.ones_like(q), q, k, v, causal=causal)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)
        plain = R.plain_attention(q, k, v, causal=causal, dtype=np.float16)
        assert plain.shape == q.shape and np.all(plain == 0)
        grads = R.plain_attention_backward(np.ones_like(q), q, k, v, causal=causal,
                                           dtype=np.float16)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    out, lse, kc, _ = R.attention_with_kvcache(q, np.ones((batch, 5, hkv, d)),
                                               np.ones((batch, 5, hkv, d)), cache_seqlens=sk)
    assert out.shape == q.shape and lse.shape == (batch, h, sq) and kc.shape == (batch, 5, hkv, d)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (5, 2)), (True, (7, -1)), (False, (-1, 3))])
def test_a_shifted_diagonal_is_a_block_of_the_whole(causal, window):
    """visible_mask and ALiBi of a (query piece, key piece) call with diag_shift = q0 - k0 - (lk - lq)
    are the whole sequence's on that block: the lse of each piece's rows against the whole's keys,
    merged, is the whole's lse."""
    n = 24
    whole = R.visible_mask(n, n, causal, window_size=window)
    for q0, lq, k0, lk in ((0, 8, 16, 8), (16, 8, 0, 8), (5, 7, 3, 13), (10, 14, 0, 24)):
        shift = q0 - k0 - (lk - lq)
        part = R.visible_mask(lq, lk, causal, window_size=window, diag_shift=shift)
        np.testing.assert_array_equal(part, whole[q0:q0 + lq, k0:k0 + lk])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for _ in range(3))
    kw = dict(causal=causal, window_size=window, alibi_slopes=np.array([0.5, 0.125]))
    _, lse = R.attention_forward(q, k, v, **kw)
    q0, lq = 9, 11
    pieces = [R.attention_forward(q[:, q0:q0 + lq], k[:, k0:k0 + 6], v[:, k0:k0 + 6], diag_shift=q0 - k0 - (6 - lq),
                                  **kw)[1] for k0 in range(0, n, 6)]  # fmt: skip
    np.testing.assert_allclose(np.logaddexp.reduce(np.stack(pieces), axis=0), lse[:, :, q0:q0 + lq], rtol=1e-12)

