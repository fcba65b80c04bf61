"""GPU tests of packed variable-length batches (cuflash.attention_varlen and its backward) on the
mma.sync and (on Hopper) wgmma kernels: each sequence against the float64 reference run on that
sequence alone, with DESIGN.md's rules (outputs and lse 2x, gradients 3x the plain low-precision
error of the same sequence), and the packed call against the dense one where both exist."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_util import DTYPES, check_lse, nan_recycled_memory, poisoned, to_f64

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))


def _packed(rng, lengths, nheads, head_dim, dtype):
    import cupy

    host = rng.standard_normal((int(sum(lengths)), nheads, head_dim), dtype=np.float32).astype(DTYPES[dtype])
    return cupy.asarray(host)


def _cu(lengths):
    import cupy

    return cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _slopes(rng, batch, nheads, per_batch):
    import cupy

    base = 2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads)
    shape = (batch, nheads) if per_batch else (nheads,)
    return cupy.asarray((base * rng.uniform(0.5, 1.5, size=shape)).astype(np.float32))


def _seq_variants(variants, b):
    """The variants sequence b runs with, as a batch of one (its row of per-batch ALiBi slopes)."""
    v = dict(variants)
    slopes = v.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        v["alibi_slopes"] = slopes[b : b + 1]
    return v


def _check_seq_forward(out, lse, q, k, v, cu_q, cu_k, *, causal, scale, dtype, what, **variants):
    """Each sequence's rows of out and lse against the reference of that sequence alone."""
    from cuflash import reference

    cq, ck = cu_q.get(), cu_k.get()
    got_all, lse_all = to_f64(out), lse
    for b in range(cq.size - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if qs.stop == qs.start:
            continue
        q1, k1, v1 = q[qs][None], k[ks][None], v[ks][None]
        var = _seq_variants(variants, b)
        if ks.stop == ks.start:  # no key: out 0, lse -inf
            assert (got_all[qs] == 0).all(), f"sequence {b} without keys: out must be 0 {what}"
            assert np.isneginf(lse_all[:, qs].get()).all(), f"sequence {b} without keys: lse must be -inf {what}"
            continue
        ref, ref_lse = reference.attention_forward(q1, k1, v1, causal=causal, softmax_scale=scale, **var)
        plain = reference.plain_attention_bar(q1, k1, v1, ref, causal=causal, softmax_scale=scale, dtype=DTYPES[dtype],
                                              **var)  # fmt: skip
        got = got_all[qs][None]
        err = reference.max_abs_error(got, ref)
        bound = 2 * reference.max_abs_error(plain, ref) + 1e-5
        assert reference.within_tolerance(got, ref, plain), f"sequence {b}: max abs error {err:.3g} > {bound:.3g} {what}"
        check_lse(lse_all[:, qs][None], ref_lse, f"sequence {b} {what}")


def _check_seq_backward(grads, dout, q, k, v, out, cu_q, cu_k, *, causal, scale, dtype, what, **variants):
    from cuflash import reference

    cq, ck = cu_q.get(), cu_k.get()
    dq, dk, dv = (to_f64(x) for x in grads)
    for b in range(cq.size - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if ks.stop == ks.start:
            assert (dq[qs] == 0).all(), f"sequence {b} without keys: dq must be 0 {what}"
            continue
        if qs.stop == qs.start:
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all(), f"sequence {b} without queries: dk, dv must be 0 {what}"
            continue
        args = [x[s][None] for x, s in ((dout, qs), (q, qs), (k, ks), (v, ks))]
        var = _seq_variants(variants, b)
        refs = reference.attention_backward(*args, causal=causal, softmax_scale=scale, **var)
        plains = reference.plain_attention_backward_bar(*args, refs, causal=causal, softmax_scale=scale,
                                                        dtype=DTYPES[dtype], out=out[qs][None], **var)  # fmt: skip
        for name, got, ref, plain in zip(("dq", "dk", "dv"), (dq[qs], dk[ks], dv[ks]), refs, plains):
            err = reference.max_abs_error(got[None], ref)
            bound = 3 * reference.max_abs_error(plain, ref) + 1e-5
            assert reference.within_tolerance(got[None], ref, plain, factor=3.0), (
                f"sequence {b} {name}: max abs error {err:.3g} > {bound:.3g} {what}")


@st.composite
def varlen_cases(draw):
    long_ = draw(st.booleans())  # half the cases have one sequence of up to a few thousand tokens
    batch = draw(st.integers(1, 3 if long_ else 6))
    lengths_q = draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    same = draw(st.booleans())
    lengths_k = list(lengths_q) if same else draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    if long_:  # (one long sequence keeps the float64 reference of a case within seconds)
        b = draw(st.integers(0, batch - 1))
        lengths_q[b] = draw(st.integers(300, 2500))
        lengths_k[b] = lengths_q[b] if same else draw(st.integers(300, 2500))
    nheads_kv = draw(st.integers(1, 2))
    window = draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(0, 300), st.one_of(st.just(-1), st.integers(0, 64)))))
    return dict(
        dtype=draw(st.sampled_from(["bf16", "fp16"])),
        head_dim=draw(st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 256))),
        nheads_kv=nheads_kv, nheads=nheads_kv * draw(st.sampled_from([1, 2] if long_ else [1, 2, 3])),
        lengths_q=lengths_q, lengths_k=lengths_k, causal=draw(st.booleans()), window=window,
        softcap=draw(st.sampled_from([0.0, 0.0, 20.0])), alibi=draw(st.sampled_from([None, None, "heads", "batch"])),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))), seed=draw(st.integers(0, 2**32 - 1)),
        deterministic=draw(st.booleans()), kernel=draw(st.sampled_from(["plan", "mma.sync", "cp.async"])),
    )  # fmt: skip


