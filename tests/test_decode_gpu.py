"""GPU tests of cuflash.attention_with_kvcache against the float64 reference (skipped without a GPU).

Every check applies DESIGN.md's rule: the kernel's max abs error is at most 2x that of a plain
implementation in the same precision (reference.plain_attention on each sequence's gathered cache,
in the worse of its two orders of rounding P) + 1e-5, and NaN never passes. Outputs are poisoned
with NaN before the launch, and so are the free blocks of CuPy's memory pool (where the split
buffers come from). A failure names the sequence, query token and head of the worst element, the
error and the bound.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash import plan, reference
from gpu_util import DTYPES, merge_policy, poisoned, randn, to_f64

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))


def forced_per_sm(n: int) -> plan.DecodePolicy:
    """The default decode policy with the split kernel's CTAs per SM forced to n."""
    return plan.DecodePolicy(ctas_per_sm=n)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def poison_pool(nbytes: int = 64 << 20) -> None:
    """Fill a pool block with NaN and free it: buffers the next call takes from the pool start as NaN.
    The partial rows of the split path live in cuflash's per-stream workspace: NaN them too (never the
    split counters, which the kernel relies on being 0 between calls)."""
    import cupy

    from cuflash import kvcache

    x = cupy.empty(nbytes // 4, dtype=cupy.float32)
    x.fill(cupy.nan)
    del x
    for partials, _ in kvcache._WORKSPACES.values():
        partials.fill(cupy.nan)


def host(x):
    if x is None or isinstance(x, (int, np.integer)):
        return x
    return x.get() if hasattr(x, "get") else np.asarray(x)


def make_caches(rng, *, batch, capacity, nheads_kv, head_dim, dtype, page_size=None, spare_pages=3, layout="bshd"):
    """(k_cache, v_cache, block_table) of `capacity` tokens per sequence; paged caches get their pages in
    a random order (plus spare pages nobody uses), block_table int32 on the host."""
    if page_size is None:
        kc = randn(rng, (batch, capacity, nheads_kv, head_dim), dtype, layout)
        vc = randn(rng, (batch, capacity, nheads_kv, head_dim), dtype, layout)
        return kc, vc, None
    max_blocks = -(-capacity // page_size)
    num_pages = batch * max_blocks + spare_pages
    kc = randn(rng, (num_pages, page_size, nheads_kv, head_dim), dtype, layout)
    vc = randn(rng, (num_pages, page_size, nheads_kv, head_dim), dtype, layout)
    bt = rng.permutation(num_pages)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    return kc, vc, bt


def gather(cache64: np.ndarray, b: int, L: int, block_table, page_size: int) -> np.ndarray:
    """Tokens [0, L) of sequence b from a float64 host cache (contiguous or paged)."""
    if block_table is None:
        return cache64[b, :L]
    t = np.arange(L)
    return cache64[np.asarray(block_table)[b, t // page_size], t % page_size]


def run_and_check(q, k_cache, v_cache, *, dtype, k=None, v=None, cache_seqlens=None, block_table=None, causal=False,
                  softmax_scale=None, num_splits=0, check=False, ref_lengths=None, what="", policy=None):  # fmt: skip
    """Call attention_with_kvcache (NaN-poisoned out and pool) and check out, lse and the caches after
    the append against the reference. ref_lengths: the lengths the reference should use (the clamped
    ones when the call passes out-of-range values unchecked); policy: the call's plan.DecodePolicy
    (None: the defaults). Returns (out, lse, err, bound)."""
    import cuflash

    kc0, vc0 = to_f64(k_cache), to_f64(v_cache)
    seqlens_before = host(cache_seqlens)
    seqlens_before = None if seqlens_before is None else np.array(seqlens_before, copy=True)
    out = poisoned(q.shape, dtype)
    poison_pool()
    ret, lse = cuflash.attention_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, out=out, check=check, policy=policy,
    )  # fmt: skip
    assert ret is out
    bt = host(block_table)
    lengths = host(cache_seqlens) if ref_lengths is None else ref_lengths
    ref, ref_lse, ref_kc, ref_vc = reference.attention_with_kvcache(
        q, kc0, vc0, k=k, v=v, cache_seqlens=lengths, block_table=bt, causal=causal, softmax_scale=softmax_scale
    )
    if seqlens_before is not None and hasattr(cache_seqlens, "get"):
        assert (cache_seqlens.get() == seqlens_before).all(), f"cache_seqlens was modified {what}"

    # Caches after the append: the new tokens in their slots, every other element unchanged.
    for name, got_c, want_c in (("k_cache", k_cache, ref_kc), ("v_cache", v_cache, ref_vc)):
        got = to_f64(got_c)
        bad = np.argwhere(~((got == want_c) | (np.isnan(got) & np.isnan(want_c))))
        assert bad.size == 0, (
            f"{name} after the call differs from the reference at {len(bad)} elements, first at index "
            f"{tuple(bad[0])}: got {got[tuple(bad[0])]}, want {want_c[tuple(bad[0])]} {what}"
        )

    # Plain same-precision attention per sequence on its gathered (updated) cache: the error bar, in
    # both orders of rounding P (reference.plain_attention_bar); the worse one sets it.
    batch, seqlen_q, nheads, head_dim = q.shape
    page_size = k_cache.shape[1]
    q64 = to_f64(q)
    L_all = reference._cache_lengths(lengths, batch, bt.shape[1] * page_size if bt is not None else k_cache.shape[1])
    L_all = L_all + (0 if k is None else k.shape[1])
    plains = {o: np.zeros(q.shape) for o in ("normalized", "unnormalized")}
    for b in range(batch):
        L = int(L_all[b])
        if L == 0:
            continue
        kb, vb = gather(ref_kc, b, L, bt, page_size), gather(ref_vc, b, L, bt, page_size)
        for o, plain in plains.items():
            plain[b : b + 1] = reference.plain_attention(q64[b : b + 1], kb[None], vb[None], causal=causal,
                                                         softmax_scale=softmax_scale, dtype=DTYPES[dtype], p_order=o)  # fmt: skip
    plain = reference.worse_of(list(plains.values()), ref)
    got = to_f64(out)
    assert not np.isnan(got).any(), (
        f"NaN in out at (b, i, h, d) = {tuple(np.argwhere(np.isnan(got))[0])} (unwritten or poisoned) {what}"
    )
    err = reference.max_abs_error(got, ref)
    bound = 2 * reference.max_abs_error(plain, ref) + 1e-5
    if not err <= bound:
        diff = np.abs(got - ref)
        worst = tuple(int(x) for x in np.unravel_index(np.argmax(diff), diff.shape))
        per_seq = [f"b{b}(L={int(L_all[b])}): {diff[b].max():.3g}" for b in range(batch)]
        pytest.fail(
            f"max abs error {err:.3g} > bound {bound:.3g} (2 x plain {reference.max_abs_error(plain, ref):.3g} + 1e-5); "
            f"worst at (b, i, h, d) = {worst}: got {got[worst]:.6g}, want {ref[worst]:.6g}; per sequence "
            f"{', '.join(per_seq)} {what}"
        )

    lse64 = np.asarray(lse.get(), dtype=np.float64)
    assert not np.isnan(lse64).any(), f"NaN in lse at (b, h, i) = {tuple(np.argwhere(np.isnan(lse64))[0])} {what}"
    ninf = np.isneginf(ref_lse)
    mism = np.argwhere(np.isneginf(lse64) != ninf)
    assert mism.size == 0, (
        f"lse -inf pattern differs at (b, h, i) = {tuple(mism[0])}: got {lse64[tuple(mism[0])]}, "
        f"want {ref_lse[tuple(mism[0])]} {what}"
    )
    if (~ninf).any():
        with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf: zeroed below
            rel = np.abs(lse64 - ref_lse) / np.maximum(1.0, np.abs(ref_lse))
        rel[ninf] = 0
        worst = tuple(int(x) for x in np.unravel_index(np.argmax(rel), rel.shape))
        assert rel.max() < 2e-4, f"lse relative error {rel.max():.3g} at (b, h, i) = {worst} {what}"
    # Queries that see no key: exactly 0.
    zero_rows = np.argwhere(ninf)  # (b, h, i)
    for b, h, i in zero_rows[:64]:
        assert (got[b, i, h] == 0).all(), f"out[{b}, {i}, {h}] must be 0 (the query sees no key) {what}"
    return out, lse, err, bound


def case(rng, *, batch=2, seqlen_q=1, nheads=4, nheads_kv=2, head_dim=64, dtype="bf16", capacity=300, lengths=None,
         seqlen_new=0, page_size=None, layout="bshd"):  # fmt: skip
    """Random q, caches, new tokens and lengths (by default random lengths that leave room for the new tokens)."""
    q = randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, layout)
    kc, vc, bt = make_caches(rng, batch=batch, capacity=capacity, nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype,
                             page_size=page_size, layout=layout)  # fmt: skip
    if page_size is not None:
        capacity = bt.shape[1] * page_size
    if lengths is None:
        lengths = rng.integers(0, capacity - seqlen_new + 1, size=batch)
    lengths = np.asarray(lengths, dtype=np.int32)
    k = v = None
    if seqlen_new:
        k = randn(rng, (batch, seqlen_new, nheads_kv, head_dim), dtype, layout)
        v = randn(rng, (batch, seqlen_new, nheads_kv, head_dim), dtype, layout)
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=lengths, block_table=bt, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Coverage of the variants
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_every_bucket(dtype, head_dim, num_splits):
    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=4, nheads_kv=2, head_dim=head_dim, dtype=dtype, capacity=700, lengths=[700, 333])
    run_and_check(**c, num_splits=num_splits, what=f"hd{head_dim} {dtype} splits={num_splits}")


@pytest.mark.parametrize("num_splits", [1, 0, 5])
@pytest.mark.parametrize("causal, seqlen_q", [(False, 1), (True, 1), (True, 3), (False, 3)])
def test_ragged_lengths_including_zero(num_splits, causal, seqlen_q):
    rng = np.random.default_rng()
    c = case(rng, batch=7, seqlen_q=seqlen_q, capacity=1000, lengths=[0, 1, 2, 63, 64, 65, 1000])
    run_and_check(**c, causal=causal, num_splits=num_splits, what=f"causal={causal} sq={seqlen_q} splits={num_splits}")


@pytest.mark.parametrize("nheads, nheads_kv, seqlen_q", [
    (8, 8, 1), (8, 2, 1), (8, 1, 1), (32, 8, 1), (32, 8, 4), (32, 1, 1), (32, 1, 2), (64, 8, 3), (64, 1, 3),
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa_and_packed_rows(nheads, nheads_kv, seqlen_q, causal):
    """Group * seqlen_q packed rows: 1 slab (<= 16 rows), 2 (<= 32), 4 (<= 64), several row blocks (> 64)."""
    rng = np.random.default_rng()
    c = case(rng, batch=2, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=128, capacity=530,
             lengths=[530, 77])  # fmt: skip
    run_and_check(**c, causal=causal, what=f"h={nheads}/{nheads_kv} sq={seqlen_q} causal={causal}")


@pytest.mark.parametrize("seqlen_q", [2, 4, 7])
@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_causal_with_several_query_tokens(seqlen_q, num_splits):
    """Causal aligned to the end of each sequence; sequences shorter than seqlen_q leave early queries
    without any key (out 0, lse -inf)."""
    rng = np.random.default_rng()
    c = case(rng, batch=6, seqlen_q=seqlen_q, nheads=6, nheads_kv=2, capacity=300, lengths=[0, 1, 3, 7, 129, 300])
    run_and_check(**c, causal=True, num_splits=num_splits, what=f"sq={seqlen_q} splits={num_splits}")


@pytest.mark.parametrize("where", ["in kernel", "combine"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("num_splits", [2, 70])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_merge_of_the_splits_every_row_arrangement(where, group, num_splits, head_dim):
    """Both merges of the splits. The last CTA's: 1 row (4 warps share it), 2-3 rows (2 warps per row,
    3 rows in two rounds), >= 4 rows (a warp per row, several rounds); 70 splits of 4 rows overflow one
    staged chunk of partial rows (hd128: 122 rows). The combine kernel's: 70 splits are 18 per warp.
    The second sequence's later splits saw no key (lse -inf). Head dim 64: rows shorter than a warp's
    128 columns."""
    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=2 * group, nheads_kv=2, head_dim=head_dim, capacity=70 * 64, lengths=[70 * 64, 900])
    run_and_check(**c, num_splits=num_splits, policy=merge_policy(where),
                  what=f"{where} group={group} splits={num_splits} hd{head_dim}")  # fmt: skip


@pytest.mark.parametrize("head_dim", [256, 96])
@pytest.mark.parametrize("num_splits", [3, 128])
def test_combine_kernel_wide_and_ragged_rows(head_dim, num_splits):
    """The combine kernel at hd256 (two float4 columns per lane, 128 splits in two register batches)
    and hd96 (lanes past the row idle), GQA with causal speculative tokens and a sequence of 0 keys."""
    rng = np.random.default_rng()
    c = case(rng, batch=3, seqlen_q=2, nheads=6, nheads_kv=2, head_dim=head_dim, capacity=128 * 64,
             lengths=[128 * 64, 0, 1000])  # fmt: skip
    run_and_check(**c, causal=True, num_splits=num_splits, policy=merge_policy("combine"),
                  what=f"hd{head_dim} splits={num_splits}")  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 256, 64])
@pytest.mark.parametrize("num_splits", [3, 17, 70, 128])
def test_combine_kernel_lean_equals_wide(plans_made, dtype, head_dim, num_splits):
    """The combine kernel's lean variant (4 partial rows per warp in flight: one batch up to 16 splits,
    several past it) and its wide one (up to 32 per warp, 16 at hd256) on the same call: both against
    the reference, and the same output bits (each warp adds its splits in the same order in both; the
    fp32 sums are seen rounded to the 16-bit dtype, fp16 keeping 3 more bits; lse does not depend on
    the variant's batch). The policy's combine field picks the variant."""
    rng = np.random.default_rng(5)
    c = case(rng, batch=3, seqlen_q=2, nheads=8, nheads_kv=2, head_dim=head_dim, dtype=dtype, capacity=128 * 64,
             lengths=[128 * 64, 0, 1000])  # fmt: skip
    got = {}
    for lean in (False, True):
        policy = merge_policy("combine", combine="lean" if lean else "wide")
        out, lse, _, _ = run_and_check(**c, causal=True, num_splits=num_splits, policy=policy,
                                       what=f"lean={lean} {dtype} hd{head_dim} splits={num_splits}")  # fmt: skip
        launched = plans_made[-1]
        assert launched.combine is not None and launched.combine.spec.lean == lean, launched.combine
        got[lean] = (to_f64(out), to_f64(lse))
    for a, b in zip(got[False], got[True]):
        assert np.array_equal(a, b, equal_nan=True), "lean and wide combine kernels differ"


def test_num_splits_agree():
    import cuflash

    rng = np.random.default_rng()
    c = case(rng, batch=3, nheads=8, nheads_kv=2, head_dim=128, capacity=5000, lengths=[5000, 4097, 10])
    outs = {s: to_f64(run_and_check(**c, num_splits=s, what=f"splits={s}")[0]) for s in (1, 0, 2, 7, 33, 128)}
    ref = reference.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["cache_seqlens"])[0]
    for s, o in outs.items():  # every split count agrees with no split to within the same error bar
        err = reference.max_abs_error(o, outs[1])
        assert err <= 2 * reference.max_abs_error(outs[1], ref) + 1e-5, f"splits={s} vs 1: {err:.3g}"
    again = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["cache_seqlens"])
    assert (to_f64(again) == outs[0]).all(), "the heuristic's split count changed between two identical calls"


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_fewer_ctas_per_sm_same_bits(ctas_per_sm):
    """Split CTAs spaced out to fewer per SM (padded shared memory) compute the same bits: only where
    the CTAs run changes, for every merge path. Checks that the padded launch really holds that many
    CTAs per SM (the driver's occupancy for the padded shared memory), so dropped padding fails."""
    import cuflash
    import cupy
    from cupy.cuda import driver

    from cuflash import jit, kvcache, plan

    rng = np.random.default_rng()
    c = case(rng, batch=3, nheads=32, nheads_kv=2, head_dim=128, capacity=3000, lengths=[3000, 1700, 0])
    args = (c["q"], c["k_cache"], c["v_cache"])
    dev = c["q"].device.id
    spec = plan.plan_decode(batch=3, seqlen_q=1, nheads=32, nheads_kv=2, head_dim=128, dtype="bf16", aligned=True,
                            max_seqlen=3008, num_splits=4, num_sms=jit.device_sm_count(dev),
                            arch=jit.device_arch(dev)).attn.spec  # fmt: skip
    if ctas_per_sm >= spec.min_blocks:
        pytest.skip(f"the {spec.name} tile holds {spec.min_blocks} CTAs per SM on this GPU: nothing to space out")
    for splits in (1, 4, 16, 6):
        want = cuflash.attention_with_kvcache(*args, cache_seqlens=c["cache_seqlens"], num_splits=splits)
        got = cuflash.attention_with_kvcache(*args, cache_seqlens=c["cache_seqlens"], num_splits=splits,
                                             policy=forced_per_sm(ctas_per_sm))  # fmt: skip
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), f"num_splits={splits}"
        # the memo entry of that call (host lengths: not uniform), the policy part of its key by value
        dplan, (fn, _, _) = kvcache._plan_and_load(3, 1, 32, 2, 128, "bf16", True, 3008, splits, 0, False, dev,
                                                   forced_per_sm(ctas_per_sm), False)  # fmt: skip
        assert dplan.ctas_per_sm == ctas_per_sm
        assert dplan.attn.spec == dataclasses.replace(spec, cta_loads=plan.decode_cta_loads(spec.tile, ctas_per_sm))
        resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, 128, dplan.attn.smem_bytes)
        assert resident == ctas_per_sm, f"{resident} CTAs per SM with {dplan.attn.smem_bytes} B of shared memory"
    run_and_check(**c, what=f"heuristic splits at {ctas_per_sm} CTAs per SM", policy=forced_per_sm(ctas_per_sm))


