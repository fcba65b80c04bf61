// FlashAttention-2 backward main kernel on Hopper warpgroup MMA (wgmma, sm_90a only).
//
// Computes what flash_bwd_kernel (flash_bwd.cuh) computes and writes the same outputs: dK and dV of
// its keys (summed over the query heads of a GQA group) and its part of dQ, added with fp32 vector
// reductions to dq_accum in the layout flash_bwd_convert_kernel reads. The preprocess (D, lse_log2)
// and convert kernels of flash_bwd.cuh run around it unchanged. Read that file's header first.
//
// Grid and tiles
//   grid  = (ceil(seqlen_k / kBlockN), nheads_kv, batch): CTA (n, hk, b) owns keys [n kBlockN, ...)
//           and walks every (query head of the group, query block of kBlockM = 64 rows) that sees them.
//   block = kBlockN / 64 warpgroups. Warpgroup w owns keys [64 w, 64 w + 64) of the CTA; warp i of
//           it owns key rows 64 w + 16 i + (g, g + 8) of every accumulator (g = lane / 4).
//   Per query block, warpgroup w:
//     S^T  = K_w Q^T, dP^T = V_w dO^T        wgmma m64n64, A = K_w / V_w, B = Q / dO, all from smem
//     P^T  = exp2(S^T scale_log2 - lse_log2[q]),  dS^T = P^T (dP^T - D[q])   (registers; mask: bwd_p_pair)
//     dV_w += P^T dO,  dK_w += dS^T Q         wgmma m64n{d}, A = P^T / dS^T from registers, B = dO / Q
//                                             read N-major; dK, dV accumulate in registers all along
//     dS^T -> smem (every warpgroup's 64 keys), barrier, then
//     dQ[:, w d/2 .. (w+1) d/2] = dS K        wgmma m64n{d/2}, A = dS read M-major from the dS^T rows,
//                                             B = K read N-major: one column half per warpgroup
//     dq_accum += dQ part                     red.global.add.v4.f32 in register order
//   smem  = K, V [kBlockN x d] + 2 x (Q, dO [64 x d]) + dS^T [kBlockN x 64] + 2 x (lse_log2, D [64]);
//           every tile in the 128-byte swizzled layout of load_tile_sw128 (flash_fwd_sm90.cuh),
//           1024-byte aligned. Query block i+1 streams in (cp.async) while block i is used.
//
// Head dim 256 (kBlockN == 64: flash_bwd_sm90_split_kernel): dK + dV of 64 keys x 256 columns would
// take 256 registers per thread, so the two warpgroups split the work instead of the keys. Per
// query block: warpgroup 0 computes S^T and P^T (64 keys x 64 queries), warpgroup 1 dP^T; P^T goes
// to warpgroup 1 through smem (fp32), which forms dS^T and shares it (bf16, swizzled); then each
// warpgroup accumulates dV, dK and computes dQ for its half of the head dim (128 columns).
//
// Preconditions (cuflash/plan/backward.py picks this kernel only then): sm_90a; 16-byte aligned rows and
// head_dim % 8 == 0; head-dim bucket 64 or 128 (kBlockN 128) or 256 (kBlockN 64); deterministic mode
// off (it runs flash_bwd_kernel).
#pragma once

#include "flash_bwd.cuh"  // BwdQueryWalk, the dQ layout of flash_bwd_convert_kernel
#include "sm90_tile.cuh"

namespace cuflash {

template <int kHeadDim_, int kBlockN_, bool kIsBF16_, bool kIsCausal_, int kMods_ = 0, int kBlockM_ = 64>
struct Sm90BwdConfig {
    static constexpr int kHeadDim = kHeadDim_;
    // Query rows per iteration: the N of S^T; 64 is one wgmma M of dQ; in the warp-specialized kernel also
    // 128 at head dim 64 (one M per warpgroup: each warpgroup's dQ part is its 64 rows x every column) and 80
    // at head dim 128 (no M: each warpgroup computes dQ^T, its head-dim half x the 80 rows).
    static constexpr int kBlockM = kBlockM_;
    static constexpr bool kDQTransposed = kBlockM == 80;
    static constexpr int kBlockN = kBlockN_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr bool kSplit = kBlockN == 64;  // warpgroups split the head dim, not the keys
    static constexpr int kMods = kMods_;           // attention variants (masks.cuh kMod* bits)

    static constexpr int kNWarps = 8;  // two warpgroups
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kChunksPerRow = kHeadDim / 8;  // load_tile_sw128
    // dQ (and, split, dK / dV) columns per warpgroup, the N of its dQ wgmma: a head-dim half of all kBlockM =
    // 64 rows, all columns of the warpgroup's 64 rows (kBlockM = 128), or the 80 query rows of dQ^T
    static constexpr int kDQCols = kBlockM == 128 ? kHeadDim : (kDQTransposed ? kBlockM : kHeadDim / 2);

