// FlashAttention-2 backward (Dao 2023, Algorithm 2) on tensor cores with mma.sync (sm_80 and newer).
//
// Given Q, K, V, O, dO and the forward's lse, computes for every (batch b, kv head hk)
//     P  = exp(scale * Q K^T - lse)               (recomputed, never stored in global memory)
//     dV = P^T dO          dP = dO V^T          D = rowsum(dO * O)
//     dS = P * (dP - D)    dQ = scale * dS K    dK = scale * dS^T Q
// with dK, dV summed over the query heads of a GQA group.
//
// Three kernels:
//   flash_bwd_pre_kernel      1-8 query rows per warp: D = rowsum(dO * O) (fp32), lse_log2 = lse * log2(e)
//                             (+inf where lse = -inf and on padding rows, so their P is exactly 0).
//   flash_bwd_kernel          grid = (ceil(seqlen_k / kBlockN), nheads_kv, batch). CTA (n, hk, b) owns
//                             keys [n*kBlockN, (n+1)*kBlockN) of kv head hk; K and V stay in smem; it
//                             walks over every query head of the group and every query block (kBlockM
//                             rows) that sees these keys, keeping dK and dV in registers, and adds its
//                             part of dQ to an fp32 buffer (atomics).
//   flash_bwd_convert_kernel  one CTA per query block: dQ = dq_accum * scale, converted to q's dtype.
//
// Main kernel, one query block per iteration; three phases, each with its own grid of warp tiles
// (BwdConfig; all warps share the tiles through smem, no warp needs another's registers):
//   scores  S^T = K Q^T, dP^T = V dO^T for a (keys x queries) warp tile; mask on the causal diagonal
//           blocks or (not causal) the ragged last key block only;
//           P^T = exp2(S^T * scale_log2 - lse_log2), dS^T = P^T * (dP^T - D) -> sP, sdS.
//   dK, dV  dV += P^T dO, dK += dS^T Q over all kBlockM query rows for a (keys x head dim) warp tile
//           (A from sP / sdS), accumulated in registers over the whole loop.
//   dQ      dQ_part = dS K over the CTA's kBlockN keys for a (queries x head dim) warp tile, added to
//           dq_accum with fp32 atomics. In deterministic mode the CTAs of one query block add in
//           key-block order (turn counter).
// smem: sK, sV [kBlockN][kHeadDim+8]; kStages x (sQ, sdO [kBlockM][kHeadDim+8], lse_log2, D [kBlockM]);
//       sP, sdS [kBlockN][kBlockM+8] (rows = keys). Row pads keep ldmatrix conflict free (odd
//       number of 16-byte units per row). kStages == 2: query block i+1 streams in during block i.
//
// Variants (Cfg::kMods, masks.cuh / dropout.cuh): the window narrows each key block's query walk
// (BwdQueryWalk); P^T is recomputed with softcap, ALiBi and the mask (AttnMask::prob); dropout's keep
// bits come from the same Philox stream as the forward's, transposed by warp shuffles: dV takes the
// dropped P^T / q, dS^T = P^T (Z dP^T / q - D) (1 - tanh^2 with softcap).
//
// Fragment layouts: primitives.cuh. Preconditions (checked in cuflash/backward.py): as the forward;
// lse is the forward's lse of these inputs; dq_turn zeroed; lse_log2 / dsum from the preprocess kernel
// of the same call, which also zeroes dq_accum.
#pragma once

#include "masks.cuh"  // AttnMask, DropoutStream: the variants
#include "params.h"
#include "primitives.cuh"
#include "warp_tile.cuh"  // load_tile

namespace cuflash {

// Compile-time shape of one backward variant. Tile choices come from cuflash/plan/backward.py (BWD_TILES).
// Each phase spreads its output tile over the kNWarps warps as a (rows x columns) grid of warps:
//   scores  S^T (kBlockN x kBlockM): kSKeyWarps along the keys  x kNWarps / kSKeyWarps along the queries
//   dK, dV  (kBlockN x kHeadDim):    kKVKeyWarps along the keys x kNWarps / kKVKeyWarps along head dim
//   dQ      (kBlockM x kHeadDim):    kDQQWarps along the queries x kNWarps / kDQQWarps along head dim
// A warp tile of R rows x C columns reads (R + C) * 32 bytes of smem per 16-deep k-step for R*C/128
// MMAs, so the layouts aim for tiles of 32+ rows and 32+ columns (shared-memory bandwidth, not the
// tensor cores, is what bounds an mma.sync backward).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kIsBF16_, bool kIsCausal_,
          bool kAligned_, int kStages_, int kSKeyWarps_, int kKVKeyWarps_, int kDQQWarps_, int kMods_ = 0>
struct BwdConfig {
    static constexpr int kHeadDim = kHeadDim_;   // head-dim bucket (multiple of 32)
    static constexpr int kBlockM = kBlockM_;     // query rows per iteration
    static constexpr int kBlockN = kBlockN_;     // keys per CTA
    static constexpr int kNWarps = kNWarps_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr bool kAligned = kAligned_;  // 16-byte cp.async loads; else element-wise loads
    static constexpr int kStages = kStages_;     // buffers of the query-side tiles (1 or 2)
    static constexpr int kMods = kMods_;         // attention variants (masks.cuh kMod* bits)

    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kSmemStride = kHeadDim + 8;   // elements per K/V/Q/dO smem row
    static constexpr int kChunksPerRow = kHeadDim / 8; // 16-byte chunks per row (load_tile)
    static constexpr int kPStride = kBlockM + 8;       // elements per sP / sdS row

