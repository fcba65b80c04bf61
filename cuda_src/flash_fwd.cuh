// FlashAttention-2 forward (Dao 2023, Algorithm 1) on tensor cores with mma.sync (sm_80 and newer).
//
// Computes, for one (batch b, query head h) and a tile of kBlockM query rows,
//     O = softmax(scale * Q K^T + mask) V      lse = log(sum_j exp(scale * q.k_j))   (natural log)
// without ever writing the kBlockM x seqlen_k score matrix to global memory.
//
// Grid and tiles
//   grid  = (ceil(seqlen_q / kBlockM), nheads, batch); CTA (m, h, b) owns query rows
//           [m*kBlockM, (m+1)*kBlockM) of head h. Causal grids run the heaviest row tiles first.
//   block = kNWarps warps. Warp w owns kRowsPerWarp = kBlockM / kNWarps consecutive query rows
//           (kMSlabs slabs of 16 rows, one MMA row block each). All warps share the K and V
//           tiles: no warp ever needs another warp's partial results (paper section 3.3).
//   smem  = sQ[kBlockM][kHeadDim+8] + kStages x (sK[kBlockN][kHeadDim+8] + sV[...]).
//           Rows are padded by 16 bytes so the 8 row addresses of an ldmatrix hit 8 distinct
//           16-byte bank groups (stride of an odd number of 16-byte units: conflict free).
//   K/V tiles are walked from the last visible block down to block 0. The blocks that need a
//   mask (causal diagonal, ragged end of seqlen_k) therefore come first; the rest run mask-free.
//   kStages == 2: while tile j is used, cp.async brings tile j-1 into the other stage (one barrier
//   per tile). kStages == 1 (FA2's order, for tiles whose two stages would not fit twice per SM):
//   V_j streams in during S = Q K_j^T and K_{j-1} during the softmax and P V_j (two barriers).
//   Epilogue: each warp stages its normalized O rows in its own rows of sQ and writes them out in
//   coalesced 16-byte chunks.
//
// Per thread (g = lane / 4, t = lane % 4) for each slab s and half r (row g or g + 8):
//   acc_o[s][d/8][2r..2r+1]: unnormalized O, fp32     row_max[s][r]: running max m (raw score units)
//   row_sum[s][r]: this thread's part of the running sum l (the 4 threads of a quad are added once, at the end)
// Online softmax per K/V tile (paper Algorithm 1, lines 8-10):
//   m_new = max(m, rowmax(S));  P = exp2(S * scale_log2 - m_new * scale_log2)
//   l = l * exp2((m - m_new) * scale_log2) + rowsum(P);  O = O * exp2(...) + P V
//   (O is rescaled only when some row of the warp got a new max: the factor is exactly 1 otherwise)
//   and only after the last tile: O /= l (the one division of FA2), lse = m * scale + ln(l).
// P goes from the S accumulator registers straight into the A operand of P V (no smem round trip).
//
// Preconditions (checked in Python, cuflash/attention.py): head_dim <= kHeadDim; kAligned variants
// need 16-byte aligned rows (base pointers % 16 == 0, strides % 8 elements, head_dim % 8 == 0);
// softmax_scale > 0; seqlen_q, seqlen_k >= 1.
#pragma once

#include "common.cuh"
#include "params.h"

