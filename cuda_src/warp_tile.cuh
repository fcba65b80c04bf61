// The per-warp steps of FlashAttention-2 on mma.sync tensor cores, shared by the forward kernel
// (flash_fwd.cuh), the Hopper forward's softmax and epilogue (flash_fwd_sm90.cuh) and the decode split
// kernel (flash_decode.cuh); and the tile loads into shared memory of the mma.sync kernels.
//
// A warp owns 16-row slabs of the query tile and runs, per K/V tile (Dao 2023, Algorithm 1):
//   S = Q K^T         S[r][c] = sum_d Q[r][d] K[c][d]                        (gemm_qk)
//   online softmax    m_new = max(m, rowmax S); P = exp2(S * scale_log2 - m_new * scale_log2);
//                     l = l * exp2((m - m_new) * scale_log2) + rowsum P       (softmax)
//   O += P V          O[r][d] = O[r][d] * exp2(...) + sum_c P[r][c] V[c][d]   (gemm_pv)
// and at the end O / l and lse = m * scale + ln l (store). A Cfg names the tile shape: kMSlabs,
// kNBlocksS, kDBlocks, kKStepsQK, kKStepsPV, kSmemStride, kKVSwizzled, kKVStride, kIsBF16, kQInRegs.
#pragma once

#include "primitives.cuh"

