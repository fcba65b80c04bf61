// Small device primitives shared by every cuflash kernel: tensor-core MMA, ldmatrix, cp.async,
// packing and exp2. Everything is inline PTX so the sources need no CUDA header at all (NVRTC
// compiles them with nothing on its include path but cuda_src/).
//
// Naming: s_ prefix = pointer into shared memory, g_ = global memory, r_ / plain = registers.
// Element type on the host side is a 2-byte float (fp16 or bf16); here it is carried as its raw
// bits (u16) and only the MMA / convert instructions know which format it is (kIsBF16).
#pragma once

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define CUFLASH_DEVICE __device__ __forceinline__

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) == exp2(x * kLog2e)
constexpr float kInf = 1.0f / 0.0f;  // +infinity (IEEE division, folded at compile time)

CUFLASH_DEVICE u32 smem_u32(const void* s_ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(s_ptr));
}

// ---- cp.async: 16 bytes global -> shared, bypassing registers (sm_80+) ----
// src_bytes == 0 writes 16 zero bytes and reads nothing (used for rows/columns outside the tensor).
CUFLASH_DEVICE void cp_async_16(u32 s_dst, const void* g_src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s_dst), "l"(g_src), "r"(src_bytes));
}
CUFLASH_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
CUFLASH_DEVICE void cp_async_wait() {  // wait until at most kPending committed groups are in flight
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- Programmatic dependent launch (sm_90+; both are no-ops before, and without a PDL launch) ----
// grid_dependency_wait: until the grid launched before this one on the stream has finished and its
// writes are visible (call it before the first global memory access). grid_launch_dependents: the
// grid launched after this one may start its CTAs once every CTA of this grid has called it (or
// exited); they then wait in their own grid_dependency_wait.
CUFLASH_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
CUFLASH_DEVICE void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into the MMA fragment layout ----
// Lanes 8i..8i+7 give the row addresses of matrix i; thread t receives row t/4, columns
// 2*(t%4)..2*(t%4)+1 of each matrix (of the transposed matrix with .trans) in r[i].
CUFLASH_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 s_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s_addr));
}
CUFLASH_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 s_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s_addr));
}

// ---- mma.sync m16n8k16, fp32 accumulate: D[16x8] += A[16x16] * B[16x8] ----
// Fragments (g = lane/4, t = lane%4):
//   A: a[0] = (row g,   k 2t..2t+1), a[1] = (row g+8, k 2t..), a[2] = (row g, k 2t+8..), a[3] = (row g+8, k 2t+8..)
//   B: b[0] = (k 2t..2t+1, col g),   b[1] = (k 2t+8..2t+9, col g)
//   D: d[0..1] = (row g, col 2t..2t+1), d[2..3] = (row g+8, col 2t..2t+1)
template <bool kIsBF16>
CUFLASH_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (kIsBF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two fp32 -> one register of two 2-byte floats, round to nearest even; lo in the low half.
template <bool kIsBF16>
CUFLASH_DEVICE u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (kIsBF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// 2^x with the SFU (ex2.approx, ~2 ulp); exp2(-inf) == 0.
CUFLASH_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Reductions over the 4 threads of a quad (the threads that share one MMA row).
CUFLASH_DEVICE float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
CUFLASH_DEVICE float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One 2-byte float (raw bits) -> fp32.
template <bool kIsBF16>
CUFLASH_DEVICE float to_float(u16 x) {
    if constexpr (kIsBF16) {
        return __uint_as_float(static_cast<u32>(x) << 16);  // bf16 is the top half of an fp32
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}

CUFLASH_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// ---- fp32 reductions into global memory ----
// g[0..3] += (a, b, c, d); g 16-byte aligned. One vector reduction on sm_90+, four scalar ones before.
CUFLASH_DEVICE void red_add_f32x4(float* g, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(g), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    atomicAdd(g, a);
    atomicAdd(g + 1, b);
    atomicAdd(g + 2, c);
    atomicAdd(g + 3, d);
#endif
}

// ---- Ordering between CTAs (the deterministic backward's dQ turn counters) ----
CUFLASH_DEVICE int ld_acquire_gpu(const int* g_ptr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(g_ptr) : "memory");
    return v;
}
CUFLASH_DEVICE void red_release_gpu_add(int* g_ptr, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(g_ptr), "r"(v) : "memory");
}

CUFLASH_DEVICE int ceil_div_nonneg(int a, int b) { return a <= 0 ? 0 : (a + b - 1) / b; }

// Type T if kCond, else F (std::conditional_t; the sources include no standard header).
template <bool kCond, class T, class F>
struct ChooseType {
    using type = T;
};
template <class T, class F>
struct ChooseType<false, T, F> {
    using type = F;
};
template <bool kCond, class T, class F>
using Choose = typename ChooseType<kCond, T, F>::type;

}  // namespace cuflash
