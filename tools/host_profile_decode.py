"""Where the host time of one decode call goes: host microseconds per call (cuflash.bench.host_us,
the bench's measure, and runs of 100 calls from an idle GPU) of cuflash and torch SDPA's peers on
one `cuflash bench --decode` shape, and the cost of a few pieces on their own (the launch with and
without PDL, the plan memo, the device context). A cProfile of cuflash's calls:
tools/profile_decode.py --cprofile FILE.

    python tools/host_profile_decode.py [--shape 8,8192,8]

Why it matters on the GPU side too: cuflash.bench.time_ms times 5 back-to-back calls from an idle
GPU, so the first call's host time until its launch is in every sample (a fifth of it per call).
"""
import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import bench_decode, jit, kvcache  # noqa: E402
from cuflash.bench import host_us  # noqa: E402


def _per_call_us(fn, calls: int = 100, rounds: int = 7) -> float:
    """Host microseconds per call: the best of ``rounds`` runs of ``calls`` calls, each run started on
    an idle GPU (a few hundred queued kernels never fill the launch queue, which would block)."""
    import cupy

    best = float("inf")
    for _ in range(rounds):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    cupy.cuda.Device().synchronize()
    return best / calls * 1e6


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,8192,8", help="batch,cache_len,kv_heads (32 query heads, hd128, bf16)")
    a = ap.parse_args()
    b, L, hk = map(int, a.shape.split(","))
    rng = cupy.random.default_rng(0)
    q = bench_decode._random((b, 1, bench_decode.NHEADS, 128), "bf16", rng)
    kc, vc = (bench_decode._random((b, L, hk, 128), "bf16", rng) for _ in "kv")
    out = cupy.empty_like(q)
    scale = 1 / math.sqrt(128)

    def ours():
        return kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=L, softmax_scale=scale, out=out)

    fns = {"cuflash": ours}
    torch = bench_decode._torch()
    if torch is not None:
        from torch.nn.attention import SDPBackend

        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, kc, vc))
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fns[name] = bench_decode._sdpa_peer(torch, backend, tq, tk, tv, scale, hk != bench_decode.NHEADS)
    for fn in fns.values():
        fn()
    cupy.cuda.Device().synchronize()
    print(f"b={b} L={L} h_kv={hk}: host us per call (bench's host_us, 200 calls; best of 7 x 100 calls)")
    for name, fn in fns.items():
        print(f"  {name:8s} {min(host_us(fn, calls=200) for _ in range(3)):7.1f} {_per_call_us(fn):7.1f}")

    # Pieces on their own (no GPU work but the launch itself).
    dplan, (fn_attn, _, _) = kvcache._plan_and_load(b, 1, bench_decode.NHEADS, hk, 128, "bf16", True,
                                                    -(-L // 64) * 64, 0, 0, False, q.device.id, 0, True)  # fmt: skip
    stream = cupy.cuda.get_current_stream().ptr

    def device_context():
        with cupy.cuda.Device(q.device.id):
            pass

    from cupy.cuda import driver

    g, blk = dplan.attn.grid, dplan.attn.block
    pieces = {
        "launch (jit.launch, args as packed last)": lambda: jit.launch(fn_attn, dplan.attn, kvcache._ARGS.argv_ptr, stream),
        "launch without PDL (cupy driver.launchKernel)": lambda: driver.launchKernel(
            fn_attn.ptr, g[0], g[1], g[2], blk[0], blk[1], blk[2], dplan.attn.smem_bytes, stream,
            kvcache._ARGS.argv_ptr, 0),
        "plan memo lookup": lambda: kvcache._plan_and_load(b, 1, bench_decode.NHEADS, hk, 128, "bf16", True,
                                                           -(-L // 64) * 64, 0, 0, False, q.device.id, 0, True),
        "cupy current stream ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "with cupy.cuda.Device(id)": device_context,
        "q.device.id": lambda: q.device.id,
        "q.data.ptr x4": lambda: (q.data.ptr, kc.data.ptr, vc.data.ptr, out.data.ptr),
    }
    print("pieces, us per call:")
    for name, fn in pieces.items():
        fn()
        print(f"  {name:46s} {_per_call_us(fn):6.2f}")


if __name__ == "__main__":
    main()
