"""CPU tests of the PyTorch layer above the kernels: flash-attn's signatures and packed forms, the custom
ops' schemas, fake implementations and autograd registration (torch.library.opcheck), torch.compile
tracing, and the transformers integration (padding, packed sequences, sliding windows, softcap,
generate), with the ops' CPU kernels computed by cuflash.reference (tests/torch_cpu_kernels.py).
Skipped without torch (transformers tests: without transformers >= 5). The same layer runs on the
real kernels in the GPU tests (test_torch_interface_gpu.py, test_transformers_gpu.py)."""
import copy
import os

import numpy as np
import pytest

from cuflash import reference
from hf_util import sharpen_queries

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def ct():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (optional extra cuflash[torch])")
    import torch_cpu_kernels

    import cuflash.torch as ct
    from cuflash.torch import interface, ops

    torch_cpu_kernels.register()

    def any_device_tensor(name, t, optional=False):  # the layer refuses CPU tensors; these tests need them
        if t is None and optional:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
        return t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interface, "_tensor", any_device_tensor)
        mp.setattr(ops, "kvcache", ops.fwd_kvcache)  # the eager shortcut calls the CUDA implementation
        # the dense and packed forwards' eager paths (ops.forward, ops.varlen_forward: the implementations
        # directly, autograd through ops._Dense, ops._Varlen) call the CPU kernels the ops run here
        mp.setattr(ops, "_fwd_impl", torch_cpu_kernels._fwd)
        mp.setattr(ops, "_bwd_impl", torch_cpu_kernels._bwd)
        mp.setattr(ops, "_varlen_fwd_impl", torch_cpu_kernels._varlen_fwd)
        mp.setattr(ops, "_varlen_bwd_impl", torch_cpu_kernels._varlen_bwd)
        yield ct


def _t(torch, gen, shape, grad=True, dtype=None):
    x = torch.randn(shape, generator=gen).to(dtype or torch.float16)
    return x.requires_grad_() if grad else x


def _h(t):
    return t.detach().double().numpy()


def _close(got, want, tol=1e-2):
    got = _h(got) if hasattr(got, "detach") else got
    assert np.abs(got - want).max() <= tol * max(1.0, float(np.abs(want).max()))


def test_flash_attn_func_wiring(ct):
    """Arguments reach the op in flash-attn's order and gradients land on q, k, v (GQA, every variant)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = _t(torch, gen, (2, 33, 4, 16)), _t(torch, gen, (2, 40, 2, 16)), _t(torch, gen, (2, 40, 2, 16))
    slopes = torch.rand(4, generator=gen) * 0.2
    kw = dict(causal=True, window_size=(9, 0), softcap=4.0, softmax_scale=0.3)
    out, lse, probs = ct.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
    assert probs is None and out.dtype == torch.float16 and lse.shape == (2, 4, 33)
    dout = _t(torch, gen, out.shape, grad=False)
    out.backward(dout)
    rk = dict(kw, alibi_slopes=_h(slopes))
    _close(out, reference.attention_forward(_h(q), _h(k), _h(v), **rk)[0])
    for t, want in zip((q, k, v), reference.attention_backward(_h(dout), _h(q), _h(k), _h(v), **rk)):
        _close(t.grad, want)


def test_no_double_backward(ct):
    """Gradients of gradients (create_graph=True) raise on the eager paths (ops._Dense, ops._Varlen) as through
    the ops, rather than silently dropping attention's second-order term; the packed eager path's gradients
    are the op's, and without gradients it records no graph."""
    import torch

    from cuflash.torch import ops

    gen = torch.Generator().manual_seed(1)
    q, k, v = (_t(torch, gen, (1, 17, 2, 16)) for _ in range(3))
    for fn in (ops.forward, ops.fwd):
        # (a loss linear in out gives a constant incoming gradient, which once_differentiable let through)
        for loss in (lambda o: o.float().square().sum(), lambda o: o.float().sum()):
            out = fn(q, k, v, None, 0.0, None, True, -1, -1, 0.0, False)[0]
            assert (type(out.grad_fn).__name__ == "_DenseBackward") == (fn is ops.forward)
            (dq,) = torch.autograd.grad(loss(out), q, create_graph=True)
            with pytest.raises(RuntimeError, match="no autograd formula"):  # (as the op; dq detached would pass)
                (dq.float().sum() + q.float().sum()).backward()
    # the packed forward's eager path (ops._Varlen) alike, and its gradients are the op's
    qp, kp, vp = (x.detach()[0].requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    grads = []
    for fn in (ops.varlen_forward, ops.varlen_fwd):
        args = (qp, kp, vp, cu, cu, 12, 12, None, None, None, 0.0, None, True, -1, -1, 0.0, False)
        out = fn(*args)[0]
        assert (type(out.grad_fn).__name__ == "_VarlenBackward") == (fn is ops.varlen_forward)
        grads.append(torch.autograd.grad(out.float().square().sum(), (qp, kp, vp)))
        (dq,) = torch.autograd.grad(fn(*args)[0].float().sum(), qp, create_graph=True)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            (dq.float().sum() + qp.float().sum()).backward()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    def no_op(*args):
        raise AssertionError("an eager call without gradients must not go through the op")

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:  # no gradient needed: the implementation directly
        mp.setattr(ops, "varlen_fwd", no_op)
        out = ops.varlen_forward(qp, kp, vp, cu, cu, 12, 12, None, None, None, 0.0, None, True, -1, -1, 0.0, False)[0]
        assert out.grad_fn is None

    # a tensor subclass anywhere among the tensor arguments (not only q, k, v) takes the op, which dispatches it
    class Marked(torch.Tensor):
        pass

    took = []
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "varlen_fwd", lambda *a: took.append("packed") or ops._varlen_fwd_impl(*a))
        mp.setattr(ops, "fwd", lambda *a: took.append("dense") or ops._fwd_impl(*a))
        ops.varlen_forward(qp, kp, vp, cu.as_subclass(Marked), cu, 12, 12, None, None, None, 0.0, None, True, -1, -1,
                           0.0, False)  # fmt: skip
        slopes = torch.full((q.shape[2],), 0.1).as_subclass(Marked)
        ops.forward(q.detach(), k.detach(), v.detach(), slopes, 0.0, None, True, -1, -1, 0.0, False)
        assert took == ["packed", "dense"]
        ops.forward(q.detach(), k.detach(), v.detach(), None, 0.0, None, True, -1, -1, 0.0, False)
        assert took == ["packed", "dense"]  # (plain tensors: the implementation directly)