    static constexpr int kTileBytesKV = kBlockN * kHeadDim * 2;
    static constexpr int kTileBytesQ = kBlockM * kHeadDim * 2;
    // dS^T [kBlockN x kBlockM] in 64-query atoms of kBlockN rows x 128 bytes (80 queries: a second atom whose
    // rows hold 16 queries, swizzled over the whole 128 bytes)
    static constexpr int kTileBytesDS = kBlockN * ((kBlockM + 63) / 64) * 128;
    static constexpr int kPStride = kBlockM + 4;  // fp32 P^T exchange rows (split): 16 bytes of padding
    static constexpr int kExchangeBytes = kSplit ? kBlockN * kPStride * 4 : 0;
    static constexpr int kSmemBytes =
        1024 + 2 * kTileBytesKV + 4 * kTileBytesQ + kTileBytesDS + kExchangeBytes + 2 * 2 * kBlockM * 4;

    static_assert(kSplit ? kHeadDim == 256 : (kHeadDim == 64 || kHeadDim == 128),
                  "dK + dV accumulators: at most 128 registers per thread");
    static_assert(kBlockN == 128 || kBlockN == 64, "keys per CTA: 64 per warpgroup, or 64 split");
    static_assert(kDQCols % 32 == 0 || kDQTransposed, "dQ halves are whole wgmma N blocks");
    static_assert(kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64 && !kSplit) || (kBlockM == 80 && kHeadDim == 128 && !kSplit),
                  "S^T and dP^T of 128 query rows take 64 registers each (only head dim 64's dK and dV fit beside them), "
                  "of 80 rows 40 (head dim 128's)");
};

// Shared memory of both Hopper backward kernels (Sm90BwdConfig::kSmemBytes, 1024-byte aligned):
// K, V [kBlockN x d]; 2 stages of Q, dO [64 x d]; dS^T [kBlockN x 64] (swizzled rows of 128 bytes);
// the split kernel's fp32 P^T exchange; 2 stages of (lse_log2[64], D[64]). Plus the loads into it.
template <class Cfg>
struct Sm90BwdSmem {
    u32 k, v, q0, do0, ds, pf, rows0;  // shared-space addresses (q0, do0, rows0: stage 0)
    float* pf_ptr;                      // pf and rows0 as pointers
    const float* rows_ptr;

    CUFLASH_DEVICE explicit Sm90BwdSmem(unsigned char* smem_raw) {
        const u32 raw = smem_u32(smem_raw);
        k = (raw + 1023u) & ~1023u;  // the swizzle pattern starts on 1024 bytes
        v = k + Cfg::kTileBytesKV;
        q0 = v + Cfg::kTileBytesKV;
        do0 = q0 + 2 * Cfg::kTileBytesQ;
        ds = do0 + 2 * Cfg::kTileBytesQ;
        pf = ds + Cfg::kTileBytesDS;
        rows0 = pf + Cfg::kExchangeBytes;
        pf_ptr = reinterpret_cast<float*>(smem_raw + (pf - raw));
        rows_ptr = reinterpret_cast<const float*>(smem_raw + (rows0 - raw));
    }
    CUFLASH_DEVICE u32 q(int stage) const { return q0 + stage * Cfg::kTileBytesQ; }
    CUFLASH_DEVICE u32 dout(int stage) const { return do0 + stage * Cfg::kTileBytesQ; }
    CUFLASH_DEVICE const float* lse_log2(int stage) const { return rows_ptr + stage * 2 * Cfg::kBlockM; }
    CUFLASH_DEVICE const float* dsum(int stage) const { return lse_log2(stage) + Cfg::kBlockM; }

    // K and V rows [n0, n0 + kBlockN) of kv head hk of sequence seq (zero-filled past its keys).
    template <class Seq>
    CUFLASH_DEVICE void load_kv(const BwdParams& p, const Seq& seq, int hk, int n0, int tid) const {
        const u16* g_k = static_cast<const u16*>(p.k) + seq.k_off(p.k_batch_stride, p.k_row_stride) + hk * p.k_head_stride + n0 * p.k_row_stride;
        const u16* g_v = static_cast<const u16*>(p.v) + seq.k_off(p.v_batch_stride, p.v_row_stride) + hk * p.v_head_stride + n0 * p.v_row_stride;
        load_tile_sw128<Cfg, Cfg::kBlockN>(k, g_k, p.k_row_stride, seq.len_k(p) - n0, p.head_dim, tid);
        load_tile_sw128<Cfg, Cfg::kBlockN>(v, g_v, p.v_row_stride, seq.len_k(p) - n0, p.head_dim, tid);
    }

