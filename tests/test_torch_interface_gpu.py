"""GPU tests of cuflash.torch's flash-attn functions and custom ops: every function through its
flash-attn signature against the float64 reference (forward, lse, gradients), the packed and varlen
forms, flash_attn_with_kvcache with contiguous and paged caches appended in place in the caller's
tensors, torch.library.opcheck of each op, torch.compile(fullgraph=True), a CUDA-graph captured decode
loop, and torch's allocator / device handling. Skipped without a GPU or without torch."""
import numpy as np
import pytest

from cuflash import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ct(torch):
    import cuflash.torch as ct

    return ct


def _host(t):
    return t.detach().double().cpu().numpy()


def _close(got, want, what, tol=2e-2):
    got = _host(got) if hasattr(got, "detach") else got
    err = np.abs(got - want).max() if np.size(want) else 0.0
    bound = tol * max(1.0, float(np.abs(want).max()) if np.size(want) else 1.0)
    assert np.isfinite(got).all(), f"{what}: not finite"
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def _randn(torch, gen, shape, dtype, grad=False):
    t = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    return t.requires_grad_() if grad else t


VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(40, 0)),
    "local": dict(window_size=(30, 20)),
    "softcap": dict(causal=True, softcap=15.0),
    "alibi": dict(causal=True, alibi=True),
    "scale": dict(softmax_scale=0.3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype_name, head_dim, heads", [("float16", 64, (4, 2)), ("bfloat16", 128, (6, 1)),
                                                         ("float16", 96, (3, 3))])  # fmt: skip
