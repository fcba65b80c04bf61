"""GPU tests of cuflash.attention against the float64 reference (skipped without a GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_util import check_forward, poisoned, random_qkv, randn, to_f64

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_bucket(dtype, head_dim, causal):
    rng = np.random.default_rng()
    b, sq, sk, h = 2, 300, 333, 2
    q, k, v = random_qkv(rng, b, sq, sk, h, h, head_dim, dtype)
    check_forward(q, k, v, causal=causal, dtype=dtype, what=f"hd{head_dim} {dtype} causal={causal}")


@pytest.mark.parametrize(
    "sq,sk,causal",
    [(1, 1, False), (1, 1, True), (1, 700, True), (700, 1, True), (129, 64, True), (64, 129, True),
     (1000, 37, True), (37, 1000, False), (128, 128, True), (4096, 4096, True)],
)
def test_lengths_and_causal_alignment(sq, sk, causal):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 1, sq, sk, 3, 3, 64, "bf16")
    check_forward(q, k, v, causal=causal, dtype="bf16", what=f"sq={sq} sk={sk}")


@pytest.mark.parametrize("head_dim", [1, 3, 8, 33, 72, 100, 129, 200, 255])
def test_ragged_head_dims(head_dim):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 150, 170, 2, 1, head_dim, "fp16")
    check_forward(q, k, v, causal=True, dtype="fp16", what=f"hd{head_dim}")


def _device_arch():
    from cuflash import jit

    return jit.device_arch(0)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(300, 333), (1, 700), (700, 1), (513, 1025), (128, 128)])
def test_both_forward_kernels(dtype, head_dim, causal, sq, sk):
    """On Hopper the planner runs the warp-specialized TMA kernel for these inputs: check it, the cp.async
    wgmma kernel (its fallback) and the mma.sync kernel (which other GPUs, unaligned inputs and other
    buckets run) on the same data."""
    from cuflash import plan

    arch = _device_arch()
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, head_dim, dtype)
    tiles = [plan.fwd_tile(head_dim, arch)]
    if arch == "sm_90a":
        tiles += [plan.FWD_SM90_TILES[head_dim], plan.FWD_SM90_WS_TILES[head_dim]]
    # and the mma.sync tiles other GPUs plan (the A100's, the RTX / L4 one's), compiled for this one
    tiles += [t for t in (plan.fwd_tile(head_dim, "sm_80"), plan.fwd_tile(head_dim, "sm_86")) if t not in tiles]
    for tile in tiles:
        check_forward(q, k, v, causal=causal, dtype=dtype, tile=tile, what=f"{tile} sq={sq} sk={sk}")


def test_transposed_inputs_and_gqa():
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 513, 700, 8, 2, 128, "bf16", layout_q="bhsd", layout_kv="bhsd", layout_v="bshd")
    assert not q.flags.c_contiguous
    check_forward(q, k, v, causal=False, softmax_scale=0.3, dtype="bf16")


def test_rows_off_by_8_bytes():
    """Head strides of head_dim + 4 elements: a 16-byte aligned base, rows 8 bytes off (element-wise loads)."""
    import cupy

    from cuflash.checks import aligned16

    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 300, 257, 4, 2, 64, "fp16")
    views = []
    for x in (q, k, v):
        y = cupy.empty(x.shape[:3] + (x.shape[3] + 4,), dtype=x.dtype)[..., : x.shape[3]]
        y[...] = x
        assert not aligned16(y)
        views.append(y)
    check_forward(*views, causal=True, dtype="fp16")


@st.composite
def forward_cases(draw):
    dtype = draw(st.sampled_from(["bf16", "fp16"]))
    head_dim = draw(st.one_of(st.sampled_from([32, 64, 96, 128, 160, 192, 224, 256]), st.integers(1, 256)))
    nheads_kv = draw(st.integers(1, 3))
    nheads = nheads_kv * draw(st.sampled_from([1, 2, 4]))
    long = draw(st.booleans())
    hi = 2500 if long else 300
    seqlen_q = draw(st.integers(1, hi))
    seqlen_k = draw(st.integers(1, hi))
    batch = 1 if seqlen_q * seqlen_k > 500_000 else draw(st.integers(1, 4))
    if seqlen_q * seqlen_k * nheads * batch > 4_000_000:  # keep the float64 reference quick
        nheads, nheads_kv = nheads_kv, nheads_kv
    return dict(
        dtype=dtype, head_dim=head_dim, nheads=nheads, nheads_kv=nheads_kv, batch=batch,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        layout_q=draw(st.sampled_from(["bshd", "bhsd"])),
        layout_kv=draw(st.sampled_from(["bshd", "bhsd"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forward_cases())
def test_forward_property(case):
    rng = np.random.default_rng(case["seed"])
    b, d, dt = case["batch"], case["head_dim"], case["dtype"]
    q, k, v = random_qkv(rng, b, case["seqlen_q"], case["seqlen_k"], case["nheads"], case["nheads_kv"], d, dt,
                         layout_q=case["layout_q"], layout_kv=case["layout_kv"])
    check_forward(q, k, v, causal=case["causal"], softmax_scale=case["scale"], dtype=dt, what=str(case))


def test_deterministic():
    import cuflash

    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, 2, 1000, 1100, 4, 4, 128, "bf16")
    first, lse0 = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for _ in range(10):
        again, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        assert (again.view("uint16") == first.view("uint16")).all()
        assert (lse.view("uint32") == lse0.view("uint32")).all()


def test_64bit_offsets():
    """Batch stride beyond 2^31 elements: offsets must be computed in 64 bits."""
    import cupy

    from cuflash import reference

    rng = np.random.default_rng()
    d, s = 64, 96
    batch_stride = 2**31 + 4096  # elements
    buf = cupy.empty(batch_stride + s * d, dtype=np.float16)
    host = rng.standard_normal((2, s, 1, d), dtype=np.float32).astype(np.float16)
    strides = (batch_stride * 2, d * 2, d * 2, 2)  # bytes
    q = cupy.lib.stride_tricks.as_strided(buf, shape=(2, s, 1, d), strides=strides)
    q[...] = cupy.asarray(host)
    out = cupy.empty((2, s, 1, d), dtype=np.float16)
    import cuflash

    cuflash.attention(q, q, q, out=out)
    ref, _ = reference.attention_forward(q, q, q)
    plain = reference.plain_attention_bar(q, q, q, ref, dtype=np.float16)
    assert reference.within_tolerance(to_f64(out), ref, plain)
    del buf


def test_empty_inputs():
    import cupy

    import cuflash

    rng = np.random.default_rng()
    q = randn(rng, (2, 0, 2, 64), "bf16")
    k = randn(rng, (2, 5, 2, 64), "bf16")
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)
    q = randn(rng, (2, 7, 2, 64), "bf16")
    k0 = randn(rng, (2, 0, 2, 64), "bf16")
    out, lse = cuflash.attention(q, k0, k0, return_lse=True)
    assert float(cupy.abs(out.astype(cupy.float32)).max()) == 0.0
    assert bool(cupy.isneginf(lse).all())
    q = randn(rng, (0, 7, 2, 64), "bf16")
    assert cuflash.attention(q, q, q).shape == (0, 7, 2, 64)


def test_bad_inputs_have_clear_errors():
    import cupy

    import cuflash

    rng = np.random.default_rng()
    q = randn(rng, (1, 8, 4, 64), "bf16")
    k = randn(rng, (1, 8, 2, 64), "bf16")
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.attention(q.get(), k, k)
    with pytest.raises(ValueError, match="4-D"):
        cuflash.attention(q[0], k, k)
    with pytest.raises(TypeError, match="share one dtype"):
        cuflash.attention(q, k.astype(cupy.float16), k.astype(cupy.float16))
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        cuflash.attention(q.astype(cupy.float32), k.astype(cupy.float32), k.astype(cupy.float32))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        cuflash.attention(q, randn(rng, (1, 8, 3, 64), "bf16"), randn(rng, (1, 8, 3, 64), "bf16"))
    with pytest.raises(ValueError, match="same batch"):
        cuflash.attention(q, randn(rng, (2, 8, 2, 64), "bf16"), randn(rng, (2, 8, 2, 64), "bf16"))
    with pytest.raises(ValueError, match="head dim"):
        cuflash.attention(q, randn(rng, (1, 8, 2, 32), "bf16"), randn(rng, (1, 8, 2, 32), "bf16"))
    with pytest.raises(ValueError, match="1 to 256"):
        big = randn(rng, (1, 8, 2, 320), "bf16")
        cuflash.attention(big, big, big)
    with pytest.raises(ValueError, match="contiguous in its last"):
        cuflash.attention(q[..., ::2], k[..., ::2], k[..., ::2])
    with pytest.raises(ValueError, match="positive"):
        cuflash.attention(q, k, k, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="out must have"):
        cuflash.attention(q, k, k, out=poisoned((1, 8, 4, 32), "bf16"))


def test_precompiled_cache_loads_with_zero_compiles(tmp_path):
    """`cuflash precompile` in one process; a later process runs attention without compiling."""
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(tmp_path / "cache"))
    pre = subprocess.run(
        [sys.executable, "-m", "cuflash", "precompile", "--head-dim", "128", "--dtype", "bf16", "-j", "2"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert pre.returncode == 0, pre.stdout + pre.stderr
    code = (
        "import numpy as np, cupy, ml_dtypes, json, cuflash\n"
        "from cuflash import jit\n"
        "x = cupy.asarray(np.random.default_rng().standard_normal((1, 300, 2, 128)).astype(ml_dtypes.bfloat16))\n"
        "cuflash.attention(x, x, x, causal=True); cuflash.attention(x, x, x)\n"
        "cupy.cuda.get_current_stream().synchronize()\n"
        "print(json.dumps(jit.stats()))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    import json

    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == 0 and stats["disk_loads"] == 2 and stats["module_loads"] == 2, stats


# ---------------------------------------------------------------------------------------------
# The prepared path: a call signature seen before skips its checks, plan lookup and packing
# (forward._signature, forward.run_prepared)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fwd_launches(monkeypatch):
    """(kernel function, Launch, parameter bytes: tensor maps and FwdParams) of every forward launch, in
    order: cuflash.launch.launch, which the whole way (through launch_record) and the prepared path both
    call, looked up on the module at each call. The memo of prepared calls is cleared before and after."""
    from cuflash import forward, launch
    from cuflash.params import FWD_DTYPE
    from cuflash.tma import MAP_BYTES

    made = []
    real = launch.launch

    def recording(fn, how, argv_ptr, stream_ptr):
        n = FWD_DTYPE.itemsize + (4 * MAP_BYTES if how.spec.family == "flash_fwd_sm90_ws" else 0)
        made.append((fn, how, launch.ARGS.buf.raw[:n]))
        return real(fn, how, argv_ptr, stream_ptr)

    monkeypatch.setattr(launch, "launch", recording)
    forward._PREPARED.calls.clear()
    yield made
    forward._PREPARED.calls.clear()


@pytest.fixture
def checked(monkeypatch):
    """The names of the calls that took the whole way's checks (checks.check_qkv, called through the module)."""
    from cuflash import checks

    seen = []
    real = checks.check_qkv
    monkeypatch.setattr(checks, "check_qkv", lambda *a: seen.append(a[0].shape) or real(*a))
    return seen