namespace cuflash {

// Compile-time shape of one kernel variant. Tile choices come from cuflash/plan.py (FWD_TILES).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kIsBF16_, bool kIsCausal_,
          bool kAligned_, bool kQInRegs_, int kStages_>
struct FwdConfig {
    static constexpr int kHeadDim = kHeadDim_;   // head-dim bucket (multiple of 32)
    static constexpr int kBlockM = kBlockM_;     // query rows per CTA
    static constexpr int kBlockN = kBlockN_;     // key rows per K/V tile
    static constexpr int kNWarps = kNWarps_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr bool kAligned = kAligned_;  // 16-byte cp.async loads; else element-wise loads
    static constexpr bool kQInRegs = kQInRegs_;  // Q fragments loaded once into registers
    static constexpr int kStages = kStages_;     // smem buffers per K and per V tile (1 or 2)

    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kRowsPerWarp = kBlockM / kNWarps;
    static constexpr int kMSlabs = kRowsPerWarp / 16;  // 16-row MMA blocks per warp
    static constexpr int kNBlocksS = kBlockN / 8;      // 8-column MMA blocks of S
    static constexpr int kDBlocks = kHeadDim / 8;      // 8-column MMA blocks of O
    static constexpr int kKStepsQK = kHeadDim / 16;    // k-steps of S = Q K^T
    static constexpr int kKStepsPV = kBlockN / 16;     // k-steps of O += P V
    static constexpr int kSmemStride = kHeadDim + 8;   // elements per smem row (16 bytes pad)
    static constexpr bool kKVSwizzled = false;         // K/V rows padded like Q (WarpTile, kv_chunk_offset)
    static constexpr int kKVStride = kSmemStride;      // elements between K/V rows in smem
    static constexpr int kChunksPerRow = kHeadDim / 8; // 16-byte chunks per row
    static constexpr int kSmemQ = kBlockM * kSmemStride;
    static constexpr int kSmemKV = kBlockN * kSmemStride;
    static constexpr int kSmemBytes = 2 * (kSmemQ + 2 * kStages * kSmemKV);  // Q + kStages x (K, V)

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32");
    static_assert(kBlockM % (16 * kNWarps) == 0, "every warp owns whole 16-row MMA slabs");
    static_assert(kBlockN % 16 == 0, "K/V tiles are whole MMA k-steps");
    static_assert((kSmemStride / 8) % 2 == 1, "odd 16-byte row stride keeps ldmatrix conflict free");
    static_assert(kStages == 1 || kStages == 2, "K/V tiles are single or double buffered");
};

// Which scores survive, and which K/V blocks a query tile visits. Future score modifiers
// (sliding window, ALiBi, softcap, additive bias) slot in here: the main loop only asks for the
// block range, whether a block needs the per-element step, and then applies it.
template <bool kIsCausal>
struct CausalMask {
    int seqlen_q, seqlen_k;

    // Causal is aligned bottom-right: query row i sees keys j <= i + seqlen_k - seqlen_q.
    CUFLASH_DEVICE int last_key_plus_one(int row) const {
        if constexpr (kIsCausal) {
            return min(seqlen_k, row + seqlen_k - seqlen_q + 1);
        } else {
            return seqlen_k;
        }
    }
    // K/V blocks [0, n_block_end) hold every key any row of [m0, m0 + block_m) can see.
    CUFLASH_DEVICE int n_block_end(int m0, int block_m, int block_n) const {
        const int last_row = min(seqlen_q, m0 + block_m) - 1;
        return ceil_div_nonneg(last_key_plus_one(last_row), block_n);
    }
    // True when some element of tile (m0.., n0..) is masked for some row: diagonal or ragged end.
    CUFLASH_DEVICE bool block_needs_mask(int m0, int n0, int block_n) const {
        return n0 + block_n > last_key_plus_one(m0);
    }
    // S[s][nb][2r + e] is row (row0 + 16 s + 8 r), column (col0 + 8 nb + e).
    template <int kMSlabs, int kNB>
    CUFLASH_DEVICE void apply(float (&S)[kMSlabs][kNB][4], int row0, int col0) const {
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int limit = last_key_plus_one(row0 + 16 * s + 8 * r);
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (col0 + 8 * nb + e >= limit) S[s][nb][2 * r + e] = -kInf;
                    }
                }
            }
        }
    }
};

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

