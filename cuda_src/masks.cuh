// Masks and score modifiers: which scores survive, what they become before the softmax, and which
// K/V blocks a query tile visits at all. Written once, used by every kernel family (the mma.sync and
// wgmma forward and backward, decode).
//
// The variants are compile-time policies (kMods bits; cuflash/plan/common.py MOD_*), their
// values runtime (ModParams, cuda_src/params.h). With kMods == 0 every function below is what the
// kernels computed before the variants existed (causal or not), so those variants compile unchanged.
// For a query whose diagonal is d = i + seqlen_k - seqlen_q (the key it is aligned to, bottom-right
// like causal; window and ALiBi kernels add ModParams::diag_shift, see diag_shift_of), raw score s = q.k
// (the softmax applies its unit scale later, as exp2(x scale_log2)):
//   window   key j is visible iff d - window_left <= j <= d + window_right (causal: window_right = 0)
//   softcap  s -> tanh(s * softcap_scale); the softmax's unit scale is then softcap, not softmax_scale,
//            so the score it sees is softcap * tanh(softmax_scale * s / softcap)
//   alibi    s -> s - slope * alibi_scale * |d - j| (the bias -slope |d - j| in the softmax's units)
//   dropout  after the softmax, dropout.cuh
// Order: softcap, then ALiBi, then the mask (-inf), as flash-attn.
#pragma once

#include "dropout.cuh"
#include "params.h"
#include "primitives.cuh"
#include "varlen.cuh"

namespace cuflash {

constexpr int kModWindow = 1;   // sliding window (local attention)
constexpr int kModSoftcap = 2;  // logit softcapping
constexpr int kModAlibi = 4;    // ALiBi linear bias
constexpr int kModDropout = 8;  // attention dropout (forward and backward only)
constexpr int kModVarlen = 16;  // packed variable-length batch (forward and backward; varlen.cuh): where rows are, not what
                                // a score becomes
constexpr int kModScores = kModWindow | kModSoftcap | kModAlibi | kModDropout;  // the bits that change the math

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): two SFU operations, absolute error ~1e-7 over the whole range
// (tanh.approx.f32 alone is off by up to ~2^-11, which a softcap of 50 turns into 0.02 in the score).
CUFLASH_DEVICE float accurate_tanh(float x) {
    const float e = fast_exp2(x * (2.f * kLog2e));
    return fmaf(-2.f, __fdividef(1.f, e + 1.f), 1.f);
}

// The shift of the diagonal: query i is aligned to key i + seqlen_k - seqlen_q + diag_shift. The host
// moves the diagonal of a call whose queries and keys are pieces of a longer sequence (a ring's chunk
// pairs: query i at absolute position q0 + i, key j at k0 + j, diag_shift = q0 - k0 - (seqlen_k -
// seqlen_q)). Only window and ALiBi kernels read ModParams::diag_shift (the host routes a shifted causal
// mask through the window kernels); for every other kernel it is the constant 0, so their code is
// what it was before the shift existed.
template <int kMods>
struct ModBits {};  // a kernel's kMods as an argument (template argument deduction)

template <int kMods>
CUFLASH_DEVICE int diag_shift_of(const ModParams& m) {
    if constexpr ((kMods & (kModWindow | kModAlibi)) != 0) {
        return m.diag_shift;
    } else {
        return 0;
    }
}

// Score modifiers of one kernel variant: softcap and ALiBi on a score, the window's key range.
template <int kMods>
struct ScoreMods {
    static constexpr int kBits = kMods;
    static constexpr bool kWindow = (kMods & kModWindow) != 0;
    static constexpr bool kSoftcap = (kMods & kModSoftcap) != 0;
    static constexpr bool kAlibi = (kMods & kModAlibi) != 0;
    static constexpr bool kDropout = (kMods & kModDropout) != 0;
    static constexpr bool kModifiesScores = kSoftcap || kAlibi;  // anything to do on every element

    int window_left, window_right;
    float softcap_scale;

    CUFLASH_DEVICE explicit ScoreMods(const ModParams& m)
        : window_left(m.window_left), window_right(m.window_right), softcap_scale(m.softcap_scale) {}

    // ALiBi slope of (batch b, query head h) in raw-score units.
    CUFLASH_DEVICE static float alibi_slope(const ModParams& m, int b, int h) {
        if constexpr (kAlibi) {
            return m.alibi_slopes[b * m.alibi_batch_stride + h] * m.alibi_scale;
        } else {
            return 0.f;
        }
    }

