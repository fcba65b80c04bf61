"""Where one attention call's GPU time goes, kernel by kernel: cuflash and SDPA's cuDNN and
FlashAttention-2 backends on the same inputs, each under the PyTorch profiler (CUPTI sees CuPy's
launches and memsets too), so fixed per-token costs (the backward's D = rowsum(dO * O), the zeroing and
conversion of the fp32 dQ accumulator) show beside the main kernel, where a short sequence pays them.

    python tools/kernel_times.py --op bwd --hd 128 --seqlen 512 [--causal] [--dtype fp16] [--iters 20]

Shapes as the benchmark grid's: 16k tokens per batch, 2048 / head_dim heads. Per implementation: every
kernel (and memset) with its launches per call and microseconds per call, then the sum. The sum is
GPU busy time; gaps between launches are not in it (cuflash bench times whole calls).
"""
from __future__ import annotations

import argparse
import math


def _times(torch, fn, iters: int) -> list[tuple[str, float, float]]:
    """(name, launches per call, us per call) of each GPU kernel / memset ``fn`` runs, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None)
        if total is None:
            total = getattr(ev, "cuda_time_total", 0.0)
        if total > 0 and ev.count > 0 and not ev.key.startswith(("cudaDeviceSynchronize", "ProfilerStep")):
            rows.append((ev.key, ev.count / iters, total / iters))
    return sorted(rows, key=lambda r: -r[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from cuflash import backward, forward
    from cuflash.checks import numpy_dtype

    b, h = max(1, 16384 // a.seqlen), 2048 // a.hd
    shape = (b, a.seqlen, h, a.hd)
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(numpy_dtype(a.dtype)) for _ in range(4))
    scale = 1.0 / math.sqrt(a.hd)
    out, lse = forward.run(q, k, v, causal=a.causal, softmax_scale=scale, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    impls = {}
    if a.op == "fwd":
        impls["cuflash"] = lambda: forward.run(q, k, v, causal=a.causal, softmax_scale=scale, out=out)
    else:
        impls["cuflash"] = lambda: backward.run(dout, q, k, v, out, lse, causal=a.causal, softmax_scale=scale,
                                                dq=grads[0], dk=grads[1], dv=grads[2])  # fmt: skip
    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
        if a.op == "fwd":
            def peer(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(tq, tk, tv, is_causal=a.causal, scale=scale)
        else:
            xs = [x.detach().requires_grad_() for x in (tq, tk, tv)]
            with sdpa_kernel(backend):
                tout = sdpa(*xs, is_causal=a.causal, scale=scale)

            def peer(xs=xs, tout=tout):
                return torch.autograd.grad(tout, xs, tdo, retain_graph=True)
        impls[name] = peer
    print(f"{a.op} {a.dtype} hd{a.hd} {'causal' if a.causal else 'full'} {a.seqlen} tokens, batch {b}, heads {h}"
          f" ({torch.cuda.get_device_name()})")  # fmt: skip
    sums = {}
    for name, fn in impls.items():
        rows = _times(torch, fn, a.iters)
        sums[name] = sum(r[2] for r in rows)
        print(f"\n{name}: {sums[name]:.1f} us of GPU time per call")
        for key, per_call, us in rows:
            print(f"  {us:9.1f} us  x{per_call:4.1f}  {key[:110]}")
    print("\n" + "  ".join(f"{n} {s:.1f} us" for n, s in sums.items()) +
          f"   cuflash / cudnn time {sums['cuflash'] / sums['cudnn']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