    // Scores: warp tile kSKeys keys (kSSlabs slabs of 16) x kSQCols queries (kSNB blocks of 8).
    static constexpr int kSKeyWarps = kSKeyWarps_;
    static constexpr int kSKeys = kBlockN / kSKeyWarps, kSSlabs = kSKeys / 16;
    static constexpr int kSQCols = kBlockM / (kNWarps / kSKeyWarps), kSNB = kSQCols / 8;
    // dK, dV: warp tile kKVKeys keys x kKVCols head-dim columns.
    static constexpr int kKVKeyWarps = kKVKeyWarps_;
    static constexpr int kKVKeys = kBlockN / kKVKeyWarps, kKVSlabs = kKVKeys / 16;
    static constexpr int kKVCols = kHeadDim / (kNWarps / kKVKeyWarps), kKVNB = kKVCols / 8;
    // dQ: warp tile kDQRows query rows x kDQCols head-dim columns.
    static constexpr int kDQQWarps = kDQQWarps_;
    static constexpr int kDQRows = kBlockM / kDQQWarps, kDQSlabs = kDQRows / 16;
    static constexpr int kDQCols = kHeadDim / (kNWarps / kDQQWarps), kDQNB = kDQCols / 8;

    static constexpr int kSmemKV = kBlockN * kSmemStride;  // elements of one K or V tile
    static constexpr int kSmemQ = kBlockM * kSmemStride;   // elements of one Q or dO tile
    static constexpr int kSmemP = kBlockN * kPStride;      // elements of sP or sdS
    static constexpr int kSmemBytes = 2 * (2 * kSmemKV + 2 * kStages * kSmemQ + 2 * kSmemP) + 4 * 2 * kStages * kBlockM;

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32");
    static_assert(kNWarps % kSKeyWarps == 0 && kNWarps % kKVKeyWarps == 0 && kNWarps % kDQQWarps == 0,
                  "every phase uses all warps in a full grid");
    static_assert(kSKeys % 16 == 0 && kKVKeys % 16 == 0 && kDQRows % 16 == 0, "warp tiles are whole 16-row slabs");
    static_assert(kSQCols % 16 == 0 && kKVCols % 16 == 0 && kDQCols % 16 == 0,
                  "ldmatrix x4 feeds pairs of 8-column blocks");
    static_assert(kBlockM % 4 == 0 && kBlockM / 2 <= kNThreads, "lse_log2 / D rows move in 16-byte chunks");
    static_assert((kSmemStride / 8) % 2 == 1 && (kPStride / 8) % 2 == 1, "odd 16-byte row strides");
    static_assert(kStages == 1 || kStages == 2, "query tiles are single or double buffered");
};

// The (query head of the GQA group, query block) pairs the CTA of key block n0 of kv head hk visits,
// one per iteration it: query head head(it) = hk * head_ratio + it / n_m, query block m_block(it) =
// m_begin + it % n_m. All query blocks, or (causal) those with a row i >= n0 - off,
// the first that sees any of these keys; with a window (block_n > 0) only the query blocks with a row
// whose window holds one of keys [n0, n0 + block_n): rows n0 - off - window_right .. n0 + block_n - 1
// - off + window_left (off = seqlen_k - seqlen_q + shift; shift: masks.cuh diag_shift_of).
struct BwdQueryWalk {
    int head0, m_begin, n_m, n_iters;
    template <int kMods>
    CUFLASH_DEVICE BwdQueryWalk(const BwdParams& p, int hk, int n0, int block_m, bool causal, int block_n, ModBits<kMods>) {
        const int shift = diag_shift_of<kMods>(p.mod);
        head0 = hk * p.head_ratio;
        if (block_n > 0) {
            const int off = p.seqlen_k - p.seqlen_q + shift;
            m_begin = max(0, n0 - off - p.mod.window_right) / block_m;
            const int last_row = n0 + block_n - 1 - off + p.mod.window_left;  // may be negative
            const int m_end = last_row < 0 ? 0 : min(p.num_m_blocks, last_row / block_m + 1);
            n_m = max(0, m_end - m_begin);
        } else {
            m_begin = causal ? max(0, n0 - (p.seqlen_k - p.seqlen_q + shift)) / block_m : 0;
            n_m = max(0, p.num_m_blocks - m_begin);
        }
        n_iters = p.head_ratio * n_m;
    }
    // Varlen: the same walk over one packed sequence of seqlen_q queries (num_m_blocks blocks) and seqlen_k keys.
    template <int kMods>
    CUFLASH_DEVICE BwdQueryWalk(const BwdParams& p, int seqlen_q, int seqlen_k, int num_m_blocks, int hk, int n0, int block_m,
                                bool causal, int block_n, ModBits<kMods>) {
        const int shift = diag_shift_of<kMods>(p.mod);
        head0 = hk * p.head_ratio;
        if (block_n > 0) {
            const int off = seqlen_k - seqlen_q + shift;
            m_begin = max(0, n0 - off - p.mod.window_right) / block_m;
            const int last_row = n0 + block_n - 1 - off + p.mod.window_left;  // may be negative
            const int m_end = last_row < 0 ? 0 : min(num_m_blocks, last_row / block_m + 1);
            n_m = max(0, m_end - m_begin);
        } else {
            m_begin = causal ? max(0, n0 - (seqlen_k - seqlen_q + shift)) / block_m : 0;
            n_m = max(0, num_m_blocks - m_begin);
        }
        n_iters = p.head_ratio * n_m;
    }
    CUFLASH_DEVICE int head(int it) const { return head0 + it / n_m; }
    CUFLASH_DEVICE int m_block(int it) const { return m_begin + it % n_m; }

