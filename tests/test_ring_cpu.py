"""CPU tests of ring attention (cuflash/torch/ring.py) with the ops' CPU kernels (tests/torch_cpu_kernels.py,
float64 NumPy): zigzag sharding, the schedule and log-sum-exp merge simulated in one process against
attention over the whole sequence (Hypothesis), and the real ring over torch.distributed with the gloo
backend in 2 and 3 processes, forward and backward. The GPU tests run the same on cuflash's kernels
(test_ring_gpu.py; NCCL where several GPUs are lent)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import reference

torch = pytest.importorskip("torch", reason="PyTorch is not installed (optional extra cuflash[torch])")


@pytest.fixture(scope="module")
def ring():
    import torch_cpu_kernels

    torch_cpu_kernels.register()
    from cuflash.torch import ring

    return ring


def _qkv(seed, b, s, h, hk, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, s, hk, d, generator=g, dtype=dtype)
    v = torch.randn(b, s, hk, d, generator=g, dtype=dtype)
    return q, k, v


def _expected(q, k, v, dout, causal, softcap=0.0, window_size=(-1, -1), alibi_slopes=None):
    kw = dict(causal=causal, softcap=softcap, window_size=window_size,
              alibi_slopes=None if alibi_slopes is None else alibi_slopes.numpy())  # fmt: skip
    out, _ = reference.attention_forward(q.numpy(), k.numpy(), v.numpy(), **kw)
    grads = reference.attention_backward(dout.numpy(), q.numpy(), k.numpy(), v.numpy(), **kw)
    return out, grads


def test_zigzag_shard_and_unshard(ring):
    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3, 1)
    parts = [ring.zigzag_shard(x, r, 3) for r in range(3)]
    assert parts[0][0, :, 0, 0].tolist() == [0, 3, 30, 33]  # chunks 0 and 5 of 6 (2 rows each, 3 heads)
    assert torch.equal(ring.zigzag_unshard(parts), x)
    with pytest.raises(ValueError, match="2 x world"):
        ring.zigzag_shard(x, 0, 5)
    with pytest.raises(ValueError, match="rank"):
        ring.zigzag_shard(x, 3, 3)


def test_the_step_plan_covers_every_causal_pair_once(ring):
    """For every world size, the steps of all ranks together give each (query chunk a, key chunk b) pair
    of the causal mask exactly what it needs, once: b < a fully visible, a == b causal, b > a nothing.
    (A step with causal=True is the local slice against itself: chunks r < 2W - 1 - r in that order.)"""
    for world in range(1, 7):
        seen = {}
        for r in range(world):
            for i in range(world):
                src = (r - i) % world
                qp, kp, c = ring._step_plan(r, src, True)
                pick = lambda part, cs: {"all": cs, "first": cs[:1], "second": cs[1:]}[part]  # noqa: E731
                for a in pick(qp, (r, 2 * world - 1 - r)):
                    for b_ in pick(kp, (src, 2 * world - 1 - src)):
                        kind = ("diag" if a == b_ else "full" if b_ < a else "none") if c else "full"
                        if kind != "none":
                            assert (a, b_) not in seen, (world, a, b_)
                            seen[(a, b_)] = kind
        want = {(a, b_): "diag" if a == b_ else "full" for a in range(2 * world) for b_ in range(a + 1)}
        assert seen == want, world


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (3, -1), (-1, 2), (5, 4), (13, 0), (30, 30), (1, 7)])
def test_the_pieces_cover_every_visible_score_once_with_its_diagonal(ring, causal, window):
    """With positions (a window or ALiBi), the calls of all ranks and steps together cover every visible
    (query, key) pair of the whole sequence exactly once (the reference mask), each call inside one pair
    of zigzag halves and cut to the rows and keys of its visible scores, with the mask of its diagonal
    shift equal to the whole's on its block."""
    for world in range(1, 5):
        half = 5
        n = 2 * world * half
        whole = reference.visible_mask(n, n, causal, window_size=window)
        count = np.zeros((n, n), dtype=int)
        pos = lambda r, t: r * half + t if t < half else (2 * world - 1 - r) * half + t - half  # noqa: E731
        for r in range(world):
            for src in range(world):
                for (a0, a1), (b0, b1), c, shift in ring._pieces(r, src, world, half, causal, window):
                    assert c == causal and (a0 < half) == (a1 <= half) and (b0 < half) == (b1 <= half)  # one half each
                    qa, ka = pos(r, a0), pos(src, b0)
                    block = whole[qa:qa + a1 - a0, ka:ka + b1 - b0]
                    assert block.any(axis=1).all() and block.any(axis=0).all(), (world, r, src)  # cut tight
                    np.testing.assert_array_equal(
                        reference.visible_mask(a1 - a0, b1 - b0, causal, window_size=window, diag_shift=shift), block)
                    count[qa:qa + a1 - a0, ka:ka + b1 - b0] += block
        np.testing.assert_array_equal(count, whole.astype(int), err_msg=f"world {world}")


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), causal=st.booleans(), chunk=st.integers(1, 6), group=st.sampled_from([1, 2]),
       window=st.sampled_from([(-1, -1), (0, 0), (4, -1), (-1, 3), (7, 2), (2, 9)]), alibi=st.booleans(),
       seed=st.integers(0, 2**16))
