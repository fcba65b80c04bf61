"""The Hopper ablation (issue 30, as in the FlashAttention-3 paper): at every point of the FA2 grid, the
planner's kernels and the same kernels with one technique switched off (or a candidate switched on),
timed in one run with SDPA's cuDNN and FlashAttention-2 backends on the same inputs.

    python3 tools/ablation.py [--op fwd bwd] [--hd 64 128 256] [--seqlen 1024 4096 16384] [--dtype bf16]
                              [--repeats 10] [--json ablation.json]
    python3 tools/ablation.py --from-json docs/results/ablation-h200.json   # the tables of a saved run, no GPU

Per point (batch x seqlen = 16k tokens, heads x head dim = 2048, causal both) the schedules are derived from
the tile the planner takes there (so the short-key points ablate their persistent tile, the long ones the
default tile):

    forward   planned; no intra-warpgroup overlap (overlap=False); ping-pong (2 consumer warpgroups only);
              the persistent grid flipped (off for a persistent tile: the per-tile launch with TMA stores; on
              otherwise, with 16-byte stores, where it fits); a causal persistent tile's walk flipped (the paired
              walk off where planned, on as a candidate where not: Sm90WsTile.paired); the
              look-ahead (a candidate, persistent 128-row tiles); no warp specialization (the cp.async wgmma
              kernel, FWD_SM90_TILES)
    backward  planned; the persistent grid flipped (head dims 64, 128); the wide query blocks (a candidate:
              BWD_SM90_WS_WIDE_ROWS); no warp specialization (the cp.async wgmma kernel, BWD_SM90_TILES)

Every schedule's result is checked against the planned kernel's before it is timed: a schedule whose output
(forward) or any gradient (backward) differs by more than 2e-2 of that tensor's largest magnitude anywhere, or
is not finite, is reported and left out. A peer that refuses a shape is reported too; the JSON is rewritten
after every point, so a run cut short keeps what it measured. Prints a line per point and schedule, then per op a table of the
median (lowest) ratio to cuDNN per head dim and the median ratio to the planned kernels. The schedules
themselves (fwd_schedules, bwd_schedules) are pure planning, tested on the CPU (tests/test_ablation_tool.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys

from cuflash import plan

TOKENS, HIDDEN = 16384, 2048


def _valid_fwd(head_dim: int, causal: bool, tile) -> bool:
    try:
        plan.fwd_sm90_ws_spec(head_dim, "bf16", causal, tile)
    except ValueError:
        return False
    return True


def fwd_schedules(head_dim: int, seqlen: int, causal: bool, sm_count: int, l2_bytes: int | None) -> dict:
    """{schedule name: tile to force, None for the planner's} at a grid point (head_dim a multiple of 64 with a
    warp-specialized forward tile), the variants of the planner's tile that the kernel can build."""
    batch, nheads = max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)
    base = plan.plan_forward(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads,
                             head_dim=head_dim, dtype="bf16", causal=causal, aligned=True, arch="sm_90a",
                             sm_count=sm_count, l2_bytes=l2_bytes).spec.tile  # fmt: skip
    out = {"planned": None}
    candidates = [("no intra-warpgroup overlap", dataclasses.replace(base, overlap=False, look_ahead=False))]
    if base.block_m == 128:
        candidates.append(("ping-pong", dataclasses.replace(base, pingpong=True, look_ahead=False)))
    if base.persistent:  # (per tile, O leaves by TMA stores, as in the planner's per-tile launches)
        candidates.append(("per-tile grid", dataclasses.replace(base, persistent=False, tma_store=True, look_ahead=False)))
        if base.block_m == 128:
            candidates.append(("look-ahead (candidate)", dataclasses.replace(base, look_ahead=True)))
        if causal and base.cluster == 1:  # (the walk's order only matters where tiles differ in cost)
            candidates.append(("strided walk" if base.paired else "paired walk (candidate)",
                               dataclasses.replace(base, paired=not base.paired)))  # fmt: skip
    else:
        short = plan.FWD_SM90_WS_SHORT_TILES.get(plan.head_dim_bucket(head_dim))  # (its walk: the planner's for the bucket)
        candidates.append(("persistent grid", dataclasses.replace(base, persistent=True, tma_store=False,
                                                                  paired=short.paired if short else True)))  # fmt: skip
    for name, tile in candidates:
        if _valid_fwd(head_dim, causal, tile):
            out[name] = tile
    out["no warp specialization"] = plan.FWD_SM90_TILES[plan.head_dim_bucket(head_dim)]
    return out


def bwd_schedules(head_dim: int, causal: bool, sm_count: int) -> dict:
    """{schedule name: main-kernel tile to force, None for the planner's} for a backward grid point."""
    bucket = plan.head_dim_bucket(head_dim)
    base = plan.bwd_sm90_ws_tile(bucket, causal, 0, sm_count)
    out = {"planned": None}
    candidates = []
    if bucket in (64, 128):
        candidates.append(("per-key-block grid" if base.persistent else "persistent grid",
                           dataclasses.replace(base, persistent=not base.persistent)))  # fmt: skip
    if base.block_m != 64:  # the planned wide query blocks against the 64 rows of the other buckets
        candidates.append(("64-row query blocks", dataclasses.replace(base, block_m=64)))
    elif bucket in plan.BWD_SM90_WS_WIDE_ROWS:
        candidates.append((f"{plan.BWD_SM90_WS_WIDE_ROWS[bucket]}-row query blocks (candidate)",
                           dataclasses.replace(base, block_m=plan.BWD_SM90_WS_WIDE_ROWS[bucket])))  # fmt: skip
    for name, tile in candidates:
        try:
            plan.bwd_sm90_ws_spec(bucket, "bf16", causal, tile)
        except ValueError:
            continue
        out[name] = tile
    out["no warp specialization"] = plan.BWD_SM90_TILES[bucket]
    return out