// Per-warp tile state and the three steps of one K/V tile. Fragment layouts: common.cuh. Q rows are
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
        if (__any_sync(0xffffffffu, grew)) {  // warp-uniform: skip 2 * kDB * kMSlabs * 2 FMULs when no max moved
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

    // Epilogue: l = sum over the quad, O /= l once, lse = m * scale + ln(l); rows that saw no key
    // (l == 0) write O = 0 and lse = -inf. g_o and g_lse point at row 0 of the CTA's tile; the warp's
    // rows start at warp_row0. Aligned variants stage the normalized rows in s_stage (kRowsPerWarp rows
    // of kSmemStride elements that only this warp touches) and write whole 16-byte chunks: coalesced
    // rows instead of 4-byte pieces.
    CUFLASH_DEVICE void store(u16* g_o, i64 o_row_stride, float* g_lse, float softmax_scale, int warp_row0,
                              int rows_valid, int head_dim, u16* s_stage, int lane) const {
        const int g = lane / 4, t = lane % 4;
        float inv_l[kMSlabs][2];
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + 16 * s + 8 * r + g;  // row inside the tile
                const float l = quad_sum(row_sum[s][r]);
                inv_l[s][r] = l > 0.f ? 1.f / l : 0.f;
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
                        *reinterpret_cast<u32*>(s_stage + (16 * s + 8 * r + g) * kStride + d * 8 + 2 * t) = packed;
                    }
            __syncwarp();  // staged rows visible to the whole warp
            constexpr int kChunks = Cfg::kRowsPerWarp * Cfg::kChunksPerRow;
#pragma unroll
            for (int i = 0; i < (kChunks + 31) / 32; ++i) {
                const int chunk = lane + 32 * i;
                const int row = chunk / Cfg::kChunksPerRow, col = (chunk % Cfg::kChunksPerRow) * 8;
                if ((kChunks % 32 == 0 || chunk < kChunks) && warp_row0 + row < rows_valid && col < head_dim) {
                    *reinterpret_cast<uint4*>(g_o + (warp_row0 + row) * o_row_stride + col) =
                        *reinterpret_cast<const uint4*>(s_stage + row * kStride + col);
                }
            }
        } else {
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

// What a forward CTA works on: query tile m of head h in batch b (blockIdx), its rows of Q, O and
// lse, its kv head's K and V, and the K/V blocks it visits.
template <class Cfg>
struct FwdTileRef {
    const u16 *q, *k, *v;  // q: row m0 of the tile; k, v: key 0 of kv head h / head_ratio
    u16* o;
    float* lse;
    int m0, rows_valid, n_block_end;
    CausalMask<Cfg::kIsCausal> mask;

    CUFLASH_DEVICE explicit FwdTileRef(const FwdParams& p) : mask{p.seqlen_q, p.seqlen_k} {
        // Causal row tiles differ in cost (tile m visits about m+1 K/V blocks): launch the heavy ones first.
        const int m_block = Cfg::kIsCausal ? p.num_m_blocks - 1 - (int)blockIdx.x : (int)blockIdx.x;
        const int h = blockIdx.y, b = blockIdx.z;
        const int hk = h / p.head_ratio;  // GQA: query head h reads kv head h / (nheads / nheads_kv)
        m0 = m_block * Cfg::kBlockM;
        // 64-bit offsets: batch * batch_stride and m0 * row_stride can exceed 2^31 elements.
        q = static_cast<const u16*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride;
        k = static_cast<const u16*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
        v = static_cast<const u16*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
        o = static_cast<u16*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + m0 * p.o_row_stride;
        lse = p.lse + ((i64)b * p.nheads + h) * p.seqlen_q + m0;
        n_block_end = mask.n_block_end(m0, Cfg::kBlockM, Cfg::kBlockN);
        rows_valid = min(Cfg::kBlockM, p.seqlen_q - m0);
    }

    // n_block_end == 0: no row of this tile sees any key, so O = 0 and lse = -inf.
    CUFLASH_DEVICE void write_empty(const FwdParams& p, int tid) const {
        for (int i = tid; i < rows_valid * p.head_dim; i += Cfg::kNThreads) {
            o[(i / p.head_dim) * p.o_row_stride + i % p.head_dim] = 0;
        }
        for (int i = tid; i < rows_valid; i += Cfg::kNThreads) lse[i] = -kInf;
    }
};

template <class Cfg>
CUFLASH_DEVICE void flash_fwd_kernel(const FwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    constexpr int kMSlabs = Cfg::kMSlabs, kNB = Cfg::kNBlocksS;
    constexpr int kStride = Cfg::kSmemStride;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const FwdTileRef<Cfg> tile(p);
    const u16 *g_q = tile.q, *g_k = tile.k, *g_v = tile.v;
    u16* g_o = tile.o;
    float* g_lse = tile.lse;
    const int m0 = tile.m0, rows_valid = tile.rows_valid, n_block_end = tile.n_block_end;
    const CausalMask<Cfg::kIsCausal> mask = tile.mask;
    const int warp_row0 = warp * Cfg::kRowsPerWarp;  // first row of this warp inside the tile
    if (n_block_end == 0) {
        tile.write_empty(p, tid);
        return;
    }

    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* s_q = reinterpret_cast<u16*>(smem_raw);
    u16* s_k0 = s_q + Cfg::kSmemQ;                     // K stages: tile j lives in stage j % kStages
    u16* s_v0 = s_k0 + Cfg::kStages * Cfg::kSmemKV;    // V stages: tile j lives in stage j % kStages
    auto s_k = [&](int j) { return s_k0 + (Cfg::kStages == 2 ? (j & 1) : 0) * Cfg::kSmemKV; };
    auto s_v = [&](int j) { return s_v0 + (Cfg::kStages == 2 ? (j & 1) : 0) * Cfg::kSmemKV; };
    auto load_k = [&](int j) {
        const int n0 = j * kBlockN;
        load_tile<Cfg, kBlockN>(s_k(j), g_k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, p.head_dim, tid);
    };
    auto load_v = [&](int j) {
        const int n0 = j * kBlockN;
        load_tile<Cfg, kBlockN>(s_v(j), g_v + n0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - n0, p.head_dim, tid);
    };

    WarpTile<Cfg> wt;
    wt.init(warp_row0, lane);
    const float scale_log2 = p.scale_log2;
    const int row_abs0 = m0 + warp_row0 + g;  // absolute query row of this thread's slab 0, half 0
    const int n_last = n_block_end - 1;       // K/V tiles are visited from n_last down to 0
    float S[kMSlabs][kNB][4];                 // scores, then probabilities, of the current tile

    // Prologue: Q and the first K tile in one cp.async group, its V tile in the next, so S = Q K^T
    // can start before V has arrived.
    load_tile<Cfg, kBlockM>(s_q, g_q, p.q_row_stride, rows_valid, p.head_dim, tid);
    load_k(n_last);
    cp_async_commit();
    if constexpr (Cfg::kStages == 2) {
        load_v(n_last);
        cp_async_commit();
    }
    if constexpr (Cfg::kQInRegs) {
        cp_async_wait<Cfg::kStages == 2 ? 1 : 0>();
        __syncthreads();  // Q tile in smem for every warp before ldmatrix
        wt.load_q_frags(s_q);
    }

    for (int j = n_last; j >= 0; --j) {
        const bool first = j == n_last;
        if constexpr (Cfg::kStages == 2) {
            // Double buffered, one barrier per tile: tile j-1 streams into the other stage while tile
            // j is used. In flight here: V_j on the first tile (its own group), else nothing else.
            if (first) cp_async_wait<1>(); else cp_async_wait<0>();
            // K_j (and V_j after the first tile) visible to every warp; every warp has finished tile
            // j+1, so the stage of tile j+1 is free for tile j-1.
            __syncthreads();
            if (j > 0) {
                load_k(j - 1);
                load_v(j - 1);
            }
            cp_async_commit();
            wt.gemm_qk(S, s_q, s_k(j));
            if (mask.block_needs_mask(m0, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t);
            wt.softmax(S, scale_log2);
            if (first) {
                cp_async_wait<1>();  // V_{n_last} landed (the prefetch of tile j-1 may still be in flight)
                __syncthreads();     // ... and is visible to every warp
            }
            wt.gemm_pv(S, s_v(j));
        } else {
            // Single buffered (FA2's order, two barriers per tile): V_j streams in during S = Q K_j^T,
            // K_{j-1} during the softmax and O += P V_j.
            cp_async_wait<0>();
            __syncthreads();  // K_j visible to every warp; every warp is done with V_{j+1}
            load_v(j);
            cp_async_commit();
            wt.gemm_qk(S, s_q, s_k(j));
            if (mask.block_needs_mask(m0, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t);
            cp_async_wait<0>();
            __syncthreads();  // V_j visible to every warp; every warp is done with K_j
            if (j > 0) load_k(j - 1);
            cp_async_commit();
            wt.softmax(S, scale_log2);
            wt.gemm_pv(S, s_v(j));
        }
    }

    // Each warp stages its O rows in its own rows of sQ (only this warp ever read them).
    wt.store(g_o, p.o_row_stride, g_lse, p.softmax_scale, warp_row0, rows_valid, p.head_dim, s_q + warp_row0 * kStride, lane);
}

}  // namespace cuflash