    // Query block m0 of query head h into one stage: Q and dO tiles, lse_log2 and D rows.
    template <class Seq>
    CUFLASH_DEVICE void load_query(const BwdParams& p, const Seq& seq, int h, int m0, int stage, int tid) const {
        constexpr int kBlockM = Cfg::kBlockM;
        const u16* g_q = static_cast<const u16*>(p.q) + seq.q_off(p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride + m0 * p.q_row_stride;
        const u16* g_do = static_cast<const u16*>(p.dout) + seq.q_off(p.do_batch_stride, p.do_row_stride) + h * p.do_head_stride + m0 * p.do_row_stride;
        load_tile_sw128<Cfg, kBlockM>(q(stage), g_q, p.q_row_stride, seq.len_q(p) - m0, p.head_dim, tid);
        load_tile_sw128<Cfg, kBlockM>(dout(stage), g_do, p.do_row_stride, seq.len_q(p) - m0, p.head_dim, tid);
        // lse_log2 and D rows are padded to whole query blocks: no bounds to check.
        const i64 row0 = seq.scratch_row(p, h) + m0;
        const u32 s_rows = rows0 + stage * 2 * kBlockM * 4;
        if (tid < kBlockM / 4) {
            cp_async_16(s_rows + 16 * tid, p.lse_log2 + row0 + 4 * tid, true);
        } else if (tid < kBlockM / 2) {
            const int c = tid - kBlockM / 4;
            cp_async_16(s_rows + kBlockM * 4 + 16 * c, p.dsum + row0 + 4 * c, true);
        }
    }
};

// P^T of key row j for queries i and i + 1: exp2(S^T scale_log2 - lse_log2), 0 where the key is
// hidden, on the blocks that need a mask (bwd_needs_mask): causal, query i sees keys j <= i + offset
// (which also hides keys past seqlen_k from every real row); otherwise keys j >= seqlen_k.
template <bool kCausal>
CUFLASH_DEVICE float2 bwd_p_pair(float s0, float s1, float2 lse2, float scale_log2, bool mask, int j, int i, int offset,
                                 int seqlen_k) {
    float p0 = fast_exp2(fmaf(s0, scale_log2, -lse2.x));
    float p1 = fast_exp2(fmaf(s1, scale_log2, -lse2.y));
    if (mask) {
        if (kCausal ? j > i + offset : j >= seqlen_k) p0 = 0.f;
        if (kCausal ? j > i + 1 + offset : j >= seqlen_k) p1 = 0.f;
    }
    return make_float2(p0, p1);
}

// Whether the (query block m0, key block n0) tile needs bwd_p_pair's mask. The keys past seqlen_k
// have zero K rows, so S = 0 and exp2(-lse_log2) can overflow fp16 (or fp32) to inf: unmasked, dQ's
// dS K would turn inf * 0 into NaN.
template <bool kCausal>
CUFLASH_DEVICE bool bwd_needs_mask(int n0, int block_n, int m0, int offset, int seqlen_k) {
    return kCausal ? n0 + block_n - 1 > m0 + offset : n0 + block_n > seqlen_k;
}

// Whether the (query block m0, key block n0) tile of a Hopper backward kernel (Cfg) needs its mask:
// bwd_needs_mask for plain variants, the variants' AttnMask otherwise.
template <class Cfg, class Seq>
CUFLASH_DEVICE bool bwd_sm90_needs_mask(const BwdParams& p, const Seq& seq, int n0, int m0, int offset) {
    if constexpr ((Cfg::kMods & kModScores) == 0) {
        return bwd_needs_mask<Cfg::kIsCausal>(n0, Cfg::kBlockN, m0, offset, seq.len_k(p));
    } else {
        return AttnMask<Cfg::kIsCausal, Cfg::kMods>(p.mod, seq.len_q(p), seq.len_k(p))
            .key_block_needs_mask(n0, Cfg::kBlockN, m0, Cfg::kBlockM);
    }
}

// What every backward orientation of the variants shares (masks.cuh): the mask, the ALiBi slope of query
// head h and dropout's 1 / keep probability; per element P (0 where hidden), the P that dV takes
// (dropped, scaled by 1 / the keep probability) and P (1 - tanh^2) that dS takes; dP as dS takes it.
// BwdModTile (S^T, keys in rows) and BwdModRows (S, queries in rows; flash_bwd_sm90_ws.cuh) add the
// dropout keep bits in their layout.
template <class Mask>
struct BwdModBase {
    Mask mask;
    float slope, rp;

    template <class Seq>
    CUFLASH_DEVICE BwdModBase(const BwdParams& p, const Seq& seq, int h)
        : mask(p.mod, seq.len_q(p), seq.len_k(p)), slope(Mask::alibi_slope(p.mod, seq.b, h)), rp(p.mod.dropout_rp) {}
    // P of query i, key j (raw score s, dist the ALiBi distance d - j as a float); *dt: what dS multiplies
    // P by (softcap: 1 - tanh^2).
    CUFLASH_DEVICE float prob(float s, int i, int j, float dist, float lse_log2, float scale_log2, bool need_mask,
                              float* dt) const {
        return mask.prob(s, i, j, dist, lse_log2, scale_log2, need_mask, slope, dt);
    }
    // P as dV takes it: dropped, scaled by 1 / the keep probability, with dropout.
    CUFLASH_DEVICE float dropped_p(float pr, bool kept) const { return Mask::kDropout ? (kept ? pr * rp : 0.f) : pr; }
    // dP as dS takes it: Z dP / the keep probability with dropout.
    CUFLASH_DEVICE float dropped_dp(float dp, bool kept) const { return Mask::kDropout ? (kept ? dp * rp : 0.f) : dp; }
};

// The variants on a warp's 16 keys x kNB * 8 queries of S^T: BwdModBase and the dropout keep bits of
// the warp's 16x16 blocks (keys from key16).
template <class Mask, int kNB>
struct BwdModTile : BwdModBase<Mask> {
    u32 keep[Mask::kDropout ? kNB / 2 : 1];