def test_flash_attn_func_matches_reference(torch, ct, variant, dtype_name, head_dim, heads):
    """flash_attn_func forward, lse (return_attn_probs) and gradients against the float64 reference."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(head_dim + len(variant))
    nh, nkv = heads
    q = _randn(torch, gen, (2, 150, nh, head_dim), dtype, grad=True)
    k = _randn(torch, gen, (2, 190, nkv, head_dim), dtype, grad=True)
    v = _randn(torch, gen, (2, 190, nkv, head_dim), dtype, grad=True)
    dout = _randn(torch, gen, q.shape, dtype)
    kw = dict(VARIANTS[variant])
    slopes = None
    if kw.pop("alibi", False):
        slopes = torch.rand(nh, device="cuda", generator=gen) * 0.2
    out, lse, probs = ct.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
    assert probs is None and lse.dtype == torch.float32 and lse.shape == (2, nh, 150)
    out.backward(dout)
    host = [_host(x) for x in (q, k, v, dout)]
    rk = dict(kw, alibi_slopes=None if slopes is None else _host(slopes))
    ref_out, ref_lse = reference.attention_forward(*host[:3], **rk)
    grads = reference.attention_backward(host[3], *host[:3], **rk)
    _close(out, ref_out, "out")
    finite = np.isfinite(ref_lse)
    _close(_host(lse)[finite], ref_lse[finite], "lse", tol=1e-3)
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), grads):
        _close(t.grad, want, name, tol=4e-2)


def test_dropout_through_the_flash_attn_signature(torch, ct):
    """dropout_p: the mask is the reference's for the (seed, offset) drawn from torch's generator, the
    backward replays it, and return_attn_probs with dropout is refused by name."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = _randn(torch, gen, (1, 130, 2, 64), torch.bfloat16, grad=True)
    k = _randn(torch, gen, (1, 170, 2, 64), torch.bfloat16, grad=True)
    v = _randn(torch, gen, (1, 170, 2, 64), torch.bfloat16, grad=True)
    dout = _randn(torch, gen, q.shape, torch.bfloat16)
    torch.manual_seed(5)
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    state = (default.initial_seed(), default.get_offset())
    out = ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    out.backward(dout)
    host = [_host(x) for x in (q, k, v, dout)]
    kw = dict(causal=True, dropout_p=0.2, rng_state=state)
    _close(out, reference.attention_forward(*host[:3], **kw)[0], "out")
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), reference.attention_backward(host[3], *host[:3], **kw)):
        _close(t.grad, want, name, tol=4e-2)
    with pytest.raises(ValueError, match="return_attn_probs"):
        ct.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_forms_equal_the_unpacked_call(torch, ct, deterministic):
    """flash_attn_qkvpacked_func / flash_attn_kvpacked_func give the unpacked call's out, and the
    gradient lands in the packed tensor (bitwise with deterministic=True)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    qkv = _randn(torch, gen, (2, 200, 3, 4, 64), torch.float16, grad=True)
    dout = _randn(torch, gen, (2, 200, 4, 64), torch.float16)
    out = ct.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=deterministic)
    out.backward(dout)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    want = ct.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    want.backward(dout)
    assert torch.equal(out, want)
    grads = torch.stack([q.grad, k.grad, v.grad], dim=2)
    if deterministic:
        assert torch.equal(qkv.grad, grads)
    else:
        torch.testing.assert_close(qkv.grad, grads, atol=2e-3, rtol=0)
    q2 = qkv.detach()[:, :, 0].clone().requires_grad_()
    kv = _randn(torch, gen, (2, 260, 2, 2, 64), torch.float16, grad=True)
    out = ct.flash_attn_kvpacked_func(q2, kv, window_size=(64, 64))
    out.backward(dout)
    k2, v2 = (x.detach().clone().requires_grad_() for x in kv.unbind(2))
    want = ct.flash_attn_func(q2.detach(), k2, v2, window_size=(64, 64))
    want.backward(dout)
    assert torch.equal(out, want) and kv.grad.shape == kv.shape
    torch.testing.assert_close(kv.grad, torch.stack([k2.grad, v2.grad], dim=2), atol=2e-3, rtol=0)


def _cu(torch, lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("form", ["varlen", "qkvpacked", "kvpacked"])
def test_varlen_forms_match_reference(torch, ct, form):
    gen = torch.Generator(device="cuda").manual_seed(21)
    lengths_q = [70, 0, 201, 1]
    lengths_k = lengths_q if form == "qkvpacked" else [90, 5, 260, 33]
    tq, tk = sum(lengths_q), sum(lengths_k)
    cu_q, cu_k = _cu(torch, lengths_q), _cu(torch, lengths_k)
    kw = dict(causal=True, window_size=(100, 0), softcap=10.0)
    if form == "qkvpacked":
        qkv = _randn(torch, gen, (tq, 3, 4, 64), torch.bfloat16, grad=True)
        out, lse, probs = ct.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lengths_q), return_attn_probs=True, **kw)
        q, k, v = qkv.unbind(1)
    elif form == "kvpacked":
        q = _randn(torch, gen, (tq, 4, 64), torch.bfloat16, grad=True)
        kv = _randn(torch, gen, (tk, 2, 2, 64), torch.bfloat16, grad=True)
        out, lse, probs = ct.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                              return_attn_probs=True, **kw)  # fmt: skip
        k, v = kv.unbind(1)
    else:
        q = _randn(torch, gen, (tq, 4, 64), torch.bfloat16, grad=True)
        k = _randn(torch, gen, (tk, 2, 64), torch.bfloat16, grad=True)
        v = _randn(torch, gen, (tk, 2, 64), torch.bfloat16, grad=True)
        out, lse, probs = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    return_attn_probs=True, **kw)  # fmt: skip
    assert probs is None and lse.shape == (4, tq)
    dout = _randn(torch, gen, out.shape, torch.bfloat16)
    out.backward(dout)
    host = [_host(x) for x in (q, k, v, dout)]
    cq, ck = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    ref_out, ref_lse = reference.attention_varlen_forward(*host[:3], cq, ck, **kw)
    _close(out, ref_out, "out")
    finite = np.isfinite(ref_lse)
    _close(_host(lse)[finite], ref_lse[finite], "lse", tol=1e-3)
    dq, dk, dv = reference.attention_varlen_backward(host[3], *host[:3], cq, ck, **kw)
    if form == "qkvpacked":
        _close(qkv.grad, np.stack([dq, dk, dv], axis=1), "dqkv", tol=4e-2)
    elif form == "kvpacked":
        _close(q.grad, dq, "dq", tol=4e-2)
        _close(kv.grad, np.stack([dk, dv], axis=1), "dkv", tol=4e-2)
    else:
        for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), (dq, dk, dv)):
            _close(t.grad, want, name, tol=4e-2)


def test_varlen_paged_block_table(torch, ct):
    """flash_attn_varlen_func(block_table=...) reads k, v from pages: the packed call's result; no backward."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths_q, lengths_k, page = [3, 120, 1], [300, 129, 0], 128
    q = _randn(torch, gen, (sum(lengths_q), 4, 64), torch.float16)
    k = _randn(torch, gen, (sum(lengths_k), 2, 64), torch.float16)
    v = _randn(torch, gen, (sum(lengths_k), 2, 64), torch.float16)
    pages_per = [-(-n // page) for n in lengths_k]
    order = torch.randperm(sum(pages_per) + 2, generator=torch.Generator().manual_seed(0)).tolist()
    k_pages = torch.zeros((len(order), page, 2, 64), device="cuda", dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    table = torch.zeros((3, max(pages_per)), dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(lengths_k):
        for p in range(pages_per[b]):
            slot = order[used]
            used += 1
            table[b, p] = slot
            rows = slice(start + p * page, start + min(n, (p + 1) * page))
            cnt = rows.stop - rows.start
            k_pages[slot, :cnt], v_pages[slot, :cnt] = k[rows], v[rows]
        start += n
    cu_q, cu_k = _cu(torch, lengths_q), _cu(torch, lengths_k)
    want = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 120, 300, causal=True)
    got = ct.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 120, 300, causal=True, block_table=table.cuda())
    assert torch.equal(got, want)
    qg = q.clone().requires_grad_()
    out = ct.flash_attn_varlen_func(qg, k_pages, v_pages, cu_q, cu_k, 120, 300, causal=True, block_table=table.cuda())
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


def _caches(torch, gen, batch, cap, nkv, d, paged, spare_pages, seed):
    """bf16 k and v caches of ``cap`` slots per sequence: contiguous (block table None), or paged: pages of
    64 slots, ``spare_pages`` more than the table uses, each sequence's pages a random draw (``seed``)."""
    if not paged:
        k_cache = _randn(torch, gen, (batch, cap, nkv, d), torch.bfloat16)
        return k_cache, torch.randn_like(k_cache), None
    page, used = 64, batch * cap // 64
    k_cache = _randn(torch, gen, (used + spare_pages, page, nkv, d), torch.bfloat16)
    table = torch.randperm(k_cache.shape[0], generator=torch.Generator().manual_seed(seed))[:used]
    return k_cache, torch.randn_like(k_cache), table.view(batch, cap // page).to(torch.int32).cuda()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths_as", ["tensor", "int"])
def test_kvcache_appends_in_place_and_matches_reference(torch, ct, paged, lengths_as):
    """flash_attn_with_kvcache: the new k, v land in the caller's cache tensors (contiguous or paged),
    out and lse match the reference, with flash-attn's default interleaved rotary."""
    gen = torch.Generator(device="cuda").manual_seed(31 + paged)
    batch, nh, nkv, d, new = 3, 8, 2, 128, 2
    cap = 512
    q = _randn(torch, gen, (batch, new, nh, d), torch.bfloat16)
    kn = _randn(torch, gen, (batch, new, nkv, d), torch.bfloat16)
    vn = _randn(torch, gen, (batch, new, nkv, d), torch.bfloat16)
    lengths = [100, 0, 400] if lengths_as == "tensor" else [250] * batch
    pos = torch.arange(cap, device="cuda", dtype=torch.float32)[:, None]
    inv = 1.0 / 10000 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64)
    cos, sin = (f(pos * inv).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    k_cache, v_cache, table = _caches(torch, gen, batch, cap, nkv, d, paged, spare_pages=3, seed=1)
    before_k, before_v = _host(k_cache), _host(v_cache)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda") if lengths_as == "tensor" else lengths[0]
    out, lse = ct.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=seqlens, block_table=table, causal=True,
                                          return_softmax_lse=True)  # fmt: skip
    ref_out, ref_lse, ref_k, ref_v = reference.attention_with_kvcache(
        _host(q), before_k, before_v, k=_host(kn), v=_host(vn), cache_seqlens=lengths,
        block_table=None if table is None else table.cpu().numpy(), causal=True, rotary_cos=_host(cos),
        rotary_sin=_host(sin), rotary_interleaved=True,
    )  # fmt: skip
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse", tol=1e-3)
    _close(k_cache, ref_k, "k_cache after the append", tol=1e-2)
    _close(v_cache, ref_v, "v_cache after the append", tol=1e-2)


@pytest.mark.parametrize("paged, lengths_as, new, splits", [
    (False, "tensor", 1, 0), (False, "int", 1, 1), (True, "tensor", 0, 0), (True, "int", 2, 4), (False, "full", 0, 0),
])  # fmt: skip
def test_kvcache_decode_loop_takes_the_prepared_path(torch, ct, monkeypatch, paged, lengths_as, new, splits):
    """A decode loop's repeated flash_attn_with_kvcache call launches from the tensors' pointers (the
    call signature prepared by its first call, cuflash.torch.ops._kvcache_prepared) on the current stream:
    outputs, lse and the caches bitwise equal to the same loop with that path off (the CuPy API's own
    prepared call then, with the same record: this checks the torch side's pointers, lengths and stream;
    the record itself is checked against the reference elsewhere); a stream without its split workspace
    yet takes the whole way once."""
    from cuflash import kvcache
    from cuflash.torch import _bridge, ops

    kvcache.free_workspaces()  # (another test's stream handle may come back for this test's side stream)
    kvcache._PREPARED.calls.clear()
    gen = torch.Generator(device="cuda").manual_seed(37 + paged + 2 * new)
    batch, nh, nkv, d, cap, steps = 4, 8, 2, 128, 2048, 5
    k_cache, v_cache, table = _caches(torch, gen, batch, cap, nkv, d, paged, spare_pages=5, seed=2)
    inputs = [tuple(_randn(torch, gen, (batch, 1 if new < 2 else 2, h, d), torch.bfloat16) for h in (nh, nkv, nkv))
              for _ in range(steps)]  # fmt: skip
    start = torch.tensor([900, 0, 1500, 31], dtype=torch.int32, device="cuda")

    def loop(kc, vc, stream=None):
        outs = []
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            for t, (q, kn, vn) in enumerate(inputs):
                lens = {"tensor": start + t * new, "int": 1000 + t * new, "full": None}[lengths_as]
                out, lse = ct.flash_attn_with_kvcache(q, kc, vc, k=kn if new else None, v=vn if new else None,
                                                      cache_seqlens=lens, block_table=table, causal=True,
                                                      softmax_scale=1 if t == 3 else None, num_splits=splits,
                                                      return_softmax_lse=True)  # fmt: skip
                outs.append((out, lse))
        torch.cuda.synchronize()
        return outs

    taken = []
    real = kvcache.run_prepared

    def spy(*a):  # (prep, device, stream, pointers...): on the caller's current stream
        assert a[2] == torch.cuda.current_stream().cuda_stream
        taken.append(real(*a))
        return taken[-1]

    monkeypatch.setattr(kvcache, "run_prepared", spy)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = loop(kc, vc)
    # step 0 prepares the signature; steps 1, 2, 4 find it (step 3's softmax_scale is another signature)
    assert taken.count(True) == 3 and False not in taken, taken
    monkeypatch.setattr(ops, "_kvcache_prepared", lambda *a: None)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = loop(want_k, want_v)
    for t, ((o, l), (wo, wl)) in enumerate(zip(got, want)):
        assert torch.equal(o, wo) and torch.equal(l, wl), f"step {t}"
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    monkeypatch.undo()
    monkeypatch.setattr(kvcache, "run_prepared", spy)
    del taken[:]
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (after the clones: the side stream reads them)
    again = loop(kc2, vc2, side)
    q, kn, vn = inputs[0]
    lens = {"tensor": start, "int": 1000, "full": None}[lengths_as]
    key = kvcache._signature(torch.Tensor, _bridge.desc, q, k_cache, v_cache, kn if new else None, vn if new else None,
                             lens, table, True, None, splits, True, None, False, None, (-1, -1), 0.0)  # fmt: skip
    prep = kvcache.prepared(key)
    assert prep is not None
    # with splits, the side stream's first call has no workspace there yet: the whole way, once
    assert taken == [prep.ws_floats == 0] + [True] * (steps - 1), taken
    for t, ((o, l), (wo, wl)) in enumerate(zip(again, want)):
        assert torch.equal(o, wo) and torch.equal(l, wl), f"side stream, step {t}"
    assert torch.equal(kc2, want_k) and torch.equal(vc2, want_v)


def test_kvcache_extras_and_errors(torch, ct):
    """cache_batch_idx and cache_leftpad through the flash-attn signature; a cache the kernels cannot
    write in place, a bad window and CPU tensors are errors that name the argument."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    q = _randn(torch, gen, (2, 1, 4, 64), torch.float16)
    k_cache = _randn(torch, gen, (4, 256, 2, 64), torch.float16)
    v_cache = _randn(torch, gen, (4, 256, 2, 64), torch.float16)
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    pad = torch.tensor([10, 0], dtype=torch.int32, device="cuda")
    lens = torch.tensor([200, 77], dtype=torch.int32, device="cuda")
    out = ct.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad)
    ref = reference.attention_with_kvcache(_host(q), _host(k_cache), _host(v_cache), cache_seqlens=[200, 77],
                                           cache_batch_idx=[3, 1], cache_leftpad=[10, 0])[0]  # fmt: skip
    _close(out, ref, "out")
    strided = torch.zeros((2, 256, 2, 128), device="cuda", dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="k_cache must be contiguous in its last dimension"):
        ct.flash_attn_with_kvcache(q, strided, strided, k=q[:, :, :2], v=q[:, :, :2], cache_seqlens=3)
    with pytest.raises(ValueError, match="window_size"):
        ct.flash_attn_func(q, q, q, window_size=5)
    with pytest.raises(ValueError, match="CUDA tensor"):
        ct.flash_attn_func(q.cpu(), q, q)
    with pytest.raises(TypeError, match="torch tensor"):
        ct.flash_attn_varlen_func(q[0], q[0], q[0], [0, 1], [0, 1], 1, 1)


def test_opcheck_every_op(torch, ct):
    """torch.library.opcheck: schema, fake tensors against real outputs, autograd registration, AOT dispatch."""
    from torch.library import opcheck

    gen = torch.Generator(device="cuda").manual_seed(51)
    q = _randn(torch, gen, (2, 100, 4, 64), torch.bfloat16, grad=True)
    k = _randn(torch, gen, (2, 120, 2, 64), torch.bfloat16, grad=True)
    v = _randn(torch, gen, (2, 120, 2, 64), torch.bfloat16, grad=True)
    ops = torch.ops.cuflash
    opcheck(ops.fwd.default, (q, k, v, None, 0.0, None, True, -1, -1, 0.0, False))
    out, lse, rng = ops.fwd(q.detach(), k.detach(), v.detach(), None, 0.0, None, True, -1, -1, 0.0, False)
    opcheck(ops.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, rng, 0.0,
                              None, True, -1, -1, 0.0, True))  # fmt: skip
    cu_q, cu_k = _cu(torch, [30, 70]), _cu(torch, [50, 70])
    qv = _randn(torch, gen, (100, 4, 64), torch.bfloat16, grad=True)
    kv = _randn(torch, gen, (120, 2, 64), torch.bfloat16, grad=True)
    args = (qv, kv, kv, cu_q, cu_k, 70, 70, None, None, None, 0.0, None, True, -1, -1, 0.0, False)
    opcheck(ops.varlen_fwd.default, args)
    out, lse, rng = ops.varlen_fwd(qv.detach(), kv.detach(), kv.detach(), *args[3:])
    opcheck(ops.varlen_bwd.default, (torch.randn_like(out), qv.detach(), kv.detach(), kv.detach(), out, lse, cu_q,
                                     cu_k, 70, 70, None, None, rng, 0.0, None, True, -1, -1, 0.0, True))  # fmt: skip
    cache = _randn(torch, gen, (2, 256, 2, 64), torch.bfloat16)
    lens = torch.tensor([5, 100], dtype=torch.int32, device="cuda")
    opcheck(ops.fwd_kvcache.default, (q.detach()[:, :1], cache, cache.clone(), k.detach()[:, :1], v.detach()[:, :1],
                                      None, None, lens, -1, None, None, None, None, None, True, -1, -1, 0.0, True, 0))  # fmt: skip


def test_compile_fullgraph_model_matches_eager(torch, ct):
    """torch.compile(fullgraph=True) of a small attention model built on the flash-attn functions: no
    graph break (fullgraph raises on one), same loss and gradients as eager."""
    torch.manual_seed(0)
    dim, heads = 256, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=torch.bfloat16)
            self.proj = torch.nn.Linear(dim, dim, dtype=torch.bfloat16)

        def forward(self, x, cu, max_len):
            b, s, _ = x.shape
            qkv = self.qkv(x).view(b, s, 3, heads, dim // heads)
            y = ct.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(64, 0))
            z = ct.flash_attn_varlen_func(*(t.reshape(b * s, heads, -1) for t in qkv.unbind(2)), cu, cu, max_len,
                                          max_len, causal=True, softcap=20.0)  # fmt: skip
            return self.proj((y + z.view(b, s, heads, -1)).reshape(b, s, dim))

    model = Block().cuda()
    x = torch.randn(2, 300, dim, device="cuda", dtype=torch.bfloat16)
    cu = _cu(torch, [100, 200, 300])
    compiled = torch.compile(model, fullgraph=True)
    grads = []
    for fn in (model, compiled):
        model.zero_grad()
        loss = fn(x, cu, 300).float().square().mean()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-3, rtol=1e-3)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_compiled_decode_step(torch, ct):
    """A compiled (fullgraph) decode step with the in-place append: the same out and caches as eager."""
    gen = torch.Generator(device="cuda").manual_seed(61)
    q = _randn(torch, gen, (4, 1, 8, 64), torch.float16)
    kn = _randn(torch, gen, (4, 1, 2, 64), torch.float16)
    caches = [_randn(torch, gen, (4, 128, 2, 64), torch.float16) for _ in range(2)]
    lens = torch.tensor([3, 50, 0, 127], dtype=torch.int32, device="cuda")

    def step(q, kc, vc, kn, lens):
        return ct.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=lens, causal=True) * 1.0

    eager_caches = [c.clone() for c in caches]
    want = step(q, *eager_caches, kn, lens)
    got = torch.compile(step, fullgraph=True)(q, *caches, kn, lens)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(caches, eager_caches))


def test_cuda_graph_decode_loop_replays_eager(torch, ct):
    """One decode step (append + attention, split-KV) captured in a CUDA graph and replayed for 12
    tokens with new inputs and lengths written into the static tensors: outputs and caches equal an
    eager loop's."""
    gen = torch.Generator(device="cuda").manual_seed(71)
    batch, nh, nkv, d, cap = 3, 8, 2, 128, 4096
    k_cache = _randn(torch, gen, (batch, cap, nkv, d), torch.bfloat16)
    v_cache = _randn(torch, gen, (batch, cap, nkv, d), torch.bfloat16)
    start = torch.tensor([1000, 17, 3000], dtype=torch.int32, device="cuda")
    steps = [tuple(_randn(torch, gen, (batch, 1, h, d), torch.bfloat16) for h in (nh, nkv, nkv)) for _ in range(12)]
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = []
    for t, (q, kn, vn) in enumerate(steps):
        want.append(ct.flash_attn_with_kvcache(q, eager_k, eager_v, k=kn, v=vn, cache_seqlens=start + t, causal=True))

    sq, sk, sv = (torch.empty_like(x) for x in steps[0])
    lens = start.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles and plans) outside the capture, on scratch caches
        for _ in range(2):
            ct.flash_attn_with_kvcache(sq, k_cache.clone(), v_cache.clone(), k=sk, v=sv, cache_seqlens=lens, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ct.flash_attn_with_kvcache(sq, k_cache, v_cache, k=sk, v=sv, cache_seqlens=lens, causal=True)
    got = []
    for t, (q, kn, vn) in enumerate(steps):
        sq.copy_(q), sk.copy_(kn), sv.copy_(vn)
        lens.copy_(start + t)
        graph.replay()
        got.append(static_out.clone())
    torch.cuda.synchronize()
    for t, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {t}"
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_memory_comes_from_torch_and_device_follows_tensors(torch, ct):
    """Outputs and scratch come from torch's caching allocator (memory_allocated sees them), and the
    call runs on the tensors' device even when another device is current."""
    gen = torch.Generator(device="cuda").manual_seed(81)
    q = _randn(torch, gen, (4, 1024, 8, 128), torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = ct.flash_attn_func(q, q, q, causal=True)
    assert torch.cuda.memory_allocated() - before >= out.numel() * out.element_size()
    last = torch.cuda.device_count() - 1
    dev = torch.device("cuda", last)
    x = q[:1, :256].to(dev)
    with torch.cuda.device(0):
        got = ct.flash_attn_func(x, x, x, causal=True)
    assert got.device == dev
    torch.testing.assert_close(got.to(q.device), ct.flash_attn_func(q[:1, :256], q[:1, :256], q[:1, :256], causal=True))


@pytest.mark.parametrize("head_dim, heads, kw", [(128, (8, 2), dict(causal=True)), (64, (4, 4), {}),
                                                 (256, (2, 1), dict(window_size=(50, 10), softcap=10.0)),
                                                 (33, (3, 1), dict(causal=True))])  # fmt: skip
def test_flash_attn_func_takes_the_prepared_forward(torch, ct, monkeypatch, head_dim, heads, kw):
    """A repeated flash_attn_func launches from the tensors' pointers (the signature its first call prepared,
    cuflash.torch.ops._fwd_prepared): eager calls never take the op (no dispatcher): without gradients they
    call its implementation, with them ops._Dense (autograd). Outputs, lse and (deterministic) gradients
    are bitwise equal to the same calls with the memo of prepared calls cleared before each, and the
    first call is checked against the float64 reference."""
    from cuflash import checks, forward
    from cuflash.torch import ops

    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    nh, nkv = heads
    whole = []
    real_checks = checks.check_qkv
    monkeypatch.setattr(checks, "check_qkv", lambda *a: whole.append(1) or real_checks(*a))
    op_calls = []
    real_op = ops.fwd
    monkeypatch.setattr(ops, "fwd", lambda *a: op_calls.append(1) or real_op(*a))
    inputs = [tuple(_randn(torch, gen, (2, 170, h, head_dim), torch.bfloat16) for h in (nh, nkv, nkv)) for _ in range(3)]
    dout = _randn(torch, gen, (2, 170, nh, head_dim), torch.bfloat16)

    def calls(clear: bool):
        """(out, lse) of every call, whether each took the whole way, the gradients of those with them."""
        outs, took, grads = [], [], []
        forward._PREPARED.calls.clear()
        for grad in (False, True):
            for q, k, v in inputs:
                if clear:
                    forward._PREPARED.calls.clear()
                q, k, v = (x.detach().clone().requires_grad_(grad) for x in (q, k, v))
                del whole[:], op_calls[:]
                out, lse, _ = ct.flash_attn_func(q, k, v, deterministic=True, return_attn_probs=True, **kw)
                assert not op_calls, f"grad={grad}: an eager call took the op"
                outs.append((out.detach(), lse))
                took.append(bool(whole))
                if grad:
                    out.backward(dout)
                    grads.append((q.grad, k.grad, v.grad))
        return outs, took, grads

    (outs, took, grads), (outs_c, took_c, grads_c) = calls(False), calls(True)
    assert took == [True, False, False, False, False, False], took  # only the very first call: the same signature
    assert all(took_c)
    for a, b in zip(outs + grads, outs_c + grads_c):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    q, k, v = inputs[0]
    want, want_lse = reference.attention_forward(_host(q), _host(k), _host(v), softmax_scale=head_dim**-0.5, **kw)
    _close(outs[0][0], want, "first call")
    np.testing.assert_allclose(_host(outs[0][1]), want_lse, atol=2e-3)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(30, 5), softcap=8.0), dict(dropout_p=0.2),
                                dict(causal=True, alibi=True)])  # fmt: skip