#: (dtype, head_dim, nheads, nheads_kv, seqlen_q, causal, layout, num_splits): the hd128 tiles that the
#: plan spaces to 2 CTAs per SM with CTA loads, one and two 16-row slabs, both load paths.
CTA_LOAD_CASES = [
    ("bf16", 128, 32, 32, 1, False, "contiguous", 1), ("fp16", 128, 32, 8, 1, False, "contiguous", 4),
    ("bf16", 100, 32, 4, 1, True, "contiguous", 3), ("bf16", 128, 32, 2, 2, True, "paged 48", 5),
    ("fp16", 120, 16, 1, 2, True, "append 3", 2), ("bf16", 128, 8, 8, 3, True, "append 3", 70)]  # fmt: skip


@pytest.mark.parametrize("dtype, head_dim, nheads, nheads_kv, seqlen_q, causal, layout, num_splits", CTA_LOAD_CASES)
def test_cta_loads_same_bits_as_column_loads(plans_made, dtype, head_dim, nheads, nheads_kv, seqlen_q, causal, layout,
                                             num_splits):  # fmt: skip
    """Split CTAs launched 2 per SM load each K/V tile as a CTA (plan.decode_cta_loads), the others per
    key column of warps: who loads a tile changes nothing in the math, so out and lse are the same bits
    (ragged lengths with 0, GQA with two slabs, paged, append, the element-wise path, both merge
    paths); and the CTA-load call is checked against the reference."""
    import cupy

    from cuflash import jit
    from cuflash.checks import DTYPE_NAMES

    rng = np.random.default_rng(head_dim + 7 * num_splits)
    new = 3 if layout == "append 3" else 0
    c = case(rng, batch=3, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype,
             capacity=2000, seqlen_new=new, page_size=48 if layout == "paged 48" else None,
             lengths=[1990 - new, 0, 777])  # fmt: skip
    dev = c["q"].device.id
    rows = seqlen_q * (nheads // nheads_kv)
    arch = jit.device_arch(dev)
    spec = plan.decode_spec(head_dim, DTYPE_NAMES[c["q"].dtype], head_dim % 8 == 0, plan.decode_m_slabs(rows, 128, arch),
                            arch)  # fmt: skip
    if not plan.decode_cta_loads(spec.tile, 2):
        pytest.skip(f"the {spec.name} tile is not spaced to 2 CTAs per SM on this GPU: no CTA loads")
    outs = {}
    for per_sm in (2, spec.tile.min_blocks):
        cc = dict(c, k_cache=c["k_cache"].copy(), v_cache=c["v_cache"].copy(), cache_seqlens=c["cache_seqlens"].copy())
        outs[per_sm] = run_and_check(**cc, causal=causal, num_splits=num_splits, policy=forced_per_sm(per_sm),
                                     what=f"{per_sm} CTAs per SM")  # fmt: skip
        launched = plans_made[-1]
        assert launched.ctas_per_sm == per_sm and launched.attn.spec.cta_loads == (per_sm == 2), launched
    (o2, l2, _, _), (o3, l3, _, _) = outs[2], outs[spec.tile.min_blocks]
    assert bool((o2.view(cupy.uint16) == o3.view(cupy.uint16)).all()), "CTA loads and column loads differ in out"
    assert bool((l2 == l3).all()), "CTA loads and column loads differ in lse"


def _all_counters_zero() -> bool:
    import cupy

    from cuflash import kvcache

    cupy.cuda.runtime.deviceSynchronize()
    return all(counters.size == 0 or int(abs(counters).max()) == 0 for _, counters in kvcache._WORKSPACES.values())


def test_split_counters_return_to_zero():
    """The last CTA of each (sequence, kv head, row block) merges the splits and resets its counter:
    after calls with many split counts, empty sequences, several row blocks and GQA, every counter of
    every workspace is 0 again, and a repeated call gives the same output."""
    import cuflash

    rng = np.random.default_rng()
    c = case(rng, batch=3, seqlen_q=3, nheads=32, nheads_kv=2, head_dim=64, capacity=900, lengths=[900, 0, 333])
    first = None
    for s in (2, 5, 0, 128, 3):
        out = to_f64(run_and_check(**c, num_splits=s, causal=True, what=f"splits={s}")[0])
        assert _all_counters_zero(), f"a split counter was left non-zero after num_splits={s}"
        first = out if first is None else first
    again = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["cache_seqlens"],
                                           causal=True, num_splits=2)  # fmt: skip
    assert (to_f64(again) == first).all()