    template <class Seq>
    CUFLASH_DEVICE BwdModTile(const BwdParams& p, const Seq& seq, int h, int m0, int key16, int lane)
        : BwdModBase<Mask>(p, seq, h) {
        if constexpr (Mask::kDropout) {
            const DropoutStream rng(p.mod.seed, p.mod.offset, seq.b, p.nheads, h, p.mod.keep_threshold);
#pragma unroll
            for (int kk = 0; kk < kNB / 2; ++kk) keep[kk] = rng.keep_bits_transposed16(m0 + 16 * kk, key16, lane);
        }
    }
    // Key j, queries i and i + 1: elements S^T[nb][2r], S^T[nb][2r + 1] of raw scores s0, s1; dist: i's
    // ALiBi distance d - j as a float (dist_base(j, i0) + 8 nb, for i = i0 + 8 nb).
    CUFLASH_DEVICE void probs(float s0, float s1, float2 lse2, float scale_log2, bool need_mask, int nb, int r, int j, int i,
                              float dist, float (&pd)[2], float (&pdt)[2], bool (&kept_e)[2]) const {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float dt;
            const float pr = this->prob(e ? s1 : s0, i + e, j, dist + e, e ? lse2.y : lse2.x, scale_log2, need_mask, &dt);
            kept_e[e] = kept(nb, r, e);
            pd[e] = this->dropped_p(pr, kept_e[e]);
            pdt[e] = pr * dt;
        }
    }
    // Whether dropout kept element (nb, 2 r + e) of the warp's S^T (always, without dropout).
    CUFLASH_DEVICE bool kept(int nb, int r, int e) const {
        if constexpr (Mask::kDropout) {
            return (keep[nb / 2] >> (4 * (nb % 2) + 2 * r + e)) & 1u;
        } else {
            return true;
        }
    }
    // d - j of key j and query i as a float (the ALiBi distance; i + 8 nb adds 8 nb).
    CUFLASH_DEVICE float dist_base(int j, int i) const {
        return static_cast<float>(i + this->mask.diag() - j);
    }
};

// Plain variants carry no variant state (BwdModTileOf; flash_bwd_sm90_ws.cuh's BwdModRowsOf).
struct BwdNoMods {
    template <class Seq>
    CUFLASH_DEVICE BwdNoMods(const BwdParams&, const Seq&, int, int, int, int) {}
    CUFLASH_DEVICE bool kept(int, int, int) const { return true; }
};
template <class Mask, int kNB>
using BwdModTileOf = Choose<(Mask::kBits & kModScores) != 0, BwdModTile<Mask, kNB>, BwdNoMods>;

// P^T of key j and queries i, i + 1 (elements S^T[nb][2 r], S^T[nb][2 r + 1] of raw scores s0, s1; i0 =
// m0 + 2 t, the thread's first query of the block) for the two 64-key kernels: pv what dV takes
// (dropout: dropped, scaled by 1 / the keep probability), pd what dS^T takes (softcap: times
// 1 - tanh^2), kept whether dropout kept each. Plain variants: bwd_p_pair, pv = pd.
template <class Cfg, class Mods>
CUFLASH_DEVICE void bwd_sm90_probs(const BwdParams& p, const Mods& mods, float s0, float s1, float2 l2, bool need_mask, int nb,
                                   int r, int j, int i, int i0, int offset, int len_k, float (&pv)[2], float (&pd)[2],
                                   bool (&kept)[2]) {
    if constexpr ((Cfg::kMods & kModScores) == 0) {
        const float2 pp = bwd_p_pair<Cfg::kIsCausal>(s0, s1, l2, p.scale_log2, need_mask, j, i, offset, len_k);
        pv[0] = pd[0] = pp.x;
        pv[1] = pd[1] = pp.y;
        kept[0] = kept[1] = true;
    } else {
        mods.probs(s0, s1, l2, p.scale_log2, need_mask, nb, r, j, i, mods.dist_base(j, i0) + 8 * nb, pv, pd, kept);
    }
}

// dS^T of one element from bwd_sm90_probs' pd: pd (dP^T - D[i]), dP^T dropped and scaled with dropout.
template <class Cfg, class Mods>
CUFLASH_DEVICE float bwd_sm90_ds(const Mods& mods, float pd, float dp, float d, bool kept) {
    if constexpr ((Cfg::kMods & kModScores) == 0) {
        return pd * (dp - d);
    } else {
        return pd * (mods.dropped_dp(dp, kept) - d);
    }
}

// dq_accum += this warp's dQ part (query block at m0 of head h): kCols / 8 float4 groups per thread,
// in the register order of flash_bwd_convert_kernel with the tile's dq_q_warps (4 at 64-row query blocks:
// warp w = 4 wg + i holds rows 16 i + (g, g + 8) of column block wg; 8 in the TMA backward's 128- and
// 80-row blocks, whose warps hold 16 query rows x all columns, or at 80 rows 16 head-dim rows x 80 queries
// of dQ^T: plan.BwdSm90WsTile.dq_q_warps): one 512-byte warp-wide vector reduction per group.
template <int kCols, class Seq>
CUFLASH_DEVICE void bwd_sm90_add_dq(const BwdParams& p, const float (&acc_dq)[kCols / 2], const Seq& seq, int h, int m0,
                                    int warp, int lane) {
    constexpr int kDB = kCols / 8;
    float* g_dq = p.dq_accum + (seq.scratch_row(p, h) + m0) * p.dq_accum_cols + (warp * kDB) * 128 + lane * 4;
#pragma unroll
    for (int db = 0; db < kDB; ++db) {
        red_add_f32x4(g_dq + db * 128, acc_dq[4 * db], acc_dq[4 * db + 1], acc_dq[4 * db + 2], acc_dq[4 * db + 3]);
    }
}

