// Shared-memory tiles of the Hopper (wgmma, sm_90a) kernels: the 128-byte swizzled K-major layout
// wgmma reads, its matrix descriptors, and k-step loops over such tiles. Used by flash_fwd_sm90.cuh
// and flash_bwd_sm90.cuh.
#pragma once

#include "primitives.cuh"
#include "wgmma.cuh"

namespace cuflash {

// What WarpTile (warp_tile.cuh) and FwdTileRef need from a Hopper forward config whose warps own 16 rows
// of the wgmma accumulators each, S is kBlockN keys wide and O kHeadDim: the configs inherit it.
template <int kHeadDim, int kBlockN>
struct Sm90WarpTileShape {
    static constexpr bool kAligned = true;
    static constexpr bool kQInRegs = false;
    static constexpr int kRowsPerWarp = 16;
    static constexpr int kMSlabs = 1;
    static constexpr int kNBlocksS = kBlockN / 8;
    static constexpr int kDBlocks = kHeadDim / 8;
    static constexpr int kKStepsQK = kHeadDim / 16;
    static constexpr int kKStepsPV = kBlockN / 16;
    static constexpr int kChunksPerRow = kHeadDim / 8;
    static constexpr int kSmemStride = kHeadDim + 8;  // padded staging rows (16 bytes of padding)
    static constexpr bool kKVSwizzled = false;        // (WarpTile's K/V layout: unused by wgmma)
    static constexpr int kKVStride = kSmemStride;
};

// Copy a kRows x kHeadDim row-major global tile (rows_valid real rows, head_dim real columns; the rest
// zero-filled) into the 128-byte swizzled K-major layout of wgmma: the head dim is cut in atoms of 64
// elements (128 bytes); atom a holds kRows rows of 128 bytes at byte a * kRows * 128, and within each
// 8-row group (1024 bytes) the 16-byte chunk c of row r is stored at chunk position c ^ (r % 8).
template <class Cfg, int kRows>
CUFLASH_DEVICE void load_tile_sw128(u32 s_tile, const u16* g_tile, i64 row_stride, int rows_valid, int head_dim,
                                    int tid) {
    constexpr int kC = Cfg::kChunksPerRow;
    constexpr int kChunks = kRows * kC;
    constexpr int kPasses = (kChunks + Cfg::kNThreads - 1) / Cfg::kNThreads;
    static_assert(Cfg::kNThreads % kC == 0 && (Cfg::kNThreads / kC) % 8 == 0,
                  "each thread keeps one column and one row-in-group: a fixed swizzled offset");
    constexpr int kRowsPerPass = Cfg::kNThreads / kC;
    const int c = tid % kC, row0 = tid / kC;
    const u32 s_off = (c / 8) * kRows * 128 + (((c % 8) ^ (row0 % 8)) * 16) + row0 * 128;
    const u16* g_walk = g_tile + row0 * row_stride + c * 8;
    const bool col_ok = c * 8 < head_dim;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int row = row0 + i * kRowsPerPass;
        if (kChunks % Cfg::kNThreads != 0 && row >= kRows) break;
        const bool valid = col_ok && row < rows_valid;
        cp_async_16(s_tile + s_off + i * kRowsPerPass * 128, valid ? g_walk : g_tile, valid);
        g_walk += kRowsPerPass * row_stride;
    }
}

// wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") for a 128-byte
// swizzled tile: start address, leading byte offset (K-major: unused; N-major: bytes between
// 64-element atoms along N), stride byte offset 1024 (between 8-row groups), swizzle mode 1.
CUFLASH_DEVICE u64 sw128_desc(u32 s_addr, u32 leading_bytes) {
    return static_cast<u64>((s_addr & 0x3FFFF) >> 4) | (static_cast<u64>(leading_bytes >> 4) << 16) |
           (static_cast<u64>(1024 >> 4) << 32) | (1ull << 62);
}

// Four 8x8 16-bit matrices from mma-layout fragments (r0..r3: this thread's packed pair of each) to
// shared memory, transposed (stmatrix .trans, sm_90): row i of stored matrix m, at the address lane
// 8 m + i gives, holds column i of fragment m (8 elements, 16 bytes).
CUFLASH_DEVICE void stmatrix_x4_trans(u32 s_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(s_addr), "r"(r0), "r"(r1), "r"(r2),
                 "r"(r3)
                 : "memory");
}

// The same, not transposed: row i of stored matrix m, at the address lane 8 m + i gives, holds row i
// of fragment m (the packed pairs of lanes 4 i .. 4 i + 3).
CUFLASH_DEVICE void stmatrix_x4(u32 s_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(s_addr), "r"(r0), "r"(r1), "r"(r2),
                 "r"(r3)
                 : "memory");
}

// Fence this thread's generic-proxy shared-memory writes (cp.async) before async-proxy reads (wgmma).
CUFLASH_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Byte offset >> 4 (descriptor units) of k-step ks (16 columns) in a K-major swizzled tile of kRows
// rows: 32 bytes per step inside a 64-column atom, atoms kRows * 128 bytes apart.
template <int kRows>
CUFLASH_DEVICE u64 kmajor_kstep(int ks) {
    return static_cast<u64>(((ks / 4) * kRows * 128 + (ks % 4) * 32) >> 4);
}

// acc = A B over kSteps k-steps of 16, A (kRowsA rows) and B (kRowsB rows) both K-major swizzled
// tiles in smem (desc_a, desc_b: their first step). The caller fences, commits and waits.
template <int kN, bool kBF16, int kSteps, int kRowsA, int kRowsB>
CUFLASH_DEVICE void wgmma_ss_kmajor(float (&acc)[kN / 2], u64 desc_a, u64 desc_b) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
        wgmma_ss<kN, kBF16>(acc, desc_a + kmajor_kstep<kRowsA>(ks), desc_b + kmajor_kstep<kRowsB>(ks), ks > 0);
    }
}

// acc (+)= A B over kSteps k-steps of 16: A fragments from registers (a[kk]), B an N-major tile whose
// 16-row k-steps lie 2048 bytes apart (desc_b: the first).
template <int kN, bool kBF16, int kSteps>
CUFLASH_DEVICE void wgmma_rs_ksteps(float (&acc)[kN / 2], const u32 (&a)[kSteps][4], u64 desc_b) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) wgmma_rs<kN, kBF16>(acc, a[kk], desc_b + static_cast<u64>((kk * 16 * 128) >> 4));
}

}  // namespace cuflash
