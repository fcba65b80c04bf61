"""Prefill benchmark: cuflash side by side with its peers on the FlashAttention-2 paper grid.

FLOP model (written once, printed with every table):
    forward  = 4 * batch * seqlen_q * seqlen_k * nheads * headdim     (two matmuls, 2 FLOPs/MAC)
    backward = 2.5 x forward (five matmuls against two, as in the FA2 paper); fwd+bwd = 3.5 x forward
    causal   = half of that (square case: only the lower triangle is computed)
Ops: "fwd" times the forward; "bwd" the backward alone (outputs, lse and dout computed beforehand);
"fwd+bwd" one forward followed by its backward.
Grid (DESIGN.md): batch * seqlen = tokens (16384), nheads * headdim = hidden (2048),
headdim 64/128/256, causal and not, seqlen 512..16384.

Peers in the same run, on the same inputs (zero-copy through DLPack), when torch is importable:
torch SDPA with the FLASH_ATTENTION backend (FlashAttention-2 compiled into PyTorch) and with
CUDNN_ATTENTION (cuDNN's fused attention), plus a naive CuPy attention (materializes S) where
its score matrix fits in a few GB.

Timing: CUDA events around batches of back-to-back calls on the default stream (host overhead of a
call overlaps the previous kernel), the implementations interleaved after a warm-up (in the listed
order, reversed every other round; each batch after one untimed call of the same implementation),
median over `repeats` batches. The host time per call is reported separately.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

FLOP_MODEL = "fwd FLOPs = 4*b*s_q*s_k*h*d, x0.5 causal; bwd = 2.5x fwd; fwd+bwd = 3.5x fwd"

OPS = ("fwd", "bwd", "fwd+bwd")
_OP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def fwd_flops(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, head_dim: int, causal: bool) -> float:
    f = 4.0 * batch * seqlen_q * seqlen_k * nheads * head_dim
    return f / 2 if causal else f


def op_flops(op: str, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, head_dim: int, causal: bool) -> float:
    return _OP_FACTOR[op] * fwd_flops(batch, seqlen_q, seqlen_k, nheads, head_dim, causal)


@dataclass
class Row:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    op: str = "fwd"  # "fwd" | "bwd" | "fwd+bwd"
    ms: dict = field(default_factory=dict)  # impl -> median ms
    tflops: dict = field(default_factory=dict)  # impl -> TFLOP/s
    mem_mb: dict = field(default_factory=dict)  # impl -> peak device memory one call adds (MB)
    notes: dict = field(default_factory=dict)  # impl -> why it did not run
    host_us: float = float("nan")  # cuflash host time per call (checks, planning, launch)


def runs_once(impls: dict, notes: dict, width: int = 120) -> dict:
    """The implementations of ``impls`` whose first call succeeds; for each one that raises (a peer
    without a kernel for this shape), why goes to ``notes[name]`` (the message's first line, at most
    ``width`` characters), and the rest are timed."""
    runnable = {}
    for name, fn in impls.items():
        try:
            fn()
            runnable[name] = fn
        except Exception as exc:  # noqa: BLE001 - any refusal is a result to report
            notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:width] if str(exc) else ''}"
    return runnable


def ratio_summary(what: str, ratios: list[float], unit: str = "points") -> str:
    """One summary line of a table: ``what`` over n points: median, min, max of the ratios."""
    return (f"{what} over {len(ratios)} {unit}: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
            f"max {max(ratios):.3f}")  # fmt: skip


def time_ms(fns: dict, repeats: int = 30, warmup_s: float = 0.3, calls: int = 5, primer: bool = True) -> dict:
    """Median device milliseconds per call of each fn(), by CUDA events on the current stream.

    Each sample is ``calls`` back-to-back calls between two events, divided by ``calls``: the host
    work of one call (argument checks, launch) overlaps the kernel of the previous one, as in a
    model's forward pass, and only the first call's launch latency remains in the sample. The
    functions are timed in rounds (one sample of each per round) after a warm-up of at least
    ``warmup_s`` seconds, so clock ramp-up and drift hit every implementation alike.

    What runs just before a sample changes it: on the H200 a decode kernel timed right after another
    library's calls measured 1.7% slower than the same kernel timed after its own
    (an A/A experiment, docs/history/decode.md). So no function keeps a fixed place: every other round runs in reverse
    order, and with ``primer`` (the default; it only matters for more than one function) each sample
    follows one untimed, synchronized call of the same function.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()
    t_end = time.perf_counter() + warmup_s
    while True:
        for fn in fns.values():
            fn()
        stream.synchronize()
        if time.perf_counter() >= t_end:
            break
    primer = primer and len(fns) > 1
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            if primer:
                fn()
                stream.synchronize()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(calls):
                fn()
            end.record(stream)
            end.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, end) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call (Python + launch), measured while the GPU queue absorbs them."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.get_current_stream().synchronize()
    return (t1 - t0) / calls * 1e6


