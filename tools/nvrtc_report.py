"""Print NVRTC's version and its raw -Xptxas=-v log for a tiny kernel per arch (diagnostics)."""
from cupy.cuda import nvrtc

SRC = 'extern "C" __global__ void k(float* x){ x[threadIdx.x] = 1.0f; }'
print("NVRTC", nvrtc.getVersion())
for arch in ("sm_80", "sm_90", "sm_90a"):
    for opts in (["-arch=" + arch, "-Xptxas=-v"], ["-arch=" + arch, "--ptxas-options=-v"]):
        prog = nvrtc.createProgram(SRC, "k.cu", [], [])
        nvrtc.compileProgram(prog, opts)
        print(arch, opts[1], repr(nvrtc.getProgramLog(prog)[:400]))
        nvrtc.destroyProgram(prog)

# The real forward kernel, as cuflash compiles it (headers from memory).
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import jit, plan  # noqa: E402

for arch in ("sm_80", "sm_90a"):
    spec = plan.fwd_spec(64, "bf16", False, True, arch)
    text = jit.entry_source(spec)
    headers = jit.included_headers(text)
    prog = nvrtc.createProgram(text, spec.name + ".cu", [h.encode() for h in headers.values()], [n.encode() for n in headers])
    nvrtc.compileProgram(prog, list(jit.compile_options(arch)))
    print(spec.name, repr(nvrtc.getProgramLog(prog)[:600]))
    nvrtc.destroyProgram(prog)