namespace cuflash {

// Copy a kRows x kHeadDim tile (rows_valid real rows, head_dim real columns) into shared memory,
// zero-filling the rest. The tile is cut in 16-byte chunks; thread tid moves chunks tid,
// tid + kNThreads, ... When a row's chunk count divides the thread count, each thread keeps one
// column and walks down the rows with a single 64-bit pointer (no per-chunk 64-bit products to
// keep alive across the main loop).
template <class Cfg, int kRows>
CUFLASH_DEVICE void load_tile(u16* s_tile, const u16* g_tile, i64 row_stride, int rows_valid, int head_dim,
                              int tid) {
    constexpr int kC = Cfg::kChunksPerRow;
    constexpr int kChunks = kRows * kC;
    constexpr int kPasses = (kChunks + Cfg::kNThreads - 1) / Cfg::kNThreads;
    constexpr bool kColumnFixed = Cfg::kNThreads % kC == 0;  // chunk tid + i*kNThreads keeps its column
    constexpr int kRowsPerPass = Cfg::kNThreads / kC;
    const u16* g_walk = g_tile + (tid / kC) * row_stride + (tid % kC) * 8;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int chunk = tid + i * Cfg::kNThreads;
        if (kChunks % Cfg::kNThreads != 0 && chunk >= kChunks) break;
        const int row = chunk / kC;
        const int col = (chunk % kC) * 8;
        u16* s_dst = s_tile + row * Cfg::kSmemStride + col;
        const bool row_ok = row < rows_valid;
        const u16* g_src = kColumnFixed ? g_walk : g_tile + row * row_stride + col;
        if constexpr (kColumnFixed) g_walk += kRowsPerPass * row_stride;
        if constexpr (Cfg::kAligned) {
            // head_dim % 8 == 0 here, so a chunk is either wholly inside the tensor or wholly outside.
            const bool valid = row_ok && col < head_dim;
            cp_async_16(smem_u32(s_dst), valid ? g_src : g_tile, valid);
        } else {
            u32 packed[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const u32 lo = (row_ok && col + e < head_dim) ? g_src[e] : 0u;
                const u32 hi = (row_ok && col + e + 1 < head_dim) ? g_src[e + 1] : 0u;
                packed[e / 2] = lo | (hi << 16);
            }
            *reinterpret_cast<uint4*>(s_dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
    }
}

// Element offset of 16-byte chunk `chunk` of row `row` in a K/V smem tile (Cfg::kKVSwizzled):
//   padded:   rows of kKVStride = head dim + 8 elements; the 16 bytes of padding keep ldmatrix's
//             8 rows on distinct banks.
//   swizzled: unpadded rows (kKVStride = head dim, a multiple of 64); chunk c of row r sits at
//             c ^ (r % 8), inside its own 128-byte group, which keeps ldmatrix conflict free. Each
//             128-byte piece of a global row then lands in one 128-byte aligned piece of smem: a
//             padded row straddles those pieces, and cp.async then fetches ~1.5 L2 sectors per
//             sector of data (ncu, decode kernel on the H200), which caps a memory-bound kernel.
template <bool kSwizzled, int kKVStride>
CUFLASH_DEVICE int kv_chunk_offset(int row, int chunk) {
    return row * kKVStride + (kSwizzled ? (chunk ^ (row & 7)) : chunk) * 8;
}

// Per-warp tile state and the three steps of one K/V tile. Fragment layouts: primitives.cuh. Q rows are
// padded (kSmemStride); K and V rows follow Cfg::kKVSwizzled (kv_chunk_offset).
template <class Cfg>
struct WarpTile {
    static constexpr int kMSlabs = Cfg::kMSlabs, kNB = Cfg::kNBlocksS, kDB = Cfg::kDBlocks;
    static constexpr int kStride = Cfg::kSmemStride;
    static constexpr bool kSwizzled = Cfg::kKVSwizzled;
    static constexpr int kKVStride = Cfg::kKVStride;
    static constexpr bool kBF16 = Cfg::kIsBF16;
    static_assert(!kSwizzled || (kKVStride % 64 == 0), "swizzled rows are whole 128-byte groups");

    float acc_o[kMSlabs][kDB][4];   // unnormalized O
    float row_max[kMSlabs][2];      // m, raw score units
    float row_sum[kMSlabs][2];      // this thread's part of l
    u32 q_frag[Cfg::kQInRegs ? kMSlabs : 1][Cfg::kQInRegs ? Cfg::kKStepsQK : 1][4];
    // Per-lane ldmatrix offsets (elements) inside a smem tile.
    int q_lane_off;  // A (Q rows): lane l -> row (l % 16), column 8 (l / 16) of a 16x16 block
    int k_lane_off;  // B of Q K^T from K rows: matrices (n-block 2i, k lo), (2i, k hi), (2i+1, k lo),
                     // (2i+1, k hi) -> lane l -> key (l % 8) + 8 (l / 16), column 8 ((l / 8) % 2)
    int v_lane_off;  // B of P V from V rows, transposed: matrices (keys lo, d-block 2i), (keys hi, 2i),
                     // (keys lo, 2i+1), (keys hi, 2i+1) -> lane l -> key (l % 8) + 8 ((l / 8) % 2), column 8 (l / 16)
    // Swizzled K/V: k_lane_off / v_lane_off hold the row part only. Every row a lane addresses is
    // l % 8 modulo 8, and the chunk it reads is an even constant c plus its chunk bit, so it is stored
    // at c ^ y, y = chunk bit ^ l % 8, = (c & ~7) + ((c & 6) ^ y): k_col[j] / v_col[j] hold
    // ((2 j) ^ y) * 8 elements for the four values of c & 6.
    int k_col[kSwizzled ? 4 : 1], v_col[kSwizzled ? 4 : 1];

    CUFLASH_DEVICE void init(int warp_row0, int lane) {
        q_lane_off = (warp_row0 + lane % 16) * kStride + (lane / 16) * 8;
        if constexpr (kSwizzled) {
            k_lane_off = (lane % 8 + (lane / 16) * 8) * kKVStride;
            v_lane_off = (lane % 8 + ((lane / 8) % 2) * 8) * kKVStride;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                k_col[j] = ((2 * j) ^ ((lane / 8) % 2) ^ (lane % 8)) * 8;
                v_col[j] = ((2 * j) ^ (lane / 16) ^ (lane % 8)) * 8;
            }
        } else {
            k_lane_off = (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
            v_lane_off = (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;
        }
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int d = 0; d < kDB; ++d) acc_o[s][d][0] = acc_o[s][d][1] = acc_o[s][d][2] = acc_o[s][d][3] = 0.f;
            row_max[s][0] = row_max[s][1] = -kInf;
            row_sum[s][0] = row_sum[s][1] = 0.f;
        }
    }

    CUFLASH_DEVICE void load_q_frags(const u16* s_q) {
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
            for (int ks = 0; ks < Cfg::kKStepsQK; ++ks)
                ldmatrix_x4(q_frag[s][ks], smem_u32(s_q + q_lane_off + s * 16 * kStride + ks * 16));
    }

    // S = Q K^T                      S[r][c] = sum_d Q[r][d] K[c][d]
    CUFLASH_DEVICE void gemm_qk(float (&S)[kMSlabs][kNB][4], const u16* s_q, const u16* s_k) const {
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
            for (int nb = 0; nb < kNB; ++nb) S[s][nb][0] = S[s][nb][1] = S[s][nb][2] = S[s][nb][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Cfg::kKStepsQK; ++ks) {
            u32 a[kMSlabs][4];
#pragma unroll
            for (int s = 0; s < kMSlabs; ++s) {
                if constexpr (Cfg::kQInRegs) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[s][i] = q_frag[s][ks][i];
                } else {
                    ldmatrix_x4(a[s], smem_u32(s_q + q_lane_off + s * 16 * kStride + ks * 16));
                }
            }
#pragma unroll
            for (int nb = 0; nb < kNB; nb += 2) {
                u32 bk[4];
                const int col = kSwizzled ? (2 * ks & ~7) * 8 + k_col[ks % 4] : ks * 16;
                ldmatrix_x4(bk, smem_u32(s_k + k_lane_off + nb * 8 * kKVStride + col));
#pragma unroll
                for (int s = 0; s < kMSlabs; ++s) {
                    mma_16816<kBF16>(S[s][nb], a[s], bk[0], bk[1]);
                    mma_16816<kBF16>(S[s][nb + 1], a[s], bk[2], bk[3]);
                }
            }
        }
    }

