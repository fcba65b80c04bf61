// FlashAttention-2 backward main kernel on Hopper, warp specialized (sm_90a only): TMA loads by a
// producer warp, wgmma by two consumer warpgroups, each softmax step overlapped with a GEMM in flight.
//
// Computes exactly what flash_bwd_sm90_kernel (flash_bwd_sm90.cuh) computes, with the same math,
// masks, variants and outputs: dK and dV of the CTA's kBlockN keys and its dQ part, added to dq_accum
// with fp32 vector reductions in flash_bwd_convert_kernel's layout. Head dims 64 and 128 (the pair
// consumers) keep that file's pair-kernel tile, 128 keys per CTA; head dim 256 (the split consumers,
// last section of this header) 64 keys per CTA. Read that file's header first; the preprocess and
// convert kernels run around this one unchanged.
//
// Grid  (ceil(seqlen_k / kBlockN), nheads_kv, batch): CTA (n, hk, b) owns keys [kBlockN n, ...) and
//       walks every (query head of the group, query block of kBlockM = 64, 128 or 80 rows) that sees them
//       (BwdQueryWalk).
//       Packed varlen batches: (scheduler slots over the packed keys, nheads_kv, 1), varlen.cuh.
//       Persistent (kPersistent: plain batches, head dims 64 and 128, atomic dQ): min(items, SMs) CTAs; CTA c
//       starts with item c of the per-key-block grid's (n, hk, b) in its order (bwd_ws_item), and each later
//       item is the next of a counter in global memory (dynamic: whichever CTA frees up first takes it); the
//       ring's slots and phases run on across items, and K / V of the next item load once the consumers
//       released this item's (the "K/V empty" mbarrier), behind that item's first kStages query blocks.
// Roles (384 threads: warpgroup 0 produces, warpgroups 1 and 2 consume)
//   producer   warp 0, lane 0 issues every load: K and V once (cp.async.bulk.tensor, 128-byte swizzle),
//              then per query block Q and dO (tensor maps) and its lse_log2 and D rows (plain bulk
//              copies) into a ring of kStages slots. Each slot has a "full" mbarrier (its bytes
//              landed) and an "empty" one (all 256 consumer threads are done with it). The producer
//              warpgroup hands its registers to the consumers (setmaxnreg: 24 + 2 x 240 per thread).
//   consumers  (head dims 64, 128) warpgroup c (c = 0, 1) owns keys [64 c, 64 c + 64) of the CTA; warp
//              i of it key rows 64 c + 16 i + (g, g + 8) of every accumulator (g = lane / 4). dK, dV
//              accumulate in registers for the whole walk.
//
//   shared memory:  K, V [kBlockN x d] | Q[kStages], dO[kStages] [kBlockM x d] | dS^T[2] [kBlockN x kBlockM]
//                   (split: P^T[b], dS^T[b] [64 x 64] for b = 0, 1) | (lse_log2, D)[kStages] [kBlockM +
//                   kBlockM floats] | mbarriers (tiles in 64-column atoms of the 128-byte swizzle, 1024-byte
//                   aligned)
//
// Schedule of one query block (head dims 64, 128; per consumer warpgroup; groups complete in issue order):
//
//   wait slot full | issue S^T = K_c Q^T | issue dP^T = V_c dO^T | wait S^T (dP^T in flight)
//   P^T = exp2(S^T scale_log2 - lse_log2) -> A fragments  | issue dV_c += P^T dO
//   wait dP^T (dV in flight) | dS^T = P^T (dP^T - D) -> A fragments and dS^T[it % 2] in smem
//   issue dK_c += dS^T Q | named barrier of the 256 consumer threads (both halves of dS^T written)
//   issue dQ[:, c d/2 ..] = dS K over all 128 keys | wait all | slot empty | dq_accum += dQ part
//
// so the exponentials run while the tensor cores compute dP^T, and dS^T while they compute dV. dS^T
// is double buffered: a warpgroup writes buffer (it + 2) % 2 only after the barrier of block it + 1,
// which the other warpgroup reaches after its dQ of block it completed (it counts the CTA's query
// blocks over all its items).
//
// Head dim 64 with query blocks of 128 rows (kBlockM = 128, FlashAttention-3's tile there): S^T, dP^T are
// wgmma m64n128 (64 fp32 registers each), dS^T is two 64-query atoms [kBlockN x 64] per buffer, and each
// warpgroup's dQ part is its own 64 query rows x all 64 columns (A = its atom of dS^T, 32 registers) instead
// of a column half of all rows, so dq_accum holds 8 warps of 16 rows x 64 columns per block. The fp32 tiles
// leave no room for dV's operands while dS^T is formed: P^T is packed with dS^T and dV issued with dK after
// it (no softcap: dV's P^T is dS^T's, dropped and scaled with dropout):
//
//   wait slot full | issue S^T | issue dP^T | wait S^T | P^T (fp32, in S) | wait dP^T (at the head of a branch)
//   dS^T and P^T -> A fragments, dS^T -> smem | issue dV += P^T dO, dK += dS^T Q | barrier | dQ ... as above
//
// Head dim 128 with query blocks of 80 rows (kBlockM = 80, FlashAttention-3's non-causal tile there): S^T,
// dP^T are m64n80 (40 registers each), the same late order, dS^T two atoms per buffer (the second's rows hold
// queries 64-79). 80 rows are no wgmma M, so each warpgroup computes dQ^T = K^T dS^T for its head-dim half
// (A = its 64-column atom of K read M-major, B = dS^T read N-major over both atoms; m64n80, 40 registers):
// dq_accum holds 8 warps of 16 head-dim rows x 80 query columns per block, which the convert kernel's
// kTransposed build stages swapped. (Dropout there left ptxas short of registers: refused, 64 rows.)
//
// Preconditions (cuflash/plan/backward.py picks this kernel only then): sm_90a; head-dim bucket 64,
// 128 or 256; head_dim % 8 == 0 and rows / strides 16-byte aligned (TMA's rules). Deterministic mode
// orders the dQ additions of a query block by key block (turn counters), as flash_bwd_kernel does.
// Tensor maps (cuflash/tma.py): q, k, v, dout as (batch, rows, heads, head_dim) (packed varlen
// batches: one batch of the packed rows, SeqInfo::tma_*), boxes of 64 columns x kBlockM (q, dout) or kBlockN
// (k, v) rows; rows past the tensor arrive as zeros, as the cp.async kernel's zero-filled loads. A
// packed sequence's last key and query tiles bring the next rows of the packed tensor instead: the
// consumers zero them in shared memory (clear_tail) before any wgmma reads them.
//
// Head dim 256 (kSplit: 64 keys per CTA, flash_bwd_sm90_ws_split_consumer): dK + dV of 64 keys x 256
// columns would take 256 registers per thread, so the consumer warpgroups split the keys for the
// score GEMMs and the head dim for the others, and P^T / dS^T cross between them through shared memory:
//
//   warpgroup c: S_c = Q K_c^T, dP_c = dO V_c^T    wgmma m64n32 (queries x keys [32 c, 32 c + 32)),
//                                                  both from smem; P_c, dS_c from them in registers
//   P_c^T, dS_c^T -> P^T[it % 2], dS^T[it % 2]      [64 keys x 64 queries] each, stmatrix .trans
//   named barrier of the 256 consumer threads       (both warpgroups' keys written)
//   issue dQ[:, 128 c ..] = dS K[:, 128 c ..]       m64n128, A = dS read M-major from the dS^T rows
//   issue dV_c += P^T dO[:, 128 c ..], dK_c += dS^T Q[:, 128 c ..]   m64n128 over all 64 keys
//   wait dQ | dq_accum += dQ part (dV, dK in flight) | wait all | slot empty
//
// So dS needs no P handed between the warpgroups (flash_bwd_sm90_split_kernel's fp32 exchange and its
// two extra barriers); they meet once per block, at the barrier before dQ, dV and dK. dQ is added
// while dV and dK run, and dK, dV, dQ accumulators take 64 registers each. P^T and dS^T are double
// buffered like dS^T above.
#pragma once

