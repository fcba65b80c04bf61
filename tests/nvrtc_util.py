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
