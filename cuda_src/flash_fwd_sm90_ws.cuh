// FlashAttention forward on Hopper, warp specialized (sm_90a only): TMA loads by a producer warp,
// wgmma by consumer warpgroups, the softmax of one tile overlapped with the tensor cores' work.
//
// Computes exactly what flash_fwd.cuh computes (same math, masks, variants, lse and output; read its
// header first): O = softmax(scale * Q K^T + mask) V and lse per query row for each (query tile, head,
// batch) or varlen scheduler slot, K/V tiles visited from the last to the first. One CTA per tile, or
// (kPersistent) one CTA per SM walking the tiles grid-stride, in groups of (head, batch) pairs whose
// K/V fit in L2 (FwdParams.sched_group; see locate below; kPaired: causal query tiles in heavy/light pairs).
//
// Roles (kConsumers = kBlockM / 64 consumer warpgroups, plus one producer warpgroup: warpgroup 0)
//   producer   one thread issues every load: per tile Q, then for each K/V tile K and V into a ring
//              of kStages shared-memory slots (cp.async.bulk.tensor, 128-byte swizzle, exactly the
//              layout wgmma reads; see sm90_tile.cuh), each slot guarded by a "full" mbarrier (the TMA
//              bytes landed) and an "empty" one (every consumer warp is done with it); the ring runs on
//              across tiles. The producer warpgroup gives its registers to the consumers (setmaxnreg);
//              its warp 0 walks the tiles (lane 0 issues), the other warps exit.
//   consumers  warpgroup c owns query rows [64c, 64c + 64) of the tile; warp i of it rows 64c + 16i ..
//              +15 of the softmax (the wgmma accumulator layout, wgmma.cuh).
//
//   shared memory:  Q[kBlockM x d] | K[kStages][kBlockN x d] | V[kStages][kBlockN x d] | (persistent) O staging
//                   [kBlockM x d] | (look-ahead) second Q slot | mbarriers
//                   (every tile in 64-column atoms of the 128-byte swizzle, 1024-byte aligned)
//
// Schedule of a consumer warpgroup (kOverlap, FlashAttention-3's intra-warpgroup pipelining):
//
//   tile t:   [issue S_t = Q K_t^T] [issue O += P_{t-1} V_{t-1}]  wait S_t | softmax(S_t) -> P_t  | wait PV
//             '------ tensor cores busy with S_t, then with P_{t-1} V_{t-1} ------'   rescale O, pack P_t
//
// so the exponentials of tile t run while the tensor cores multiply the previous tile's P by V; O is
// rescaled by tile t's correction once that product has landed. P_{t-1} lives in its own registers
// (the A operand of an in-flight wgmma) while S_t is computed. kPingPong (2 consumer warpgroups)
// additionally orders the two warpgroups' GEMM issues through two named barriers, so one warpgroup's
// softmax runs while the other's GEMMs own the tensor cores. Without kOverlap each tile is
// S, softmax, P V in sequence (the ablation of the pipelining).
//
// Clusters (kCluster 2, plain batches): the two CTAs of a thread-block cluster take query tiles 2i and
// 2i + 1 of one (head, batch) pair and walk the hull of their key blocks; each producer loads half the
// rows of every K/V tile and multicasts them into both CTAs' slots (each "full" barrier expects the
// whole tile; each "empty" barrier counts both CTAs' consumer warps, the other's arriving through mapa),
// so the L2 serves each tile once per pair. A CTA only waits for and hands back the blocks outside its
// own tile's range (pass_kv). docs/design/forward.md has the diagram.
//
// Varlen: the first key tile of a sequence (the last block, visited first) may stick out past its keys;
// its V rows there are zeroed in shared memory before the first P V (clear_v_tail), as the cp.async
// kernel's zero-filled loads do. Plain batches get zeros from TMA (rows outside the tensor map).
//
// Epilogue: each consumer warp stages its normalized O rows in its own rows of the Q tile (Q's swizzled
// layout, WarpTile::store) and writes lse; its lane 0 stores the rows with TMA (kSchedTmaStore: tma_o, a
// box of 16 rows per 64-column atom; else, and for packed batches, every lane writes 16-byte chunks of
// the valid rows), then Q goes back ("Q empty") to the producer. Persistent: Q goes back right after
// the last S = Q K^T, O is staged in a tile of its own, and the next tile's Q and K/V loads overlap the
// last P V and the epilogue, whose TMA stores run on while the next tile computes. Look-ahead
// (kSchedLookAhead, persistent plain batches): the next tile's first S is issued right after this tile's last
// P V and runs under the epilogue; Q has two slots, the u-th Q tile of the walk in slot u % 2.
//
// Preconditions (cuflash/plan/forward.py picks this kernel only then): sm_90a; head_dim % 8 == 0, rows
// and strides 16-byte aligned (TMA's rules); head-dim bucket a multiple of 64; the host encodes the
// tensor maps (cuflash/tma.py): q, k, v, o seen as (batch, rows, heads, head_dim) with boxes of
// 64 columns x kBlockM (q), kBlockN / kCluster (k, v) or kOBoxRows (o) rows. Rows or columns past the tensor
// arrive as zeros (loads) or are not written (stores).
#pragma once

#include "flash_fwd.cuh"  // FwdTileRef (masks and variants), WarpTile (softmax, epilogue)
#include "sm90_tile.cuh"
#include "tma.cuh"
#include "trace.cuh"