#include "flash_bwd_sm90.cuh"  // Sm90BwdConfig, bwd_p_pair, BwdModTile, dq / dK dV epilogues
#include "tma.cuh"

namespace cuflash {

// The kernel's only argument (`const __grid_constant__`): four tensor maps, then the backward's
// parameter block at byte 512 (cuflash/backward.py writes the BwdParams record there).
struct BwdTmaParams {
    TmaDesc tma_q, tma_k, tma_v, tma_do;
    BwdParams p;
};
static_assert(sizeof(BwdTmaParams) == 512 + (sizeof(BwdParams) + 63) / 64 * 64, "p starts at byte 512, after the maps");

template <int kHeadDim_, bool kIsBF16_, bool kIsCausal_, int kMods_ = 0, int kStages_ = 2, bool kPersistent_ = false,
          int kBlockM_ = 64>
struct Sm90WsBwdConfig : Sm90BwdConfig<kHeadDim_, kHeadDim_ == 256 ? 64 : 128, kIsBF16_, kIsCausal_, kMods_, kBlockM_> {
    using Base = Sm90BwdConfig<kHeadDim_, kHeadDim_ == 256 ? 64 : 128, kIsBF16_, kIsCausal_, kMods_, kBlockM_>;
    static constexpr int kStages = kStages_;
    // One CTA per SM walks its items (key blocks, taken from a counter): the next item's K / V and
    // first query blocks load while this one's last blocks and dK / dV stores run (pair consumers, plain
    // batches, atomic dQ only: in deterministic mode a CTA's later item would wait for the turn of an item
    // that another CTA of the grid holds, which needs the whole grid resident; the planner refuses it).
    static constexpr bool kPersistent = kPersistent_;
    static_assert(!kPersistent || (!Base::kSplit && (kMods_ & kModVarlen) == 0), "persistent: pair consumers, plain batches");
    static constexpr int kNThreads = 384;
    static constexpr int kProducerRegs = 24;   // 24 x 128 + 240 x 256 = 64512 <= 65536
    static constexpr int kConsumerRegs = 240;
    static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 168 * 384, "setmaxnreg: within the launch's registers");
    static constexpr int kRowsBytes = 2 * Base::kBlockM * 4;  // lse_log2 and D of one query block
    // K/V full; full, empty per slot; K/V empty; persistent: full, empty per slot of the 2-slot item ring
    static constexpr int kBarriers = 2 + 2 * kStages + (kPersistent ? 4 : 0);
    static constexpr int kItemBytes = kPersistent ? 8 + 32 : 0;  // the item ring's two items (16-byte aligned)
    static constexpr int kDsTiles = Base::kSplit ? 2 : 1;      // dS^T (split: and P^T) per buffer
    static constexpr int kSmemBytes = 1024 + 2 * Base::kTileBytesKV + 2 * kStages * Base::kTileBytesQ +
                                      2 * kDsTiles * Base::kTileBytesDS + kStages * kRowsBytes + 8 * kBarriers +
                                      kItemBytes;
    static_assert(kStages >= 2 && kStages <= 4, "a ring of 2 to 4 query-block slots");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Plain (non-tensor) bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from
// global memory into shared memory; its bytes complete on mbarrier `bar`.
CUFLASH_DEVICE void bulk_load(u32 s_dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(s_dst),
                 "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

// The kernel's shared memory (see the header; 1024-byte aligned for the swizzle) and its mbarriers.
// Buffer b of the dS^T tiles starts at ds0 + b kTileBytesDS (pair consumers); the split consumers'
// buffer b at ds0 + 2 b kTileBytesDS holds P^T, then dS^T.
template <class Cfg>
struct BwdWsSmem {
    u32 k, v, q0, do0, ds0, rows0, bar;

    CUFLASH_DEVICE explicit BwdWsSmem(const unsigned char* smem_raw) {
        k = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the swizzle pattern starts on 1024 bytes
        v = k + Cfg::kTileBytesKV;
        q0 = v + Cfg::kTileBytesKV;
        do0 = q0 + Cfg::kStages * Cfg::kTileBytesQ;
        ds0 = do0 + Cfg::kStages * Cfg::kTileBytesQ;
        rows0 = ds0 + 2 * Cfg::kDsTiles * Cfg::kTileBytesDS;
        bar = rows0 + Cfg::kStages * Cfg::kRowsBytes;
    }
    CUFLASH_DEVICE u32 q(int st) const { return q0 + st * Cfg::kTileBytesQ; }
    CUFLASH_DEVICE u32 dout(int st) const { return do0 + st * Cfg::kTileBytesQ; }
    CUFLASH_DEVICE u32 full_kv() const { return bar; }
    CUFLASH_DEVICE u32 full(int st) const { return bar + 8u * (1 + st); }
    CUFLASH_DEVICE u32 empty(int st) const { return bar + 8u * (1 + Cfg::kStages + st); }
    CUFLASH_DEVICE u32 empty_kv() const { return bar + 8u * (1 + 2 * Cfg::kStages); }  // (persistent) K, V read
    // (persistent) the item ring: slot s holds a later item of the CTA (BwdWsItem, 16 bytes; bwd_ws_publish_next)
    CUFLASH_DEVICE u32 item_full(int s) const { return bar + 8u * (2 + 2 * Cfg::kStages + s); }
    CUFLASH_DEVICE u32 item_empty(int s) const { return bar + 8u * (4 + 2 * Cfg::kStages + s); }
    CUFLASH_DEVICE u32 item(int s) const { return ((bar + 8u * Cfg::kBarriers + 15u) & ~15u) + 16u * s; }
};

// The producer (one thread), for one item (key block): K and V, then Q, dO, lse_log2 and D of every query
// block of the walk into the ring's slots, each after its slot's consumers released it. g0: query blocks
// that the CTA's earlier items passed through the ring; kv_use: its earlier items with query blocks. After
// the first item (persistent grids) K and V may be overwritten only once the previous item's last query
// block is done with them, while the ring's slots free up earlier: the item's first kStages query blocks
// are loaded ahead of its K and V.
template <class Cfg, class Seq>
CUFLASH_DEVICE void bwd_ws_produce(const BwdTmaParams& P, const Seq& seq, const BwdQueryWalk& walk, int hk, int n0,
                                   const BwdWsSmem<Cfg>& sm, int g0, int kv_use) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages, kAtoms = Cfg::kHeadDim / 64;
    const BwdParams& p = P.p;
    auto load_kv = [&] {
        if (kv_use > 0) mbar_wait(sm.empty_kv(), (kv_use - 1) & 1);
        mbar_arrive_expect_tx(sm.full_kv(), 2 * Cfg::kTileBytesKV);
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) {
            tma_load_4d(sm.k + a * kBlockN * 128, &P.tma_k, sm.full_kv(), 64 * a, seq.tma_k_row(n0), hk, seq.tma_batch());
            tma_load_4d(sm.v + a * kBlockN * 128, &P.tma_v, sm.full_kv(), 64 * a, seq.tma_k_row(n0), hk, seq.tma_batch());
        }
    };
    const int kv_at = kv_use > 0 ? min(kStages, walk.n_iters) : 0;  // query blocks loaded ahead of K and V
    BwdQueryWalk::Cursor at = walk.first();
    for (int it = 0; it < walk.n_iters; ++it, walk.next(at)) {
        if (it == kv_at) load_kv();
        const int gi = g0 + it, st = gi % kStages;
        const int h = at.head, m0 = at.m_block * kBlockM, row = seq.tma_q_row(m0);
        mbar_wait(sm.empty(st), ((gi / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(sm.full(st), 2 * Cfg::kTileBytesQ + Cfg::kRowsBytes);
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) {
            tma_load_4d(sm.q(st) + a * kBlockM * 128, &P.tma_q, sm.full(st), 64 * a, row, h, seq.tma_batch());
            tma_load_4d(sm.dout(st) + a * kBlockM * 128, &P.tma_do, sm.full(st), 64 * a, row, h, seq.tma_batch());
        }
        // lse_log2 and D rows are padded to whole query blocks (4 kBlockM bytes each, a multiple of 16): no bounds.
        const i64 row0 = seq.scratch_row(p, h) + m0;
        const u32 s_rows = sm.rows0 + st * Cfg::kRowsBytes;
        bulk_load(s_rows, p.lse_log2 + row0, kBlockM * 4, sm.full(st));
        bulk_load(s_rows + kBlockM * 4, p.dsum + row0, kBlockM * 4, sm.full(st));
    }
    if (kv_at == walk.n_iters) load_kv();  // (every query block went ahead)
}

// Varlen: rows of a tile past its sequence's keys or queries arrived from the rows that follow in the
// packed tensor (the next sequence, rows no sequence owns: any bits, NaN included). Their P is 0, but
// 0 * NaN is not: zero rows [r0, rows) of both tiles (whole 128-byte lines of every atom, whatever the
// swizzle) before any wgmma reads them; both consumer warpgroups then meet at named barrier 2. Only
// a sequence's last key block and last query block stick out. Plain batches need nothing: rows past
// the tensor arrive as zeros.
template <class Cfg>
CUFLASH_DEVICE void bwd_ws_clear_tail(unsigned char* smem_raw, u32 s_tile0, u32 s_tile1, int rows, int r0, int tid) {
    if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
        constexpr int kAtoms = Cfg::kHeadDim / 64;
        if (r0 >= rows) return;  // uniform over the consumers
        const int lines = (rows - r0) * kAtoms;
        for (int i = tid - 128; i < 2 * lines * 8; i += 256) {
            const int line = (i / 8) % lines, a = line % kAtoms, r = r0 + line / kAtoms;
            unsigned char* tile = smem_raw + ((i < lines * 8 ? s_tile0 : s_tile1) - smem_u32(smem_raw));
            *reinterpret_cast<uint4*>(tile + a * rows * 128 + r * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_smem();  // generic stores -> the async proxy (wgmma reads, later TMA writes)
        named_sync(2, 256);
    }
}

// Consumers, before the first query block: wait for the CTA's K and V (zeroing rows past the keys).
template <class Cfg>
CUFLASH_DEVICE void bwd_ws_wait_kv(const BwdParams& p, const BwdKeyBlock<Cfg>& blk, const BwdWsSmem<Cfg>& sm,
                                   unsigned char* smem_raw, int n0, int tid, int kv_use = 0) {
    mbar_wait(sm.full_kv(), kv_use & 1);
    bwd_ws_clear_tail<Cfg>(smem_raw, sm.k, sm.v, Cfg::kBlockN, blk.seq.len_k(p) - n0, tid);
}

// Consumers, the CTA's query block gi (ring slot st, first row m0): wait for its Q, dO and rows (zeroing
// rows past the queries).
template <class Cfg>
CUFLASH_DEVICE void bwd_ws_wait_block(const BwdParams& p, const BwdKeyBlock<Cfg>& blk, const BwdWsSmem<Cfg>& sm,
                                      unsigned char* smem_raw, int gi, int st, int m0, int tid) {
    mbar_wait(sm.full(st), (gi / Cfg::kStages) & 1);
    bwd_ws_clear_tail<Cfg>(smem_raw, sm.q(st), sm.dout(st), Cfg::kBlockM, blk.seq.len_q(p) - m0, tid);
}

// dq_accum += this warp's dQ part of block it (query head h, rows from m0). Deterministic mode: the key
// blocks that visit this query block add their dQ parts in key-block order (the turn counter, as
// flash_bwd_kernel): one consumer thread waits for this CTA's turn, named barrier 3 holds the other
// 255 until then, and after every warp's additions (fenced) the turn passes on. CTAs wait only on
// lower key blocks, which launch earlier: no deadlock.
template <class Cfg>
CUFLASH_DEVICE void bwd_ws_add_dq(const BwdParams& p, const float (&acc_dq)[Cfg::kDQCols / 2], const BwdKeyBlock<Cfg>& blk,
                                  int h, int m0, int cwarp, int lane, int tid) {
    int* turn = nullptr;  // (deterministic mode only: the turn counter of query block m0 / kBlockM of head h)
    if (p.deterministic) {
        turn = p.dq_turn + blk.seq.turn_row(p, h) + m0 / Cfg::kBlockM;
        if (tid == 128) {
            while (ld_acquire_gpu(turn) != blk.dq_turn(p, m0)) {
            }
        }
        named_sync(3, 256);
    }
    bwd_sm90_add_dq<Cfg::kDQCols>(p, acc_dq, blk.seq, h, m0, cwarp, lane);
    if (p.deterministic) {
        __threadfence();  // this thread's additions are visible device-wide ...
        named_sync(3, 256);  // ... for every consumer thread, before the turn passes on
        if (tid == 128) red_release_gpu_add(turn, 1);
    }
}

// Head dims 64 and 128: consumer warpgroup c owns keys [64 c, 64 c + 64) of the CTA (the header's
// first schedule), for one item (kv head hk, keys from n0; g0 and kv_use as the producer's).
template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_ws_pair_consumer(const BwdParams& p, const BwdKeyBlock<Cfg>& blk, const BwdQueryWalk& walk,
                                                    const BwdWsSmem<Cfg>& sm, unsigned char* smem_raw, int tid, int warp, int lane,
                                                    int n0, int offset, int hk, int g0, int kv_use) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim, kStages = Cfg::kStages;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kNB = kBlockM / 8, kQSteps = kBlockM / 16, kDSteps = kHeadDim / 16, kKeySteps = kBlockN / 16;
    const auto& seq = blk.seq;
    const int cwg = warp / 4 - 1, cwarp = warp - 4;
    const int g = lane / 4, t = lane % 4;
    const int n_iters = walk.n_iters;
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;
    const float* rows_ptr = reinterpret_cast<const float*>(smem_raw + (sm.rows0 - smem_u32(smem_raw)));

    // Descriptors as in flash_bwd_sm90_pair_kernel (K-major A / B step 32 bytes per k-step inside an
    // atom; N-major B and M-major A: 64-column atoms rows * 128 bytes apart, 2048 bytes per k-step).
    const u64 desc_k_w = sw128_desc(sm.k + cwg * 64 * 128, 16);
    const u64 desc_v_w = sw128_desc(sm.v + cwg * 64 * 128, 16);
    const u64 desc_q0 = sw128_desc(sm.q0, 16);
    const u64 desc_do0 = sw128_desc(sm.do0, 16);
    const u64 desc_q0_n = sw128_desc(sm.q0, kBlockM * 128);
    const u64 desc_do0_n = sw128_desc(sm.do0, kBlockM * 128);
    // dQ: 64 query rows (kBlockM = 64: all of them, kBlockM = 128: this warpgroup's, dS^T's 64-query atom cwg)
    // x kDQCols columns of K (kBlockM = 64: from column cwg kDQCols, whole atoms at hd128, half an atom at
    // hd64; kBlockM = 128: all of them). kBlockM = 80: dQ^T, K's atom cwg (read M-major) x dS^T's 80 queries.
    constexpr bool kRowsPerWg = kBlockM == 128, kDQT = Cfg::kDQTransposed;
    // 128 (80) query rows: S^T and dP^T take 64 (40) registers each, so the P^T fragments are packed and dV
    // issued only after dS^T (FlashAttention-3's order): issued before it, as at 64 rows, dV's operands stay
    // live beside both fp32 tiles and ptxas serializes every wgmma for want of registers. (Softcap: dV takes
    // P^T, dS^T P^T (1 - tanh^2), two fp32 tiles; the planner keeps those calls at 64 rows.)
    constexpr bool kLatePack = kBlockM > 64;
    static_assert(!kLatePack || !Mask::kSoftcap, "wide query blocks: dV's P^T is derived from dS^T's");
    const u64 desc_ds0 = kRowsPerWg ? sw128_desc(sm.ds0 + cwg * kBlockN * 128, kBlockN * 128) : sw128_desc(sm.ds0, kBlockN * 128);
    // (80 rows: dQ^T's A, K's head-dim half = its 64-column atom cwg; kDQCols is dQ^T's N there, the 80 rows)
    const u64 desc_k_dq = kRowsPerWg ? sw128_desc(sm.k, kBlockN * 128)
                          : kDQT     ? sw128_desc(sm.k + cwg * kBlockN * 128, kBlockN * 128)
                                     : sw128_desc(sm.k + (cwg * Cfg::kDQCols / 64) * kBlockN * 128 + (cwg * Cfg::kDQCols % 64) * 2,
                                                  kBlockN * 128);
    constexpr u64 kQStage = Cfg::kTileBytesQ >> 4, kDsBuf = Cfg::kTileBytesDS >> 4;

    float acc_dk[kHeadDim / 2], acc_dv[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const int key_local = cwg * 64 + (cwarp % 4) * 16 + g;  // this thread's key rows: key_local, key_local + 8
    const int st_row = key_local - g + 8 * ((lane / 8) % 2) + lane % 8;  // dS^T row and chunk this lane addresses
    const int st_chunk = (lane / 16) ^ (lane % 8);

    if (n_iters > 0) bwd_ws_wait_kv<Cfg>(p, blk, sm, smem_raw, n0, tid, kv_use);
    BwdQueryWalk::Cursor at = walk.first();
    for (int it = 0; it < n_iters; ++it, walk.next(at)) {
        const int gi = g0 + it, st = gi % kStages, buf = gi & 1;
        const int h = at.head;
        const int m0 = at.m_block * kBlockM;
        const u32 s_ds = sm.ds0 + buf * Cfg::kTileBytesDS;
        bwd_ws_wait_block<Cfg>(p, blk, sm, smem_raw, gi, st, m0, tid);

        // ---- issue S^T = K_c Q^T and dP^T = V_c dO^T as two groups
        float S[kNB][4], dP[kNB][4];
        float(&s_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(S);
        float(&dp_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(dP);
        wgmma_fence();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(s_acc, desc_k_w, desc_q0 + st * kQStage);
        wgmma_commit();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(dp_acc, desc_v_w, desc_do0 + st * kQStage);
        wgmma_commit();
        const BwdModTileOf<Mask, kNB> mods(p, seq, h, m0, n0 + key_local - g, lane);  // (variants) while they run
        wgmma_wait<1>();  // S^T landed; dP^T may still run
        wgmma_fence_operands(s_acc);

        // ---- P^T (fp32 kept in S for dS; variants: P^T (1 - tanh^2)) and its A fragments
        const float* s_lse = rows_ptr + st * 2 * kBlockM;
        const float* s_d = s_lse + kBlockM;
        const bool need_mask = bwd_sm90_needs_mask<Cfg>(p, seq, n0, m0, offset);
        u32 a_p[kQSteps][4], a_ds[kQSteps][4];
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
            const int col = 8 * nb + 2 * t;
            const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float pv[2], pd[2];
                bool kept[2];
                bwd_sm90_probs<Cfg>(p, mods, S[nb][2 * r], S[nb][2 * r + 1], l2, need_mask, nb, r, n0 + key_local + 8 * r,
                                    m0 + col, m0 + 2 * t, offset, seq.len_k(p), pv, pd, kept);
                S[nb][2 * r] = pd[0];  // (kept for dS^T)
                S[nb][2 * r + 1] = pd[1];
                if constexpr (!kLatePack) a_p[nb / 2][2 * (nb % 2) + r] = pack2<kBF16>(pv[0], pv[1]);
            }
        }

        if constexpr (!kLatePack) {
            // ---- dV += P^T dO (in flight while dS^T is formed)
            wgmma_fence();
            wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dv, a_p, desc_do0_n + st * kQStage);
            wgmma_commit();
            wgmma_wait<1>();  // dP^T landed; dV may still run
        } else if (p.head_dim > 0) {
            // dP^T landed. The wait at the head of a branch, as the forward's P V wait (flash_fwd_sm90_ws.cuh):
            // in the softmax's block ptxas scheduled it above three quarters of P^T's exponentials, which then
            // ran after dP^T instead of under it. The condition is uniform and always true; the arms differ
            // (a fence) so that ptxas keeps two blocks.
            wgmma_wait<0>();
        } else {
            wgmma_wait<0>();
            __threadfence_block();
        }
        wgmma_fence_operands(dp_acc);

        // ---- dS^T = P^T (dP^T - D[i]), to A fragments and smem (variants: P^T (1 - tanh^2) (Z dP^T / q - D[i]),
        //      q the keep probability); late pack: P^T's A fragments too (from the fp32 P^T, which is what dV takes
        //      without softcap: dropout drops and scales it here)
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
            const int col = 8 * nb + 2 * t;
            const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 ds = pack2<kBF16>(bwd_sm90_ds<Cfg>(mods, S[nb][2 * r], dP[nb][2 * r], dd.x, mods.kept(nb, r, 0)),
                                            bwd_sm90_ds<Cfg>(mods, S[nb][2 * r + 1], dP[nb][2 * r + 1], dd.y, mods.kept(nb, r, 1)));
                a_ds[nb / 2][2 * (nb % 2) + r] = ds;
                if constexpr (kLatePack) {
                    float pv0 = S[nb][2 * r], pv1 = S[nb][2 * r + 1];
                    if constexpr (Mask::kDropout) {
                        pv0 = mods.dropped_p(pv0, mods.kept(nb, r, 0));
                        pv1 = mods.dropped_p(pv1, mods.kept(nb, r, 1));
                    }
                    a_p[nb / 2][2 * (nb % 2) + r] = pack2<kBF16>(pv0, pv1);
                }
            }
        }
        if constexpr (kLatePack) {
            // ---- dV += P^T dO (in flight with dK below)
            wgmma_fence();
            wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dv, a_p, desc_do0_n + st * kQStage);
            wgmma_commit();
        }
        // dS^T to smem, one stmatrix per 16 queries: matrix m of call kk holds 8-query block 2 kk + m / 2,
        // key rows 8 (m % 2) ..+ 8 (a_ds[kk][m]); lane 8 m + i addresses key row warp_key0 + 8 (m % 2) + i,
        // chunk 2 (kk % 4) + m / 2 of 64-query atom kk / 4, swizzled by the row (i).
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) {
            const u32 atom = kBlockM > 64 ? s_ds + (kk / 4) * kBlockN * 128 : s_ds;
            stmatrix_x4(atom + st_row * 128 + ((st_chunk ^ (2 * (kk % 4))) << 4), a_ds[kk][0], a_ds[kk][1], a_ds[kk][2],
                        a_ds[kk][3]);
        }

        // ---- dK += dS^T Q, then dQ part = dS K over the CTA's keys once both halves of dS^T are in smem
        wgmma_fence();
        wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dk, a_ds, desc_q0_n + st * kQStage);
        wgmma_commit();
        fence_proxy_async_smem();
        named_sync(1, 256);
        float acc_dq[Cfg::kDQCols / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
            if constexpr (kDQT) {  // dQ^T [head-dim half x 80] = K^T dS^T: A = K's atom read M-major, B = dS^T N-major
                wgmma_ss<Cfg::kDQCols, kBF16, 1, 1>(acc_dq, desc_k_dq + static_cast<u64>(kk * 128),
                                                    desc_ds0 + buf * kDsBuf + static_cast<u64>(kk * 128), kk > 0);
            } else {
                wgmma_ss<Cfg::kDQCols, kBF16, 1, 1>(acc_dq, desc_ds0 + buf * kDsBuf + static_cast<u64>(kk * 128),
                                                    desc_k_dq + static_cast<u64>(kk * 128), kk > 0);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dq);
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
        wgmma_fence_operands(a_p);
        wgmma_fence_operands(a_ds);
        // Q, dO and the lse_log2 / D rows of this slot are no longer read: every consumer thread arrives
        // for its own reads (and its writes of clear_tail's zero rows), so the producer's next refill is
        // ordered after each of them. (One arrive per warp after __syncwarp orders them too, but
        // compute-sanitizer racecheck follows an arrive only for the arriving thread's own accesses.)
        mbar_arrive(sm.empty(st));
        if (Cfg::kPersistent && it == n_iters - 1) mbar_arrive(sm.empty_kv());  // (no wgmma reads K or V any more)
        bwd_ws_add_dq<Cfg>(p, acc_dq, blk, h, m0, cwarp, lane, tid);
    }

    bwd_sm90_store_dkdv<kBF16, kHeadDim>(p, acc_dk, acc_dv, seq, hk, n0 + key_local, 0, t);
}