    // Position of a walk that goes through its blocks in order (head(it), m_block(it) for it = 0, 1, ...)
    // without a division per block: first(), then next() once per block.
    struct Cursor {
        int head, m_block;
    };
    CUFLASH_DEVICE Cursor first() const { return Cursor{head0, m_begin}; }
    CUFLASH_DEVICE void next(Cursor& c) const {
        if (++c.m_block == m_begin + n_m) {
            c.m_block = m_begin;
            ++c.head;
        }
    }
};

// What a backward main-kernel CTA works on: key block n_block of batch b (blockIdx), or with varlen
// (varlen.cuh) the scheduler slot blockIdx.x over the packed keys, which names sequence seq.b and its
// key block, or nothing (skip).
template <class Cfg>
struct BwdKeyBlock {
    static constexpr bool kVarlen = (Cfg::kMods & kModVarlen) != 0;
    SeqInfo<kVarlen> seq;
    int n_block;
    bool skip;
    CUFLASH_DEVICE static BwdKeyBlock make(const BwdParams& p) {
        if constexpr (kVarlen) {
            const VarlenTile<BwdParams> t(p, true, Cfg::kBlockN, Cfg::kBlockM, false);
            return BwdKeyBlock{t.seq, t.m_block, t.skip};
        } else {
            return BwdKeyBlock{SeqInfo<false>((int)blockIdx.z), (int)blockIdx.x, false};
        }
    }
    // Query blocks of the sequence.
    CUFLASH_DEVICE int num_m_blocks(const BwdParams& p) const {
        if constexpr (kVarlen) {
            return (seq.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
        } else {
            return p.num_m_blocks;
        }
    }
    // The diagonal offset: query i of the sequence is aligned to key i + diag(p) (masks.cuh
    // diag_shift_of; spelled out here: a + 0 from a helper perturbed the plain kernels' register use).
    CUFLASH_DEVICE int diag(const BwdParams& p) const {
        if constexpr ((Cfg::kMods & (kModWindow | kModAlibi)) != 0) {
            return seq.len_k(p) - seq.len_q(p) + p.mod.diag_shift;
        } else {
            return seq.len_k(p) - seq.len_q(p);
        }
    }
    CUFLASH_DEVICE BwdQueryWalk walk(const BwdParams& p, int hk) const {
        if constexpr (kVarlen) {
            return BwdQueryWalk(p, seq.seqlen_q, seq.seqlen_k, num_m_blocks(p), hk, n_block * Cfg::kBlockN, Cfg::kBlockM,
                                Cfg::kIsCausal, Cfg::kMods & kModWindow ? Cfg::kBlockN : 0, ModBits<Cfg::kMods>{});
        } else {
            return BwdQueryWalk(p, hk, n_block * Cfg::kBlockN, Cfg::kBlockM, Cfg::kIsCausal,
                                Cfg::kMods & kModWindow ? Cfg::kBlockN : 0, ModBits<Cfg::kMods>{});
        }
    }
    // Deterministic mode: how many key blocks add to query block m0's dQ before this one (the key
    // blocks that visit a query block are consecutive: from the block of its first row's first
    // visible key with a window, from 0 otherwise).
    CUFLASH_DEVICE int dq_turn(const BwdParams& p, int m0) const {
        if constexpr ((Cfg::kMods & kModWindow) != 0) {
            return n_block - max(0, m0 + diag(p) - p.mod.window_left) / Cfg::kBlockN;
        } else {
            return n_block;
        }
    }
};

template <class Cfg>
CUFLASH_DEVICE void flash_bwd_kernel(const BwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStride = Cfg::kSmemStride;
    constexpr int kPStride = Cfg::kPStride;
    constexpr bool kBF16 = Cfg::kIsBF16;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const BwdKeyBlock<Cfg> blk = BwdKeyBlock<Cfg>::make(p);
    if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
        if (blk.skip) return;
    }
    const auto& seq = blk.seq;
    const int n_block = blk.n_block, hk = blockIdx.y, b = seq.b;
    const int n0 = n_block * kBlockN;
    const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset

    const BwdQueryWalk walk = blk.walk(p, hk);
    const int n_iters = walk.n_iters;
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* s_k = reinterpret_cast<u16*>(smem_raw);
    u16* s_v = s_k + Cfg::kSmemKV;
    u16* s_q0 = s_v + Cfg::kSmemKV;                    // kStages Q tiles
    u16* s_do0 = s_q0 + Cfg::kStages * Cfg::kSmemQ;    // kStages dO tiles
    u16* s_p = s_do0 + Cfg::kStages * Cfg::kSmemQ;     // P^T  [key][query]
    u16* s_ds = s_p + Cfg::kSmemP;                     // dS^T [key][query]
    float* s_lse0 = reinterpret_cast<float*>(s_ds + Cfg::kSmemP);  // kStages x kBlockM
    float* s_d0 = s_lse0 + Cfg::kStages * kBlockM;                 // kStages x kBlockM

    const u16* g_k = static_cast<const u16*>(p.k) + seq.k_off(p.k_batch_stride, p.k_row_stride) + hk * p.k_head_stride + n0 * p.k_row_stride;
    const u16* g_v = static_cast<const u16*>(p.v) + seq.k_off(p.v_batch_stride, p.v_row_stride) + hk * p.v_head_stride + n0 * p.v_row_stride;

