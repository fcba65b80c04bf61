// FlashAttention-2 forward on Hopper warpgroup MMA (wgmma, sm_90a only).
//
// Computes exactly what flash_fwd.cuh computes (same math, masks, lse and output conventions; read
// its header first): O = softmax(scale * Q K^T + mask) V and lse per query row, one CTA per
// (query tile, head, batch), K/V tiles streamed through shared memory with an online softmax.
// What changes is how the two matrix products run:
//   S = Q K^T   one wgmma m64n{kBlockN}k16 per 16-wide k-step, both operands read by the tensor
//               cores straight from shared memory (no ldmatrix, no per-warp fragments of K);
//   O += P V    P stays in registers (the S accumulators, packed to 16 bits, are already the A
//               fragment layout) and V is read from shared memory as a transposed (N-major) B.
//
// Grid and tiles
//   grid  = (ceil(seqlen_q / kBlockM), nheads, batch), heaviest causal tiles first (as flash_fwd).
//   block = kBlockM / 64 warpgroups of 4 warps. Warpgroup w owns query rows [64w, 64w + 64) of the
//           tile and issues its own wgmmas; warp i of it owns rows 64w + 16i .. +15 for the softmax
//           (the wgmma accumulator layout, see wgmma.cuh). Every thread helps load every tile.
//   smem  = Q[kBlockM x d] + kStages x (K[kBlockN x d] + V[kBlockN x d]), each tile in the 128-byte
//           swizzled K-major layout wgmma reads (load_tile_sw128), 1024-byte aligned.
//   K/V tiles are double buffered with cp.async: tile j-1 streams in while tile j is used; after a
//   tile's cp.async group lands, each thread fences its writes into the async proxy
//   (fence.proxy.async) before the barrier that hands the tile to the tensor cores.
//   Epilogue: after the loop the K/V buffers are free; each warp stages its normalized O rows there
//   and writes 16-byte chunks (WarpTile::store).
//
// Preconditions (cuflash/plan/forward.py picks this kernel only then): sm_90a; head_dim % 8 == 0 and 16-byte
// aligned rows (the 16-byte cp.async path); head-dim bucket a multiple of 64.
#pragma once

#include "flash_fwd.cuh"  // FwdTileRef (masks and variants), WarpTile (softmax, epilogue)
#include "sm90_tile.cuh"

namespace cuflash {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kIsBF16_, bool kIsCausal_, int kMods_ = 0>
struct Sm90FwdConfig : Sm90WarpTileShape<kHeadDim_, kBlockN_> {  // (WarpTile's fields)
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kStages = kStages_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr int kMods = kMods_;  // attention variants (masks.cuh kMod* bits)

    static constexpr int kWarpGroups = kBlockM / 64;
    static constexpr int kNWarps = 4 * kWarpGroups;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kTileBytesQ = kBlockM * kHeadDim * 2;
    static constexpr int kTileBytesKV = kBlockN * kHeadDim * 2;
    // 1024 bytes of slack to align the dynamic shared memory base to the swizzle pattern.
    static constexpr int kSmemBytes = 1024 + kTileBytesQ + 2 * kStages * kTileBytesKV;

    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "whole 64-element swizzle atoms, N <= 256");
    static_assert(kBlockM % 64 == 0 && kBlockM <= 256, "whole warpgroups of 64 rows");
    static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "key tiles are wgmma N (multiple of 64 here)");
    static_assert(kStages == 2, "K/V tiles are double buffered");
    static_assert(kNWarps * 16 * Sm90WarpTileShape<kHeadDim_, kBlockN_>::kSmemStride * 2 <= 2 * kStages * kTileBytesKV,
                  "O staging fits in the K/V buffers");
};