// The variants on a warp's 16 queries x 32 keys of S (the split consumer's orientation, the forward's):
// BwdModBase (flash_bwd_sm90.cuh) and the dropout keep bits of the 16x32 block (one Philox call,
// DropoutStream::keep_bits: bit 4 nb + 2 a + e is element S[nb][2 a + e]).
template <class Mask>
struct BwdModRows : BwdModBase<Mask> {
    u32 keep;

    template <class Seq>
    CUFLASH_DEVICE BwdModRows(const BwdParams& p, const Seq& seq, int h, int row16, int key32, int lane)
        : BwdModBase<Mask>(p, seq, h), keep(0) {
        if constexpr (Mask::kDropout) {
            keep = DropoutStream(p.mod.seed, p.mod.offset, seq.b, p.nheads, h, p.mod.keep_threshold).keep_bits(row16, key32, lane);
        }
    }
    CUFLASH_DEVICE bool kept(int nb, int a, int e) const {
        return Mask::kDropout ? ((keep >> (4 * nb + 2 * a + e)) & 1u) != 0 : true;
    }
    // Query i, keys j and j + 1 (elements S[nb][2 a], S[nb][2 a + 1] of raw scores s0, s1; dist the ALiBi
    // distance of (i, j) as a float): pv what dV takes, pd what dS takes, kept as in BwdModTile::probs.
    CUFLASH_DEVICE void probs(float s0, float s1, float lse_log2, float scale_log2, bool need_mask, int nb, int a, int j, int i,
                              float dist, float (&pv)[2], float (&pd)[2], bool (&kept_e)[2]) const {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float dt;
            const float pr = this->prob(e ? s1 : s0, i, j + e, dist - e, lse_log2, scale_log2, need_mask, &dt);
            kept_e[e] = kept(nb, a, e);
            pv[e] = this->dropped_p(pr, kept_e[e]);
            pd[e] = pr * dt;
        }
    }
};
template <class Mask>
using BwdModRowsOf = Choose<(Mask::kBits & kModScores) != 0, BwdModRows<Mask>, BwdNoMods>;  // (no state)