def _case_inputs(case):
    rng = np.random.default_rng(case["seed"])
    dt, d = case["dtype"], case["head_dim"]
    q = _packed(rng, case["lengths_q"], case["nheads"], d, dt)
    k = _packed(rng, case["lengths_k"], case["nheads_kv"], d, dt)
    v = _packed(rng, case["lengths_k"], case["nheads_kv"], d, dt)
    variants = dict(window_size=case["window"], softcap=case["softcap"])
    if case["alibi"] is not None:
        variants["alibi_slopes"] = _slopes(rng, len(case["lengths_q"]), case["nheads"], case["alibi"] == "batch")
    return rng, q, k, v, _cu(case["lengths_q"]), _cu(case["lengths_k"]), variants


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=varlen_cases())
def test_varlen_property(case):
    """Packed batches of lengths 0 .. a few thousand, q and k lengths different per sequence, any head
    dim, GQA, causal and windowed (with softcap / ALiBi sometimes), both dtypes: forward outputs and lse,
    then the backward's gradients, each sequence against the reference of that sequence alone."""
    import cupy

    from cuflash import varlen

    rng, q, k, v, cu_q, cu_k, variants = _case_inputs(case)
    dt, what = case["dtype"], f"case {case}"
    fwd_tile, bwd_tile = _tiles(case["kernel"], case["head_dim"])
    if case["deterministic"] and case["kernel"] == "cp.async":
        bwd_tile = None  # (ordered dQ additions run the mma.sync kernel)
    max_q, max_k = max(case["lengths_q"]), max(case["lengths_k"])
    out = poisoned(q.shape, dt)
    res = varlen.run(q, k, v, cu_q, cu_k, max_q, max_k, causal=case["causal"], softmax_scale=case["scale"],
                     return_lse=True, out=out, check=True, tile=fwd_tile, **variants)  # fmt: skip
    assert res[0] is out and res[1].shape == (case["nheads"], q.shape[0])
    _check_seq_forward(out, res[1], q, k, v, cu_q, cu_k, causal=case["causal"], scale=case["scale"], dtype=dt, what=what,
                       **variants)  # fmt: skip
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(DTYPES[dt]))
    grads = [poisoned(x.shape, dt) for x in (q, k, v)]
    ret = varlen.run_backward(dout, q, k, v, out, res[1], cu_q, cu_k, max_q, max_k, causal=case["causal"],
                              softmax_scale=case["scale"], deterministic=case["deterministic"], dq=grads[0], dk=grads[1],
                              dv=grads[2], tile=bwd_tile, **variants)  # fmt: skip
    assert all(r is g for r, g in zip(ret, grads))
    _check_seq_backward(grads, dout, q, k, v, out, cu_q, cu_k, causal=case["causal"], scale=case["scale"], dtype=dt,
                        what=what, **variants)  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("variant", ["plain", "causal", "window", "alibi", "dropout"])
