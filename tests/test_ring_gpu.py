"""GPU tests of ring attention (cuflash/torch/ring.py) on cuflash's kernels: the ring simulated in one
process over W slices (the same schedule and log-sum-exp merge as the distributed ring) against the
float64 reference over the whole sequence, forward and backward, causal and not, with Hypothesis; and,
where the machine has 2 or more GPUs, the real ring over NCCL in one process per GPU against
single-GPU cuflash on the whole sequence. Skipped without a GPU or without torch."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash import reference

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "60"))


def _host(t):
    return t.detach().double().cpu().numpy()


def _bound(single_err, scale):
    # The ring rounds each step's partial output to the kernel's dtype before the fp32 merge: allow 3x the
    # single call's own error against float64, plus a little for the merge (relative to the values' size).
    return 3 * single_err + 2e-3 * max(1.0, scale)


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 4), causal=st.booleans(), chunk=st.integers(1, 200), heads=st.sampled_from([(4, 4), (4, 1), (6, 2)]),
       head_dim=st.sampled_from([64, 128]), dtype_name=st.sampled_from(["bfloat16", "float16"]),
       window=st.sampled_from([(-1, -1), (-1, -1), (0, 0), (50, 0), (100, 30), (-1, 70)]), alibi=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_simulated_ring_matches_attention_over_the_sequence(torch, world, causal, chunk, heads, head_dim, dtype_name,
                                                            window, alibi, seed):  # fmt: skip
    """With a window or ALiBi (over the whole sequence's positions) too: then every step runs the
    zigzag halves as separate calls with their diagonal shifted (the window kernels, on every family)."""
    import cuflash.torch as ct
    from cuflash.torch import ring

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nh, nkv = heads
    s = 2 * world * chunk
    q, k, v = (torch.randn((2, s, n, head_dim), device="cuda", generator=gen).to(dtype) for n in (nh, nkv, nkv))
    dout = torch.randn(q.shape, device="cuda", generator=gen).to(dtype)
    slopes = (0.5 ** torch.arange(1, nh + 1, device="cuda", dtype=torch.float32)) if alibi else None
    zigzag = causal or window != (-1, -1) or alibi
    shard = (lambda x, r: ring.zigzag_shard(x, r, world)) if zigzag else (lambda x, r: x.chunk(world, dim=1)[r])
    unshard = ring.zigzag_unshard if zigzag else (lambda parts: torch.cat(parts, dim=1))
    qs, ks, vs = ([shard(x, r).clone().requires_grad_() for r in range(world)] for x in (q, k, v))
    outs = ring.simulate_ring(qs, ks, vs, causal=causal, window_size=window, alibi_slopes=slopes)
    torch.autograd.backward(outs, [shard(dout, r) for r in range(world)])
    got = [unshard(outs)] + [unshard([g.grad for g in xs]) for xs in (qs, ks, vs)]
    # the same inputs through one cuflash call on the whole sequence, and the float64 reference
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    o1 = ct.flash_attn_func(q1, k1, v1, causal=causal, window_size=window, alibi_slopes=slopes)
    o1.backward(dout)
    single = [o1, q1.grad, k1.grad, v1.grad]
    kw = dict(causal=causal, window_size=window, alibi_slopes=None if slopes is None else slopes.cpu().numpy())
    want_out, _ = reference.attention_forward(_host(q), _host(k), _host(v), **kw)
    want = [want_out, *reference.attention_backward(_host(dout), _host(q), _host(k), _host(v), **kw)]
    for name, g, s1, w in zip(("out", "dq", "dk", "dv"), got, single, want):
        err, err1 = np.abs(_host(g) - w).max(), np.abs(_host(s1) - w).max()
        assert np.isfinite(_host(g)).all(), name
        assert err <= _bound(err1, float(np.abs(w).max())), f"{name}: ring {err:.3g}, one call {err1:.3g}"


@pytest.mark.parametrize("window,alibi", [((-1, -1), False), ((100, 0), True)])
def test_simulated_ring_deterministic_backward_is_bitwise_reproducible(torch, window, alibi):
    """deterministic=True: the kernels' ordered dQ sums and the ring's fixed order of partial sums give the
    same bits run after run (10 runs, causal, W = 3, GQA)."""
    from cuflash.torch import ring

    gen = torch.Generator(device="cuda").manual_seed(5)
    world, s = 3, 6 * 96
    q, k, v, dout = (torch.randn((2, s, n, 128), device="cuda", generator=gen).to(torch.bfloat16) for n in (8, 2, 2, 8))
    slopes = (0.5 ** torch.arange(1, 9, device="cuda", dtype=torch.float32)) if alibi else None

    def grads():
        qs, ks, vs = ([ring.zigzag_shard(x, r, world).clone().requires_grad_() for r in range(world)] for x in (q, k, v))
        outs = ring.simulate_ring(qs, ks, vs, causal=True, window_size=window, alibi_slopes=slopes, deterministic=True)
        torch.autograd.backward(outs, [ring.zigzag_shard(dout, r, world) for r in range(world)])
        return [x.grad.clone() for x in (*qs, *ks, *vs)]

    first = grads()
    for _ in range(9):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


def _nccl_worker(rank, world, init_file, causal, result_file):
    import torch
    import torch.distributed as dist

    from cuflash.torch import ring

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator(device="cuda").manual_seed(11)
        q, k, v, dout = (torch.randn((1, 8 * world * 64, 8, 128), device="cuda", generator=gen).to(torch.bfloat16)
                         for _ in range(4))  # fmt: skip
        shard = (lambda x: ring.zigzag_shard(x, rank, world)) if causal else (lambda x: x.chunk(world, dim=1)[rank])
        ql, kl, vl = (shard(x).clone().requires_grad_() for x in (q, k, v))
        out = ring.ring_attention(ql, kl, vl, causal=causal)
        out.backward(shard(dout))
        torch.save({n: t.detach().cpu() for n, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))},
                   f"{result_file}.{rank}")  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [True, False])
def test_ring_over_nccl(torch, tmp_path, causal):
    """One process per GPU (up to 8), NCCL point-to-point, against one cuflash call on the whole sequence."""
    n = min(torch.cuda.device_count(), 8)
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    import torch.multiprocessing as mp

    import cuflash.torch as ct
    from cuflash.torch import ring

    result = tmp_path / "result"
    mp.spawn(_nccl_worker, args=(n, str(tmp_path / "init"), causal, str(result)), nprocs=n, join=True)
    got = [torch.load(f"{result}.{r}") for r in range(n)]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn((1, 8 * n * 64, 8, 128), device="cuda", generator=gen).to(torch.bfloat16)
                     for _ in range(4))  # fmt: skip
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    o1 = ct.flash_attn_func(q1, k1, v1, causal=causal)
    o1.backward(dout)
    unshard = ring.zigzag_unshard if causal else (lambda parts: torch.cat(parts, dim=1))
    for name, want in (("out", o1), ("dq", q1.grad), ("dk", k1.grad), ("dv", v1.grad)):
        g = unshard([r[name] for r in got])
        np.testing.assert_allclose(_host(g), _host(want), atol=3e-2 * max(1.0, float(want.abs().max())), err_msg=name)
    # The same schedule in one process on one GPU: the same kernels and merges, only the transport and
    # the order of the dK / dV sums differ (within a couple of bf16 units in the last place).
    shard = (lambda x, r: ring.zigzag_shard(x, r, n)) if causal else (lambda x, r: x.chunk(n, dim=1)[r])
    qs, ks, vs = ([shard(x, r).clone().requires_grad_() for r in range(n)] for x in (q, k, v))
    outs = ring.simulate_ring(qs, ks, vs, causal=causal)
    torch.autograd.backward(outs, [shard(dout, r) for r in range(n)])
    for name, sim in (("out", outs), ("dq", [x.grad for x in qs]), ("dk", [x.grad for x in ks]), ("dv", [x.grad for x in vs])):
        g, w = _host(unshard([r[name] for r in got])), _host(unshard([t.detach() for t in sim]))
        np.testing.assert_allclose(g, w, rtol=2 ** -6, atol=2 ** -7 * max(1.0, float(np.abs(w).max())), err_msg=f"{name} vs simulated")