// Epilogue: dK = scale * (dS^T Q summed) and dV as accumulated, for key rows j and j + 8 and the
// kCols columns from col0 (accumulator (row r, 8-column block db, element e) = acc[4 db + 2 r + e]).
// Rows beyond seqlen_k and columns beyond head_dim (whole 8-column pairs: head_dim % 8 == 0) are not written.
template <bool kBF16, int kCols, class Seq>
CUFLASH_DEVICE void bwd_sm90_store_dkdv(const BwdParams& p, const float (&acc_dk)[kCols / 2], const float (&acc_dv)[kCols / 2],
                                        const Seq& seq, int hk, int j, int col0, int t) {
    u16* g_dk = static_cast<u16*>(p.dk) + seq.k_off(p.dk_batch_stride, p.dk_row_stride) + hk * p.dk_head_stride;
    u16* g_dv = static_cast<u16*>(p.dv) + seq.k_off(p.dv_batch_stride, p.dv_row_stride) + hk * p.dv_head_stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = j + 8 * r;
        if (row >= seq.len_k(p)) continue;
        u16* dk_row = g_dk + row * p.dk_row_stride;
        u16* dv_row = g_dv + row * p.dv_row_stride;
#pragma unroll
        for (int db = 0; db < kCols / 8; ++db) {
            const int col = col0 + 8 * db + 2 * t;
            if (col < p.head_dim) {
                *reinterpret_cast<u32*>(dk_row + col) =
                    pack2<kBF16>(acc_dk[4 * db + 2 * r] * p.softmax_scale, acc_dk[4 * db + 2 * r + 1] * p.softmax_scale);
                *reinterpret_cast<u32*>(dv_row + col) = pack2<kBF16>(acc_dv[4 * db + 2 * r], acc_dv[4 * db + 2 * r + 1]);
            }
        }
    }
}