def test_eager_autograd_matches_the_op(torch, ct, kw):
    """An eager call with gradients runs ops._Dense (the op's implementations and saved tensors, without the
    dispatcher): outputs, lse and gradients bitwise equal to the op's (deterministic backward; dropout replays
    the same Philox stream from the same generator state)."""
    from cuflash.torch import ops

    gen = torch.Generator(device="cuda").manual_seed(len(str(kw)))  # (a different draw per case)
    q = _randn(torch, gen, (2, 200, 6, 64), torch.bfloat16)
    k, v = (_randn(torch, gen, (2, 230, 2, 64), torch.bfloat16) for _ in range(2))
    dout = _randn(torch, gen, q.shape, torch.bfloat16)
    slopes = torch.rand(6, generator=gen, device="cuda", dtype=torch.float32) if kw.get("alibi") else None
    left, right = kw.get("window_size", (-1, -1))
    args = (slopes, kw.get("dropout_p", 0.0), None, kw.get("causal", False), left, right, kw.get("softcap", 0.0), True)
    got = []
    for fn in (ops.forward, ops.fwd):
        torch.manual_seed(3)
        a, b, c = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out, lse, _ = fn(a, b, c, *args)
        assert (type(out.grad_fn).__name__ == "_DenseBackward") == (fn is ops.forward), type(out.grad_fn).__name__
        (out.float() * dout.float()).sum().backward()
        got.append((out.detach(), lse.detach(), a.grad, b.grad, c.grad))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), *got):
        assert torch.equal(x, y), name


def test_inplace_edit_of_out_is_caught_on_every_call(torch, ct):
    """A signature's first call (the whole way: out from the call's allocator through to_torch) and its later
    ones (the prepared path: out from torch.empty) give outputs autograd treats alike: an in-place edit is
    allowed and the backward, which needs out, raises on it."""
    from cuflash import forward

    forward._PREPARED.calls.clear()  # (so that call 0 takes the whole way whatever ran before in this worker)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (_randn(torch, gen, (2, 160, 4, 64), torch.bfloat16) for _ in range(3))
    for call in range(3):
        a, b, c = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = ct.flash_attn_func(a, b, c, causal=True)
        assert out._base is None, call
        out.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.float().sum().backward()
