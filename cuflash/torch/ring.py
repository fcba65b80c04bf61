"""Context parallelism: ring attention over torch.distributed, forward and backward.

Each rank holds a slice of the sequence (its queries, keys and values, flash-attn's layout
(batch, seqlen_local, nheads, headdim)). The K/V slices travel around the ring of ranks: at step i
rank r holds the slice of rank (r - i) mod W, attends its queries to it with cuflash's kernels, and
merges the partial result into its running output through the log-sum-exp (the merge cuflash's
split-KV decode does on the device). The next slice is exchanged with NCCL point-to-point
(``batch_isend_irecv``; NCCL runs it on its own stream) while the current one is computed. The backward sends K, V
around again, with their dK, dV partial sums travelling beside them, and ends with every rank
holding the gradients of its own slice.

Causal attention needs load balance: with contiguous slices the last rank would attend to every key
and the first to its own only. ``zigzag_shard`` cuts the sequence into 2W chunks and gives rank r the
chunks r and 2W - 1 - r, so every rank does the same work: at step 0 the local slice is causal
against itself; from a rank before it, all of the rank's queries see the first half of the slice;
from a rank after it, the second half of the rank's queries sees the whole slice.

    import torch.distributed as dist
    from cuflash.torch.ring import ring_attention, zigzag_shard, zigzag_unshard
    q_loc, k_loc, v_loc = (zigzag_shard(x, rank, world) for x in (q, k, v))   # (b, s / W, h, d)
    out_loc = ring_attention(q_loc, k_loc, v_loc, causal=True)               # autograd works
    out = zigzag_unshard(gathered_out_slices)                                  # all ranks' slices

Supported: causal or not, GQA / MQA, softmax_scale, softcap, the sliding window and ALiBi; not dropout
(a clear error). The window and ALiBi depend on absolute positions: with either, the slices are taken
to be zigzag_shard's (causal or not), each step runs rank r's query halves against the slice's key
halves as separate calls, each cut to the rows and keys that hold visible scores and with its diagonal
moved to their absolute positions (the kernels' diag_shift, cuflash.attention); pairs a window leaves
empty are skipped. ``simulate_ring``
runs the same schedule in one process over W slices (tests, and a check of the merge on one GPU).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from . import ops  # noqa: F401  (torch.ops.cuflash.fwd / bwd)
from .interface import _window

__all__ = ["ring_attention", "simulate_ring", "zigzag_shard", "zigzag_unshard"]


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------


def zigzag_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s slice of a full sequence for causal ring attention: chunks rank and
    2 world - 1 - rank of 2 world equal chunks along ``dim`` (the sequence dim of (b, s, h, d))."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"the sequence ({n} along dim {dim}) must split into 2 x world = {2 * world} equal chunks; "
                         "pad it to a multiple")  # fmt: skip
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(slices: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's ``zigzag_shard`` slice, in rank order (e.g. after an all-gather)."""
    world = len(slices)
    halves = [s.chunk(2, dim=dim) for s in slices]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim=dim)


# ---------------------------------------------------------------------------------------------
# The schedule: which part of rank r's queries meets which part of the slice of rank src
# ---------------------------------------------------------------------------------------------


def _step_plan(rank: int, src: int, causal: bool) -> tuple[str, str, bool]:
    """(query part, key part, causal) of rank ``rank``'s queries against the slice of rank ``src``:
    parts "all", "first" or "second" (halves of the zigzag slice)."""
    if not causal:
        return "all", "all", False
    if src == rank:
        return "all", "all", True  # [chunk r, chunk 2W-1-r] against itself: causal is exact
    if src < rank:
        return "all", "first", False  # chunk src is before both query chunks; chunk 2W-1-src after both
    return "second", "all", False  # only chunk 2W-1-r comes after both of src's chunks