def test_packed_forms_route_gradients(ct):
    import torch

    gen = torch.Generator().manual_seed(1)
    qkv = _t(torch, gen, (2, 20, 3, 4, 16))
    ct.flash_attn_qkvpacked_func(qkv, causal=True).float().square().sum().backward()
    parts = [x.detach().clone().requires_grad_() for x in qkv.unbind(2)]
    ct.flash_attn_func(*parts, causal=True).float().square().sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([p.grad for p in parts], dim=2))
    q, kv = _t(torch, gen, (2, 20, 4, 16)), _t(torch, gen, (2, 25, 2, 2, 16))
    got = ct.flash_attn_kvpacked_func(q, kv)
    got.float().square().sum().backward()
    k, v = (x.detach().clone().requires_grad_() for x in kv.unbind(2))
    want = ct.flash_attn_func(q.detach(), k, v)
    want.float().square().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kv.grad, torch.stack([k.grad, v.grad], dim=2))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    qkv_v = _t(torch, gen, (20, 3, 4, 16))
    out, lse, _ = ct.flash_attn_varlen_qkvpacked_func(qkv_v, cu, 13, causal=True, return_attn_probs=True)
    assert lse.shape == (4, 20)
    dout = _t(torch, gen, out.shape, grad=False)
    out.backward(dout)
    h = [_h(x) for x in qkv_v.unbind(1)]
    want = reference.attention_varlen_backward(_h(dout), *h, cu.numpy(), cu.numpy(), causal=True)
    _close(qkv_v.grad, np.stack(want, axis=1))
    kvv = _t(torch, gen, (30, 2, 2, 16))
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    got = ct.flash_attn_varlen_kvpacked_func(qkv_v[:, 0].detach(), kvv, cu, cu_k, 13, 20)
    want = reference.attention_varlen_forward(_h(qkv_v[:, 0]), _h(kvv[:, 0]), _h(kvv[:, 1]), cu.numpy(), cu_k.numpy())
    _close(got, want[0])


