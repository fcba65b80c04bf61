"""Sweep forward tile shapes on the GPU at a few points of the paper grid, side by side with
torch's FlashAttention-2, to choose the rows of cuflash/plan.py FWD_TILES.

    python tools/tune_fwd.py [--hd 64 128 256] [--seqlen 2048 8192] [--dtype bf16]
Prints one line per (head dim, tile, causal, seqlen) and, last, the best tile per head dim.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench, plan  # noqa: E402
from cuflash.plan import Tile  # noqa: E402

CANDIDATES = {
    32: [Tile(128, 64, 4, True, 2), Tile(128, 128, 4, True, 2), Tile(64, 64, 4, True, 2)],
    64: [Tile(128, 64, 4, True, 2), Tile(128, 128, 4, False, 2), Tile(128, 128, 8, True, 1),
         Tile(64, 64, 4, True, 2), Tile(128, 64, 4, False, 2)],
    96: [Tile(128, 64, 4, False, 2), Tile(128, 64, 8, True, 1), Tile(128, 32, 4, False, 2)],
    128: [Tile(128, 64, 4, False, 2), Tile(128, 32, 4, False, 2), Tile(128, 64, 8, True, 1),
          Tile(128, 128, 8, True, 1), Tile(64, 64, 4, True, 2)],
    160: [Tile(128, 64, 8, True, 1), Tile(128, 32, 4, False, 2), Tile(64, 64, 4, True, 1)],
    192: [Tile(128, 64, 8, True, 1), Tile(128, 32, 8, True, 1), Tile(64, 64, 4, True, 1)],
    224: [Tile(128, 64, 8, False, 1), Tile(128, 32, 8, True, 1), Tile(64, 64, 4, False, 1)],
    256: [Tile(128, 64, 8, False, 1), Tile(128, 32, 8, False, 1), Tile(64, 64, 4, False, 1),
          Tile(64, 32, 4, False, 1)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    best = {}
    for hd in a.hd:
        scores = {}
        for tile in CANDIDATES[hd]:
            ratios = []
            for causal in (False, True):
                for s in a.seqlen:
                    b, h = max(1, 16384 // s), 2048 // hd
                    try:
                        row = bench.run_point(a.dtype, hd, causal, s, b, h, repeats=a.repeats, peers=True,
                                              naive_max_gb=0, tile=tile)
                    except Exception as exc:  # e.g. too much shared memory for this tile
                        print(f"hd{hd} {tile} causal={causal} s={s}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                    t = row.tflops
                    if "cuflash" not in t:
                        print(f"hd{hd} {tile} causal={causal} s={s}: cuflash failed: {row.notes}", flush=True)
                        continue
                    r = t["cuflash"] / t["flash"] if "flash" in t else float("nan")
                    ratios.append(r)
                    print(f"hd{hd} bm{tile.block_m} bn{tile.block_n} w{tile.warps} qreg={int(tile.q_in_regs)} "
                          f"causal={int(causal)} s={s:5d}: cuflash {t['cuflash']:6.1f}  flash {t.get('flash', 0):6.1f} "
                          f"cudnn {t.get('cudnn', 0):6.1f}  ratio {r:.3f}", flush=True)
            if ratios:
                scores[tile] = statistics.median(ratios)
        if scores:
            best[hd] = max(scores, key=scores.get)
            for tile, sc in sorted(scores.items(), key=lambda kv: -kv[1]):
                print(f"  hd{hd} median ratio vs flash {sc:.3f}  {tile}")
    print("BEST:", {hd: (t.block_m, t.block_n, t.warps, t.q_in_regs, t.min_blocks) for hd, t in best.items()})


if __name__ == "__main__":
    main()
