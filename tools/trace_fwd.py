"""Where the warp-specialized TMA forward's time goes, from the kernel itself: a diagnostic build
(-DCUFLASH_TRACE, cuda_src/trace.cuh) in which the producer and one thread of each consumer warpgroup
write marks (%globaltimer and %clock) at their waits, GEMM completions and epilogue (flash_fwd_sm90_ws.cuh,
FwdTraceEvent), launched on the paper grid's shapes in place of the planned kernel (same spec, same
parameter block). Needs an sm_90a GPU.

    python3 tools/trace_fwd.py --hd 128 --seqlen 512 [--causal] [--tile 128,128,persistent]
        [--json trace.json] [--plot trace.png]

Prints, per role, the median time per work item of each phase (consumer: waiting for Q, for the first
K tile, the first S = Q K^T, its softmax while the tensor cores idle, the main loop per key tile split
into waits / S / softmax / P V, the last P V, the epilogue; producer: waits for free slots), the
traced kernel's time against the normal build's (the marks' cost), and the share of consumer time
outside the main loop. --plot draws the first CTAs' timelines. The marks are one thread's view of
its warpgroup; the other warps of a warpgroup run the same schedule. At head dim 256 the traced build
spills 8-16 bytes (the plain build none): its timeline there is a little slower than the kernel's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

#: flash_fwd_sm90_ws.cuh FwdTraceEvent (checked against the header in main)
EVENTS = {1: "P item", 2: "P Q free", 3: "P K free", 4: "P V free", 10: "item", 11: "Q", 12: "K", 13: "S",
          14: "softmax", 15: "V", 16: "PV", 17: "epilogue"}
EVENT_NAMES = {1: "kTraceProducerItem", 2: "kTraceProducerQ", 3: "kTraceProducerK", 4: "kTraceProducerV",
               10: "kTraceItem", 11: "kTraceQ", 12: "kTraceK", 13: "kTraceS", 14: "kTraceSoftmax", 15: "kTraceV",
               16: "kTracePV", 17: "kTraceEpilogue"}  # fmt: skip


def trace_layout() -> tuple[int, int, int]:
    """(CTAs, roles, events per role) of the trace buffer, read from cuda_src/trace.cuh; and a check
    that EVENTS numbers the kernel's events as its header does."""
    import re

    from cuflash import jit

    text = (jit.source_dir() / "trace.cuh").read_text()
    nums = [int(re.search(rf"constexpr int {n} = (\d+);", text).group(1)) for n in ("kTraceCtas", "kTraceRoles", "kTraceEvents")]
    kernel = (jit.source_dir() / "flash_fwd_sm90_ws.cuh").read_text()
    for number, name in EVENT_NAMES.items():
        if not re.search(rf"\b{name} = {number}\b", kernel):
            sys.exit(f"{name} is not event {number} in flash_fwd_sm90_ws.cuh: update EVENTS here")
    return tuple(nums)


def parse_tile(text: str | None, default):
    """--tile "block_m,block_n[,persistent][,pingpong][,notma][,cluster][,lookahead][,strided]" -> an Sm90WsTile (the
    planner's when None; cluster: clusters of 2 sharing K/V by multicast; lookahead: each item's first S issued
    before the epilogue of the item before; strided: a persistent causal walk without the heavy/light pairs)."""
    from cuflash.plan import Sm90WsTile

    if not text:
        return default
    parts = text.split(",")
    flags = set(parts[2:])
    unknown = flags - {"persistent", "pingpong", "notma", "cluster", "lookahead", "strided"}
    if unknown:
        sys.exit(f"--tile: unknown flags {sorted(unknown)} (persistent, pingpong, notma, cluster, lookahead, strided)")
    return Sm90WsTile(int(parts[0]), int(parts[1]), pingpong="pingpong" in flags, persistent="persistent" in flags,
                      tma_store="notma" not in flags, cluster=2 if "cluster" in flags else 1,
                      look_ahead="lookahead" in flags, paired="strided" not in flags)  # fmt: skip


def _role_marks(row):
    """[(event, globaltimer ns, cycles), ...] of one role's row of the buffer (its SM word skipped),
    with the 32-bit %clock unwrapped (it wraps every ~2 s)."""
    mask = (1 << 56) - 1
    marks, wraps, last = [], 0, None
    for i in range(1, len(row) - 1, 2):
        if row[i]:
            c = int(row[i + 1])
            wraps += last is not None and c < last
            last = c
            marks.append((int(row[i]) >> 56, int(row[i]) & mask, c + (wraps << 32)))
    return marks


def _rate(marks):
    """ns per cycle over a role's marks (first to last), or None with one mark or a timer that did not move."""
    (_, g0, c0), (_, g1, c1) = marks[0], marks[-1]
    return (g1 - g0) / (c1 - c0) if c1 > c0 and g1 > g0 else None


