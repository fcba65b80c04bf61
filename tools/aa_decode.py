"""Does the timing order bias `cuflash bench --decode`? An A/A test of cuflash.bench.time_ms on the
GPU: cuflash's decode call is timed twice per round, listed as cuflash, FA2, cuDNN, cuflash again.

    python tools/aa_decode.py [--shapes 8,4096,32 ...] [--repeats 20]
A shape is batch,cache_len,kv_heads (32 query heads, head dim 128, bf16, one query token, full
caches). Per shape, without and with time_ms's primer (an untimed call of the same function before
each sample): the speed of "cuflash again" over "cuflash" (1.0: no bias) and cuflash / cuDNN from
each of the two entries. Last, the medians.

First run (2026-11-30, before time_ms reversed every other round): in a fixed order, the entry that
follows cuDNN measured 1.7% slower than the one that follows cuflash's own call (median of six
shapes), 0.5% with the primer. time_ms now also alternates the order, so both entries follow each
function equally often and the two ratios here should be 1.0 within the noise.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402

SHAPES = ["8,4096,32", "1,16384,32", "1,32768,32", "1,131072,32", "8,16384,8", "64,4096,8"]


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch = bench_decode._torch()
    if torch is None:
        sys.exit("aa_decode needs torch with CUDA (the peers whose calls come before cuflash's)")
    from torch.nn.attention import SDPBackend

    rng = cupy.random.default_rng(0)
    summary = {False: ([], []), True: ([], [])}  # primer -> (again / first, vs cuDNN spread)
    for shape in a.shapes:
        b, L, hk = map(int, shape.split(","))
        q = bench_decode._random((b, 1, 32, 128), "bf16", rng)
        kc, vc = (bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv")
        out = cupy.empty_like(q)

        def ours():
            return kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5, out=out)

        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
        fns = {  # the bench's order, then the same cuflash call once more
            "cuflash": ours,
            "flash": bench_decode._sdpa_peer(torch, SDPBackend.FLASH_ATTENTION, tq, tk, tv, 128**-0.5, hk != 32),
            "cudnn": bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, 128**-0.5, hk != 32),
            "cuflash again": ours,
        }
        torch.cuda.synchronize()
        cells = []
        for primer in (False, True):
            ms = time_ms(fns, repeats=a.repeats, primer=primer)
            aa = ms["cuflash"] / ms["cuflash again"]
            first, last = ms["cudnn"] / ms["cuflash"], ms["cudnn"] / ms["cuflash again"]
            summary[primer][0].append(aa)
            summary[primer][1].append(last - first)
            cells.append(f"{'primer' if primer else 'plain '}: cuflash {ms['cuflash'] * 1e3:7.1f} us, again "
                         f"{ms['cuflash again'] * 1e3:7.1f} us, again/first speed x{aa:.3f}, vs cuDNN "
                         f"{first:.3f} (first) {last:.3f} (again)")  # fmt: skip
        print(f"b={b:3d} L={L:6d} h_kv={hk:2d}  " + "  |  ".join(cells), flush=True)
        q = kc = vc = out = fns = tq = tk = tv = None
        bench_decode._release_memory()
    for primer, (aa, spread) in summary.items():
        print(f"{'with' if primer else 'without'} primer: median again/first x{statistics.median(aa):.3f}, "
              f"median vs-cuDNN difference (again - first) {statistics.median(spread):+.3f}")


if __name__ == "__main__":
    main()
