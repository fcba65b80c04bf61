// Attention dropout: which probabilities survive, regenerated from a counter-based generator so the
// forward and the backward draw the same mask without storing it (flash-attn's semantics: P is
// normalized first, then each element is kept with probability q ~ 1 - p and scaled by 1 / q; q is
// keep_threshold / 256, 1 - p rounded to a 256th).
//
// Random numbers: Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"),
// key (seed_lo, seed_hi ^ offset_hi), one call per (batch b, head h, 16-row x 32-column block of the
// score matrix (i16, j32), lane), counter (j32, 32 i16 + lane, b * nheads + h, offset_lo). Its four
// 32-bit words hold sixteen 8-bit numbers, one per element (flash-attn draws 8-bit numbers too: one
// call covers twice the elements of 16-bit ones, and the Philox rounds are most of dropout's cost);
// element (i, j) is kept iff its number < keep_threshold = round((1 - p) 256), clamped to [1, 255].
// In the 16x32 block, element (i, j) (i mod 16, j mod 32) belongs to
//     lane = 4 (i mod 8) + (j mod 8) / 2,   word = 2 ((j / 8) mod 2) + j mod 2,   byte = 2 (j / 16) + i / 8
// which is exactly what lane (g = lane / 4, t = lane % 4) of an m16n8k16 accumulator holds for rows
// g, g + 8 and columns 2t, 2t + 1 of the block's four 8-column blocks (forward S tiles: one call per
// thread and 16x32 block).
// The backward holds the transposed tile (S^T: keys as rows): each thread draws its own lane's call
// and four warp shuffles hand every thread the numbers of its elements (keep_bits_transposed).
// cuflash/reference.py rebuilds the same numbers in float64 NumPy (dropout_keep_mask).
#pragma once

#include "primitives.cuh"

namespace cuflash {

struct U32x4 {
    u32 x, y, z, w;
};

// Philox4x32-10 (Random123's constants and round): 10 rounds, the key bumped between rounds.
CUFLASH_DEVICE U32x4 philox4x32_10(U32x4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const u32 lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The dropout stream of one (batch, head): the Philox key and the counter words that do not move.
struct DropoutStream {
    u32 k0, k1, bh, offset_lo, threshold;

    DropoutStream() = default;
    CUFLASH_DEVICE DropoutStream(unsigned long long seed, unsigned long long offset, int b, int nheads, int h,
                                 u32 keep_threshold)
        : k0(static_cast<u32>(seed)),
          k1(static_cast<u32>(seed >> 32) ^ static_cast<u32>(offset >> 32)),
          bh(static_cast<u32>(b) * static_cast<u32>(nheads) + static_cast<u32>(h)),
          offset_lo(static_cast<u32>(offset)),
          threshold(keep_threshold) {}

    // The call of `lane` for the 16x32 block whose first row is i0 (a multiple of 16) and first
    // column j0 (a multiple of 32).
    CUFLASH_DEVICE U32x4 draw(int i0, int j0, int lane) const {
        return philox4x32_10(U32x4{static_cast<u32>(j0) >> 5, (static_cast<u32>(i0) >> 4) * 32u + lane, bh, offset_lo},
                             k0, k1);
    }

    // Keep bits of this thread's 16 elements of a forward (row-major) 16x32 block: bit 8h + 4c + 2a + e
    // is row g + 8a, column 16h + 8c + 2t + e (bits 0-7: the first 16x16 block, 8-15: the second, each
    // in S[.][2 kk + c][2 a + e] order).
    CUFLASH_DEVICE u32 keep_bits(int i0, int j0, int lane) const {
        const U32x4 r = draw(i0, j0, lane);
        const u32 w[4] = {r.x, r.y, r.z, r.w};
        u32 bits = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (((w[2 * c + e] >> (8 * (2 * h + a))) & 0xffu) < threshold) bits |= 1u << (8 * h + 4 * c + 2 * a + e);
        return bits;
    }

    // Keep bits of this thread's 16 elements of a transposed 32x16 block (keys k32.., a multiple of
    // 32, as rows; queries q0.. as columns; the whole warp calls it for the same block): bit
    // 8h + 4c + 2a + e is S^T key 16h + g + 8a, query 8c + 2t + e (bits 0-7: the first 16 keys, 8-15:
    // the next 16). Element (query i, key j) is word 2 ((j / 8) mod 2) + j mod 2, byte 2 (j / 16) + i / 8
    // of lane 4 (i mod 8) + (j mod 8) / 2: for this thread, lane (2t + e) 4 + g / 2, word 2a + g % 2,
    // byte 2h + c. Round (a, r) moves, from every lane L, the word 2a + (r ^ bit 2 of L) to the one
    // thread that needs it (the one with g % 2 = r ^ e, e = bit 2 of L); all four of its bytes are that
    // thread's.
    CUFLASH_DEVICE u32 keep_bits_transposed(int q0, int k32, int lane) const { return transposed_bits<2>(q0, k32, lane); }

    // The keep bits of one 16x16 block of S^T (keys key16.., a multiple of 16; queries q0..): its half
    // of the 32x16 block (bits 0-7 as in keep_bits_transposed; the other half is not compared).
    CUFLASH_DEVICE u32 keep_bits_transposed16(int q0, int key16, int lane) const {
        return transposed_bits<1>(q0, key16, lane);
    }

  private:
    // keep_bits_transposed (kHalves = 2, key a multiple of 32) or keep_bits_transposed16 (kHalves = 1,
    // key a multiple of 16: only the half holding it, bytes 2h + c with h = bit 4 of key, compared).
    template <int kHalves>
    CUFLASH_DEVICE u32 transposed_bits(int q0, int key, int lane) const {
        u32 got[2][2];
        transposed_words(q0, kHalves == 2 ? key : key & ~31, lane, got);
        const int e0 = (lane >> 2) & 1, shift = kHalves == 2 ? 0 : key & 16;
        u32 bits = 0;
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const u32 word = got[a][rr] >> shift;
#pragma unroll
                for (int h = 0; h < kHalves; ++h)
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (((word >> (8 * (2 * h + c))) & 0xffu) < threshold) bits |= 1u << (8 * h + 4 * c + 2 * a + (rr ^ e0));
            }
        return bits;
    }

    // The shuffles of keep_bits_transposed: got[a][rr] is word 2a + g % 2 of lane (2t + e) 4 + g / 2,
    // e = rr ^ (g % 2), whose bytes 2h + c are this thread's S^T key 16h + g + 8a, query 8c + 2t + e.
    CUFLASH_DEVICE void transposed_words(int q0, int k32, int lane, u32 (&got)[2][2]) const {
        const U32x4 r = draw(q0, k32, lane);
        const int g = lane / 4, t = lane % 4;
        const u32 own_e = (lane >> 2) & 1u;
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const u32 lo = a == 0 ? r.x : r.z, hi = a == 0 ? r.y : r.w;
                const u32 offer = (static_cast<u32>(rr) ^ own_e) ? hi : lo;
                const int e = rr ^ (g & 1);
                got[a][rr] = __shfl_sync(0xffffffffu, offer, (2 * t + e) * 4 + g / 2);
            }
    }
};

}  // namespace cuflash
