"""Varlen benchmark: packed batches of uneven lengths (cuflash.attention_varlen) against the same
kernels on a batch of equal lengths and against PyTorch FlexAttention with a document mask, on one GPU
in one run.

Each point packs --tokens tokens (default 16k) of sequences whose lengths are drawn uniformly from
[1, 2 x mean] (seeded; the last one cut to fit). Implementations, same tokens and heads:
  cuflash        attention_varlen on the packed batch
  cuflash equal  cuflash.attention on tokens / mean sequences of exactly mean tokens (no padding): what
                 the same kernels do on an even batch (the bar: varlen >= 0.95x of it per useful FLOP)
  flex           FlexAttention under torch.compile on one (1, heads, tokens, d) sequence with a
                 document mask (create_block_mask, built once before timing): the packed batch
TFLOP/s count useful FLOPs only: 4 x headdim per (query, key) pair a query sees in its own sequence
(causal: bottom-right per sequence), x2.5 for the backward. Timing as cuflash.bench.time_ms.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np

from .bench import (
    Row, environment, grouped_bars, load_run, ratio_summary, release_memory, runs_once, save_run, time_ms, torch_or_none,
)

MEANS = (512, 1024, 2048, 4096, 8192)
FLOP_MODEL = "FLOPs = 4*headdim per (query, key) pair of one sequence x heads; bwd = 2.5x"


def draw_lengths(mean: int, tokens: int, seed: int = 0) -> list[int]:
    """Lengths uniform in [1, 2 mean] until they hold ``tokens`` tokens (the last one cut to fit)."""
    rng = np.random.default_rng(seed + mean)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(1, 2 * mean + 1)))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def pairs(lengths, causal: bool) -> int:
    """(query, key) pairs the queries of each sequence see, summed."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def _flex_document(torch, lengths, causal, scale, tq, tk, tv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
    total = doc.numel()

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(document, None, None, total, total, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(tq, tk, tv, block_mask=block_mask, scale=scale)


def run_point(op: str, dtype: str, head_dim: int, causal: bool, mean: int, tokens: int, nheads: int, *,
              repeats: int = 20, peers: bool = True) -> Row:  # fmt: skip
    import cupy

    import cuflash

    from .checks import numpy_dtype

    dt = numpy_dtype(dtype)
    lengths = draw_lengths(mean, tokens)
    equal = max(1, tokens // mean)
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((tokens, nheads, head_dim), dtype=cupy.float32).astype(dt) for _ in range(4))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    max_len = max(lengths)
    scale = 1.0 / math.sqrt(head_dim)
    row = Row(dtype, head_dim, causal, mean, len(lengths), nheads, op=op)
    row.notes["lengths"] = f"{len(lengths)} sequences, {min(lengths)}..{max_len} tokens"
    mult = 1.0 if op == "fwd" else 2.5
    flops = {"cuflash": 4.0 * head_dim * pairs(lengths, causal) * nheads * mult}
    flops["flex"] = flops["cuflash"]
    # The even batch: tokens / mean sequences of mean tokens, dense layout.
    qe, ke, ve, doe = (x[: equal * mean].reshape(equal, mean, nheads, head_dim) for x in (q, k, v, dout))
    flops["cuflash equal"] = 4.0 * head_dim * pairs([mean] * equal, causal) * nheads * mult
    impls = {}
    if op == "fwd":
        impls["cuflash"] = lambda: cuflash.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal)
        impls["cuflash equal"] = lambda: cuflash.attention(qe, ke, ve, causal=causal)
    else:
        o, lse = cuflash.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal, return_lse=True)
        oe, lsee = cuflash.attention(qe, ke, ve, causal=causal, return_lse=True)
        impls["cuflash"] = lambda: cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, max_len, max_len,
                                                                     causal=causal)  # fmt: skip
        impls["cuflash equal"] = lambda: cuflash.attention_backward(doe, qe, ke, ve, oe, lsee, causal=causal)
    torch = torch_or_none() if peers else None
    if peers and torch is None:
        row.notes["torch"] = "torch with CUDA not importable"
    if torch is not None:
        tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, dout))
        if op != "fwd":
            tq, tk, tv = (x.requires_grad_() for x in (tq, tk, tv))
        try:
            fwd = _flex_document(torch, lengths, causal, scale, tq, tk, tv)
            if op == "fwd":
                impls["flex"] = fwd
            else:
                saved = fwd()
                impls["flex"] = lambda: torch.autograd.grad(saved, (tq, tk, tv), tdo, retain_graph=True)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is noted, the rest timed
            row.notes["flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    runnable = runs_once(impls, row.notes)
    row.ms = time_ms(runnable, repeats=repeats)
    for name in runnable:
        row.tflops[name] = flops[name] / (row.ms[name] * 1e-3) / 1e12
    return row


def format_table(rows: list[Row], env: dict) -> str:
    lines = [
        f"GPU {env['gpu']} | cuflash {env['cuflash']} | NVRTC {env['nvrtc']} | torch {env.get('torch', '-')}",
        f"Packed batches, lengths uniform in [1, 2 x mean]. TFLOP/s ({FLOP_MODEL}); equal: cuflash on an even "
        "batch of mean-token sequences; flex: FlexAttention with a document mask",
        f"{'op':4} {'dtype':5} {'hd':>3} {'causal':6} {'mean':>5} {'seqs':>4} | {'varlen':>7} {'equal':>7} {'flex':>7} | "
        f"{'vs equal':>8} {'vs flex':>7} | {'ms':>8}",
    ]
    for r in rows:
        t = r.tflops
        ours, eq, flex = t.get("cuflash"), t.get("cuflash equal"), t.get("flex")
        fmt = lambda x: f"{x:7.1f}" if x else f"{'-':>7}"  # noqa: E731
        ratio = lambda a, b, w: f"{a / b:{w}.3f}" if a and b else f"{'-':>{w}}"  # noqa: E731
        lines.append(f"{r.op:4} {r.dtype:5} {r.head_dim:>3} {str(r.causal):6} {r.seqlen:>5} {r.batch:>4} | {fmt(ours)} "
                     f"{fmt(eq)} {fmt(flex)} | {ratio(ours, eq, 8)} {ratio(ours, flex, 7)} | "
                     f"{r.ms.get('cuflash', float('nan')):8.3f}")
    for op in dict.fromkeys(r.op for r in rows):
        for peer in ("cuflash equal", "flex"):
            ratios = [r.tflops["cuflash"] / r.tflops[peer] for r in rows if r.op == op and peer in r.tflops
                      and "cuflash" in r.tflops]  # fmt: skip
            if ratios:
                lines.append(ratio_summary(f"{op}: cuflash varlen / {peer}", ratios))
    for r in rows:
        for impl, why in r.notes.items():
            if impl != "lengths":
                lines.append(f"note: {impl} at {r.op} hd{r.head_dim} mean={r.seqlen}: {why}")
    return "\n".join(lines)


def plot(rows: list[Row], env: dict, path: str) -> None:
    keys = list(dict.fromkeys((r.op, r.head_dim, r.causal) for r in rows))
    panels = []
    for op, hd, causal in keys:
        sel = sorted((r for r in rows if (r.op, r.head_dim, r.causal) == (op, hd, causal)), key=lambda r: r.seqlen)
        panels.append((f"{op} hd{hd}{' causal' if causal else ''}", [(f"mean {r.seqlen}", r.tflops) for r in sel]))
    impls = [i for i in ("flex", "cuflash equal", "cuflash") if any(i in r.tflops for r in rows)]
    grouped_bars(panels, impls, f"Packed varlen batches, {env['gpu']}, {env.get('date', '')[:10]}", "TFLOP/s", path)


def cli_main(head_dim, tokens, hidden, dtype, causal, op, repeats, peers, means=MEANS, json_path=None, plot_path=None,
             echo=None):  # fmt: skip
    echo = echo or (lambda msg, err=False: print(msg, file=sys.stderr if err else sys.stdout, flush=True))
    env = environment()
    dtypes = ("bf16", "fp16") if dtype == "both" else (dtype,)
    causals = {"both": (False, True), "causal": (True,), "no-causal": (False,)}[causal]
    ops = ("fwd", "bwd") if op == "all" else (op,)
    points = [(o, dt, hd, c, m) for o in ops for dt in dtypes for hd in head_dim for c in causals for m in means]
    rows = []
    t0 = time.time()
    for i, (o, dt, hd, c, m) in enumerate(points):
        h = max(1, hidden // hd)
        echo(f"[{i + 1}/{len(points)}] varlen {o} {dt} hd{hd} causal={c} mean={m} tokens={tokens} heads={h}", err=True)
        rows.append(run_point(o, dt, hd, c, m, tokens, h, repeats=repeats, peers=peers))
        release_memory()
    echo(format_table(rows, env))
    echo(f"({len(points)} points in {time.time() - t0:.0f} s)", err=True)
    if json_path:
        save_run(json_path, env, rows, benchmark="varlen")
    if plot_path:
        plot(rows, env, plot_path)
    return rows


def replot(json_path: str, plot_path: str | None = None, echo=None) -> list[Row]:
    rows, env, _ = load_run(json_path)
    (echo or print)(format_table(rows, env))
    if plot_path:
        plot(rows, env, plot_path)
    return rows