    auto load_query_side = [&](int it, int stage) {
        const int h = walk.head(it);
        const int m0 = walk.m_block(it) * kBlockM;
        const u16* g_q = static_cast<const u16*>(p.q) + seq.q_off(p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride + m0 * p.q_row_stride;
        const u16* g_do = static_cast<const u16*>(p.dout) + seq.q_off(p.do_batch_stride, p.do_row_stride) + h * p.do_head_stride + m0 * p.do_row_stride;
        load_tile<Cfg, kBlockM>(s_q0 + stage * Cfg::kSmemQ, g_q, p.q_row_stride, seq.len_q(p) - m0, p.head_dim, tid);
        load_tile<Cfg, kBlockM>(s_do0 + stage * Cfg::kSmemQ, g_do, p.do_row_stride, seq.len_q(p) - m0, p.head_dim, tid);
        // lse_log2 and D rows are padded to whole query blocks: no bounds to check.
        const i64 row0 = seq.scratch_row(p, h) + m0;
        if (tid < kBlockM / 4) {
            cp_async_16(smem_u32(s_lse0 + stage * kBlockM + 4 * tid), p.lse_log2 + row0 + 4 * tid, true);
        } else if (tid < kBlockM / 2) {
            const int c = tid - kBlockM / 4;
            cp_async_16(smem_u32(s_d0 + stage * kBlockM + 4 * c), p.dsum + row0 + 4 * c, true);
        }
    };

    // Prologue: K, V and the first query block in one cp.async group.
    load_tile<Cfg, kBlockN>(s_k, g_k, p.k_row_stride, seq.len_k(p) - n0, p.head_dim, tid);
    load_tile<Cfg, kBlockN>(s_v, g_v, p.v_row_stride, seq.len_k(p) - n0, p.head_dim, tid);
    if (n_iters > 0) load_query_side(0, 0);
    cp_async_commit();

    // Warp positions in the three phase grids (see BwdConfig).
    const int s_key0 = Cfg::kSKeys * (warp % Cfg::kSKeyWarps), s_col0 = Cfg::kSQCols * (warp / Cfg::kSKeyWarps);
    const int kv_key0 = Cfg::kKVKeys * (warp % Cfg::kKVKeyWarps), kv_col0 = Cfg::kKVCols * (warp / Cfg::kKVKeyWarps);
    const int dq_row0 = Cfg::kDQRows * (warp % Cfg::kDQQWarps), dq_col0 = Cfg::kDQCols * (warp / Cfg::kDQQWarps);
    // ldmatrix lane offsets (elements): A rows of a 16 x 16 block (row lane % 16, column 8 (lane / 16));
    // B from the rows of an [n][k] tile (n = (lane % 8) + 8 (lane / 16), k = 8 ((lane / 8) % 2));
    // B from the rows of a [k][n] tile, transposed (k = (lane % 8) + 8 ((lane / 8) % 2), n = 8 (lane / 16)).
    const int a_kv_off = (s_key0 + lane % 16) * kStride + (lane / 16) * 8;
    const int b_q_off = (s_col0 + lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
    const int a_p_off = (kv_key0 + lane % 16) * kPStride + (lane / 16) * 8;
    const int bt_q_off = (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8 + kv_col0;
    // dS as the A operand of dQ = dS K, read transposed from sdS^T rows (key = (lane % 8) + 8 (lane / 16)).
    const int at_ds_off = (lane % 8 + (lane / 16) * 8) * kPStride + dq_row0 + ((lane / 8) % 2) * 8;
    const int bt_k_off = (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8 + dq_col0;

    float acc_dk[Cfg::kKVSlabs][Cfg::kKVNB][4], acc_dv[Cfg::kKVSlabs][Cfg::kKVNB][4];
#pragma unroll
    for (int s = 0; s < Cfg::kKVSlabs; ++s)
#pragma unroll
        for (int i = 0; i < Cfg::kKVNB; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[s][i][e] = acc_dv[s][i][e] = 0.f;

    for (int it = 0; it < n_iters; ++it) {
        const int stage = Cfg::kStages == 2 ? (it & 1) : 0;
        const int h = walk.head(it);
        const int m_block = walk.m_block(it);
        const int m0 = m_block * kBlockM;
        if constexpr (Cfg::kStages == 2) {
            cp_async_wait<0>();
            // Query block it visible to every warp; every warp is done with iteration it-1 (its stage,
            // sP and sdS), so the other stage can take block it+1.
            __syncthreads();
            if (it + 1 < n_iters) load_query_side(it + 1, stage ^ 1);
            cp_async_commit();
        } else {
            if (it > 0) {
                __syncthreads();  // every warp is done with query block it-1, sP and sdS
                load_query_side(it, 0);
                cp_async_commit();
            }
            cp_async_wait<0>();
            __syncthreads();  // query block it (and, first, K and V) visible to every warp
        }
        const u16* s_q = s_q0 + stage * Cfg::kSmemQ;
        const u16* s_do = s_do0 + stage * Cfg::kSmemQ;
        const float* s_lse = s_lse0 + stage * kBlockM;
        const float* s_d = s_d0 + stage * kBlockM;

        // Dropout keep bits of this iteration's S^T tile (dropout.cuh), drawn before the score MMAs so
        // the Philox work can interleave with them. Nothing without dropout.
        u32 keep[Cfg::kSSlabs][Cfg::kSNB / 2];
        if constexpr ((Cfg::kMods & kModDropout) != 0) {
            const DropoutStream rng(p.mod.seed, p.mod.offset, b, p.nheads, h, p.mod.keep_threshold);
            if constexpr (Cfg::kSSlabs % 2 == 0) {  // slab pairs are 32-key blocks: one Philox call for both
#pragma unroll
                for (int s = 0; s < Cfg::kSSlabs; s += 2)
#pragma unroll
                    for (int kk = 0; kk < Cfg::kSNB / 2; ++kk) {
                        const u32 both = rng.keep_bits_transposed(m0 + s_col0 + 16 * kk, n0 + s_key0 + 16 * s, lane);
                        keep[s][kk] = both & 0xffu;
                        keep[s + 1][kk] = both >> 8;
                    }
            } else {
#pragma unroll
                for (int s = 0; s < Cfg::kSSlabs; ++s)
#pragma unroll
                    for (int kk = 0; kk < Cfg::kSNB / 2; ++kk)
                        keep[s][kk] = rng.keep_bits_transposed16(m0 + s_col0 + 16 * kk, n0 + s_key0 + 16 * s, lane);
            }
        }

        // ---- Scores: S^T = K Q^T, dP^T = V dO^T       S^T[j][i] = sum_d K[j][d] Q[i][d]
        {
            constexpr int kSl = Cfg::kSSlabs, kNB = Cfg::kSNB;
            float S[kSl][kNB][4], dP[kSl][kNB][4];
#pragma unroll
            for (int s = 0; s < kSl; ++s)
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) S[s][nb][e] = dP[s][nb][e] = 0.f;
#pragma unroll
            for (int kd = 0; kd < Cfg::kHeadDim / 16; ++kd) {
                u32 ak[kSl][4], av[kSl][4];
#pragma unroll
                for (int s = 0; s < kSl; ++s) {
                    ldmatrix_x4(ak[s], smem_u32(s_k + a_kv_off + 16 * s * kStride + kd * 16));
                    ldmatrix_x4(av[s], smem_u32(s_v + a_kv_off + 16 * s * kStride + kd * 16));
                }
#pragma unroll
                for (int nb = 0; nb < kNB; nb += 2) {
                    u32 bq[4], bdo[4];
                    ldmatrix_x4(bq, smem_u32(s_q + b_q_off + nb * 8 * kStride + kd * 16));
                    ldmatrix_x4(bdo, smem_u32(s_do + b_q_off + nb * 8 * kStride + kd * 16));
#pragma unroll
                    for (int s = 0; s < kSl; ++s) {
                        mma_16816<kBF16>(S[s][nb], ak[s], bq[0], bq[1]);
                        mma_16816<kBF16>(S[s][nb + 1], ak[s], bq[2], bq[3]);
                        mma_16816<kBF16>(dP[s][nb], av[s], bdo[0], bdo[1]);
                        mma_16816<kBF16>(dP[s][nb + 1], av[s], bdo[2], bdo[3]);
                    }
                }
            }
            if constexpr ((Cfg::kMods & kModScores) == 0) {
                // Mask only the blocks that need it. Causal: where some key of the tile is later than what
                // the block's first row sees (this also hides keys past seqlen_k from every real row).
                // Otherwise: keys past seqlen_k in the last key block. Their K rows are zero, so S = 0 and
                // P = exp2(-lse_log2) would be finite but can overflow fp16 (or fp32) to inf; dQ's
                // dS K then turns inf * 0 into NaN.
                if (Cfg::kIsCausal ? n0 + kBlockN - 1 > m0 + offset : n0 + kBlockN > seq.len_k(p)) {
#pragma unroll
                    for (int s = 0; s < kSl; ++s)
#pragma unroll
                        for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int j = n0 + s_key0 + 16 * s + g + 8 * (e / 2);
                                const int i = m0 + s_col0 + 8 * nb + 2 * t + (e % 2);
                                if (Cfg::kIsCausal ? j > i + offset : j >= seq.len_k(p)) S[s][nb][e] = -kInf;
                            }
                }
                // P^T = exp2(S^T * scale_log2 - lse_log2[i]);  dS^T = P^T * (dP^T - D[i])
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = s_col0 + 8 * nb + 2 * t;
                    const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
                    const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
                    for (int s = 0; s < kSl; ++s)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const float p0 = fast_exp2(fmaf(S[s][nb][2 * r], p.scale_log2, -l2.x));
                            const float p1 = fast_exp2(fmaf(S[s][nb][2 * r + 1], p.scale_log2, -l2.y));
                            const float ds0 = p0 * (dP[s][nb][2 * r] - dd.x);
                            const float ds1 = p1 * (dP[s][nb][2 * r + 1] - dd.y);
                            const int row = s_key0 + 16 * s + g + 8 * r;
                            *reinterpret_cast<u32*>(s_p + row * kPStride + col) = pack2<kBF16>(p0, p1);
                            *reinterpret_cast<u32*>(s_ds + row * kPStride + col) = pack2<kBF16>(ds0, ds1);
                        }
                }
            } else {
                // The variants (masks.cuh): softcap and ALiBi on every score, the mask where the block
                // needs it, dropout on P (regenerated, dropout.cuh; dV takes the dropped and scaled P^T)
                // and on dP^T:  dS^T = P^T (Z dP^T / q - D) (1 - tanh^2), q the keep probability.
                const Mask mask(p.mod, seq.len_q(p), seq.len_k(p));
                const bool need_mask = mask.key_block_needs_mask(n0, kBlockN, m0, kBlockM);
                const float slope = Mask::alibi_slope(p.mod, b, h);
                // ALiBi distance d - j of query column 2t (nb 0, e 0) for this thread's key rows.
                float dist_row[kSl][2];
#pragma unroll
                for (int s = 0; s < kSl; ++s)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        dist_row[s][r] = static_cast<float>(m0 + s_col0 + 2 * t + offset - (n0 + s_key0 + 16 * s + g + 8 * r));
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = s_col0 + 8 * nb + 2 * t;
                    const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
                    const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
                    for (int s = 0; s < kSl; ++s)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int row = s_key0 + 16 * s + g + 8 * r;
                            float pd[2], ds[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float dt;
                                const float pr = mask.prob(S[s][nb][2 * r + e], m0 + col + e, n0 + row,
                                                           dist_row[s][r] + (8 * nb + e), e ? l2.y : l2.x,
                                                           p.scale_log2, need_mask, slope, &dt);
                                float dp = dP[s][nb][2 * r + e];
                                pd[e] = pr;
                                if constexpr (Mask::kDropout) {
                                    const bool kept = (keep[s][nb / 2] >> (4 * (nb % 2) + 2 * r + e)) & 1u;
                                    pd[e] = kept ? pr * p.mod.dropout_rp : 0.f;
                                    dp = kept ? dp * p.mod.dropout_rp : 0.f;
                                }
                                ds[e] = pr * (dp - (e ? dd.y : dd.x)) * dt;
                            }
                            *reinterpret_cast<u32*>(s_p + row * kPStride + col) = pack2<kBF16>(pd[0], pd[1]);
                            *reinterpret_cast<u32*>(s_ds + row * kPStride + col) = pack2<kBF16>(ds[0], ds[1]);
                        }
                }
            }
        }
        __syncthreads();  // sP and sdS complete: the next two phases read other warps' tiles