// Head dim 256: the split schedule of the header. Warpgroup c forms P and dS for keys [32 c, 32 c + 32)
// of the CTA and all 64 queries, then dV, dK and dQ for head-dim columns [128 c, 128 c + 128).
template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_ws_split_consumer(const BwdParams& p, const BwdKeyBlock<Cfg>& blk, const BwdQueryWalk& walk,
                                                     const BwdWsSmem<Cfg>& sm, unsigned char* smem_raw, int hk) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHalf = Cfg::kDQCols, kStages = Cfg::kStages;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kDSteps = Cfg::kHeadDim / 16, kQSteps = kBlockM / 16, kKeySteps = kBlockN / 16;
    constexpr int kKeys = kBlockN / 2;  // keys of S_c per warpgroup
    constexpr int kNB = kKeys / 8;      // their 8-key blocks
    static_assert(kKeys == 32 && kBlockM == 64, "S_c is one m64n32 wgmma group; dropout draws 16x32 blocks");
    const auto& seq = blk.seq;
    const int tid = threadIdx.x, lane = tid % 32, cwarp = tid / 32 - 4, cwg = cwarp / 4, wq = cwarp % 4;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blk.n_block * kBlockN;
    const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset
    const int n_iters = walk.n_iters;
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;
    const float* rows_ptr = reinterpret_cast<const float*>(smem_raw + (sm.rows0 - smem_u32(smem_raw)));

    // Descriptors. S_c, dP_c: A = Q / dO and B = K / V rows [32 c, 32 c + 32), all K-major. dV, dK: A =
    // P^T / dS^T K-major (a 64-query row is one atom), B = dO / Q columns [128 c, ...) N-major. dQ: A = dS
    // read M-major from the dS^T rows, B = K columns [128 c, ...) N-major (16 rows of k per 2048 bytes).
    const u64 desc_q0 = sw128_desc(sm.q0, 16);
    const u64 desc_do0 = sw128_desc(sm.do0, 16);
    const u64 desc_k_c = sw128_desc(sm.k + cwg * kKeys * 128, 16);
    const u64 desc_v_c = sw128_desc(sm.v + cwg * kKeys * 128, 16);
    const u64 desc_q_half = sw128_desc(sm.q0 + 2 * cwg * kBlockM * 128, kBlockM * 128);
    const u64 desc_do_half = sw128_desc(sm.do0 + 2 * cwg * kBlockM * 128, kBlockM * 128);
    const u64 desc_k_half = sw128_desc(sm.k + 2 * cwg * kBlockN * 128, kBlockN * 128);
    const u64 desc_pt0 = sw128_desc(sm.ds0, 16);
    const u64 desc_dst0 = sw128_desc(sm.ds0 + Cfg::kTileBytesDS, 16);
    const u64 desc_ds0 = sw128_desc(sm.ds0 + Cfg::kTileBytesDS, kBlockN * 128);
    constexpr u64 kQStage = Cfg::kTileBytesQ >> 4, kBuf = (2 * Cfg::kTileBytesDS) >> 4;

    float acc_dk[kHalf / 2], acc_dv[kHalf / 2];