def test_varlen_equal_lengths_match_dense(head_dim, variant):
    """A packed batch of equal lengths runs the math of the dense call: out, lse, gradients agree
    (ALiBi per batch row and the dropout stream use sequence b as batch index b)."""
    import cupy

    import cuflash

    rng = np.random.default_rng(head_dim)
    batch, seqlen, nheads, nheads_kv = 3, 333, 4, 2
    qd, kd, vd = (cupy.asarray(rng.standard_normal((batch, seqlen, h, head_dim), dtype=np.float32).astype(DTYPES["bf16"]))
                  for h in (nheads, nheads_kv, nheads_kv))  # fmt: skip
    causal = variant in ("causal", "window")
    variants = {"window": dict(window_size=(100, 0)), "alibi": dict(alibi_slopes=_slopes(rng, batch, nheads, True)),
                "dropout": dict(dropout_p=0.2, rng_state=(1234, 8))}.get(variant, {})  # fmt: skip
    dense = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, **variants)
    cu = _cu([seqlen] * batch)
    pack = lambda x: x.reshape(batch * seqlen, *x.shape[2:])  # noqa: E731
    packed = cuflash.attention_varlen(pack(qd), pack(kd), pack(vd), cu, cu, seqlen, seqlen, causal=causal,
                                      return_lse=True, **variants)  # fmt: skip
    np.testing.assert_allclose(to_f64(packed[0]), to_f64(pack(dense[0])), atol=2e-2, rtol=0)
    lse_dense = dense[1].get().transpose(1, 0, 2).reshape(nheads, batch * seqlen)
    np.testing.assert_allclose(packed[1].get(), lse_dense, rtol=1e-4, atol=1e-4)
    dout = cupy.asarray(rng.standard_normal(qd.shape, dtype=np.float32).astype(DTYPES["bf16"]))
    g_dense = cuflash.attention_backward(dout, qd, kd, vd, dense[0], dense[1], causal=causal, **variants)
    g_packed = cuflash.attention_varlen_backward(pack(dout), pack(qd), pack(kd), pack(vd), packed[0], packed[1], cu, cu,
                                                 seqlen, seqlen, causal=causal, **variants)  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dv"), g_packed, g_dense):
        scale = float(np.abs(to_f64(b)).max())
        np.testing.assert_allclose(to_f64(a), to_f64(pack(b)), atol=2e-2 * max(1.0, scale), rtol=0, err_msg=name)


def _tiles(kernel, head_dim):
    """(forward tile, backward tile) that force a kernel family: "mma.sync", "cp.async" (the Hopper
    kernels without TMA, the TMA ones' fallback; the planner's choice where they cannot run), or
    "plan": None, None for the planner's choice (on Hopper the TMA kernels at head dims 64 / 128), or
    "wide": the TMA backward with wide query blocks (128 rows at head dim 64, 80 at 128, on sm_90a; (None,
    None) elsewhere)."""
    from cuflash import jit, plan

    bucket, arch = plan.head_dim_bucket(head_dim), jit.device_arch(0)
    if kernel == "wide":
        runs = arch == "sm_90a" and head_dim % 8 == 0 and bucket in plan.BWD_SM90_WS_WIDE_ROWS
        rows = plan.BWD_SM90_WS_WIDE_ROWS.get(bucket, 64)
        return (None, plan.BwdSm90WsTile(block_m=rows, stages=3 if rows == 128 else 2)) if runs else (None, None)
    if kernel == "cp.async":
        runs = arch == "sm_90a" and head_dim % 8 == 0 and bucket in plan.BWD_SM90_TILES
        return (plan.FWD_SM90_TILES[bucket], plan.BWD_SM90_TILES[bucket]) if runs else (None, None)
    if kernel == "plan":
        return None, None
    return plan.fwd_tile(bucket, arch), plan.bwd_tile(bucket, arch)