        // ---- dV += P^T dO, dK += dS^T Q                dV[j][d] += sum_i P[i][j] dO[i][d]
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
            u32 ap[Cfg::kKVSlabs][4], ads[Cfg::kKVSlabs][4];
#pragma unroll
            for (int s = 0; s < Cfg::kKVSlabs; ++s) {
                ldmatrix_x4(ap[s], smem_u32(s_p + a_p_off + 16 * s * kPStride + kq * 16));
                ldmatrix_x4(ads[s], smem_u32(s_ds + a_p_off + 16 * s * kPStride + kq * 16));
            }
#pragma unroll
            for (int db = 0; db < Cfg::kKVNB; db += 2) {
                u32 bdo[4], bq[4];
                ldmatrix_x4_trans(bdo, smem_u32(s_do + bt_q_off + kq * 16 * kStride + db * 8));
                ldmatrix_x4_trans(bq, smem_u32(s_q + bt_q_off + kq * 16 * kStride + db * 8));
#pragma unroll
                for (int s = 0; s < Cfg::kKVSlabs; ++s) {
                    mma_16816<kBF16>(acc_dv[s][db], ap[s], bdo[0], bdo[1]);
                    mma_16816<kBF16>(acc_dv[s][db + 1], ap[s], bdo[2], bdo[3]);
                    mma_16816<kBF16>(acc_dk[s][db], ads[s], bq[0], bq[1]);
                    mma_16816<kBF16>(acc_dk[s][db + 1], ads[s], bq[2], bq[3]);
                }
            }
        }

