"""Timeline of one decode call, CTA by CTA: where the split kernel's time goes between launch and end.

    python tools/trace_decode.py [--shapes 1,16384,32 ...] [--splits 0 1 ...] [--json FILE]

Builds the split-KV kernel with -DCUFLASH_DECODE_TRACE (cuda_src/flash_decode.cuh), which makes
thread 0 of every CTA record its SM, %globaltimer at start (after its wait for the kernel before
it), when its first K/V tile landed, when its main loop ended and when it exited, and clock64
deltas of the same steps. Per shape (batch,cache_len,
kv_heads; 32 query heads, head dim 128, bf16, one query token) and split count (0: the heuristic) it
prints the traced call's span next to the untraced kernel's and cuDNN's device spans (torch.profiler),
and how the span divides up:
  ours      our kernels (the middle one of 8 calls) and their times; --merge-max: who merges the splits
  first     launch of the CTA -> its first tile in shared memory (Q and one tile of latency), us
  loop      the CTA's main loop, us;  tail = its epilogue (warp merge, partial rows, merge of splits)
  start     CTA start offsets from the kernel's first start: quantiles show the waves
  end       CTA end offsets: p50 / p90 / max, and max - p90 (the last CTAs' tail)
  busy      sum of CTA lifetimes / (span * slots): how full the resident slots were
and cuDNN's kernels with their grid, block, registers and shared memory.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuflash import bench_decode, jit, kvcache, plan  # noqa: E402

SHAPES = ["1,16384,32", "1,65536,8", "8,8192,8", "8,4096,32", "64,4096,8", "8,131072,32"]
TRACE_ENTRIES = 8 * 16384  # 8 u64 per CTA


class Traced:
    """The traced build of every decode spec asked for, swapped in for kvcache's loaded kernels."""

    def __init__(self, extra_options=(), carveout=None):
        self.mods = {}
        self.extra = tuple(extra_options)
        self.carveout = carveout  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent), or the default
        self.orig = kvcache._plan_and_load.__wrapped__

    def function(self, spec):
        from cupy.cuda import driver, function

        if spec not in self.mods:
            cubin, header = jit.compile_cubin(spec, extra_options=(f"-DCUFLASH_DECODE_TRACE={TRACE_ENTRIES}",) + self.extra)
            mod = function.Module()
            mod.load(cubin)
            fn = mod.get_function(spec.name)
            if plan.max_launch_smem(spec) > 48 * 1024:  # padded launches too (fewer CTAs per SM)
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        plan.max_launch_smem(spec))  # fmt: skip
            if self.carveout is not None:
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, self.carveout)
            print(f"    traced build {spec.name}: {header['ptxas']}", flush=True)
            self.mods[spec] = (mod, fn)
        return self.mods[spec]

    def plan_and_load(self, *args):
        p, (fn_attn, fn_append, fn_combine) = self.orig(*args)
        return p, (self.function(p.attn.spec)[1], fn_append, fn_combine)

    def buffer(self, spec):
        import cupy

        mod, _ = self.mods[spec]
        ptr = mod.get_global_var("cuflash_decode_trace")
        mem = cupy.cuda.UnownedMemory(ptr, 8 * TRACE_ENTRIES, mod)
        return cupy.ndarray((TRACE_ENTRIES,), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(mem, 0))


def summarize(tr, ctas: int, slots: int) -> dict:
    import numpy as np

    t = tr[: 8 * ctas].reshape(ctas, 8).astype(np.int64)
    sm = t[:, 0]
    gt = t[:, 1:8].copy()
    for e in (1, 2):  # CTAs with no key (no tile, no main loop): those events are their start
        gt[:, e] = np.where(gt[:, e] == 0, gt[:, 0], gt[:, e])
    t0 = gt[:, 0].min()
    rel = np.where(gt > 0, (gt - t0) / 1e3, np.nan)  # us from the kernel's first start; nan: event not reached
    start, first, loop_end, end = rel[:, 0], rel[:, 1], rel[:, 2], rel[:, 3]
    span = np.nanmax(end)
    life = end - start
    q = lambda x, f: float(np.nanquantile(x, f))  # noqa: E731
    last = np.argsort(end)[-6:][::-1]
    return {
        "span_us": float(span),
        "first_us": [q(first - start, 0.5), q(first - start, 0.9), float(np.nanmax(first - start))],
        "loop_us": [float(np.nanmin(loop_end - first)), q(loop_end - first, 0.5), float(np.nanmax(loop_end - first))],
        "tail_us": [q(end - loop_end, 0.5), float(np.nanmax(end - loop_end))],
        "start_q": [q(start, f) for f in (0.1, 0.5, 0.9, 1.0)],
        "end_q": [q(end, 0.1), q(end, 0.5), q(end, 0.9), float(span)],
        "busy": float(np.nansum(life) / (span * slots)),
        "sms_used": int(len(np.unique(sm))),
        "max_ctas_per_sm": int(np.bincount(sm).max()),
        # The last CTAs to end: [cta, sm, start, first tile, loop done, partials written, counted, staged, end]
        "last_ctas": [[int(c), int(sm[c])] + [None if np.isnan(x) else round(float(x), 1)
                                              for x in rel[c, [0, 1, 2, 4, 5, 6, 3]]] for c in last],
    }