#pragma unroll
    for (int i = 0; i < kHalf / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    // This thread's elements of S_c: queries q_row, q_row + 8 of the block x keys j_first + 8 nb (+ 1).
    const int q_row = 16 * wq + g;
    const int j_first = n0 + kKeys * cwg + 2 * t;
    // stmatrix .trans of P_c / dS_c into the [key][query] tiles: lane 8 m + i addresses row i of
    // matrix m (key kKeys c + 8 (2 kk + m / 2) + i, queries 16 wq + 8 (m % 2) .. + 8: one 16-byte chunk,
    // swizzled by the row); matrix m of call kk holds the fragments of 8-key block 2 kk + m / 2, row half m % 2.
    const int st_row = kKeys * cwg + 8 * (lane / 16) + lane % 8;
    const u32 st_off = st_row * 128 + (((2 * wq + (lane / 8) % 2) ^ (lane % 8)) << 4);

    if (n_iters > 0) bwd_ws_wait_kv<Cfg>(p, blk, sm, smem_raw, n0, tid);
    BwdQueryWalk::Cursor at = walk.first();
    for (int it = 0; it < n_iters; ++it, walk.next(at)) {
        const int st = it % kStages, buf = it & 1;
        const int h = at.head;
        const int m0 = at.m_block * kBlockM;
        const u32 s_pt = sm.ds0 + buf * 2 * Cfg::kTileBytesDS, s_dst = s_pt + Cfg::kTileBytesDS;
        bwd_ws_wait_block<Cfg>(p, blk, sm, smem_raw, it, st, m0, tid);

        // ---- issue S_c = Q K_c^T and dP_c = dO V_c^T as two groups
        float S[kNB][4], dP[kNB][4];
        float(&s_acc)[kKeys / 2] = reinterpret_cast<float(&)[kKeys / 2]>(S);
        float(&dp_acc)[kKeys / 2] = reinterpret_cast<float(&)[kKeys / 2]>(dP);
        wgmma_fence();
        wgmma_ss_kmajor<kKeys, kBF16, kDSteps, kBlockM, kBlockN>(s_acc, desc_q0 + st * kQStage, desc_k_c);
        wgmma_commit();
        wgmma_ss_kmajor<kKeys, kBF16, kDSteps, kBlockM, kBlockN>(dp_acc, desc_do0 + st * kQStage, desc_v_c);
        wgmma_commit();
        const BwdModRowsOf<Mask> mods(p, seq, h, m0 + 16 * wq, n0 + kKeys * cwg, lane);  // (variants) while they run
        wgmma_wait<1>();  // S_c landed; dP_c may still run
        wgmma_fence_operands(s_acc);

        // ---- P_c (fp32 kept in S for dS; variants: P (1 - tanh^2)); P^T (what dV takes) to smem
        const float* s_lse = rows_ptr + st * 2 * kBlockM;
        const float* s_d = s_lse + kBlockM;
        const bool need_mask = bwd_sm90_needs_mask<Cfg>(p, seq, n0, m0, offset);
        u32 pk[kNB][2];
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const int i = m0 + q_row + 8 * a;
            const float lse = s_lse[q_row + 8 * a];
            float dist = 0.f;  // the ALiBi distance of (i, j_first) (variants only)
            if constexpr ((Cfg::kMods & kModScores) != 0) dist = static_cast<float>(i + offset - j_first);
#pragma unroll
            for (int nb = 0; nb < kNB; ++nb) {
                const int j = j_first + 8 * nb;
                float pv[2], pd[2];
                if constexpr ((Cfg::kMods & kModScores) == 0) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float x = fast_exp2(fmaf(S[nb][2 * a + e], p.scale_log2, -lse));
                        if (need_mask && (Cfg::kIsCausal ? j + e > i + offset : j + e >= seq.len_k(p))) x = 0.f;
                        pv[e] = pd[e] = x;
                    }
                } else {
                    bool kept[2];
                    mods.probs(S[nb][2 * a], S[nb][2 * a + 1], lse, p.scale_log2, need_mask, nb, a, j, i, dist - 8 * nb, pv, pd, kept);
                }
                S[nb][2 * a] = pd[0];  // (kept for dS)
                S[nb][2 * a + 1] = pd[1];
                pk[nb][a] = pack2<kBF16>(pv[0], pv[1]);
            }
        }