        // ---- dQ (part) = dS K                           dQ[i][d] += sum_j dS[i][j] K[j][d]
        {
            constexpr int kSl = Cfg::kDQSlabs, kNB = Cfg::kDQNB;
            float acc_dq[kSl][kNB][4];
#pragma unroll
            for (int s = 0; s < kSl; ++s)
#pragma unroll
                for (int i = 0; i < kNB; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_dq[s][i][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                u32 a[kSl][4];
#pragma unroll
                for (int s = 0; s < kSl; ++s) ldmatrix_x4_trans(a[s], smem_u32(s_ds + at_ds_off + kk * 16 * kPStride + 16 * s));
#pragma unroll
                for (int db = 0; db < kNB; db += 2) {
                    u32 bk[4];
                    ldmatrix_x4_trans(bk, smem_u32(s_k + bt_k_off + kk * 16 * kStride + db * 8));
#pragma unroll
                    for (int s = 0; s < kSl; ++s) {
                        mma_16816<kBF16>(acc_dq[s][db], a[s], bk[0], bk[1]);
                        mma_16816<kBF16>(acc_dq[s][db + 1], a[s], bk[2], bk[3]);
                    }
                }
            }
            int* turn = p.dq_turn + seq.turn_row(p, h) + m_block;
            if (p.deterministic) {
                // Every key block before this one visits this query block too (causal visits start at
                // the diagonal, which moves right with n): wait until all n_block of them have added.
                if (tid == 0) {
                    while (ld_acquire_gpu(turn) != blk.dq_turn(p, m0)) {
                    }
                }
                __syncthreads();  // the whole CTA adds only in its turn
            }
            // The tile is stored in register order (see flash_bwd_convert_kernel): each warp-wide vector reduction adds
            // 32 lanes x 4 consecutive floats, 512 contiguous bytes.
            float* g_dq = p.dq_accum + (seq.scratch_row(p, h) + m0) * p.dq_accum_cols +
                          (warp * kSl * kNB) * 128 + lane * 4;
#pragma unroll
            for (int s = 0; s < kSl; ++s)
#pragma unroll
                for (int db = 0; db < kNB; ++db)
                    red_add_f32x4(g_dq + (s * kNB + db) * 128, acc_dq[s][db][0], acc_dq[s][db][1], acc_dq[s][db][2], acc_dq[s][db][3]);
            if (p.deterministic) {
                __threadfence();  // this thread's additions are visible device-wide ...
                __syncthreads();  // ... for every thread of the CTA, before the turn passes on
                if (tid == 0) red_release_gpu_add(turn, 1);
            }
        }
    }

    // Epilogue: dK = scale * (dS^T Q summed), dV as accumulated; rows beyond seqlen_k and columns
    // beyond head_dim are not written.
    u16* g_dk = static_cast<u16*>(p.dk) + seq.k_off(p.dk_batch_stride, p.dk_row_stride) + hk * p.dk_head_stride;
    u16* g_dv = static_cast<u16*>(p.dv) + seq.k_off(p.dv_batch_stride, p.dv_row_stride) + hk * p.dv_head_stride;
#pragma unroll
    for (int s = 0; s < Cfg::kKVSlabs; ++s)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = n0 + kv_key0 + 16 * s + g + 8 * r;
            if (j >= seq.len_k(p)) continue;
            u16* dk_row = g_dk + j * p.dk_row_stride;
            u16* dv_row = g_dv + j * p.dv_row_stride;
#pragma unroll
            for (int db = 0; db < Cfg::kKVNB; ++db) {
                const int col = kv_col0 + 8 * db + 2 * t;
                const u32 pk = pack2<kBF16>(acc_dk[s][db][2 * r] * p.softmax_scale, acc_dk[s][db][2 * r + 1] * p.softmax_scale);
                const u32 pv = pack2<kBF16>(acc_dv[s][db][2 * r], acc_dv[s][db][2 * r + 1]);
                if constexpr (Cfg::kAligned) {  // head_dim % 8 == 0: both columns are in or both out
                    if (col < p.head_dim) {
                        *reinterpret_cast<u32*>(dk_row + col) = pk;
                        *reinterpret_cast<u32*>(dv_row + col) = pv;
                    }
                } else {
                    if (col < p.head_dim) {
                        dk_row[col] = static_cast<u16>(pk & 0xffffu);
                        dv_row[col] = static_cast<u16>(pv & 0xffffu);
                    }
                    if (col + 1 < p.head_dim) {
                        dk_row[col + 1] = static_cast<u16>(pk >> 16);
                        dv_row[col + 1] = static_cast<u16>(pv >> 16);
                    }
                }
            }
        }
}

