// Timeline marks of a diagnostic build (tools/trace_fwd.py): where the time of a warp-specialized
// kernel goes, per CTA and role, without a profiler's replay. Only a build compiled with -DCUFLASH_TRACE
// records anything; in every other build CUFLASH_TRACE_INIT and CUFLASH_TRACE_MARK expand to nothing,
// so the kernels' code is unchanged.
//
// Layout of the module global cuflash_trace (zeroed by the tool before a launch):
//   [cta][role][kTraceEvents] 64-bit words, cta = the linear block index (only the first kTraceCtas
//   CTAs record), role 0 the producer warp, 1 + c consumer warpgroup c (its warp 0, lane 0 marks).
//   The first word of a role is (kTraceSm << 56) | %smid; then two words per mark: (event << 56) |
//   (%globaltimer in ns, low 56 bits), and %clock (the SM's 32-bit cycle counter: globaltimer can tick in
//   steps of up to a microsecond, so the tool times phases by cycles and converts them to ns with the
//   rate of the two counters over the role's marks). Unused words stay 0. Events are numbered by the
//   kernel that marks them.
#pragma once

#include "primitives.cuh"

#ifdef CUFLASH_TRACE
namespace cuflash {
constexpr int kTraceCtas = 512;  // (tools/trace_fwd.py reads these four numbers from here)
constexpr int kTraceRoles = 4;
constexpr int kTraceEvents = 2048;  // words: 1 + 2 per mark
constexpr unsigned long long kTraceSm = 255;
}  // namespace cuflash

extern "C" {  // (C linkage: the tool finds it by this name with cuModuleGetGlobal)
__device__ unsigned long long cuflash_trace[cuflash::kTraceCtas * cuflash::kTraceRoles * cuflash::kTraceEvents];
}

namespace cuflash {

struct TraceLog {
    unsigned long long* out = nullptr;  // null: this thread does not record
    int n = 0;

    CUFLASH_DEVICE TraceLog(int role, bool records) {
        const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        if (!records || cta >= kTraceCtas || role >= kTraceRoles) return;
        out = cuflash_trace + ((size_t)cta * kTraceRoles + role) * kTraceEvents;
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        out[n++] = (kTraceSm << 56) | sm;
    }
    CUFLASH_DEVICE void mark(unsigned long long event) {
        if (out == nullptr || n + 2 > kTraceEvents) return;
        unsigned long long t;
        u32 c;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
        out[n++] = (event << 56) | (t & ((1ull << 56) - 1));
        out[n++] = c;
    }
};

}  // namespace cuflash
#define CUFLASH_TRACE_INIT(role, records) ::cuflash::TraceLog trace_log_((role), (records))
#define CUFLASH_TRACE_MARK(event) trace_log_.mark(event)
#else
#define CUFLASH_TRACE_INIT(role, records)
#define CUFLASH_TRACE_MARK(event)
#endif