def decode(words, layout):
    """{(cta, role): (sm, [(event, t_ns), ...])} from the raw trace buffer (numpy uint64). A mark's time
    is its cycle count converted to ns at the rate globaltimer advanced against %clock over the role's
    marks (globaltimer alone may tick in steps of up to a microsecond), from the role's first globaltimer
    value; with one mark, or a timer that did not move, its globaltimer value."""
    ctas, roles, per_role = layout
    out = {}
    per = words.reshape(ctas, roles, per_role)
    for cta in range(ctas):
        for role in range(roles):
            row = per[cta, role]
            marks = _role_marks(row) if row[0] else []
            if not marks:
                continue
            rate, g0, c0 = _rate(marks), marks[0][1], marks[0][2]
            out[(cta, role)] = (int(row[0]) & 0xFFFFFFFF,
                                [(ev, g0 + round((c - c0) * rate) if rate else g) for ev, g, c in marks])  # fmt: skip
    return out


def timer_report(words, layout) -> str:
    """The globaltimer's smallest step and the SM clock (GHz) the marks imply: how far to trust them."""
    ctas, roles, per_role = layout
    steps, ghz = [], []
    for row in words.reshape(ctas * roles, per_role):
        marks = _role_marks(row) if row[0] else []
        rate = _rate(marks) if marks else None
        if rate:
            steps += [b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[1] > a[1]]
            ghz.append(1 / rate)
    if not steps:
        return "no timer steps recorded"
    return f"globaltimer's smallest step {min(steps)} ns; SM clock {statistics.median(ghz):.3f} GHz (median over roles)"


LOOP = {"K": "loop wait K", "V": "loop wait V", "S": "loop S", "softmax": "loop softmax", "PV": "loop P V"}
PHASES = ["wait Q", "wait K0", "S0", "softmax0", "loop wait K", "loop wait V", "loop S", "loop softmax", "loop P V",
          "last wait V", "last P V", "epilogue", "between items"]  # fmt: skip
OUTSIDE = ("wait Q", "wait K0", "S0", "softmax0", "last wait V", "last P V", "epilogue")


def consumer_phases(marks):
    """The work items of one consumer warpgroup's marks, each a dict of phase -> ns (the time that ended
    at each mark), in the overlapped schedule's order: item, Q, K, S, softmax, then per further key
    tile K, V, S, softmax, P V, and last V, P V, epilogue."""
    items, cur = [], None
    for ev, t in marks:
        name = EVENTS.get(ev, str(ev))
        if name == "item":
            cur = [(name, t)]
            items.append(cur)
        elif cur is not None:
            cur.append((name, t))
    rows, prev_end = [], None
    for it in items:
        names, ts = [n for n, _ in it], [t for _, t in it]
        if names[1:5] != ["Q", "K", "S", "softmax"] or names[-3:] != ["V", "PV", "epilogue"]:
            continue  # (not the overlapped schedule, or cut off by the buffer's end)
        d = {"item": ts[-1] - ts[0], "tiles": names.count("S")}
        if prev_end is not None:
            d["between items"] = ts[0] - prev_end
        prev_end = ts[-1]
        for key, i in (("wait Q", 1), ("wait K0", 2), ("S0", 3), ("softmax0", 4), ("last wait V", -3),
                       ("last P V", -2), ("epilogue", -1)):  # fmt: skip
            d[key] = ts[i] - ts[i - 1]
        for i in range(5, len(ts) - 3):
            d[LOOP[names[i]]] = d.get(LOOP[names[i]], 0) + ts[i] - ts[i - 1]
        rows.append(d)
    return rows


