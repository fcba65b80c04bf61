"""Ring attention (cuflash.torch.ring) on several GPUs against one GPU: the context-parallel issue's bar
(128k tokens, causal, forward + backward, at least 1.8x one GPU's speed on 2 H200s) and a length one GPU
cannot hold.

    python3 tools/bench_ring.py [--world N] [--seqlen 131072] [--heads 16] [--head-dim 128] [--no-causal]
                                [--window LEFT RIGHT] [--repeats 5] [--skip-single] [--simulate W] [--json FILE]

Spawns N processes (default: every GPU), one per GPU, joined over NCCL (NVLink multicast off, as the
device docs ask). Each rank makes its own random bf16 slice of a (1, seqlen, heads, head_dim) sequence
(seqlen / N tokens: with causal, the two zigzag halves' worth), runs 2 untimed forward + backward
passes of ring_attention, then --repeats timed ones (CUDA events, the ranks aligned by a barrier before
each), and writes its times and peak memory. A pass's time is the slowest rank's. Then this process
times one cuflash call on the whole sequence on GPU 0 (flash_attn_func, forward + backward), or records
that it does not fit. Prints one line per measurement, then the speedup; --json writes them all.

--simulate W (one GPU): no processes; simulate_ring runs the W ranks' steps one after another on GPU 0,
and the one-GPU call is timed beside it. W x one call / the simulated pass bounds what W GPUs can gain
over one with the traffic fully hidden (each rank does 1/W of the simulated work): the part of the bar
one GPU can measure. --window: flash-attn's window_size over the whole sequence (zigzag slices).

--device cpu runs the same over gloo with the ops' float64 CPU kernels (tests/torch_cpu_kernels.py) at
a tiny size: a check of the tool itself (tests/test_bench_ring_cpu.py), not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _setup_device(device: str):
    """The torch module with cuflash's ops ready on ``device`` ("cuda", or "cpu": the tests' CPU kernels)."""
    import torch

    if device == "cpu":
        sys.path.insert(0, str(TESTS))
        import torch_cpu_kernels

        torch_cpu_kernels.register()
    else:  # (the device docs: keep NVLink multicast off on the multi-GPU machines)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    return torch


def _dtype(torch, device: str):
    return torch.bfloat16 if device == "cuda" else torch.float64  # (the CPU kernels compute in float64)


def _elapsed(torch, device: str, fn) -> float:
    """Milliseconds of ``fn()`` on ``device``'s stream (CUDA events), or of the host (CPU)."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _rank_main(rank: int, world: int, init_file: str, a: argparse.Namespace, result: str) -> None:
    torch = _setup_device(a.device)
    import torch.distributed as dist

    from cuflash.torch import ring

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)
        local = a.seqlen // world
        q, k, v, dout = (torch.randn((1, local, a.heads, a.head_dim), device=dev, generator=gen).to(_dtype(torch, a.device))
                         for _ in range(4))  # fmt: skip
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def step():
            out = ring.ring_attention(q, k, v, causal=a.causal, window_size=a.window)
            out.backward(dout)

        times = []
        for i in range(2 + a.repeats):
            dist.barrier()
            ms = _elapsed(torch, a.device, step)
            if i >= 2:
                times.append(ms)
        peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
        Path(f"{result}.{rank}").write_text(json.dumps({"times_ms": times, "peak_bytes": peak}))
    finally:
        dist.destroy_process_group()


def _single(a: argparse.Namespace) -> dict:
    """One cuflash call on the whole sequence on one device, forward + backward: times and peak memory, or
    why it did not run."""
    torch = _setup_device(a.device)
    import cuflash.torch as ct
    from cuflash.torch import ring

    cuda = a.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        gen = torch.Generator(device=dev).manual_seed(7)
        q, k, v, dout = (torch.randn((1, a.seqlen, a.heads, a.head_dim), device=dev, generator=gen).to(_dtype(torch, a.device))
                         for _ in range(4))  # fmt: skip
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)

        def step():
            if cuda:
                ct.flash_attn_func(q, k, v, causal=a.causal, window_size=a.window).backward(dout)
            else:  # (flash_attn_func takes CUDA tensors only: the ring's schedule on one slice, one kernel call)
                ring.simulate_ring([q], [k], [v], causal=a.causal, window_size=a.window)[0].backward(dout)

        times = [_elapsed(torch, a.device, step) for _ in range(2 + a.repeats)][2:]
        return {"times_ms": times, "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else 0}
    except torch.cuda.OutOfMemoryError as e:  # (a length one GPU cannot hold: the ring's other point)
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}