#: (what, shapes (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim), call keywords): on the H200 the TMA
#: kernel's persistent and per-tile launches (with and without its output map), the cp.async wgmma kernel's
#: unaligned head dim (mma.sync), a window with softcap, a shifted diagonal, a given out, strided inputs.
PREPARED_FWD_CASES = [
    ("hd64 short keys", (2, 512, 512, 8, 8, 64), {}),
    ("hd128 causal GQA", (2, 300, 333, 8, 2, 128), dict(causal=True)),
    ("hd128 long keys", (1, 200, 4096, 4, 4, 128), {}),
    ("hd256 window softcap", (2, 257, 300, 4, 2, 256), dict(window_size=(64, 0), softcap=20.0)),
    ("hd40", (2, 129, 140, 4, 4, 40), dict(causal=True, softmax_scale=0.2)),
    ("hd33 (element-wise loads)", (2, 100, 77, 3, 1, 33), dict(causal=True)),
    ("hd64 shifted diagonal", (1, 300, 500, 4, 1, 64), dict(causal=True, diag_shift=-30)),
    ("strided q, given out", (2, 300, 400, 4, 4, 128), dict(layout_q="bhsd", out=True)),
]  # fmt: skip


@pytest.mark.parametrize("what, shape, kw", PREPARED_FWD_CASES)
def test_prepared_forward_against_the_reference_and_the_whole_way(fwd_launches, checked, what, shape, kw):
    """The second call of a signature takes the prepared path (checks.check_qkv not called) with new arrays
    (pointers): against the float64 reference. It launches the same kernel with the same bytes (tensor maps
    and FwdParams) as the whole way for the same call (the memo of prepared calls cleared; the lse pointer
    aside, a new array each call), and the record's pointers are this call's."""
    import cupy

    import cuflash
    from cuflash.params import FWD_DTYPE

    kw = dict(kw)
    layout_q, given_out = kw.pop("layout_q", "bshd"), kw.pop("out", False)
    causal = kw.pop("causal", False)
    b, sq, sk, h, hkv, d = shape
    rng = np.random.default_rng(sum(shape))
    for step in range(2):  # the first call prepares the signature, the second finds it
        del checked[:]
        q, k, v = random_qkv(rng, b, sq, sk, h, hkv, d, "bf16", layout_q=layout_q)
        check_forward(q, k, v, causal=causal, dtype="bf16", what=f"{what} step {step}", **kw)
        assert bool(checked) == (step == 0), f"{what}: step {step} {'took' if checked else 'skipped'} the checks"
    out = poisoned(q.shape, "bf16") if given_out else None
    cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, **kw)  # (the call below's signature)
    records = []
    for prepared in (True, False):
        if not prepared:
            from cuflash import forward

            forward._PREPARED.calls.clear()
        del checked[:], fwd_launches[:]
        got = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, **kw)
        assert bool(checked) != prepared and len(fwd_launches) == 1
        fn, how, buf = fwd_launches[0]
        maps = len(buf) - FWD_DTYPE.itemsize
        rec = np.frombuffer(buf[maps:], dtype=FWD_DTYPE)[0]
        want = dict(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=got[0].data.ptr, lse=got[1].data.ptr)
        assert {name: int(rec[name]) for name in want} == want, f"{what} (prepared={prepared}): the record's pointers"
        masked = bytearray(buf)
        masked[maps + 4 * 8 : maps + 5 * 8] = bytes(8)  # lse: a new array every call
        if not given_out:
            masked[maps + 3 * 8 : maps + 4 * 8] = bytes(8)  # o: likewise (and its map, where the kernel has one)
            if maps and how.spec.tile.tma_store:
                masked[3 * 128 : 4 * 128] = bytes(128)
        records.append((fn.ptr, how, bytes(masked)))
        cupy.cuda.get_current_stream().synchronize()
        if prepared:
            first = (got[0].copy(), got[1].copy())  # (a given out is written again by the second call)
    assert records[0] == records[1], f"{what}: the prepared path launched another kernel or other bytes"
    assert cupy.array_equal(first[0].view(cupy.uint16), got[0].view(cupy.uint16))
    assert cupy.array_equal(first[1], got[1])