// D = rowsum(dO * O) and lse_log2 of the padded query rows; blockDim = 256 (8 warps). Warp w of CTA x
// covers the p.pre_rows_per_warp (rpw) consecutive rows from (8 x + w) rpw, 32 / rpw lanes per row
// (the plan's choice, cuflash/plan/backward.py: on the aligned path about one 16-byte chunk of O and
// of dO per lane, e.g. 8 lanes x 4 rows at head dim 64; 32 lanes x 1 row element-wise), so every lane
// keeps loads in flight; the row's lanes add their partial sums by shuffles. Padding rows (past the
// sequence) get D = 0 and lse_log2 = +inf, as rows whose lse is -inf (no key): their P is exactly 0.
// Varlen: padded row r belongs to query tile r / block_m of the scheduler (varlen.cuh), which names the
// sequence and its row. A warp's rows lie in one tile (block_m is a multiple of 16, rpw divides 8), so
// each warp searches once for its first row. Each padded row's dq_accum row is zeroed here too,
// and the persistent Hopper backward's item counter.
template <bool kIsBF16, bool kAligned, bool kVarlen = false>
CUFLASH_DEVICE void flash_bwd_pre_kernel(const BwdParams& p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
    const int rpw = p.pre_rows_per_warp, lanes = 32 / rpw, sub = lane % lanes;
    if (p.item_counter != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
        *p.item_counter = 0;  // (the persistent main kernel's item counter: it runs after this kernel)
    }
    const int r0 = (blockIdx.x * 8 + warp) * rpw;  // the warp's first padded row
    if (r0 >= p.seqlen_q_pad) return;              // uniform over the warp (seqlen_q_pad is a multiple of rpw)
    const int r = r0 + lane / lanes;               // this lane's padded row
    i64 idx, lse_idx;                              // scratch index, lse index (when real)
    bool real;
    const u16 *o, *dout;
    if constexpr (kVarlen) {
        const SeqInfo<true> seq(p, varlen_find_seq(p.mod.cu_seqlens_q, p.batch, p.seqlen_q, p.block_m, r0 / p.block_m),
                                p.block_m);
        const int i = r - seq.q_tile0 * p.block_m;  // the sequence's row (>= 0 unless cu_seqlens_q is invalid)
        real = i >= 0 && i < seq.seqlen_q;
        idx = (i64)h * p.seqlen_q_pad + r;
        const i64 row = seq.q_start + i;
        lse_idx = seq.lse_row(p, h) + i;
        o = static_cast<const u16*>(p.o) + h * p.o_head_stride + row * p.o_row_stride;
        dout = static_cast<const u16*>(p.dout) + h * p.do_head_stride + row * p.do_row_stride;
    } else {
        const int b = blockIdx.z;
        real = r < p.seqlen_q;
        idx = ((i64)b * p.nheads + h) * p.seqlen_q_pad + r;
        lse_idx = ((i64)b * p.nheads + h) * p.seqlen_q + r;
        o = static_cast<const u16*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + (i64)r * p.o_row_stride;
        dout = static_cast<const u16*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride + (i64)r * p.do_row_stride;
    }
    float dsum = 0.f;
    if (real) {
        if constexpr (kAligned) {  // 16-byte rows: a lane owns 8 consecutive columns per step
            for (int c = 8 * sub; c < p.head_dim; c += 8 * lanes) {
                const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
                const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
                const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    dsum += to_float<kIsBF16>(ow[w] & 0xffffu) * to_float<kIsBF16>(dw[w] & 0xffffu);
                    dsum += to_float<kIsBF16>(ow[w] >> 16) * to_float<kIsBF16>(dw[w] >> 16);
                }
            }
        } else {
            for (int c = sub; c < p.head_dim; c += lanes) dsum += to_float<kIsBF16>(o[c]) * to_float<kIsBF16>(dout[c]);
        }
    }
    for (int off = lanes / 2; off > 0; off /= 2) dsum += __shfl_xor_sync(0xffffffffu, dsum, off);  // within the row's lanes
    if (sub == 0) {
        const float lse = real ? p.lse[lse_idx] : -kInf;
        p.dsum[idx] = dsum;
        p.lse_log2[idx] = lse == -kInf ? kInf : lse * kLog2e;
    }
    // Zero this row of dq_accum (dq_accum_cols floats, a multiple of 32; the buffer is 16-byte aligned),
    // which the main kernel adds into: every padded row of the buffer is some warp's row, so this replaces
    // a memset launch of the same bytes.
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + idx * p.dq_accum_cols);
    for (int c = sub; c < p.dq_accum_cols / 4; c += lanes) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dQ = dq_accum * softmax_scale in q's dtype. CTA (m, h, b) converts query block m's tile, which