def _simulated(a: argparse.Namespace, world: int) -> dict:
    """simulate_ring over ``world`` slices of one sequence on one device, forward + backward: times."""
    torch = _setup_device(a.device)
    from cuflash.torch import ring

    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k, v, dout = (torch.randn((1, a.seqlen, a.heads, a.head_dim), device=dev, generator=gen).to(_dtype(torch, a.device))
                     for _ in range(4))  # fmt: skip
    zigzag = a.causal or tuple(a.window) != (-1, -1)
    shard = (lambda x, r: ring.zigzag_shard(x, r, world)) if zigzag else (lambda x, r: x.chunk(world, dim=1)[r])
    qs, ks, vs = ([shard(x, r).contiguous().requires_grad_() for r in range(world)] for x in (q, k, v))
    douts = [shard(dout, r).contiguous() for r in range(world)]

    def step():
        outs = ring.simulate_ring(qs, ks, vs, causal=a.causal, window_size=a.window)
        torch.autograd.backward(outs, douts)

    return {"times_ms": [_elapsed(torch, a.device, step) for _ in range(2 + a.repeats)][2:]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=0, help="processes, one per GPU (default: every GPU)")
    ap.add_argument("--seqlen", type=int, default=131072, help="tokens of the whole sequence")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                    help="sliding window over the whole sequence (flash-attn's window_size; -1 unbounded)")
    ap.add_argument("--simulate", type=int, default=0, metavar="W",
                    help="one GPU: the W ranks' steps in one process (simulate_ring) against one call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-single", action="store_true", help="do not time the one-GPU call")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    torch = _setup_device(a.device)
    a.window = tuple(a.window)
    world = a.simulate or a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    if world < 1 or a.device == "cuda" and not a.simulate and world > torch.cuda.device_count():
        sys.exit(f"--world {world}: this machine has {torch.cuda.device_count()} GPUs")
    unit = 2 * world if a.causal or a.window != (-1, -1) else world  # (zigzag: two halves per rank)
    if a.seqlen % unit:
        sys.exit(f"--seqlen must be a multiple of {unit} (world {world}"
                 f"{', zigzag halves: causal or a window' if unit == 2 * world else ''})")
    import torch.multiprocessing as mp

    import cuflash
    from cuflash import bench

    flops = bench.op_flops("fwd+bwd", 1, a.seqlen, a.seqlen, a.heads, a.head_dim, a.causal)  # (cuflash bench's count)
    if a.window != (-1, -1):  # the pairs the window leaves (cuflash bench --variant's count)
        from cuflash.bench_variants import visible_pairs

        full = bench.op_flops("fwd+bwd", 1, a.seqlen, a.seqlen, a.heads, a.head_dim, False)
        flops = full * visible_pairs(a.seqlen, a.seqlen, a.causal, a.window) / a.seqlen**2
    res = {"world": world, "seqlen": a.seqlen, "heads": a.heads, "head_dim": a.head_dim, "causal": a.causal,
           "window": list(a.window), "simulated": bool(a.simulate),
           "environment": bench.environment() if a.device == "cuda" else {"device": "cpu", "torch": torch.__version__,
                                                                          "cuflash": cuflash.__version__}}  # fmt: skip
    if a.simulate:
        sim = _simulated(a, world)
        sim["ms"] = statistics.median(sim["times_ms"])
        res["ring"] = sim
        print(f"ring  x{world} simulated on one GPU: {sim['ms']:9.2f} ms (all ranks' work, one after another)", flush=True)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/rank"
            mp.spawn(_rank_main, args=(world, f"{tmp}/init", a, out), nprocs=world, join=True)
            ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
        per_pass = [max(r["times_ms"][i] for r in ranks) for i in range(a.repeats)]
        res["ring"] = {"ms": statistics.median(per_pass), "times_ms": per_pass,
                       "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks]}  # fmt: skip
        res["ring"]["tflops"] = flops / res["ring"]["ms"] / 1e9
        print(f"ring  x{world}: {res['ring']['ms']:9.2f} ms  {res['ring']['tflops']:7.1f} TFLOP/s  peak "
              f"{max(res['ring']['peak_bytes_per_rank']) / 2**30:.1f} GiB per GPU", flush=True)  # fmt: skip
    if not a.skip_single:
        single = _single(a)
        res["single"] = single
        if "error" in single:
            print(f"single GPU: {single['error']}")
        else:
            single["ms"] = statistics.median(single["times_ms"])
            single["tflops"] = flops / single["ms"] / 1e9
            print(f"single GPU: {single['ms']:9.2f} ms  {single['tflops']:7.1f} TFLOP/s  peak "
                  f"{single['peak_bytes'] / 2**30:.1f} GiB")  # fmt: skip
            if a.simulate:  # (each of W ranks would do 1/W of the simulated work)
                res["speedup_bound"] = world * single["ms"] / res["ring"]["ms"]
                print(f"speedup bound on {world} GPUs with the traffic hidden (W x one call / simulated): "
                      f"{res['speedup_bound']:.2f}x")  # fmt: skip
            else:
                res["speedup"] = single["ms"] / res["ring"]["ms"]
                print(f"speedup of the ring over one GPU: {res['speedup']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