#pragma unroll
        for (int kk = 0; kk < kNB / 2; ++kk) {
            stmatrix_x4_trans(s_pt + st_off + kk * 16 * 128, pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]);
        }

        // ---- dS_c = P (dP - D[i]) (variants: P (1 - tanh^2) (Z dP / q - D[i]), q the keep probability) to smem
        wgmma_wait<0>();
        wgmma_fence_operands(dp_acc);
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const float d = s_d[q_row + 8 * a];
#pragma unroll
            for (int nb = 0; nb < kNB; ++nb) {
                pk[nb][a] = pack2<kBF16>(bwd_sm90_ds<Cfg>(mods, S[nb][2 * a], dP[nb][2 * a], d, mods.kept(nb, a, 0)),
                                         bwd_sm90_ds<Cfg>(mods, S[nb][2 * a + 1], dP[nb][2 * a + 1], d, mods.kept(nb, a, 1)));
            }
        }
#pragma unroll
        for (int kk = 0; kk < kNB / 2; ++kk) {
            stmatrix_x4_trans(s_dst + st_off + kk * 16 * 128, pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]);
        }
        fence_proxy_async_smem();
        named_sync(1, 256);  // both warpgroups' keys of P^T and dS^T in smem

        // ---- issue dQ part = dS K[:, half], then dV[:, half] += P^T dO[:, half], dK[:, half] += dS^T Q[:, half]
        float acc_dq[kHalf / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
            wgmma_ss<kHalf, kBF16, 1, 1>(acc_dq, desc_ds0 + buf * kBuf + static_cast<u64>(kk * 128),
                                         desc_k_half + static_cast<u64>(kk * 128), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < kQSteps; ++ks) {
            wgmma_ss<kHalf, kBF16, 0, 1>(acc_dv, desc_pt0 + buf * kBuf + kmajor_kstep<kBlockN>(ks),
                                         desc_do_half + st * kQStage + static_cast<u64>(ks * 128), true);
        }
#pragma unroll
        for (int ks = 0; ks < kQSteps; ++ks) {
            wgmma_ss<kHalf, kBF16, 0, 1>(acc_dk, desc_dst0 + buf * kBuf + kmajor_kstep<kBlockN>(ks),
                                         desc_q_half + st * kQStage + static_cast<u64>(ks * 128), true);
        }
        wgmma_commit();
        wgmma_wait<1>();  // dQ landed: add it while dV and dK run
        wgmma_fence_operands(acc_dq);
        bwd_ws_add_dq<Cfg>(p, acc_dq, blk, h, m0, cwarp, lane, tid);
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
        mbar_arrive(sm.empty(st));  // (every consumer thread: see the pair consumer)
    }

    bwd_sm90_store_dkdv<kBF16, kHalf>(p, acc_dk, acc_dv, seq, hk, n0 + 16 * wq + g, cwg * kHalf, t);  // this warpgroup's half
}