@pytest.mark.parametrize("kernel", ["plan", "mma.sync", "cp.async", "wide"])
@pytest.mark.parametrize("head_dim", [128, 64, 100])
def test_varlen_ragged_edges(kernel, head_dim):
    """Zero-length sequences (q, k or both), one very long sequence among short ones, sequences of one
    token, and a query sequence with no keys; forward and backward, causal or not, on the planner's
    kernel (on Hopper the TMA ones for 64 and 128), the Hopper cp.async one or the mma.sync one,
    16-byte and element-wise loads; in memory that held NaN (scratch buffers the kernels must write
    or zero first, the dQ accumulator among them)."""
    import cupy

    from cuflash import varlen

    fwd_tile, bwd_tile = _tiles(kernel, head_dim)
    if kernel == "cp.async" and bwd_tile is None:
        pytest.skip("the Hopper cp.async kernels run on sm_90a at 16-byte aligned head dims")
    if kernel == "wide" and bwd_tile is None:
        pytest.skip("wide query blocks: the TMA backward at head dims 64 and 128 on sm_90a")
    lengths_q = [0, 5, 1, 2100, 0, 77, 3, 129]
    lengths_k = [3, 0, 1, 2000, 0, 200, 3, 128]
    rng = np.random.default_rng(7)
    q, k, v = (_packed(rng, n, h, head_dim, "fp16") for n, h in ((lengths_q, 2), (lengths_k, 1), (lengths_k, 1)))
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    with nan_recycled_memory():
        for causal in (False, True):
            out = poisoned(q.shape, "fp16")
            _, lse = varlen.run(q, k, v, cu_q, cu_k, 2100, 2000, causal=causal, return_lse=True, out=out, tile=fwd_tile)
            _check_seq_forward(out, lse, q, k, v, cu_q, cu_k, causal=causal, scale=None, dtype="fp16", what=f"causal={causal}")
            dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(DTYPES["fp16"]))
            grads = [poisoned(x.shape, "fp16") for x in (q, k, v)]
            varlen.run_backward(dout, q, k, v, out, lse, cu_q, cu_k, 2100, 2000, causal=causal, dq=grads[0], dk=grads[1],
                                dv=grads[2], tile=bwd_tile)  # fmt: skip
            _check_seq_backward(grads, dout, q, k, v, out, cu_q, cu_k, causal=causal, scale=None, dtype="fp16",
                                what=f"causal={causal}")  # fmt: skip


def test_seqused_k():
    """seqused_k: sequence b attends to its first seqused_k[b] keys only; the unused keys' dk, dv are 0."""
    import cupy

    import cuflash

    rng = np.random.default_rng(3)
    lengths, used = [300, 200, 64], [100, 200, 0]
    q = _packed(rng, lengths, 2, 64, "bf16")
    k, v = _packed(rng, lengths, 2, 64, "bf16"), _packed(rng, lengths, 2, 64, "bf16")
    cu = _cu(lengths)
    seqused = cupy.asarray(np.array(used, dtype=np.int32))
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 300, 300, seqused_k=seqused, return_lse=True, check=True)
    # The same as packing only the used keys.
    keep = np.concatenate([np.arange(s, s + u) for s, u in zip(np.cumsum([0] + lengths[:-1]), used)])
    k_used, v_used = k[cupy.asarray(keep)], v[cupy.asarray(keep)]
    cu_used = _cu(used)
    ref_out, ref_lse = cuflash.attention_varlen(q, k_used, v_used, cu, cu_used, 300, 200, return_lse=True)
    np.testing.assert_array_equal(to_f64(out), to_f64(ref_out))
    np.testing.assert_array_equal(lse.get(), ref_lse.get())
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(DTYPES["bf16"]))
    dk = poisoned(k.shape, "bf16")
    _, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, 300, 300, seqused_k=seqused, dk=dk)
    _, dk_u, dv_u = cuflash.attention_varlen_backward(dout, q, k_used, v_used, ref_out, ref_lse, cu, cu_used, 300, 200)
    mask = np.zeros(k.shape[0], bool)
    mask[keep] = True
    np.testing.assert_allclose(to_f64(dk)[mask], to_f64(dk_u), atol=1e-2)
    np.testing.assert_allclose(to_f64(dv)[mask], to_f64(dv_u), atol=1e-2)
    assert (to_f64(dk)[~mask] == 0).all() and (to_f64(dv)[~mask] == 0).all()


