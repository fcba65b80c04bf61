"""Device time of a decode call per num_splits at the decode bench's shapes, next to cuDNN, and the
split count the heuristic (num_splits=0) picks: the data behind cuflash/plan.py decode_num_splits.

    python tools/sweep_splits.py [--shapes 8,4096,32 ...] [--splits 1 2 3 4 6 8 12 16 24 32 48 64]
                                 [--ctas-per-sm 2 3] [--max-gb 5] [--repeats 8] [--json FILE]
A shape is batch,cache_len,kv_heads (32 query heads, head dim 128, bf16, one query token, full
caches); the default is every shape of `cuflash bench --decode`. Per shape: microseconds per call
(CUDA events, cuflash.bench.time_ms, interleaved samples) of each split count (those above the
heuristic's cap of one split per 256 keys are left out) and of cuDNN, the best count, and the
plan's own choice (num_splits=0: its count @ CTAs per SM) with its time / the best plain time. --ctas-per-sm: also each split count with the split
CTAs spaced out to that many per SM (cells "splits@ctas"; plain cells use the plan's CTAs per SM).
--max-gb: skip shapes whose cache is larger (their calls are milliseconds long). Last: how many shapes the heuristic is within 2%
of the best on, and the median of its time / best.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache, plan  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402

SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{b},{n},{h}" for h in bench_decode.DEFAULT_KV_HEADS
                                                     for b in bench_decode.DEFAULT_BATCHES
                                                     for n in bench_decode.DEFAULT_CACHE_LENS])
    ap.add_argument("--splits", nargs="*", type=int, default=SPLITS)
    ap.add_argument("--ctas-per-sm", nargs="*", type=int, default=[])
    ap.add_argument("--max-gb", type=float, default=float("inf"))
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--json", help="write every time here")
    a = ap.parse_args()
    torch = bench_decode._torch()
    rng = cupy.random.default_rng(0)
    rows, ratios = [], []
    for shape in a.shapes:
        b, L, hk = map(int, shape.split(","))
        if bench_decode.kv_bytes(b, L, hk, 128) > a.max_gb * 1e9:
            continue
        q = bench_decode._random((b, 1, 32, 128), "bf16", rng)
        kc, vc = (bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv")
        used = bench_decode._plan_used(q, hk, L)
        heuristic, per_sm = used.num_splits, used.ctas_per_sm
        s_max = min(plan.MAX_DECODE_SPLITS, max(1, -(-L // plan.MIN_DECODE_KEYS_PER_SPLIT)))
        counts = sorted({s for s in a.splits if s <= s_max} | {heuristic})

        def call(s, c=0):
            return lambda: kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5,
                                                          num_splits=s, _ctas_per_sm=c)  # fmt: skip

        fns = {"auto": call(0)}  # the plan's own choice (its split count and CTAs per SM)
        fns.update({s: call(s) for s in counts})
        fns.update({f"{s}@{c}": call(s, c) for c in a.ctas_per_sm for s in counts})
        tq = tk = tv = None
        if torch is not None:
            from torch.nn.attention import SDPBackend

            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
            fns["cudnn"] = bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, 128**-0.5, hk != 32)
            torch.cuda.synchronize()
        us = {k: v * 1e3 for k, v in time_ms(fns, repeats=a.repeats).items()}
        best = min(counts, key=lambda s: us[s])
        ratios.append(us["auto"] / us[best])
        spaced = {k: v for k, v in us.items() if isinstance(k, str) and "@" in k}
        rows.append({"batch": b, "cache_len": L, "nheads_kv": hk, "us": {str(k): v for k, v in us.items()},
                     "best": best, "heuristic": heuristic, "heuristic_ctas_per_sm": per_sm})  # fmt: skip
        cells = "  ".join(f"{s}:{us[s]:.1f}" for s in counts)
        peer = f"  cudnn {us['cudnn']:.1f}" if "cudnn" in us else ""
        print(f"b={b:3d} L={L:6d} h_kv={hk:2d}  {cells}{peer}  | best {best}, heuristic {heuristic}@{per_sm} "
              f"{us['auto']:.1f} x{ratios[-1]:.3f}", flush=True)  # fmt: skip
        if spaced:
            top = min(spaced, key=spaced.get)
            print(f"    spaced: {'  '.join(f'{k}:{v:.1f}' for k, v in spaced.items())}  | best {top} "
                  f"{spaced[top]:.1f} (x{spaced[top] / us[best]:.3f} of the best plain)", flush=True)  # fmt: skip
        q = kc = vc = fns = tq = tk = tv = None  # the torch views hold the caches too
        bench_decode._release_memory()
    print(f"heuristic within 2% of the best on {sum(r <= 1.02 for r in ratios)} of {len(ratios)} shapes; "
          f"median time / best x{statistics.median(ratios):.3f}, worst x{max(ratios):.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
