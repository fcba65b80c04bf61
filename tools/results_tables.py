"""Markdown tables of the saved benchmark runs in docs/results (for README.md and docs/results/README.md),
so the numbers in the docs are read from the result files, never typed.

    python tools/results_tables.py [docs/results] [--dtype bf16]

Prefill (forward, backward, forward+backward; files written by `cuflash bench --op ... --json`): one
row per head dim and causal flag with the TFLOP/s of cuflash, FlashAttention-2 (torch SDPA
FLASH_ATTENTION) and cuDNN at the longest sequence, and the median and lowest ratio cuflash / peer over
all sequence lengths. Decode (`cuflash bench --decode --json`): one row per kv heads and batch with
cuflash's KV TB/s over the cache lengths and the ratios to the peers, then its prefill-against-decode rows
(batch 1: one causal prefill, one decode step). Variants (`cuflash bench --variant
... --json`): one row per variant, operation and head dim with the TFLOP/s at the longest sequence and
the ratios to the variant's peer (FlexAttention; SDPA FlashAttention-2 for dropout) over the lengths,
and the sliding-window tile check. Varlen (`cuflash bench --varlen --json`): one row per operation, head
dim and causal flag with the ratios of the packed uneven batch to the same kernels on an even batch and
to FlexAttention with a document mask over the mean lengths.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

OPS = {"fwd": "Forward", "bwd": "Backward", "fwd+bwd": "Forward + backward"}


def _env_line(env: dict) -> str:
    cudnn = env.get("cudnn")
    cudnn = f"{cudnn // 10000}.{cudnn // 100 % 100}" if isinstance(cudnn, int) else cudnn
    return (f"{env['gpu']} ({env['sm_count']} SMs), {env['date'][:10]}; cuflash {env['cuflash']}, NVRTC {env['nvrtc']}, "
            f"CuPy {env['cupy']}, torch {env.get('torch', '-')}, cuDNN {cudnn}")


def _ratio_cells(ratios):
    return (f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}") if ratios else ("-", "-")


def _ratios(group: list, metric: str, peer: str) -> list[float]:
    """cuflash / peer of ``metric`` ("tflops" or "tbps") at every point of ``group`` the peer ran."""
    return [r[metric]["cuflash"] / r[metric][peer] for r in group if peer in r[metric]]


def prefill_table(op: str, rows: list, env: dict, dtype: str, source: str) -> list[str]:
    out = []
    title = OPS[op]
    sel = [r for r in rows if r.get("op", "fwd") == op and r["dtype"] == dtype and "cuflash" in r["tflops"]]
    if sel:
        longest = max(r["seqlen"] for r in sel)
        out += [f"**{title}** ({dtype}, TFLOP/s at {longest // 1024}k tokens; ratios cuflash / peer over "
                f"{len({r['seqlen'] for r in sel})} lengths {min(r['seqlen'] for r in sel)}-{longest}; `{source}`)", "",
                "| head dim | causal | cuflash | FA2 | cuDNN | vs FA2 median (min) | vs cuDNN median (min) |",
                "|---|---|---|---|---|---|---|"]
        all_f, all_c = [], []
        for hd, causal in sorted({(r["head_dim"], r["causal"]) for r in sel}):
            group = [r for r in sel if (r["head_dim"], r["causal"]) == (hd, causal)]
            top = max(group, key=lambda r: r["seqlen"])["tflops"]
            rf, rc = _ratios(group, "tflops", "flash"), _ratios(group, "tflops", "cudnn")
            all_f += rf
            all_c += rc
            mf, lf = _ratio_cells(rf)
            mc, lc = _ratio_cells(rc)
            out.append(f"| {hd} | {'yes' if causal else 'no'} | {top['cuflash']:.0f} | {top.get('flash', 0):.0f} | "
                       f"{top.get('cudnn', 0):.0f} | {mf} ({lf}) | {mc} ({lc}) |")
        mf, lf = _ratio_cells(all_f)
        mc, lc = _ratio_cells(all_c)
        out += [f"| all | | | | | **{mf}** ({lf}) | **{mc}** ({lc}) |", ""]
    return out


def decode_table(rows: list, env: dict, source: str) -> list[str]:
    sel = [r for r in rows if "cuflash" in r.get("tbps", {})]
    if not sel:
        return []
    lens = sorted({r["cache_len"] for r in sel})
    hd = sorted({r["head_dim"] for r in sel})
    out = [f"**Decode** (one query token, {'/'.join(sorted({r['dtype'] for r in sel}))}, head dim "
           f"{'/'.join(map(str, hd))}, {sel[0]['nheads']} query heads, caches of {lens[0] // 1024}k-{lens[-1] // 1024}k "
           f"tokens; KV bytes read per second; ratios cuflash / peer over the cache lengths; `{source}`)", "",
           "| kv heads | batch | cuflash TB/s | vs FA2 median (min) | vs cuDNN median (min) |", "|---|---|---|---|---|"]
    all_f, all_c = [], []
    for hk, b in sorted({(r["nheads_kv"], r["batch"]) for r in sel}, key=lambda x: (-x[0], x[1])):
        group = [r for r in sel if (r["nheads_kv"], r["batch"]) == (hk, b)]
        t = [r["tbps"]["cuflash"] for r in group]
        rf, rc = _ratios(group, "tbps", "flash"), _ratios(group, "tbps", "cudnn")
        all_f += rf
        all_c += rc
        mf, lf = _ratio_cells(rf)
        mc, lc = _ratio_cells(rc)
        out.append(f"| {hk} | {b} | {min(t):.2f}-{max(t):.2f} | {mf} ({lf}) | {mc} ({lc}) |")
    mf, lf = _ratio_cells(all_f)
    mc, lc = _ratio_cells(all_c)
    n_ahead = sum(x >= 1.0 for x in all_c)
    out += [f"| all | | | **{mf}** ({lf}) | **{mc}** ({lc}); {n_ahead} of {len(all_c)} >= 1 |", "",
            f"Decode measured on {_env_line(env)}.", ""]
    return out


def prefill_decode_table(rows: list) -> list[str]:
    """Prefill against decode at batch 1 (the decode file's ``prefill_vs_decode``): per kv heads and cache
    length, the causal prefill's ms and TFLOP/s and one decode step's us and KV TB/s."""
    if not rows:
        return []
    out = ["| kv heads | cache tokens | prefill ms | prefill TFLOP/s | decode step us | decode TB/s |",
           "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (-r["nheads_kv"], r["cache_len"])):
        out.append(f"| {r['nheads_kv']} | {r['cache_len']} | {r['prefill_ms']:.2f} | {r['prefill_tflops']:.0f} | "
                   f"{r['decode_ms'] * 1e3:.1f} | {r['decode_tbps']:.2f} |")
    return out + [""]


VARIANT_PEERS = {"window": ("flex", "FlexAttention"), "softcap": ("flex", "FlexAttention"),
                 "alibi": ("flex", "FlexAttention"), "dropout": ("flash", "FA2 + dropout")}


def variants_table(data: dict, source: str) -> list[str]:
    rows = [r for r in data["rows"] if "cuflash" in r["tflops"]]
    if not rows:
        return []
    lens = sorted({r["seqlen"] for r in rows})
    out = [f"**Variants** (bf16, causal, TFLOP/s of the visible scores at {lens[-1] // 1024}k tokens; ratios cuflash / "
           f"the variant's peer over {len(lens)} lengths {lens[0]}-{lens[-1]}; `{source}`)", "",
           "| variant | op | head dim | cuflash | peer | vs peer median (min) |", "|---|---|---|---|---|---|"]
    per_variant: dict = {}
    for var in VARIANT_PEERS:
        for op in ("fwd", "bwd"):
            for hd in sorted({r["head_dim"] for r in rows}):
                group = [r for r in rows if r["notes"].get("variant") == var and r["op"] == op and r["head_dim"] == hd]
                if not group:
                    continue
                peer, peer_name = VARIANT_PEERS[var]
                ratios = _ratios(group, "tflops", peer)
                per_variant.setdefault((var, op), []).extend(ratios)
                top = max(group, key=lambda r: r["seqlen"])["tflops"]
                med, low = _ratio_cells(ratios)
                out.append(f"| {var} | {op} | {hd} | {top['cuflash']:.0f} | {top.get(peer, 0):.0f} ({peer_name}) | "
                           f"{med} ({low}) |")
    out.append("")
    out.append("| variant | op | vs peer median (min), all points |")
    out.append("|---|---|---|")
    for (var, op), ratios in per_variant.items():
        med, low = _ratio_cells(ratios)
        out.append(f"| {var} | {op} | **{med}** ({low}) |")
    out.append("")
    w = data.get("window_check") or {}
    if w:
        out.append(f"Sliding window {w['window']} at {w['seqlen'] // 1024}k tokens, head dim {w['head_dim']}: time / "
                   f"(visited tiles / causal tiles x causal time) = {w['fwd']['ratio_to_bound']:.3f} forward, "
                   f"{w['bwd']['ratio_to_bound']:.3f} backward (tile fraction {w['fwd']['tile_fraction']:.3f}).")
        out.append("")
    out += [f"Variants measured on {_env_line(data['environment'])}.", ""]
    return out


def varlen_table(data: dict, source: str) -> list[str]:
    rows = [r for r in data["rows"] if "cuflash" in r["tflops"]]
    if not rows:
        return []
    means = sorted({r["seqlen"] for r in rows})
    out = [f"**Varlen** (bf16, packed batches of 16k tokens, lengths uniform in [1, 2 x mean] for means "
           f"{means[0]}-{means[-1]}; TFLOP/s of the useful scores; ratios over the means; `{source}`)", "",
           "| op | head dim | causal | cuflash TFLOP/s | vs even batch median (min) | vs FlexAttention median (min) |",
           "|---|---|---|---|---|---|"]
    per_op: dict = {}
    for op in ("fwd", "bwd"):
        for hd, causal in sorted({(r["head_dim"], r["causal"]) for r in rows if r["op"] == op}):
            group = [r for r in rows if (r["op"], r["head_dim"], r["causal"]) == (op, hd, causal)]
            eq, fx = _ratios(group, "tflops", "cuflash equal"), _ratios(group, "tflops", "flex")
            per_op.setdefault(op, ([], []))[0].extend(eq)
            per_op[op][1].extend(fx)
            t = [r["tflops"]["cuflash"] for r in group]
            (me, le), (mf, lf) = _ratio_cells(eq), _ratio_cells(fx)
            out.append(f"| {op} | {hd} | {'yes' if causal else 'no'} | {min(t):.0f}-{max(t):.0f} | {me} ({le}) | {mf} ({lf}) |")
    for op, (eq, fx) in per_op.items():
        (me, le), (mf, lf) = _ratio_cells(eq), _ratio_cells(fx)
        out.append(f"| {op} | all | | | **{me}** ({le}) | **{mf}** ({lf}) |")
    out += ["", f"Varlen measured on {_env_line(data['environment'])}.", ""]
    return out


def e2e_table(data: dict, source: str) -> list[str]:
    """The end-to-end GPT run (`cuflash bench --e2e --json`): training tokens/s per model and context
    with the ratios, peak memory; prefill and decode tokens/s."""
    runs, env = data["runs"], data["environment"]
    train = {}
    for r in runs:
        if r["kind"] == "train" and not r["note"]:
            train.setdefault((r["model"], r["context"]), {})[r["impl"]] = r
    lines = [f"**End to end: GPT training** (bf16, 16k tokens per step, {WARMUP_NOTE}; tokens/s, peak GB; "
             f"`{source}`)", "",
             "| model | context | cuflash | FA2 | cuDNN | vs FA2 | vs cuDNN | peak GB cuflash / FA2 / cuDNN | compiled / eager |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ratios = {"flash": [], "cudnn": []}
    for (model, ctx), g in train.items():
        ours = g["cuflash"]
        cells = []
        for peer in ("flash", "cudnn"):
            if peer in g:
                ratios[peer].append(ours["tokens_per_s"] / g[peer]["tokens_per_s"])
                cells.append(f"{ratios[peer][-1]:.3f}")
            else:
                cells.append("n/a")
        comp = g.get("cuflash+compile")
        tps = [f"{g[i]['tokens_per_s']:.0f}" if i in g else "n/a" for i in ("cuflash", "flash", "cudnn")]
        peaks = " / ".join(f"{g[i]['peak_gb']:.1f}" for i in ("cuflash", "flash", "cudnn") if i in g)
        compiled = f"{comp['tokens_per_s'] / ours['tokens_per_s']:.3f}" if comp else ""
        lines.append(f"| {model} | {ctx // 1024}k | {' | '.join(tps)} | {cells[0]} | {cells[1]} | {peaks} | {compiled} |")
    (fm, fl), (cm, cl) = _ratio_cells(ratios["flash"]), _ratio_cells(ratios["cudnn"])
    lines.append(f"| all | | | | | **{fm}** ({fl}) | **{cm}** ({cl}) | | |")
    lines += ["", "**End to end: inference** (prefill of context - 64 tokens, then 64 greedy tokens, eager PyTorch; "
              "tokens/s)", "", "| model | context | batch | prefill cuflash / FA2 / cuDNN | decode cuflash / FA2 / cuDNN |",
              "|---|---|---|---|---|"]  # fmt: skip
    infer = {}
    for r in runs:
        if r["kind"] == "infer":
            infer.setdefault((r["model"], r["context"], r["batch"]), {})[r["impl"]] = r
    for (model, ctx, batch), g in infer.items():
        cell = lambda key: " / ".join("n/a" if g[i]["note"] else f"{g[i][key]:.0f}" for i in ("cuflash", "flash", "cudnn") if i in g)  # noqa: E731
        lines.append(f"| {model} | {ctx // 1024}k | {batch} | {cell('prefill_tokens_per_s')} | {cell('decode_tokens_per_s')} |")
    lines += ["", f"End to end measured on {_env_line(env)}.", "", "![GPT training on the H200](e2e-h200.png)", ""]
    return lines


WARMUP_NOTE = "3 warm-up steps, 5 timed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default="docs/results")
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    runs = [(path, json.loads(path.read_text())) for path in sorted(Path(a.folder).glob("*.json"))]
    lines, envs = [], []
    for op in OPS:  # the newest file holding each operation in this dtype
        have = [(d["environment"]["date"], str(p), d) for p, d in runs
                if "rows" in d and "window_check" not in d and d.get("benchmark") not in ("varlen", "e2e", "ablation")
                and any(r.get("op", "fwd") == op and r.get("dtype") == a.dtype for r in d["rows"])]
        if have:
            _, path, d = max(have, key=lambda x: x[0])
            lines += prefill_table(op, d["rows"], d["environment"], a.dtype, path)
            envs.append(_env_line(d["environment"]))
    for env in dict.fromkeys(envs):  # one line per run the tables come from
        lines += [f"Prefill measured on {env}.", ""]
    for path, d in runs:
        if "decode" in d:
            lines += decode_table(d["decode"], d["environment"], str(path))
            lines += prefill_decode_table(d.get("prefill_vs_decode", []))
    for path, d in runs:
        if "window_check" in d:
            lines += variants_table(d, str(path))
    for path, d in runs:
        if d.get("benchmark") == "varlen":
            lines += varlen_table(d, str(path))
    for path, d in runs:
        if d.get("benchmark") == "e2e":
            lines += e2e_table(d, str(path))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