def test_streams_get_their_own_workspace():
    """Calls on another stream use a workspace of their own (two streams may run at once), and so do two
    threads on the per-thread default stream."""
    import cupy

    from cuflash import kvcache

    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=8, nheads_kv=2, head_dim=128, capacity=3000, lengths=[3000, 1500])
    run_and_check(**c, num_splits=6, what="default stream")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run_and_check(**c, num_splits=6, what="another stream")
    assert kvcache._workspace_key(c["q"].device.id, stream.ptr) in kvcache._WORKSPACES
    assert kvcache._workspace_key(c["q"].device.id, cupy.cuda.Stream.null.ptr) in kvcache._WORKSPACES
    # the per-thread default stream: one handle, a different stream (and workspace) in each thread
    import threading

    keys, errors = [], []

    def worker():
        try:
            with cupy.cuda.Stream.ptds:
                run_and_check(**c, num_splits=6, what="per-thread default stream")
                cupy.cuda.Stream.ptds.synchronize()
            keys.append(kvcache._workspace_key(c["q"].device.id, cupy.cuda.Stream.ptds.ptr))
        except Exception as exc:  # (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(keys)) == 2 and all(k in kvcache._WORKSPACES for k in keys)
    assert _all_counters_zero()
    kvcache.free_workspaces()
    assert not kvcache._WORKSPACES
    run_and_check(**c, num_splits=6, what="after free_workspaces")