namespace cuflash {

// The kernel's only argument (declared `const __grid_constant__` by the entry point: TMA reads the
// maps from parameter space): the four tensor maps, then the forward's parameter block.
// tma_o's box is one warp's rows (kOBoxRows) x 64 columns: each consumer warp stores its own rows.
struct FwdTmaParams {
    TmaDesc tma_q, tma_k, tma_v, tma_o;
    FwdParams p;
};
constexpr int kOBoxRows = 16;  // cuflash/tma.py O_BOX_ROWS
static_assert(sizeof(TmaDesc) == 128 && alignof(TmaDesc) == 64, "a CUtensorMap is 128 bytes, 64-byte aligned");
static_assert(sizeof(FwdTmaParams) == 512 + (sizeof(FwdParams) + 63) / 64 * 64,
              "p starts at byte 512, right after the maps: cuflash/forward.py writes the FwdParams record there");

// Schedule bits of the warp-specialized forward (kSched): the ablations of the pipelining.
constexpr int kSchedOverlap = 1;   // softmax of tile t overlaps P_{t-1} V_{t-1} inside a warpgroup
constexpr int kSchedPingPong = 2;  // two consumer warpgroups take turns issuing their GEMMs
constexpr int kSchedPersistent = 4;  // one CTA per SM walks the tiles; the next tile's loads overlap this one's epilogue
constexpr int kSchedTmaStore = 8;    // O leaves by TMA stores (else 16-byte stores from every lane; packed batches always)
constexpr int kSchedCluster = 16;    // clusters of 2 CTAs share each K/V tile: each loads half and multicasts it (plain batches)
constexpr int kSchedLookAhead = 32;  // (persistent, plain batches) the next item's first S issued before this item's epilogue
constexpr int kSchedPaired = 64;     // (persistent, causal, plain batches, no clusters) query tiles taken in heavy/light pairs

// Timeline events of a diagnostic build (trace.cuh, tools/trace_fwd.py; other builds mark nothing). The
// producer marks when it starts an item and when its waits for a free Q / K / V slot end (the load is
// issued right after); a consumer warpgroup when it starts an item, when its waits for Q, a K tile, a V
// tile end, when S = Q K^T has landed, when the softmax of S is done, when P V has landed, and when its
// epilogue is done. (The overlapped schedule only.)
enum FwdTraceEvent : int {
    kTraceProducerItem = 1, kTraceProducerQ = 2, kTraceProducerK = 3, kTraceProducerV = 4,
    kTraceItem = 10, kTraceQ = 11, kTraceK = 12, kTraceS = 13, kTraceSoftmax = 14, kTraceV = 15, kTracePV = 16,
    kTraceEpilogue = 17,
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kIsBF16_, bool kIsCausal_, int kMods_ = 0,
          int kSched_ = kSchedOverlap | kSchedPingPong>
struct Sm90WsFwdConfig : Sm90WarpTileShape<kHeadDim_, kBlockN_> {  // (WarpTile's fields)
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kStages = kStages_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr int kMods = kMods_;  // attention variants (masks.cuh kMod* bits)

    static constexpr int kConsumers = kBlockM / 64;  // consumer warpgroups
    static constexpr int kNThreads = 128 * (kConsumers + 1);
    static constexpr bool kOverlap = (kSched_ & kSchedOverlap) != 0;
    static constexpr bool kPingPong = (kSched_ & kSchedPingPong) != 0 && kConsumers == 2;
    static constexpr bool kPersistent = (kSched_ & kSchedPersistent) != 0;
    static constexpr bool kTmaStore = (kSched_ & kSchedTmaStore) != 0 && (kMods_ & kModVarlen) == 0;
    // CTAs per cluster: 2 = two query tiles of one (head, batch) take their K/V tiles together, each CTA
    // loading half of every tile's rows into both CTAs' shared memory (TMA multicast).
    static constexpr int kCluster = (kSched_ & kSchedCluster) != 0 && (kMods_ & kModVarlen) == 0 ? 2 : 1;
    // Look-ahead (persistent, overlapped, one CTA, plain batches): a consumer warpgroup issues the next item's
    // first S = Q K^T right after this item's last P V, so that product runs under the epilogue instead of
    // after it; Q takes two slots, so the next item's Q loads while this item still reads its own.
    static constexpr bool kLookAhead = (kSched_ & kSchedLookAhead) != 0 && kPersistent && kOverlap && !kPingPong &&
                                       kCluster == 1 && (kMods_ & kModVarlen) == 0;
    static constexpr int kQSlots = kLookAhead ? 2 : 1;
    // Paired walk (persistent, causal, one CTA, plain batches): a CTA takes query tiles u and m - 1 - u of one
    // (head, batch) pair back to back, so that what each CTA takes adds up the same (see locate below).
    static constexpr bool kPaired = (kSched_ & kSchedPaired) != 0 && kPersistent && kIsCausal && kCluster == 1 &&
                                    (kMods_ & kModVarlen) == 0;
    // Registers per thread after the hand-over: the launch gives 65536 / kNThreads (168 or 128); the
    // producer keeps kProducerRegs (its warp walks the tiles: a persistent CTA's walk needs 40, one
    // tile's 24), the consumers take the rest (40 x 128 + 232 x 256 = 64512 = 168 x 384, 24 x 128 + 240 x
    // 256 = 64512; 32 x 128 + 160 x 384 = 128 x 512). (Head dim 256's 128 x 80 tile spills at 232.)
    static constexpr int kProducerRegs = kConsumers == 3 ? 32 : kPersistent ? 40 : 24;
    static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kPersistent ? 232 : 240;
    static constexpr int kTileBytesQ = kBlockM * kHeadDim * 2;
    static constexpr int kTileBytesKV = kBlockN * kHeadDim * 2;
    // Q full, Q empty; K full, V full, K empty, V empty per slot; (look-ahead) Q full, Q empty of the second Q slot
    static constexpr int kBarriers = 2 + 4 * kStages + 2 * (kQSlots - 1);
    // 1024 bytes of slack to align the base to the swizzle pattern; the mbarriers after the tiles.
    // Persistent: O is staged in a tile of its own, so the next item's Q can load during the epilogue.
    static constexpr int kTileBytesO = kPersistent ? kTileBytesQ : 0;
    // (Look-ahead: the second Q slot after the O staging tile.)
    static constexpr int kSmemBytes =
        1024 + kQSlots * kTileBytesQ + 2 * kStages * kTileBytesKV + kTileBytesO + 8 * ((kBarriers + 1) / 2 * 2);

    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "whole 64-element swizzle atoms, N <= 256");
    static_assert(kConsumers == 2 || kConsumers == 3, "2 or 3 consumer warpgroups (the register split above)");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key tiles are wgmma N and whole P V k-steps of 16");
    static_assert(kStages >= 2 && kStages <= 4, "a ring of 2 to 4 K/V slots");
    static_assert(kBlockN / kCluster % 8 == 0, "each CTA's share of a K/V tile is whole 8-row swizzle patterns");
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536 / kNThreads / 8 * 8 * kNThreads,
                  "the register split must fit what the launch gives (else setmaxnreg.inc waits forever)");
    static_assert(!kLookAhead || kBlockN <= kBlockM, "look-ahead: a stand-in S reads a Q tile as its B (kBlockN rows)");
};

