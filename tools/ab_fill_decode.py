"""Which decode grid is faster where the filled grid could apply: the same kernel under several
plans, next to cuDNN, in one run (bf16, head dim 128, 32 query heads, one query token, full caches
of one length, num_splits=0).

    python tools/ab_fill_decode.py [--shapes 8,32768,32 ...] [--repeats 20] [--all]
                                   [--modes NAME:CONSTANT=VALUE,... ...]
A mode is a name and cuflash/plan.py constants set while the mode's calls are planned (the value
"none" for _filled_grid: never filled; "plain" for decode_num_splits: the split count chosen as if
no grid were filled, then filled where it can be, or a count N >= 1: N splits wherever the heuristic
would choose; 0 or 1 for a bool constant); the default modes are
  equal   _filled_grid=none,DECODE_TAIL_SPLIT_MIN_GAIN=inf: equal splits, whole groups never split
          by the tail-split grid (what ragged lengths get);
  plan    this tree's plan: filled wherever the long splits' last wave leaves slots empty, tail-split
          where whole groups leave it partly empty.
e.g. --modes equal:_filled_grid=none plan: plan1:DECODE_FILL_MIN_UNSPLIT_TILES=1
A shape is batch,cache_len,kv_heads; the default is every `cuflash bench --decode` shape where two of
the modes plan differently (grids or kernel variants; --all: every shape). Per shape: device microseconds per call (CUDA
events, interleaved and primed samples, cuflash.bench.time_ms) of each mode and of torch SDPA's
CUDNN_ATTENTION, each mode's grid (splits x tiles per long split where filled, @ CTAs per SM), and
cuDNN / mode speed ratios (>1: the mode is faster); last, per mode the median of its time over the
equal grid's and of the cuDNN ratio. The modes' outputs are checked against each other.
"""
import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache, plan  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402

REAL_NUM_SPLITS = plan.decode_num_splits
DEFAULT_MODES = ["equal:_filled_grid=none,DECODE_TAIL_SPLIT_MIN_GAIN=inf", "plan:"]


def _parse_mode(text):
    name, _, assigns = text.partition(":")
    consts = {}
    for item in filter(None, assigns.split(",")):
        key, _, value = item.partition("=")
        if not hasattr(plan, key):
            raise SystemExit(f"cuflash.plan has no constant {key!r}")
        if (key, value) == ("_filled_grid", "none"):
            consts[key] = lambda *args: None
        elif (key, value) == ("decode_num_splits", "plain"):  # the split count chosen without the filled grid
            consts[key] = lambda filled_tiles=None, **kw: REAL_NUM_SPLITS(**kw)
        elif key == "decode_num_splits" and value.isdigit() and int(value) >= 1:  # that count wherever num_splits=0
            consts[key] = lambda n=int(value), **kw: min(n, plan.MAX_DECODE_SPLITS, kw["n_tiles"])
        elif key in ("_filled_grid", "decode_num_splits"):
            raise SystemExit("_filled_grid takes only the value none, decode_num_splits plain or a count >= 1")
        elif isinstance(getattr(plan, key), bool):  # bool("0") would be True
            if value not in ("0", "1"):
                raise SystemExit(f"{key} takes 0 or 1, got {value!r}")
            consts[key] = value == "1"
        else:
            consts[key] = float(value) if value in ("inf", "-inf") else type(getattr(plan, key))(value)
    return name, consts


def _with_constants(consts, fn, *args, **kw):
    saved = {k: getattr(plan, k) for k in consts}
    for k, v in consts.items():
        setattr(plan, k, v)
    try:
        return fn(*args, **kw)
    finally:
        for k, v in saved.items():
            setattr(plan, k, v)


def _planner(consts):
    """kvcache._plan_and_load planned under the mode's constants, memoized per mode."""
    inner = kvcache._plan_and_load.__wrapped__
    return functools.lru_cache(maxsize=None)(lambda *args, **kw: _with_constants(consts, inner, *args, **kw))