_SPIN_SOURCE = r"""
extern "C" __global__ void cuflash_test_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""


def _hold_the_stream(cycles: int = 40_000_000) -> None:
    """Keep the current stream busy (one thread spinning, ~20 ms at 2 GHz) so that the launches queued
    behind it run back to back on the GPU, not one at a time as the host issues them."""
    import cupy

    cupy.RawKernel(_SPIN_SOURCE, "cuflash_test_spin")((1,), (1,), (cupy.int64(cycles),))


def _decode_loop(q_steps, kc, vc, k_steps, v_steps, length0, splits):
    """Step s appends token s at length0 + s and attends to the first length0 + s + 1 tokens; all steps
    are queued behind a spinning kernel without a sync, each into its own (NaN) output."""
    import cuflash

    outs = [poisoned(q.shape, "bf16") for q in q_steps]
    poison_pool()
    _hold_the_stream()
    for s, (q, k, v) in enumerate(zip(q_steps, k_steps, v_steps)):
        cuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=length0 + s, num_splits=splits[s],
                                       out=outs[s])  # fmt: skip
    return [to_f64(o) for o in outs]


_LOOP_BATCH, _LOOP_LENGTH0 = 2, 2500  # the decode-loop tests: sequences, tokens cached before the first step


def _decode_loop_inputs(steps: int):
    """(q, k, v per step, k_cache, v_cache) of a decode loop over _LOOP_BATCH sequences of _LOOP_LENGTH0
    cached tokens, 32 query heads on 2 kv heads, head dim 128, bf16. The cache slots the steps append
    to hold NaN, which a step that read its own token before the append wrote it would put into its
    output (slots past a step's length are never read)."""
    import cupy

    rng = np.random.default_rng()
    batch, nheads, nheads_kv, hd = _LOOP_BATCH, 32, 2, 128
    q_steps = [randn(rng, (batch, 1, nheads, hd), "bf16") for _ in range(steps)]
    k_steps = [randn(rng, (batch, 1, nheads_kv, hd), "bf16") for _ in range(steps)]
    v_steps = [randn(rng, (batch, 1, nheads_kv, hd), "bf16") for _ in range(steps)]
    kc, vc, _ = make_caches(rng, batch=batch, capacity=_LOOP_LENGTH0 + steps + 7, nheads_kv=nheads_kv, head_dim=hd,
                            dtype="bf16")  # fmt: skip
    for x in (kc, vc):
        x.view(cupy.uint16)[:, _LOOP_LENGTH0:] = 0x7FFF  # NaN in bf16
    return q_steps, k_steps, v_steps, kc, vc


def _check_decode_loop(got, q_steps, k_steps, v_steps, kc, vc, length0, splits):
    """Token s is in the caches at length0 + s, and step s's output (float64) is within the bound of
    attention over the first length0 + s + 1 tokens; the split counters are back to 0."""
    kf, vf = to_f64(kc), to_f64(vc)
    for s in range(len(q_steps)):
        assert (kf[:, length0 + s] == to_f64(k_steps[s])[:, 0]).all(), f"token {s} was not appended to k_cache"
        assert (vf[:, length0 + s] == to_f64(v_steps[s])[:, 0]).all(), f"token {s} was not appended to v_cache"
    for s in range(len(q_steps)):
        L = length0 + s + 1
        q64 = to_f64(q_steps[s])
        ref = reference.attention_with_kvcache(q64, kf, vf, cache_seqlens=L)[0]
        plains = [reference.plain_attention(q64, kf[:, :L], vf[:, :L], dtype=DTYPES["bf16"], p_order=o)
                  for o in ("normalized", "unnormalized")]  # fmt: skip
        plain = reference.worse_of(plains, ref)
        assert not np.isnan(got[s]).any(), f"step {s} (num_splits={splits[s]}): NaN in out"
        err, bound = reference.max_abs_error(got[s], ref), 2 * reference.max_abs_error(plain, ref) + 1e-5
        assert err <= bound, f"step {s} (num_splits={splits[s]}, {L} tokens): max abs error {err:.3g} > {bound:.3g}"
    assert _all_counters_zero()


def test_a_decode_loop_without_syncs():
    """A decode loop as a model runs it: append one token, attend, next step, with nothing between the
    launches, queued behind a spinning kernel so that they run back to back (on sm_90 each kernel
    starts while the one before it ends: programmatic dependent launch). Every step must see the
    tokens appended before it and none after, whichever path merges its splits (one split, the
    in-kernel merge, the combine kernel, all sharing one workspace): the cache slots not yet appended
    hold NaN, which a step reading its own token before the append wrote it would put into its
    output (slots past a step's length are never read). The same loop with PDL off gives the same
    bits."""
    import cupy

    from cuflash import launch

    # 16 packed rows per kv head: 16 splits merge in the combine kernel, 4 and 3 in the split kernel.
    splits, length0 = [0, 1, 16, 4, 0, 1, 16, 4, 3], _LOOP_LENGTH0
    q_steps, k_steps, v_steps, kc0, vc0 = _decode_loop_inputs(len(splits))
    kc, vc = kc0.copy(), vc0.copy()
    got = _decode_loop(q_steps, kc, vc, k_steps, v_steps, length0, splits)

    _check_decode_loop(got, q_steps, k_steps, v_steps, kc, vc, length0, splits)

    saved = launch.set_pdl_enabled(False)
    try:
        kc2, vc2 = kc0.copy(), vc0.copy()
        again = _decode_loop(q_steps, kc2, vc2, k_steps, v_steps, length0, splits)
    finally:
        launch.set_pdl_enabled(saved)
    for a, b in ((kc2, kc), (vc2, vc)):  # bits: the slots never appended to are still NaN
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    for s in range(len(splits)):
        assert (again[s] == got[s]).all(), f"step {s}: the loop with PDL off differs from the loop with PDL on"
    cupy.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_a_decode_step_captured_in_a_cuda_graph(num_splits):
    """A decode step (append one token, attend) captured once in a CUDA graph on a side stream and
    replayed step after step, as serving loops run it: the lengths are a CuPy array bumped on the
    stream between replays, and the inputs are copied into the captured buffers. The three merge
    paths (one split, the in-kernel merge, the combine kernel) with PDL as the driver allows it
    under capture (a refused PDL launch falls back to a plain one: either way every replay must see
    the tokens appended before it). All replays are queued behind a spinning kernel, no sync between."""
    import cupy

    import cuflash
    from cuflash import launch

    steps, batch, length0 = 5, _LOOP_BATCH, _LOOP_LENGTH0
    q_steps, k_steps, v_steps, kc, vc = _decode_loop_inputs(steps)
    q_buf, k_buf, v_buf = (x.copy() for x in (q_steps[0], k_steps[0], v_steps[0]))
    out = poisoned(q_buf.shape, "bf16")
    cupy.cuda.Device().synchronize()  # the inputs were made on the null stream, which a non-blocking one ignores
    saved = launch.pdl_enabled()  # a launch refused under capture turns PDL off for the process: restored below
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            seqlens = cupy.full((batch,), length0, dtype=cupy.int32)

            def step(k_cache, v_cache):
                cuflash.attention_with_kvcache(q_buf, k_cache, v_cache, k=k_buf, v=v_buf, cache_seqlens=seqlens,
                                               num_splits=num_splits, out=out)  # fmt: skip

            step(kc.copy(), vc.copy())  # loads the kernels and this stream's workspace: nothing to allocate in capture
            stream.synchronize()
            stream.begin_capture()
            step(kc, vc)
            graph = stream.end_capture()
            outs = [poisoned(q_buf.shape, "bf16") for _ in range(steps)]
            _hold_the_stream()
            for s in range(steps):
                q_buf[...], k_buf[...], v_buf[...] = q_steps[s], k_steps[s], v_steps[s]
                graph.launch(stream)
                outs[s][...] = out
                seqlens += 1
            stream.synchronize()
    finally:
        launch.set_pdl_enabled(saved)
    _check_decode_loop([to_f64(o) for o in outs], q_steps, k_steps, v_steps, kc, vc, length0, [num_splits] * steps)


# ---------------------------------------------------------------------------------------------
# Paged caches
# ---------------------------------------------------------------------------------------------


def _contiguous_case(c, page_size: int):
    """The paged case ``c`` with the same tokens gathered into a contiguous cache (batch, capacity, ...)."""
    import cupy

    bt = c["block_table"]
    pos = np.arange(bt.shape[1] * page_size)
    pages, slots = cupy.asarray(bt[:, pos // page_size]), cupy.asarray(pos % page_size)
    return dict(c, block_table=None, k_cache=cupy.ascontiguousarray(c["k_cache"][pages, slots]),
                v_cache=cupy.ascontiguousarray(c["v_cache"][pages, slots]))  # fmt: skip


@pytest.mark.parametrize("page_size", [16, 32, 48, 80, 256])
@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_paged_equals_contiguous(page_size, num_splits):
    """The same tokens in a contiguous cache and in shuffled pages give bitwise the same out and lse
    (the kernel visits the same tiles in the same order; only the addresses differ)."""
    import cuflash
    import cupy

    rng = np.random.default_rng()
    batch, hk, d, capacity = 3, 2, 128, 20 * page_size
    c = case(rng, batch=batch, nheads=8, nheads_kv=hk, head_dim=d, capacity=capacity, page_size=page_size,
             lengths=[capacity, 5 * page_size + 7, 0])  # fmt: skip
    bt = c["block_table"]
    cont = _contiguous_case(c, page_size)
    assert cont["k_cache"].shape == (batch, capacity, hk, d)
    paged_out, paged_lse, _, _ = run_and_check(**c, num_splits=num_splits, what=f"paged P={page_size}")
    cont_out, cont_lse, _, _ = run_and_check(**cont, num_splits=num_splits, what=f"contiguous P={page_size}")
    same = (paged_out.view(cupy.uint16) == cont_out.view(cupy.uint16)).all()
    assert bool(same), f"paged (P={page_size}) and contiguous outputs differ; max diff " \
        f"{reference.max_abs_error(to_f64(paged_out), to_f64(cont_out)):.3g}"
    assert bool((paged_lse.view(cupy.uint32) == cont_lse.view(cupy.uint32)).all())
    out2 = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["cache_seqlens"],
                                          block_table=cupy.asarray(bt), num_splits=num_splits)  # fmt: skip
    assert bool((out2.view(cupy.uint16) == paged_out.view(cupy.uint16)).all()), "device block_table differs from host"


def test_paged_cta_loads_across_page_boundaries(plans_made):
    """CTA loads (64-key tiles, one split at 2 per SM) on 80-token pages: some tiles lie in one page
    (the stepped loads), others straddle two (the per-row loads); the same bits as the contiguous cache."""
    import cupy

    rng = np.random.default_rng(5)
    page_size, capacity = 80, 50 * 80
    c = case(rng, batch=2, nheads=8, nheads_kv=2, head_dim=128, capacity=capacity, page_size=page_size,
             lengths=[capacity, 2345])  # fmt: skip
    cont = _contiguous_case(c, page_size)
    outs = []
    for cc, what in ((c, "paged P=80"), (cont, "contiguous")):
        outs.append(run_and_check(**cc, num_splits=1, policy=forced_per_sm(2), what=what))
        if not plans_made[-1].attn.spec.cta_loads:
            pytest.skip(f"one split at 2 per SM does not load as a CTA on this GPU ({plans_made[-1].attn.spec.name})")
    (po, pl, _, _), (co, cl, _, _) = outs
    assert bool((po.view(cupy.uint16) == co.view(cupy.uint16)).all()), "paged and contiguous CTA loads differ"
    assert bool((pl.view(cupy.uint32) == cl.view(cupy.uint32)).all())


@pytest.mark.parametrize("page_size", [16, 48])
@pytest.mark.parametrize("seqlen_new", [1, 3, 17])
def test_paged_append(page_size, seqlen_new):
    """New tokens land in the right page and slot (also across page boundaries); nothing else changes."""
    rng = np.random.default_rng()
    capacity = 6 * page_size
    c = case(rng, batch=4, seqlen_q=2, nheads=4, nheads_kv=2, capacity=capacity, page_size=page_size,
             seqlen_new=seqlen_new, lengths=[0, page_size - 1, 3 * page_size, capacity - seqlen_new])  # fmt: skip
    run_and_check(**c, causal=True, what=f"P={page_size} new={seqlen_new}")


# ---------------------------------------------------------------------------------------------
# Append (contiguous), load paths, layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlen_new", [1, 2, 5])
@pytest.mark.parametrize("head_dim", [64, 100])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_append_semantics(seqlen_new, head_dim, num_splits):
    rng = np.random.default_rng()
    c = case(rng, batch=4, seqlen_q=seqlen_new, nheads=4, nheads_kv=2, head_dim=head_dim, capacity=200,
             seqlen_new=seqlen_new, lengths=[0, 1, 64, 200 - seqlen_new])  # fmt: skip
    run_and_check(**c, causal=True, num_splits=num_splits, what=f"new={seqlen_new} hd{head_dim}")


@pytest.mark.parametrize("head_dim", [1, 3, 8, 40, 72, 100, 129, 200, 255])
def test_ragged_head_dims(head_dim):
    """16-byte path with zero-filled tail chunks (40, 72, 200) and the element-wise path (odd dims)."""
    rng = np.random.default_rng()
    c = case(rng, batch=2, seqlen_q=2, nheads=4, nheads_kv=1, head_dim=head_dim, dtype="fp16", capacity=300,
             lengths=[299, 150], seqlen_new=1)  # fmt: skip
    run_and_check(**c, causal=True, what=f"hd{head_dim}")


def _offset_view(x):
    """The same values in a buffer shifted by one element: every row is misaligned for 16-byte loads."""
    import cupy

    buf = cupy.empty(x.size + 1, dtype=x.dtype)
    y = buf[1:].reshape(x.shape)
    y[...] = x
    return y


def test_element_wise_path_for_misaligned_rows():
    from cuflash.checks import aligned16

    rng = np.random.default_rng()
    c = case(rng, batch=3, seqlen_q=2, nheads=8, nheads_kv=2, head_dim=64, capacity=400, seqlen_new=2,
             lengths=[0, 200, 398])  # fmt: skip
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        c[name] = _offset_view(c[name])
        assert not aligned16(c[name])
    run_and_check(**c, causal=True, what="misaligned")
    paged = case(rng, batch=2, nheads=4, nheads_kv=2, head_dim=64, capacity=96, page_size=32, seqlen_new=1)
    paged["k_cache"] = _offset_view(paged["k_cache"])
    run_and_check(**paged, num_splits=2, what="misaligned paged")


def _padded_rows_view(x):
    """The same values with every (b, s, h) row 4 elements (8 bytes) apart from a 16-byte boundary:
    a 16-byte aligned base, but head strides of head_dim + 4 elements."""
    import cupy

    b, s, h, d = x.shape
    y = cupy.empty((b, s, h, d + 4), dtype=x.dtype)[..., :d]
    y[...] = x
    return y


def test_element_wise_path_for_rows_off_by_8_bytes():
    from cuflash.checks import aligned16

    rng = np.random.default_rng()
    c = case(rng, batch=2, seqlen_q=2, nheads=8, nheads_kv=2, head_dim=64, capacity=300, seqlen_new=1)
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        c[name] = _padded_rows_view(c[name])
        assert c[name].data.ptr % 16 == 0 and not aligned16(c[name])
    run_and_check(**c, causal=True, what="rows off by 8 bytes")


def test_16_byte_path_and_strided_layouts():
    """(b, h, s, d) storage seen through transposed views: non-contiguous strides, 16-byte aligned."""
    from cuflash.checks import aligned16

    rng = np.random.default_rng()
    c = case(rng, batch=2, seqlen_q=3, nheads=8, nheads_kv=2, head_dim=128, capacity=700, layout="bhsd",
             seqlen_new=2)  # fmt: skip
    assert not c["k_cache"].flags.c_contiguous
    assert all(aligned16(c[n]) for n in ("q", "k_cache", "v_cache", "k", "v"))
    run_and_check(**c, causal=True, softmax_scale=0.25, what="bhsd views")


# ---------------------------------------------------------------------------------------------
# Lengths and page tables on the device; values out of range
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The filled grid: long splits plus a short tail per sequence in the free CTA slots (plan/decode.py _filled_grid)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def plans_made(monkeypatch):
    """The decode plans attention_with_kvcache makes (plan.plan_decode's results, in order), with the
    plan memo cleared before and after, so every call signature plans afresh (kvcache calls
    plan.plan_decode through the package, where it is recorded)."""
    from cuflash import kvcache, plan

    made = []
    real = plan.plan_decode

    def recording(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(plan, "plan_decode", recording)
    kvcache._plan_and_load.cache_clear()
    yield made
    kvcache._plan_and_load.cache_clear()


#: The policy of the filled-grid tests: the plan fills the free slots on small caches (no minimum of
#: tiles per long split, every split "long"), so they reach the filled grid with many groups and
#: short splits.
FILLED_POLICY = dataclasses.replace(plan.DEFAULT_DECODE_POLICY, fill_min_unsplit_tiles=1, fill_min_unsplit_tiles_full=1,
                                    long_cta_keys=1)  # fmt: skip


def _plan_of_call(q, k_cache, L: int, seqlen_new: int = 0, policy=plan.DEFAULT_DECODE_POLICY):
    """The plan of this call (uniform length L after the append, ``policy``) on this GPU."""
    from cuflash import jit
    from cuflash.checks import DTYPE_NAMES

    batch, seqlen_q, nheads, head_dim = q.shape
    dev = q.device.id
    return plan.plan_decode(batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=k_cache.shape[2],
                            head_dim=head_dim, dtype=DTYPE_NAMES[q.dtype], aligned=head_dim % 8 == 0,
                            max_seqlen=-(-L // 64) * 64, num_splits=0, num_sms=jit.device_sm_count(dev),
                            arch=jit.device_arch(dev), seqlen_new=seqlen_new, uniform_lengths=True,
                            policy=policy)  # fmt: skip


def _require_filled(q, k_cache, L: int, seqlen_new: int = 0, policy=FILLED_POLICY):
    """The plan of this call under ``policy``; skips where it does not take the filled grid (another SM
    count or architecture), so a pass means the filled grid ran."""
    p = _plan_of_call(q, k_cache, L, seqlen_new, policy)
    if not p.split_major:
        pytest.skip(f"the plan does not fill the slots for this call on this GPU (grid {p.attn.grid})")
    return p


def _layout_case(rng, layout_case, dtype: str, head_dim: int, layout: str):
    """(case, L, new tokens) of layout_case = (batch, nheads, nheads_kv, cached tokens, capacity) in
    `layout` ("contiguous", "paged 48", "append 3", "full caches"), one length for all."""
    new = 3 if layout == "append 3" else 0
    batch, nheads, nheads_kv, cached, capacity = layout_case
    c = case(rng, batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype, capacity=capacity,
             seqlen_new=new, page_size=48 if layout == "paged 48" else None)  # fmt: skip
    cap = c["k_cache"].shape[1] if c["block_table"] is None else c["block_table"].shape[1] * 48
    cached = cap - new if layout == "full caches" else cached
    c["cache_seqlens"] = None if layout == "full caches" else cached
    return c, cached + new, new


def _assert_launched_filled(plans):
    """The call itself planned (and so launched) the filled grid: kvcache passed uniform lengths."""
    assert plans and plans[-1].split_major, f"the call did not take the filled grid: {plans[-1:]}"


#: (batch, nheads, nheads_kv, seqlen_q, causal, L) that take the filled grid on the H200 (132 SMs) with
#: FILLED_POLICY (tests/test_decode_plan.py checks that on the CPU).
FILLED_CASES = [
    (12, 8, 8, 1, False, 919), (12, 8, 8, 3, True, 919), (4, 32, 8, 1, False, 7686), (4, 16, 8, 2, True, 3601),
    (1, 32, 32, 1, False, 3603), (23, 8, 4, 1, True, 901),
    (8, 32, 32, 1, False, 2200),  # one split per sequence before: a second (the tail) and a merge now
    (16, 32, 32, 1, False, 2200), (20, 16, 8, 2, True, 4100)]  # the long splits in 2 waves  # fmt: skip
#: (batch, nheads, nheads_kv, cached tokens, capacity) of the layout / dtype / append cases, likewise.
FILLED_LAYOUT_CASE = (9, 8, 8, 1200, 1300)
FILLED_REPEAT_CASE = (12, 32, 8, 901)


@pytest.mark.parametrize("batch, nheads, nheads_kv, seqlen_q, causal, L", FILLED_CASES)
def test_filled_grid_against_the_reference(plans_made, batch, nheads, nheads_kv, seqlen_q, causal, L):
    """Long splits and a tail per (sequence, kv head), split-major grid: out and lse within the error
    bar, for MHA and GQA, causal with several query tokens; the group counters back to 0."""
    rng = np.random.default_rng(L + 7 * nheads)
    c = case(rng, batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=128, capacity=L + 5)
    c["cache_seqlens"] = L  # one length for all: the filled grid's condition
    _require_filled(c["q"], c["k_cache"], L)
    run_and_check(**c, causal=causal, policy=FILLED_POLICY, what=f"filled grid, L={L}")
    _assert_launched_filled(plans_made)
    assert _all_counters_zero(), "a group counter was left non-zero by the filled grid"


@pytest.mark.parametrize("dtype, head_dim", [("fp16", 64), ("bf16", 96), ("bf16", 128)])
@pytest.mark.parametrize("layout", ["contiguous", "paged 48", "append 3", "full caches"])
def test_filled_grid_paged_append_and_dtypes(plans_made, dtype, head_dim, layout):
    c, L, new = _layout_case(np.random.default_rng(head_dim), FILLED_LAYOUT_CASE, dtype, head_dim, layout)
    _require_filled(c["q"], c["k_cache"], L, new)
    run_and_check(**c, policy=FILLED_POLICY, what=f"filled grid, {layout}")
    _assert_launched_filled(plans_made)


def test_filled_grid_repeats_and_matches_the_split_grid(plans_made):
    """Two identical calls give the same bits (the counters reset); the equal splits agree within the bar."""
    import cuflash

    rng = np.random.default_rng(5)
    batch, nheads, nheads_kv, L = FILLED_REPEAT_CASE
    c = case(rng, batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_dim=128, capacity=L)
    args = (c["q"], c["k_cache"], c["v_cache"])
    _require_filled(c["q"], c["k_cache"], L)
    filled = [to_f64(cuflash.attention_with_kvcache(*args, cache_seqlens=L, policy=FILLED_POLICY)) for _ in range(2)]
    _assert_launched_filled(plans_made)
    assert (filled[0] == filled[1]).all(), "two identical filled-grid calls differ"
    assert _all_counters_zero()
    split = to_f64(cuflash.attention_with_kvcache(*args, cache_seqlens=L, num_splits=4, policy=FILLED_POLICY))
    assert not plans_made[-1].split_major
    ref = reference.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=L)[0]
    assert reference.max_abs_error(filled[0], split) <= 2 * reference.max_abs_error(split, ref) + 1e-5


def test_filled_grid_at_a_bench_shape(plans_made):
    """The plan's own choice (no thresholds changed) at b=1, 32 kv heads, 32k tokens: the filled grid on
    the H200; checked against the reference like any call."""
    rng = np.random.default_rng(11)
    c = case(rng, batch=1, nheads=32, nheads_kv=32, head_dim=128, capacity=32768)
    c["cache_seqlens"] = 32768
    _require_filled(c["q"], c["k_cache"], 32768, policy=plan.DEFAULT_DECODE_POLICY)
    run_and_check(**c, what="filled grid at b=1 L=32k h_kv=32")
    _assert_launched_filled(plans_made)


# ---------------------------------------------------------------------------------------------
# The tail-split grid: whole groups, then the last wave's groups in splits (plan/decode.py _tail_split)
# ---------------------------------------------------------------------------------------------


def _require_tail(q, k_cache, L: int, seqlen_new: int = 0, policy=None):
    """The plan of this call under ``policy`` (None: TAIL_POLICY); skips where it does not take the
    tail-split grid (another SM count or architecture), so a pass means it ran."""
    p = _plan_of_call(q, k_cache, L, seqlen_new, TAIL_POLICY if policy is None else policy)
    if not p.tail_groups:
        pytest.skip(f"the plan does not split the last wave's groups for this call on this GPU (grid {p.attn.grid})")
    return p


def _assert_launched_tail(plans):
    assert plans and plans[-1].tail_groups > 0, f"the call did not take the tail-split grid: {plans[-1:]}"


#: (batch, nheads, nheads_kv, seqlen_q, causal, L) that take the tail-split grid on the H200 (132 SMs)
#: with TAIL_POLICY (tests/test_decode_plan.py checks that on the CPU): column loads at 3
#: per SM, CTA loads at 2 per SM, GQA with 12 and 8 packed rows, causal with several query tokens.
TAIL_CASES = [(19, 32, 32, 1, False, 500), (15, 32, 32, 1, False, 3100), (58, 32, 8, 3, True, 3100),
              (149, 16, 4, 2, True, 333)]  # fmt: skip
#: (batch, nheads, nheads_kv, cached tokens, capacity) of the layout / dtype / append cases, likewise,
#: and their (dtype, head dim): the 16-byte and the element-wise (head dim 100) load paths.
TAIL_LAYOUT_CASE = (21, 32, 32, 470, 520)
TAIL_DTYPES = [("fp16", 128), ("bf16", 100), ("bf16", 128)]
#: The policy of the tail-split tests: the tail split wherever it can be taken (any gain, fill, waves,
#: tiles; splits down to one 64-key tile), so small caches reach it.
TAIL_POLICY = dataclasses.replace(plan.DEFAULT_DECODE_POLICY, tail_split_min_gain=-math.inf, tail_split_max_fill=1.0,
                                  tail_split_min_waves=1, tail_split_min_tiles=1, min_keys_per_split=64)  # fmt: skip


@pytest.mark.parametrize("batch, nheads, nheads_kv, seqlen_q, causal, L", TAIL_CASES)
def test_tail_split_grid_against_the_reference(plans_made, batch, nheads, nheads_kv, seqlen_q, causal, L):
    """Whole groups (final rows written directly) and the last wave's groups in splits (merged in the
    kernel): out and lse within the error bar; the group counters back to 0."""
    rng = np.random.default_rng(L + 3 * batch)
    c = case(rng, batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=128, capacity=L + 7)
    c["cache_seqlens"] = L
    _require_tail(c["q"], c["k_cache"], L)
    run_and_check(**c, causal=causal, policy=TAIL_POLICY, what=f"tail-split grid, L={L}")
    _assert_launched_tail(plans_made)
    assert _all_counters_zero(), "a group counter was left non-zero by the tail-split grid"


@pytest.mark.parametrize("dtype, head_dim", TAIL_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "paged 48", "append 3", "full caches"])
def test_tail_split_grid_paged_append_and_dtypes(plans_made, dtype, head_dim, layout):
    c, L, new = _layout_case(np.random.default_rng(head_dim + 1), TAIL_LAYOUT_CASE, dtype, head_dim, layout)
    _require_tail(c["q"], c["k_cache"], L, new)
    run_and_check(**c, policy=TAIL_POLICY, what=f"tail-split grid, {layout}")
    _assert_launched_tail(plans_made)
    assert _all_counters_zero(), "a group counter was left non-zero by the tail-split grid"


def test_tail_split_grid_repeats_and_matches_whole_groups(plans_made):
    """Two identical calls give the same bits (the counters reset); one split for every group (a given
    num_splits=1 never takes the tail split) gives the same rows for the groups the tail split leaves
    whole, and agrees within the bar on the split ones."""
    import cuflash

    rng = np.random.default_rng(6)
    batch, nheads, nheads_kv, _, _, L = TAIL_CASES[1]
    c = case(rng, batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_dim=128, capacity=L)
    args = (c["q"], c["k_cache"], c["v_cache"])
    p = _require_tail(c["q"], c["k_cache"], L)
    tail = [cuflash.attention_with_kvcache(*args, cache_seqlens=L, policy=TAIL_POLICY) for _ in range(2)]
    _assert_launched_tail(plans_made)
    assert (tail[0] == tail[1]).all(), "two identical tail-split calls differ"
    assert _all_counters_zero()
    whole = cuflash.attention_with_kvcache(*args, cache_seqlens=L, num_splits=1, policy=TAIL_POLICY)
    assert plans_made[-1].tail_groups == 0
    # Group g = b * nheads_kv + hk; the first batch * nheads_kv - tail_groups are whole in both calls.
    n_whole = batch * nheads_kv - p.tail_groups
    t, w = to_f64(tail[0]), to_f64(whole)
    rows_t, rows_w = (x.reshape(batch * nheads_kv, -1) for x in (t, w))  # MHA: one row per group
    assert (rows_t[:n_whole] == rows_w[:n_whole]).all(), "a whole group's output differs from the one-split grid's"
    ref = reference.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=L)[0]
    assert reference.max_abs_error(t, w) <= 2 * reference.max_abs_error(w, ref) + 1e-5


def test_deep_grid_at_a_bench_like_shape(plans_made):
    """The plan's own choice (no thresholds changed) at b=64, 32 kv heads, 2048 tokens: on the H200 the
    deep grid (plan/decode.py _deep_grid), 1980 whole groups at 3 CTAs per SM and the 68 of the last wave in
    splits, where the split model alone planned 2 splits a group. The whole groups give the bits of
    the one-split grid; the rows of the split ones agree with the reference."""
    import cuflash

    rng = np.random.default_rng(13)
    batch, nheads, L = 64, 32, 2048
    c = case(rng, batch=batch, nheads=nheads, nheads_kv=nheads, head_dim=128, capacity=L, lengths=[L] * batch)
    from cuflash import jit
    from cuflash.plan import decode as pdecode

    default = plan.DEFAULT_DECODE_POLICY
    p = _require_tail(c["q"], c["k_cache"], L, policy=default)
    if not pdecode._deep_grid(batch * nheads, -(-L // p.attn.spec.tile.block_n), 1, 1, p.attn.spec,
                              jit.device_sm_count(c["q"].device.id), default) \
            or p.ctas_per_sm != p.attn.spec.min_blocks:  # fmt: skip
        pytest.skip(f"the plan does not take the deep grid here (grid {p.attn.grid} at {p.ctas_per_sm} per SM)")
    args = (c["q"], c["k_cache"], c["v_cache"])
    deep = to_f64(cuflash.attention_with_kvcache(*args, cache_seqlens=L))
    _assert_launched_tail(plans_made)
    assert _all_counters_zero(), "a group counter was left non-zero by the deep grid"
    whole = to_f64(cuflash.attention_with_kvcache(*args, cache_seqlens=L, num_splits=1))
    assert plans_made[-1].tail_groups == 0
    n_whole = batch * nheads - p.tail_groups  # group g = b * nheads_kv + hk, one row each (MHA)
    rows_d, rows_w = (x.reshape(batch * nheads, -1) for x in (deep, whole))
    assert (rows_d[:n_whole] == rows_w[:n_whole]).all(), "a whole group's output differs from the one-split grid's"
    first = n_whole // nheads  # the first sequence with a split group
    ref = reference.attention_with_kvcache(c["q"][first:], to_f64(c["k_cache"][first:]),
                                           to_f64(c["v_cache"][first:]), cache_seqlens=L)[0]  # fmt: skip
    bound = reference.max_abs_error(whole[first:], ref)
    assert reference.max_abs_error(deep[first:], ref) <= 2 * bound + 1e-5


def test_unsplit_wave_at_a_bench_like_shape(plans_made):
    """The plan's own choice (no thresholds changed) at b=16, 8 kv heads, 4059 tokens in every sequence:
    on the H200 the unsplit wave (plan/decode.py _unsplit_wave), 128 whole groups, one CTA per SM, whose loads
    take the stepped path (63 full tiles and the first share of the last) and the per-row one (the rest
    of the ragged last tile). Checked against the reference; the same bits as one split launched 2 per
    SM (CTA loads) and as the element-wise load path (misaligned caches) on the same grid."""
    import cupy

    rng = np.random.default_rng(17)
    batch, capacity, L = 16, 4096, 4059
    c = dict(case(rng, batch=batch, nheads=32, nheads_kv=8, head_dim=128, capacity=capacity), cache_seqlens=L)
    p = _plan_of_call(c["q"], c["k_cache"], L)
    if (p.num_splits, p.ctas_per_sm) != (1, 1):
        pytest.skip(f"the plan does not take the unsplit wave here ({p.num_splits} splits at {p.ctas_per_sm} per SM)")
    wave_out, wave_lse, _, _ = run_and_check(**c, what="unsplit wave b=16 L=4059 h_kv=8")
    launched = plans_made[-1]
    assert (launched.num_splits, launched.ctas_per_sm, launched.combine) == (1, 1, None), launched
    assert launched.attn.spec.aligned
    out2, lse2, _, _ = run_and_check(**c, num_splits=1, policy=forced_per_sm(2), what="one split at 2 per SM")
    assert plans_made[-1].ctas_per_sm == 2 and plans_made[-1].attn.spec.cta_loads
    misaligned = dict(c, k_cache=_offset_view(c["k_cache"]), v_cache=_offset_view(c["v_cache"]))
    out3, lse3, _, _ = run_and_check(**misaligned, num_splits=1, policy=forced_per_sm(1), what="element-wise loads")
    assert not plans_made[-1].attn.spec.aligned and plans_made[-1].attn.grid == launched.attn.grid
    for out, lse, what in ((out2, lse2, "one split at 2 per SM"), (out3, lse3, "the element-wise loads")):
        assert bool((wave_out.view(cupy.uint16) == out.view(cupy.uint16)).all()), f"unsplit wave and {what} differ"
        assert bool((wave_lse == lse).all()), f"unsplit wave and {what} differ in lse"


def test_ragged_or_device_lengths_keep_equal_splits(plans_made):
    """The filled grid needs one length for all: the same shape with host list or device lengths plans
    equal splits (and is right)."""
    import cupy

    rng = np.random.default_rng(12)
    c = case(rng, batch=1, nheads=32, nheads_kv=32, head_dim=128, capacity=32768)
    _require_filled(c["q"], c["k_cache"], 32768, policy=plan.DEFAULT_DECODE_POLICY)
    for lengths in ([32768], cupy.asarray(np.array([32768], dtype=np.int32))):
        run_and_check(**dict(c, cache_seqlens=lengths), what=f"lengths {type(lengths).__name__}")
        assert plans_made and not plans_made[-1].split_major and plans_made[-1].split_tiles == 0


def test_device_lengths_and_int_lengths():
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=3, nheads=4, nheads_kv=2, capacity=500, lengths=[500, 17, 0])
    dev = dict(c, cache_seqlens=cupy.asarray(c["cache_seqlens"]))
    run_and_check(**dev, what="cupy cache_seqlens")
    run_and_check(**dev, check=True, what="cupy cache_seqlens, check=True")
    run_and_check(**dict(c, cache_seqlens=123), what="int cache_seqlens")
    run_and_check(**dict(c, cache_seqlens=[500, 1, 2]), what="list cache_seqlens")
    run_and_check(**dict(c, cache_seqlens=None), what="cache_seqlens=None (full caches)")


def test_unchecked_device_values_are_clamped():
    """Out-of-range lengths / pages in CuPy arrays (check=False): no access outside the caches, the
    lengths clamped into [0, capacity] and the pages into [0, num_blocks)."""
    import cuflash
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=3, nheads=4, nheads_kv=2, capacity=400, lengths=[0, 0, 0])
    bad = cupy.asarray(np.array([400 + 50, -7, 2**31 - 1], dtype=np.int32))
    run_and_check(**dict(c, cache_seqlens=bad), ref_lengths=np.array([400, 0, 400]), what="clamped lengths")
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -7"):
        cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=bad, check=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 450 exceeds the cache capacity of 400"):
        cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=bad.clip(0), check=True)
    p = case(rng, batch=2, nheads=4, nheads_kv=2, capacity=64, page_size=16, lengths=[64, 64])
    bt = p["block_table"].copy()
    bt[0, 1], bt[1, 3] = -5, 10**6
    out = cuflash.attention_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                         block_table=cupy.asarray(bt))  # fmt: skip
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
    clamped = np.clip(bt, 0, p["k_cache"].shape[0] - 1)  # what the kernel reads instead
    want = cuflash.attention_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                          block_table=clamped)  # fmt: skip
    assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -5"):
        cuflash.attention_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                       block_table=cupy.asarray(bt), check=True)  # fmt: skip


