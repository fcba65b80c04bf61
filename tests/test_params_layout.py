"""The NumPy records that fill the kernels' parameter structs have exactly the C layout of
cuda_src/params.h: the header is compiled by the host C compiler, which prints every field's
offset and size and the struct's size. A field out of order or of the wrong width would make a
kernel read garbage, so this is checked for every struct in cuflash.params.STRUCTS."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from cuflash import jit, launch, params

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.skipif(CC is None, reason="no host C compiler (cc/gcc/clang) to compile cuda_src/params.h with")
@pytest.mark.parametrize("struct", sorted(params.STRUCTS))
def test_struct_layout_matches_numpy(struct, tmp_path):
    dtype = params.STRUCTS[struct]
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "params.h"', "int main(void) {"]
    lines.append(f'    printf("size %zu\\n", sizeof(struct {struct}));')
    for name in dtype.names:
        lines.append(
            f'    printf("{name} %zu %zu\\n", offsetof(struct {struct}, {name}), sizeof(((struct {struct}*)0)->{name}));'
        )
    lines += ["    return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([CC, "-std=c11", "-I", str(jit.source_dir()), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    c_layout = {parts[0]: tuple(int(x) for x in parts[1:]) for parts in (line.split() for line in out) if parts}
    assert c_layout.pop("size") == (dtype.itemsize,), f"sizeof(struct {struct}) differs from the NumPy record"
    for name in dtype.names:
        field_dtype, offset = dtype.fields[name][:2]
        assert c_layout[name] == (offset, field_dtype.itemsize), (
            f"{struct}.{name}: C (offset, size) {c_layout[name]} vs NumPy {(offset, field_dtype.itemsize)}"
        )


#: cuda.h's CUlaunchConfig / CUlaunchAttribute (CUDA 12 and 13): (size, {field: offset}).
LAUNCH_STRUCTS = {
    "CULaunchConfig": ("CUlaunchConfig", 56, {"grid": ("gridDimX", 0), "shared_mem_bytes": ("sharedMemBytes", 24),
                                              "stream": ("hStream", 32), "attrs": ("attrs", 40),
                                              "num_attrs": ("numAttrs", 48)}),
    "CULaunchAttribute": ("CUlaunchAttribute", 72, {"id": ("id", 0), "value": ("value", 8)}),
}  # fmt: skip


@pytest.mark.parametrize("struct", sorted(LAUNCH_STRUCTS))
def test_launch_ex_structs_match_cuda_h(struct, tmp_path):
    """The ctypes structs launch.launch hands to cuLaunchKernelEx have cuda.h's layout: checked against the
    header itself where a CUDA toolkit is installed, and always against its documented offsets."""
    import ctypes

    c_name, size, fields = LAUNCH_STRUCTS[struct]
    py = getattr(launch, struct)
    assert ctypes.sizeof(py) == size and ctypes.alignment(py) == 8
    for py_field, (_, offset) in fields.items():
        assert getattr(py, py_field).offset == offset, f"{struct}.{py_field}"
    assert launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    include = next((d for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if d and
                    os.path.exists(os.path.join(d, "include", "cuda.h"))), None)  # fmt: skip
    if CC is None or include is None:
        pytest.skip("no CUDA toolkit header (cuda.h) or host C compiler to compare with")
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <cuda.h>", "int main(void) {",
             f'    printf("size %zu\\n", sizeof({c_name}));']  # fmt: skip
    lines += [f'    printf("{c} %zu\\n", offsetof({c_name}, {c}));' for c, _ in fields.values()]
    lines += ['    printf("pss %d\\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);', "    return 0;", "}"]
    src, exe = tmp_path / "launch.c", tmp_path / "launch"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([CC, "-std=c11", "-I", os.path.join(include, "include"), str(src), "-o", str(exe)], check=True)
    out = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())  # fmt: skip
    assert int(out.pop("size")) == size and int(out.pop("pss")) == 6
    assert {c: int(v) for c, v in out.items()} == {c: off for c, off in fields.values()}


def test_fast_divisor_divides_exactly_over_the_kernels_range():
    """FastDiv (params.h; flash_fwd.cuh fast_div): (n * mul >> 32) >> shift == n // d for every 0 <= n < 2^31,
    checked at every divisor up to 4096 and around each power of two up to 2^31 - 1, at n near 0, near every
    multiple of d up to 2^16 d, near 2^31 and at random; mul fits 32 bits. Divisors outside [1, 2^31) are an error."""
    import random

    rng = random.Random(0)
    top = (1 << 31) - 1
    divisors = set(range(1, 4097)) | {(1 << k) + e for k in range(12, 31) for e in (-1, 0, 1)} | {top}
    divisors |= {rng.randrange(2, top) for _ in range(500)}
    for d in sorted(divisors):
        dd, mul, shift = params.fast_divisor(d)
        assert dd == d and 0 <= mul < 1 << 32 and 0 <= shift < 31
        ns = {0, 1, 2, top, top - 1, top - d + 1} | {rng.randrange(0, 1 << 31) for _ in range(64)}
        ns |= {k * d + e for k in (1, 2, 3, 1 << 8, 1 << 16, top // d) for e in (-1, 0, 1)}
        for n in ns:
            if 0 <= n <= top:
                assert (n if d == 1 else (n * mul >> 32) >> shift) == n // d, (d, n)
    for bad in (0, -3, 1 << 31):
        with pytest.raises(ValueError, match="FastDiv"):
            params.fast_divisor(bad)