// the main kernel stored in its register order: float4 number f of the tile holds, for warp
// w = f / (slabs * blocks), register group (s, db) = ((f % (slabs * blocks)) / blocks, f % blocks)
// of lane f % 32 ... precisely: f = (w * slabs * blocks + s * blocks + db) * 32 + lane, and its four
// floats are rows (16 s + g, 16 s + g + 8) x columns (8 db + 2 t, + 1) of warp w's rows x cols dQ
// tile (g = lane / 4, t = lane % 4). The tile is read in that order (coalesced), staged in smem as
// rows, and written out row by row (16-byte stores on the aligned path). blockDim = 256.
constexpr int kConvertSmemElems = 64 * (256 + 8);  // largest block_m * (bucket + 8) of any tile (cuflash/plan/backward.py checks)

// Varlen: CTA (t, h) converts the scheduler's query tile t (varlen.cuh), stored at padded rows
// t * block_m, into the rows of the tile m of the sequence it names; spare slots exit.
// kTransposed: the main kernel added dQ^T (the TMA backward's 80-row blocks): a warp tile's rows are
// head-dim columns and its columns query rows, and they are staged in smem swapped.
template <bool kIsBF16, bool kAligned, bool kVarlen = false, bool kTransposed = false>
CUFLASH_DEVICE void flash_bwd_convert_kernel(const BwdParams& p) {
    __shared__ __align__(16) u16 s_tile[kConvertSmemElems];
    const int m0 = blockIdx.x * p.block_m, h = blockIdx.y, b = blockIdx.z;  // (varlen: b = 0, m0 the padded row)
    int vrows = 0;  // varlen: the tile's rows and the packed row of its first
    i64 vrow0 = 0;
    if constexpr (kVarlen) {
        const VarlenTile<BwdParams> vt(p, false, p.block_m, p.block_m, false);
        if (vt.skip) return;
        vrows = min(p.block_m, vt.seq.seqlen_q - vt.m_block * p.block_m);
        vrow0 = vt.seq.q_start + vt.m_block * p.block_m;
    }
    const int cols = p.dq_accum_cols, stride = cols + 8;
    const int rows_w = p.dq_tile_rows, cols_w = p.dq_tile_cols, blocks = cols_w / 8;
    const int per_warp = (rows_w / 16) * blocks;  // float4 groups of 32 lanes per warp
    const float4* tile = reinterpret_cast<const float4*>(p.dq_accum + (((i64)b * p.nheads + h) * p.seqlen_q_pad + m0) * cols);
    const float sc = p.softmax_scale;
    // Warp i of the CTA takes the groups of 32 float4s numbered i, i + nwarps, ..., kLoads of them in flight
    // before any is used (one load at a time left the kernel bound by the load latency, not by HBM); a
    // group's (w, s, db) advance by nwarps as a mixed-radix count instead of divisions per float4.
    constexpr int kLoads = 8;
    const int lane = threadIdx.x % 32, nwarps = blockDim.x / 32, n_grp = p.block_m * cols / 128, slabs = rows_w / 16;
    int grp = threadIdx.x / 32;
    int w = grp / per_warp, s = (grp % per_warp) / blocks, db = grp % blocks;
    int wq = w % p.dq_q_warps, wc = w / p.dq_q_warps;  // warp w's rows x cols tile: (wq, wc)
    for (; grp < n_grp; grp += kLoads * nwarps) {
        float4 x[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u)
            if (grp + u * nwarps < n_grp) x[u] = tile[(grp + u * nwarps) * 32 + lane];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            if (grp + u * nwarps >= n_grp) break;
            const int r = wq * rows_w + 16 * s + lane / 4, c = wc * cols_w + 8 * db + 2 * (lane % 4);
            if constexpr (!kTransposed) {
                *reinterpret_cast<u32*>(s_tile + r * stride + c) = pack2<kIsBF16>(x[u].x * sc, x[u].y * sc);
                *reinterpret_cast<u32*>(s_tile + (r + 8) * stride + c) = pack2<kIsBF16>(x[u].z * sc, x[u].w * sc);
            } else {  // dQ^T tiles: r, r + 8 are head-dim columns, c, c + 1 query rows
                const u32 a = pack2<kIsBF16>(x[u].x * sc, x[u].z * sc), b = pack2<kIsBF16>(x[u].y * sc, x[u].w * sc);
                s_tile[c * stride + r] = static_cast<u16>(a);
                s_tile[c * stride + r + 8] = static_cast<u16>(a >> 16);
                s_tile[(c + 1) * stride + r] = static_cast<u16>(b);
                s_tile[(c + 1) * stride + r + 8] = static_cast<u16>(b >> 16);
            }
            for (db += nwarps; db >= blocks;) {  // the next group of this warp: nwarps further
                db -= blocks;
                if (++s == slabs) {
                    s = 0;
                    if (++wq == p.dq_q_warps) wq = 0, ++wc;
                }
            }
        }
    }
    __syncthreads();  // the whole tile is in smem as rows
    int rows;  // dQ rows of this tile, from its first at dq
    u16* dq;
    if constexpr (kVarlen) {
        rows = vrows;
        dq = static_cast<u16*>(p.dq) + h * p.dq_head_stride + vrow0 * p.dq_row_stride;
    } else {
        rows = min(p.block_m, p.seqlen_q - m0);
        dq = static_cast<u16*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + (i64)m0 * p.dq_row_stride;
    }
    if constexpr (kAligned) {  // head_dim % 8 == 0: whole 16-byte chunks
        const int chunks = p.head_dim / 8;
        for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
            const int r = i / chunks, c = (i % chunks) * 8;
            *reinterpret_cast<uint4*>(dq + r * p.dq_row_stride + c) = *reinterpret_cast<const uint4*>(s_tile + r * stride + c);
        }
    } else {
        for (int i = threadIdx.x; i < rows * p.head_dim; i += blockDim.x) {
            const int r = i / p.head_dim, c = i % p.head_dim;
            dq[r * p.dq_row_stride + c] = s_tile[r * stride + c];
        }
    }
}

}  // namespace cuflash