def test_appends_past_the_capacity_are_dropped_when_unchecked():
    import cuflash
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=2, nheads_kv=1, capacity=100, seqlen_new=3, lengths=[0, 0])
    lengths = cupy.asarray(np.array([98, 5], dtype=np.int32))  # sequence 0: its third new token does not fit
    kc0, vc0 = to_f64(c["k_cache"]), to_f64(c["v_cache"])
    out = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], k=c["k"], v=c["v"], cache_seqlens=lengths)
    kc, vc, kn, vn = (to_f64(x) for x in (c["k_cache"], c["v_cache"], c["k"], c["v"]))
    assert (kc[0, 98:100] == kn[0, :2]).all() and (kc[0, :98] == kc0[0, :98]).all()
    assert (vc[0, 98:100] == vn[0, :2]).all() and (vc[0, :98] == vc0[0, :98]).all()
    assert (kc[1, 5:8] == kn[1]).all() and (kc[1, :5] == kc0[1, :5]).all() and (kc[1, 8:] == kc0[1, 8:]).all()
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())


# ---------------------------------------------------------------------------------------------
# Property test over drawn shapes
# ---------------------------------------------------------------------------------------------


@st.composite
def decode_cases(draw):
    nheads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 48, 64, 112, 256])) if paged else None
    capacity = draw(st.integers(1, 2500))
    seqlen_new = draw(st.sampled_from([0, 0, 1, 2, 5]))
    if page_size is not None:
        capacity = max(1, -(-capacity // page_size)) * page_size
    capacity = max(capacity, seqlen_new)
    batch = draw(st.integers(1, 4))
    return dict(
        dtype=draw(st.sampled_from(["bf16", "fp16"])),
        head_dim=draw(st.one_of(st.sampled_from([32, 64, 96, 128, 160, 192, 224, 256]), st.integers(1, 256))),
        nheads=nheads_kv * group, nheads_kv=nheads_kv, batch=batch,
        seqlen_q=draw(st.integers(1, 4)), capacity=capacity, page_size=page_size, seqlen_new=seqlen_new,
        lengths=[draw(st.integers(0, capacity - seqlen_new)) for _ in range(batch)],
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        num_splits=draw(st.sampled_from([0, 0, 1, 2, 3, 9, 64])),
        layout=draw(st.sampled_from(["bshd", "bhsd"])),
        device_lengths=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_cases())
def test_decode_property(dc):
    import cupy

    rng = np.random.default_rng(dc["seed"])
    c = case(rng, batch=dc["batch"], seqlen_q=dc["seqlen_q"], nheads=dc["nheads"], nheads_kv=dc["nheads_kv"],
             head_dim=dc["head_dim"], dtype=dc["dtype"], capacity=dc["capacity"], lengths=dc["lengths"],
             seqlen_new=dc["seqlen_new"], page_size=dc["page_size"], layout=dc["layout"])  # fmt: skip
    if dc["device_lengths"]:
        c["cache_seqlens"] = cupy.asarray(c["cache_seqlens"])
    run_and_check(**c, causal=dc["causal"], softmax_scale=dc["scale"], num_splits=dc["num_splits"], what=str(dc))


# ---------------------------------------------------------------------------------------------
# Determinism, empty inputs, 64-bit offsets, argument errors
# ---------------------------------------------------------------------------------------------


def test_deterministic():
    import cuflash
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=2, seqlen_q=2, nheads=8, nheads_kv=2, head_dim=128, capacity=3000, lengths=[3000, 1234])
    args = dict(cache_seqlens=c["cache_seqlens"], causal=True, return_lse=True)
    first, lse0 = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], **args)
    for _ in range(5):
        again, lse = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], **args)
        assert bool((again.view(cupy.uint16) == first.view(cupy.uint16)).all())
        assert bool((lse.view(cupy.uint32) == lse0.view(cupy.uint32)).all())