    // The score of a key at distance dist = d - j from the query's diagonal d (softcap, then ALiBi with
    // the head's slope in raw units); *dtanh (softcap, if given) gets 1 - tanh^2, the factor the backward
    // multiplies dS by. The callers form dist as a per-row float plus a compile-time column offset: an
    // int-to-float conversion per element runs at a quarter of the FMA rate on sm_90.
    CUFLASH_DEVICE float modify(float s, float dist, float slope, float* dtanh = nullptr) const {
        if constexpr (kSoftcap) {
            s = accurate_tanh(s * softcap_scale);
            if (dtanh != nullptr) *dtanh = fmaf(-s, s, 1.f);
        }
        if constexpr (kAlibi) s = fmaf(-slope, fabsf(dist), s);
        return s;
    }

    // First visible key of the query of diagonal d (window only; 0 otherwise).
    CUFLASH_DEVICE int first_key(int d) const { return kWindow ? max(0, d - window_left) : 0; }
};

// The forward's and backward's view: seqlen_q x seqlen_k scores, causal or not, and the variants.
template <bool kIsCausal, int kMods = 0>
struct AttnMask : ScoreMods<kMods> {
    using Mods = ScoreMods<kMods>;
    using Mods::kWindow;
    int seqlen_q, seqlen_k;
    int shift;  // diag_shift_of: query row i is aligned to key i + seqlen_k - seqlen_q + shift

    CUFLASH_DEVICE AttnMask(const ModParams& m, int seqlen_q_, int seqlen_k_)
        : Mods(m), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), shift(diag_shift_of<kMods>(m)) {}

    // Causal is aligned bottom-right: query row i sees keys j <= i + seqlen_k - seqlen_q (+ shift); a
    // window also keys j >= that - window_left (the host folds causal into window_right = 0). The window's
    // bounds are the row plus one bracketed sum each: ptxas keeps those two in registers; written as a
    // chain of the four terms they cost the TMA forward's window kernels 56-116 bytes of spills.
    CUFLASH_DEVICE int last_key_plus_one(int row) const {
        if constexpr (kWindow) {
            return min(seqlen_k, row + (seqlen_k - seqlen_q + shift + this->window_right + 1));
        } else if constexpr (kIsCausal) {
            return min(seqlen_k, row + seqlen_k - seqlen_q + shift + 1);
        } else {
            return seqlen_k;
        }
    }
    CUFLASH_DEVICE int first_key_of_row(int row) const {
        return kWindow ? max(0, row + (seqlen_k - seqlen_q + shift - this->window_left)) : 0;
    }
    // The diagonal offset: query row i is aligned to key i + diag().
    CUFLASH_DEVICE int diag() const { return seqlen_k - seqlen_q + shift; }

    // K/V blocks [n_block_begin, n_block_end) hold every key any row of [m0, m0 + block_m) can see.
    CUFLASH_DEVICE int n_block_end(int m0, int block_m, int block_n) const {
        const int last_row = min(seqlen_q, m0 + block_m) - 1;
        return ceil_div_nonneg(last_key_plus_one(last_row), block_n);
    }
    CUFLASH_DEVICE int n_block_begin(int m0, int block_n) const {
        return kWindow ? min(first_key_of_row(m0), seqlen_k) / block_n : 0;
    }
    // True when some element of tile (rows m0.., keys n0..) is masked for some row: the causal or window
    // diagonal, the window's left edge, or the ragged end of seqlen_k.
    CUFLASH_DEVICE bool block_needs_mask(int m0, int block_m, int n0, int block_n) const {
        if constexpr (kWindow) {
            return n0 + block_n > last_key_plus_one(m0) || n0 < first_key_of_row(min(seqlen_q, m0 + block_m) - 1);
        } else {
            return n0 + block_n > last_key_plus_one(m0);
        }
    }
    // The backward's form (keys n0.. of a key block against query rows m0..): the same condition.
    // Keys past seqlen_k count even for causal grids: their K rows are zero, so S = 0 and exp2(-lse_log2)
    // can overflow to inf, and dQ's dS K would turn inf * 0 into NaN.
    CUFLASH_DEVICE bool key_block_needs_mask(int n0, int block_n, int m0, int block_m) const {
        if constexpr (kWindow) {
            return block_needs_mask(m0, block_m, n0, block_n);
        } else {
            return kIsCausal ? n0 + block_n - 1 > m0 + (seqlen_k - seqlen_q + shift) : n0 + block_n > seqlen_k;
        }
    }
    // Whether query i must not see key j (on the blocks that need a mask; see key_block_needs_mask).
    CUFLASH_DEVICE bool hidden(int i, int j) const {
        if constexpr (kWindow) {
            return j >= last_key_plus_one(i) || j < first_key_of_row(i);
        } else {
            return kIsCausal ? j > i + (seqlen_k - seqlen_q + shift) : j >= seqlen_k;
        }
    }

    // Backward: P = exp2(score * scale_log2 - lse_log2) of query i and key j (dist = i + diag() - j, as
    // a float) from the raw score s, 0 where the key is hidden (on blocks that need the
    // mask); *dtanh gets what dS is multiplied by for the softcap's tanh (1 - tanh^2; 1 without softcap).
    CUFLASH_DEVICE float prob(float s, int i, int j, float dist, float lse_log2, float scale_log2, bool need_mask,
                              float slope, float* dtanh) const {
        *dtanh = 1.f;
        const float u = this->modify(s, dist, slope, dtanh);
        const float p = fast_exp2(fmaf(u, scale_log2, -lse_log2));
        return need_mask && hidden(i, j) ? 0.f : p;
    }

    // Forward score tile: softcap and ALiBi on every element (nothing without them). S[s][nb][2r + e]
    // is row (row0 + 16 s + 8 r), column (col0 + 8 nb + e).
    template <int kMSlabs, int kNB>
    CUFLASH_DEVICE void modify_tile(float (&S)[kMSlabs][kNB][4], int row0, int col0, float slope) const {
        if constexpr (Mods::kModifiesScores) {
#pragma unroll
            for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float dist0 = static_cast<float>(row0 + 16 * s + 8 * r + seqlen_k - seqlen_q + shift - col0);
#pragma unroll
                    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            S[s][nb][2 * r + e] = this->modify(S[s][nb][2 * r + e], dist0 - (8 * nb + e), slope);
                }
        }
    }

    // Forward score tile: -inf where the key is hidden (layout as modify_tile).
    template <int kMSlabs, int kNB>
    CUFLASH_DEVICE void apply(float (&S)[kMSlabs][kNB][4], int row0, int col0) const {
#pragma unroll
        for (int s = 0; s < kMSlabs; ++s) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int limit = last_key_plus_one(row0 + 16 * s + 8 * r);
                const int first = first_key_of_row(row0 + 16 * s + 8 * r);
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = col0 + 8 * nb + e;
                        if (col >= limit || (kWindow && col < first)) S[s][nb][2 * r + e] = -kInf;
                    }
                }
            }
        }
    }
};

