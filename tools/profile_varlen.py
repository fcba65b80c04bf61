"""One even dense forward and one packed forward of the same tokens (the packed one of equal lengths, the
dense batch's sequences, or --ragged: bench_varlen's lengths), each run twice (the first compiles), for ncu:
where packing costs time.

    ncu --clock-control none -k regex:flash_fwd --launch-skip 0 --section WarpStateStats ... \\
        python tools/profile_varlen.py --hd 64 --mean 512
"""
import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=64)
    ap.add_argument("--mean", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--ragged", action="store_true", help="the packed batch with bench --varlen's lengths")
    a = ap.parse_args()
    import cupy
    import numpy as np

    import cuflash
    from cuflash.bench_varlen import draw_lengths
    from cuflash.checks import BF16

    n = a.tokens // a.mean
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((n * a.mean, a.heads, a.hd), dtype=cupy.float32).astype(BF16) for _ in range(3))
    lengths = draw_lengths(a.mean, n * a.mean) if a.ragged else [a.mean] * n
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    for _ in range(2):
        cuflash.attention(*(x.reshape(n, a.mean, a.heads, a.hd) for x in (q, k, v)), causal=a.causal)
        cuflash.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=a.causal)
    cupy.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