# ---------------------------------------------------------------------------------------------
# The prepared path: a call signature seen before skips its checks and packing (kvcache._signature)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """The (kernel function, Launch, DecodeParams bytes) of every decode launch, in order (kvcache
    launches through cuflash.launch.launch, looked up on the module at each call)."""
    from cuflash import kvcache, launch
    from cuflash.params import DECODE_DTYPE

    made = []
    real = launch.launch

    def recording(fn, how, argv_ptr, stream_ptr):
        made.append((fn, how, kvcache._ARGS.buf.raw[: DECODE_DTYPE.itemsize]))  # (the buffer holds any record)
        return real(fn, how, argv_ptr, stream_ptr)

    monkeypatch.setattr(launch, "launch", recording)
    kvcache._PREPARED.calls.clear()
    yield made
    kvcache._PREPARED.calls.clear()


#: (what, call keywords) of repeated signatures: one length (int, device array, full caches), an
#: append, a paged cache, lse, a given out or none, GQA rows with causal speculative tokens.
PREPARED_CASES = [
    ("int length", dict(num_splits=0)), ("device lengths", dict(device_lengths=True)),
    ("full caches", dict(full=True)), ("append 2", dict(seqlen_new=2)), ("paged 32", dict(page_size=32)),
    ("lse, no out", dict(return_lse=True, no_out=True)), ("causal 3 tokens", dict(seqlen_q=3, causal=True)),
]  # fmt: skip


@pytest.mark.parametrize("what, kw", PREPARED_CASES)
def test_prepared_path_against_the_reference_and_the_whole_way(launches, monkeypatch, what, kw):
    """The second call of a signature takes the prepared path (no checks: checks.geometry is not called), with
    new arrays (pointers) and another length in the same 64-token step: checked against the reference;
    it launches the same kernels with the same DecodeParams bytes as the whole way does for the same
    call (the memo of prepared calls cleared; the lse pointer aside, a new array each call); and the
    fields it patches hold this call's pointers and length (read back through params.DECODE_DTYPE)."""
    import cupy

    import cuflash
    from cuflash import checks, kvcache
    from cuflash.params import DECODE_DTYPE

    rng = np.random.default_rng(31)
    kw = dict(kw)
    seqlen_new, page_size = kw.pop("seqlen_new", 0), kw.pop("page_size", None)
    device_lengths, full, no_out = kw.pop("device_lengths", False), kw.pop("full", False), kw.pop("no_out", False)
    seqlen_q, causal, return_lse = kw.pop("seqlen_q", 1), kw.pop("causal", False), kw.pop("return_lse", False)
    c = case(rng, batch=3, seqlen_q=seqlen_q, nheads=8, nheads_kv=2, head_dim=128, capacity=1500,
             seqlen_new=seqlen_new, page_size=page_size)  # fmt: skip
    if c["block_table"] is not None:  # on the GPU: a host table's values are checked every call (the whole way)
        c["block_table"] = cupy.asarray(c["block_table"])
    checked = []
    real_geometry = checks.geometry  # kvcache calls it as checks.geometry
    monkeypatch.setattr(checks, "geometry", lambda *args: checked.append(args[0]) or real_geometry(*args))

    def lengths(L):
        if full:
            return None
        return cupy.full(3, L, dtype=cupy.int32) if device_lengths else L

    for step, L in enumerate((1000, 1003)):  # one 64-token step of the plan
        del checked[:]
        run_and_check(**dict(c, q=c["q"].copy(), cache_seqlens=lengths(L)), causal=causal, what=f"{what} step {step}")
        assert bool(checked) == (step == 0), f"{what}: step {step} {'took' if checked else 'skipped'} the checks"
    args = dict(k=c["k"], v=c["v"], block_table=c["block_table"], cache_seqlens=lengths(1001), causal=causal,
                return_lse=return_lse)  # fmt: skip
    out = None if no_out else cupy.empty_like(c["q"])
    cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], out=out, **args)  # this signature's first
    records = []
    for prepared in (True, False):
        if not prepared:
            kvcache._PREPARED.calls.clear()
        del checked[:], launches[:]
        cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], out=out, **args)
        assert bool(checked) != prepared
        masked = []
        for fn, launch, buf in launches:
            buf = bytearray(buf)
            buf[6 * 8 : 7 * 8] = bytes(8)  # lse: a new array every call
            if no_out:
                buf[5 * 8 : 6 * 8] = bytes(8)  # o: likewise
            masked.append((fn.ptr, launch, bytes(buf)))
        records.append(masked)
        rec = np.frombuffer(launches[-1][2], dtype=DECODE_DTYPE)[0]
        seqlens = args["cache_seqlens"]
        want = dict(q=c["q"].data.ptr, k=c["k_cache"].data.ptr, v=c["v_cache"].data.ptr,
                    k_new=0 if c["k"] is None else c["k"].data.ptr, v_new=0 if c["v"] is None else c["v"].data.ptr,
                    seqlens=seqlens.data.ptr if device_lengths else 0,
                    block_table=0 if c["block_table"] is None else c["block_table"].data.ptr,
                    seqlen_const=1500 if full else (0 if device_lengths else 1001))  # fmt: skip
        if not no_out:
            want["o"] = out.data.ptr
        got = {name: int(rec[name]) for name in want}
        assert got == want, f"{what} (prepared={prepared}): the record's pointers or length"
        assert (int(rec["lse"]) != 0) == return_lse
    assert records[0] == records[1], f"{what}: the prepared path launched other kernels or other bytes"


