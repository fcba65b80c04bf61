"""GPU tests of flash-attn's serving extras of attention_with_kvcache: rotary embedding of q and the new
k (rotary_cos / rotary_sin, both layouts), cache_batch_idx and cache_leftpad. Each extra is checked
against the same call with the extra done by hand (the rotation by cuflash.reference.apply_rotary, the
rows gathered, the padding cut away), which the decode tests check against the float64 reference, and
against cuflash.reference.attention_with_kvcache, which implements the extras itself."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, to_f64
from test_decode_gpu import case

pytestmark = pytest.mark.gpu


def _close(got, want, dtype, what, scale=1.0):
    """Outputs of two computations that differ only in roundings: within a few units of the dtype."""
    tol = (3e-2 if dtype == "bf16" else 4e-3) * scale
    err = float(np.max(np.abs(to_f64(got) - np.asarray(want, dtype=np.float64)))) if np.size(want) else 0.0
    assert err <= tol, f"max abs difference {err:.3g} > {tol:.3g} {what}"


def _cos_sin(rng, seqlen_ro, rotary_dim, dtype):
    import cupy

    inv = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(seqlen_ro)[:, None] * inv[None, :] + rng.uniform(0, 0.1)
    cos, sin = (cupy.asarray(f(angles).astype(DTYPES[dtype])) for f in (np.cos, np.sin))
    return cos, sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged, rotary_dim", [(False, 64), (True, 32), (False, 48)])
def test_rotary(interleaved, causal, paged, rotary_dim):
    """q and the new k rotated at flash-attn's positions; the rotated k is what lands in the cache; q, k
    themselves are untouched."""
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(rotary_dim + 2 * causal + interleaved)
    dt = "bf16" if interleaved else "fp16"
    c = case(rng, batch=3, seqlen_q=2, nheads=4, nheads_kv=2, head_dim=64, dtype=dt, capacity=256, lengths=[0, 100, 200],
             seqlen_new=2, page_size=64 if paged else None)  # fmt: skip
    cap = c["k_cache"].shape[1] * (c["block_table"].shape[1] if paged else 1)
    cos, sin = _cos_sin(rng, cap, rotary_dim, dt)
    kc0, vc0 = c["k_cache"].copy(), c["v_cache"].copy()
    q0, k0 = c["q"].copy(), c["k"].copy()
    out, lse = cuflash.attention_with_kvcache(
        c["q"], c["k_cache"], c["v_cache"], k=c["k"], v=c["v"], cache_seqlens=cupy.asarray(c["cache_seqlens"]),
        block_table=c["block_table"], causal=causal, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
        return_lse=True,
    )  # fmt: skip
    assert (c["q"] == q0).all() and (c["k"] == k0).all()
    # By hand: rotate on the host, round to the dtype, run without rotary on copies of the caches.
    lengths = c["cache_seqlens"].astype(np.int64)
    q_pos = lengths[:, None] + (np.arange(2)[None, :] if causal else 0)
    q_rot = np.stack([_rot_rows(q0[b].get(), cos.get(), sin.get(), q_pos[b], interleaved) for b in range(3)])
    k_rot = np.stack([_rot_rows(k0[b].get(), cos.get(), sin.get(), lengths[b] + np.arange(2), interleaved)
                      for b in range(3)])  # fmt: skip
    q_rot, k_rot = (cupy.asarray(x.astype(DTYPES[dt])) for x in (q_rot, k_rot))
    kc1, vc1 = kc0.copy(), vc0.copy()
    want, want_lse = cuflash.attention_with_kvcache(q_rot, kc1, vc1, k=k_rot, v=c["v"], cache_seqlens=c["cache_seqlens"],
                                                    block_table=c["block_table"], causal=causal, return_lse=True)  # fmt: skip
    _close(out, to_f64(want), dt, "out vs the rotation done by hand")
    _close(c["k_cache"], to_f64(kc1), dt, "k_cache vs the rotated k written by hand", scale=0.1)
    assert (c["v_cache"] == vc1).all()
    np.testing.assert_allclose(lse.get(), want_lse.get(), atol=2e-2)
    # And the float64 reference, which rotates by itself.
    ref = reference.attention_with_kvcache(q0, kc0, vc0, k=k0, v=c["v"], cache_seqlens=lengths,
                                           block_table=None if not paged else c["block_table"], causal=causal,
                                           rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)  # fmt: skip
    _close(out, ref[0], dt, "out vs reference.attention_with_kvcache", scale=2.0)


def _rot_rows(x, cos, sin, positions, interleaved):
    """x (tokens, heads, d) rotated at the given positions (float64, through reference.apply_rotary)."""
    from cuflash import reference

    out = np.empty(x.shape)
    for t, pos in enumerate(np.broadcast_to(positions, (x.shape[0],))):
        out[t] = reference.apply_rotary(x[t][None, None], cos, sin, interleaved=interleaved,
                                        seqlen_offsets=int(pos))[0, 0]  # fmt: skip
    return out


@pytest.mark.parametrize("host_idx", [False, True])
def test_cache_batch_idx(host_idx):
    """Sequence b reads and appends to cache row cache_batch_idx[b]; the other rows are untouched; the
    result equals the call on the gathered rows."""
    import cupy

    import cuflash

    rng = np.random.default_rng(5)
    c = case(rng, batch=5, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=128, capacity=512, lengths=[10, 500, 0, 77, 300],
             seqlen_new=3)  # fmt: skip
    big_k = cupy.concatenate([c["k_cache"], c["k_cache"][:2]])  # 7 rows, 5 sequences
    big_v = cupy.concatenate([c["v_cache"], c["v_cache"][:2]])
    idx = np.array([6, 0, 3, 2, 4], dtype=np.int32)
    before_k, before_v = big_k.copy(), big_v.copy()
    out = cuflash.attention_with_kvcache(c["q"], big_k, big_v, k=c["k"], v=c["v"], cache_seqlens=c["cache_seqlens"],
                                         causal=True, cache_batch_idx=idx if host_idx else cupy.asarray(idx),
                                         num_splits=0)  # fmt: skip
    gk, gv = before_k[cupy.asarray(idx)], before_v[cupy.asarray(idx)]
    want = cuflash.attention_with_kvcache(c["q"], gk, gv, k=c["k"], v=c["v"], cache_seqlens=c["cache_seqlens"],
                                          causal=True, num_splits=0)  # fmt: skip
    assert (out.view(cupy.uint16) == want.view(cupy.uint16)).all()
    assert (big_k[cupy.asarray(idx)] == gk).all() and (big_v[cupy.asarray(idx)] == gv).all()
    untouched = [r for r in range(7) if r not in idx]
    assert (big_k[untouched] == before_k[untouched]).all() and (big_v[untouched] == before_v[untouched]).all()


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("variant", ["plain", "causal", "window", "alibi"])
def test_cache_leftpad(num_splits, variant):
    """Keys before cache_leftpad[b] are never attended: the result equals the call on caches with the
    padding cut away (positions, causal alignment, windows and ALiBi distances all count from L_b)."""
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(9)
    lengths, pads = [300, 64, 500, 7], [100, 64, 3, 0]
    c = case(rng, batch=4, seqlen_q=2, nheads=4, nheads_kv=2, head_dim=64, capacity=512, lengths=lengths, seqlen_new=1)
    kw = {"causal": dict(causal=True), "window": dict(causal=True, window_size=(120, 0)),
          "alibi": dict(alibi_slopes=cupy.asarray(rng.uniform(0.01, 0.2, 4).astype(np.float32)))}.get(variant, {})  # fmt: skip
    kc0, vc0 = c["k_cache"].copy(), c["v_cache"].copy()
    out, lse = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], k=c["k"], v=c["v"],
                                              cache_seqlens=c["cache_seqlens"], cache_leftpad=cupy.asarray(np.array(pads, np.int32)),
                                              num_splits=num_splits, return_lse=True, **kw)  # fmt: skip
    # By hand: shift each row left by its padding.
    sk, sv = cupy.zeros_like(kc0), cupy.zeros_like(vc0)
    for b, p in enumerate(pads):
        sk[b, : 512 - p], sv[b, : 512 - p] = kc0[b, p:], vc0[b, p:]
    want, want_lse = cuflash.attention_with_kvcache(c["q"], sk, sv, k=c["k"], v=c["v"],
                                                    cache_seqlens=np.array(lengths) - np.array(pads),
                                                    num_splits=num_splits, return_lse=True, **kw)  # fmt: skip
    _close(out, to_f64(want), "bf16", f"{variant} splits={num_splits} vs the padding cut away", scale=0.5)
    np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)
    ref = reference.attention_with_kvcache(c["q"], kc0, vc0, k=c["k"], v=c["v"], cache_seqlens=lengths,
                                           cache_leftpad=pads, **kw)  # fmt: skip
    _close(out, ref[0], "bf16", f"{variant} splits={num_splits} vs reference", scale=1.0)


def test_leftpad_of_a_whole_sequence():
    """cache_leftpad == cache_seqlens (and no new token): the sequence has no key; out 0, lse -inf."""
    import cuflash

    rng = np.random.default_rng(2)
    c = case(rng, batch=2, seqlen_q=1, nheads=2, nheads_kv=1, head_dim=64, capacity=128, lengths=[50, 64])
    out, lse = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[50, 64],
                                              cache_leftpad=[50, 0], return_lse=True)  # fmt: skip
    assert (to_f64(out[0]) == 0).all() and np.isneginf(lse[0].get()).all()
    assert np.isfinite(lse[1].get()).all()


def test_extras_errors():
    import cupy

    import cuflash

    rng = np.random.default_rng(0)
    c = case(rng, batch=2, seqlen_q=1, nheads=2, nheads_kv=1, head_dim=64, capacity=64, lengths=[10, 20])
    p = case(rng, batch=2, seqlen_q=1, nheads=2, nheads_kv=1, head_dim=64, capacity=64, lengths=[10, 20], page_size=16)
    f = cuflash.attention_with_kvcache
    with pytest.raises(ValueError, match="cache_batch_idx picks rows of a contiguous cache"):
        f(p["q"], p["k_cache"], p["v_cache"], block_table=p["block_table"], cache_seqlens=[1, 1], cache_batch_idx=[0, 1])
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 2 is not a row of the cache"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[1, 1], cache_batch_idx=[0, 2])
    with pytest.raises(TypeError, match="cache_batch_idx must be int32"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[1, 1], cache_batch_idx=cupy.zeros(2, cupy.int64))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = 11 must be in \[0, cache_seqlens\[0\] = 10\]"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], cache_leftpad=[11, 0])
    with pytest.raises(ValueError, match="cache_leftpad must have shape"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], cache_leftpad=[1, 2, 3])
    cos, sin = _cos_sin(rng, 64, 32, "bf16")
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], rotary_cos=cos)
    with pytest.raises(TypeError, match="rotary_cos must have q's dtype"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], rotary_cos=cos.astype(cupy.float32),
          rotary_sin=sin.astype(cupy.float32))  # fmt: skip
    with pytest.raises(ValueError, match="rows; this call can rotate at positions up to 64"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], rotary_cos=cos[:10], rotary_sin=sin[:10])
    wide_cos, wide_sin = _cos_sin(rng, 64, 66, "bf16")
    with pytest.raises(ValueError, match="rotary_dim"):
        f(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=[10, 20], rotary_cos=wide_cos, rotary_sin=wide_sin)