def peer_kernels(torch, fn) -> list:
    """One call of fn under torch.profiler: 'name  us  grid  block  regs  smem' per kernel."""
    from profile_decode import kernel_events

    out = []
    for e in kernel_events(torch, fn, 1):
        g = e.get("args", {})
        out.append(f"{e['name'][:60]}  {e['dur']:.1f} us  grid {g.get('grid')}  block {g.get('block')}  "
                   f"regs {g.get('registers per thread')}  smem {g.get('shared memory')}  "
                   f"blocks/SM {g.get('blocks per SM')}")
    return out


def main():
    import cupy

    from cuflash.bench import _torch
    from profile_decode import decode_problem, kernel_calls

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--splits", nargs="*", type=int, default=[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--carveout", type=int, default=None, help="also trace with this shared-memory carveout (percent)")
    ap.add_argument("--merge-max", type=int, default=None,
                    help="override plan.DECODE_IN_KERNEL_MERGE_MAX (partial rows per group the split kernel merges itself)")
    a = ap.parse_args()
    if a.merge_max is not None:
        plan.DECODE_IN_KERNEL_MERGE_MAX = a.merge_max
    torch = _torch()
    variants = {"default": Traced()}
    if a.carveout is not None:
        variants[f"carveout{a.carveout}"] = Traced(carveout=a.carveout)
    results = []
    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for si, shape in enumerate(a.shapes):
        b, L, h_kv, nbytes, ours, peers = decode_problem(torch, shape, si)
        cudnn = peers["cudnn"]
        print(f"=== b={b} L={L} h_kv={h_kv} ({nbytes / 1e9:.3f} GB)", flush=True)
        for k in peer_kernels(torch, cudnn):
            print(f"    cudnn {k}", flush=True)
        spans = {"cudnn": statistics.median(c[0] for c in kernel_calls(torch, cudnn))}
        for s in a.splits:
            kvcache._plan_and_load.cache_clear()
            dplan, _ = kvcache._plan_and_load.__wrapped__(  # the calls pass an int length: uniform
                b, 1, 32, h_kv, 128, "bf16", True, -(-L // 64) * 64, s, 0, False, cupy.cuda.Device().id, 0, True)
            calls = kernel_calls(torch, lambda s=s: ours(s))
            spans[f"s{s}"] = statistics.median(c[0] for c in calls)
            print("    ours  " + "  ".join(f"{n[:40]} {us:.1f} us" for n, us in calls[len(calls) // 2][1]), flush=True)
            for vname, traced in variants.items():
                kvcache._plan_and_load = _swap(kvcache._plan_and_load, traced.plan_and_load)
                try:
                    ours(s)
                    buf = traced.buffer(dplan.attn.spec)
                    buf.fill(0)
                    cupy.cuda.get_current_stream().synchronize()
                    ours(s)
                    cupy.cuda.get_current_stream().synchronize()
                    g = dplan.attn.grid
                    ctas = g[0] * g[1] * g[2]
                    r = summarize(buf.get(), ctas, num_sms * dplan.ctas_per_sm)  # the CTAs per SM it ran at
                    traced_span = statistics.median(c[0] for c in kernel_calls(torch, lambda s=s: ours(s)))
                finally:
                    kvcache._plan_and_load = kvcache._plan_and_load.orig
                r.update(shape=shape, variant=vname, splits=dplan.num_splits, ctas=ctas, span_untraced_us=spans[f"s{s}"],
                         span_cudnn_us=spans["cudnn"], span_traced_profiled_us=traced_span)
                results.append(r)
                print(f"  {vname:10} splits {dplan.num_splits:3d} ctas {ctas:5d}  span traced {r['span_us']:7.1f} "
                      f"(profiled {traced_span:7.1f}) untraced {spans[f's{s}']:7.1f} cudnn {spans['cudnn']:7.1f} us  "
                      f"busy {r['busy']:.3f}  sms {r['sms_used']} max/sm {r['max_ctas_per_sm']}", flush=True)
                fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)  # noqa: E731
                print(f"      first {fmt(r['first_us'])} (p50/p90/max)  loop {fmt(r['loop_us'])} (min/p50/max)  "
                      f"tail {fmt(r['tail_us'])}  start {fmt(r['start_q'])} (p10/50/90/max)  "
                      f"end {fmt(r['end_q'])} (p10/50/90/max)", flush=True)
                print("      last CTAs [cta, sm, start, first, loop, written, counted, staged, end]: "
                      + " ".join(str(x) for x in r["last_ctas"][:4]), flush=True)
        ours = peers = cudnn = None  # free the caches (held by the closures) before the next shape
        bench_decode._release_memory()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def _swap(cached, replacement):
    """A stand-in for kvcache._plan_and_load that calls ``replacement`` and remembers the original."""

    def f(*args):
        return replacement(*args)

    f.orig = cached
    f.cache_clear = cached.cache_clear
    return f


if __name__ == "__main__":
    main()
