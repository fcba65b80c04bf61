"""A/B of kernel source trees in one GPU run: the same benchmark points timed on several versions of
cuflash side by side, so a kernel change is judged against its base on the same machine and minute
(runs on different days differ by several percent; see docs/history/hopper.md, session 8).

    python tools/ab_sources.py export main HEAD wip/x --into ab   # here: each git revision's cuflash/ and
                                                                  # cuda_src/ under ab/<name>; the first
                                                                  # is the base of the ratios. ab/ is
                                                                  # git-ignored: name it in the device
                                                                  # tool's carry
    python3 tools/ab_sources.py run ab --op bwd                   # on the GPU machine: every tree, 2 rounds

`run` first compiles each tree's kernels for the points (16 NVRTC processes), then times each tree in
its own Python process (run in ab/<name>, PYTHONPATH too; its own kernel cache .kcache_ab_<name>),
cuflash only (no peers), with cuflash.bench.run_point, in rounds that alternate the trees, and prints
one line per point: TFLOP/s of every tree in every round, then each tree's median ratio to the first
tree. The points: --op fwd or bwd, --head-dim, --seqlen, both causal flags, 16k tokens per batch,
2048 / head_dim heads (the paper grid's shapes). With --varlen, packed batches of 16k tokens and 16 heads
instead (attention_varlen / attention_varlen_backward): each --seqlen is a mean length, timed twice, as
the ragged batch of `cuflash bench --varlen` (bench_varlen.draw_lengths) and as equal lengths ("equal").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
import cuflash
from cuflash import bench
print("MODULE" + cuflash.__file__, flush=True)
points = json.loads(sys.argv[1])

# Packed batches (--varlen): the ragged lengths of `cuflash bench --varlen` and equal ones, 16k tokens, 16 heads
# (imported here: a tree older than cuflash.bench_varlen still runs the dense points).
def varlen_point(op, dtype, hd, causal, mean, name, tokens=16384, heads=16):
    import numpy as np, cupy
    from cuflash.bench_varlen import draw_lengths, pairs
    from cuflash.checks import numpy_dtype

    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((tokens, heads, hd), dtype=cupy.float32).astype(numpy_dtype(dtype))
                   for _ in range(4))
    res = {}
    for kind, lengths in (("ragged", draw_lengths(mean, tokens)), ("equal", [mean] * (tokens // mean))):
        n = sum(lengths)
        qs, ks, vs, ds = (x[:n] for x in (q, k, v, do))
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        mx = max(lengths)
        if op == "fwd":
            fn = lambda: cuflash.attention_varlen(qs, ks, vs, cu, cu, mx, mx, causal=causal)
        else:
            o, lse = cuflash.attention_varlen(qs, ks, vs, cu, cu, mx, mx, causal=causal, return_lse=True)
            fn = lambda: cuflash.attention_varlen_backward(ds, qs, ks, vs, o, lse, cu, cu, mx, mx, causal=causal)
        ms = bench.time_ms({"f": fn}, repeats=10)["f"]
        res[f"{name} {kind}"] = 4.0 * hd * pairs(lengths, causal) * heads * (1.0 if op == "fwd" else 2.5) / (ms * 1e9)
    return res

out = {}
for op, dtype, hd, causal, s, varlen in points:
    name = f"{op} {dtype} hd{hd} {'causal' if causal else 'full'} {s}"
    if not varlen:
        b, h = max(1, 16384 // s), 2048 // hd
        row = bench.run_point(dtype, hd, causal, s, b, h, repeats=10, peers=False, naive_max_gb=0, op=op)
        out[name] = row.tflops["cuflash"]
    else:
        out.update(varlen_point(op, dtype, hd, causal, s, name))
    bench.release_memory()
print("RESULT" + json.dumps(out))
"""

# Before the rounds, each tree compiles the kernels its points run (its plans, both ops' launches) into
# its own cache, 16 NVRTC processes at once, so no timed process waits on a lazy compile one at a time.
WARM = r"""
import inspect, json, sys
from cuflash import jit, plan
points = json.loads(sys.argv[1])
arch, specs = jit.device_arch(0), set()
for op, dtype, hd, causal, s, varlen in points:
    b, h = max(1, 16384 // s), 2048 // hd
    kw = dict(batch=b, seqlen_q=s, seqlen_k=s, nheads=h, nheads_kv=h, head_dim=hd, dtype=dtype, causal=causal,
              aligned=True, arch=arch)
    if varlen:  # (the timed calls compile what they miss: packed plans depend on the lengths drawn)
        continue
    if op == "fwd":
        specs.add(plan.plan_forward(**kw, sm_count=jit.device_sm_count(0), l2_bytes=jit.device_l2_bytes(0)).spec)
    else:
        # (with the SM count where the tree's planner takes it: its persistent backward)
        takes_sm = "sm_count" in inspect.signature(plan.plan_backward).parameters
        bp = plan.plan_backward(**kw, **(dict(sm_count=jit.device_sm_count(0)) if takes_sm else {}))
        specs.update(x.spec for x in (bp.pre, bp.main, bp.convert))
jit.precompile(sorted(specs, key=lambda x: x.name), jobs=16)
print(f"warm: {len(specs)} kernels", file=sys.stderr)
"""


