"""Fingerprint of the planner over a fixed sweep of inputs, to prove that a change which only moves
code plans every call as before. Pure Python, no GPU.

    python tools/plan_digest.py --out before.txt     # on the old tree
    python tools/plan_digest.py --out after.txt      # on the new tree
    cmp before.txt after.txt

Each line is one call of plan_forward / plan_backward / plan_decode (a deterministic sample of
batch, lengths, heads, head dims, dtypes, flags, split counts, CTAs per SM, SM counts and archs):
its arguments, then the repr of the plan it returned (with each launch's variant name, template
arguments, threads, CTAs per SM and shared memory), or the error it raised. The last line is the
SHA-256 of all the others.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import random
import sys

from cuflash import plan

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100")
HEAD_DIMS = (1, 8, 16, 31, 32, 33, 48, 64, 72, 80, 96, 100, 128, 129, 160, 192, 200, 224, 256)


def _launch_facts(obj) -> str:
    """Every Launch inside ``obj`` (a Launch or a plan) with the derived facts of its spec."""
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, plan.Launch):
            s = v.spec
            out.append(f"{f.name}:{s.name}|{s.template_args()}|{s.threads}|{s.min_blocks}|{s.smem_bytes}")
    if isinstance(obj, plan.Launch):
        s = obj.spec
        out.append(f"{s.name}|{s.template_args()}|{s.threads}|{s.min_blocks}|{s.smem_bytes}")
    return " ".join(out)


def _call(fn, kw) -> str:
    call = kw
    if "ctas_per_sm" in kw and hasattr(plan, "DecodePolicy"):  # the forced CTAs per SM live in the policy now
        call = {k: v for k, v in kw.items() if k != "ctas_per_sm"}
        call["policy"] = plan.DecodePolicy(ctas_per_sm=kw["ctas_per_sm"])
    try:
        p = fn(**call)
    except (ValueError, TypeError) as exc:
        return f"{fn.__name__} {sorted(kw.items())} -> {type(exc).__name__}: {exc}"
    return f"{fn.__name__} {sorted(kw.items())} -> {p!r} {_launch_facts(p)}"


def lines():
    for arch, d, dt, causal, aligned, (b, sq, sk), (h, hk) in itertools.product(
        ARCHS, HEAD_DIMS, plan.DTYPES, (False, True), (False, True),
        ((1, 1, 1), (2, 100, 1000), (3, 4097, 333)), ((16, 16), (32, 8)),
    ):
        kw = dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hk, head_dim=d, dtype=dt, causal=causal,
                  aligned=aligned, arch=arch)
        yield _call(plan.plan_forward, kw)
        for det in (False, True):
            yield _call(plan.plan_backward, dict(kw, deterministic=det))
    rng = random.Random(0)
    space = dict(
        batch=(1, 2, 3, 8, 16, 33, 64, 100, 128, 200, 250, 400), seqlen_q=(1, 2, 4, 8, 16),
        heads=((32, 32), (32, 8), (32, 1), (8, 8), (64, 8), (16, 2), (40, 8)),
        head_dim=(32, 64, 80, 96, 128, 160, 200, 256), dtype=plan.DTYPES, aligned=(True, False),
        max_seqlen=(0, 64, 1000, 2048, 3072, 4096, 6144, 8192, 16384, 32768, 65536, 131072),
        num_splits=(0, 0, 0, 1, 5, 200), num_sms=(108, 132), arch=("sm_80", "sm_90a", "sm_89"),
        seqlen_new=(0, 1, 3), append_aligned=(False, True), ctas_per_sm=(0, 0, 1, 2, 3),
        uniform_lengths=(False, True, True),
    )
    for _ in range(60000):
        kw = {k: rng.choice(v) for k, v in space.items()}
        kw["nheads"], kw["nheads_kv"] = kw.pop("heads")
        yield _call(plan.plan_decode, kw)
    # The grids the plan picks itself (one length for all, hd128 on Hopper): filled, tail-split, deep, unsplit wave.
    for b, (h, hk), L, sq in itertools.product(range(1, 401, 3), ((32, 32), (32, 8), (32, 4), (32, 1), (16, 16)),
                                               (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768, 65536,
                                                131072), (1, 4)):
        yield _call(plan.plan_decode, dict(batch=b, seqlen_q=sq, nheads=h, nheads_kv=hk, head_dim=128, dtype="bf16",
                                           aligned=True, max_seqlen=L, num_splits=0, num_sms=132, arch="sm_90a",
                                           uniform_lengths=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    h = hashlib.sha256()
    n = 0
    with open(a.out, "w") as f:
        for line in lines():
            f.write(line + "\n")
            h.update(line.encode() + b"\n")
            n += 1
        f.write(f"{n} calls sha256 {h.hexdigest()}\n")
    print(f"{n} calls sha256 {h.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
