"""Variant benchmark: cuflash's sliding window, softcap, ALiBi and dropout side by side with the peer
that runs the same variant on the same GPU, on the FlashAttention-2 paper grid.

Peers (same inputs, zero-copy through DLPack, one run):
  window, softcap, alibi  PyTorch FlexAttention (torch.nn.attention.flex_attention under torch.compile,
                          the variant as a score_mod and a block_mask, so it also skips the blocks a
                          window leaves out)
  dropout                 SDPA's FlashAttention-2 backend with the same dropout_p (FlexAttention has
                          no dropout)
  every variant           SDPA's FlashAttention-2 without the variant, for scale ("flash (plain)")
Variant settings: window = causal sliding window of --window keys (Mistral's), softcap 30 (Gemma 2's
range), ALiBi slopes 2^(-8 h / H) (BLOOM's), dropout_p 0.1.

FLOPs count the scores a query actually sees (4 * headdim per visible (query, key) pair, x2.5 for the
backward), so TFLOP/s are comparable across variants and the ratios are ratios of time. Timing as
cuflash.bench.time_ms (CUDA events, interleaved, median).
"""
from __future__ import annotations

import math
import sys
import time

from .bench import (
    Row, environment, grouped_bars, load_run, ratio_summary, release_memory, runs_once, save_run, time_ms, torch_or_none,
)

VARIANTS = ("window", "softcap", "alibi", "dropout")
SOFTCAP = 30.0
DROPOUT_P = 0.1
FLOP_MODEL = "FLOPs = 4*headdim per visible (query, key) pair x batch x heads; bwd = 2.5x"


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> int:
    """(query, key) pairs a query sees: bottom-right aligned causal and window (left, right; -1 open)."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen_q):
        d = i + seqlen_k - seqlen_q
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, d + right)
        lo = 0 if left < 0 else max(0, d - left)
        total += max(0, hi - lo + 1)
    return total


def alibi_slopes(nheads: int):
    """BLOOM's ALiBi slopes for nheads heads (a power of two): 2^(-8 (h + 1) / nheads)."""
    return [2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)]


