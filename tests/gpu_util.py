"""Helpers for the GPU tests: random inputs, poisoned outputs, comparison against the reference."""
from __future__ import annotations

import contextlib
import dataclasses

import ml_dtypes
import numpy as np

from cuflash import plan, reference

DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}


def randn(rng: np.random.Generator, shape, dtype: str, layout: str = "bshd"):
    """Random normal CuPy array of `shape` (b, s, h, d). layout "bhsd" stores it as (b, h, s, d)
    and returns the transposed view, so the strides are not the contiguous ones."""
    import cupy

    b, s, h, d = shape
    if layout == "bhsd":
        host = rng.standard_normal((b, h, s, d), dtype=np.float32).astype(DTYPES[dtype])
        return cupy.asarray(host).transpose(0, 2, 1, 3)
    host = rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype])
    return cupy.asarray(host)


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype: str, layout_q="bshd",
               layout_kv="bshd", layout_v=None):  # fmt: skip
    """q (batch, seqlen_q, nheads, head_dim), then k and v (batch, seqlen_k, nheads_kv, head_dim), drawn
    from rng in that order (randn; v takes layout_kv unless layout_v is given)."""
    q = randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, layout_q)
    k = randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, layout_kv)
    v = randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, layout_kv if layout_v is None else layout_v)
    return q, k, v


NAN_BITS = 0x7FFF  # NaN in both fp16 and bf16


@contextlib.contextmanager
def nan_recycled_memory(nbytes: int = 256 << 20):
    """Inside: CuPy allocates from a fresh memory pool whose free memory held NaN (one freed block that
    later allocations split), so a scratch buffer that a kernel should have zeroed or written but did not
    reads as NaN. Checks that the poisoning took before handing over. The pool's memory is freed on exit:
    arrays made inside must not be used after the block."""
    import cupy

    pool = cupy.cuda.MemoryPool()
    try:
        with cupy.cuda.using_allocator(pool.malloc):
            junk = cupy.full(nbytes // 4, np.nan, dtype=np.float32)
            del junk
            probe = cupy.empty(1 << 16, dtype=np.float32)
            assert bool(cupy.isnan(probe).all()), "the recycled memory does not hold NaN: the poisoning failed"
            del probe
            yield
    finally:
        pool.free_all_blocks()


def poisoned(shape, dtype: str):
    """A fresh array filled with NaN bits."""
    import cupy

    out = cupy.empty(shape, dtype=DTYPES[dtype])
    out.view(cupy.uint16).fill(NAN_BITS)
    return out


def poison_rows(x, rows):
    """Fill x[rows] (a fp16 / bf16 CuPy array, rows a slice of its first axis) with NaN bits."""
    x.view("uint16")[rows] = NAN_BITS


PACKED_LENGTHS = [300, 200, 77]  # packed_with_gaps' three sequences


def packed_with_gaps(rng, head_dim, heads):
    """A packed batch with rows a kernel must not read as data: the three sequences of PACKED_LENGTHS
    (577 rows) and 40 rows after them, seqused_k 100, 150 and 77. Returns one bf16 CuPy array of shape
    (617, h, head_dim) per h in heads (randn from rng in that order), cu_seqlens, seqused_k, the packed
    rows (577), and the key rows no sequence uses (sequence 0's, sequence 1's, the tail; slices), which
    the caller fills with poison_rows."""
    import cupy

    from cuflash.checks import BF16

    n = sum(PACKED_LENGTHS)
    arrays = [cupy.asarray(rng.standard_normal((n + 40, h, head_dim), dtype=np.float32).astype(BF16)) for h in heads]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(PACKED_LENGTHS)]).astype(np.int32))
    used = cupy.asarray(np.array([100, 150, 77], np.int32))
    return arrays, cu, used, n, (slice(100, 300), slice(450, 500), slice(n, n + 40))


def to_f64(x) -> np.ndarray:
    return np.asarray(x.get(), dtype=np.float64)


def check_lse(lse, ref_lse, what=""):
    lse = np.asarray(lse.get(), dtype=np.float64)
    assert lse.shape == ref_lse.shape, (lse.shape, ref_lse.shape)
    assert not np.isnan(lse).any(), f"NaN in lse {what}"
    ninf = np.isneginf(ref_lse)
    assert (np.isneginf(lse) == ninf).all(), f"-inf pattern of lse differs {what}"
    fin = ~ninf
    if fin.any():
        err = np.max(np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin])))
        assert err < 2e-4, f"lse relative error {err:.3g} {what}"


