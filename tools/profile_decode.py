"""Where does a decode step's time go? cuflash next to torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION.

    python tools/profile_decode.py [--shapes 1,4096,8 ...] [--splits 1 2 4 8 16 32 64] [--cprofile FILE]
                                   [--back-to-back N]

Per shape (batch,cache_len,kv_heads; 32 query heads, head dim 128, bf16, one query token):
  event ms   cuflash.bench.time_ms (5 back-to-back calls per sample, what `cuflash bench --decode` reports)
  host us    Python + launch time per call (cuflash.bench.host_us)
  kernels    the device kernels of one call from torch.profiler (CUPTI sees CuPy's launches too): name,
             microseconds, and the call's span from its first kernel's start to its last kernel's end
Then, for cuflash, the span of one call per num_splits, so the split heuristic can be checked against
the device alone. --back-to-back N: N calls of each implementation without a sync between them (as
the bench times them), each kernel's start, duration and the gap after the one before. --cprofile writes the top Python functions of 2000 cuflash calls (first shape).
--ncu runs one call of each implementation per shape inside cudaProfilerStart/Stop and nothing else.
"""
import argparse
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, kvcache  # noqa: E402
from cuflash.bench import host_us, time_ms  # noqa: E402

SHAPES = ["1,4096,32", "1,32768,32", "8,4096,32", "1,4096,8", "1,32768,8", "1,131072,8", "8,4096,8", "8,32768,8",
          "8,131072,32", "64,4096,8"]


def kernel_events(torch, fn, calls: int, sync: bool = True) -> list:
    """The kernel records (chrome-trace events, start order) of `calls` calls of fn under
    torch.profiler, each call followed by a sync (or, sync=False, back to back); one warm-up call before."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def kernel_calls(torch, fn, calls: int = 8):
    """[(span_us, [(kernel name, us), ...]) per call] of `calls` calls, each followed by a sync."""
    kernels = kernel_events(torch, fn, calls)
    # Calls are separated by syncs: split where the gap to the previous kernel exceeds 15 us.
    groups, cur = [], []
    for e in kernels:
        if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > 15.0:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    return [(g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"], [(e["name"], e["dur"]) for e in g]) for g in groups]


def decode_problem(torch, shape: str, seed: int):
    """One problem "batch,cache_len,kv_heads" (32 query heads, head dim 128, bf16, one query token):
    (batch, cache_len, kv_heads, KV bytes, ours(num_splits=0), {"flash": fn, "cudnn": fn}), the peers
    torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION on the same cache. The arrays live in the
    closures: drop them to free the memory."""
    import cupy
    from torch.nn.attention import SDPBackend

    b, L, h_kv = map(int, shape.split(","))
    rng = cupy.random.default_rng(seed)
    q = bench_decode._random((b, 1, 32, 128), "bf16", rng)
    kc = bench_decode._random((b, L, h_kv, 128), "bf16", rng)
    vc = bench_decode._random((b, L, h_kv, 128), "bf16", rng)
    out = cupy.empty_like(q)
    scale = 1 / math.sqrt(128)

    def ours(s=0):
        return kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=scale, out=out, num_splits=s)

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
    peers = {name: bench_decode._sdpa_peer(torch, backend, tq, tk, tv, scale, h_kv != 32)
             for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))}
    return b, L, h_kv, bench_decode.kv_bytes(b, L, h_kv, 128), ours, peers


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def main():
    import cupy

    from cuflash.bench import _torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--splits", nargs="*", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    ap.add_argument("--cprofile", default=None)
    ap.add_argument("--back-to-back", type=int, default=0, metavar="N",
                    help="also N calls of each implementation with no sync between (as cuflash bench times them): "
                         "every kernel's start, duration and gap after the previous kernel")
    ap.add_argument("--ncu", action="store_true",
                    help="one call of each implementation per shape between cudaProfilerStart/Stop, nothing else "
                         "(run under ncu --profile-from-start off)")
    a = ap.parse_args()
    torch = _torch()
    for si, shape in enumerate(a.shapes):
        b, L, h_kv, nbytes, ours, peers = decode_problem(torch, shape, si)
        impls = {"cuflash": ours, **peers}
        if a.ncu:
            for fn in impls.values():
                fn()
            torch.cuda.synchronize()
            cupy.cuda.runtime.profilerStart()
            for fn in impls.values():
                fn()
            torch.cuda.synchronize()
            cupy.cuda.runtime.profilerStop()
            continue
        ms = time_ms(impls, repeats=15)
        print(f"=== b={b} L={L} h_kv={h_kv} ({nbytes / 1e9:.3f} GB of KV)", flush=True)
        for name, fn in impls.items():
            hu = host_us(fn, calls=100)
            calls = kernel_calls(torch, fn)
            span = statistics.median(c[0] for c in calls)
            ks = calls[len(calls) // 2][1]
            print(f"  {name:8} event {ms[name] * 1e3:8.1f} us ({nbytes / ms[name] / 1e9:5.2f} TB/s)  host {hu:6.1f} us  "
                  f"device span {span:8.1f} us ({nbytes / span / 1e6:5.2f} TB/s)", flush=True)
            for kname, dur in ks:
                print(f"      {dur:8.1f} us  {short(kname)}")
        spans = {}
        for s in a.splits:
            calls = kernel_calls(torch, lambda s=s: ours(s), calls=6)
            spans[s] = statistics.median(c[0] for c in calls)
        best = min(spans, key=spans.get)
        print("  cuflash span by num_splits: " + "  ".join(f"{s}:{v:.1f}" for s, v in spans.items()) + f"  (best {best})")
        for name, fn in impls.items() if a.back_to_back else ():
            ks = kernel_events(torch, fn, a.back_to_back, sync=False)
            t0, prev_end, cells = ks[0]["ts"], None, []
            for e in ks:
                gap = "" if prev_end is None else f" +{e['ts'] - prev_end:.1f}"
                cells.append(f"{e['ts'] - t0:.1f}({e['dur']:.1f}{gap})")
                prev_end = e["ts"] + e["dur"]
            print(f"  {name} back to back, start(duration +gap) us: {' '.join(cells)}; "
                  f"per call {(prev_end - t0) / a.back_to_back:.1f}")
        if si == 0 and a.cprofile:
            pr = cProfile.Profile()
            for _ in range(20):  # runs of 100 calls from an idle GPU: 2000 queued at once fill the launch
                cupy.cuda.get_current_stream().synchronize()  # queue, and the launches then block
                pr.enable()
                for _ in range(100):
                    ours()
                pr.disable()
            cupy.cuda.get_current_stream().synchronize()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            Path(a.cprofile).write_text(buf.getvalue())
        impls = ours = peers = None  # free the caches (held by the closures) before the next shape
        bench_decode._release_memory()


if __name__ == "__main__":
    main()
