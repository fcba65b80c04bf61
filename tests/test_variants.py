"""The attention variants without a GPU: the float64 reference against direct formulas and finite
differences, the Philox stream against Random123's known answers, the resolution of the API's
arguments into kernel variants (cuflash.variants), and the variant names and template arguments of
the planners."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import plan, reference, variants


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 and the dropout mask
# ---------------------------------------------------------------------------------------------


def test_philox_matches_random123_known_answers():
    """Random123's kat_vectors for philox4x32_10 (counter, key -> output)."""
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]  # fmt: skip
    for counter, key, want in kat:
        assert tuple(int(x) for x in reference.philox4x32_10(counter, key)) == want


def _mask_one_by_one(state, b, h, nheads, p, sq, sk):
    """dropout_keep_mask written element by element from the layout in cuda_src/dropout.cuh."""
    seed, offset = state
    key = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    thr = reference.keep_threshold(p)
    out = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        for j in range(sk):
            lane = 4 * (i % 8) + (j % 8) // 2
            words = reference.philox4x32_10((j // 32, 32 * (i // 16) + lane, b * nheads + h, offset & 0xFFFFFFFF), key)
            word = int(words[2 * ((j % 16) // 8) + j % 2])
            out[i, j] = (word >> (8 * (2 * ((j % 32) // 16) + (i % 16) // 8))) & 0xFF < thr
    return out


def test_dropout_mask_layout_and_rate():
    state = (0xDEADBEEF_12345678, 3 << 32 | 9)
    got = reference.dropout_keep_mask(state, 1, 2, 3, 0.25, 0, 37, 77)
    assert (got == _mask_one_by_one(state, 1, 2, 3, 0.25, 37, 77)).all()
    # a row range is the same rows of the whole mask; heads, batches and offsets give other masks
    whole = reference.dropout_keep_mask(state, 0, 0, 1, 0.5, 0, 300, 300)
    assert (reference.dropout_keep_mask(state, 0, 0, 1, 0.5, 17, 200, 300) == whole[17:200]).all()
    for other in (reference.dropout_keep_mask(state, 0, 1, 2, 0.5, 0, 300, 300),
                  reference.dropout_keep_mask(state, 1, 0, 1, 0.5, 0, 300, 300),
                  reference.dropout_keep_mask((state[0], state[1] + 1), 0, 0, 1, 0.5, 0, 300, 300),
                  reference.dropout_keep_mask((state[0], state[1] + (1 << 32)), 0, 0, 1, 0.5, 0, 300, 300)):  # fmt: skip
        assert 0.4 < (other != whole).mean() < 0.6
    for p in (0.1, 0.5, 0.9):
        rate = reference.dropout_keep_mask(state, 0, 0, 1, p, 0, 512, 512).mean()
        keep = reference.keep_probability(p)
        assert abs(keep - (1 - p)) <= 1 / 512
        assert abs(rate - keep) < 5 * math.sqrt(keep * (1 - keep) / 512**2)


def test_keep_threshold_rounds_to_a_256th_and_never_keeps_all_or_none():
    assert reference.keep_threshold(0.0) == 256 and reference.keep_probability(0.0) == 1.0
    assert reference.keep_threshold(0.5) == 128 and reference.keep_threshold(0.25) == 192
    assert reference.keep_threshold(0.1) == 230  # 0.9 * 256 = 230.4
    assert reference.keep_threshold(1e-6) == 255 and reference.keep_threshold(0.999999) == 1
    for p in np.linspace(1 / 512, 1 - 1 / 512, 101):
        assert abs(reference.keep_probability(p) - (1 - p)) <= 1 / 512 + 1e-12


# ---------------------------------------------------------------------------------------------
# The reference against direct formulas
# ---------------------------------------------------------------------------------------------


def _direct(q, k, v, scale, causal, window, softcap, slopes, p, state):
    """Attention written out with dense matrices: softcap, ALiBi, the window, softmax, dropout."""
    b_, sq, nh, d = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.zeros((b_, nh, sq))
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    left, right = window
    right = 0 if causal else right
    vis = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        vis &= j <= diag + right
    if left >= 0:
        vis &= j >= diag - left
    for b in range(b_):
        for h in range(nh):
            hk = h // (nh // nkv)
            s = scale * q[b, :, h] @ k[b, :, hk].T
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[b, h] * np.abs(diag - j)
            s = np.where(vis, s, -np.inf)
            with np.errstate(invalid="ignore"):
                m = np.max(s, axis=1, keepdims=True)
                e = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
            l = e.sum(axis=1, keepdims=True)
            pr = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
            lse[b, h] = np.where(l[:, 0] > 0, np.log(np.where(l[:, 0] > 0, l[:, 0], 1)) + np.where(np.isfinite(m[:, 0]), m[:, 0], 0), -np.inf)
            if p:
                pr = pr * reference.dropout_keep_mask(state, b, h, nh, p, 0, sq, sk) / reference.keep_probability(p)
            out[b, :, h] = pr @ v[b, :, hk]
    return out, lse


@pytest.mark.parametrize("case", [
    dict(causal=False, window=(3, 5), softcap=0.0, alibi=False, p=0.0),
    dict(causal=True, window=(4, -1), softcap=0.0, alibi=False, p=0.0),
    dict(causal=False, window=(-1, -1), softcap=2.0, alibi=False, p=0.0),
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi=True, p=0.0),
    dict(causal=False, window=(-1, -1), softcap=0.0, alibi=False, p=0.3),
    dict(causal=False, window=(0, 0), softcap=1.5, alibi=True, p=0.2),  # sq > sk: rows with no key
])  # fmt: skip
def test_reference_variants_match_direct_formulas(case):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 23, 4, 8)) * 2
    k = rng.standard_normal((2, 19, 2, 8)) * 2
    v = rng.standard_normal((2, 19, 2, 8))
    slopes = rng.uniform(0.05, 0.5, (2, 4)) if case["alibi"] else None
    state = (11, 22)
    kw = dict(window_size=case["window"], softcap=case["softcap"], alibi_slopes=slopes, dropout_p=case["p"],
              rng_state=state if case["p"] else None)  # fmt: skip
    out, lse = reference.attention_forward(q, k, v, causal=case["causal"], softmax_scale=0.4, **kw)
    want, want_lse = _direct(q, k, v, 0.4, case["causal"], case["window"], case["softcap"], slopes, case["p"], state)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("case", [
    dict(causal=False, window=(3, 2), softcap=1.5, alibi=True, p=0.0),
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi=False, p=0.4),
    dict(causal=False, window=(6, -1), softcap=3.0, alibi=True, p=0.25),
])  # fmt: skip
def test_reference_gradients_match_finite_differences(case):
    """attention_backward with the variants (the softcap's tanh, ALiBi, the window, dropout's mask on
    P and dP) against central differences of sum(out * dout) in float64."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 9, 2, 4))
    k = rng.standard_normal((1, 11, 1, 4))
    v = rng.standard_normal((1, 11, 1, 4))
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=case["causal"], softmax_scale=0.7, window_size=case["window"], softcap=case["softcap"],
              alibi_slopes=rng.uniform(0.1, 0.4, 2) if case["alibi"] else None, dropout_p=case["p"],
              rng_state=(5, 6) if case["p"] else None)  # fmt: skip
    grads = reference.attention_backward(dout, q, k, v, **kw)

    def loss(q_, k_, v_):
        return float(np.sum(reference.attention_forward(q_, k_, v_, **kw)[0] * dout))

    eps = 1e-6
    for which, x, g in zip("qkv", (q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = {"q": (xp, k, v), "k": (q, xp, v), "v": (q, k, xp)}[which]
            args_m = {"q": (xm, k, v), "k": (q, xm, v), "v": (q, k, xm)}[which]
            num[idx] = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        np.testing.assert_allclose(g, num, atol=1e-6, err_msg=f"d{which}")


def test_kvcache_reference_aligns_the_variants_to_each_sequence():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 4, 8))
    kc = rng.standard_normal((2, 50, 2, 8))
    vc = rng.standard_normal((2, 50, 2, 8))
    slopes = rng.uniform(0.1, 0.3, (2, 4))
    kw = dict(window_size=(7, 0), softcap=2.0, alibi_slopes=slopes)
    out, lse, _, _ = reference.attention_with_kvcache(q, kc, vc, cache_seqlens=[40, 13], **kw)
    for b, L in enumerate((40, 13)):
        want, want_lse = reference.attention_forward(q[b:b + 1], kc[b:b + 1, :L], vc[b:b + 1, :L], window_size=(7, 0),
                                                     softcap=2.0, alibi_slopes=slopes[b:b + 1])  # fmt: skip
        np.testing.assert_allclose(out[b:b + 1], want)
        np.testing.assert_allclose(lse[b:b + 1], want_lse)


def test_reference_rejects_bad_variants():
    q = np.zeros((1, 4, 2, 8))
    for kw, match in [(dict(window_size=(-2, 0)), "window_size"), (dict(softcap=-1.0), "softcap"),
                      (dict(alibi_slopes=np.ones(3)), "alibi_slopes"), (dict(dropout_p=1.0), "dropout_p"),
                      (dict(dropout_p=0.5), "rng_state")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            reference.attention_forward(q, q, q, **kw)
    with pytest.raises(TypeError, match="unknown keyword"):
        reference.plain_attention(q, q, q, dtype=np.float16, windowsize=(1, 1))


# ---------------------------------------------------------------------------------------------
# cuflash.variants.resolve: the API's arguments -> the kernel variant
# ---------------------------------------------------------------------------------------------


class _FakeArray(SimpleNamespace):
    pass


_CUPY = SimpleNamespace(ndarray=_FakeArray)


def _resolve(causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
             sq=100, sk=120, **kw):  # fmt: skip
    return variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            dropout_p=dropout_p, rng_state=rng_state, batch=2, nheads=4, seqlen_q=sq, seqlen_k=sk,
                            device_id=0, cupy=_CUPY, **kw)  # fmt: skip


@pytest.mark.parametrize("causal,window,want_mods,want_causal,want_window", [
    (False, (-1, -1), 0, False, None),
    (True, (-1, -1), 0, True, None),
    (False, (-1, 0), 0, True, None),              # (-1, 0) is causal
    (True, (-1, 7), 0, True, None),               # causal overrides the right side
    (False, (119, 99), 0, False, None),           # reaches every key on both sides: plain
    (False, (500, -1), 0, False, None),
    (False, (64, -1), plan.MOD_WINDOW, False, (64, 100)),
    (True, (64, -1), plan.MOD_WINDOW, False, (64, 0)),
    (False, (-1, 5), plan.MOD_WINDOW, False, (120, 5)),
    (False, (3, 98), plan.MOD_WINDOW, False, (3, 98)),
])  # fmt: skip
def test_window_resolution(causal, window, want_mods, want_causal, want_window):
    v = _resolve(causal=causal, window_size=window)
    assert v.mods == want_mods and v.causal == want_causal
    if want_window is not None:
        assert v.window == want_window


@pytest.mark.parametrize("causal,window,shift,want_mods,want_window", [
    (True, (-1, -1), 5, plan.MOD_WINDOW, (125, 0)),       # a shifted causal mask runs on the window kernels
    (True, (-1, -1), -200, plan.MOD_WINDOW, (120, 0)),    # every key after every query: still masked
    (True, (-1, -1), 200, 0, None),                       # every key before every query: nothing to mask
    (False, (-1, -1), 7, 0, None),                        # no mask, no ALiBi: the shift changes nothing
    (False, (10, 10), 3, plan.MOD_WINDOW, (10, 10)),
    (False, (150, -1), 40, plan.MOD_WINDOW, (150, 100)),  # d - 150 > 0 for the last rows: a left edge
    (False, (150, -1), 0, 0, None),
    (False, (-1, 90), -20, plan.MOD_WINDOW, (120, 90)),   # d + 90 < 119 for the first rows (also unshifted)
    (False, (-1, 90), 20, 0, None),                      # d + 90 >= 119 for every row
])  # fmt: skip
def test_window_resolution_with_a_shifted_diagonal(causal, window, shift, want_mods, want_window):
    v = _resolve(causal=causal, window_size=window, diag_shift=shift)
    assert v.mods == want_mods and not v.causal
    assert v.diag_shift == (shift if want_mods else 0)
    if want_window is not None:
        assert v.window == want_window
        assert v.record(0.125)[-1] == shift  # ModParams.diag_shift, the last field
    assert _resolve(softcap=5.0, diag_shift=shift).diag_shift == 0  # only window and ALiBi kernels read it


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", ["3", 2.0, 0.0, 2**24 + 1, -(2**24) - 1, 2**40])
def test_bad_diag_shift(bad, causal):
    """Refused whatever else the call asks for (a plain call too), beyond 2^24 as well: ALiBi's distances are
    floats in the kernels."""
    with pytest.raises(ValueError, match="diag_shift"):
        _resolve(causal=causal, diag_shift=bad)


def test_softcap_alibi_dropout_resolution_and_record():
    slopes = _FakeArray(dtype=np.dtype(np.float32), shape=(2, 4), strides=(16, 4), ndim=2, device=SimpleNamespace(id=0),
                        data=SimpleNamespace(ptr=4096))  # fmt: skip
    v = _resolve(softcap=30.0, alibi_slopes=slopes, dropout_p=0.25, rng_state=(2**64 - 1, 5))
    assert v.mods == plan.MOD_SOFTCAP | plan.MOD_ALIBI | plan.MOD_DROPOUT
    assert v.unit_scale(0.125) == 30.0
    rec = v.record(0.125)
    assert rec == (4096, 4, 2**64 - 1, 5, 0, 0, 0, 0, 0, 0, 0, 0.125 / 30.0, 1 / 30.0, 1 / 0.75, 192, 0, 0, 0, 0)
    assert v.record(0.125, 8, 16, 24)[4:7] == (8, 16, 24)  # varlen: cu_seqlens_q, cu_seqlens_k, seqused_k
    fresh = _resolve(dropout_p=0.1)
    assert fresh.rng_state is not None and fresh.rng_state != _resolve(dropout_p=0.1).rng_state
    with pytest.raises(ValueError, match="rng_state"):
        _resolve(dropout_p=0.1, new_rng_state=False)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        _resolve(dropout_p=0.1, allow_dropout=False)


@pytest.mark.parametrize("kw,match", [
    (dict(window_size=(-2, 0)), "window_size"), (dict(window_size=(1, 2, 3)), "window_size"),
    (dict(window_size=(True, 0)), "window_size"), (dict(window_size=None), "window_size"),
    (dict(softcap=-0.5), "softcap"), (dict(softcap=float("inf")), "softcap"), (dict(softcap="x"), "softcap"),
    (dict(dropout_p=1.0), "dropout_p"), (dict(dropout_p=float("nan")), "dropout_p"),
    (dict(dropout_p=0.5, rng_state=(1, 2, 3)), "rng_state"), (dict(dropout_p=0.5, rng_state=(2**64, 0)), "rng_state"),
    (dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes"),
])  # fmt: skip
def test_bad_arguments_name_the_argument(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _resolve(**kw)


def test_bad_alibi_slopes():
    def arr(**kw):
        base = dict(dtype=np.dtype(np.float32), shape=(4,), strides=(4,), ndim=1, device=SimpleNamespace(id=0),
                    data=SimpleNamespace(ptr=0))  # fmt: skip
        return _FakeArray(**{**base, **kw})

    for bad, match in [(arr(dtype=np.dtype(np.float16)), "float32"), (arr(shape=(3,)), "shape"),
                       (arr(device=SimpleNamespace(id=1)), "device"), (arr(strides=(8,)), "contiguous")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _resolve(alibi_slopes=bad)


# ---------------------------------------------------------------------------------------------
# Planners: variant names, template arguments, spec lists
# ---------------------------------------------------------------------------------------------


def test_variant_specs_name_their_variants_and_pass_them_last():
    spec = plan.fwd_spec(128, "bf16", True, True, "sm_80", mods=plan.MOD_WINDOW | plan.MOD_DROPOUT)
    plain = plan.fwd_spec(128, "bf16", True, True, "sm_80")
    assert spec.name == plain.name.replace("_vec16", "_window_dropout_vec16")
    assert spec.template_args() == plain.template_args() + ", 9"
    assert plan.bwd_sm90_spec(256, "fp16", False, mods=plan.MOD_SOFTCAP).template_args().endswith(", 2")
    dec = plan.decode_spec(128, "bf16", True, 1, "sm_90a", mods=plan.MOD_ALIBI)
    assert "_alibi_" in dec.name and dec.template_args().endswith(", 4")
    with pytest.raises(ValueError, match="mods"):
        plan.decode_spec(128, "bf16", True, 1, "sm_90a", mods=plan.MOD_DROPOUT)
    with pytest.raises(ValueError, match="mods"):
        plan.fwd_spec(128, "bf16", True, True, "sm_80", mods=32)
    with pytest.raises(ValueError, match="mods"):
        plan.decode_spec(128, "bf16", True, 1, "sm_90a", mods=plan.MOD_VARLEN)
    launch = plan.plan_forward(batch=1, seqlen_q=10, seqlen_k=10, nheads=1, nheads_kv=1, head_dim=128, dtype="bf16",
                               causal=False, aligned=True, arch="sm_90a", mods=plan.MOD_SOFTCAP)  # fmt: skip
    assert launch.spec.family == "flash_fwd_sm90_ws" and launch.spec.mods == plan.MOD_SOFTCAP
    ws = plan.fwd_sm90_ws_spec(128, "bf16", False)  # its mods are not last: the schedule bits follow
    assert ws.template_args().endswith(f", 0, {ws.tile.sched}")


def test_spec_lists_take_variant_combinations():
    plain = plan.all_fwd_specs("sm_90a", head_dims=(128,))
    both = plan.all_fwd_specs("sm_90a", head_dims=(128,), mods=(0, plan.ALL_MODS))
    assert len(both) == 2 * len(plain) and set(plain) < set(both)
    dec = plan.all_decode_specs("sm_90a", head_dims=(128,), mods=(plan.ALL_MODS,))
    assert {s.mods for s in dec if s.family == "flash_decode"} == {plan.ALL_MODS & ~plan.MOD_DROPOUT}


def test_windowed_decode_plans_for_the_window_not_the_cache():
    kw = dict(batch=1, seqlen_q=1, nheads=8, nheads_kv=1, head_dim=128, dtype="bf16", aligned=True,
              max_seqlen=131072, num_splits=0, num_sms=132, arch="sm_90a")  # fmt: skip
    whole = plan.plan_decode(**kw)
    windowed = plan.plan_decode(**kw, mods=plan.MOD_WINDOW, window_left=4095)
    assert windowed.num_splits < whole.num_splits
    assert windowed == plan.plan_decode(**{**kw, "max_seqlen": 4096 + 64}, mods=plan.MOD_WINDOW, window_left=4095)
    with pytest.raises(ValueError, match="window_left"):
        plan.plan_decode(**kw, mods=plan.MOD_WINDOW)


# ---------------------------------------------------------------------------------------------
# The variant benchmark's arithmetic (cuflash.bench_variants), without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk,causal,window", [(64, 64, False, (-1, -1)), (64, 64, True, (-1, -1)),
                                                  (50, 80, True, (10, -1)), (80, 50, False, (3, 7)),
                                                  (40, 40, False, (0, 0))])  # fmt: skip
def test_visible_pairs_counts_the_reference_mask(sq, sk, causal, window):
    from cuflash import bench_variants

    assert bench_variants.visible_pairs(sq, sk, causal, window) == reference.visible_mask(sq, sk, causal,
                                                                                            window_size=window).sum()


def test_variant_table_reports_ratios_to_the_variants_peer():
    from cuflash import bench, bench_variants

    env = {"gpu": "G", "cuflash": "0", "nvrtc": "13.0", "torch": "2", "date": "2026-12-02"}
    rows = []
    for var, peer in (("softcap", "flex"), ("dropout", "flash")):
        r = bench.Row("bf16", 128, True, 4096, 4, 16, op="fwd")
        r.notes["variant"] = var
        r.tflops = {"cuflash": 300.0, peer: 200.0, "flash (plain)": 250.0}
        r.ms = {"cuflash": 1.0}
        rows.append(r)
    text = bench_variants.format_table(rows, env)
    assert "softcap fwd: cuflash / flex over 1 points: median 1.500" in text
    assert "dropout fwd: cuflash / flash over 1 points: median 1.500" in text
    assert bench_variants.variant_kwargs("window", True, 512, 8) == {"window_size": (512, 0)}
    with pytest.raises(ValueError, match="variant"):
        bench_variants.variant_kwargs("rotary", True, 512, 8)
