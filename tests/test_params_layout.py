"""The NumPy records that fill the kernels' parameter structs have exactly the C layout of
cuda_src/params.h: the header is compiled by the host C compiler, which prints every field's
offset and size and the struct's size. A field out of order or of the wrong width would make a
kernel read garbage, so this is checked for every struct in cuflash.params.STRUCTS."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from cuflash import jit, params

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