    // Online softmax (paper Algorithm 1, lines 8-10): new running max m, rescale l and O by
    // exp2((m_old - m_new) * scale_log2), then S <- P = exp2(S * scale_log2 - m_new * scale_log2).
    // O is rescaled only when some row of the warp got a larger max (the factor is exactly 1 otherwise).
    CUFLASH_DEVICE void softmax(float (&S)[kMSlabs][kNB][4], float scale_log2) {
        float correction[kMSlabs][2];
        const bool grew = softmax_rows(S, scale_log2, correction);
        rescale_o(correction, grew);
    }

    // The softmax without touching O: S <- P, m and l updated; correction[s][r] is the factor O's rows
    // must be multiplied by (rescale_o). Returns whether any row's max grew (else every factor is 1).
    // The Hopper kernel rescales O later, after the P V product of the previous tile has landed.
    CUFLASH_DEVICE bool softmax_rows(float (&S)[kMSlabs][kNB][4], float scale_log2, float (&correction)[kMSlabs][2]) {
        bool grew = false;
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m_new = row_max[s][r];
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) m_new = fmaxf(m_new, fmaxf(S[s][nb][2 * r], S[s][nb][2 * r + 1]));
                m_new = quad_max(m_new);
                const bool row_grew = m_new > row_max[s][r];
                grew |= row_grew;
                // A row that has seen only masked keys keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
                const float m_scaled = m_new == -kInf ? 0.f : m_new * scale_log2;
                correction[s][r] = row_grew ? fast_exp2(row_max[s][r] * scale_log2 - m_scaled) : 1.f;
                row_max[s][r] = m_new;
                row_sum[s][r] *= correction[s][r];
                float sum = 0.f;
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pe = fast_exp2(fmaf(S[s][nb][2 * r + e], scale_log2, -m_scaled));
                        S[s][nb][2 * r + e] = pe;
                        sum += pe;
                    }
                }
                row_sum[s][r] += sum;
            }
        }
        return grew;
    }

    // O *= correction (per row) when some row of the warp grew its max.
    CUFLASH_DEVICE void rescale_o(const float (&correction)[kMSlabs][2], bool grew) {
        if (__any_sync(0xffffffffu, grew)) scale_o(correction);  // warp-uniform: skip the FMULs when no max moved
    }

    // O *= correction (per row), unconditionally: 2 * kDB * kMSlabs * 2 FMULs.
    CUFLASH_DEVICE void scale_o(const float (&correction)[kMSlabs][2]) {
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
            for (int d = 0; d < kDB; ++d) {
                acc_o[s][d][0] *= correction[s][0];
                acc_o[s][d][1] *= correction[s][0];
                acc_o[s][d][2] *= correction[s][1];
                acc_o[s][d][3] *= correction[s][1];
            }
    }

    // O += P V                       O[r][d] += sum_c P[r][c] V[c][d]
    // P comes straight from the S accumulators: n-blocks 2kk, 2kk+1 form the A operand of k-step kk.
    CUFLASH_DEVICE void gemm_pv(const float (&P)[kMSlabs][kNB][4], const u16* s_v) {
#pragma unroll
        for (int kk = 0; kk < Cfg::kKStepsPV; ++kk) {
            u32 a[kMSlabs][4];
#pragma unroll
            for (int s = 0; s < kMSlabs; ++s) {
                a[s][0] = pack2<kBF16>(P[s][2 * kk][0], P[s][2 * kk][1]);
                a[s][1] = pack2<kBF16>(P[s][2 * kk][2], P[s][2 * kk][3]);
                a[s][2] = pack2<kBF16>(P[s][2 * kk + 1][0], P[s][2 * kk + 1][1]);
                a[s][3] = pack2<kBF16>(P[s][2 * kk + 1][2], P[s][2 * kk + 1][3]);
            }
#pragma unroll
            for (int d = 0; d < kDB; d += 2) {
                u32 bv[4];
                const int col = kSwizzled ? (d & ~7) * 8 + v_col[(d / 2) % 4] : d * 8;
                ldmatrix_x4_trans(bv, smem_u32(s_v + v_lane_off + kk * 16 * kKVStride + col));
#pragma unroll
                for (int s = 0; s < kMSlabs; ++s) {
                    mma_16816<kBF16>(acc_o[s][d], a[s], bv[0], bv[1]);
                    mma_16816<kBF16>(acc_o[s][d + 1], a[s], bv[2], bv[3]);
                }
            }
        }
    }

    // Epilogue: l = sum over the quad, O *= out_scale / l once (kScaleOut; dropout's out_scale = 1 / (1 - p)),
    // lse = m * scale + ln(l); rows that saw no key
    // (l == 0) write O = 0 and lse = -inf. g_o and g_lse point at row 0 of the CTA's tile; the warp's
    // rows start at warp_row0. Aligned variants stage the normalized rows in s_stage (kRowsPerWarp rows
    // of kSmemStride elements that only this warp touches) and write whole 16-byte chunks: coalesced
    // rows instead of 4-byte pieces.
    //
    // kAtomRows > 0: s_stage is not padded rows but the warp's first row of a 128-byte swizzled tile of
    // kAtomRows rows (64-column atoms kAtomRows * 64 elements apart; chunk c of row r at c ^ (r % 8)),
    // as the Hopper TMA kernel stages O in its Q tile (same bytes, no padding, no bank conflicts).
    // kWriteOut false (aligned variants): stage only, lse included; the caller writes the staged rows
    // (the Hopper TMA kernel, with a TMA store). g_o and head_dim are then unused.
    template <bool kScaleOut = false, int kAtomRows = 0, bool kWriteOut = true>
    CUFLASH_DEVICE void store(u16* g_o, i64 o_row_stride, float* g_lse, float softmax_scale, int warp_row0,
                              int rows_valid, int head_dim, u16* s_stage, int lane, float out_scale = 1.f) const {
        auto stage_off = [](int row, int col) {  // element offset of (row, col) of the warp's rows
            if constexpr (kAtomRows == 0) {
                return row * kStride + col;
            } else {
                return (col / 64) * kAtomRows * 64 + row * 64 + ((((col % 64) / 8) ^ (row % 8)) * 8) + col % 8;
            }
        };
        const int g = lane / 4, t = lane % 4;
        float inv_l[kMSlabs][2];
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + 16 * s + 8 * r + g;  // row inside the tile
                const float l = quad_sum(row_sum[s][r]);
                if constexpr (kScaleOut) {
                    inv_l[s][r] = l > 0.f ? out_scale / l : 0.f;
                } else {
                    inv_l[s][r] = l > 0.f ? 1.f / l : 0.f;
                }
                if (t == 0 && row < rows_valid) g_lse[row] = l > 0.f ? row_max[s][r] * softmax_scale + __logf(l) : -kInf;
            }
        }
        if constexpr (Cfg::kAligned) {
            __syncwarp();  // every lane of the warp is done reading what s_stage held before
#pragma unroll
            for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int d = 0; d < kDB; ++d) {
                        const u32 packed = pack2<kBF16>(acc_o[s][d][2 * r] * inv_l[s][r], acc_o[s][d][2 * r + 1] * inv_l[s][r]);
                        *reinterpret_cast<u32*>(s_stage + stage_off(16 * s + 8 * r + g, d * 8 + 2 * t)) = packed;
                    }
            __syncwarp();  // staged rows visible to the whole warp
            if constexpr (!kWriteOut) return;
            constexpr int kChunks = Cfg::kRowsPerWarp * Cfg::kChunksPerRow;