def test_errors_name_the_argument(ct):
    import torch

    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="window_size"):
        ct.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(ValueError, match="return_attn_probs"):
        ct.flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(TypeError, match="k must be a torch tensor"):
        ct.flash_attn_func(q, np.zeros(3), q)
    with pytest.raises(TypeError, match=r"q has dtype torch.float32; cuflash runs float16 and bfloat16"):
        ct.flash_attn_func(q.float(), q, q)
    with pytest.raises(TypeError, match="must share one dtype"):
        ct.flash_attn_varlen_func(q[0], q[0].bfloat16(), q[0], torch.tensor([0, 8], dtype=torch.int32),
                                  torch.tensor([0, 8], dtype=torch.int32), 8, 8)  # fmt: skip
    with pytest.raises(TypeError, match="k_cache torch.float32"):
        ct.flash_attn_with_kvcache(q, q.float(), q.float())
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        ct.flash_attn_qkvpacked_func(q)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int"):
        ct.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                  torch.tensor([0, 8], dtype=torch.int32), torch.tensor([8, 8]), 8)  # fmt: skip
    with pytest.raises(ValueError, match="max_seqlen_k must be an int, got 'a'"):
        ct.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                  torch.tensor([0, 8], dtype=torch.int32), 8, "a")  # fmt: skip
    with pytest.raises(ValueError, match="window_size values must be >= -1"):
        ct.flash_attn_func(q, q, q, window_size=(-2, 0))
    for kw, name in ((dict(dropout_p=None), "dropout_p"), (dict(softcap="x"), "softcap"),
                     (dict(softmax_scale="a"), "softmax_scale")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be a number"):
            ct.flash_attn_func(q, q, q, **kw)
    with pytest.raises(ValueError, match="softcap must be a number"):
        ct.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                  torch.tensor([0, 8], dtype=torch.int32), 8, 8, softcap=None)  # fmt: skip
    with pytest.raises(ValueError, match="k and v .* must be given together"):
        ct.flash_attn_with_kvcache(q, q, q, k=q)
    with pytest.raises(ValueError, match=r"cache_seqlens must be an int or an int32 tensor \(batch,\), got \[3\]"):
        ct.flash_attn_with_kvcache(q, q, q, cache_seqlens=[3])
    for kw, name in ((dict(softcap=None), "softcap"), (dict(softmax_scale="a"), "softmax_scale")):
        with pytest.raises(ValueError, match=f"{name} must be a number"):
            ct.flash_attn_with_kvcache(q, q, q, **kw)


def test_opcheck_every_op(ct):
    """Schemas, fake implementations against real outputs (shapes, strides, dtypes), autograd registration."""
    import torch
    from torch.library import opcheck

    gen = torch.Generator().manual_seed(2)
    q, k = _t(torch, gen, (2, 12, 4, 16)), _t(torch, gen, (2, 15, 2, 16))
    ops = torch.ops.cuflash
    opcheck(ops.fwd.default, (q, k, k, None, 0.0, None, True, -1, -1, 0.0, False))
    out, lse, rng = ops.fwd(q.detach(), k.detach(), k.detach(), None, 0.0, None, True, -1, -1, 0.0, False)
    opcheck(ops.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), k.detach(), out, lse, None, rng, 0.0, None,
                              True, -1, -1, 0.0, False))  # fmt: skip
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 15], dtype=torch.int32)
    args = (q[0], k[0], k[0], cu_q, cu_k, 7, 9, None, None, None, 0.0, None, True, -1, -1, 0.0, False)
    opcheck(ops.varlen_fwd.default, args)
    out, lse, rng = ops.varlen_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    opcheck(ops.varlen_bwd.default, (torch.randn_like(out), q[0].detach(), k[0].detach(), k[0].detach(), out, lse, cu_q,
                                     cu_k, 7, 9, None, None, rng, 0.0, None, True, -1, -1, 0.0, False))  # fmt: skip
    cache = _t(torch, gen, (2, 32, 2, 16), grad=False)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    opcheck(ops.fwd_kvcache.default, (q.detach()[:, :1], cache, cache.clone(), k.detach()[:, :1], k.detach()[:, :1],
                                      None, None, lens, -1, None, None, None, None, None, True, -1, -1, 0.0, True, 0))  # fmt: skip


def test_kvcache_appends_into_the_callers_tensors(ct):
    import torch

    gen = torch.Generator().manual_seed(3)
    q, kn = _t(torch, gen, (2, 1, 4, 16), grad=False), _t(torch, gen, (2, 1, 2, 16), grad=False)
    kc, vc = _t(torch, gen, (2, 32, 2, 16), grad=False), _t(torch, gen, (2, 32, 2, 16), grad=False)
    before = _h(kc)
    out, lse = ct.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=torch.tensor([3, 20], dtype=torch.int32),
                                          causal=True, return_softmax_lse=True)  # fmt: skip
    assert torch.equal(kc[0, 3], kn[0, 0]) and torch.equal(kc[1, 20], kn[1, 0])
    want = reference.attention_with_kvcache(_h(q), before, _h(vc), k=_h(kn), v=_h(kn), cache_seqlens=[3, 20], causal=True)
    _close(out, want[0])
    assert lse.shape == (2, 4, 1)


