"""CPU-side checks that compile a few lines against cuflash's headers with NVRTC (no GPU needed)."""
from __future__ import annotations

import pytest

from cuflash import jit


def compile_static_asserts(lines: list[str], filename: str, arch: str = "sm_90a") -> None:
    """Compile ``lines`` (an #include of a kernel header, then static_asserts on its configs) for ``arch``;
    a failed assertion or any other compile error fails the calling test with NVRTC's log."""
    from cupy.cuda import nvrtc

    text = "\n".join(lines) + "\n"
    headers = jit.included_headers(text)
    prog = nvrtc.createProgram(text, filename, [h.encode() for h in headers.values()], [n.encode() for n in headers])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


#: A test kernel around varlen.cuh's varlen_find_seq (the packed-batch scheduler's search): one warp per
#: grid tile t writes the sequence it names. Compiled on the CPU by test_varlen_reference, run by test_varlen_gpu.
FIND_SEQ_SOURCE = r"""
#include "varlen.cuh"
extern "C" __global__ void cuflash_test_find_seq(const int* cu, int batch, int total, int block, int n_slots, int* out) {
    const int t = (int)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);  // uniform over the warp
    if (t >= n_slots) return;
    const int b = cuflash::varlen_find_seq(cu, batch, total, block, t);
    if (threadIdx.x % 32 == 0) out[t] = b;
}
"""


def find_seq_owners(cu: list[int], total: int, block: int, n_slots: int) -> list[int]:
    """What varlen_find_seq must return for grid tiles t = 0 .. n_slots - 1: the largest b < batch with
    clamp(cu[b]) // block + b <= t (cu clamped into [0, total]), or 0 where none is (a bad cu[0] >= block)."""
    import numpy as np

    f = np.minimum(np.maximum(np.asarray(cu[:-1], dtype=np.int64), 0), total) // block + np.arange(len(cu) - 1)
    out = []
    for t in range(n_slots):
        hits = np.nonzero(f <= t)[0]
        out.append(int(hits[-1]) if hits.size else 0)
    return out
