"""Decode benchmark: one query token against a long KV cache, cuflash next to its peers.

Bytes model (written once, printed with every table):
    KV bytes read = 2 (K and V) * batch * cache_len * nheads_kv * headdim * 2 bytes (fp16 / bf16)
    bandwidth     = KV bytes / time, in TB/s (10^12 bytes/s), against the GPU's HBM peak
Decode reads the whole cache once per step and does ~1 FLOP per byte: it is memory bound, so the
number that matters is how close the KV stream gets to the HBM ceiling (DESIGN.md, "How speed is judged").

Grid (issue 5): batch 1, 8, 64; cache length 4k..128k; 32 query heads, kv heads 32 (MHA) and 8 (GQA);
head dim 128; bf16; q of one token. Shapes whose caches do not fit the free memory are skipped.

Peers in the same run, on the same cache (zero-copy through DLPack, laid out (b, h, s, d) as
`.transpose(1, 2)` views), when torch is importable: torch SDPA FLASH_ATTENTION (FlashAttention-2)
and CUDNN_ATTENTION; GQA through ``enable_gqa=True``. A backend that refuses a shape is recorded
with its reason in the row. Timing: cuflash.bench.time_ms (CUDA events, interleaved, median).

The prefill-vs-decode table puts one causal prefill of a cache_len-token sequence through
cuflash.attention (TFLOP/s, FLOPs = 2 * L^2 * h * d) next to one decode step against the same
cache length (TB/s), batch 1.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

from .bench import (
    environment, fwd_flops, grouped_bars, host_us, peak_extra_mb, ratio_summary, release_memory, runs_once, time_ms,
    torch_or_none,
    torch_peak_mb,
)

BYTES_MODEL = "KV bytes = 2*b*L*h_kv*d*2 B; TB/s = KV bytes / time"
DEFAULT_BATCHES = (1, 8, 64)
DEFAULT_CACHE_LENS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_KV_HEADS = (32, 8)
DEFAULT_HEAD_DIMS = (128,)
NHEADS = 32


def kv_bytes(batch: int, cache_len: int, nheads_kv: int, head_dim: int, itemsize: int = 2) -> int:
    return 2 * batch * cache_len * nheads_kv * head_dim * itemsize


@dataclass
class DecodeRow:
    dtype: str
    head_dim: int
    batch: int
    cache_len: int
    nheads: int
    nheads_kv: int
    kv_gb: float  # KV bytes read per call, GB (10^9)
    num_splits: int = 0  # cuflash's split count (num_splits=0 heuristic)
    ctas_per_sm: int = 0  # cuflash's split CTAs resident per SM (the plan's choice)
    filled: bool = False  # cuflash's last split is a short tail filling the free CTA slots (plan/decode.py _filled_grid)
    tail_groups: int = 0  # cuflash's groups split num_splits ways, the rest whole (plan/decode.py _tail_split)
    ms: dict = field(default_factory=dict)  # impl -> median ms per call
    tbps: dict = field(default_factory=dict)  # impl -> KV TB/s
    mem_mb: dict = field(default_factory=dict)  # impl -> peak extra device memory of one call (MB)
    notes: dict = field(default_factory=dict)  # impl -> why it did not run / was skipped
    host_us: float = float("nan")  # cuflash host time per call


@dataclass
class PrefillDecodeRow:
    dtype: str
    head_dim: int
    cache_len: int
    nheads: int
    nheads_kv: int
    prefill_ms: float = float("nan")  # causal forward of the whole sequence (batch 1)
    prefill_tflops: float = float("nan")
    decode_ms: float = float("nan")  # one step: 1 query token against cache_len keys (batch 1)
    decode_tbps: float = float("nan")
    notes: dict = field(default_factory=dict)


def _dtype(dtype: str):
    from .checks import numpy_dtype

    return numpy_dtype(dtype)


def _random(shape, dtype: str, rng):
    """A random normal array of `shape`, filled one leading slice at a time (the float32 temporary of
    a 60-GB cache would not fit next to it)."""
    import cupy

    x = cupy.empty(shape, dtype=_dtype(dtype))
    for i in range(shape[0]):
        x[i] = rng.standard_normal(shape[1:], dtype=cupy.float32).astype(x.dtype)
    return x


def _free_bytes() -> int:
    import cupy

    release_memory()
    return cupy.cuda.runtime.memGetInfo()[0]


def _sdpa_peer(torch, backend, tq, tk, tv, scale: float, gqa: bool, causal: bool = False):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kwargs = {"enable_gqa": True} if gqa else {}

    def run():
        with sdpa_kernel(backend):
            return sdpa(tq, tk, tv, is_causal=causal, scale=scale, **kwargs)

    return run


def run_decode_point(dtype: str, head_dim: int, batch: int, cache_len: int, nheads: int, nheads_kv: int, *,
                     repeats: int = 30, peers: bool = True) -> DecodeRow:  # fmt: skip
    import cupy

    from . import kvcache

    rng = cupy.random.default_rng()
    row = DecodeRow(dtype, head_dim, batch, cache_len, nheads, nheads_kv,
                    round(kv_bytes(batch, cache_len, nheads_kv, head_dim) / 1e9, 3))  # fmt: skip
    q = _random((batch, 1, nheads, head_dim), dtype, rng)
    k_cache = _random((batch, cache_len, nheads_kv, head_dim), dtype, rng)
    v_cache = _random((batch, cache_len, nheads_kv, head_dim), dtype, rng)
    scale = 1.0 / math.sqrt(head_dim)
    out = cupy.empty_like(q)

    def ours():
        return kvcache.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_len, softmax_scale=scale, out=out)

    impls = {"cuflash": ours}
    torch = torch_or_none() if peers else None
    if peers and torch is None:
        row.notes["torch"] = "torch with CUDA not importable"
    if torch is not None:
        from torch.nn.attention import SDPBackend

        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k_cache, v_cache))  # (b, h, s, d) views
        gqa = nheads != nheads_kv
        impls["flash"] = _sdpa_peer(torch, SDPBackend.FLASH_ATTENTION, tq, tk, tv, scale, gqa)
        impls["cudnn"] = _sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, scale, gqa)

    runnable = runs_once(impls, row.notes, width=160)
    cupy.cuda.get_current_stream().synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    row.ms = time_ms(runnable, repeats=repeats)
    nbytes = kv_bytes(batch, cache_len, nheads_kv, head_dim)
    for name in runnable:
        row.tbps[name] = nbytes / (row.ms[name] * 1e-3) / 1e12
    if "cuflash" in runnable:
        row.host_us = round(host_us(ours, calls=50), 1)
        row.mem_mb["cuflash"] = round(peak_extra_mb(ours), 1)
        p = _plan_used(q, k_cache.shape[2], cache_len)
        row.num_splits, row.ctas_per_sm, row.filled = p.num_splits, p.ctas_per_sm, p.split_major
        row.tail_groups = p.tail_groups
    for name in runnable:
        if name != "cuflash":
            row.mem_mb[name] = round(torch_peak_mb(torch, runnable[name]), 1)
    return row


def _plan_used(q, nheads_kv: int, cache_len: int):
    """The decode plan cuflash picks for this call (the same plan the call used): split count, CTAs per SM."""
    from . import jit, plan
    from .checks import DTYPE_NAMES

    batch, seqlen_q, nheads, head_dim = q.shape
    dev = q.device.id
    p = plan.plan_decode(
        batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=DTYPE_NAMES[q.dtype], aligned=head_dim % 8 == 0, max_seqlen=-(-cache_len // 64) * 64, num_splits=0,
        num_sms=jit.device_sm_count(dev), arch=jit.device_arch(dev), uniform_lengths=True,
    )  # fmt: skip
    return p


def run_prefill_vs_decode(dtype: str, head_dim: int, cache_len: int, nheads: int, nheads_kv: int, *,
                          repeats: int = 30) -> PrefillDecodeRow:  # fmt: skip
    import cupy

    from . import kvcache
    from .forward import attention

    rng = cupy.random.default_rng()
    row = PrefillDecodeRow(dtype, head_dim, cache_len, nheads, nheads_kv)
    q = _random((1, cache_len, nheads, head_dim), dtype, rng)
    k = _random((1, cache_len, nheads_kv, head_dim), dtype, rng)
    v = _random((1, cache_len, nheads_kv, head_dim), dtype, rng)
    q1 = q[:, -1:]  # the next token's query against the same cache
    out = cupy.empty_like(q)
    out1 = cupy.empty_like(q1)

    def prefill():
        return attention(q, k, v, causal=True, out=out)

    def decode():
        return kvcache.attention_with_kvcache(q1, k, v, cache_seqlens=cache_len, out=out1)

    try:
        # One causal prefill of 128k tokens is ~0.5 s: a few single calls give a stable median.
        row.prefill_ms = time_ms({"prefill": prefill}, repeats=3, warmup_s=0.0, calls=1)["prefill"]
        row.prefill_tflops = fwd_flops(1, cache_len, cache_len, nheads, head_dim, True) / (row.prefill_ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        row.notes["prefill"] = f"{type(exc).__name__}: {exc}"[:160]
    try:
        row.decode_ms = time_ms({"decode": decode}, repeats=repeats)["decode"]
        row.decode_tbps = kv_bytes(1, cache_len, nheads_kv, head_dim) / (row.decode_ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        row.notes["decode"] = f"{type(exc).__name__}: {exc}"[:160]
    return row


def _ratio(a, b) -> str:
    return f"{a / b:8.3f}" if a is not None and b else f"{'-':>8}"


def _splits_cell(r: DecodeRow) -> str:
    if r.tail_groups:  # whole groups, then the last wave's groups in num_splits splits
        return f"1|{r.num_splits}x{r.ctas_per_sm}"
    return f"{r.num_splits - 1}+1x{r.ctas_per_sm}" if r.filled else f"{r.num_splits}x{r.ctas_per_sm}"


def format_decode_table(rows: list[DecodeRow], env: dict) -> str:
    lines = [
        f"GPU {env['gpu']} (sm {env['compute_capability']}, {env['sm_count']} SMs) | cuflash {env['cuflash']} "
        f"| NVRTC {env['nvrtc']} | torch {env.get('torch', '-')} | cuDNN {env.get('cudnn', '-')}",
        f"Decode, 1 query token: KV TB/s ({BYTES_MODEL}); ratio = cuflash / peer (>1: cuflash faster); "
        "ms = cuflash device time; mem = extra MB of one call; host us = cuflash host time per call",
        f"{'dtype':5} {'hd':>3} {'b':>3} {'kv len':>7} {'h':>3} {'h_kv':>4} {'KV GB':>7} | {'cuflash':>7} {'flash':>7} "
        f"{'cudnn':>7} | {'vs flash':>8} {'vs cudnn':>8} | {'ms':>8} {'splits':>6} {'mem':>7} {'host us':>7}",
        "splits: cuflash's key splits per sequence x split CTAs per SM; s+1: s long splits and a short tail in the free slots;"
        " 1|s: whole sequences, those of the last wave in s splits",
    ]

    def f(x):
        return f"{x:7.2f}" if x is not None else f"{'-':>7}"

    for r in rows:
        t = r.tbps
        lines.append(
            f"{r.dtype:5} {r.head_dim:>3} {r.batch:>3} {r.cache_len:>7} {r.nheads:>3} {r.nheads_kv:>4} {r.kv_gb:7.2f} | "
            f"{f(t.get('cuflash'))} {f(t.get('flash'))} {f(t.get('cudnn'))} | "
            f"{_ratio(t.get('cuflash'), t.get('flash'))} {_ratio(t.get('cuflash'), t.get('cudnn'))} | "
            f"{r.ms.get('cuflash', float('nan')):8.3f} {_splits_cell(r):>6} "
            f"{r.mem_mb.get('cuflash', float('nan')):7.1f} "
            f"{r.host_us:7.1f}"
        )
    for peer in ("flash", "cudnn"):
        ratios = [r.tbps["cuflash"] / r.tbps[peer] for r in rows if peer in r.tbps and "cuflash" in r.tbps]
        if ratios:
            lines.append(ratio_summary(f"cuflash / {peer}", ratios, unit="shapes"))
    big = [r for r in rows if r.batch * r.cache_len >= 256 * 1024 and "cuflash" in r.tbps]
    if big:
        lines.append(
            f"cuflash where batch*len >= 256k tokens ({len(big)} shapes): min {min(r.tbps['cuflash'] for r in big):.2f} TB/s"
        )
    for r in rows:
        for impl, why in r.notes.items():
            lines.append(f"note: {impl} at {r.dtype} hd{r.head_dim} b={r.batch} L={r.cache_len} h_kv={r.nheads_kv}: {why}")
    return "\n".join(lines)


def format_prefill_table(rows: list[PrefillDecodeRow]) -> str:
    lines = [
        "Prefill vs decode, batch 1: prefill = cuflash.attention causal over L tokens (TFLOP/s, 2*L^2*h*d FLOPs); "
        "decode = one step, 1 token against L cached keys (KV TB/s)",
        f"{'dtype':5} {'hd':>3} {'L':>7} {'h':>3} {'h_kv':>4} | {'prefill ms':>10} {'TFLOP/s':>8} | "
        f"{'decode us':>9} {'TB/s':>6} | {'prefill/decode':>14}",
    ]
    for r in rows:
        ratio = r.prefill_ms / r.decode_ms if r.decode_ms == r.decode_ms and r.decode_ms > 0 else float("nan")
        lines.append(
            f"{r.dtype:5} {r.head_dim:>3} {r.cache_len:>7} {r.nheads:>3} {r.nheads_kv:>4} | {r.prefill_ms:10.3f} "
            f"{r.prefill_tflops:8.1f} | {r.decode_ms * 1e3:9.1f} {r.decode_tbps:6.2f} | {ratio:14.1f}"
        )
        for what, why in r.notes.items():
            lines.append(f"note: {what} at L={r.cache_len} h_kv={r.nheads_kv}: {why}")
    return "\n".join(lines)


def plot(rows: list[DecodeRow], env: dict, path: str) -> None:
    """Grouped bars in the FA2 paper's style: one panel per (dtype, head dim, kv heads, batch), bars of
    KV TB/s per cache length for each implementation."""
    rows = [r for r in rows if r.tbps]
    keys = sorted({(r.dtype, r.head_dim, r.nheads_kv, r.batch) for r in rows}, key=lambda p: (p[0], p[1], -p[2], p[3]))
    impls = [i for i in ("flash", "cudnn", "cuflash") if any(i in r.tbps for r in rows)]
    panels = []
    for dt, hd, hk, b in keys:
        sel = sorted((r for r in rows if (r.dtype, r.head_dim, r.nheads_kv, r.batch) == (dt, hd, hk, b)),
                     key=lambda r: r.cache_len)  # fmt: skip
        panels.append((f"decode {dt} hd{hd}, batch {b}, {sel[0].nheads}/{hk} heads",
                       [(f"{r.cache_len // 1024}k", r.tbps) for r in sel]))
    grouped_bars(panels, impls, f"Decode, 1 query token, {env['gpu']}, {env.get('date', '')[:10]} ({BYTES_MODEL})",
                 "KV TB/s", path, digits=1)  # fmt: skip


def replot(json_path: str, plot_path: str | None = None, echo=None):
    """The tables of a run saved with --json (and its figure, with ``plot_path``), without a GPU."""
    echo = echo or _echo
    with open(json_path) as f:
        data = json.load(f)
    rows = [DecodeRow(**r) for r in data["decode"]]
    pd_rows = [PrefillDecodeRow(**r) for r in data.get("prefill_vs_decode", [])]
    echo(format_decode_table(rows, data["environment"]))
    if pd_rows:
        echo("")
        echo(format_prefill_table(pd_rows))
    if plot_path:
        plot(rows, data["environment"], plot_path)
    return rows, pd_rows


def _echo(msg: str, err: bool = False) -> None:
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def cli_main(head_dim=None, cache_len=None, batch=None, kv_heads=None, dtype="bf16", repeats=30, peers=True,
             json_path=None, nheads=NHEADS, prefill=True, echo=_echo, plot_path=None):  # fmt: skip
    """Entry point of `cuflash bench --decode` (see cuflash/cli.py for the options). None = the issue's grid."""
    env = environment()
    head_dims = tuple(head_dim or DEFAULT_HEAD_DIMS)
    lens = tuple(cache_len or DEFAULT_CACHE_LENS)
    batches = tuple(batch or DEFAULT_BATCHES)
    kvh = tuple(kv_heads or DEFAULT_KV_HEADS)
    dtypes = ("bf16", "fp16") if dtype == "both" else (dtype,)
    points = [(dt, hd, b, L, h) for dt in dtypes for hd in head_dims for h in kvh for b in batches for L in lens]
    rows: list[DecodeRow] = []
    t0 = time.time()
    for i, (dt, hd, b, L, h) in enumerate(points):
        need = kv_bytes(b, L, h, hd) * 1.05 + (4 << 30)  # the cache, a fill temporary, and headroom
        free = _free_bytes()
        if need > free:
            row = DecodeRow(dt, hd, b, L, nheads, h, round(kv_bytes(b, L, h, hd) / 1e9, 3))
            row.notes["all"] = f"skipped: needs {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
            echo(f"[{i + 1}/{len(points)}] {dt} hd{hd} b={b} L={L} h_kv={h}: {row.notes['all']}", err=True)
            rows.append(row)
            continue
        echo(f"[{i + 1}/{len(points)}] {dt} hd{hd} b={b} L={L} h={nheads} h_kv={h} ({row_gb(b, L, h, hd):.2f} GB of KV)", err=True)
        rows.append(run_decode_point(dt, hd, b, L, nheads, h, repeats=repeats, peers=peers))
        release_memory()
    echo(format_decode_table(rows, env))
    pd_rows: list[PrefillDecodeRow] = []
    if prefill:
        for dt in dtypes:
            for hd in head_dims:
                for h in kvh:
                    for L in lens:
                        echo(f"[prefill vs decode] {dt} hd{hd} L={L} h_kv={h}", err=True)
                        pd_rows.append(run_prefill_vs_decode(dt, hd, L, nheads, h, repeats=repeats))
                        release_memory()
        echo("")
        echo(format_prefill_table(pd_rows))
    echo(f"({len(points)} decode shapes, {len(pd_rows)} prefill/decode pairs in {time.time() - t0:.0f} s)", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"environment": env, "bytes_model": BYTES_MODEL, "decode": [asdict(r) for r in rows],
                 "prefill_vs_decode": [asdict(r) for r in pd_rows]},
                f, indent=1,
            )  # fmt: skip
    if plot_path:
        plot(rows, env, plot_path)
    return rows, pd_rows


def row_gb(batch: int, cache_len: int, nheads_kv: int, head_dim: int) -> float:
    return kv_bytes(batch, cache_len, nheads_kv, head_dim) / 1e9


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `cuflash bench --decode` (python -m cuflash bench --decode)")