def variant_kwargs(variant: str, causal: bool, window: int, nheads: int) -> dict:
    """cuflash's keyword arguments of one variant (alibi_slopes as a list, made a device array later)."""
    if variant == "window":
        return {"window_size": (window, 0)}
    if variant == "softcap":
        return {"softcap": SOFTCAP}
    if variant == "alibi":
        return {"alibi_slopes": alibi_slopes(nheads)}
    if variant == "dropout":
        return {"dropout_p": DROPOUT_P}
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def _flex_peer(torch, variant, causal, window, scale, tq, tk, tv, slopes_t):
    """FlexAttention forward with the variant (score_mod / block_mask), compiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqlen = tq.shape[2]
    # One compiled graph per (shape, variant): more than dynamo's default 8 recompilations of
    # flex_attention in one run, which would otherwise fall back to the unfused eager path.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    compiled = torch.compile(flex_attention, dynamic=False)

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    mask_mod = window_mask if variant == "window" else causal_mask if causal else None
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
    score_mod = None
    if variant == "softcap":
        def score_mod(score, b, h, q_idx, kv_idx):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    elif variant == "alibi":
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes_t[h] * (q_idx - kv_idx).abs()

    def fwd():
        return compiled(tq, tk, tv, score_mod=score_mod, block_mask=block_mask, scale=scale)

    return fwd


def run_point(variant: str, op: str, dtype: str, head_dim: int, causal: bool, seqlen: int, batch: int, nheads: int, *,
              window: int = 1024, repeats: int = 20, peers: bool = True, tile=None) -> Row:  # fmt: skip
    """One point of the variant grid; ``tile`` forces the forward's tile (``forward.run``; tools/tune_fwd.py
    --variant), in the backward too (its forward)."""
    import cupy

    from . import backward as bwd_api
    from . import forward as fwd_api
    from .checks import numpy_dtype

    causal = True if variant == "window" else causal
    dt = numpy_dtype(dtype)
    rng = cupy.random.default_rng()
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(4))
    scale = 1.0 / math.sqrt(head_dim)
    kw = variant_kwargs(variant, causal, window, nheads)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = cupy.asarray(kw["alibi_slopes"], dtype=cupy.float32)
    if "dropout_p" in kw:
        kw["rng_state"] = (1234, 0)
    row = Row(dtype, head_dim, causal, seqlen, batch, nheads, op=op)
    row.notes["variant"] = variant
    pairs = visible_pairs(seqlen, seqlen, causal, kw.get("window_size", (-1, -1)))
    flops = 4.0 * head_dim * pairs * batch * nheads * (1.0 if op == "fwd" else 2.5)
    out = cupy.empty_like(q)
    grads = [cupy.empty_like(x) for x in (q, k, v)]

    def forward():
        return fwd_api.run(q, k, v, causal=causal, softmax_scale=scale, return_lse=op != "fwd", out=out, tile=tile,
                           **kw)  # fmt: skip

    if op == "fwd":
        impls = {"cuflash": forward}
    else:
        o, lse = forward()[:2]

        def backward():
            return bwd_api.run(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale, dq=grads[0], dk=grads[1],
                               dv=grads[2], **kw)  # fmt: skip

        impls = {"cuflash": backward}
    torch = torch_or_none() if peers else None
    if peers and torch is None:
        row.notes["torch"] = "torch with CUDA not importable"
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, dout))
        if op != "fwd":
            tq, tk, tv = (x.requires_grad_() for x in (tq, tk, tv))
        slopes_t = torch.from_dlpack(kw["alibi_slopes"]) if "alibi_slopes" in kw else None

        def with_grad(fwd):
            if op == "fwd":
                return fwd
            saved = fwd()
            return lambda: torch.autograd.grad(saved, (tq, tk, tv), tdo, retain_graph=True)

        def sdpa_fn(dropout_p):
            def fwd():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(tq, tk, tv, is_causal=causal, scale=scale, dropout_p=dropout_p)
            return fwd

        if variant == "dropout":
            impls["flash"] = with_grad(sdpa_fn(DROPOUT_P))
        else:
            try:
                impls["flex"] = with_grad(_flex_peer(torch, variant, causal, window, scale, tq, tk, tv, slopes_t))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is noted, the rest timed
                row.notes["flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        impls["flash (plain)"] = with_grad(sdpa_fn(0.0))
    runnable = runs_once(impls, row.notes)
    row.ms = time_ms(runnable, repeats=repeats)
    for name in runnable:
        row.tflops[name] = flops / (row.ms[name] * 1e-3) / 1e12
    return row


def peer_of(variant: str) -> str:
    return "flash" if variant == "dropout" else "flex"


def format_table(rows: list[Row], env: dict) -> str:
    lines = [
        f"GPU {env['gpu']} | cuflash {env['cuflash']} | NVRTC {env['nvrtc']} | torch {env.get('torch', '-')}",
        f"TFLOP/s ({FLOP_MODEL}); ratio = cuflash / peer (flex: FlexAttention with the variant; flash: SDPA "
        "FlashAttention-2 with the same dropout; flash (plain): SDPA FlashAttention-2 without the variant)",
        f"{'variant':8} {'op':4} {'dtype':5} {'hd':>3} {'causal':6} {'seqlen':>6} | {'cuflash':>7} {'peer':>7} "
        f"{'plain':>7} | {'vs peer':>7} {'vs plain':>8} | {'ms':>8}",
    ]
    for r in rows:
        var = r.notes.get("variant", "?")
        t = r.tflops
        peer = t.get(peer_of(var))
        plain = t.get("flash (plain)")
        ours = t.get("cuflash")
        ratio = f"{ours / peer:7.3f}" if ours and peer else f"{'-':>7}"
        ratio_plain = f"{ours / plain:8.3f}" if ours and plain else f"{'-':>8}"
        fmt = lambda x: f"{x:7.1f}" if x else f"{'-':>7}"  # noqa: E731
        lines.append(f"{var:8} {r.op:4} {r.dtype:5} {r.head_dim:>3} {str(r.causal):6} {r.seqlen:>6} | {fmt(ours)} "
                     f"{fmt(peer)} {fmt(plain)} | {ratio} {ratio_plain} | {r.ms.get('cuflash', float('nan')):8.3f}")
    for var in dict.fromkeys(r.notes.get("variant") for r in rows):
        for op in dict.fromkeys(r.op for r in rows):
            ratios = [r.tflops["cuflash"] / r.tflops[peer_of(var)] for r in rows
                      if r.notes.get("variant") == var and r.op == op and peer_of(var) in r.tflops
                      and "cuflash" in r.tflops]  # fmt: skip
            if ratios:
                lines.append(ratio_summary(f"{var} {op}: cuflash / {peer_of(var)}", ratios))
    for r in rows:
        for impl, why in r.notes.items():
            if impl != "variant":
                lines.append(f"note: {impl} at {r.notes.get('variant')} {r.op} hd{r.head_dim} s={r.seqlen}: {why}")
    return "\n".join(lines)


def plot(rows: list[Row], env: dict, path: str) -> None:
    """Grouped bars per (variant, op, head dim): cuflash and the variant's peer (the table also has SDPA
    without the variant, whose bars would read as the variant's FLOPs over a different computation)."""
    keys = list(dict.fromkeys((r.notes.get("variant"), r.op, r.head_dim) for r in rows))
    impls = ["flex", "flash", "cuflash"]
    panels = []
    for var, op, hd in keys:
        sel = sorted((r for r in rows if (r.notes.get("variant"), r.op, r.head_dim) == (var, op, hd)),
                     key=lambda r: r.seqlen)  # fmt: skip
        points = [(f"{r.seqlen // 1024}k" if r.seqlen >= 1024 else str(r.seqlen), r.tflops) for r in sel]
        panels.append((f"{var} {op} hd{hd}", points))
    impls = [i for i in impls if any(i in r.tflops for r in rows)]
    grouped_bars(panels, impls, f"Attention variants, {env['gpu']}, {env.get('date', '')[:10]}", "TFLOP/s", path)