def export(revs: list[str], into: str) -> None:
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    for rev in revs:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
        dest = root / into / name
        if dest.exists():
            sys.exit(f"{dest} exists: remove it first")
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", rev, "cuflash", "cuda_src"], cwd=root, capture_output=True,
                                 check=True).stdout  # fmt: skip
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
        print(f"{rev} -> {dest}")
    order = root / into / "order.txt"  # run's default: the trees in the order exported, the first the base
    names = order.read_text().split() if order.exists() else []
    order.write_text("\n".join(names + [re.sub(r"[^A-Za-z0-9_.-]", "_", r) for r in revs]) + "\n")
    if not (root / into).resolve().is_relative_to(root):
        print(f"note: {into} is outside the repository: the device tool cannot carry it")
    elif subprocess.run(["git", "check-ignore", "-q", into], cwd=root).returncode == 0:
        print(f"note: {into} is git-ignored: name it in the device tool's carry")


def run(folder: str, trees: list[str], points: list, rounds: int) -> int:
    order = Path(folder, "order.txt")
    trees = trees or (order.read_text().split() if order.exists() else
                      sorted(p.name for p in Path(folder).iterdir() if (p / "cuflash").is_dir()))  # fmt: skip
    if not trees:
        sys.exit(f"no source trees under {folder} (tools/ab_sources.py export first)")

    def env_of(name: str, tree: Path) -> dict:
        return dict(os.environ, PYTHONPATH=str(tree), CUFLASH_CACHE_DIR=str(Path(f".kcache_ab_{name}").resolve()))

    for name in trees:  # (a tree whose planner differs still runs: its timed processes then compile lazily)
        tree = Path(folder, name).resolve()
        warm = subprocess.run([sys.executable, "-c", WARM, json.dumps(points)], env=env_of(name, tree),
                              capture_output=True, text=True, cwd=tree)  # fmt: skip
        print(f"{name}: {warm.stderr.strip().splitlines()[-1] if warm.stderr.strip() else 'warm: no output'}",
              file=sys.stderr, flush=True)  # fmt: skip
    results: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for name in trees if rnd % 2 == 0 else trees[::-1]:
            tree = Path(folder, name).resolve()
            env = env_of(name, tree)
            # cwd = the tree: `python -c` puts the current directory first on sys.path, ahead of PYTHONPATH,
            # so from the repository root every child would import the checkout's cuflash
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(points)], env=env, capture_output=True,
                                  text=True, cwd=tree)  # fmt: skip
            module = [x[6:] for x in proc.stdout.splitlines() if x.startswith("MODULE")]
            if module and not Path(module[0]).resolve().is_relative_to(tree):
                sys.exit(f"{name}: imported {module[0]}, not the tree's cuflash")
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
            if not line:
                print(f"{name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
                continue
            for point, tflops in json.loads(line[0][6:]).items():
                results.setdefault(point, {}).setdefault(name, []).append(tflops)
            print(f"round {rnd + 1}: {name} done", file=sys.stderr, flush=True)
    width = max(14, *(len(t) for t in trees))
    print(f"{'point':32} " + " ".join(f"{t:>{width}}" for t in trees))
    ratios: dict[str, list[float]] = {t: [] for t in trees}
    for point, per_tree in results.items():
        cells = ["/".join(f"{x:.0f}" for x in per_tree.get(t, [])) for t in trees]
        print(f"{point:32} " + " ".join(f"{c:>{width}}" for c in cells))
        base = per_tree.get(trees[0])
        for t in trees:
            if base and per_tree.get(t):
                ratios[t].append(statistics.median(per_tree[t]) / statistics.median(base))
    print(f"{'median ratio to ' + trees[0]:32} " + " ".join(
        f"{statistics.median(ratios[t]) if ratios[t] else float('nan'):>{width}.3f}" for t in trees))  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write each git revision's cuflash/ and cuda_src/ under --into")
    ex.add_argument("revs", nargs="+")
    ex.add_argument("--into", default="ab")
    rn = sub.add_parser("run", help="time every tree under FOLDER (on the GPU machine)")
    rn.add_argument("folder")
    rn.add_argument("--trees", nargs="*", default=[],
                    help="names under FOLDER, the base first (default: the export order, FOLDER/order.txt)")
    rn.add_argument("--op", choices=("fwd", "bwd"), default="bwd")
    rn.add_argument("--dtype", default="bf16")
    rn.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    rn.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    rn.add_argument("--rounds", type=int, default=2)
    rn.add_argument("--varlen", action="store_true", help="packed batches: each --seqlen a mean length (ragged, equal)")
    a = ap.parse_args()
    if a.cmd == "export":
        export(a.revs, a.into)
        return 0
    points = [(a.op, a.dtype, hd, causal, s, a.varlen) for hd in a.head_dim for causal in (False, True) for s in a.seqlen]
    return run(a.folder, a.trees, points, a.rounds)


if __name__ == "__main__":
    raise SystemExit(main())