def check_forward(q, k, v, *, causal, softmax_scale=None, dtype: str, what="", tile=None, **variants):
    """Run cuflash.attention with a NaN-poisoned `out` and apply DESIGN.md's pass rule. A `tile`
    (plan.Tile or plan.Sm90Tile) forces that kernel and tile instead of the planner's choice.
    ``variants``: window_size, softcap, alibi_slopes, dropout_p, rng_state (the reference gets the
    rng_state the call returns). Returns (err, bound)."""
    import cuflash
    from cuflash import forward  # cuflash.forward.run: attention plus the tile to force

    out = poisoned(q.shape, dtype)
    if tile is None:
        res = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, out=out, **variants)
    else:
        res = forward.run(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, out=out, tile=tile,
                          **variants)  # fmt: skip
    ret, lse = res[0], res[1]
    assert len(res) == (3 if variants.get("dropout_p", 0) > 0 else 2)
    if len(res) == 3:
        variants = dict(variants, rng_state=res[2])
    assert ret is out
    ref, ref_lse = reference.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **variants)
    plain = reference.plain_attention_bar(q, k, v, ref, causal=causal, softmax_scale=softmax_scale, dtype=DTYPES[dtype],
                                          **variants)  # fmt: skip
    got = to_f64(out)
    err = reference.max_abs_error(got, ref)
    bound = 2 * reference.max_abs_error(plain, ref) + 1e-5
    assert reference.within_tolerance(got, ref, plain), f"max abs error {err:.3g} > bound {bound:.3g} {what}"
    check_lse(lse, ref_lse, what)
    return err, bound


def check_backward(q, k, v, *, causal, softmax_scale=None, dtype: str, what="", deterministic=False, rng=None,
                   tile=None, **variants):  # fmt: skip
    """Forward with cuflash, then cuflash.attention_backward into NaN-poisoned dq/dk/dv, each gradient
    held to DESIGN.md's rule for gradients: 3x the plain same-precision error + 1e-5, NaN never passes.
    A `tile` (plan.BwdTile or plan.BwdSm90Tile) forces that main kernel instead of the planner's choice."""
    import cupy

    import cuflash
    from cuflash import backward  # cuflash.backward.run: attention_backward plus the tile to force

    res = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **variants)
    out, lse = res[0], res[1]
    if len(res) == 3:  # dropout: the backward replays the forward's stream
        variants = dict(variants, rng_state=res[2])
    rng = rng if rng is not None else np.random.default_rng()  # pass the case's rng to make a failure replayable
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(DTYPES[dtype]))
    grads = [poisoned(x.shape, dtype) for x in (q, k, v)]
    ret = backward.run(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
        dq=grads[0], dk=grads[1], dv=grads[2], tile=tile, **variants,
    )  # fmt: skip
    assert all(r is g for r, g in zip(ret, grads))
    refs = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, **variants)
    # The plain backward gets the same `out` as the kernel (for D), as any implementation of the API does;
    # of its summation orders (D pairwise or left to right, dP as tensor cores sum it), the worst per
    # gradient sets the bar.
    plains = reference.plain_attention_backward_bar(dout, q, k, v, refs, causal=causal, softmax_scale=softmax_scale,
                                                    dtype=DTYPES[dtype], out=out, **variants)  # fmt: skip
    errors = {}
    for name, got, ref, plain in zip(("dq", "dk", "dv"), grads, refs, plains):
        got = to_f64(got)
        err = reference.max_abs_error(got, ref)
        bound = 3 * reference.max_abs_error(plain, ref) + 1e-5
        if not reference.within_tolerance(got, ref, plain, factor=3.0):
            where = np.unravel_index(np.nanargmax(np.where(np.isnan(got), np.inf, np.abs(got - ref))), got.shape)
            raise AssertionError(
                f"{name}: max abs error {err:.3g} > bound {bound:.3g} (worst at (b, s, h, d) = {where}: "
                f"got {got[where]!r}, want {ref[where]!r}) {what}"
            )
        errors[name] = (err, bound)
    return errors


def merge_policy(where: str, **fields) -> plan.DecodePolicy:
    """A decode policy that forces who merges the splits: "in kernel" (the last split CTA of each group)
    or "combine" (the combine kernel after the split kernel), whatever the default in_kernel_merge_max
    would pick; ``fields``: other DecodePolicy fields (e.g. combine="lean")."""
    cap = {"in kernel": 1 << 30, "combine": 0}[where]
    return dataclasses.replace(plan.DEFAULT_DECODE_POLICY, in_kernel_merge_max=cap, **fields)
