"""Does a one-wave decode grid stream slower because it leaves CTA slots empty? KV TB/s of cuflash
(a fixed split count, 2 split CTAs per SM) and cuDNN at MHA shapes whose grids hold a few CTAs
fewer or more than the GPU's slots (132 SMs x 2 = 264 on the H200): 32 kv heads give 256 CTAs per
split, 33 give 264, 31 give 248.

    python tools/wave_fill_decode.py [--cases 1,131072,8 8,16384,1,3 ...] [--heads 31 32 33]
                                     [--tiles 64,2,3 64,3,2] [--repeats 20]
A case is batch,cache_len,num_splits[,split CTAs per SM (default 2)]; a tile is a hd128 row of
cuflash/plan.py DECODE_TILES (block_n,stages,min_blocks; default the table's). Query heads = kv heads (MHA), head dim 128, bf16, one query
token, full caches. If throughput follows the number of resident CTAs, 33 heads read ~3% faster per
byte than 32 (264 / 256).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache, plan  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["1,131072,8", "1,65536,8", "8,16384,1", "8,4096,1"])
    ap.add_argument("--heads", nargs="*", type=int, default=[31, 32, 33])
    ap.add_argument("--tiles", nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch = bench_decode._torch()
    rng = cupy.random.default_rng(0)
    tiles = [plan.DecodeTile(*map(int, t.split(","))) for t in a.tiles] or [plan.DECODE_TILES[128]]
    for case, tile, h in ((c, t, h) for c in a.cases for t in tiles for h in a.heads):
        b, L, splits, per_sm = (list(map(int, case.split(","))) + [2])[:4]
        plan.DECODE_TILES[128] = tile
        kvcache._plan_and_load.cache_clear()
        q = bench_decode._random((b, 1, h, 128), "bf16", rng)
        kc, vc = (bench_decode._random((b, L, h, 128), "bf16", rng) for _ in "kv")
        out = cupy.empty_like(q)
        fns = {"cuflash": lambda: kvcache.attention_with_kvcache(
            q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5, num_splits=splits, _ctas_per_sm=per_sm, out=out)}
        tq = tk = tv = None
        if torch is not None:
            from torch.nn.attention import SDPBackend

            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
            fns["cudnn"] = bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, 128**-0.5, False)
            torch.cuda.synchronize()
        ms = time_ms(fns, repeats=a.repeats)
        nbytes = bench_decode.kv_bytes(b, L, h, 128)
        cells = "  ".join(f"{k} {nbytes / (v * 1e-3) / 1e12:.3f} TB/s ({v * 1e3:.1f} us)" for k, v in ms.items())
        print(f"b={b} L={L:6d} splits={splits:2d}@{per_sm} tile {tile.block_n},{tile.stages},{tile.min_blocks} heads={h}: "
              f"{b * h * splits:4d} CTAs  {cells}", flush=True)  # fmt: skip
        q = kc = vc = out = fns = tq = tk = tv = None
        bench_decode._release_memory()


if __name__ == "__main__":
    main()