#: (what, head dim, call keywords, seqused_k): the planned TMA kernels (persistent short-key tile, and the
#: default tile past SHORT_KEYS), GQA with a window and softcap, the mma.sync kernel (head dim 33) and
#: seqused_k, whose pointer the prepared path patches too.
PREPARED_VARLEN_CASES = [
    ("hd64 short keys", 64, dict(causal=False), False),
    ("hd128 causal seqused_k", 128, dict(causal=True), True),
    ("hd128 long keys", 128, dict(causal=True, max_seqlen=5000), False),
    ("hd256 GQA window softcap", 256, dict(window_size=(64, 0), softcap=20.0, kv_heads=1), False),
    ("hd33 (mma.sync, element-wise loads)", 33, dict(causal=True), False),
]  # fmt: skip


@pytest.mark.parametrize("what, head_dim, kw, used", PREPARED_VARLEN_CASES)
def test_prepared_varlen_forward(monkeypatch, what, head_dim, kw, used):
    """A signature seen before (varlen._signature) takes the prepared path: no checks, the pointers of the
    new q, k, v, out, lse, prefix sums and seqused_k patched into the first call's record. Three calls
    with new arrays each, the second with other lengths in prefix sums of the same shape (their values are
    read by the kernel only): each sequence against the float64 reference; then the prepared call and the
    whole way for the same arrays give the same bits."""
    import math

    import cupy

    import cuflash
    from cuflash import varlen

    kw = dict(kw)
    mx, hkv = kw.pop("max_seqlen", 300), kw.pop("kv_heads", 2)
    seen = []
    real = varlen._check_inputs
    monkeypatch.setattr(varlen, "_check_inputs", lambda *a, **k: seen.append(1) or real(*a, **k))
    varlen._PREPARED.calls.clear()
    rng = np.random.default_rng(head_dim)
    layouts = ([300, 0, 129, 71], [100, 250, 150, 0], [300, 0, 129, 71])  # (500 tokens each)
    for step, lengths in enumerate(layouts):
        del seen[:]
        q = _packed(rng, lengths, 2, head_dim, "bf16")
        k, v = _packed(rng, lengths, hkv, head_dim, "bf16"), _packed(rng, lengths, hkv, head_dim, "bf16")
        cu = _cu(lengths)
        cu_k = cu
        seqused = None
        if used:  # the used keys as a packing of their own, for the reference
            n_used = [min(n, 90) for n in lengths]
            seqused = cupy.asarray(np.array(n_used, dtype=np.int32))
            keep = np.concatenate([np.arange(s, s + u) for s, u in zip(np.cumsum([0] + lengths[:-1]), n_used)])
            k_ref, v_ref, cu_k = k[cupy.asarray(keep)], v[cupy.asarray(keep)], _cu(n_used)
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, mx, mx, seqused_k=seqused, return_lse=True, **kw)
        assert bool(seen) == (step == 0), f"{what}: call {step} {'took' if seen else 'skipped'} the checks"
        _check_seq_forward(out, lse, q, k_ref if used else k, v_ref if used else v, cu, cu_k,
                           causal=kw.get("causal", False), scale=1 / math.sqrt(head_dim), dtype="bf16",
                           what=f"{what} call {step}", **{n: kw[n] for n in ("window_size", "softcap") if n in kw})  # fmt: skip
    assert len(varlen._PREPARED.calls) == 1
    results = []
    for step in range(3):  # a given out: the whole way (a signature of its own), prepared, then the whole way again
        if step == 2:
            varlen._PREPARED.calls.clear()
        del seen[:]
        given = poisoned(q.shape, "bf16")
        got = cuflash.attention_varlen(q, k, v, cu, cu, mx, mx, seqused_k=seqused, return_lse=True, out=given, **kw)
        assert got[0] is given and bool(seen) == (step != 1), f"{what}: given out, call {step}"
        results.append(got)
    for got in results[1:]:
        assert cupy.array_equal(results[0][0].view(cupy.uint16), got[0].view(cupy.uint16)), what
        assert cupy.array_equal(results[0][1], got[1]), what