def producer_phases(marks):
    waits = {"P Q free": [], "P K free": [], "P V free": []}
    prev = None
    for ev, t in marks:
        name = EVENTS.get(ev)
        if prev is not None and name in waits:
            waits[name].append(t - prev)
        prev = t
    return waits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tile", help="block_m,block_n[,persistent][,pingpong][,notma][,cluster][,lookahead][,strided] "
                                   "(default: the planner's)")
    ap.add_argument("--json", help="write the decoded marks here")
    ap.add_argument("--plot", help="PNG of the first CTAs' timelines")
    ap.add_argument("--ctas", type=int, default=6, help="CTAs in the plot")
    a = ap.parse_args()

    import cupy
    import numpy as np
    from cupy.cuda import driver, function

    from cuflash import bench, forward, jit, plan
    from cuflash.checks import numpy_dtype

    if jit.device_arch(0) != "sm_90a":
        sys.exit("the TMA forward runs on sm_90a only")
    b, h = max(1, 16384 // a.seqlen), 2048 // a.hd
    bucket = plan.head_dim_bucket(a.hd)
    tile = parse_tile(a.tile, plan.sm90_ws_tile(bucket, a.seqlen, a.causal))
    rng = np.random.default_rng(0)
    dt = numpy_dtype(a.dtype)
    q, k, v = (cupy.asarray(rng.standard_normal((b, a.seqlen, h, a.hd), dtype=np.float32).astype(dt)) for _ in range(3))
    how, normal = forward._plan_and_load(b, a.seqlen, a.seqlen, h, h, a.hd, a.dtype, a.causal, True, 0, tile)
    spec = how.spec
    if spec.family != "flash_fwd_sm90_ws":
        sys.exit(f"the planned kernel is {spec.family}, not the TMA forward")
    cubin, header = jit.compile_cubin(spec, extra_options=("-DCUFLASH_TRACE",))
    module = function.Module()
    module.load(cubin)
    traced = module.get_function(spec.name)
    driver.funcSetAttribute(traced.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.launch_smem_limit)
    layout = trace_layout()
    words = layout[0] * layout[1] * layout[2]
    ptr = driver.moduleGetGlobal(module.ptr, "cuflash_trace")  # (the buffer's device address)
    buf = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, words * 8, module), 0)

    def call(kernel):
        return lambda: forward.run(q, k, v, causal=a.causal, tile=tile, kernel=kernel)

    ms = bench.time_ms({"normal": call(normal), "traced": call(traced)}, repeats=20)
    buf.memset(0, words * 8)
    got = call(traced)()
    ref = call(normal)()
    diff = float(cupy.abs(ref.astype(cupy.float32) - got.astype(cupy.float32)).max())
    if not diff <= 1e-2:  # (the same math; only the marks' stores were added)
        sys.exit(f"the traced build's output differs from the normal build's by up to {diff}")
    raw = cupy.ndarray((words,), dtype=cupy.uint64, memptr=buf).get()
    trace = decode(raw, layout)
    print(f"{spec.name}: grid {how.grid}, batch {b} x {h} heads x {a.seqlen} tokens; traced build {header['ptxas']}")
    print(f"normal build {ms['normal']:.3f} ms, traced {ms['traced']:.3f} ms ({ms['traced'] / ms['normal']:.3f}x: "
          f"the marks' cost); {len({c for c, _ in trace})} CTAs traced; {timer_report(raw, layout)}")  # fmt: skip

    rows = [r for (cta, role), (sm, marks) in trace.items() if role > 0 for r in consumer_phases(marks)]
    if not rows:
        sys.exit("no consumer marks of the overlapped schedule")
    item = statistics.median(r["item"] for r in rows)
    print(f"\nconsumer warpgroups: {len(rows)} work items, {statistics.median(r['tiles'] for r in rows):.0f} key "
          f"tiles each (median), {item / 1000:.2f} us per item; phases, us per item (median, share of the median item):")  # fmt: skip
    for key in PHASES:
        vals = [r[key] for r in rows if key in r]
        if vals:
            med = statistics.median(vals)
            print(f"  {key:14s} {med / 1000:8.3f}  {med / item:6.1%}")
    outside = statistics.median(sum(r.get(x, 0) for x in OUTSIDE) / r["item"] for r in rows)
    print(f"  outside the main loop (first K tile's S and softmax, waits for Q / K0, last P V, epilogue): "
          f"{outside:.1%} of an item (median)")  # fmt: skip
    prod = {}
    for (cta, role), (sm, marks) in trace.items():
        if role == 0:
            for name, vals in producer_phases(marks).items():
                prod.setdefault(name, []).extend(vals)
    print("producer waits for a free slot, us (median / 90th percentile):")
    for name, vals in prod.items():
        if vals:
            vals.sort()
            print(f"  {name:10s} {statistics.median(vals) / 1000:8.3f} / {vals[int(0.9 * (len(vals) - 1))] / 1000:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"spec": spec.name, "grid": list(how.grid), "ms_normal": ms["normal"], "ms_traced": ms["traced"],
                       "events": EVENTS, "trace": {f"{c},{r}": [sm, marks] for (c, r), (sm, marks) in trace.items()}},
                      f)  # fmt: skip
    if a.plot:
        plot(trace, a.plot, a.ctas, spec.name)
    return 0


def plot(trace, path, ctas, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"wait": "#bbbbbb", "S": "#1f77b4", "softmax": "#ff7f0e", "PV": "#2ca02c", "epilogue": "#d62728"}
    keys = sorted(k for k in trace if k[0] < ctas)
    t0 = min(m[0][1] for (_, (_, m)) in trace.items() if m)
    fig, ax = plt.subplots(figsize=(14, 0.4 * len(keys) + 1))
    for y, key in enumerate(keys):
        sm, marks = trace[key]
        for (e0, ta), (e1, tb) in zip(marks, marks[1:]):
            name = EVENTS.get(e1, "")
            color = colors.get(name, colors["wait"] if name in ("Q", "K", "V") or name.startswith("P ") else "#eeeeee")
            ax.barh(y, (tb - ta) / 1000, left=(ta - t0) / 1000, color=color, height=0.8)
    ax.set_yticks(range(len(keys)), [f"CTA {c} {'producer' if r == 0 else f'consumer {r - 1}'} (SM {trace[(c, r)][0]})"
                                     for c, r in keys])  # fmt: skip
    ax.set_xlabel("us since the first mark (bars: the phase that ended at each mark)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