def test_prepared_forward_follows_the_pointers_and_the_plan_memo(fwd_launches, checked):
    """What sends a seen signature the whole way again: a base pointer off the 16-byte rows (the same
    shape and strides, 8 bytes on: the element-wise loads, no tensor map), a cleared plan memo (tools and
    tests clear or swap it). Both are checked against the reference; the next aligned call is prepared
    again. ALiBi and dropout never are (their record holds a pointer or a seed per call)."""
    import cupy

    from cuflash import forward

    rng = np.random.default_rng(5)
    b, s, h, d = 2, 384, 4, 128
    q, k, v = random_qkv(rng, b, s, s, h, h, d, "bf16")
    check_forward(q, k, v, causal=True, dtype="bf16", what="first")
    assert checked and len(forward._PREPARED.calls) == 1
    flat = cupy.empty(q.size + 8, dtype=q.dtype)
    off = flat[4 : 4 + q.size].reshape(q.shape)  # same shape and strides, base 8 bytes off 16
    off[...] = q
    assert off.strides == q.strides and off.data.ptr % 16 == 8
    for what, qq in (("8 bytes off", off), ("aligned again", q.copy())):
        del checked[:], fwd_launches[:]
        check_forward(qq, k, v, causal=True, dtype="bf16", what=what)
        assert bool(checked) == (what == "8 bytes off"), what
        family = fwd_launches[-1][1].spec.family
        assert (family == "flash_fwd_sm90_ws") == (what != "8 bytes off" and jit_arch() == "sm_90a"), (what, family)
    forward._plan_and_load.cache_clear()
    del checked[:]
    check_forward(q.copy(), k, v, causal=True, dtype="bf16", what="plan memo cleared")
    assert checked, "a cleared plan memo must send the call the whole way"
    del checked[:]
    check_forward(q.copy(), k, v, causal=True, dtype="bf16", what="prepared again")
    assert not checked
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, h).astype(np.float32))
    for what, kw in (("alibi", dict(alibi_slopes=slopes)), ("dropout", dict(dropout_p=0.2, rng_state=(7, 0)))):
        n = len(forward._PREPARED.calls)
        for _ in range(2):
            del checked[:]
            check_forward(q, k, v, causal=True, dtype="bf16", what=what, **kw)
            assert checked, f"{what}: every call takes the whole way"
        assert len(forward._PREPARED.calls) == n


def jit_arch():
    from cuflash import jit

    return jit.device_arch(0)
