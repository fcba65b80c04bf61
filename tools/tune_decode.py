"""Sweep decode tiles (cuflash/plan.py DecodeTile rows of DECODE_TILES) on the GPU at a few shapes of
the decode grid, side by side with torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION.

    python tools/tune_decode.py [--hd 128] [--tiles 64,3,2 128,2,2 ...] [--shapes 8,32768,8 ...]
A tile is block_n,stages,min_blocks. Prints KV TB/s per (tile, shape) and, last, the median ratio to
cuDNN per tile. Every tile is first checked against the float64 reference on a small GQA case.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache, plan  # noqa: E402

#: (batch, cache len, kv heads): long caches that stream at HBM speed and shorter ones where a call is
#: a few tens of microseconds (pipeline fill, the split count and the merge of the splits show there).
SHAPES = [(1, 131072, 32), (8, 32768, 32), (8, 32768, 8), (64, 4096, 32), (64, 32768, 8), (1, 32768, 8),
          (8, 4096, 8), (1, 131072, 8), (8, 4096, 32)]


def check(hd):
    import cupy
    import numpy as np

    from cuflash import reference
    from cuflash.attention import _BF16

    rng = np.random.default_rng(0)
    q, kc, vc = (cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(_BF16))
                 for s in ((3, 1, 8, hd), (3, 3000, 2, hd), (3, 3000, 2, hd)))
    lengths = np.array([3000, 1234, 1], dtype=np.int32)
    out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths)
    ref = reference.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths)[0]
    plains = [np.stack([reference.plain_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], dtype=_BF16,
                                                  p_order=o)[0] for b, n in enumerate(lengths)])
              for o in ("normalized", "unnormalized")]  # fmt: skip
    return reference.within_tolerance(out.get().astype(np.float64), ref, reference.worse_of(plains, ref))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--tiles", nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", nargs="*", default=[], help="batch,cache_len,kv_heads (default: SHAPES)")
    a = ap.parse_args()
    shapes = [tuple(map(int, x.split(","))) for x in a.shapes] or SHAPES
    tiles = [plan.DecodeTile(*map(int, t.split(","))) for t in a.tiles] or [plan.DECODE_TILES[a.hd]]
    scores = {}
    for tile in tiles:
        plan.DECODE_TILES[a.hd] = tile
        kvcache._plan_and_load.cache_clear()
        name = f"bn{tile.block_n} st{tile.stages} mb{tile.min_blocks}"
        try:
            ok = check(a.hd)
        except Exception as exc:
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        if not ok:
            print(f"{name}: WRONG RESULTS, skipped", flush=True)
            continue
        ratios = []
        for b, L, h in shapes:
            row = bench_decode.run_decode_point("bf16", a.hd, b, L, 32, h, repeats=a.repeats)
            bench_decode._release_memory()
            t = row.tbps
            r = t.get("cuflash", 0) / t["cudnn"] if "cudnn" in t else float("nan")
            ratios.append(r)
            print(f"{name} b={b:3d} L={L:6d} h_kv={h:2d} splits={row.num_splits:3d}: cuflash {t.get('cuflash', 0):.2f} "
                  f"flash {t.get('flash', 0):.2f} cudnn {t.get('cudnn', 0):.2f} TB/s  vs cudnn {r:.3f}", flush=True)
        scores[name] = statistics.median(ratios)
    for name, sc in sorted(scores.items(), key=lambda kv: -kv[1]):
        print(f"  hd{a.hd} median ratio vs cudnn {sc:.3f}  {name}")


if __name__ == "__main__":
    main()
