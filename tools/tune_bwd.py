"""Sweep backward tile shapes (cuflash/plan/backward.py BwdTile) on the GPU, side by side with torch's
FlashAttention-2 backward, to choose the rows of BWD_TILES.

    python tools/tune_bwd.py --hd 128 [--seqlen 1024 4096] [--tiles "64,128,8,2,4,4,2" ...]
    python tools/tune_bwd.py --hd 128 --sm90     (the Hopper kernels: TMA at 2 and 3 stages, cp.async)
    python tools/tune_bwd.py --hd 128 --sm90 --persistent   (TMA at 2-4 stages, per key block and persistent)
    python tools/tune_bwd.py --hd 64 --sm90 --block-m 64 128   (the TMA tiles with 64- and 128-row query blocks;
                                                              at --hd 128: --block-m 64 80)
A tile is block_m,block_n,warps,stages,s_key_warps,kv_key_warps,dq_q_warps. Every tile is first
checked against the float64 reference on a ragged GQA case; then one line per (tile, causal,
seqlen) and, last, the median ratio per tile.
"""
import argparse
import dataclasses
import statistics

from cuflash import bench, plan


def check_tile(hd, tile, dtype):
    import cupy
    import numpy as np

    from cuflash import backward, forward, reference
    from cuflash.checks import numpy_dtype

    dt = numpy_dtype(dtype)
    rng = np.random.default_rng()
    for causal in (False, True):
        q, k, v, do = (cupy.asarray(rng.standard_normal(sh, dtype=np.float32).astype(dt))
                       for sh in ((2, 211, 2, hd), (2, 333, 1, hd), (2, 333, 1, hd), (2, 211, 2, hd)))
        out, lse = forward.run(q, k, v, causal=causal, return_lse=True)
        got = backward.run(do, q, k, v, out, lse, causal=causal, tile=tile)
        refs = reference.attention_backward(do, q, k, v, causal=causal)
        plains = reference.plain_attention_backward_bar(do, q, k, v, refs, causal=causal, dtype=dt, out=out)
        for g, r, pl in zip(got, refs, plains):
            if not reference.within_tolerance(g.get().astype(np.float64), r, pl, factor=3.0):
                return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiles", nargs="*", default=[])
    ap.add_argument("--sm90", action="store_true",
                    help="the Hopper kernels instead: warp-specialized TMA (2, 3 stages) and cp.async, side by side")
    ap.add_argument("--persistent", action="store_true",
                    help="with --sm90: the warp-specialized tiles at 2-4 stages, each per key block and persistent "
                         "(head dims 64 and 128), without the cp.async kernel")
    ap.add_argument("--block-m", type=int, nargs="+", default=[64],
                    help="with --sm90: the warp-specialized tiles' query rows per block (128: head dim 64 only; "
                         "80: head dim 128 only)")
    a = ap.parse_args()
    if a.sm90:
        heights = (64, plan.BWD_SM90_WS_WIDE_ROWS.get(a.hd, 64))
        if any(bm not in heights for bm in a.block_m):
            ap.error(f"--block-m at head dim {a.hd} takes {' or '.join(map(str, sorted(set(heights))))}")
        ws = plan.BWD_SM90_WS_TILES.get(a.hd)  # its block_n (64 at head dim 256); every ring depth that fits
        persistent = (False, True) if a.persistent and a.hd in (64, 128) else (False,)
        tiles = [dataclasses.replace(ws, stages=st, persistent=pe, block_m=bm) for bm in a.block_m
                 for st in ((2, 3, 4) if a.persistent else (2, 3)) for pe in persistent
                 if ws and plan.bwd_sm90_ws_smem_bytes(a.hd, dataclasses.replace(ws, stages=st, persistent=pe, block_m=bm))
                 <= plan.max_smem_bytes("sm_90a")]  # fmt: skip
        if not a.persistent and a.block_m == [64]:
            tiles.append(plan.BWD_SM90_TILES[a.hd])
    else:
        tiles = [plan.BwdTile(*map(int, t.split(","))) for t in a.tiles] or [plan.BWD_TILES[a.hd]]
    scores = {}
    for tile in tiles:
        name = type(tile).__name__ + ":" + ",".join(str(x) for x in tile.__dict__.values())
        if isinstance(tile, plan.BwdTile) and not tile.valid_for(a.hd):
            print(f"hd{a.hd} {name}: breaks the layout rules, skipped", flush=True)
            continue
        try:
            ok = check_tile(a.hd, tile, a.dtype)
        except Exception as exc:
            print(f"hd{a.hd} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        if not ok:
            print(f"hd{a.hd} {name}: WRONG RESULTS, skipped", flush=True)
            continue
        ratios, vs_cudnn = [], []
        for causal in (False, True):
            for s in a.seqlen:
                b, h = max(1, 16384 // s), 2048 // a.hd
                row = bench.run_point(a.dtype, a.hd, causal, s, b, h, repeats=a.repeats, peers=True, naive_max_gb=0,
                                      op="bwd", bwd_tile=tile)
                bench.release_memory()
                t = row.tflops
                r = t["cuflash"] / t["flash"] if "flash" in t and "cuflash" in t else float("nan")
                ratios.append(r)
                if "cudnn" in t and "cuflash" in t:
                    vs_cudnn.append(t["cuflash"] / t["cudnn"])
                print(f"hd{a.hd} {name} causal={int(causal)} s={s:5d}: cuflash {t.get('cuflash', 0):6.1f} "
                      f"flash {t.get('flash', 0):6.1f} cudnn {t.get('cudnn', 0):6.1f} ratio {r:.3f}", flush=True)
        scores[name] = (statistics.median(ratios), statistics.median(vs_cudnn) if vs_cudnn else float("nan"),
                        min(vs_cudnn) if vs_cudnn else float("nan"))  # fmt: skip
    for name, (sc, sd, lo) in sorted(scores.items(), key=lambda kv: -kv[1][0]):
        print(f"  hd{a.hd} median ratio vs flash {sc:.3f} vs cudnn {sd:.3f} (lowest {lo:.3f})  tile {name}")


if __name__ == "__main__":
    main()