def _grid(p):
    tag = f"{p.num_splits}x{p.split_tiles}t" if p.split_major else f"{p.num_splits}"
    if p.tail_groups:  # whole groups, then tail_groups groups in num_splits splits
        tag = f"1|{p.num_splits}x{p.tail_groups}g"
    return f"{tag}@{p.ctas_per_sm}"


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{b},{n},{h}" for h in bench_decode.DEFAULT_KV_HEADS
                                                     for b in bench_decode.DEFAULT_BATCHES
                                                     for n in bench_decode.DEFAULT_CACHE_LENS])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--all", action="store_true", help="also shapes where every mode plans the same grid")
    ap.add_argument("--modes", nargs="*", default=DEFAULT_MODES, help="NAME:CONSTANT=VALUE,... (first: the baseline)")
    a = ap.parse_args()
    modes = dict(_parse_mode(m) for m in a.modes)
    base = next(iter(modes))
    torch = bench_decode._torch()
    planners = {m: _planner(c) for m, c in modes.items()}
    real_planner = kvcache._plan_and_load
    rng = cupy.random.default_rng(0)
    current = [base]
    kvcache._plan_and_load = lambda *args, **kw: planners[current[0]](*args, **kw)
    rows = []
    try:
        for shape in a.shapes:
            b, L, hk = map(int, shape.split(","))
            q = bench_decode._random((b, 1, bench_decode.NHEADS, 128), "bf16", rng)
            plans = {m: _with_constants(c, bench_decode._plan_used, q, hk, L) for m, c in modes.items()}
            grids = {m: _grid(p) for m, p in plans.items()}
            if not a.all and len(set(map(repr, plans.values()))) == 1:  # also kernels, not only grids
                continue
            need, free = bench_decode.kv_bytes(b, L, hk, 128) * 1.05 + (4 << 30), bench_decode._free_bytes()
            if need > free:  # the bench's rule
                print(f"b={b} L={L} h_kv={hk}: skipped, needs {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
                continue
            kc, vc = (bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv")

            def call(mode):
                def fn():
                    current[0] = mode
                    return kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5)
                return fn

            fns = {m: call(m) for m in modes}
            outs = {m: fn().astype(cupy.float32) for m, fn in fns.items()}
            diff = max(float(abs(outs[m] - outs[base]).max()) for m in modes)
            outs = tq = tk = tv = None
            if torch is not None:
                from torch.nn.attention import SDPBackend

                tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
                fns["cudnn"] = bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, 128**-0.5, hk != 32)
                torch.cuda.synchronize()
            us = {k: v * 1e3 for k, v in time_ms(fns, repeats=a.repeats).items()}
            rows.append(us)
            cells = "  ".join(f"{m} [{grids[m]}] {us[m]:.1f}" for m in modes)
            ratios = "  cudnn/x " + " ".join(f"{us['cudnn'] / us[m]:.3f}" for m in modes) if "cudnn" in us else ""
            print(f"b={b:2d} L={L:6d} h_kv={hk:2d}  {cells}  cudnn {us.get('cudnn', float('nan')):.1f}{ratios}"
                  f"  max|diff| {diff:.1e}", flush=True)  # fmt: skip
            q = kc = vc = fns = tq = tk = tv = None
            bench_decode._release_memory()
    finally:
        kvcache._plan_and_load = real_planner
    if rows:
        print(f"medians over {len(rows)} shapes:")
        for m in modes:
            line = f"  {m:10s} time / {base}'s {statistics.median(u[m] / u[base] for u in rows):.3f}"
            if all("cudnn" in u for u in rows):
                r = [u["cudnn"] / u[m] for u in rows]
                line += f"  cudnn/{m} {statistics.median(r):.3f} (min {min(r):.3f}, {sum(x >= 1 for x in r)} >= 1.0)"
            print(line)


if __name__ == "__main__":
    main()