def test_simulated_ring_with_a_window_or_alibi_is_attention_over_the_whole_sequence(ring, world, causal, chunk, group,
                                                                                    window, alibi, seed):  # fmt: skip
    """The window and ALiBi over the whole sequence's positions: zigzag slices, causal or not."""
    s = 2 * world * chunk
    q, k, v = _qkv(seed, 2, s, 2 * group, 2, 16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625][: 2 * group], dtype=torch.float32) if alibi else None
    qs, ks, vs = ([ring.zigzag_shard(x, r, world).clone().requires_grad_() for r in range(world)] for x in (q, k, v))
    outs = ring.simulate_ring(qs, ks, vs, causal=causal, window_size=window, alibi_slopes=slopes)
    torch.autograd.backward(outs, [ring.zigzag_shard(dout, r, world) for r in range(world)])
    want, (dq, dk, dv) = _expected(q, k, v, dout, causal, window_size=window, alibi_slopes=slopes)
    np.testing.assert_allclose(ring.zigzag_unshard(outs).detach().numpy(), want, atol=1e-5)
    for got, ref in ((qs, dq), (ks, dk), (vs, dv)):
        np.testing.assert_allclose(ring.zigzag_unshard([g.grad for g in got]).numpy(), ref, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), causal=st.booleans(), chunk=st.integers(1, 9), group=st.sampled_from([1, 2]),
       softcap=st.sampled_from([0.0, 3.0]), seed=st.integers(0, 2**16))
def test_simulated_ring_is_attention_over_the_whole_sequence(ring, world, causal, chunk, group, softcap, seed):
    s = 2 * world * chunk
    q, k, v = _qkv(seed, 2, s, 2 * group, 2, 16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)
    shard = (lambda x, r: ring.zigzag_shard(x, r, world)) if causal else (lambda x, r: x.chunk(world, dim=1)[r])
    qs, ks, vs = ([shard(x, r).clone().requires_grad_() for r in range(world)] for x in (q, k, v))
    outs = ring.simulate_ring(qs, ks, vs, causal=causal, softcap=softcap)
    unshard = ring.zigzag_unshard if causal else (lambda parts: torch.cat(parts, dim=1))
    out = unshard(outs)
    torch.autograd.backward(outs, [shard(dout, r) for r in range(world)])
    want, (dq, dk, dv) = _expected(q, k, v, dout, causal, softcap)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-5)
    for got, ref in ((qs, dq), (ks, dk), (vs, dv)):
        np.testing.assert_allclose(unshard([g.grad for g in got]).numpy(), ref, atol=1e-5)


def test_what_a_ring_cannot_do_is_an_error(ring):
    q, k, v = _qkv(0, 1, 8, 2, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout"):
        ring.ring_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="window_size"):
        ring.ring_attention(q, k, v, window_size=(4, -2))
    with pytest.raises(ValueError, match="window_size"):
        ring.ring_attention(q, k, v, window_size=4)
    q7, k7, v7 = _qkv(0, 1, 7, 2, 2, 16)
    with pytest.raises(ValueError, match="window or ALiBi takes zigzag_shard slices, of even length"):
        ring.ring_attention(q7, k7, v7, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="causal ring attention takes zigzag_shard slices"):
        ring.simulate_ring([q7], [k7], [v7], causal=True)
    with pytest.raises(ValueError, match="slices expected"):
        ring.simulate_ring([q[0]], [k], [v])


def _worker(rank, world, init_file, causal, result_file, window=(-1, -1), alibi=False):
    import torch.distributed as dist

    import torch_cpu_kernels

    torch_cpu_kernels.register()
    from cuflash.torch import ring

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q, k, v = _qkv(7, 2, 4 * world * 3, 4, 2, 16)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
        zigzag = causal or window != (-1, -1) or alibi
        shard = (lambda x: ring.zigzag_shard(x, rank, world)) if zigzag else (lambda x: x.chunk(world, dim=1)[rank])
        ql, kl, vl = (shard(x).clone().requires_grad_() for x in (q, k, v))
        out = ring.ring_attention(ql, kl, vl, causal=causal, window_size=window, alibi_slopes=_SLOPES if alibi else None)
        out.backward(shard(dout))
        torch.save({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


@pytest.mark.slow  # (spawns processes: ~15 s)
@pytest.mark.parametrize("world,causal,window,alibi", [(2, True, (-1, -1), False), (3, True, (-1, -1), False),
                                                       (3, False, (-1, -1), False), (3, True, (5, 0), True),
                                                       (2, False, (4, 7), False)])  # fmt: skip
def test_ring_over_gloo_processes(ring, tmp_path, world, causal, window, alibi):
    """The real ring: W processes, torch.distributed with gloo (CPU), point-to-point K/V and dK/dV exchange;
    every rank's output and gradients against attention over the whole sequence."""
    import sys

    import torch.multiprocessing as mp

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    result = tmp_path / "result"
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), causal, str(result), window, alibi), nprocs=world, join=True)
    got = [torch.load(f"{result}.{r}") for r in range(world)]
    q, k, v = _qkv(7, 2, 4 * world * 3, 4, 2, 16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
    want, grads = _expected(q, k, v, dout, causal, window_size=window, alibi_slopes=_SLOPES if alibi else None)
    zigzag = causal or window != (-1, -1) or alibi
    unshard = ring.zigzag_unshard if zigzag else (lambda parts: torch.cat(parts, dim=1))
    np.testing.assert_allclose(unshard([g["out"] for g in got]).numpy(), want, atol=1e-5)
    for name, ref in zip(("dq", "dk", "dv"), grads):
        np.testing.assert_allclose(unshard([g[name] for g in got]).numpy(), ref, atol=1e-5, err_msg=name)
