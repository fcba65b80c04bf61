"""The decode kernels of this tree next to those of another copy of cuda_src, on the GPU, in one run
(bf16, head dim 128, 32 query heads, one query token, full caches, num_splits=0), with cuDNN alongside.

    python tools/ab_decode.py --old .old/cuda_src [--also NAME=DIR ...] [--shapes 8,4096,32 ...] [--repeats 20]
The old build is launched without programmatic dependent launch (its kernels may not wait for the
kernel before them) unless --old-pdl, the new one as cuflash launches it (CUFLASH_PDL). Per shape: device
microseconds per call (CUDA events, interleaved samples, cuflash.bench.time_ms) of
the old and the new kernels and torch SDPA's CUDNN_ATTENTION, and new / old and new / cuDNN speed
ratios; last, their medians. Every build is checked against old (max abs difference). --also adds
more builds (launched as the new one) to the same samples, each reported as NAME / old.

Bias: the samples go old, new, cuDNN in every round, and on the H200 an A/A run (--old pointing at a
copy of this tree's cuda_src, --old-pdl) put "new" 1.5% ahead of the same kernel timed as "old"
(median over 4 shapes, 12 samples; the first of a round follows torch's calls). Run the A/A next to
any A/B and compare the two medians, not the A/B's alone. (Since then cuflash.bench.time_ms
alternates the order and primes each sample, and an A/A run measured 0.997-1.004.) Both builds are
launched with this tree's DecodeParams: a cuda_src from before 4a84b6c (no split_tiles, split_major)
does not match it.
"""
import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, jit, kvcache  # noqa: E402
from cuflash.bench import time_ms  # noqa: E402

SHAPES = ["8,4096,32", "64,4096,32", "64,4096,8", "8,8192,32", "8,8192,8", "8,16384,8", "1,16384,32", "1,32768,32",
          "1,32768,8", "1,65536,8", "64,16384,8", "8,65536,32"]


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="folder of the other cuda_src")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--old-pdl", action="store_true",
                    help="launch the old build with programmatic dependent launch too (its kernels must wait for "
                         "the kernel before them, as every decode kernel since 91b1f50 does)")
    ap.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR",
                    help="more cuda_src folders timed in the same samples, each reported against old")
    a = ap.parse_args()
    new_dir, old_dir = jit.source_dir(), Path(a.old).resolve()
    if any("=" not in item for item in a.also):
        ap.error("--also takes NAME=DIR items, e.g. --also cta3=.old/cta3")
    also = dict(item.split("=", 1) for item in a.also)
    if not also.keys().isdisjoint({"old", "new", "cudnn"}):
        ap.error("--also names must differ from old, new and cudnn")
    for name, d in also.items():
        if not (Path(d) / "flash_decode.cuh").is_file():
            ap.error(f"--also {name}={d}: no flash_decode.cuh in that folder")
    # Per build: its source folder, its loaded functions and its own memo of plans and functions, so
    # switching builds between calls costs three assignments (a cleared memo would put host time into
    # the short calls' samples).
    plan_and_load = kvcache._plan_and_load.__wrapped__
    builds = {name: (src, {}, functools.lru_cache(maxsize=64)(plan_and_load))
              for name, src in (("old", old_dir), ("new", new_dir), *((n, Path(d).resolve()) for n, d in also.items()))}  # fmt: skip

    pdl = jit.PDL_ENABLED

    def use(name):
        src, fns, memo = builds[name]
        jit.source_dir = lambda: src
        jit._functions = fns
        kvcache._plan_and_load = memo
        # The old kernels may predate griddepcontrol.wait, which a PDL launch needs: never launch them so.
        jit.PDL_ENABLED = pdl and (name != "old" or a.old_pdl)

    torch = bench_decode._torch()
    rng = cupy.random.default_rng(0)  # the bench's caches, made on the GPU (bench_decode._random)
    vs_old, vs_cudnn = [], []
    also_vs_old = {name: [] for name in also}
    for shape in a.shapes:
        b, L, hk = map(int, shape.split(","))
        q = bench_decode._random((b, 1, bench_decode.NHEADS, 128), "bf16", rng)
        kc, vc = (bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv")

        def call(name):
            def fn():
                use(name)
                kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=128**-0.5)
            return fn

        outs = {}
        for name in builds:
            call(name)()
            outs[name] = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L).astype(cupy.float32)
        diff = max(float(cupy.abs(outs["old"] - outs[name]).max()) for name in builds if name != "old")
        fns = {name: call(name) for name in builds}
        if torch is not None:
            from torch.nn.attention import SDPBackend

            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
            fns["cudnn"] = bench_decode._sdpa_peer(torch, SDPBackend.CUDNN_ATTENTION, tq, tk, tv, 128**-0.5, hk != 32)
            torch.cuda.synchronize()
        ms = time_ms(fns, repeats=a.repeats)
        vs_old.append(ms["old"] / ms["new"])
        line = f"b={b:3d} L={L:6d} h_kv={hk:2d}: old {ms['old'] * 1e3:7.1f} us  new {ms['new'] * 1e3:7.1f} us"
        if "cudnn" in ms:
            vs_cudnn.append(ms["cudnn"] / ms["new"])
            line += f"  cudnn {ms['cudnn'] * 1e3:7.1f} us  new/cudnn x{vs_cudnn[-1]:.3f}"
        line += f"  new/old x{vs_old[-1]:.3f}"
        for name, ratios in also_vs_old.items():
            ratios.append(ms["old"] / ms[name])
            line += f"  {name} {ms[name] * 1e3:7.1f} us {name}/old x{ratios[-1]:.3f}"
        print(f"{line}  (max diff {diff:.1e})", flush=True)
        outs = fns = None
        bench_decode._release_memory()
    print(f"median new/old x{statistics.median(vs_old):.3f}"
          + (f", new/cudnn x{statistics.median(vs_cudnn):.3f}" if vs_cudnn else "")
          + "".join(f", {name}/old x{statistics.median(r):.3f}" for name, r in also_vs_old.items()))


if __name__ == "__main__":
    main()