// Head dims 64 and 128: each warpgroup owns 64 keys (see the header).
template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_pair_kernel(const BwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kNB = kBlockM / 8;           // 8-column blocks of S^T (queries)
    constexpr int kQSteps = kBlockM / 16;      // k-steps of dV, dK (over queries)
    constexpr int kDSteps = kHeadDim / 16;     // k-steps of S^T, dP^T (over the head dim)
    constexpr int kKeySteps = kBlockN / 16;    // k-steps of dQ (over keys)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4, g = lane / 4, t = lane % 4;
    const BwdKeyBlock<Cfg> blk = BwdKeyBlock<Cfg>::make(p);  // key block n_block of sequence seq (varlen.cuh)
    if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
        if (blk.skip) return;
    }
    const auto& seq = blk.seq;
    const int n_block = blk.n_block, hk = blockIdx.y;
    const int n0 = n_block * kBlockN;
    const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset

    const BwdQueryWalk walk = blk.walk(p, hk);
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;
    const int n_iters = walk.n_iters;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Sm90BwdSmem<Cfg> sm(smem_raw);
    const u32 s_k = sm.k, s_v = sm.v, s_q0 = sm.q0, s_do0 = sm.do0, s_ds = sm.ds;
    auto load_query_side = [&](int it, int stage) { sm.load_query(p, seq, walk.head(it), walk.m_block(it) * kBlockM, stage, tid); };
    sm.load_kv(p, seq, hk, n0, tid);  // prologue: K, V and the first query block in one group
    if (n_iters > 0) load_query_side(0, 0);
    cp_async_commit();

    // Descriptors (see flash_fwd_sm90.cuh). K-major A/B: k-step ks of the head dim moves 32 bytes
    // inside a 64-column atom, atoms are rows * 128 bytes apart. N-major B (dO, Q as B of dV, dK; K as
    // B of dQ) and M-major A (dS^T rows as A of dQ): 64-column atoms rows * 128 bytes apart (leading
    // offset), 16 rows of k per step = 2048 bytes.
    const u64 desc_k_w = sw128_desc(s_k + wg * 64 * 128, 16);
    const u64 desc_v_w = sw128_desc(s_v + wg * 64 * 128, 16);
    const u64 desc_q0 = sw128_desc(s_q0, 16);
    const u64 desc_do0 = sw128_desc(s_do0, 16);
    const u64 desc_q0_n = sw128_desc(s_q0, kBlockM * 128);
    const u64 desc_do0_n = sw128_desc(s_do0, kBlockM * 128);
    const u64 desc_ds = sw128_desc(s_ds, kBlockN * 128);
    // dQ columns [wg * kDQCols, ...) of K: whole atoms (hd128) or half an atom (hd64: +64 bytes).
    const u64 desc_k_dq = sw128_desc(s_k + (wg * Cfg::kDQCols / 64) * kBlockN * 128 + (wg * Cfg::kDQCols % 64) * 2, kBlockN * 128);
    constexpr u64 kQStage = Cfg::kTileBytesQ >> 4;

    float acc_dk[kHeadDim / 2], acc_dv[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const int key_local = wg * 64 + (warp % 4) * 16 + g;  // this thread's key rows: key_local, key_local + 8

    for (int it = 0; it < n_iters; ++it) {
        const int stage = it & 1;
        const int h = walk.head(it);
        const int m0 = walk.m_block(it) * kBlockM;
        cp_async_wait<0>();
        fence_proxy_async_smem();
        // Query block it visible to every warpgroup; every warpgroup is done with iteration it-1 (its
        // stage and dS^T), so the other stage can take block it+1.
        __syncthreads();
        if (it + 1 < n_iters) load_query_side(it + 1, stage ^ 1);
        cp_async_commit();

        // ---- S^T = K_w Q^T, dP^T = V_w dO^T
        float S[kNB][4], dP[kNB][4];
        float(&s_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(S);
        float(&dp_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(dP);
        wgmma_fence();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(s_acc, desc_k_w, desc_q0 + stage * kQStage);
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(dp_acc, desc_v_w, desc_do0 + stage * kQStage);
        wgmma_commit();
        // The variants' per-head values and dropout keep bits (BwdModTile), drawn while the tensor cores
        // compute S^T and dP^T. Nothing for plain variants.
        const BwdModTileOf<Mask, kNB> mods(p, seq, h, m0, n0 + wg * 64 + (warp % 4) * 16, lane);
        wgmma_wait<0>();
        wgmma_fence_operands(s_acc);
        wgmma_fence_operands(dp_acc);

        // ---- P^T = exp2(S^T scale_log2 - lse_log2[i]), dS^T = P^T (dP^T - D[i]), packed as A fragments
        const float* s_lse = sm.lse_log2(stage);
        const float* s_d = sm.dsum(stage);
        const bool need_mask = bwd_sm90_needs_mask<Cfg>(p, seq, n0, m0, offset);
        u32 a_p[kQSteps][4], a_ds[kQSteps][4];
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
            const int col = 8 * nb + 2 * t;
            const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
            const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
            u32 pk[2], dk[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float pv[2], pd[2];
                bool kept[2];
                bwd_sm90_probs<Cfg>(p, mods, S[nb][2 * r], S[nb][2 * r + 1], l2, need_mask, nb, r, n0 + key_local + 8 * r,
                                    m0 + col, m0 + 2 * t, offset, seq.len_k(p), pv, pd, kept);
                pk[r] = pack2<kBF16>(pv[0], pv[1]);
                dk[r] = pack2<kBF16>(bwd_sm90_ds<Cfg>(mods, pd[0], dP[nb][2 * r], dd.x, kept[0]),
                                     bwd_sm90_ds<Cfg>(mods, pd[1], dP[nb][2 * r + 1], dd.y, kept[1]));
            }
            // A fragment of k-step nb / 2: rows g / g+8 x queries 2t.. of blocks 2kk (regs 0, 1), 2kk+1 (2, 3)
            a_p[nb / 2][2 * (nb % 2)] = pk[0];
            a_p[nb / 2][2 * (nb % 2) + 1] = pk[1];
            a_ds[nb / 2][2 * (nb % 2)] = dk[0];
            a_ds[nb / 2][2 * (nb % 2) + 1] = dk[1];
            // dS^T rows to smem: row key_local (+8), 16-byte chunk nb swizzled by the row, bytes 4t..4t+3.
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = key_local + 8 * r;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_ds + row * 128 + ((nb ^ (row % 8)) * 16) + 4 * t), "r"(dk[r]));
            }
        }

        // ---- dV += P^T dO, dK += dS^T Q (in flight while dS^T is shared and dQ runs)
        wgmma_fence();
        wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dv, a_p, desc_do0_n + stage * kQStage);
        wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dk, a_ds, desc_q0_n + stage * kQStage);
        wgmma_commit();

        fence_proxy_async_smem();
        __syncthreads();  // dS^T of every warpgroup's keys in smem

        // ---- dQ part: rows [m0, m0 + 64) x columns [wg kDQCols, ...) = dS K over the CTA's keys
        float acc_dq[Cfg::kDQCols / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
            wgmma_ss<Cfg::kDQCols, kBF16, 1, 1>(acc_dq, desc_ds + static_cast<u64>(kk * 128), desc_k_dq + static_cast<u64>(kk * 128), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dq);
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
        wgmma_fence_operands(a_p);
        wgmma_fence_operands(a_ds);

        bwd_sm90_add_dq<Cfg::kDQCols>(p, acc_dq, seq, h, m0, warp, lane);
    }

    cp_async_wait<0>();  // nothing left in flight (a CTA without query blocks still loaded K and V)
    bwd_sm90_store_dkdv<kBF16, kHeadDim>(p, acc_dk, acc_dv, seq, hk, n0 + key_local, 0, t);
}

