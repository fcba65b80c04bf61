"""GPU tests of the PyTorch bridge cuflash.torch.attention (skipped without a GPU or without torch)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _sdpa(torch, q, k, v, causal, scale):
    """SDPA on flash-attn layout tensors; causal aligned bottom-right like cuflash (square here)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale,
               enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
    return out.transpose(1, 2)


def _grads(torch, fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_kv,head_dim", [(4, 4, 64), (8, 2, 128), (4, 1, 96)])
def test_matches_sdpa_forward_and_gradients(torch, dtype_name, causal, heads, heads_kv, head_dim):
    """Output and gradients against SDPA in float64 (the truth); cuflash's error must stay within 3x
    the error of SDPA's own low-precision run + 1e-5 (DESIGN.md's rule with SDPA as the plain run)."""
    import cuflash.torch as ct

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(1234 + heads + head_dim)
    shape_q, shape_kv = (2, 333, heads, head_dim), (2, 333, heads_kv, head_dim)
    q = torch.randn(shape_q, device="cuda", generator=gen).to(dtype)
    k = torch.randn(shape_kv, device="cuda", generator=gen).to(dtype)
    v = torch.randn(shape_kv, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(shape_q, device="cuda", generator=gen).to(dtype)
    scale = head_dim**-0.5
    truth = _grads(torch, lambda a, b, c: _sdpa(torch, a, b, c, causal, scale), *(x.double() for x in (q, k, v, dout)))
    low = _grads(torch, lambda a, b, c: _sdpa(torch, a, b, c, causal, scale), q, k, v, dout)
    ours = _grads(torch, lambda a, b, c: ct.attention(a, b, c, causal=causal), q, k, v, dout)
    for name, t, lo, us in zip(("out", "dq", "dk", "dv"), truth, low, ours):
        assert us.dtype == dtype and us.shape == t.shape, name
        assert not torch.isnan(us).any(), f"NaN in {name}"
        err = (us.double() - t).abs().max().item()
        bound = 3 * (lo.double() - t).abs().max().item() + 1e-5
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def test_runs_on_torch_current_stream_and_accepts_sdpa_layout_views(torch, monkeypatch):
    import cuflash.torch as ct
    from cuflash import launch

    q = torch.randn(2, 4, 257, 64, device="cuda", dtype=torch.bfloat16)  # SDPA's (b, h, s, d)
    side = torch.cuda.Stream()
    streams = []
    real = launch.launch

    def spy(fn, how, argv_ptr, stream_ptr):  # every kernel of the forward and the backward, on torch's stream
        streams.append(stream_ptr)
        real(fn, how, argv_ptr, stream_ptr)

    monkeypatch.setattr(launch, "launch", spy)  # (launch_record and the prepared forward both call it)
    with torch.cuda.stream(side):
        for _ in range(2):  # the whole way, then the prepared forward (forward._signature)
            a = q.transpose(1, 2).requires_grad_()  # flash-attn layout view, not contiguous
            out = ct.attention(a, a, a, causal=True)
            out.float().sum().backward()
    side.synchronize()
    assert len(streams) >= 8 and set(streams) == {side.cuda_stream}, (streams, side.cuda_stream)  # 2 x (fwd + 3 bwd)
    ref = _sdpa(torch, q.transpose(1, 2).double(), q.transpose(1, 2).double(), q.transpose(1, 2).double(), True, 64**-0.5)
    assert (out.double() - ref).abs().max().item() < 2e-2
    assert a.grad is not None and a.grad.shape == a.shape and not torch.isnan(a.grad).any()


def test_packed_forward_eager_and_prepared_paths(torch, monkeypatch):
    """flash_attn_varlen_func in eager mode: the first call of a signature takes the whole way, the next ones
    launch from the tensors' pointers (ops._varlen_prepared: no CuPy arrays), on torch's current stream, all
    three with the bits of the CuPy API's call on the same tensors; with gradients (ops._Varlen) output and
    gradients are the custom op's, bit for bit (the deterministic backward: its dQ additions are ordered)."""
    import cupy

    import cuflash
    import cuflash.torch as ct
    from cuflash import launch, varlen
    from cuflash.torch import ops

    lengths = [300, 0, 129, 71]
    cu = torch.tensor([0, 300, 300, 429, 500], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(500, 4, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    prepared = []
    real = ops._varlen_prepared
    monkeypatch.setattr(ops, "_varlen_prepared", lambda *a: prepared.append(r := real(*a)) or r)
    streams = []
    real_launch = launch.launch
    monkeypatch.setattr(launch, "launch", lambda fn, how, argv, stream: streams.append(stream) or
                        real_launch(fn, how, argv, stream))  # fmt: skip
    varlen._PREPARED.calls.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (q, k, v, cu were made on the default stream)
    with torch.cuda.stream(side):
        outs = [ct.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True) for _ in range(3)]
    side.synchronize()
    assert [p is not None for p in prepared] == [False, True, True], "the second and third calls are prepared"
    assert set(streams) == {side.cuda_stream} and len(streams) == 3
    want = cuflash.attention_varlen(*(cupy.from_dlpack(x) for x in (q, k, v, cu, cu)), 300, 300, causal=True)
    for out in outs:
        assert cupy.array_equal(cupy.from_dlpack(out).view(cupy.uint16), want.view(cupy.uint16))
    assert sum(lengths) == q.shape[0]
    dout = torch.randn_like(q)
    results = []
    for fn in (ops.varlen_forward, ops.varlen_fwd):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = fn(qq, kk, vv, cu, cu, 300, 300, None, None, None, 0.0, None, True, -1, -1, 0.0, True)[0]
        assert (type(out.grad_fn).__name__ == "_VarlenBackward") == (fn is ops.varlen_forward)
        out.backward(dout)
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_deterministic_backward_is_bitwise_reproducible(torch):
    import cuflash.torch as ct

    q = torch.randn(1, 700, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 900, 2, 64, device="cuda", dtype=torch.float16)
    dout = torch.randn_like(q)
    first = _grads(torch, lambda a, b, c: ct.attention(a, b, c, causal=True, deterministic=True), q, k, k, dout)
    for _ in range(5):
        again = _grads(torch, lambda a, b, c: ct.attention(a, b, c, causal=True, deterministic=True), q, k, k, dout)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


def test_training_loop_loss_goes_down(torch):
    """A one-layer attention model trained with Adam for 60 steps: the loss falls below 30% of its start."""
    import cuflash.torch as ct

    torch.manual_seed(0)
    b, s, heads, d = 4, 128, 4, 32
    dim = heads * d

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = self.qkv(x).to(torch.bfloat16).view(b, s, 3, heads, d).unbind(2)
            return self.proj(ct.attention(q, k, v, causal=True).reshape(b, s, dim).float())

    model = Layer().cuda()
    x = torch.randn(b, s, dim, device="cuda")
    # Learnable by causal attention: the running mean of a fixed linear map of the inputs.
    mixed = x @ torch.randn(dim, dim, device="cuda") / dim**0.5
    target = mixed.cumsum(1) / torch.arange(1, s + 1, device="cuda")[:, None]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)), "NaN loss"
    assert losses[-1] < 0.3 * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert all(p.grad is not None for p in model.parameters())


def test_clear_errors(torch):
    import cuflash.torch as ct

    with pytest.raises(ValueError, match="CUDA tensor"):
        x = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
        ct.attention(x, x, x)
    with pytest.raises(TypeError, match="torch tensor"):
        ct.attention(1, 2, 3)


def test_variants_through_autograd(torch):
    """window, softcap, ALiBi and dropout pass through the bridge, forward and backward, against the
    float64 reference with the same Philox stream (the one the bridge drew from torch's generator)."""
    import numpy as np

    import cuflash.torch as ct
    from cuflash import reference

    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn((2, 200, 4, 64), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k = torch.randn((2, 230, 2, 64), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    v = torch.randn((2, 230, 2, 64), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    dout = torch.randn((2, 200, 4, 64), device="cuda", generator=gen).to(torch.bfloat16)
    slopes = torch.rand(4, device="cuda", dtype=torch.float32) * 0.3
    torch.manual_seed(11)
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = default.get_offset()
    # softcap 2 bends these scores (std ~1): in the float64 reference, dropping it moves out and the gradients
    # by 1.5-3, against this test's bound of ~0.1-0.2 (at softcap 20 they moved 0.06-0.09, under the bound)
    kw = dict(causal=True, window_size=(50, -1), softcap=2.0, dropout_p=0.15)
    out = ct.attention(q, k, v, alibi_slopes=slopes, **kw)
    out.backward(dout)
    state = (default.initial_seed(), offset)
    host = [x.detach().float().cpu().numpy() for x in (q, k, v, dout)]
    ref = reference.attention_forward(*host[:3], alibi_slopes=slopes.cpu().numpy(), rng_state=state, **kw)[0]
    grads = reference.attention_backward(host[3], *host[:3], alibi_slopes=slopes.cpu().numpy(), rng_state=state, **kw)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (ref, *grads)):
        err = np.abs(got.detach().double().cpu().numpy() - want).max()
        assert err < 0.05 * max(1.0, np.abs(want).max()), f"{name}: error {err:.3g}"
    # torch.manual_seed makes the dropout mask reproducible; successive calls draw new masks
    torch.manual_seed(11)
    again = ct.attention(q, k, v, alibi_slopes=slopes, **kw)
    assert torch.equal(again, out)
    assert not torch.equal(ct.attention(q, k, v, alibi_slopes=slopes, **kw), out)


def test_dropout_under_graph_capture_is_a_clear_error(torch):
    import cuflash.torch as ct

    q = torch.randn((1, 64, 2, 64), device="cuda", dtype=torch.float16)
    ct.attention(q, q, q)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError, match="graph capture"):
            with torch.cuda.graph(graph, stream=stream):
                ct.attention(q, q, q, dropout_p=0.1)