def test_bridge_desc_is_what_to_cupy_would_give(ct):
    """The decode step's prepared path keys a call by _bridge.desc of its tensors: (shape, strides in bytes,
    NumPy dtype, device), as the CuPy view to_cupy makes has them; None where the whole way must run (a
    CPU tensor, a dtype that crosses by DLPack, a last dimension to_cupy would copy)."""
    from types import SimpleNamespace

    import ml_dtypes
    import torch

    from cuflash.torch import _bridge

    def fake(shape, strides, dtype=torch.bfloat16, cuda=True, index=1):
        return SimpleNamespace(shape=torch.Size(shape), stride=lambda *d: strides[d[0]] if d else strides, dtype=dtype,
                               is_cuda=cuda, device=SimpleNamespace(index=index), dim=lambda: len(shape))  # fmt: skip

    got = _bridge.desc(fake((2, 3, 4, 64), (1536, 512, 128, 1)))
    assert got == ((2, 3, 4, 64), (3072, 1024, 256, 2), np.dtype(ml_dtypes.bfloat16), 1)
    assert type(got[0]) is tuple and hash(got) is not None
    assert _bridge.desc(fake((5,), (1,), torch.int32, index=0)) == ((5,), (4,), np.dtype(np.int32), 0)
    assert _bridge.desc(fake((2, 64), (64, 2))) is None  # to_cupy copies it
    assert _bridge.desc(fake((2, 1), (1, 7))) == ((2, 1), (2, 14), np.dtype(ml_dtypes.bfloat16), 1)  # (one column)
    assert _bridge.desc(fake((2, 64), (64, 1), torch.float64)) is None
    assert _bridge.desc(fake((2, 64), (64, 1), cuda=False)) is None
    assert _bridge.desc(torch.zeros(2, 64, dtype=torch.bfloat16)) is None  # a real CPU tensor
    # one copy rule for both (to_cupy copies what needs_copy says, desc refuses it)
    x = torch.zeros(3, 8, 2)
    assert not _bridge.needs_copy(x) and _bridge.needs_copy(x.transpose(1, 2)) and not _bridge.needs_copy(x[..., :1])
    assert not _bridge.needs_copy(torch.tensor(1.0)) and not _bridge.needs_copy(x[:, ::2])


def test_bridge_to_torch_shares_the_block_without_a_view(ct):
    """to_torch hands a CuPy array allocated in a torch block back over that block's storage (same bytes, no
    copy) as a tensor that is no view of it: autograd then treats a call's outputs as the prepared path's
    torch.empty ones (an in-place edit of a saved output raises at the backward, no 'view created inside a
    custom Function' error on the first call only). A CPU byte block stands in for the CUDA one."""
    import types

    import torch

    from cuflash.torch import _bridge

    block = torch.zeros(256, dtype=torch.uint8)
    mem = types.SimpleNamespace(_owner=block)
    x = types.SimpleNamespace(data=types.SimpleNamespace(mem=mem, ptr=block.data_ptr() + 16), shape=(3, 4),
                              strides=(32, 4), dtype=np.dtype(np.float32), itemsize=4)  # fmt: skip
    t = _bridge.to_torch(x)
    assert t._base is None and t.dtype == torch.float32 and t.shape == (3, 4) and t.stride() == (8, 1)
    assert t.data_ptr() == block.data_ptr() + 16 and t.untyped_storage().data_ptr() == block.data_ptr()
    t.fill_(1.0)
    assert int(block.view(torch.float32)[4:12].sum()) == 4 and int(block.view(torch.float32).sum()) == 12

    class Saves(torch.autograd.Function):  # as ops._Dense: the output is saved for the backward
        @staticmethod
        def forward(ctx, a):
            out = _bridge.to_torch(x)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, g):
            return g * ctx.saved_tensors[0]

    out = Saves.apply(torch.ones(3, 4, requires_grad=True))
    out.add_(1)  # allowed (not a view) ...
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()  # ... and caught where it matters


