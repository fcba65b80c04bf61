"""Host time per call of the PyTorch bridge against the CuPy API and SDPA (a decode step is host-bound).

    python3 tools/torch_host_overhead.py [--rounds N] [--profile [ROW]]   # needs a GPU and torch; --profile: cProfile of
                                                                          # row ROW's call (default 0, the decode call)

Prints microseconds of host time per call (calls queued back to back, GPU idle time excluded by
measuring before the final synchronize; the median of N rounds, default 5) for a decode step (batch 8, 16 heads, d 128, 2k cache, one new
token appended), a small prefill (2 x 512 tokens; SDPA's backends on the same inputs, in its layout) and the same
tokens as a packed batch of two sequences (varlen).
"""
import statistics
import sys
import time

import cupy
import torch

import cuflash
import cuflash.torch as ct


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, kn = torch.randn(8, 1, 16, 128, **bf), torch.randn(8, 1, 16, 128, **bf)
    kc, vc = torch.randn(8, 2048, 16, 128, **bf), torch.randn(8, 2048, 16, 128, **bf)
    lens = torch.full((8,), 1000, dtype=torch.int32, device="cuda")
    c = cupy.from_dlpack
    cq, ckc, cvc, ckn, cl = c(q), c(kc), c(vc), c(kn), c(lens)
    qs, ks = q.transpose(1, 2), kc.transpose(1, 2)[:, :, :1000]
    small = torch.randn(2, 512, 16, 128, **bf)
    small_grad = small.clone().requires_grad_()
    cs, ss = c(small), small.transpose(1, 2)
    packed, cu = small.reshape(1024, 16, 128), torch.tensor([0, 512, 1024], dtype=torch.int32, device="cuda")
    cpk, ccu = c(packed), c(cu)

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, ks)

    def sdpa_prefill(backend):
        def fn():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(ss, ss, ss, is_causal=True)

        return fn

    rows = [
        ("decode: cuflash.torch.flash_attn_with_kvcache", lambda: ct.flash_attn_with_kvcache(
            q, kc, vc, k=kn, v=kn, cache_seqlens=lens, causal=True)),
        ("decode: torch.ops.cuflash.fwd_kvcache (dispatcher)", lambda: torch.ops.cuflash.fwd_kvcache(
            q, kc, vc, kn, kn, None, None, lens, -1, None, None, None, None, None, True, -1, -1, 0.0, True, 0)),
        ("decode: cuflash.attention_with_kvcache (CuPy)", lambda: cuflash.attention_with_kvcache(
            cq, ckc, cvc, k=ckn, v=ckn, cache_seqlens=cl, causal=True)),
        ("decode: SDPA FlashAttention-2 (no append)", sdpa),
        ("prefill 2x512: cuflash.torch.flash_attn_func", lambda: ct.flash_attn_func(small, small, small, causal=True)),
        ("prefill 2x512: flash_attn_func, q needs grad", lambda: ct.flash_attn_func(small_grad, small, small,
                                                                                    causal=True)),
        ("prefill 2x512: cuflash.attention (CuPy)", lambda: cuflash.attention(cs, cs, cs, causal=True)),
        ("prefill 2x512: SDPA FlashAttention-2", sdpa_prefill(SDPBackend.FLASH_ATTENTION)),
        ("prefill 2x512: SDPA cuDNN", sdpa_prefill(SDPBackend.CUDNN_ATTENTION)),
        ("packed 2x512: cuflash.torch.flash_attn_varlen_func", lambda: ct.flash_attn_varlen_func(
            packed, packed, packed, cu, cu, 512, 512, causal=True)),
        ("packed 2x512: cuflash.attention_varlen (CuPy)", lambda: cuflash.attention_varlen(
            cpk, cpk, cpk, ccu, ccu, 512, 512, causal=True)),
    ]
    # Rounds over all rows in turn (the host's noise comes in bursts: one row measured once can read 3x
    # its median); the median and the spread per row.
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    times = {name: [] for name, _ in rows}
    for _ in range(rounds):
        for name, fn in rows:
            times[name].append(host_us(fn))
    print(f"{'call':52} {'host us':>8}  (median of {rounds} rounds; min-max)")
    for name, _ in rows:
        t = sorted(times[name])
        print(f"{name:52} {statistics.median(t):8.1f}  ({t[0]:.1f}-{t[-1]:.1f})")
    if "--profile" in sys.argv[1:]:  # where a call's host time goes, function by function
        import cProfile
        import pstats

        at = sys.argv.index("--profile") + 1
        row = int(sys.argv[at]) if at < len(sys.argv) and sys.argv[at].isdigit() else 0
        fn = rows[row][1]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\nprofile of 300 calls of {rows[row][0]} (cumulative seconds; / 300 for per call):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