#pragma unroll
            for (int i = 0; i < (kChunks + 31) / 32; ++i) {
                const int chunk = lane + 32 * i;
                const int row = chunk / Cfg::kChunksPerRow, col = (chunk % Cfg::kChunksPerRow) * 8;
                if ((kChunks % 32 == 0 || chunk < kChunks) && warp_row0 + row < rows_valid && col < head_dim) {
                    *reinterpret_cast<uint4*>(g_o + (warp_row0 + row) * o_row_stride + col) =
                        *reinterpret_cast<const uint4*>(s_stage + stage_off(row, col));
                }
            }
        } else {
            static_assert(kWriteOut, "only aligned variants stage O for the caller");
#pragma unroll
            for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = warp_row0 + 16 * s + 8 * r + g;
                    if (row >= rows_valid) continue;
                    u16* g_row = g_o + row * o_row_stride;
#pragma unroll
                    for (int d = 0; d < kDB; ++d) {
                        const int col = d * 8 + 2 * t;
                        const u32 packed = pack2<kBF16>(acc_o[s][d][2 * r] * inv_l[s][r], acc_o[s][d][2 * r + 1] * inv_l[s][r]);
                        if (col < head_dim) g_row[col] = static_cast<u16>(packed & 0xffffu);
                        if (col + 1 < head_dim) g_row[col + 1] = static_cast<u16>(packed >> 16);
                    }
                }
            }
        }
    }
};

}  // namespace cuflash