def test_compile_fullgraph_traces_the_functions(ct):
    """torch.compile(fullgraph=True) over the dense, packed, varlen and kvcache functions: no graph
    break (fullgraph raises on one), the compiled loss and gradients equal the eager ones."""
    import torch

    gen = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(64, 192, dtype=torch.float16)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    cache = _t(torch, gen, (2, 40, 4, 16), grad=False)

    def f(x, kc, vc):
        qkv = lin(x).view(2, 12, 3, 4, 16)
        y = ct.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(5, 0))
        z = ct.flash_attn_varlen_func(*(t.reshape(24, 4, 16) for t in qkv.unbind(2)), cu, cu, 14, 14, softcap=3.0)
        w = ct.flash_attn_with_kvcache(qkv[:, -1:, 0].detach(), kc, vc, k=qkv[:, -1:, 1].detach(),
                                       v=qkv[:, -1:, 2].detach(), cache_seqlens=7)  # fmt: skip
        return (y.float().square().sum() + z.float().square().sum()) + w.float().sum()

    x = _t(torch, gen, (2, 12, 64), grad=False)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        lin.zero_grad()
        kc, vc = cache.clone(), cache.clone()
        loss = fn(x, kc, vc)
        loss.backward()
        results.append((loss.detach(), lin.weight.grad.clone(), kc))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])  # the compiled call appended in place too


# transformers


COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip
MODELS = {"llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", dict(sliding_window=6)),
          "gemma2": ("Gemma2Config", dict(sliding_window=6, attn_logit_softcapping=4.0, query_pre_attn_scalar=16))}


@pytest.fixture(scope="module")
def hf(ct):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}: the integration needs >= 5")
    import cuflash.torch.transformers as cft

    assert cft.register() == "cufa"
    return transformers


#: Gemma 2's q_proj weights are multiplied by this: with the random initialization the scores stay far
#: below the softcap (|s| < 0.5 against 4), where tanh is the identity and a dropped softcap would pass.
GEMMA2_Q_SCALE = 100.0


def _pair(hf, name, **config_changes):
    """(eager float32 reference, cuflash float16), the same random weights (Gemma 2's queries sharpened
    by GEMMA2_Q_SCALE so that its softcap bends the scores). ``config_changes`` go to the reference only."""
    import torch

    cls, extra = MODELS[name]
    config = getattr(hf, cls)(**COMMON, **extra)
    torch.manual_seed(0)
    ref = hf.AutoModelForCausalLM.from_config(getattr(hf, cls)(**COMMON, **{**extra, **config_changes}),
                                              attn_implementation="eager", dtype=torch.float32)  # fmt: skip
    if name == "gemma2":
        sharpen_queries(ref, GEMMA2_Q_SCALE)
    ours = hf.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="cufa", dtype=torch.float32)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.to(torch.float16).eval()


def test_transformers_gemma2_softcap_matters(hf):
    """The Gemma 2 cases below would fail if the softcap were dropped: the reference without it differs
    from cuflash (with it) by far more than their 2e-2 bound."""
    import torch

    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(5))
    no_cap, ours = _pair(hf, "gemma2", attn_logit_softcapping=None)
    ref, _ = _pair(hf, "gemma2")
    with torch.no_grad():
        got = ours(ids).logits.float()
        assert (got - ref(ids).logits).abs().max() < 2e-2
        assert (got - no_cap(ids).logits).abs().max() > 0.1


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_padding_window_softcap(hf, name):
    """Left-padded batch (the padding path: unpad, varlen, scatter back) with the model's window and
    softcap: logits at real tokens as the float32 eager model's, within float16 rounding."""
    import torch

    ref, ours = _pair(hf, name)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :9] = 0
    with torch.no_grad():
        for m in (None, mask):
            want = ref(ids, attention_mask=m).logits
            got = ours(ids, attention_mask=m).logits.float()
            keep = torch.ones_like(ids, dtype=torch.bool) if m is None else mask.bool()
            assert (got - want)[keep].abs().max() < 2e-2