def test_prepared_path_follows_the_plan_memo_and_the_pointers(launches, plans_made, monkeypatch):
    """What sends a seen signature the whole way again: a cleared plan memo whose planner now plans
    otherwise (as a tool swapping plan.plan_decode does: the new plan is the one launched), a pointer
    off the 16-byte rows (the element-wise kernels). Another policy is another signature (its own
    prepared call and plan). And a length past the capacity, after the same call was prepared with a
    good one, raises as before (such a call never gets a key: the whole way checks it)."""
    import cupy

    import cuflash
    from cuflash import kvcache

    rng = np.random.default_rng(41)
    c = case(rng, batch=2, nheads=8, nheads_kv=2, head_dim=128, capacity=2000, lengths=[1500, 1500])
    in_kernel = merge_policy("in kernel")
    run_and_check(**dict(c, cache_seqlens=1500), num_splits=6, policy=in_kernel, what="merged in the kernel")
    assert [how for _, how, _ in launches] == [plans_made[-1].attn] and plans_made[-1].combine is None
    n_prepared = len(kvcache._PREPARED.calls)
    del launches[:]
    run_and_check(**dict(c, cache_seqlens=1500), num_splits=6, policy=merge_policy("combine"), what="another policy")
    assert [how for _, how, _ in launches] == [plans_made[-1].attn, plans_made[-1].combine]
    assert len(kvcache._PREPARED.calls) == n_prepared + 1  # a signature of its own
    recording = plan.plan_decode  # plans_made's recorder
    with monkeypatch.context() as mp:
        # The in-kernel policy's signature again: prepared, but its plan is gone and the planner now
        # merges in the combine kernel.
        mp.setattr(plan, "plan_decode", lambda **kw: recording(**{**kw, "policy": merge_policy("combine")}))
        kvcache._plan_and_load.cache_clear()
        del launches[:]
        run_and_check(**dict(c, cache_seqlens=1500), num_splits=6, policy=in_kernel,
                      what="after the plan memo was cleared")  # fmt: skip
        assert [how for _, how, _ in launches] == [plans_made[-1].attn, plans_made[-1].combine]
        assert plans_made[-1].combine is not None
        # A view 8 bytes into the caches' allocation: rows no longer 16-byte aligned.
        kc = cupy.empty(c["k_cache"].size + 8, dtype=c["k_cache"].dtype)[4 : 4 + c["k_cache"].size]
        kc = kc.reshape(c["k_cache"].shape)
        kc[...] = c["k_cache"]
        del launches[:]
        run_and_check(**dict(c, k_cache=kc, cache_seqlens=1500), num_splits=6, policy=in_kernel,
                      what="misaligned k_cache")  # fmt: skip
        assert not launches[0][1].spec.aligned and launches[0][1] == plans_made[-1].attn
    kvcache._plan_and_load.cache_clear()  # drop the plans the swapped planner made
    for _ in range(2):  # the whole way, then prepared
        cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=1500, num_splits=6)
    args = (cupy.ndarray, kvcache._desc, c["q"], c["k_cache"], c["v_cache"], None, None, 1500, None, False, None, 6, False, None, False, None)
    assert kvcache._signature(*args) in kvcache._PREPARED.calls
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=2001, num_splits=6)


