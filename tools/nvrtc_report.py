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