def _visible_block(q0: int, k0: int, n: int, causal: bool, window: tuple[int, int]):
    """Rows [i0, i1) and keys [j0, j1) of a pair of n query positions from q0 and n key positions from
    k0 that hold every visible score (flash-attn's window: key position j is visible to query position i
    iff i - left <= j <= i + right, -1 unbounded; causal: right = 0), or None when none is visible."""
    left, right = window
    right = 0 if causal else right
    big = 4 * n + abs(q0 - k0)  # (wider than any distance in the pair: unbounded)
    lo, hi = (big if left < 0 else left), (big if right < 0 else right)  # key - query distance in [-lo, hi]
    i0, i1 = max(0, k0 - q0 - hi), min(n, k0 - q0 + n + lo)
    j0, j1 = max(0, q0 - k0 - lo), min(n, q0 - k0 + n + hi)
    return (i0, i1, j0, j1) if i0 < i1 and j0 < j1 else None


def _pieces(rank: int, src: int, world: int, half: int, causal: bool, window: Optional[tuple[int, int]]):
    """The kernel calls of rank ``rank``'s queries against the slice of rank ``src``: a list of
    (query part, key part, causal, diag_shift), a part "all", "first", "second" or a (start, stop) range
    of the slice. window None: positions do not matter (no window, no ALiBi): _step_plan's one call.
    Else the zigzag halves' absolute positions (chunk r and 2W - 1 - r of ``half`` tokens each): per
    pair of halves, one call on the rows and keys that hold its visible scores (none if it holds
    none), its diagonal moved to their positions."""
    if window is None:
        qp, kp, c = _step_plan(rank, src, causal)
        return [(qp, kp, c, 0)]
    starts = lambda r: ((0, r * half), (half, (2 * world - 1 - r) * half))  # noqa: E731  (offset in the slice, position)
    pieces = []
    for qo, q0 in starts(rank):
        for ko, k0 in starts(src):
            block = _visible_block(q0, k0, half, causal, window)
            if block is not None:
                i0, i1, j0, j1 = block
                shift = (q0 + i0) - (k0 + j0) - ((j1 - j0) - (i1 - i0))
                pieces.append(((qo + i0, qo + i1), (ko + j0, ko + j1), causal, shift))
    return pieces


def _part(x: Tensor, part, dim: int = 1) -> Tensor:
    """The rows of ``part`` along ``dim``: "all", "first" / "second" (halves) or a (start, stop) range."""
    if part == "all":
        return x
    if not isinstance(part, str):
        return x.narrow(dim, part[0], part[1] - part[0])
    half = x.shape[dim] // 2
    return x.narrow(dim, 0, half) if part == "first" else x.narrow(dim, half, half)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for fp16 / bf16 (float64 stays float64)