// An item of a persistent grid (plain batches): key block n_block of kv head hk of sequence b; n_block < 0
// ends the CTA's walk.
struct BwdWsItem {
    int n_block, hk, b;
};
// Item number i: key block i % n_blocks of kv head (i / n_blocks) % nheads_kv of sequence
// i / (n_blocks nheads_kv), the per-key-block launch's blockIdx order; numbers past the last item end the walk.
template <class Cfg>
CUFLASH_DEVICE BwdWsItem bwd_ws_item(const BwdParams& p, int i) {
    const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
    if (i >= n_blocks * p.nheads_kv * p.batch) return BwdWsItem{-1, 0, 0};
    return BwdWsItem{i % n_blocks, (i / n_blocks) % p.nheads_kv, i / (n_blocks * p.nheads_kv)};
}

// The item ring (persistent grids): the CTA's item j + 1 (j >= 0; item 0 is blockIdx.x) comes from the call's
// item counter (zeroed by the preprocess). The first consumer thread takes the number when the CTA starts its
// item j (its warp waits for the atomic there, at best under the wait for K and V) and publishes the decoded
// item in slot j % 2, use j / 2; the producer (after item j's loads) and every consumer thread (after item j)
// read it and free the slot.
template <class Cfg>
CUFLASH_DEVICE void bwd_ws_publish_next(const BwdParams& p, const BwdWsSmem<Cfg>& sm, int j) {
    const int s = j & 1;
    const BwdWsItem it = bwd_ws_item<Cfg>(p, (int)gridDim.x + atomicAdd(p.item_counter, 1));
    mbar_wait(sm.item_empty(s), ((j >> 1) & 1) ^ 1);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %3};\n" ::"r"(sm.item(s)), "r"(it.n_block), "r"(it.hk), "r"(it.b)
                 : "memory");
    mbar_arrive(sm.item_full(s));
}
template <class Cfg>
CUFLASH_DEVICE BwdWsItem bwd_ws_take(const BwdWsSmem<Cfg>& sm, int j) {
    const int s = j & 1;
    BwdWsItem it;
    int pad;
    mbar_wait(sm.item_full(s), (j >> 1) & 1);
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(it.n_block), "=r"(it.hk), "=r"(it.b), "=r"(pad)
                 : "r"(sm.item(s))
                 : "memory");
    mbar_arrive(sm.item_empty(s));
    return it;
}