def summarize(rows: list[dict]) -> str:
    """Markdown tables (one per op) from the point rows: per schedule and head dim, the median (lowest) of
    cuflash / cuDNN over the points, and the median of the schedule / the planned kernels."""
    lines = []
    for op in sorted({r["op"] for r in rows}):
        hds = sorted({r["head_dim"] for r in rows if r["op"] == op})
        names = list(dict.fromkeys(n for r in rows if r["op"] == op for n in r["tflops"] if n not in ("cudnn", "flash")))
        lines += [f"\n{op} (cuflash / cuDNN median (lowest) over the points; / the planned kernels)", "",
                  "| schedule | " + " | ".join(f"hd {h}" for h in hds) + " |", "|---|" + "---|" * len(hds)]
        for name in names:
            cells = []
            for h in hds:
                pts = [r for r in rows if r["op"] == op and r["head_dim"] == h and name in r["tflops"] and "cudnn" in r["tflops"]]
                if not pts:
                    cells.append("")
                    continue
                vs_cudnn = [r["tflops"][name] / r["tflops"]["cudnn"] for r in pts]
                vs_plan = [r["tflops"][name] / r["tflops"]["planned"] for r in pts if "planned" in r["tflops"]]
                cell = f"{statistics.median(vs_cudnn):.3f} ({min(vs_cudnn):.2f})"
                if name != "planned" and vs_plan:
                    cell += f"; {statistics.median(vs_plan):.3f}x"
                cells.append(f"{cell} [{len(pts)}]")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _point(op: str, head_dim: int, causal: bool, seqlen: int, dtype: str, repeats: int, sm_count: int,
           l2_bytes: int | None) -> dict:  # fmt: skip
    import cupy

    from cuflash import backward, bench, forward
    from cuflash.checks import numpy_dtype

    batch, nheads = max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)
    dt = numpy_dtype(dtype)
    rng = cupy.random.default_rng(seqlen + head_dim)
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(4))
    scale = 1.0 / math.sqrt(head_dim)
    if op == "bwd":  # (the forward's output and lse, which every backward schedule takes)
        out, lse = forward.run(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    schedules = (fwd_schedules(head_dim, seqlen, causal, sm_count, l2_bytes) if op == "fwd"
                 else bwd_schedules(head_dim, causal, sm_count))  # fmt: skip
    fns, notes = {}, {}
    want = None
    for name, tile in schedules.items():
        if op == "fwd":
            o = cupy.empty_like(q)
            fn = (lambda t, o: lambda: forward.run(q, k, v, causal=causal, softmax_scale=scale, out=o, tile=t))(tile, o)
        else:
            g = [cupy.empty_like(x) for x in (q, k, v)]
            fn = (lambda t, g: lambda: backward.run(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                                    dq=g[0], dk=g[1], dv=g[2], tile=t))(tile, g)  # fmt: skip
        try:
            got = fn()
            got = got if isinstance(got, tuple) else (got,)
            got = [x.astype(cupy.float32) for x in got]
        except Exception as exc:  # (a build the GPU refuses: reported, not timed)
            notes[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if want is None:
            want = got
        else:
            err = max(float(cupy.abs(a - b).max()) / max(float(cupy.abs(b).max()), 1e-30) for a, b in zip(got, want))
            if not err <= 2e-2:  # (NaN fails too)
                notes[name] = f"differs from the planned kernels by {err:.3g} of the largest magnitude: left out"
                continue
        fns[name] = fn
    torch = bench.torch_or_none()
    if torch is not None:
        try:
            peers = bench.sdpa_peers(torch, q, k, v, dout, causal, scale, op)
        except Exception as exc:  # noqa: BLE001 - (the backward's peers run their forward here)
            notes["sdpa"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            peers = {}
        fns.update(bench.runs_once(peers, notes))
    ms = bench.time_ms(fns, repeats=repeats)
    flops = bench.op_flops(op, batch, seqlen, seqlen, nheads, head_dim, causal)
    return {"op": op, "dtype": dtype, "head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
            "nheads": nheads, "ms": ms, "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()},
            "notes": notes, "tiles": {n: repr(t) for n, t in schedules.items()}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="write the point rows and the environment here")
    ap.add_argument("--from-json", help="print the tables of a saved run (--json) and exit; no GPU needed")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            print(summarize(json.load(f)["rows"]))
        return 0
    from cuflash import bench, jit

    if jit.device_arch(0) != "sm_90a":
        sys.exit("the ablation times the Hopper TMA kernels: it needs an sm_90a GPU")
    sm_count, l2_bytes = jit.device_sm_count(0), jit.device_l2_bytes(0)
    env = bench.environment()
    rows = []
    for op in a.op:
        for hd in a.hd:
            for causal in (False, True):
                for s in a.seqlen:
                    row = _point(op, hd, causal, s, a.dtype, a.repeats, sm_count, l2_bytes)
                    bench.release_memory()
                    rows.append(row)
                    if a.json:
                        with open(a.json, "w") as f:
                            json.dump({"benchmark": "ablation", "environment": env, "rows": rows}, f, indent=1)
                    t = row["tflops"]
                    print(f"{op} hd{hd} causal={int(causal)} s={s:5d}: " + "  ".join(f"{n} {v:.0f}" for n, v in t.items())
                          + "".join(f"\n    {n}: {why}" for n, why in row["notes"].items()), flush=True)  # fmt: skip
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