def test_append_path_follows_the_caches_not_q(launches):
    """The append kernel's 16-byte path depends on the caches and the new tokens only: a q (and out)
    whose rows are not 16-byte aligned sends the attention to the element-wise kernels but keeps the
    16-byte append, the first call and the prepared second alike; both against the reference."""
    import cupy

    rng = np.random.default_rng(43)
    c = case(rng, batch=2, nheads=8, nheads_kv=2, head_dim=128, capacity=700, seqlen_new=2, lengths=[600, 600])
    padded = cupy.empty((2, 1, 8, 132), dtype=c["q"].dtype)[..., :128]  # head stride 264 bytes
    padded[...] = c["q"]
    for step in range(2):
        del launches[:]
        run_and_check(**dict(c, q=padded, cache_seqlens=600 + 2 * step), num_splits=3, what=f"padded q, call {step}")
        append, attn = launches[0][1], launches[1][1]
        assert append.spec.family == "flash_decode_append" and append.spec.aligned, append.spec
        assert not attn.spec.aligned, attn.spec


def test_empty_inputs():
    import cuflash
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=4, nheads_kv=2, capacity=50, seqlen_new=1, lengths=[3, 0])
    # No query token: the new tokens are still appended.
    q0 = randn(rng, (2, 0, 4, 64), "bf16")
    out, lse = cuflash.attention_with_kvcache(q0, c["k_cache"], c["v_cache"], k=c["k"], v=c["v"],
                                              cache_seqlens=c["cache_seqlens"], return_lse=True)  # fmt: skip
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    assert (to_f64(c["k_cache"])[0, 3] == to_f64(c["k"])[0, 0]).all()
    # A cache of capacity 0: every query sees nothing.
    q = randn(rng, (2, 1, 4, 64), "bf16")
    empty = randn(rng, (2, 0, 2, 64), "bf16")
    out, lse = cuflash.attention_with_kvcache(q, empty, empty, return_lse=True)
    assert float(cupy.abs(out.astype(cupy.float32)).max()) == 0.0 and bool(cupy.isneginf(lse).all())
    qb = randn(rng, (0, 1, 4, 64), "bf16")
    assert cuflash.attention_with_kvcache(qb, c["k_cache"][:0], c["v_cache"][:0], cache_seqlens=0).shape == qb.shape


def test_64bit_offsets():
    """Cache rows (and pages) beyond 2^31 elements: every offset is computed in 64 bits."""
    import cupy

    rng = np.random.default_rng()
    d, s = 64, 200
    stride = 2**31 + 4096  # elements between cache rows / pages
    for paged in (False, True):
        bufk = cupy.empty(stride + s * d, dtype=np.float16)
        bufv = cupy.empty(stride + s * d, dtype=np.float16)
        shape, strides = (2, s, 1, d), (stride * 2, d * 2, d * 2, 2)
        kc = cupy.lib.stride_tricks.as_strided(bufk, shape=shape, strides=strides)
        vc = cupy.lib.stride_tricks.as_strided(bufv, shape=shape, strides=strides)
        kc[...] = randn(rng, shape, "fp16")
        vc[...] = randn(rng, shape, "fp16")
        q = randn(rng, (2, 1, 2, d), "fp16")
        kn, vn = randn(rng, (2, 1, 1, d), "fp16"), randn(rng, (2, 1, 1, d), "fp16")
        if paged:  # the 2 rows as 2 pages of 192 tokens; sequence 0 uses page 1, beyond 2^31 elements
            kc, vc = kc[:, :192], vc[:, :192]
            bt = np.array([[1], [0]], dtype=np.int32)
            run_and_check(q, kc, vc, k=kn, v=vn, cache_seqlens=[150, 191], block_table=bt, dtype="fp16",
                          what="paged, page 1 beyond 2^31 elements")  # fmt: skip
        else:
            run_and_check(q, kc, vc, k=kn, v=vn, cache_seqlens=[150, 199], dtype="fp16",
                          what="contiguous, row 1 beyond 2^31 elements")  # fmt: skip
        del kc, vc, bufk, bufv
        cupy.get_default_memory_pool().free_all_blocks()


def test_bad_inputs_have_clear_errors():
    import cuflash
    import cupy

    rng = np.random.default_rng()
    c = case(rng, batch=2, nheads=4, nheads_kv=2, capacity=64, lengths=[10, 20])
    q, kc, vc = c["q"], c["k_cache"], c["v_cache"]
    f = cuflash.attention_with_kvcache
    with pytest.raises(TypeError, match="cupy.ndarray"):
        f(q.get(), kc, vc)
    with pytest.raises(TypeError, match="share one dtype"):
        f(q, kc.astype(cupy.float16), vc.astype(cupy.float16))
    with pytest.raises(ValueError, match="same shape"):
        f(q, kc, vc[:, :10])
    with pytest.raises(ValueError, match="head dim"):
        f(q[..., :32], kc, vc)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        f(randn(rng, (2, 1, 3, 64), "bf16"), kc, vc)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        f(randn(rng, (3, 1, 4, 64), "bf16"), kc, vc)
    # Lengths beyond the cache, negative, wrong shape, wrong device dtype.
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 65 exceeds the cache capacity of 64"):
        f(q, kc, vc, cache_seqlens=[10, 65])
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0"):
        f(q, kc, vc, cache_seqlens=-1)
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        f(q, kc, vc, cache_seqlens=[1, 2, 3])
    with pytest.raises(TypeError, match="int32"):
        f(q, kc, vc, cache_seqlens=cupy.asarray([1, 2], dtype=cupy.int64))
    # New tokens that do not fit / malformed.
    kn, vn = randn(rng, (2, 3, 2, 64), "bf16"), randn(rng, (2, 3, 2, 64), "bf16")
    with pytest.raises(ValueError, match=r"3 new tokens do not fit: cache_seqlens\[1\] = 62 \+ 3"):
        f(q, kc, vc, k=kn, v=vn, cache_seqlens=[0, 62])
    with pytest.raises(ValueError, match="no room for the new tokens"):
        f(q, kc, vc, k=kn, v=vn)
    with pytest.raises(ValueError, match="given together"):
        f(q, kc, vc, k=kn, cache_seqlens=0)
    with pytest.raises(ValueError, match=r"\(batch, seqlen_new, nheads_kv, headdim\)"):
        f(q, kc, vc, k=kn[:, :, :1], v=vn[:, :, :1], cache_seqlens=0)
    with pytest.raises(TypeError, match="must have q's dtype"):
        f(q, kc, vc, k=kn.astype(cupy.float16), v=vn.astype(cupy.float16), cache_seqlens=0)
    # Paged: page size, block_table shape, dtype and range.
    p = case(rng, batch=2, nheads=4, nheads_kv=2, capacity=64, page_size=16, lengths=[10, 20])
    pq, pk, pv, bt = p["q"], p["k_cache"], p["v_cache"], p["block_table"]
    pages24 = randn(rng, (pk.shape[0], 24, 2, 64), "bf16")
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        f(pq, pages24, pages24, block_table=bt, cache_seqlens=0)
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch, max_blocks\)"):
        f(pq, pk, pv, block_table=bt[:1], cache_seqlens=0)
    with pytest.raises(ValueError, match=r"block_table must have shape"):
        f(pq, pk, pv, block_table=bt[0], cache_seqlens=0)
    with pytest.raises(TypeError, match="block_table must be int32"):
        f(pq, pk, pv, block_table=cupy.asarray(bt, dtype=cupy.int64), cache_seqlens=0)
    bad = bt.copy()
    bad[1, 1] = pk.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = \d+ is not a page of the cache"):
        f(pq, pk, pv, block_table=bad, cache_seqlens=[10, 20])
    f(pq, pk, pv, block_table=bad, cache_seqlens=[10, 16])  # entry 1 of sequence 1 unused: fine
    # A NumPy block table is validated against lengths that only the device holds too (read back), with
    # or without new tokens; unused entries stay fine.
    dev_lengths = cupy.asarray(np.array([10, 20], np.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = \d+ is not a page of the cache"):
        f(pq, pk, pv, block_table=bad, cache_seqlens=dev_lengths)
    kn2 = randn(rng, (2, 2, 2, 64), "bf16")
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = \d+ is not a page of the cache"):
        f(pq, pk, pv, k=kn2, v=kn2, block_table=bad, cache_seqlens=cupy.asarray(np.array([10, 15], np.int32)))
    f(pq, pk, pv, block_table=bad, cache_seqlens=cupy.asarray(np.array([10, 16], np.int32)))
    with pytest.raises(ValueError, match=r"exceeds the cache capacity of 64"):
        f(pq, pk, pv, block_table=bt, cache_seqlens=[65, 0])
    # Scalars.
    with pytest.raises(ValueError, match="num_splits"):
        f(q, kc, vc, cache_seqlens=1, num_splits=-1)
    with pytest.raises(ValueError, match="positive"):
        f(q, kc, vc, cache_seqlens=1, softmax_scale=0.0)
    with pytest.raises(ValueError, match="out must have"):
        f(q, kc, vc, cache_seqlens=1, out=poisoned((2, 1, 4, 32), "bf16"))
    # The tuning policy: a DecodePolicy or None, whose forced CTAs per SM the variant's tile must hold.
    with pytest.raises(TypeError, match="policy must be a cuflash.plan.DecodePolicy or None, got dict"):
        f(q, kc, vc, cache_seqlens=1, policy={"ctas_per_sm": 1})
    with pytest.raises(ValueError, match="ctas_per_sm must be 0"):
        f(q, kc, vc, cache_seqlens=1, policy=forced_per_sm(9))
    f(q, kc, vc, cache_seqlens=1, policy=forced_per_sm(1))  # 1 per SM fits every tile