template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_ws_kernel(const BwdTmaParams& P) {
    const BwdParams& p = P.p;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdWsSmem<Cfg> sm(smem_raw);
    if (tid == 0) {
        mbar_init(sm.full_kv(), 1);
#pragma unroll
        for (int s = 0; s < Cfg::kStages; ++s) {
            mbar_init(sm.full(s), 1);
            mbar_init(sm.empty(s), 256);  // every consumer thread (see the arrive)
        }
        mbar_init(sm.empty_kv(), 256);
        if constexpr (Cfg::kPersistent) {
            for (int s = 0; s < 2; ++s) {
                mbar_init(sm.item_full(s), 1);
                mbar_init(sm.item_empty(s), 257);  // every consumer thread and the producer's
            }
        }
        mbar_fence_init();
    }

    if constexpr (!Cfg::kPersistent) {
        // One item: the CTA's key block (blockIdx; packed batches: the scheduler's slot).
        const BwdKeyBlock<Cfg> blk = BwdKeyBlock<Cfg>::make(p);  // key block n_block of sequence seq (varlen.cuh)
        __syncthreads();  // (the barriers' initialisation)
        if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
            if (blk.skip) return;  // a spare slot of the scheduler (uniform over the CTA)
        }
        const int hk = blockIdx.y, n0 = blk.n_block * Cfg::kBlockN;
        const BwdQueryWalk walk = blk.walk(p, hk);
        if (wg == 0) {
            // ---------------- producer ----------------
            regs_release<Cfg::kProducerRegs>();
            if (warp != 0 || lane != 0 || walk.n_iters == 0) return;
            tma_prefetch(&P.tma_q);
            tma_prefetch(&P.tma_do);
            bwd_ws_produce<Cfg>(P, blk.seq, walk, hk, n0, sm, 0, 0);
            return;
        }
        // ---------------- consumers ----------------
        regs_claim<Cfg::kConsumerRegs>();
        if constexpr (Cfg::kSplit) {
            flash_bwd_sm90_ws_split_consumer<Cfg>(p, blk, walk, sm, smem_raw, hk);
        } else {
            const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset
            flash_bwd_sm90_ws_pair_consumer<Cfg>(p, blk, walk, sm, smem_raw, tid, warp, lane, n0, offset, hk, 0, 0);
        }
    } else {
        // Persistent: G = gridDim.x <= n_items CTAs; CTA c starts with item c, and each later item is the
        // next number of the call's counter, plus G: the items go out in the per-key-block grid's order to
        // whichever CTA frees up first (a causal call's long and short key blocks balance as the hardware's
        // block scheduler balances the per-key-block grid). Numbers past the last item end the CTA.
        BwdWsItem item = bwd_ws_item<Cfg>(p, blockIdx.x);
        __syncthreads();  // (the barriers' initialisation)
        if (wg == 0) {
            // ---------------- producer ----------------
            regs_release<Cfg::kProducerRegs>();
            if (warp != 0 || lane != 0) return;
            tma_prefetch(&P.tma_q);
            tma_prefetch(&P.tma_do);
            int g0 = 0, kv_use = 0;
            for (int j = 0; item.n_block >= 0; ++j) {
                const BwdKeyBlock<Cfg> blk{SeqInfo<false>(item.b), item.n_block, false};
                const BwdQueryWalk walk = blk.walk(p, item.hk);
                if (walk.n_iters > 0) {  // (else no query sees these keys: the consumers write dK = dV = 0)
                    bwd_ws_produce<Cfg>(P, blk.seq, walk, item.hk, item.n_block * Cfg::kBlockN, sm, g0, kv_use);
                    g0 += walk.n_iters;
                    ++kv_use;
                }
                item = bwd_ws_take<Cfg>(sm, j);
            }
            return;
        }
        // ---------------- consumers ----------------
        regs_claim<Cfg::kConsumerRegs>();
        int g0 = 0, kv_use = 0;
        for (int j = 0; item.n_block >= 0; ++j) {
            if (tid == 128) bwd_ws_publish_next<Cfg>(p, sm, j);
            __syncwarp();
            const BwdKeyBlock<Cfg> blk{SeqInfo<false>(item.b), item.n_block, false};
            const BwdQueryWalk walk = blk.walk(p, item.hk);
            const int offset = blk.diag(p);  // causal: query i sees keys j <= i + offset
            flash_bwd_sm90_ws_pair_consumer<Cfg>(p, blk, walk, sm, smem_raw, tid, warp, lane, item.n_block * Cfg::kBlockN,
                                                 offset, item.hk, g0, kv_use);
            g0 += walk.n_iters;
            kv_use += walk.n_iters > 0;
            item = bwd_ws_take<Cfg>(sm, j);
        }
    }
}

}  // namespace cuflash
