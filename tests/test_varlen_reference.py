"""The float64 reference of packed variable-length batches and of rotary embedding (CPU only): against
the dense reference per sequence, and rotary against complex multiplication."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference


def _packed(rng, lens_q, lens_k, nheads=4, nheads_kv=2, d=8):
    q = rng.standard_normal((sum(lens_q), nheads, d))
    k = rng.standard_normal((sum(lens_k), nheads_kv, d))
    v = rng.standard_normal((sum(lens_k), nheads_kv, d))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 1), softcap=2.0),
                                dict(causal=True, alibi_slopes="batch", dropout_p=0.3, rng_state=(9, 4))])  # fmt: skip
def test_equal_lengths_pack_to_the_dense_call(kw):
    """A packed batch of equal lengths is the dense batch: outputs, lse, gradients, the ALiBi slopes and
    the dropout stream of sequence b are those of batch index b."""
    rng = np.random.default_rng(0)
    b, sq, sk = 3, 7, 11
    q, k, v, cu_q, cu_k = _packed(rng, [sq] * b, [sk] * b)
    if kw.get("alibi_slopes") == "batch":
        kw = dict(kw, alibi_slopes=rng.uniform(0.1, 0.5, (b, 4)))
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    dense = [x.reshape(b, -1, *x.shape[1:]) for x in (q, k, v, dout)]
    want, want_lse = reference.attention_forward(*dense[:3], **kw)
    np.testing.assert_allclose(out, want.reshape(out.shape), atol=1e-13)
    np.testing.assert_allclose(lse, want_lse.transpose(1, 0, 2).reshape(lse.shape), atol=1e-13)
    grads = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **kw)
    want_grads = reference.attention_backward(dense[3], *dense[:3], **kw)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w.reshape(g.shape), atol=1e-12)


def test_ragged_and_empty_sequences_are_each_their_own_attention():
    rng = np.random.default_rng(1)
    lens_q, lens_k = [5, 0, 9, 3], [12, 4, 2, 0]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k)
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True, window_size=(4, -1))
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, window_size=(4, -1))
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        want, want_lse = reference.attention_forward(q[qs][None], k[ks][None], v[ks][None], causal=True,
                                                     window_size=(4, -1))  # fmt: skip
        np.testing.assert_allclose(out[qs], want[0], atol=1e-13)
        np.testing.assert_allclose(lse[:, qs], want_lse[0], atol=1e-13)
        if lens_k[b]:
            g = reference.attention_backward(dout[qs][None], q[qs][None], k[ks][None], v[ks][None], causal=True,
                                             window_size=(4, -1))  # fmt: skip
            np.testing.assert_allclose(dq[qs], g[0][0], atol=1e-12)
            np.testing.assert_allclose(dk[ks], g[1][0], atol=1e-12)
            np.testing.assert_allclose(dv[ks], g[2][0], atol=1e-12)
    # the query rows of sequence 3 see no key: 0 and -inf
    assert (out[cu_q[3]:cu_q[4]] == 0).all() and np.isneginf(lse[:, cu_q[3]:cu_q[4]]).all()
    assert (dq[cu_q[3]:cu_q[4]] == 0).all()


@pytest.mark.parametrize("cu,match", [([1, 3], "start at 0"), ([0, 5, 3], "never decrease"), ([0, 99], "end at most"),
                                      ([0.0, 3.0], "integer")])  # fmt: skip
def test_bad_cu_seqlens(cu, match):
    q = np.zeros((10, 2, 4))
    with pytest.raises(ValueError, match=match):
        reference.attention_varlen_forward(q, q, q, np.asarray(cu), np.asarray([0, 3, 5][: len(cu)]))


def test_rotary_is_complex_multiplication():
    rng = np.random.default_rng(2)
    b, s, h, d, rd = 2, 6, 3, 10, 6
    x = rng.standard_normal((b, s, h, d))
    theta = rng.uniform(0, 6.3, (20, rd // 2))
    cos, sin = np.cos(theta), np.sin(theta)
    offsets = np.array([0, 7])
    got = reference.apply_rotary(x, cos, sin, seqlen_offsets=offsets)
    got_i = reference.apply_rotary(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    for bi in range(b):
        rot = np.exp(1j * theta[offsets[bi]:offsets[bi] + s])[:, None, :]
        neox = (x[bi, ..., : rd // 2] + 1j * x[bi, ..., rd // 2 : rd]) * rot
        np.testing.assert_allclose(got[bi, ..., : rd // 2], neox.real, atol=1e-13)
        np.testing.assert_allclose(got[bi, ..., rd // 2 : rd], neox.imag, atol=1e-13)
        gptj = (x[bi, ..., 0:rd:2] + 1j * x[bi, ..., 1:rd:2]) * rot
        np.testing.assert_allclose(got_i[bi, ..., 0:rd:2], gptj.real, atol=1e-13)
        np.testing.assert_allclose(got_i[bi, ..., 1:rd:2], gptj.imag, atol=1e-13)
    np.testing.assert_array_equal(got[..., rd:], x[..., rd:])  # channels past rotary_dim pass through
    with pytest.raises(ValueError, match="seqlen_offsets"):
        reference.apply_rotary(x, cos, sin, seqlen_offsets=15)
    with pytest.raises(ValueError, match="rotary_dim"):
        reference.apply_rotary(x, np.ones((20, 6)), np.ones((20, 6)))


# ---------------------------------------------------------------------------------------------
# The KV-cache extras: cache_batch_idx, cache_leftpad, rotary on q and the new k
# ---------------------------------------------------------------------------------------------


def _kv_case(rng, batch=3, rows=5, slots=40, nheads=4, nheads_kv=2, d=8, seqlen_q=2, seqlen_new=2):
    q = rng.standard_normal((batch, seqlen_q, nheads, d))
    kc = rng.standard_normal((rows, slots, nheads_kv, d))
    vc = rng.standard_normal((rows, slots, nheads_kv, d))
    kn = rng.standard_normal((batch, seqlen_new, nheads_kv, d))
    vn = rng.standard_normal((batch, seqlen_new, nheads_kv, d))
    return q, kc, vc, kn, vn


def test_cache_batch_idx_and_leftpad():
    rng = np.random.default_rng(3)
    q, kc, vc, kn, vn = _kv_case(rng)
    idx, lens, pad = np.array([4, 0, 2]), np.array([30, 7, 12]), np.array([5, 0, 12])
    out, lse, kc2, vc2 = reference.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                                          cache_batch_idx=idx, cache_leftpad=pad)  # fmt: skip
    for b in range(3):
        np.testing.assert_array_equal(kc2[idx[b], lens[b]:lens[b] + 2], kn[b])  # appended into row idx[b]
        keys = slice(pad[b], lens[b] + 2)  # the padding before cache_leftpad is not attended to
        want, want_lse = reference.attention_forward(q[b:b + 1], kc2[idx[b], keys][None], vc2[idx[b], keys][None],
                                                     causal=True)  # fmt: skip
        np.testing.assert_allclose(out[b], want[0], atol=1e-13)
        np.testing.assert_allclose(lse[b], want_lse[0], atol=1e-13)
    untouched = [r for r in range(5) if r not in idx]
    np.testing.assert_array_equal(kc2[untouched], kc[untouched])
    with pytest.raises(ValueError, match="cache_batch_idx"):
        reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=np.array([0, 5, 1]))
    with pytest.raises(ValueError, match="cache_leftpad"):
        reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=np.array([0, 8, 0]))


@pytest.mark.parametrize("causal,window,interleaved", [(True, (-1, -1), False), (False, (-1, -1), True),
                                                        (False, (6, 0), False)])  # fmt: skip
def test_rotary_rotates_q_and_the_new_k_at_their_positions(causal, window, interleaved):
    rng = np.random.default_rng(4)
    q, kc, vc, kn, vn = _kv_case(rng, rows=3)
    lens, pad = np.array([10, 3, 20]), np.array([2, 0, 5])
    theta = rng.uniform(0, 6.3, (64, 3))  # rotary_dim 6 of head dim 8
    cos, sin = np.cos(theta), np.sin(theta)
    out, _, kc2, vc2 = reference.attention_with_kvcache(
        q, kc, vc, k=kn, v=vn, cache_seqlens=lens, cache_leftpad=pad, causal=causal, window_size=window,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)  # fmt: skip
    local = causal or window != (-1, -1)
    for b in range(3):
        first = lens[b] - pad[b]
        want_k = reference.apply_rotary(kn[b:b + 1], cos, sin, interleaved=interleaved, seqlen_offsets=first)[0]
        np.testing.assert_allclose(kc2[b, lens[b]:lens[b] + 2], want_k, atol=1e-13)
        if local:
            q_b = reference.apply_rotary(q[b:b + 1], cos, sin, interleaved=interleaved, seqlen_offsets=first)
        else:  # every query token at the position of the first new token
            q_b = np.stack([reference.apply_rotary(q[b:b + 1, i:i + 1], cos, sin, interleaved=interleaved,
                                                   seqlen_offsets=first)[0, 0] for i in range(2)])[None]  # fmt: skip
        keys = slice(pad[b], lens[b] + 2)
        want = reference.attention_forward(q_b, kc2[b, keys][None], vc2[b, keys][None], causal=causal,
                                           window_size=window)[0]  # fmt: skip
        np.testing.assert_allclose(out[b], want[0], atol=1e-12)
    with pytest.raises(ValueError, match="together"):
        reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, rotary_cos=cos)
    with pytest.raises(ValueError, match="rotary positions"):
        reference.attention_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=np.array([35, 0, 0]), causal=True,
                                         rotary_cos=cos[:30], rotary_sin=sin[:30])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The API's host-side checks of cu_seqlens (cuflash.varlen.validate_cu_seqlens, pure NumPy)
# ---------------------------------------------------------------------------------------------


def test_validate_cu_seqlens():
    from cuflash.varlen import validate_cu_seqlens

    np.testing.assert_array_equal(validate_cu_seqlens("cu_seqlens_q", np.array([0, 3, 3, 10]), 10, 7), [3, 0, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        validate_cu_seqlens("cu_seqlens_q", np.array([1, 3]), 10)
    with pytest.raises(ValueError, match=r"must not decrease: cu_seqlens_k\[2\] = 2 < cu_seqlens_k\[1\] = 5"):
        validate_cu_seqlens("cu_seqlens_k", np.array([0, 5, 2]), 10)
    with pytest.raises(ValueError, match="exceeds the 10 packed rows"):
        validate_cu_seqlens("cu_seqlens_q", np.array([0, 5, 11]), 10)
    with pytest.raises(ValueError, match="sequence 1 has 6 rows in cu_seqlens_q, more than max_seqlen_q = 5"):
        validate_cu_seqlens("cu_seqlens_q", np.array([0, 4, 10]), 10, 5)


def test_varlen_search_model_never_names_sequence_minus_one():
    """A model of varlen.cuh's 32-way search (varlen_find_seq, VarlenTile): for valid prefix sums every
    (sequence, tile) pair gets exactly one slot; for a bad cu[0] >= block (unchecked input) the slots
    before f(0) resolve to sequence 0 and are skipped, never to sequence -1 (an out-of-bounds index)."""
    rng = np.random.default_rng(1)

    def find(cu, total, block, t):
        batch, span, lo = len(cu) - 1, 1, 0
        while span < batch:
            span *= 32
        while span > 1:
            step = span // 32
            ok = [lo + i * step < batch and min(max(cu[lo + i * step], 0), total) // block + lo + i * step <= t
                  for i in range(32)]  # fmt: skip
            lo += max(sum(ok) - 1, 0) * step
            span //= 32
        return lo

    def slots(cu, total, block):
        owned = []
        for t in range(total // block + len(cu) - 1):
            b = find(cu, total, block, t)
            assert 0 <= b < len(cu) - 1
            start = min(max(cu[b], 0), total)
            n = -(-max(min(max(cu[b + 1], 0), total) - start, 0) // block)
            m = t - (start // block + b)
            if 0 <= m < n:
                owned.append((b, m))
        return owned

    for _ in range(300):
        block = int(rng.choice([64, 128]))
        lengths = rng.integers(0, 400, size=int(rng.integers(1, 70)))
        cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        owned = slots(cu, cu[-1], block)
        want = [(b, m) for b, n in enumerate(lengths) for m in range(-(-int(n) // block))]
        assert sorted(owned) == want
    slots([256, 300, 400], 400, 128)  # cu[0] >= block: no sequence -1


def test_find_seq_test_kernel_compiles():
    """The kernel test_varlen_gpu runs varlen_find_seq through compiles against varlen.cuh (NVRTC, no GPU)."""
    pytest.importorskip("cupy")
    from nvrtc_util import FIND_SEQ_SOURCE, compile_static_asserts

    compile_static_asserts(FIND_SEQ_SOURCE.splitlines(), "find_seq.cu", arch="sm_80")
