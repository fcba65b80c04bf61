// Masks: which scores survive, and which K/V blocks a query tile visits at all.
//
// The kernels ask a mask for the block range a query tile visits, whether a block needs the
// per-element step, and then apply it to the score tile. Causal is aligned to the bottom-right
// corner (query row i sees keys j <= i + seqlen_k - seqlen_q); the other attention variants
// (sliding window, ALiBi, softcap) are meant to join here as compile-time policies.
#pragma once

#include "primitives.cuh"

namespace cuflash {

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

}  // namespace cuflash
