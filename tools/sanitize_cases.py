"""Small ragged forward and backward cases for compute-sanitizer (memcheck / racecheck) on the GPU.

CuPy's memory pool hides out-of-bounds accesses inside its big blocks, so the pool is disabled
and every array is its own cudaMalloc. Exits non-zero if a result is wrong.
    compute-sanitizer --tool memcheck python tools/sanitize_cases.py
"""
import sys
from pathlib import Path

import cupy

cupy.cuda.set_allocator(None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import numpy as np  # noqa: E402
from gpu_util import check_backward, check_forward, randn  # noqa: E402

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, dtype, layout)
    (1, 77, 45, 2, 1, 64, True, "bf16", "bshd"),
    (2, 45, 77, 2, 2, 64, False, "fp16", "bhsd"),
    (1, 130, 130, 1, 1, 128, True, "bf16", "bshd"),
    (1, 33, 200, 2, 1, 128, False, "bf16", "bshd"),
    (1, 70, 70, 1, 1, 256, True, "fp16", "bshd"),
    (1, 50, 90, 1, 1, 100, True, "bf16", "bshd"),  # scalar-load path
    (1, 19, 23, 2, 2, 33, False, "fp16", "bshd"),  # scalar-load path
    (1, 200, 40, 1, 1, 160, True, "bf16", "bshd"),  # rows that see no key
]


def main():
    rng = np.random.default_rng(0)
    for b, sq, sk, h, hk, d, causal, dt, layout in CASES:
        q = randn(rng, (b, sq, h, d), dt, layout)
        k = randn(rng, (b, sk, hk, d), dt, layout)
        v = randn(rng, (b, sk, hk, d), dt, layout)
        err, bound = check_forward(q, k, v, causal=causal, dtype=dt)
        print(f"ok fwd b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {dt} {layout}: err {err:.2e} <= {bound:.2e}")
        for deterministic in (False, True):
            errors = check_backward(q, k, v, causal=causal, dtype=dt, deterministic=deterministic)
            print(f"ok bwd deterministic={deterministic}: " + ", ".join(f"{n} {e:.2e} <= {bd:.2e}" for n, (e, bd) in errors.items()))
    cupy.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