def _merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge a partial attention over disjoint keys into (out, lse) in place (views allowed):
    out (b, s, h, d) in the accumulator dtype, lse (b, h, s) fp32. Rows that saw no key (-inf) stay 0."""
    new = torch.logaddexp(lse, lse_b)
    new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_a = torch.exp(lse - new_safe).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - new_safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_a).addcmul_(out_b, w_b)
    lse.copy_(new)


def _merge_into(out: Optional[Tensor], lse: Optional[Tensor], part: str, out_b: Tensor, lse_b: Tensor,
                seqlen: int):  # fmt: skip
    """_merge_ of a partial attention of one query part into the running (out, lse) of all ``seqlen``
    queries. The first part starts them: itself when it covers every query, else (a window's first call
    may cover part of them) zeros with lse -inf, merged with it."""
    if out is None:
        if part == "all":
            return out_b.to(_acc_dtype(out_b.dtype)), lse_b.clone()
        b, _, h, d = out_b.shape
        out = torch.zeros(b, seqlen, h, d, dtype=_acc_dtype(out_b.dtype), device=out_b.device)
        lse = torch.full((b, h, seqlen), -math.inf, dtype=torch.float32, device=out_b.device)
    _merge_(_part(out, part), _part(lse, part, dim=2), out_b, lse_b)
    return out, lse


class _Args:
    """The per-call arguments of every step: scale, softcap, the position-dependent variants (window
    (left, right) and ALiBi slopes; window None when neither is asked for) and the backward's
    deterministic mode."""

    def __init__(self, softmax_scale: float, softcap: float, window: Optional[tuple[int, int]] = None,
                 alibi_slopes: Optional[Tensor] = None, deterministic: bool = False):  # fmt: skip
        self.scale, self.softcap, self.window, self.alibi = softmax_scale, softcap, window, alibi_slopes
        self.deterministic = bool(deterministic)

    def pieces(self, rank: int, src: int, world: int, length: int, causal: bool):
        return _pieces(rank, src, world, length // 2, causal, self.window)

    def fwd(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, shift: int = 0):
        wl, wr = self.window or (-1, -1)
        out, lse, _ = torch.ops.cuflash.fwd(q, k, v, self.alibi, 0.0, self.scale, causal, wl, wr, self.softcap, False,
                                            shift)  # fmt: skip
        return out, lse

    def bwd(self, dout, q, k, v, out, lse, causal: bool, shift: int = 0):
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # (read only with dropout; no kernel to fill it)
        wl, wr = self.window or (-1, -1)
        return torch.ops.cuflash.bwd(dout, q, k, v, out, lse, self.alibi, no_rng, 0.0, self.scale, causal, wl, wr,
                                     self.softcap, self.deterministic, shift)  # fmt: skip


def _forward_steps(q: Tensor, kv_of_step: Callable[[int], tuple[Tensor, Tensor]], rank: int, world: int, causal: bool,
                   args: _Args) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Rank ``rank``'s output and lse (fp32 out) over the W steps; kv_of_step(i) gives the K/V slice
    held at step i (that of rank (rank - i) mod W)."""
    out = lse = None
    for i in range(world):
        k, v = kv_of_step(i)
        for qp, kp, c, shift in args.pieces(rank, (rank - i) % world, world, q.shape[1], causal):
            o_b, l_b = args.fwd(_part(q, qp), _part(k, kp), _part(v, kp), c, shift)
            out, lse = _merge_into(out, lse, qp, o_b, l_b, q.shape[1])
    return out, lse


def _backward_step(dout, q, k, v, out, lse, rank: int, src: int, world: int, causal: bool, args: _Args):
    """[((qp, dq_part), (kp, dk_part, dv_part)), ...] of rank's queries against src's slice, one per
    call of the step: the gradients of the query part and key part it covers (add them into views:
    _part(dq, qp).add_(dq_part))."""
    grads = []
    for qp, kp, c, shift in args.pieces(rank, src, world, q.shape[1], causal):
        sl = lambda x: _part(x, qp)  # noqa: E731,B023
        dq_p, dk_p, dv_p = args.bwd(sl(dout), sl(q), _part(k, kp), _part(v, kp), sl(out),
                                    _part(lse, qp, dim=2).contiguous(), c, shift)  # fmt: skip
        grads.append(((qp, dq_p), (kp, dk_p, dv_p)))
    return grads


# ---------------------------------------------------------------------------------------------
# The ring over torch.distributed
# ---------------------------------------------------------------------------------------------