def test_transformers_packed_sequences(hf):
    """Padding-free packing (batch 1, position_ids that restart; or cu_seq_lens kwargs from a flattening
    collator): each sequence attends only to itself, as the eager model run on it alone."""
    import torch

    ref, ours = _pair(hf, "mistral")
    lengths = [5, 9, 4]
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(6))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    with torch.no_grad():
        want = torch.cat([ref(ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        by_pos = ours(ids, position_ids=pos).logits.float()
        by_cu = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
    assert (by_pos - want).abs().max() < 2e-2
    assert (by_cu.float() - want).abs().max() < 2e-2


@pytest.mark.parametrize("name, cache", [("llama", "dynamic"), ("gemma2", "dynamic"), ("llama", "static")])
def test_transformers_generate(hf, name, cache):
    """Greedy generate() of a left-padded batch with transformers' dynamic or static cache (a static
    cache hands over every slot: the padding path cuts k, v to the mask's length): the float32 eager
    model's tokens, except after a step where that model has a near tie (top two logits within 1e-2)."""
    import torch

    ref, ours = _pair(hf, name)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want, got = ref.generate(ids, **kw), ours.generate(ids, **kw)
        for b in range(2):
            diff = (got[b] != want[b]).nonzero()
            if diff.numel():
                t = int(diff[0])
                m = torch.cat([mask[b : b + 1], torch.ones(1, t - ids.shape[1], dtype=mask.dtype)], dim=1)
                top = ref(got[b : b + 1, :t], attention_mask=m).logits[0, -1].topk(2).values
                assert (top[0] - top[1]).item() < 1e-2, f"row {b}: tokens differ at {t} without a near tie"


def test_transformers_errors(hf):
    import torch

    import cuflash.torch.transformers as cft

    with pytest.raises(ValueError, match="without 'flash'"):
        cft.register("cuflash")
    _, ours = _pair(hf, "llama")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(ids, output_attentions=True)
    with pytest.raises(TypeError, match="float16 / bfloat16"):
        ours.float()(ids)


@pytest.mark.parametrize("q_len, causal", [(3, False), (12, False), (8, False), (1, True), (1, False)])
def test_transformers_keys_mask_keeps_every_query(hf, q_len, causal):
    """Cross-attention (a decoder's non-causal attention: the 2-D mask is the encoder's, the keys'), q_len
    8 = kv_len included, and one new token: every query row is computed against its row's unmasked
    keys, none dropped."""
    import torch

    import cuflash.torch.transformers as cft

    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, q_len, 16, generator=gen).half()
    k, v = torch.randn(2, 2, 8, 16, generator=gen).half(), torch.randn(2, 2, 8, 16, generator=gen).half()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # right padding of the encoder's second row
    module = torch.nn.Module()
    module.is_causal, module.is_decoder = causal, True
    out, _ = cft.attention_forward(module, q, k, v, mask, scaling=0.25)
    assert out.shape == (2, q_len, 4, 16)
    for b, n in ((0, 8), (1, 5)):
        want = reference.attention_forward(_h(q[b : b + 1].transpose(1, 2)), _h(k[b : b + 1, :, :n].transpose(1, 2)),
                                           _h(v[b : b + 1, :, :n].transpose(1, 2)), causal=causal,
                                           softmax_scale=0.25)[0]  # fmt: skip
        _close(out[b : b + 1], want)


def test_bert_padding_helpers(ct):
    """unpad_input / pad_input (flash-attn 2.7's five-value unpad): the kept tokens in order, prefix sums,
    longest length, used lengths with unused_mask, the padded batch back with zeros, gradients through."""
    import torch

    from cuflash.torch.bert_padding import pad_input, unpad_input

    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    xu, idx, cu, max_len, used = unpad_input(x, mask)
    assert idx.tolist() == [1, 2, 3, 4, 5] and cu.tolist() == [0, 3, 5] and cu.dtype == torch.int32
    assert max_len == 3 and used.tolist() == [3, 2]
    torch.testing.assert_close(xu, x.detach().reshape(8, 3)[[1, 2, 3, 4, 5]])
    back = pad_input(xu * 2, idx, 2, 4)
    torch.testing.assert_close(back, x.detach() * 2 * mask[..., None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, 2 * mask[..., None].float().expand(2, 4, 3))
    _, idx2, cu2, max2, used2 = unpad_input(x, mask, unused_mask=torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]]))
    assert idx2.tolist() == [1, 2, 3, 4, 5, 6] and cu2.tolist() == [0, 3, 6] and used2.tolist() == [3, 2]


def test_transformers_encoder_self_attention_drops_padded_queries(hf):
    """Non-causal self-attention of an encoder (is_decoder False): the mask is the queries' too, padded
    query rows are 0 and the real ones see the real keys."""
    import torch

    import cuflash.torch.transformers as cft

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen).half() for _ in range(3))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    module = torch.nn.Module()
    module.is_causal, module.is_decoder = False, False
    out, _ = cft.attention_forward(module, q, k, v, mask)
    assert out[1, 6:].abs().max() == 0
    want = reference.attention_forward(*(_h(x[1:2, :, :6].transpose(1, 2)) for x in (q, k, v)))[0]
    _close(out[1:2, :6], want)