// Head dim 256: warpgroup 0 computes S^T and P^T, warpgroup 1 dP^T and dS^T, then each accumulates
// dV, dK and computes dQ for its half of the head dim (see the header).
template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_split_kernel(const BwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHalf = Cfg::kDQCols;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kNB = kBlockM / 8, kQSteps = kBlockM / 16, kDSteps = Cfg::kHeadDim / 16, kKeySteps = kBlockN / 16;
    constexpr int kPStride = Cfg::kPStride;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4, g = lane / 4, t = lane % 4;
    const BwdKeyBlock<Cfg> blk = BwdKeyBlock<Cfg>::make(p);  // key block n_block of sequence seq (varlen.cuh)
    if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
        if (blk.skip) return;
    }
    const auto& seq = blk.seq;
    const int n_block = blk.n_block, hk = blockIdx.y;
    const int n0 = n_block * kBlockN;
    const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset

    const BwdQueryWalk walk = blk.walk(p, hk);
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;
    const int n_iters = walk.n_iters;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Sm90BwdSmem<Cfg> sm(smem_raw);
    const u32 s_k = sm.k, s_v = sm.v, s_q0 = sm.q0, s_do0 = sm.do0, s_ds = sm.ds;
    float* pf = sm.pf_ptr;  // P^T [key][kPStride] fp32: warpgroup 0 -> 1
    auto load_query_side = [&](int it, int stage) { sm.load_query(p, seq, walk.head(it), walk.m_block(it) * kBlockM, stage, tid); };
    sm.load_kv(p, seq, hk, n0, tid);
    if (n_iters > 0) load_query_side(0, 0);
    cp_async_commit();

    // Descriptors as in the pair kernel. Warpgroup 0 multiplies K by Q, warpgroup 1 V by dO; the
    // head-dim half of warpgroup wg is 64-column atoms 2 wg and 2 wg + 1.
    const u64 desc_a = sw128_desc(wg == 0 ? s_k : s_v, 16);
    const u64 desc_b0 = sw128_desc(wg == 0 ? s_q0 : s_do0, 16);
    const u64 desc_do_half = sw128_desc(s_do0 + 2 * wg * kBlockM * 128, kBlockM * 128);
    const u64 desc_q_half = sw128_desc(s_q0 + 2 * wg * kBlockM * 128, kBlockM * 128);
    const u64 desc_ds = sw128_desc(s_ds, kBlockN * 128);
    const u64 desc_k_half = sw128_desc(s_k + 2 * wg * kBlockN * 128, kBlockN * 128);
    constexpr u64 kQStage = Cfg::kTileBytesQ >> 4;

    float acc_dk[kHalf / 2], acc_dv[kHalf / 2];