template <class Cfg>
CUFLASH_DEVICE void flash_fwd_sm90_ws_kernel(const FwdTmaParams& P) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim, kStages = Cfg::kStages;
    constexpr bool kBF16 = Cfg::kIsBF16, kVarlen = FwdTileRef<Cfg>::kVarlen;
    constexpr int kNB = Cfg::kNBlocksS, kAtoms = kHeadDim / 64;
    const FwdParams& p = P.p;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4;

    // Work items: one (blockIdx), or (persistent) items blockIdx.x, + gridDim.x, ... of the tiles the
    // non-persistent launch would have, in groups of p.sched_group (head, batch) pairs (the last group
    // may hold fewer): inside a group the query-tile index is outermost, then the pair. So the CTAs
    // that run together read the K/V of one group's heads, which the host sized to stay in L2
    // (plan.persistent_group), and causal's heaviest tiles (FwdTileRef reverses the index) come first
    // in each group. (kPaired permutes these items: see locate.)
    // Clusters (kCluster 2): an item is a pair of query tiles, 2 i and 2 i + 1 of one (head, batch) pair,
    // and the CTA of rank r takes tile 2 i + r (the last pair of an odd count has one tile: its rank-1 CTA
    // only helps load). Both visit the K/V tiles of the pair's hull (kv_span), each loading half the
    // rows of every tile into both CTAs' shared memory; a CTA computes with its own tile's blocks and
    // only waits for and hands back the others (causal: the diagonal block of the upper tile).
    constexpr int kCluster = Cfg::kCluster;
    const int rank = kCluster > 1 ? (int)cluster_ctarank() : 0;
    const int heads = p.nheads, batches = kVarlen ? 1 : p.batch;
    const int m_items = (p.num_m_blocks + kCluster - 1) / kCluster;  // items per (head, batch) pair
    const int n_items = Cfg::kPersistent ? m_items * heads * batches : 1;
    const int item_step = Cfg::kPersistent ? (int)gridDim.x / kCluster : 1;
    // (Persistent) item -> the query-tile index (before causal's reversal) of rank 0 and the (head, batch) pair.
    // Paired walk (kPaired): causal tile i (after the reversal) costs about i + 1 key blocks, so a CTA that took every
    // item_step-th tile of the plain walk carried whatever mix of heavy and light tiles the stride gave it
    // (0.76-0.95 of an even share on 132 SMs, by the L2 group size; docs/history/hopper.md, session 38).
    // Here a unit is indices u and m - 1 - u of one pair (tiles m - 1 - u and u: m + 1 blocks), in groups of sched_group
    // pairs as above (u outermost); the CTA's items 2d and 2d + 1 (rounds 2d and 2d + 1 of the stride)
    // are unit d * item_step + its index, heavy tile first. What is left after the last whole double
    // round goes one tile per item: the leftover units' heavy tiles, their light tiles, then the middle
    // tiles of an odd count (one per pair). Every tile is one item, so n_items and the walk are unchanged.
    // The divisions go through FastDiv multipliers (FwdParams.walk_*; plan/forward.py fwd_walk): a CTA runs this
    // for every item, and plain integer division put ~100-clock SFU chains between its items.
    auto locate = [&](int item, int& m_idx, int& pair) {
        const int pairs = heads * batches;
        int first, in;  // the group's first pair; the index inside the group
        bool light = false;
        if constexpr (Cfg::kPaired) {
            const int half = p.num_m_blocks / 2, units = half * pairs;
            int unit;
            const int whole = fast_div(p.walk_step, units) * item_step;  // units handed out in whole double rounds
            if (item < 2 * whole) {
                int round, col;
                fast_divmod(p.walk_step, item, round, col);
                unit = (round >> 1) * item_step + col;
                light = round & 1;
            } else {
                const int e = item - 2 * whole, left = units - whole;
                if (e < 2 * left) {
                    unit = whole + (e < left ? e : e - left);
                    light = e >= left;
                } else {
                    m_idx = half, pair = e - 2 * left;
                    return;
                }
            }
            fast_divmod(p.walk_units, unit, first, in);  // (half >= 1 here: with one tile there are no units)
        } else {
            fast_divmod(p.walk_items, item, first, in);
        }
        first *= p.sched_group;
        const FastDiv size = pairs - first < p.sched_group ? p.walk_tail : p.walk_group;  // (the last group may hold fewer)
        int row;
        fast_divmod(size, in, row, pair);
        pair += first;
        m_idx = Cfg::kPaired ? (light ? p.num_m_blocks - 1 - row : row) : row * kCluster;
    };
    auto m_index = [&](int item, int r) {  // the query-tile index (before causal's reversal) of rank r
        if constexpr (Cfg::kPersistent) {
            int m_idx, pair;
            locate(item, m_idx, pair);
            return m_idx + r;
        } else {
            return (int)blockIdx.x / kCluster * kCluster + r;
        }
    };
    auto tile_of = [&](int item, int r) {
        if constexpr (Cfg::kPersistent) {
            int m_idx, pair;
            locate(item, m_idx, pair);
            int b, h;
            fast_divmod(p.walk_heads, pair, b, h);
            return FwdTileRef<Cfg>(p, m_idx + r, h, b);
        } else {
            return FwdTileRef<Cfg>(p, m_index(item, r), blockIdx.y, blockIdx.z);
        }
    };
    // Key blocks [lo, hi) whose K/V an item's CTAs load: the tile's own, or (clusters) the hull of the
    // cluster's tiles that have keys; hi == lo when none has.
    auto kv_span = [&](int item, const FwdTileRef<Cfg>& own, int& lo, int& hi) {
        if constexpr (kCluster == 1) {
            lo = own.first_block();
            hi = own.empty() ? lo : own.n_block_end;
        } else {
            lo = 0x7fffffff, hi = 0;
#pragma unroll
            for (int r = 0; r < kCluster; ++r) {
                if (m_index(item, r) >= p.num_m_blocks) continue;
                const FwdTileRef<Cfg> t = r == rank ? own : tile_of(item, r);
                if (t.empty()) continue;
                lo = min(lo, t.first_block());
                hi = max(hi, t.n_block_end);
            }
            if (hi == 0) lo = 0;
        }
    };
    const int item0 = Cfg::kPersistent ? (int)blockIdx.x / kCluster : 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;  // swizzle pattern starts on 1024 bytes
    const u32 s_q = s_base;
    const u32 s_k0 = s_q + Cfg::kTileBytesQ;
    const u32 s_v0 = s_k0 + kStages * Cfg::kTileBytesKV;
    const u32 s_o = s_v0 + kStages * Cfg::kTileBytesKV;  // (persistent: O staging)
    const u32 s_q1 = s_o + Cfg::kTileBytesO;              // (look-ahead: the second Q slot)
    const u32 s_bar = s_q1 + (Cfg::kQSlots - 1) * Cfg::kTileBytesQ;
    const u32 full_q = s_bar, empty_q = s_bar + 8u;
    // The u-th Q tile of the CTA's walk: its slot, barriers and phase (look-ahead: two slots taken in turn).
    constexpr bool kLookAhead = Cfg::kLookAhead;
    auto q_tile = [&](int u) { return kLookAhead && (u & 1) ? s_q1 : s_q; };
    auto q_full = [&](int u) { return kLookAhead && (u & 1) ? s_bar + 8u * (2 + 4 * kStages) : full_q; };
    auto q_empty = [&](int u) { return kLookAhead && (u & 1) ? s_bar + 8u * (3 + 4 * kStages) : empty_q; };
    auto q_phase = [&](int u) { return (u32)((kLookAhead ? u >> 1 : u) & 1); };
    auto full_k = [&](int s) { return s_bar + 8u * (2 + s); };
    auto full_v = [&](int s) { return s_bar + 8u * (2 + kStages + s); };
    auto empty_k = [&](int s) { return s_bar + 8u * (2 + 2 * kStages + s); };
    auto empty_v = [&](int s) { return s_bar + 8u * (2 + 3 * kStages + s); };
    auto generic = [&](u32 s_addr) { return smem_raw + (s_addr - smem_u32(smem_raw)); };

    if (tid == 0) {
#pragma unroll
        for (int u = 0; u < Cfg::kQSlots; ++u) {
            mbar_init(q_full(u), 1);
            mbar_init(q_empty(u), 4 * Cfg::kConsumers);  // lane 0 of every consumer warp arrives
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * Cfg::kConsumers * kCluster);  // (clusters: every CTA's consumer warps)
            mbar_init(empty_v(s), 4 * Cfg::kConsumers * kCluster);
        }
        mbar_fence_init();
    }
    if constexpr (kCluster > 1) {
        cluster_sync();  // both CTAs' barriers exist before either signals the other's
    } else {
        __syncthreads();
    }

    // Both roles walk the same items and count the same loads: `ring` K/V tiles so far (slot ring %
    // kStages, phase (ring / kStages) & 1) and `uses` Q tiles so far (phase uses & 1).
    int ring = 0, uses = 0;

    if (wg == 0) {
        // ---------------- producer: warp 0 walks the items (the varlen scheduler's search needs a
        // whole warp), its lane 0 issues every load; the other producer warps leave ----------------
        regs_release<Cfg::kProducerRegs>();
        if (warp != 0) return;
        CUFLASH_TRACE_INIT(0, lane == 0);
        if (lane == 0) {
            tma_prefetch(&P.tma_q);
            tma_prefetch(&P.tma_k);
            tma_prefetch(&P.tma_v);
        }
        // Clusters: each CTA loads rows [r kBlockN / 2, (r + 1) kBlockN / 2) of every K/V tile into the
        // same place in both CTAs (multicast); a slot is refilled once both CTAs' consumers handed it back
        // (its "empty" barriers count both), and its "full" barrier expects the whole tile's bytes.
        constexpr int kShareRows = kBlockN / kCluster;
        constexpr u32 kShareBytes = kShareRows * 128;  // (per 64-column atom)
        auto load_kv = [&](u32 s_slot, const TmaDesc* desc, u32 bar, int a, int row, int hk, int batch) {
            if constexpr (kCluster == 1) {
                tma_load_4d(s_slot + a * kBlockN * 128, desc, bar, 64 * a, row, hk, batch);
            } else {
                tma_load_4d_multicast(s_slot + a * kBlockN * 128 + rank * kShareBytes, desc, bar, 64 * a,
                                      row + rank * kShareRows, hk, batch, (1u << kCluster) - 1);  // fmt: skip
            }
        };
        for (int item = item0; item < n_items; item += item_step) {
            const FwdTileRef<Cfg> tile = tile_of(item, rank);
            if (tile.skip()) continue;
            // (look-ahead: every item's Q, rows that see no key included: a stand-in S reads it)
            const bool own = (kCluster == 1 || m_index(item, rank) < p.num_m_blocks) && (kLookAhead || !tile.empty());
            int lo, hi;
            kv_span(item, tile, lo, hi);
            const int n_tiles = hi - lo;
            if (lane == 0) {
                CUFLASH_TRACE_MARK(kTraceProducerItem);
                if (own) {
                    mbar_wait(q_empty(uses), q_phase(uses) ^ 1);  // the consumers are done with the slot's last Q (and its O staging)
                    CUFLASH_TRACE_MARK(kTraceProducerQ);
                    mbar_arrive_expect_tx(q_full(uses), Cfg::kTileBytesQ);
#pragma unroll
                    for (int a = 0; a < kAtoms; ++a) {
                        tma_load_4d(q_tile(uses) + a * kBlockM * 128, &P.tma_q, q_full(uses), 64 * a, tile.q_row0, tile.tma_h,
                                    tile.tma_b);
                    }
                }
                for (int t = 0; t < n_tiles; ++t) {
                    const int st = (ring + t) % kStages;
                    const u32 free_parity = (((ring + t) / kStages) & 1) ^ 1;
                    int row, batch;
                    tile.kv_coords(p, (hi - 1 - t) * kBlockN, row, batch);
                    mbar_wait(empty_k(st), free_parity);
                    CUFLASH_TRACE_MARK(kTraceProducerK);
                    mbar_arrive_expect_tx(full_k(st), Cfg::kTileBytesKV);
#pragma unroll
                    for (int a = 0; a < kAtoms; ++a) {
                        load_kv(s_k0 + st * Cfg::kTileBytesKV, &P.tma_k, full_k(st), a, row, tile.tma_hk, batch);
                    }
                    mbar_wait(empty_v(st), free_parity);  // (V after K: S needs K first)
                    CUFLASH_TRACE_MARK(kTraceProducerV);
                    mbar_arrive_expect_tx(full_v(st), Cfg::kTileBytesKV);
#pragma unroll
                    for (int a = 0; a < kAtoms; ++a) {
                        load_kv(s_v0 + st * Cfg::kTileBytesKV, &P.tma_v, full_v(st), a, row, tile.tma_hk, batch);
                    }
                }
            }
            ring += n_tiles;
            if (own) ++uses;
        }
        return;
    }

    // ---------------- consumers ----------------
    regs_claim<Cfg::kConsumerRegs>();
    const int cwg = wg - 1;        // consumer warpgroup
    const int cwarp = warp - 4;    // consumer warp: rows 16 cwarp .. +15 of the tile
    CUFLASH_TRACE_INIT(1 + cwg, cwarp % 4 == 0 && lane == 0);
    const int ctid = tid - 128;
    const bool signals = lane == 0;  // the thread of its warp that arrives on "empty" barriers
    const int t4 = lane % 4;
    const int warp_row0 = cwarp * 16;

    // Descriptors (as flash_fwd_sm90.cuh): A = this warpgroup's 64 rows of Q (K-major); B of S = K
    // (K-major); B of O = V read N-major (64-column atoms kBlockN * 128 bytes apart).
    const u64 desc_q = sw128_desc(s_q + cwg * 64 * 128, 16);
    const u64 desc_k0 = sw128_desc(s_k0, 16);
    const u64 desc_v0 = sw128_desc(s_v0, kBlockN * 128);
    constexpr u64 kSlotStep = Cfg::kTileBytesKV >> 4;
    const float scale_log2 = p.scale_log2;
    // Ping-pong: warpgroup 1 lets warpgroup 0 take the first turn, and warpgroup 0 takes that last turn
    // after the last item, so each barrier sees as many arrivals as waits, one warpgroup's at a time (a
    // warpgroup never arrives twice on a barrier before the other has waited on it).
    if (Cfg::kPingPong && cwg == 1) named_arrive(2, 256);

    // Look-ahead: the S of an item's first K/V tile is issued at the end of the item before (and for the
    // CTA's first item here), into S_ahead, which the item's tiles then use as their S. Where the next item
    // has no key to see, or there is none, a stand-in S = Q Q^T of a Q tile that nothing overwrites any more
    // (the next item's own, or the last one's: the producer has no loads left) is issued instead and its
    // result dropped, so that every path issues the same wgmma (an issue on one branch only made ptxas
    // serialize every wgmma of the kernel, docs/history/hopper.md, session 15).
    float S_ahead[1][kNB][4];
    float(&s_ahead)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(S_ahead);
    const u64 desc_qa1 = sw128_desc(s_q1 + cwg * 64 * 128, 16);  // (A: this warpgroup's rows of the second slot)
    const u64 desc_qb0 = sw128_desc(s_q, 16), desc_qb1 = sw128_desc(s_q1, 16);  // (a Q tile read as a stand-in B)
    auto look_ahead = [&](int next, int u_next, int ring_next, int u_hold) {
        u64 da = (u_hold & 1) ? desc_qa1 : desc_q, db = (u_hold & 1) ? desc_qb1 : desc_qb0;
        if (next < n_items) {
            const FwdTileRef<Cfg> nt = tile_of(next, rank);
            mbar_wait(q_full(u_next), q_phase(u_next));
            da = (u_next & 1) ? desc_qa1 : desc_q;
            db = (u_next & 1) ? desc_qb1 : desc_qb0;
            if (!nt.empty()) {
                const int st = ring_next % kStages;
                mbar_wait(full_k(st), (u32)((ring_next / kStages) & 1));
                db = desc_k0 + st * kSlotStep;
            }
        }
        wgmma_fence_operands(s_ahead);
        wgmma_fence();
        wgmma_ss_kmajor<kBlockN, kBF16, Cfg::kKStepsQK, kBlockM, kBlockN>(s_ahead, da, db);
        wgmma_commit();
    };
    if constexpr (kLookAhead) look_ahead(item0, 0, 0, 0);

    // A K/V load of the ring (the k-th) that this CTA does not compute with (clusters: the other CTA's
    // blocks): wait until it has landed here, then hand the slot back to both CTAs' producers.
    auto release_kv = [&](u32 bar) {
        __syncwarp();
        if (signals) {
            mbar_arrive(bar);
            if constexpr (kCluster > 1) mbar_arrive_cluster(bar, rank ^ 1);
        }
    };
    auto pass_kv = [&](int k) {
        const int st = k % kStages;
        const u32 ph = (u32)((k / kStages) & 1);
        mbar_wait(full_k(st), ph);
        mbar_wait(full_v(st), ph);
        release_kv(empty_k(st));
        release_kv(empty_v(st));
    };

    for (int item = item0; item < n_items; item += item_step) {
        const FwdTileRef<Cfg> tile = tile_of(item, rank);
        if (tile.skip()) continue;  // a spare slot of the varlen scheduler
        int lo, hi;
        kv_span(item, tile, lo, hi);
        const bool valid = kCluster == 1 || m_index(item, rank) < p.num_m_blocks;
        if (!valid || tile.empty()) {  // no row sees a key: O = 0, lse = -inf; nothing was loaded for it
            if constexpr (kLookAhead) {  // (but its Q: the stand-in S read it)
                wgmma_wait<0>();
                wgmma_fence_operands(s_ahead);
                __syncwarp();
                if (lane == 0) mbar_arrive(q_empty(uses));
                tile.write_empty(p, ctid, 128 * Cfg::kConsumers);
                look_ahead(item + item_step, uses + 1, ring, uses);
                ++uses;
                continue;
            }
            if (valid) tile.write_empty(p, ctid, 128 * Cfg::kConsumers);
            for (int k = ring; k < ring + hi - lo; ++k) pass_kv(k);
            ring += hi - lo;
            continue;
        }
        CUFLASH_TRACE_MARK(kTraceItem);
        const int n_last = tile.n_block_end - 1;
        const int n_tiles = tile.n_block_end - tile.first_block();  // >= 1 (not empty)
        // Clusters: the span's blocks above this tile's come first (visited from the last block), those
        // below it last.
        for (int k = ring; k < ring + hi - tile.n_block_end; ++k) pass_kv(k);
        ring += hi - tile.n_block_end;
        const int m0 = tile.m0;
        const typename FwdTileRef<Cfg>::Mask mask = tile.mask;
        const int row_abs0 = m0 + warp_row0 + lane / 4;

        WarpTile<Cfg> wt;
        wt.init(warp_row0, lane);
        float S_own[1][kNB][4];
        float(&S)[1][kNB][4] = kLookAhead ? S_ahead : S_own;
        u32 keep[1][kNB / 2];       // dropout keep bits of the current tile (dropout only)
        u32 pa[Cfg::kKStepsPV][4];  // P of the previous tile: the A operand of its P V product
        float corr[1][2];
        float(&s_acc)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(S);
        float(&o_acc)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(wt.acc_o);
        auto slot = [&](int t) { return (ring + t) % kStages; };
        auto phase = [&](int t) { return (u32)(((ring + t) / kStages) & 1); };

        // Ping-pong: warpgroup c issues its GEMMs after `bar.sync 2 + c` and lets the other one go with
        // `bar.arrive 3 - c` (the turns run on across items: both warpgroups take the same number).
        auto turn_wait = [&] {
            if constexpr (Cfg::kPingPong) {
                if (cwg == 0) named_sync(2, 256);
                else named_sync(3, 256);
            }
        };
        auto turn_pass = [&] {
            if constexpr (Cfg::kPingPong) {
                if (cwg == 0) named_arrive(3, 256);
                else named_arrive(2, 256);
            }
        };
        auto issue_s = [&](int st) {  // S = Q K_st^T (look-ahead: Q from this item's slot)
            wgmma_fence_operands(s_acc);
            wgmma_fence();
            wgmma_ss_kmajor<kBlockN, kBF16, Cfg::kKStepsQK, kBlockM, kBlockN>(
                s_acc, kLookAhead && (uses & 1) ? desc_qa1 : desc_q, desc_k0 + st * kSlotStep);
            wgmma_commit();
        };
        auto issue_pv = [&](int st) {  // O += P V_st
            wgmma_fence_operands(o_acc);
            wgmma_fence_operands(pa);
            wgmma_fence();
            wgmma_rs_ksteps<kHeadDim, kBF16>(o_acc, pa, desc_v0 + st * kSlotStep);
            wgmma_commit();
        };
        auto wait_pv = [&] {  // every wgmma of this warpgroup landed: O and pa may be read and written
            wgmma_wait<0>();
            wgmma_fence_operands(o_acc);
            wgmma_fence_operands(pa);
        };
        auto scores = [&](int j) {  // variants, mask, softmax of S (key block j) -> P; returns "a max grew"
            tile.modify_scores(S, row_abs0, j * kBlockN + 2 * t4);
            if (mask.block_needs_mask(m0, kBlockM, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t4);
            return wt.softmax_rows(S, scale_log2, corr);
        };
        auto pack_p = [&] {  // (dropout) then P into A fragments, one per 16-key step
            tile.drop(S, keep);
#pragma unroll
            for (int kk = 0; kk < Cfg::kKStepsPV; ++kk) {
                pa[kk][0] = pack2<kBF16>(S[0][2 * kk][0], S[0][2 * kk][1]);
                pa[kk][1] = pack2<kBF16>(S[0][2 * kk][2], S[0][2 * kk][3]);
                pa[kk][2] = pack2<kBF16>(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
                pa[kk][3] = pack2<kBF16>(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
            }
        };
        auto release = [&](u32 bar) {  // (Q: this CTA's own)
            __syncwarp();
            if (signals) mbar_arrive(bar);
        };
        auto q_done = [&] {  // (persistent) this warpgroup's last S = Q K^T has completed: Q may be reloaded
            if constexpr (Cfg::kPersistent) release(q_empty(uses));
        };
        // Varlen: the first tile visited (key block n_last) may end past the sequence's keys, and TMA then
        // brought the rows that follow them in the packed tensor or page (the next sequence, unused cache
        // slots: any bits, NaN included). Their P is 0, but 0 * NaN is not: zero those V rows (whole
        // 128-byte lines of every atom, whatever the swizzle) before any P V reads the slot. Plain batches
        // need nothing: rows past seqlen_k are outside the tensor map and arrive as zeros.
        auto clear_v_tail = [&] {
            if constexpr (kVarlen) {
                const int r0 = tile.keys(p) - n_last * kBlockN;  // first row of the tile past the keys
                if (r0 >= kBlockN) return;                       // uniform over the consumers
                mbar_wait(full_v(slot(0)), phase(0));
                unsigned char* v_slot = generic(s_v0 + slot(0) * Cfg::kTileBytesKV);
                const int lines = (kBlockN - r0) * kAtoms;
                for (int i = ctid; i < lines * 8; i += 128 * Cfg::kConsumers) {
                    const int line = i / 8, a = line % kAtoms, r = r0 + line / kAtoms;
                    *reinterpret_cast<uint4*>(v_slot + a * kBlockN * 128 + r * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
                }
                fence_proxy_async_smem();  // generic stores -> the async proxy (wgmma) reads
                named_sync(4, 128 * Cfg::kConsumers);
            }
        };

        if constexpr (!kLookAhead) mbar_wait(full_q, uses & 1);  // (look-ahead: waited for before its S was issued)
        CUFLASH_TRACE_MARK(kTraceQ);

        if constexpr (Cfg::kOverlap) {
            // Tile 0: S, softmax, P (O is still zero: nothing to rescale). (Look-ahead: S is in flight.)
            if constexpr (!kLookAhead) {
                mbar_wait(full_k(slot(0)), phase(0));
                CUFLASH_TRACE_MARK(kTraceK);
                turn_wait();
                issue_s(slot(0));
                turn_pass();
            } else {
                CUFLASH_TRACE_MARK(kTraceK);  // (waited for before S was issued: the timeline's phases stay in order)
            }
            tile.draw_keep(keep, n_last, m0 + warp_row0, lane);
            wgmma_wait<0>();
            wgmma_fence_operands(s_acc);
            CUFLASH_TRACE_MARK(kTraceS);
            release_kv(empty_k(slot(0)));
            if (n_tiles == 1) q_done();
            scores(n_last);
            CUFLASH_TRACE_MARK(kTraceSoftmax);
            pack_p();
            clear_v_tail();
            for (int t = 1; t < n_tiles; ++t) {
                const int j = n_last - t;
                mbar_wait(full_k(slot(t)), phase(t));
                CUFLASH_TRACE_MARK(kTraceK);
                mbar_wait(full_v(slot(t - 1)), phase(t - 1));
                CUFLASH_TRACE_MARK(kTraceV);
                turn_wait();
                issue_s(slot(t));
                issue_pv(slot(t - 1));
                turn_pass();
                tile.draw_keep(keep, j, m0 + warp_row0, lane);
                wgmma_wait<1>();  // S_t landed; P_{t-1} V_{t-1} may still run
                wgmma_fence_operands(s_acc);
                CUFLASH_TRACE_MARK(kTraceS);
                release_kv(empty_k(slot(t)));
                if (t == n_tiles - 1) q_done();
                const bool grew = scores(j);
                CUFLASH_TRACE_MARK(kTraceSoftmax);
                // Wait for P_{t-1} V_{t-1} (then O, pa and its V slot are free) and rescale O, the wait
                // at the head of a branch: in the softmax's basic block ptxas schedules the wait
                // (WARPGROUP.DEPBAR) at the top of the block, ahead of the softmax, which then never
                // overlapped the P V product (SASS of every build before session 17). The branch must be
                // the same for the whole warpgroup (wgmma.wait_group is .aligned; a branch on a per-warp
                // vote around the wait drew synccheck errors), so it tests a kernel parameter: uniform
                // over the grid, unknown to the compiler, always true (head_dim >= 8 here). Both arms are
                // correct, and they differ so that ptxas keeps two blocks: the first skips a warp's FMULs
                // where none of its rows grew its max (factor 1), the second always scales.
                // tools/check_overlap_sass.py checks that the softmax stays between the two waits.
                if (p.head_dim > 0) {
                    wait_pv();
                    wt.rescale_o(corr, grew);
                } else {
                    wait_pv();
                    wt.scale_o(corr);
                }
                CUFLASH_TRACE_MARK(kTracePV);
                release_kv(empty_v(slot(t - 1)));
                pack_p();
            }
            mbar_wait(full_v(slot(n_tiles - 1)), phase(n_tiles - 1));
            CUFLASH_TRACE_MARK(kTraceV);
            turn_wait();
            issue_pv(slot(n_tiles - 1));
            turn_pass();
            if constexpr (kLookAhead) {  // the next item's first S behind the last P V: it runs under the epilogue
                look_ahead(item + item_step, uses + 1, ring + n_tiles, uses);
                wgmma_wait<1>();
                wgmma_fence_operands(o_acc);
                wgmma_fence_operands(pa);
            } else {
                wait_pv();
            }
            CUFLASH_TRACE_MARK(kTracePV);
            release_kv(empty_v(slot(n_tiles - 1)));
        } else {
            for (int t = 0; t < n_tiles; ++t) {
                const int j = n_last - t;
                mbar_wait(full_k(slot(t)), phase(t));
                turn_wait();
                issue_s(slot(t));
                turn_pass();
                tile.draw_keep(keep, j, m0 + warp_row0, lane);
                wgmma_wait<0>();
                wgmma_fence_operands(s_acc);
                release_kv(empty_k(slot(t)));
                if (t == n_tiles - 1) q_done();
                const bool grew = scores(j);
                wt.rescale_o(corr, grew);
                pack_p();
                if (t == 0) clear_v_tail();
                mbar_wait(full_v(slot(t)), phase(t));
                turn_wait();
                issue_pv(slot(t));
                turn_pass();
                wait_pv();
                release_kv(empty_v(slot(t)));
            }
        }
        ring += n_tiles;
        ++uses;
        for (int k = ring; k < ring + tile.first_block() - lo; ++k) pass_kv(k);
        ring += tile.first_block() - lo;

        // Epilogue. Each warp stages its normalized O rows in its own rows of the Q tile (its warpgroup's
        // last S = Q K^T has completed; the other warpgroup reads only its own rows), in Q's swizzled
        // layout, which is the O tensor map's box layout; kTmaStore: its lane 0 writes them with one TMA
        // store per 64-column atom (rows and columns past the tensor are not written); else, and for
        // packed batches (whose last tile of a sequence reaches into the next sequence's rows), its lanes
        // write the valid rows in 16-byte chunks. Then the Q tile goes back to the producer once the
        // stores have read it.
        // Persistent: the Q tile went back after the last S (q_done), the next item's Q and K/V stream in
        // meanwhile, and O is staged in its own tile (same layout); a warp's store must have read its
        // rows before the warp stages the next item's (the wait at the top).
        u16* s_stage = reinterpret_cast<u16*>(generic(Cfg::kPersistent ? s_o : s_q)) + warp_row0 * 64;
        const u32 s_stage_addr = (Cfg::kPersistent ? s_o : s_q) + warp_row0 * 128;  // (the same, for TMA)
        constexpr bool kDropout = (Cfg::kMods & kModDropout) != 0;
        if constexpr (Cfg::kTmaStore) {
            if (Cfg::kPersistent && lane == 0) tma_store_wait_read<0>();  // (store() starts with __syncwarp)
            wt.template store<kDropout, kBlockM, false>(tile.o, p.o_row_stride, tile.lse, p.softmax_scale, warp_row0,
                                                        tile.rows_valid, p.head_dim, s_stage, lane,
                                                        p.mod.dropout_rp);  // fmt: skip
            if (warp_row0 < tile.rows_valid) {  // (a warp past the last row has nothing to store)
                fence_proxy_async_smem();  // each lane's staged rows -> the async proxy (the TMA store reads them)
                __syncwarp();
                if (lane == 0) {
#pragma unroll
                    for (int a = 0; a < kAtoms; ++a) {
                        tma_store_4d(&P.tma_o, s_stage_addr + a * kBlockM * 128, 64 * a, tile.q_row0 + warp_row0,
                                     tile.tma_h, tile.tma_b);  // fmt: skip
                    }
                    tma_store_commit();
                }
            }
        } else {  // (packed batches: TMA for the warps whose rows are all inside the sequence cost the
                  // persistent builds 96-120 bytes of local memory, the coordinates living through the main loop)
            wt.template store<kDropout, kBlockM>(tile.o, p.o_row_stride, tile.lse, p.softmax_scale, warp_row0,
                                                 tile.rows_valid, p.head_dim, s_stage, lane,
                                                 p.mod.dropout_rp);  // fmt: skip
        }
        if constexpr (!Cfg::kPersistent) {
            if (Cfg::kTmaStore && lane == 0) tma_store_wait_read<0>();  // the store has read Q's bytes
            fence_proxy_async_smem();  // this thread's generic accesses to Q's bytes, before TMA writes them again
            release(empty_q);
        }
        CUFLASH_TRACE_MARK(kTraceEpilogue);
    }
    if constexpr (kLookAhead) {  // the stand-in S after the CTA's last item
        wgmma_wait<0>();
        wgmma_fence_operands(s_ahead);
    }
    if (Cfg::kTmaStore && Cfg::kPersistent && lane == 0) tma_store_wait_read<0>();  // smem stays until the last store read it
    if (Cfg::kPingPong && cwg == 0) named_sync(2, 256);
    // Clusters: stay until the other CTA's consumers are done too: their last arrivals land on this
    // CTA's "empty" barriers (its producer warps have exited: they count as arrived).
    if constexpr (kCluster > 1) cluster_sync();
}

}  // namespace cuflash