def test_prepared_varlen_follows_the_pointers_and_the_plan_memo(monkeypatch):
    """A q 8 bytes off the 16-byte rows (same shape and strides) sends a prepared signature the whole way
    (element-wise loads, no tensor map) and leaves its aligned preparation in place; so does a cleared plan
    memo send it; check=True, ALiBi and dropout always take it. Each call against the reference."""
    import math

    import cupy

    import cuflash
    from cuflash import varlen

    seen = []
    real = varlen._check_inputs
    monkeypatch.setattr(varlen, "_check_inputs", lambda *a, **k: seen.append(1) or real(*a, **k))
    varlen._PREPARED.calls.clear()
    rng = np.random.default_rng(11)
    lengths, d = [200, 0, 77, 300], 128
    q = _packed(rng, lengths, 4, d, "bf16")
    k, v = _packed(rng, lengths, 4, d, "bf16"), _packed(rng, lengths, 4, d, "bf16")
    cu = _cu(lengths)
    flat = cupy.empty(q.size + 8, dtype=q.dtype)
    off = flat[4 : 4 + q.size].reshape(q.shape)
    off[...] = q
    assert off.strides == q.strides and off.data.ptr % 16 == 8

    def call(qq, whole_way, **kw):
        del seen[:]
        out, lse = cuflash.attention_varlen(qq, k, v, cu, cu, 300, 300, causal=True, return_lse=True, **kw)
        assert bool(seen) == whole_way, (whole_way, kw)
        extra = {"alibi_slopes": kw["alibi_slopes"]} if "alibi_slopes" in kw else {}
        _check_seq_forward(out, lse, qq, k, v, cu, cu, causal=True, scale=1 / math.sqrt(d), dtype="bf16",
                           what=str(kw), **extra)  # fmt: skip

    call(q, True)
    call(q.copy(), False)
    (prep,) = varlen._PREPARED.calls.values()
    assert prep.aligned
    call(off, True)
    (kept,) = varlen._PREPARED.calls.values()
    assert kept is prep, "the misaligned call must not replace the aligned preparation"
    call(q.copy(), False)
    varlen._plan_and_load.cache_clear()
    call(q.copy(), True)
    call(q.copy(), False)
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, 4).astype(np.float32))
    for kw in (dict(check=True), dict(alibi_slopes=slopes)):
        for _ in range(2):
            call(q, True, **kw)
    n = len(varlen._PREPARED.calls)
    for _ in range(2):
        del seen[:]
        cuflash.attention_varlen(q, k, v, cu, cu, 300, 300, dropout_p=0.1)
        assert seen
    assert len(varlen._PREPARED.calls) == n


@pytest.mark.parametrize("window", [None, (300, 0)])
def test_deterministic_varlen_and_window(window):
    """deterministic=True: bitwise identical gradients run after run, packed and (window) dense. The
    window case used to wait forever: the key blocks left of a query block's window never add to it."""
    import cupy

    import cuflash

    rng = np.random.default_rng(11)
    lengths = [1000, 17, 1500, 0, 600]
    q, k, v = (_packed(rng, lengths, h, 128, "bf16") for h in (2, 1, 1))
    cu = _cu(lengths)
    var = {} if window is None else {"window_size": window}
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 1500, 1500, causal=True, return_lse=True, **var)
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(DTYPES["bf16"]))
    first = [x.copy() for x in cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, 1500, 1500,
                                                                   causal=True, deterministic=True, **var)]  # fmt: skip
    for _ in range(10):
        again = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, 1500, 1500, causal=True,
                                                  deterministic=True, **var)  # fmt: skip
        for a, b in zip(first, again):
            assert (a.view(cupy.uint16) == b.view(cupy.uint16)).all()
    _check_seq_backward(first, dout, q, k, v, out, cu, cu, causal=True, scale=None, dtype="bf16", what="", **var)
    if window is not None:  # the dense window backward in deterministic mode (no varlen)
        from gpu_util import check_backward

        qd, kd, vd = (x[:1000][None] for x in (q, k, v))
        check_backward(qd, kd, vd, causal=True, dtype="bf16", deterministic=True, window_size=window)