#pragma unroll
    for (int i = 0; i < kHalf / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const int key_local = (warp % 4) * 16 + g;  // this thread's key rows (both warpgroups): key_local, + 8

    for (int it = 0; it < n_iters; ++it) {
        const int stage = it & 1;
        const int h = walk.head(it);
        const int m0 = walk.m_block(it) * kBlockM;
        cp_async_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();  // query block it visible; iteration it-1 finished everywhere
        if (it + 1 < n_iters) load_query_side(it + 1, stage ^ 1);
        cp_async_commit();

        // ---- warpgroup 0: X = S^T = K Q^T; warpgroup 1: X = dP^T = V dO^T
        float X[kNB][4];
        float(&x_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(X);
        wgmma_fence();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(x_acc, desc_a, desc_b0 + stage * kQStage);
        wgmma_commit();
        // (variants) warpgroup 0's per-head values and dropout keep bits, drawn while the tensor cores run
        const BwdModTileOf<Mask, kNB> mods(p, seq, h, m0, n0 + (warp % 4) * 16, lane);
        wgmma_wait<0>();
        wgmma_fence_operands(x_acc);

        const float* s_lse = sm.lse_log2(stage);
        const float* s_d = sm.dsum(stage);
        u32 a_p[kQSteps][4], a_ds[kQSteps][4];
        if constexpr ((Cfg::kMods & kModScores) == 0) {
            if (wg == 0) {  // P^T = exp2(S^T scale_log2 - lse_log2[i]) (causal mask), to registers and to warpgroup 1
                const bool need_mask = bwd_needs_mask<Cfg::kIsCausal>(n0, kBlockN, m0, offset, seq.len_k(p));
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = 8 * nb + 2 * t;
                    const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float2 pp = bwd_p_pair<Cfg::kIsCausal>(X[nb][2 * r], X[nb][2 * r + 1], l2, p.scale_log2, need_mask,
                                                                    n0 + key_local + 8 * r, m0 + col, offset, seq.len_k(p));
                        *reinterpret_cast<float2*>(pf + (key_local + 8 * r) * kPStride + col) = pp;
                        a_p[nb / 2][2 * (nb % 2) + r] = pack2<kBF16>(pp.x, pp.y);
                    }
                }
            }
            __syncthreads();  // P^T in smem for warpgroup 1
            if (wg == 1) {  // dS^T = P^T (dP^T - D[i]), to registers and to smem for both warpgroups
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = 8 * nb + 2 * t;
                    const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = key_local + 8 * r;
                        const float2 pp = *reinterpret_cast<const float2*>(pf + row * kPStride + col);
                        const u32 ds = pack2<kBF16>(pp.x * (X[nb][2 * r] - dd.x), pp.y * (X[nb][2 * r + 1] - dd.y));
                        a_p[nb / 2][2 * (nb % 2) + r] = pack2<kBF16>(pp.x, pp.y);
                        a_ds[nb / 2][2 * (nb % 2) + r] = ds;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_ds + row * 128 + ((nb ^ (row % 8)) * 16) + 4 * t), "r"(ds));
                    }
                }
            }
            fence_proxy_async_smem();
            __syncthreads();  // dS^T in smem
            if (wg == 0) {
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = key_local + 8 * r;
                        asm volatile("ld.shared.b32 %0, [%1];\n"
                                     : "=r"(a_ds[nb / 2][2 * (nb % 2) + r])
                                     : "r"(s_ds + row * 128 + ((nb ^ (row % 8)) * 16) + 4 * t));
                    }
            }
        } else {
            // The variants (BwdModTile): warpgroup 0 forms P^T and hands warpgroup 1, through pf, P^T (1 - tanh^2)
            // negated where dropout dropped the element, and, through the dS^T slots that warpgroup 1's
            // thread of the same rows and columns overwrites with dS^T afterwards, the P^T that dV takes
            // (dropped and scaled by 1 / the keep probability) as packed A fragments.
            auto slot = [&](int row, int nb) { return s_ds + row * 128 + ((nb ^ (row % 8)) * 16) + 4 * t; };
            if (wg == 0) {
                const bool need_mask = mods.mask.key_block_needs_mask(n0, kBlockN, m0, kBlockM);
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = 8 * nb + 2 * t;
                    const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        float pd[2], pdt[2];
                        bool kept[2];
                        mods.probs(X[nb][2 * r], X[nb][2 * r + 1], l2, p.scale_log2, need_mask, nb, r, n0 + key_local + 8 * r,
                                   m0 + col, mods.dist_base(n0 + key_local + 8 * r, m0 + 2 * t) + 8 * nb, pd, pdt, kept);
                        *reinterpret_cast<float2*>(pf + (key_local + 8 * r) * kPStride + col) =
                            make_float2(kept[0] ? pdt[0] : -pdt[0], kept[1] ? pdt[1] : -pdt[1]);
                        const u32 pk = pack2<kBF16>(pd[0], pd[1]);
                        a_p[nb / 2][2 * (nb % 2) + r] = pk;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot(key_local + 8 * r, nb)), "r"(pk));
                    }
                }
            }
            __syncthreads();  // pf and the P^T fragments in smem for warpgroup 1
            if (wg == 1) {  // dS^T = P^T (1 - tanh^2) (Z dP^T / q - D[i], q the keep probability)
                const float rp = p.mod.dropout_rp;
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
                    const int col = 8 * nb + 2 * t;
                    const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = key_local + 8 * r;
                        const float2 x = *reinterpret_cast<const float2*>(pf + row * kPStride + col);
                        float dp0 = X[nb][2 * r], dp1 = X[nb][2 * r + 1];
                        if constexpr (Mask::kDropout) {
                            dp0 = (__float_as_uint(x.x) >> 31) ? 0.f : dp0 * rp;
                            dp1 = (__float_as_uint(x.y) >> 31) ? 0.f : dp1 * rp;
                        }
                        const u32 ds = pack2<kBF16>(fabsf(x.x) * (dp0 - dd.x), fabsf(x.y) * (dp1 - dd.y));
                        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a_p[nb / 2][2 * (nb % 2) + r]) : "r"(slot(row, nb)));
                        a_ds[nb / 2][2 * (nb % 2) + r] = ds;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot(row, nb)), "r"(ds));
                    }
                }
            }
            fence_proxy_async_smem();
            __syncthreads();  // dS^T in smem
            if (wg == 0) {
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a_ds[nb / 2][2 * (nb % 2) + r]) : "r"(slot(key_local + 8 * r, nb)));
            }
        }

        // ---- dV[:, half] += P^T dO[:, half], dK[:, half] += dS^T Q[:, half]
        wgmma_fence();
        wgmma_rs_ksteps<kHalf, kBF16>(acc_dv, a_p, desc_do_half + stage * kQStage);
        wgmma_rs_ksteps<kHalf, kBF16>(acc_dk, a_ds, desc_q_half + stage * kQStage);
        wgmma_commit();
        wgmma_wait<0>();  // before dQ's accumulators go live: keeps the thread under 255 registers
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
        wgmma_fence_operands(a_p);
        wgmma_fence_operands(a_ds);

        // ---- dQ[:, half] = dS K[:, half] over the CTA's 64 keys
        float acc_dq[kHalf / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
            wgmma_ss<kHalf, kBF16, 1, 1>(acc_dq, desc_ds + static_cast<u64>(kk * 128), desc_k_half + static_cast<u64>(kk * 128), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dq);
        bwd_sm90_add_dq<kHalf>(p, acc_dq, seq, h, m0, warp, lane);
    }

    cp_async_wait<0>();
    bwd_sm90_store_dkdv<kBF16, kHalf>(p, acc_dk, acc_dv, seq, hk, n0 + key_local, wg * kHalf, t);  // this warpgroup's half
}

template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_kernel(const BwdParams& p) {
    if constexpr (Cfg::kSplit) {
        flash_bwd_sm90_split_kernel<Cfg>(p);
    } else {
        flash_bwd_sm90_pair_kernel<Cfg>(p);
    }
}

}  // namespace cuflash
