"""Does reading the same KV cache call after call help a decode kernel through L2? Times cuflash and
cuDNN on one cache (as `cuflash bench --decode` does) and on N copies used in turn (a call never
finds the previous call's lines in L2, as in a model, where other layers' caches and weights run in
between).

    python tools/l2_reuse_decode.py [--shapes 8,4096,32 ...] [--copies 4] [--repeats 20]
A shape is batch,cache_len,kv_heads (32 query heads, head dim 128, bf16, one query token, full caches).
Prints us per call (cuflash.bench.time_ms) of each implementation, same cache vs rotated copies.
"""
import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["8,4096,32", "8,8192,8", "64,4096,8", "1,65536,8", "8,32768,32"])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch = bench_decode._torch()
    from torch.nn.attention import SDPBackend

    rng = cupy.random.default_rng(0)
    for shape in a.shapes:
        b, L, hk = map(int, shape.split(","))
        q = bench_decode._random((b, 1, 32, 128), "bf16", rng)
        caches = [tuple(bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv") for _ in range(a.copies)]
        tq = torch.from_dlpack(q).transpose(1, 2)
        peers = [bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, torch.from_dlpack(kc).transpose(1, 2),
                                         torch.from_dlpack(vc).transpose(1, 2), 128**-0.5, hk != 32)
                 for kc, vc in caches]  # fmt: skip

        def ours(i):
            kc, vc = caches[i]
            return lambda: kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5)

        def rotating(fns):
            it = itertools.cycle(fns)
            return lambda: next(it)()

        fns = {"cuflash same": ours(0), "cuflash rotated": rotating([ours(i) for i in range(a.copies)]),
               "cudnn same": peers[0], "cudnn rotated": rotating(peers)}  # fmt: skip
        torch.cuda.synchronize()
        us = {k: v * 1e3 for k, v in time_ms(fns, repeats=a.repeats).items()}
        print(f"b={b:3d} L={L:6d} h_kv={hk:2d}  " + "  ".join(f"{k} {v:7.1f}" for k, v in us.items())
              + f"  | cuflash/cudnn speed: same x{us['cudnn same'] / us['cuflash same']:.3f}, "
              f"rotated x{us['cudnn rotated'] / us['cuflash rotated']:.3f}", flush=True)  # fmt: skip
        caches = peers = fns = q = tq = None
        bench_decode._release_memory()


if __name__ == "__main__":
    main()