def test_varlen_checks():
    """check=True validates the prefix sums and seqused_k on the host; bad arguments name themselves."""
    import cupy

    import cuflash

    rng = np.random.default_rng(0)
    q = _packed(rng, [10, 20], 2, 64, "bf16")
    good = _cu([10, 20])

    def call(cu_q=good, cu_k=good, **kw):
        return cuflash.attention_varlen(q, q, q, cu_q, cu_k, kw.pop("mq", 20), kw.pop("mk", 20), check=True, **kw)

    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 cupy.ndarray"):
        call(cu_q=good.get())
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        call(cu_k=good.astype(cupy.int64))
    with pytest.raises(ValueError, match="batch \\+ 1 values"):
        call(cu_k=_cu([10, 10, 10]))
    with pytest.raises(ValueError, match="must not decrease"):
        call(cu_q=cupy.asarray(np.array([0, 20, 10], np.int32)))
    with pytest.raises(ValueError, match="exceeds the 30 packed rows"):
        call(cu_k=cupy.asarray(np.array([0, 10, 31], np.int32)))
    with pytest.raises(ValueError, match="more than max_seqlen_q"):
        call(mq=15)
    with pytest.raises(ValueError, match="seqused_k\\[1\\] = 21"):
        call(seqused_k=cupy.asarray(np.array([3, 21], np.int32)))
    with pytest.raises(ValueError, match="3-D"):
        cuflash.attention_varlen(q[None], q, q, good, good, 20, 20)