class _Ring:
    """Point-to-point exchange with the ring's neighbours (send to rank + 1, receive from rank - 1).
    ProcessGroupNCCL runs the transfers on its own stream, ordered after the work already queued on the
    current stream; work.wait() makes the current stream wait for them: the attention on the slice
    already held runs meanwhile, with no side stream of ours."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("ring_attention: this process is not a member of `group`")
        glob = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
        self.next, self.prev = glob((self.rank + 1) % self.world), glob((self.rank - 1) % self.world)

    def start(self, tensors: Sequence[Tensor], tag: int = 0) -> tuple[list, list[Tensor]]:
        """Begin sending ``tensors`` to the next rank and receiving as many from the previous one
        (every rank's tensors must have the same shapes and dtypes)."""
        recv = [torch.empty_like(t) for t in tensors]
        ops_ = [self.dist.P2POp(self.dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops_ += [self.dist.P2POp(self.dist.irecv, t, self.prev, self.group, tag) for t in recv]
        if tensors[0].is_cuda:
            with torch.cuda.device(tensors[0].device):  # the current stream of the tensors' device
                return self.dist.batch_isend_irecv(ops_), recv
        return self.dist.batch_isend_irecv(ops_), recv

    def finish(self, pending: tuple[list, list[Tensor]]) -> list[Tensor]:
        reqs, recv = pending
        if recv[0].is_cuda:
            with torch.cuda.device(recv[0].device):  # wait() orders that device's current stream
                for r in reqs:
                    r.wait()
        else:
            for r in reqs:
                r.wait()
        return recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, causal: bool, args: _Args):
        held = [k.contiguous(), v.contiguous()]
        pending = None

        def kv_of_step(i):
            nonlocal held, pending
            if i > 0:
                held = ring.finish(pending)
            if i + 1 < ring.world:
                pending = ring.start(held)  # the next slice travels while this one is used
            return held[0], held[1]

        out, lse = _forward_steps(q, kv_of_step, ring.rank, ring.world, causal, args)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.args = ring, causal, args
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, args = ctx.ring, ctx.causal, ctx.args
        dout = dout.contiguous()
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        held = [k.contiguous(), v.contiguous()]
        kv_pending = dkv_pending = None
        # Step i: the slice of rank src = rank - i is held; the next slice and the dK, dV partial sums of
        # this one (from the ranks it visited before) arrive while this step's gradients are computed.
        # The sums travel one hop behind their slice and, after W hops, are back at its owner.
        for i in range(ring.world):
            if i + 1 < ring.world:
                kv_pending = ring.start(held)
            grads = _backward_step(dout, q, held[0], held[1], out, lse, ring.rank, (ring.rank - i) % ring.world,
                                   ring.world, causal, args)  # fmt: skip
            if i == 0:
                dk, dv = torch.zeros_like(held[0], dtype=acc), torch.zeros_like(held[1], dtype=acc)
            else:
                dk, dv = ring.finish(dkv_pending)  # the received sums: ours to add into
            for (qp, dq_p), (kp, dk_p, dv_p) in grads:
                _part(dq, qp).add_(dq_p)
                _part(dk, kp).add_(dk_p)
                _part(dv, kp).add_(dv_p)
            if ring.world > 1:
                dkv_pending = ring.start([dk, dv], tag=1)
            if i + 1 < ring.world:
                held = ring.finish(kv_pending)
        if ring.world > 1:
            dk, dv = ring.finish(dkv_pending)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _check(q, k, v, causal, window_size, alibi_slopes, dropout_p) -> Optional[tuple[int, int]]:
    """Check one rank's slices and the variants; the window as the steps take it (None: positions
    do not matter)."""
    if dropout_p:
        raise NotImplementedError("ring_attention: no dropout across a ring")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q (b, s, h, d) and k, v (b, s_kv, h_kv, d) slices expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    left, right = _window(window_size)
    positional = (left, right) != (-1, -1) or alibi_slopes is not None
    what = "causal ring attention" if causal else "ring attention with a window or ALiBi" if positional else None
    if what and q.shape[1] % 2:
        raise ValueError(f"{what} takes zigzag_shard slices, of even length; got {q.shape[1]}")
    if what and q.shape[1] != k.shape[1]:
        raise ValueError(f"{what}: q and k slices must have the same length (zigzag_shard of one sequence)")
    return (left, right) if positional else None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, softcap: float = 0.0, window_size=(-1, -1),
                   alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, deterministic: bool = False) -> Tensor:  # fmt: skip
    """Attention of this rank's query slice against the whole sequence, whose K/V slices are spread over
    ``group`` (torch.distributed, NCCL on GPUs; default the world). q: (batch, seqlen_local, nheads,
    headdim); k, v: (batch, seqlen_local, nheads_kv, headdim), this rank's slices; with causal, the
    slices of ``zigzag_shard`` (every rank the same length, even), and so with a window or ALiBi,
    causal or not (their positions are zigzag_shard's). Every rank's slices must have the same shapes
    (the receive buffers are shaped like the local slice: pad the sequence to a multiple of the world
    size, or of twice it with causal, a window or ALiBi). window_size (left, right) and alibi_slopes
    ((nheads,) or (batch, nheads) float32 on q's device): flash-attn's, over the whole sequence's
    positions. Returns this rank's output slice; differentiable (the backward runs the ring again,
    and every rank of the group must run it). deterministic: the kernels' deterministic backward (the
    ring adds its partial gradients in a fixed order, so the gradients are then bitwise reproducible).
    dropout_p exists to say clearly that it is not supported here."""
    window = _check(q, k, v, causal, window_size, alibi_slopes, dropout_p)
    ring = _Ring(group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, ring, causal, _Args(scale, softcap, window, alibi_slopes, deterministic))


# ---------------------------------------------------------------------------------------------
# The same schedule in one process (tests; a check of the merge on one GPU)
# ---------------------------------------------------------------------------------------------


class _Simulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, causal: bool, args: _Args, *slices):
        world = len(slices) // 3
        qs, ks, vs = slices[:world], slices[world: 2 * world], slices[2 * world:]
        outs, lses = [], []
        for r in range(world):
            o, l = _forward_steps(qs[r], lambda i: (ks[(r - i) % world], vs[(r - i) % world]), r, world, causal, args)  # noqa: B023
            outs.append(o.to(qs[r].dtype))
            lses.append(l)
        ctx.save_for_backward(*slices, *outs, *lses)
        ctx.causal, ctx.args, ctx.world = causal, args, world
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        w, causal, args = ctx.world, ctx.causal, ctx.args
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * w:(i + 1) * w] for i in range(5))
        dqs = [torch.zeros_like(q, dtype=_acc_dtype(q.dtype)) for q in qs]
        dks = [torch.zeros_like(k, dtype=_acc_dtype(k.dtype)) for k in ks]
        dvs = [torch.zeros_like(v, dtype=_acc_dtype(v.dtype)) for v in vs]
        for r in range(w):
            for i in range(w):
                src = (r - i) % w
                for (qp, dq), (kp, dk, dv) in _backward_step(douts[r].contiguous(), qs[r], ks[src], vs[src], outs[r],
                                                             lses[r], r, src, w, causal, args):  # fmt: skip
                    _part(dqs[r], qp).add_(dq)
                    _part(dks[src], kp).add_(dk)
                    _part(dvs[src], kp).add_(dv)
        cast = lambda gs, xs: [g.to(x.dtype) for g, x in zip(gs, xs)]  # noqa: E731
        return (None, None, *cast(dqs, qs), *cast(dks, ks), *cast(dvs, vs))


def simulate_ring(qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor], *, causal: bool = False,
                  softmax_scale: Optional[float] = None, softcap: float = 0.0, window_size=(-1, -1),
                  alibi_slopes: Optional[Tensor] = None, deterministic: bool = False) -> list[Tensor]:  # fmt: skip
    """ring_attention's schedule and merge for W = len(qs) ranks in one process: every rank's output
    slice, differentiable. The slices as ring_attention takes them (zigzag_shard with causal, a
    window or ALiBi)."""
    if not len(qs) == len(ks) == len(vs) >= 1:
        raise ValueError("one q, k and v slice per simulated rank")
    for q, k, v in zip(qs, ks, vs):
        window = _check(q, k, v, causal, window_size, alibi_slopes, 0.0)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(qs[0].shape[-1])
    return list(_Simulated.apply(causal, _Args(scale, softcap, window, alibi_slopes, deterministic), *qs, *ks, *vs))