// Forward dropout, in two steps so the random numbers can be drawn while the tensor cores compute
// S = Q K^T (they do not depend on it): dropout_bits draws the keep bits of this thread's 16x16 blocks
// of a tile (the warp's rows from row16, a multiple of 16; columns from col32, a multiple of 32; one
// Philox call per 16x32 block; bits[s][kk] for slab s and column block kk, in its low 8 bits),
// dropout_apply zeroes the dropped probabilities (after the softmax's row sums: the normalization counts
// every element). S[s][nb][2r + e] as in AttnMask::apply; the 1 / keep probability of the kept ones is
// applied to O at the end.
template <int kMSlabs, int kNB>
CUFLASH_DEVICE void dropout_bits(u32 (&bits)[kMSlabs][kNB / 2], const DropoutStream& rng, int row16, int col32, int lane) {
    static_assert(kNB % 4 == 0, "dropout draws 16x32 blocks: the key tile must be a multiple of 32 columns");
#pragma unroll
    for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
        for (int kk = 0; kk < kNB / 4; ++kk) {
            const u32 both = rng.keep_bits(row16 + 16 * s, col32 + 32 * kk, lane);
            bits[s][2 * kk] = both & 0xffu;
            bits[s][2 * kk + 1] = both >> 8;
        }
}
template <int kMSlabs, int kNB>
CUFLASH_DEVICE void dropout_apply(float (&S)[kMSlabs][kNB][4], const u32 (&bits)[kMSlabs][kNB / 2]) {
#pragma unroll
    for (int s = 0; s < kMSlabs; ++s)
#pragma unroll
        for (int kk = 0; kk < kNB / 2; ++kk)
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (!((bits[s][kk] >> (4 * c + i)) & 1u)) S[s][2 * kk + c][i] = 0.f;
}

}  // namespace cuflash