template <class Cfg>
CUFLASH_DEVICE void flash_fwd_sm90_kernel(const FwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kNB = Cfg::kNBlocksS;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4;
    const int t = lane % 4;
    const FwdTileRef<Cfg> tile(p);  // pointers, rows, visited K/V blocks: as flash_fwd_kernel
    const u16 *g_q = tile.q, *g_k = tile.k, *g_v = tile.v;
    const int m0 = tile.m0, rows_valid = tile.rows_valid, n_block_end = tile.n_block_end;
    constexpr bool kWindow = FwdTileRef<Cfg>::Mask::kWindow;
    const int n_first = tile.first_block();  // (window) K/V tiles n_last down to n_first are visited, else down to 0
    const typename FwdTileRef<Cfg>::Mask mask = tile.mask;
    const int warp_row0 = warp * 16;
    if constexpr (FwdTileRef<Cfg>::kVarlen) {
        if (tile.skip()) return;  // a spare slot of the varlen scheduler
    }
    if (tile.empty()) {
        tile.write_empty(p, tid);
        return;
    }

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;  // swizzle pattern starts on 1024 bytes
    const u32 s_q = s_base;
    const u32 s_k0 = s_q + Cfg::kTileBytesQ;
    const u32 s_v0 = s_k0 + Cfg::kStages * Cfg::kTileBytesKV;
    auto s_k = [&](int j) { return s_k0 + (j & 1) * Cfg::kTileBytesKV; };
    auto s_v = [&](int j) { return s_v0 + (j & 1) * Cfg::kTileBytesKV; };
    auto load_kv = [&](int j) {
        const int n0 = j * kBlockN;
        load_tile_sw128<Cfg, kBlockN>(s_k(j), tile.kv_tile(p, g_k, n0, p.k_batch_stride, p.k_row_stride), p.k_row_stride,
                                      tile.keys(p) - n0, p.head_dim, tid);
        load_tile_sw128<Cfg, kBlockN>(s_v(j), tile.kv_tile(p, g_v, n0, p.v_batch_stride, p.v_row_stride), p.v_row_stride,
                                      tile.keys(p) - n0, p.head_dim, tid);
    };

    // Descriptors. A = this warpgroup's 64 rows of Q (K-major); B of S = K (K-major); B of O = V read
    // N-major: 64-column atoms kBlockN * 128 bytes apart, 8-key groups 1024 bytes apart. Stepping k by 16
    // moves 32 bytes inside a Q/K atom (atoms of 4 steps are kRows * 128 bytes apart), 16 keys of V 2048 bytes.
    const u64 desc_q = sw128_desc(s_q + wg * 64 * 128, 16);
    const u64 desc_k0 = sw128_desc(s_k0, 16);
    const u64 desc_v0 = sw128_desc(s_v0, kBlockN * 128);
    constexpr u64 kKVStageStep = Cfg::kTileBytesKV >> 4;

    WarpTile<Cfg> wt;
    wt.init(warp_row0, lane);
    const float scale_log2 = p.scale_log2;
    const int row_abs0 = m0 + warp_row0 + lane / 4;
    const int n_last = n_block_end - 1;
    float S[1][kNB][4];
    u32 keep[1][kNB / 2];  // dropout keep bits of the current tile (dropout only)
    float(&s_acc)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(S);
    float(&o_acc)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(wt.acc_o);

    // Prologue: Q and the first K/V tile.
    load_tile_sw128<Cfg, kBlockM>(s_q, g_q, p.q_row_stride, rows_valid, p.head_dim, tid);
    load_kv(n_last);
    cp_async_commit();

    for (int j = n_last; j >= 0; --j) {
        if constexpr (kWindow) {
            if (j < n_first) break;  // the window's first block was the last one
        }
        cp_async_wait<0>();
        fence_proxy_async_smem();
        // Tile j visible to every warpgroup's wgmmas; every warpgroup is done with tile j+1's stage.
        __syncthreads();
        if (kWindow ? j > n_first : j > 0) load_kv(j - 1);
        cp_async_commit();

        // S = Q K_j^T
        const u64 desc_k = desc_k0 + (j & 1) * kKVStageStep;
        wgmma_fence();
        wgmma_ss_kmajor<kBlockN, kBF16, Cfg::kKStepsQK, kBlockM, kBlockN>(s_acc, desc_q, desc_k);
        wgmma_commit();
        tile.draw_keep(keep, j, m0 + warp_row0, lane);  // (dropout) while the tensor cores compute S
        wgmma_wait<0>();
        wgmma_fence_operands(s_acc);

        tile.modify_scores(S, row_abs0, j * kBlockN + 2 * t);
        if (mask.block_needs_mask(m0, kBlockM, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t);
        wt.softmax(S, scale_log2);
        tile.drop(S, keep);

        // O += P V_j: P packed from the S accumulators into A fragments, one per 16-key step.
        u32 a[Cfg::kKStepsPV][4];
#pragma unroll
        for (int kk = 0; kk < Cfg::kKStepsPV; ++kk) {
            a[kk][0] = pack2<kBF16>(S[0][2 * kk][0], S[0][2 * kk][1]);
            a[kk][1] = pack2<kBF16>(S[0][2 * kk][2], S[0][2 * kk][3]);
            a[kk][2] = pack2<kBF16>(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
            a[kk][3] = pack2<kBF16>(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
        }
        const u64 desc_v = desc_v0 + (j & 1) * kKVStageStep;
        wgmma_fence_operands(o_acc);
        wgmma_fence();
        wgmma_rs_ksteps<kHeadDim, kBF16>(o_acc, a, desc_v);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o_acc);
    }

    // Every warpgroup's last wgmma has read its K/V tile: the K/V buffers become O staging rows.
    __syncthreads();
    u16* s_stage = reinterpret_cast<u16*>(smem_raw + (s_k0 - smem_u32(smem_raw))) + warp * 16 * Cfg::kSmemStride;
    wt.template store<(Cfg::kMods & kModDropout) != 0>(tile.o, p.o_row_stride, tile.lse, p.softmax_scale, warp_row0, rows_valid, p.head_dim, s_stage, lane,
             p.mod.dropout_rp);
}

}  // namespace cuflash