def torch_or_none():
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return torch
    except ImportError:
        return None


def environment() -> dict:
    import cupy

    from . import __version__, jit

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    env = {
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "compute_capability": dev.compute_capability,
        "sm_count": props["multiProcessorCount"],
        "cuflash": __version__,
        "cupy": cupy.__version__,
        "nvrtc": ".".join(map(str, jit.nvrtc_version())),
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
        "flop_model": FLOP_MODEL,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    torch = torch_or_none()
    if torch is not None:
        env["torch"] = torch.__version__
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def _naive(q, k, v, causal: bool, scale: float):
    """Plain CuPy attention in float32 that materializes the (b, h, s_q, s_k) scores."""
    import cupy

    qf = q.transpose(0, 2, 1, 3).astype(cupy.float32)
    kf = k.transpose(0, 2, 3, 1).astype(cupy.float32)
    vf = v.transpose(0, 2, 1, 3).astype(cupy.float32)
    s = cupy.matmul(qf, kf) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = cupy.arange(sk)[None, :] > (cupy.arange(sq)[:, None] + sk - sq)
        s = cupy.where(mask, -cupy.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cupy.matmul(p, vf).astype(q.dtype).transpose(0, 2, 1, 3)


def peak_extra_mb(fn) -> float:
    """Peak device memory one call takes from CuPy's pool beyond what was in use before (MB).

    The pool's cached free blocks are released first, so every byte the call allocates (and frees
    again) grows the pool: its growth is the call's high-water mark.
    """
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.cuda.get_current_stream().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    res = fn()
    cupy.cuda.get_current_stream().synchronize()
    after = pool.total_bytes()
    del res
    return (after - before) / 2**20


def torch_peak_mb(torch, fn) -> float:
    """Peak device memory one call takes from torch's caching allocator beyond what was in use (MB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_point(dtype: str, head_dim: int, causal: bool, seqlen: int, batch: int, nheads: int, *,
              repeats: int = 30, peers: bool = True, naive_max_gb: float = 4.0, tile=None, op: str = "fwd",
              bwd_tile=None) -> Row:  # fmt: skip
    import cupy

    from . import backward as bwd_api
    from . import forward as fwd_api
    from .checks import numpy_dtype

    dt = numpy_dtype(dtype)
    rng = cupy.random.default_rng()
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    row = Row(dtype, head_dim, causal, seqlen, batch, nheads, op=op)
    flops = op_flops(op, batch, seqlen, seqlen, nheads, head_dim, causal)
    out = cupy.empty_like(q)
    dout = rng.standard_normal(shape, dtype=cupy.float32).astype(dt)
    grads = [cupy.empty_like(x) for x in (q, k, v)]

    def forward():
        return fwd_api.run(q, k, v, causal=causal, softmax_scale=scale, return_lse=op != "fwd", out=out, tile=tile)

    def backward(o, lse):
        return bwd_api.run(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale, deterministic=False,
                         dq=grads[0], dk=grads[1], dv=grads[2], tile=bwd_tile)  # fmt: skip

    if op == "fwd":
        ours = forward
    elif op == "bwd":
        saved = forward()
        ours = lambda: backward(*saved)  # noqa: E731
    else:
        ours = lambda: backward(*forward())  # noqa: E731
    impls = {"cuflash": ours}
    torch = torch_or_none() if peers else None
    if peers and torch is None:
        row.notes["torch"] = "torch with CUDA not importable"
    if torch is not None:
        impls.update(sdpa_peers(torch, q, k, v, dout, causal, scale, op))
    if peers and op == "fwd" and batch * nheads * seqlen * seqlen * 4 <= naive_max_gb * 2**30:
        impls["naive"] = lambda: _naive(q, k, v, causal, scale)

    runnable = runs_once(impls, row.notes)
    # The fused kernels are timed together; the naive one apart (its 4-GB passes would sit between them).
    naive = {k: v for k, v in runnable.items() if k == "naive"}
    fused = {k: v for k, v in runnable.items() if k != "naive"}
    row.ms = time_ms(fused, repeats=repeats)
    if naive:
        row.ms.update(time_ms(naive, repeats=max(3, repeats // 6), warmup_s=0.0, calls=1))
    if "cuflash" in runnable:
        row.host_us = round(host_us(runnable["cuflash"], calls=50), 1)
    for name, fn in runnable.items():
        row.tflops[name] = flops / (row.ms[name] * 1e-3) / 1e12
        if name in ("cuflash", "naive"):
            row.mem_mb[name] = round(peak_extra_mb(fn), 1)
        else:
            row.mem_mb[name] = round(torch_peak_mb(torch, fn), 1)
    return row


def sdpa_peers(torch, q, k, v, dout, causal: bool, scale: float, op: str) -> dict:
    """{"flash": fn, "cudnn": fn}: torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends doing ``op`` on
    (b, h, s, d) views of the same CuPy arrays (zero-copy through DLPack)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d) views
    tdo = torch.from_dlpack(dout).transpose(1, 2)
    if op != "fwd":
        tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))

    def peer(backend):
        def fwd():
            with sdpa_kernel(backend):
                return sdpa(tq, tk, tv, is_causal=causal, scale=scale)

        if op == "fwd":
            return fwd
        if op == "fwd+bwd":
            return lambda: torch.autograd.grad(fwd(), (tq, tk, tv), tdo)
        saved = fwd()  # the backend's backward runs on the graph its forward recorded
        return lambda: torch.autograd.grad(saved, (tq, tk, tv), tdo, retain_graph=True)

    return {"flash": peer(SDPBackend.FLASH_ATTENTION), "cudnn": peer(SDPBackend.CUDNN_ATTENTION)}