def test_torch_varlen_autograd():
    """cuflash.torch.attention_varlen: forward and autograd gradients equal the CuPy API's."""
    torch = pytest.importorskip("torch")
    import cupy

    import cuflash
    import cuflash.torch

    lengths_q, lengths_k = [100, 0, 257], [90, 30, 300]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lengths_q), 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(sum(lengths_k), 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(sum(lengths_k), 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32, device="cuda")
    out = cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, 257, 300, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    c = lambda t: cupy.from_dlpack(t.detach())  # noqa: E731
    ref, lse = cuflash.attention_varlen(c(q), c(k), c(v), c(cu_q), c(cu_k), 257, 300, causal=True, return_lse=True)
    grads = cuflash.attention_varlen_backward(c(dout), c(q), c(k), c(v), ref, lse, c(cu_q), c(cu_k), 257, 300, causal=True)
    assert (c(out).view(cupy.uint16) == ref.view(cupy.uint16)).all()
    for t, g in zip((q, k, v), grads):
        np.testing.assert_allclose(to_f64(c(t.grad)), to_f64(g), atol=2e-2)


@pytest.mark.parametrize("kernel", ["plan", "mma.sync"])
@pytest.mark.parametrize("page_size, head_dim", [(128, 128), (256, 64), (128, 96), (128, 256)])
def test_varlen_paged_matches_contiguous(kernel, page_size, head_dim):
    """block_table: k, v in shuffled pages of a paged cache give exactly the packed call's out and lse
    (the same key tiles, read from their pages); causal and windowed; a bad page index is an error.
    Head dim 256 on Hopper: the planned tile's 80 keys would straddle pages, so the paged call plans
    plan.fit_key_tile's 64 keys; the packed call it must equal is forced to that tile. (Head dim 128's
    default tile has 80 keys too, but keys this short take the 128-key short-key tile.)"""
    import cupy

    from cuflash import jit, plan, varlen

    rng = np.random.default_rng(page_size + head_dim)
    lengths_q, lengths_k = [5, 0, 300, 1, 64], [700, 3, 1000, 0, 129]
    q = _packed(rng, lengths_q, 4, head_dim, "bf16")
    k, v = _packed(rng, lengths_k, 2, head_dim, "bf16"), _packed(rng, lengths_k, 2, head_dim, "bf16")
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    pages_per = [-(-n // page_size) for n in lengths_k]
    num_pages = sum(pages_per) + 3
    order = rng.permutation(num_pages)  # page ids handed out in shuffled order
    k_pages = cupy.asarray(rng.standard_normal((num_pages, page_size, 2, head_dim), dtype=np.float32).astype(DTYPES["bf16"]))
    v_pages = k_pages.copy()
    table = np.full((len(lengths_k), max(pages_per) + 1), -1, dtype=np.int32)  # unused entries: -1
    nxt, start = 0, np.concatenate([[0], np.cumsum(lengths_k)])
    for b, n in enumerate(lengths_k):
        for j in range(pages_per[b]):
            page = int(order[nxt])
            nxt += 1
            table[b, j] = page
            rows = slice(start[b] + j * page_size, min(start[b] + (j + 1) * page_size, start[b] + n))
            cnt = rows.stop - rows.start
            k_pages[page, :cnt], v_pages[page, :cnt] = k[rows], v[rows]
    fwd_tile, _ = _tiles(kernel, head_dim)
    want_tile = fwd_tile
    if fwd_tile is None and plan.uses_sm90_ws_forward(head_dim, True, jit.device_arch(0)):
        planned = plan.FWD_SM90_WS_TILES[plan.head_dim_bucket(head_dim)]  # (hd256: 1000 keys > SHORT_KEYS[256])
        # (hd128's default, 192 x 80, straddles pages too, but these 1000 keys take its short-key tile)
        assert (plan.fit_key_tile(planned, paged=True) != planned) == (head_dim in (128, 256))
        if head_dim == 256:
            want_tile = plan.fit_key_tile(planned, paged=True)
            assert want_tile.block_n == 64
    for kw in (dict(causal=True), dict(causal=False, window_size=(200, 50))):
        want, want_lse = varlen.run(q, k, v, cu_q, cu_k, 300, 1000, return_lse=True, tile=want_tile, **kw)
        for bt in (table, cupy.asarray(table)):
            got, lse = varlen.run(q, k_pages, v_pages, cu_q, cu_k, 300, 1000, block_table=bt, return_lse=True,
                                  check=True, tile=fwd_tile, **kw)  # fmt: skip
            assert (got.view(cupy.uint16) == want.view(cupy.uint16)).all(), f"paged out differs {kw}"
            np.testing.assert_array_equal(lse.get(), want_lse.get())
    bad = table.copy()
    bad[2, 1] = num_pages
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] = \d+ is not a page of the cache"):
        varlen.run(q, k_pages, v_pages, cu_q, cu_k, 300, 1000, block_table=bad)
    with pytest.raises(ValueError, match="multiple of 128"):
        varlen.run(q, k_pages[:, :100], v_pages[:, :100], cu_q, cu_k, 300, 1000, block_table=table)


def test_varlen_find_seq_on_the_gpu(tmp_path):
    """varlen.cuh's varlen_find_seq itself (test_varlen_reference models it in Python): for every grid tile
    of random packed batches (1 to 2000 sequences: one to three levels of its 32-way search, lengths 0
    included) the sequence it names is the largest b with cu[b] / block + b <= t; a bad cu[0] >= block
    (unchecked input) names sequence 0 for the tiles before it, never -1."""
    import cupy

    from cuflash import jit
    from nvrtc_util import FIND_SEQ_SOURCE, find_seq_owners

    for name, body in jit.included_headers(FIND_SEQ_SOURCE).items():  # (the headers as cuflash hands them to NVRTC)
        (tmp_path / name).write_text(body)
    kernel = cupy.RawModule(code=FIND_SEQ_SOURCE, options=("-std=c++17", f"-I{tmp_path}")).get_function(
        "cuflash_test_find_seq")  # fmt: skip
    rng = np.random.default_rng(4)
    cases = [(int(rng.choice([64, 128])), np.concatenate([[0], np.cumsum(rng.integers(0, 400, size=n))]).tolist())
             for n in (1, 2, 31, 32, 33, 100, 1023, 1024, 1025, 2000)]  # fmt: skip
    cases += [(128, [256, 300, 400]), (64, [0, 0, 0, 5000, 5000])]  # cu[0] >= block; empty sequences then a long one
    for block, cu in cases:
        batch, total = len(cu) - 1, cu[-1]
        n_slots = total // block + batch + 2  # past the last tile too
        out = cupy.full(n_slots, -7, dtype=cupy.int32)
        warps = 8
        kernel(((n_slots + warps - 1) // warps,), (32 * warps,),
               (cupy.asarray(cu, dtype=cupy.int32), np.int32(batch), np.int32(total), np.int32(block), np.int32(n_slots), out))  # fmt: skip
        got = out.get().tolist()
        want = find_seq_owners(cu, total, block, n_slots)
        assert got == want, (block, batch, [(t, g, w) for t, (g, w) in enumerate(zip(got, want)) if g != w][:5])
