"""GPU tests of cuflash.attention_backward against the float64 reference (skipped without a GPU)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_util import DTYPES, check_backward, nan_recycled_memory, poisoned, random_qkv, randn

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))
BUCKETS = [32, 64, 96, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", BUCKETS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_bucket(dtype, head_dim, causal):
    rng = np.random.default_rng()
    b, sq, sk, h = 2, 300, 333, 2
    q, k, v = random_qkv(rng, b, sq, sk, h, h, head_dim, dtype)
    check_backward(q, k, v, causal=causal, dtype=dtype, what=f"hd{head_dim} {dtype} causal={causal}")


@pytest.mark.parametrize(
    "sq,sk,causal",
    [(1, 1, False), (1, 1, True), (1, 700, True), (700, 1, True), (129, 64, True), (64, 129, True),
     (1000, 37, True), (37, 1000, False), (128, 128, True), (2048, 2048, True), (2048, 2048, False)],
)
def test_lengths_and_causal_alignment(sq, sk, causal):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 2, 64, "bf16")
    check_backward(q, k, v, causal=causal, dtype="bf16", what=f"sq={sq} sk={sk}")


@pytest.mark.parametrize("head_dim", [1, 3, 8, 33, 72, 100, 129, 200, 255])
def test_ragged_head_dims(head_dim):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 150, 170, 2, 1, head_dim, "fp16")
    check_backward(q, k, v, causal=True, dtype="fp16", what=f"hd{head_dim}")


@pytest.mark.parametrize("causal", [False, True])
def test_transposed_inputs_and_gqa(causal):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 513, 700, 8, 2, 128, "bf16", layout_q="bhsd", layout_kv="bhsd", layout_v="bshd")
    check_backward(q, k, v, causal=causal, softmax_scale=0.3, dtype="bf16")


@st.composite
def backward_cases(draw, dtype: str, causal: bool):
    head_dim = draw(st.one_of(st.sampled_from(BUCKETS), st.integers(1, 256)))
    nheads_kv = draw(st.integers(1, 3))
    nheads = nheads_kv * draw(st.sampled_from([1, 2, 4]))
    hi = 2000 if draw(st.booleans()) else 300
    seqlen_q = draw(st.integers(1, hi))
    seqlen_k = draw(st.integers(1, hi))
    batch = 1 if seqlen_q * seqlen_k > 500_000 else draw(st.integers(1, 3))
    if seqlen_q * seqlen_k * nheads * batch > 3_000_000:  # keep the float64 reference quick
        nheads = nheads_kv
    return dict(
        dtype=dtype, head_dim=head_dim, nheads=nheads, nheads_kv=nheads_kv, batch=batch,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        layout_q=draw(st.sampled_from(["bshd", "bhsd"])), layout_kv=draw(st.sampled_from(["bshd", "bhsd"])),
        deterministic=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def _check_case(case):
    rng = np.random.default_rng(case["seed"])
    b, d, dt = case["batch"], case["head_dim"], case["dtype"]
    q, k, v = random_qkv(rng, b, case["seqlen_q"], case["seqlen_k"], case["nheads"], case["nheads_kv"], d, dt,
                         layout_q=case["layout_q"], layout_kv=case["layout_kv"])
    check_backward(
        q, k, v, causal=case["causal"], softmax_scale=case["scale"], dtype=dt, deterministic=case["deterministic"],
        what=str(case), rng=rng,
    )  # fmt: skip


#: The property test runs in four parts (dtype x causal), EXAMPLES examples in all: pytest-xdist runs
#: them side by side, and each example's float64 reference takes seconds on the CPU.
PARTS = [("bf16", False), ("bf16", True), ("fp16", False), ("fp16", True)]


@pytest.mark.parametrize("dtype, causal", PARTS)
@settings(max_examples=max(1, EXAMPLES // len(PARTS)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_backward_property(dtype, causal, data):
    _check_case(data.draw(backward_cases(dtype, causal), label="case"))


def test_backward_one_key():
    """One key, exact dQ = dK = 0: the H200's dQ error 1.54e-5 came from dP's tensor-core accumulation,
    which every IEEE order of the plain bar missed (reference.plain_attention_backward_bar;
    test_reference.py)."""
    _check_case(dict(dtype="fp16", head_dim=224, nheads=1, nheads_kv=1, batch=1, seqlen_q=1, seqlen_k=1, causal=False,
                     scale=1.0, layout_q="bshd", layout_kv="bshd", deterministic=False, seed=258))  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk", [(300, 333, 4, 2), (1, 700, 2, 1), (700, 1, 2, 2), (513, 1025, 2, 1), (128, 128, 1, 1)])
def test_both_backward_kernels(dtype, head_dim, causal, sq, sk, h, hk):
    """On Hopper the planner runs a wgmma backward for these inputs (the warp-specialized TMA one by
    default): check each Hopper kernel and the mma.sync kernel (other GPUs, unaligned
    inputs, other buckets, deterministic mode) on the same data."""
    from cuflash import jit, plan

    arch = jit.device_arch(0)
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, sq, sk, h, hk, head_dim, dtype)
    tiles = [plan.bwd_tile(head_dim, arch)]
    if arch == "sm_90a":
        tiles.append(plan.BWD_SM90_TILES[head_dim])
        if head_dim in plan.BWD_SM90_WS_TILES:
            tiles.append(plan.BWD_SM90_WS_TILES[head_dim])
    for tile in tiles:
        check_backward(q, k, v, causal=causal, dtype=dtype, tile=tile, rng=rng, what=f"{tile} sq={sq} sk={sk}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(4, 1), (300, 77), (70, 200)])
def test_very_negative_scores_with_a_ragged_last_key_block(dtype, head_dim, causal, sq, sk):
    """Scores around -25 sqrt(d) (q = randn - 5, k = randn + 5), so exp(-lse) overflows fp16 and fp32.
    The keys past seqlen_k in the last key block have zero K rows, S = 0 and, unmasked, P = exp(-lse)
    = inf, which dQ = dS K turns into NaN (found by test_backward_property: fp16 hd32, seqlen_q 4,
    seqlen_k 1, scale 1). Both backward kernels, each held to the usual rule."""
    import cupy

    from cuflash import jit, plan

    rng = np.random.default_rng()

    def shifted(seqlen, heads, shift):
        x = rng.standard_normal((2, seqlen, heads, head_dim), dtype=np.float32) + shift
        return cupy.asarray(x.astype(DTYPES[dtype]))

    q, k, v = shifted(sq, 2, -5.0), shifted(sk, 1, 5.0), shifted(sk, 1, 0.0)
    arch = jit.device_arch(0)
    tiles = [plan.bwd_tile(head_dim, arch)]
    if arch == "sm_90a" and head_dim in plan.BWD_SM90_TILES:
        tiles.append(plan.BWD_SM90_TILES[head_dim])
    if arch == "sm_90a" and head_dim in plan.BWD_SM90_WS_TILES:
        tiles.append(plan.BWD_SM90_WS_TILES[head_dim])
    for tile in tiles:
        check_backward(q, k, v, causal=causal, dtype=dtype, tile=tile, rng=rng, what=f"{tile} sq={sq} sk={sk}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])  # (on Hopper: the TMA kernel at 64, 128, 256, mma.sync at 96)
def test_deterministic_mode_is_bitwise_reproducible(causal, head_dim):
    """deterministic=True: 50 runs give bitwise identical dq, dk, dv (GQA, many key blocks per query block)."""
    import cupy

    import cuflash

    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 1000, 1500, 4, 2, head_dim, "bf16")
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = randn(rng, q.shape, "bf16")
    first = [x.copy() for x in cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)]
    for run in range(50):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} differs on run {run + 1}"
    check_backward(q, k, v, causal=causal, dtype="bf16", deterministic=True)


@pytest.mark.parametrize("head_dim,deterministic", [(32, False), (64, False), (128, False), (128, True), (256, False),
                                                    (96, False)])  # fmt: skip
def test_dq_accumulator_is_zeroed_by_the_preprocess(head_dim, deterministic):
    """The fp32 dQ accumulator is allocated uninitialized and zeroed by the preprocess kernel: in memory that
    held NaN the gradients still pass: the planner's kernels (on Hopper the TMA one at 64 / 128 / 256, mma.sync
    at 32 and 96; the preprocess's 8 rows per warp at 32), deterministic mode's ordered additions, GQA, ragged
    blocks. q, k, v are made inside: the pool is freed at the end, so the test uses them there only."""
    rng = np.random.default_rng(head_dim)
    with nan_recycled_memory():
        q, k, v = random_qkv(rng, 2, 300, 333, 4, 2, head_dim, "bf16")
        check_backward(q, k, v, causal=False, dtype="bf16", deterministic=deterministic, rng=rng)


def test_empty_inputs():
    import cupy

    import cuflash

    rng = np.random.default_rng()
    q0 = randn(rng, (2, 0, 2, 64), "bf16")
    k = randn(rng, (2, 5, 2, 64), "bf16")
    out0, lse0 = cuflash.attention(q0, k, k, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(out0, q0, k, k, out0, lse0)
    assert dq.shape == q0.shape and dk.shape == k.shape
    assert float(cupy.abs(dk.astype(cupy.float32)).max()) == 0.0 and float(cupy.abs(dv.astype(cupy.float32)).max()) == 0.0
    q = randn(rng, (2, 7, 2, 64), "bf16")
    k0 = randn(rng, (2, 0, 2, 64), "bf16")
    out, lse = cuflash.attention(q, k0, k0, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(out, q, k0, k0, out, lse)
    assert float(cupy.abs(dq.astype(cupy.float32)).max()) == 0.0 and dk.shape == k0.shape


def test_bad_inputs_have_clear_errors():
    import cupy

    import cuflash

    rng = np.random.default_rng()
    q = randn(rng, (1, 8, 4, 64), "bf16")
    k = randn(rng, (1, 8, 2, 64), "bf16")
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    with pytest.raises(TypeError, match="dout must be a cupy.ndarray"):
        cuflash.attention_backward(out.get(), q, k, k, out, lse)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        cuflash.attention_backward(out[:, :4], q, k, k, out, lse)
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        cuflash.attention_backward(out, q, k, k, out, lse[:, :2])
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        cuflash.attention_backward(out, q, k, k, out, lse.astype(cupy.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        cuflash.attention_backward(out, q, k, k, out, cupy.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="out must have q's shape"):
        cuflash.attention_backward(out, q, k, k, out.astype(cupy.float16), lse)
    with pytest.raises(ValueError, match="dk must have k's shape"):
        cuflash.attention_backward(out, q, k, k, out, lse, dk=poisoned((1, 8, 4, 64), "bf16"))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        k3 = randn(rng, (1, 8, 3, 64), "bf16")
        cuflash.attention_backward(out, q, k3, k3, out, lse)