def release_memory() -> None:
    """Give the previous point's buffers back so peak memory stays that of one point."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    torch = torch_or_none()
    if torch is not None:
        torch.cuda.empty_cache()


def grid(head_dims, seqlens, tokens: int, hidden: int, dtypes, causals, ops=("fwd",)):
    for op in ops:
        for dtype in dtypes:
            for hd in head_dims:
                for causal in causals:
                    for s in seqlens:
                        yield op, dtype, hd, causal, s, max(1, tokens // s), max(1, hidden // hd)


def format_table(rows: list[Row], env: dict) -> str:
    lines = [
        f"GPU {env['gpu']} (sm {env['compute_capability']}, {env['sm_count']} SMs) | cuflash {env['cuflash']} "
        f"| NVRTC {env['nvrtc']} | torch {env.get('torch', '-')} | cuDNN {env.get('cudnn', '-')}",
        f"TFLOP/s, {FLOP_MODEL}; ratio = cuflash / peer (>1: cuflash faster); ms = cuflash device time; "
        "mem = peak MB one call adds; host us = cuflash host time per call",
        f"{'op':7} {'dtype':5} {'hd':>3} {'causal':6} {'seqlen':>6} {'b':>3} {'h':>3} | {'cuflash':>7} {'flash':>7} "
        f"{'cudnn':>7} {'naive':>7} | {'vs flash':>8} {'vs cudnn':>8} | {'ms':>8} {'mem':>7} {'host us':>7}",
    ]

    def f(x):
        return f"{x:7.1f}" if x is not None else f"{'-':>7}"

    def _ratio(x):
        return f"{x:8.3f}" if x is not None else f"{'-':>8}"

    for r in rows:
        t = r.tflops
        vf = t["cuflash"] / t["flash"] if "cuflash" in t and "flash" in t else None
        vc = t["cuflash"] / t["cudnn"] if "cuflash" in t and "cudnn" in t else None
        lines.append(
            f"{r.op:7} {r.dtype:5} {r.head_dim:>3} {str(r.causal):6} {r.seqlen:>6} {r.batch:>3} {r.nheads:>3} | "
            f"{f(t.get('cuflash'))} {f(t.get('flash'))} {f(t.get('cudnn'))} {f(t.get('naive'))} | "
            f"{_ratio(vf)} {_ratio(vc)} | "
            f"{r.ms.get('cuflash', float('nan')):8.3f} {r.mem_mb.get('cuflash', float('nan')):7.1f} {r.host_us:7.1f}"
        )
    for op in dict.fromkeys(r.op for r in rows):
        for peer in ("flash", "cudnn"):
            ratios = [r.tflops["cuflash"] / r.tflops[peer] for r in rows
                      if r.op == op and peer in r.tflops and "cuflash" in r.tflops]  # fmt: skip
            if ratios:
                lines.append(ratio_summary(f"{op}: cuflash / {peer}", ratios))
    for r in rows:
        for impl, why in r.notes.items():
            lines.append(f"note: {impl} at {r.op} {r.dtype} hd{r.head_dim} causal={r.causal} s={r.seqlen}: {why}")
    return "\n".join(lines)


#: One color per implementation in every figure.
IMPL_COLORS = {"naive": "tab:gray", "flash": "tab:orange", "cudnn": "tab:green", "flex": "tab:purple", "cuflash": "tab:red"}


def grouped_bars(panels: list, impls: list, title: str, ylabel: str, path: str, digits: int = 0) -> None:
    """A figure in the FA2 paper's style, written to ``path``: one panel per (panel title, [(x label,
    {impl: value})]), a bar per implementation at each x, its value printed on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = max(1, min(3, len(panels)))
    nrow = max(1, math.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.5 * ncol, 3.6 * nrow), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, (panel_title, points) in zip(axes.flat, panels):
        for i, impl in enumerate(impls):
            xs = [j + i * width for j in range(len(points))]
            ys = [values.get(impl, 0.0) for _, values in points]
            ax.bar(xs, ys, width, label=impl, color=IMPL_COLORS.get(impl))
            for x, y in zip(xs, ys):
                if y:
                    ax.text(x, y, f"{y:.{digits}f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
        ax.set_xticklabels([label for label, _ in points])
        ax.set_title(panel_title, fontsize=9)
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title above the panels
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot(rows: list[Row], env: dict, path: str) -> None:
    """FA2-paper-style grouped bars: one panel per (op, dtype, head dim, causal), bars per seqlen."""
    keys = sorted({(r.op, r.dtype, r.head_dim, r.causal) for r in rows}, key=lambda p: (OPS.index(p[0]), *p[1:]))
    impls = [i for i in ("naive", "flash", "cudnn", "cuflash") if any(i in r.tflops for r in rows)]
    panels = []
    for op, dt, hd, causal in keys:
        sel = sorted((r for r in rows if (r.op, r.dtype, r.head_dim, r.causal) == (op, dt, hd, causal)),
                     key=lambda r: r.seqlen)  # fmt: skip
        points = [(f"{r.seqlen // 1024}k" if r.seqlen >= 1024 else str(r.seqlen), r.tflops) for r in sel]
        panels.append((f"{op} {dt} hd{hd} {'causal' if causal else 'non-causal'}", points))
    grouped_bars(panels, impls, f"Attention, {env['gpu']}, {env.get('date', '')[:10]} ({FLOP_MODEL})", "TFLOP/s",
                 path)  # fmt: skip


def save_run(json_path: str, env: dict, rows: list[Row], **extra) -> None:
    """Write a run as --json saves it: {**extra, "environment": env, "rows": [...]} (extra: e.g. the
    benchmark's name or the variants' window check)."""
    with open(json_path, "w") as f:
        json.dump({**extra, "environment": env, "rows": [asdict(r) for r in rows]}, f, indent=1)


def load_run(json_path: str) -> tuple[list[Row], dict, dict]:
    """(rows, environment, the whole file) of a run saved by save_run."""
    with open(json_path) as f:
        data = json.load(f)
    return [Row(**r) for r in data["rows"]], data["environment"], data


def replot(json_path: str, plot_path: str | None = None, echo=None, ops=None) -> list[Row]:
    """The table of a run saved with --json (and its figure, with ``plot_path``), without a GPU.
    ops: only these operations ("fwd", "bwd", "fwd+bwd"); None: all in the file."""
    echo = echo or _echo
    rows, _, data = load_run(json_path)
    if ops is not None:
        rows = [r for r in rows if r.op in ops]
        if not rows:
            raise ValueError(f"no {'/'.join(ops)} rows in the file")
    echo(format_table(rows, data["environment"]))
    if plot_path:
        plot(rows, data["environment"], plot_path)
    return rows


def _echo(msg: str, err: bool = False) -> None:
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def cli_main(head_dim, seqlen, tokens, hidden, dtype, causal, repeats, peers, json_path=None, plot_path=None,
             echo=_echo, op="fwd"):  # fmt: skip
    """Entry point of `cuflash bench` (see cuflash/cli.py for the options)."""
    env = environment()
    dtypes = ("bf16", "fp16") if dtype == "both" else (dtype,)
    causals = {"both": (False, True), "causal": (True,), "no-causal": (False,)}[causal]
    ops = OPS if op == "all" else (op,)
    points = list(grid(head_dim, seqlen, tokens, hidden, dtypes, causals, ops))
    rows = []
    t0 = time.time()
    for i, (o, dt, hd, c, s, b, h) in enumerate(points):
        echo(f"[{i + 1}/{len(points)}] {o} {dt} hd{hd} causal={c} seqlen={s} batch={b} heads={h}", err=True)
        rows.append(run_point(dt, hd, c, s, b, h, repeats=repeats, peers=peers, op=o))
        release_memory()
    table = format_table(rows, env)
    echo(table)
    echo(f"({len(points)} points in {time.time() - t0:.0f} s)", err=True)
    if json_path:
        save_run(json_path, env, rows)
    if plot_path:
        plot(rows, env, plot_path)
    return rows


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `cuflash bench` (python -m cuflash bench)")