def window_tile_check(head_dim: int = 128, seqlen: int = 16384, window: int = 4096, dtype: str = "bf16",
                      repeats: int = 20) -> dict:  # fmt: skip
    """The sliding-window bar: time of a causal window of ``window`` keys at ``seqlen`` tokens against
    (visited K/V tiles / all causal tiles) x the full causal time, forward and backward."""
    import cupy

    from . import backward as bwd_api
    from . import forward as fwd_api
    from . import jit, plan
    from .checks import numpy_dtype

    dt = numpy_dtype(dtype)
    rng = cupy.random.default_rng()
    batch, nheads = max(1, 16384 // seqlen), max(1, 2048 // head_dim)
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(4))
    arch = jit.device_arch(cupy.cuda.Device().id)
    result = {"head_dim": head_dim, "seqlen": seqlen, "window": window}
    for op in ("fwd", "bwd"):
        times = {}
        for name, kw in (("causal", {}), ("window", {"window_size": (window, 0)})):
            o, lse = fwd_api.attention(q, k, v, causal=True, return_lse=True, **kw)
            if op == "fwd":
                fn = lambda kw=kw: fwd_api.attention(q, k, v, causal=True, **kw)  # noqa: E731
            else:
                fn = lambda kw=kw, o=o, lse=lse: bwd_api.attention_backward(dout, q, k, v, o, lse, causal=True, **kw)  # noqa: E731
            times[name] = time_ms({name: fn}, repeats=repeats)[name]
        if op == "fwd":
            launch = plan.plan_forward(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads,
                                       head_dim=head_dim, dtype=dtype, causal=True, aligned=True, arch=arch)  # fmt: skip
            bm, bn = launch.spec.tile.block_m, launch.spec.tile.block_n
        else:
            bp = plan.plan_backward(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads,
                                    head_dim=head_dim, dtype=dtype, causal=True, aligned=True, arch=arch)  # fmt: skip
            bm, bn = bp.main.spec.tile.block_m, bp.main.spec.tile.block_n
        full = window_tiles = 0
        for m in range(-(-seqlen // bm)):  # (query block, key block) tiles a causal / windowed pass visits
            last = min(seqlen, (m + 1) * bm) - 1
            hi = last // bn + 1
            lo = max(0, m * bm - window) // bn
            full += hi
            window_tiles += hi - lo
        frac = window_tiles / full
        result[op] = {"causal_ms": times["causal"], "window_ms": times["window"], "tile_fraction": frac,
                      "ratio_to_bound": times["window"] / (frac * times["causal"])}  # fmt: skip
    return result


def cli_main(variants, head_dim, seqlen, tokens, hidden, dtype, causal, op, repeats, peers, window=1024,
             json_path=None, plot_path=None, window_check=True, echo=None):  # fmt: skip
    echo = echo or (lambda msg, err=False: print(msg, file=sys.stderr if err else sys.stdout, flush=True))
    env = environment()
    dtypes = ("bf16", "fp16") if dtype == "both" else (dtype,)
    causals = {"both": (False, True), "causal": (True,), "no-causal": (False,)}[causal]
    ops = ("fwd", "bwd") if op == "all" else (op,)
    points = [(var, o, dt, hd, c, s, max(1, tokens // s), max(1, hidden // hd)) for var in variants for o in ops
              for dt in dtypes for hd in head_dim for c in (causals if var != "window" else (True,)) for s in seqlen]
    rows = []
    t0 = time.time()
    for i, (var, o, dt, hd, c, s, b, h) in enumerate(points):
        echo(f"[{i + 1}/{len(points)}] {var} {o} {dt} hd{hd} causal={c} seqlen={s} batch={b} heads={h}", err=True)
        rows.append(run_point(var, o, dt, hd, c, s, b, h, window=window, repeats=repeats, peers=peers))
        release_memory()
    echo(format_table(rows, env))
    extra = {}
    if window_check and "window" in variants:
        extra = window_tile_check(repeats=repeats)
        for o in ("fwd", "bwd"):
            r = extra[o]
            echo(f"window {extra['window']} at {extra['seqlen']} tokens, hd{extra['head_dim']} {o}: {r['window_ms']:.3f} ms "
                 f"vs causal {r['causal_ms']:.3f} ms x tile fraction {r['tile_fraction']:.3f} = "
                 f"{r['tile_fraction'] * r['causal_ms']:.3f} ms: ratio {r['ratio_to_bound']:.3f} (bar <= 1.15)")
    echo(f"({len(points)} points in {time.time() - t0:.0f} s)", err=True)
    if json_path:
        save_run(json_path, env, rows, window_check=extra)
    if plot_path:
        plot(rows, env, plot_path)
    return rows


def replot(json_path: str, plot_path: str | None = None, echo=None) -> list[Row]:
    rows, env, _ = load_run(json_path)
    (echo or print)(format_table(rows, env))
    if plot_path:
        plot(rows, env, plot_path)
    return rows
