"""End-to-end benchmark, as the FlashAttention-2 paper measures it: GPT-style models trained for a few
steps, and a prefill + greedy decode run, with cuflash, SDPA's FlashAttention-2 and SDPA's cuDNN as
the attention of the same model, in one run on one GPU (``cuflash bench --e2e``).

Model (GPT-2 / GPT-3 style, the paper's configurations): token and learned position embeddings,
pre-LayerNorm blocks (fused qkv projection with bias, causal attention, output projection, GELU MLP
of 4 x hidden), final LayerNorm, LM head tied to the token embedding, vocabulary 50304 (GPT-2's,
padded to a multiple of 64). gpt-1.3b: 24 layers, hidden 2048, 16 heads; gpt-2.7b: 32 layers,
hidden 2560, 20 heads (head dim 128 for both). Parameters, activations and AdamW state in bfloat16.

Only the attention call differs between implementations:
  cuflash  cuflash.torch.flash_attn_qkvpacked_func on the projection's (batch, seqlen, 3, heads, d) view
  flash    torch SDPA restricted to its FlashAttention-2 backend, on (batch, heads, seqlen, d) views
  cudnn    torch SDPA restricted to its cuDNN backend, same views
Same initial weights (one seed), same batches, same optimizer. Training: --tokens tokens per step
(batch = tokens // context), 3 warm-up steps then --repeats timed steps; tokens/s over the timed
steps, model TFLOP/s by Megatron-LM's count without recomputation (72 B s L h^2 (1 + s / 6h + V /
12 L h) per step: the full attention matrix is counted, as in the paper), peak memory
(torch.cuda.max_memory_allocated over the timed steps: cuflash's buffers come from torch's
allocator, so they count), and the loss of every step. With --compile (default), cuflash's model
is also timed with each block under torch.compile(fullgraph=True). Inference: a prompt of context -
64 tokens, batch tokens // context, then 64 greedy tokens with a KV cache (the last one at position
context - 2); prefill and decode
tokens/s apart (cuflash decodes with flash_attn_with_kvcache appending in place; SDPA reads a
preallocated cache through views).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

from .bench import environment, grouped_bars, ratio_summary

MODELS = {"gpt-1.3b": (24, 2048, 16), "gpt-2.7b": (32, 2560, 20)}  # layers, hidden, heads
CONTEXTS = (2048, 8192)
VOCAB = 50304
IMPLS = ("cuflash", "flash", "cudnn")
WARMUP = 3
DECODE_TOKENS = 64
FLOP_MODEL = "72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per training step (Megatron-LM, no recomputation)"


@dataclass
class Run:
    model: str
    context: int
    batch: int
    impl: str  # cuflash / flash / cudnn, "+compile" for the compiled model
    kind: str = "train"  # train / infer
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    peak_gb: float = float("nan")
    step_ms: float = float("nan")
    losses: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # inference: the first greedy tokens of row 0
    prefill_tokens_per_s: float = float("nan")
    decode_tokens_per_s: float = float("nan")
    note: str = ""


def step_flops(layers: int, hidden: int, context: int, batch: int, vocab: int = VOCAB) -> float:
    return 72 * batch * context * layers * hidden**2 * (1 + context / (6 * hidden) + vocab / (12 * layers * hidden))


def _sdpa_backend(impl: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]


def _attention(torch, impl: str):
    """attend(qkv (b, s, 3, h, d), causal) -> (b, s, h, d) of one implementation."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if impl == "cuflash":
        from .torch import flash_attn_qkvpacked_func

        return lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True)
    backend = _sdpa_backend(impl)

    def attend(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    return attend


def build_model(torch, layers: int, hidden: int, heads: int, context: int, impl: str, seed: int = 0):
    nn = torch.nn
    attend = _attention(torch, impl)
    head_dim = hidden // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, _ = x.shape
            y = attend(self.qkv(self.ln1(x)).view(b, s, 3, heads, head_dim))
            x = x + self.proj(y.reshape(b, s, hidden))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(context, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(hidden)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x) @ self.tok.weight.t()

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = GPT()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    return model.to(torch.bfloat16)


def _batches(torch, steps: int, batch: int, context: int, seed: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, context + 1), device="cuda", generator=gen) for _ in range(steps)]


def train(torch, model_name: str, context: int, tokens: int, impl: str, steps: int, compiled: bool = False) -> Run:
    layers, hidden, heads = MODELS[model_name]
    batch = max(1, tokens // context)
    run = Run(model_name, context, batch, impl + ("+compile" if compiled else ""))
    model = build_model(torch, layers, hidden, heads, context, impl)
    if compiled:
        for blk in model.blocks:
            blk.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    data = _batches(torch, WARMUP + steps, batch, context)

    def step(ids):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step(ids) for ids in data[:WARMUP]]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses += [step(ids) for ids in data[WARMUP:]]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    run.peak_gb = torch.cuda.max_memory_allocated() / 2**30
    run.losses = [float(x) for x in losses]
    run.step_ms = elapsed / steps * 1e3
    run.tokens_per_s = steps * batch * context / elapsed
    run.tflops = steps * step_flops(layers, hidden, context, batch) / elapsed / 1e12
    return run


def infer(torch, model_name: str, context: int, tokens: int, impl: str, new_tokens: int = DECODE_TOKENS) -> Run:
    """Prefill a prompt of ``context - new_tokens`` tokens, then ``new_tokens`` greedy steps with a KV cache."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    layers, hidden, heads = MODELS[model_name]
    head_dim = hidden // heads
    batch = max(1, tokens // context)
    run = Run(model_name, context, batch, impl, kind="infer")
    model = build_model(torch, layers, hidden, heads, context, impl).eval()
    prompt = context - new_tokens
    ids = _batches(torch, 1, batch, prompt - 1, seed=2)[0]
    shape = (batch, context, heads, head_dim) if impl == "cuflash" else (batch, heads, context, head_dim)
    caches = [(torch.empty(shape, device="cuda", dtype=torch.bfloat16), torch.empty(shape, device="cuda",
              dtype=torch.bfloat16)) for _ in range(layers)]  # fmt: skip
    backend = None if impl == "cuflash" else _sdpa_backend(impl)
    if impl == "cuflash":
        from .torch import flash_attn_func, flash_attn_with_kvcache

    def attend(layer: int, qkv, pos: int):
        kc, vc = caches[layer]
        s = qkv.shape[1]
        if impl == "cuflash":
            q, k, v = qkv.unbind(2)
            if pos == 0:  # prefill: attention over the prompt, then the prompt's k, v into the cache
                kc[:, :s], vc[:, :s] = k, v
                return flash_attn_func(q, k, v, causal=True)
            return flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=pos, causal=True)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        kc[:, :, pos:pos + s], vc[:, :, pos:pos + s] = k, v
        with sdpa_kernel([backend]):
            if pos == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, kc[:, :, :pos + s], vc[:, :, :pos + s])
        return out.transpose(1, 2)

    def forward(ids, pos: int):
        b, s = ids.shape
        x = model.tok(ids) + model.pos(torch.arange(pos, pos + s, device="cuda"))
        for i, blk in enumerate(model.blocks):
            y = attend(i, blk.qkv(blk.ln1(x)).view(b, s, 3, heads, head_dim), pos)
            x = x + blk.proj(y.reshape(b, s, hidden))
            x = x + blk.out(F.gelu(blk.fc(blk.ln2(x)), approximate="tanh"))
        return model.ln(x[:, -1]) @ model.tok.weight.t()

    with torch.no_grad():
        for _ in range(2):  # warm-up: kernels compiled, allocator primed
            tok = forward(ids, 0).argmax(-1)
            forward(tok[:, None], ids.shape[1])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tok = forward(ids, 0).argmax(-1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pos = ids.shape[1]
        out = [tok]
        for _ in range(new_tokens - 1):
            tok = forward(tok[:, None], pos).argmax(-1)
            out.append(tok)
            pos += 1
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    run.prefill_tokens_per_s = batch * ids.shape[1] / (t1 - t0)
    run.decode_tokens_per_s = batch * (new_tokens - 1) / (t2 - t1)
    run.tokens = torch.stack(out, 1)[0, :16].tolist()  # the first greedy tokens of row 0, to compare
    return run


def _release(torch):
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def format_table(runs: list[Run], env: dict) -> str:
    lines = [f"# E2E GPT, {env['gpu']}, torch {env.get('torch')}, cuflash {env['cuflash']}, {env['date']}",
             f"# ratio = cuflash tokens/s / this implementation's (compiled: / eager cuflash); {FLOP_MODEL}", "",
             "training:", f"{'model':9} {'ctx':>5} {'batch':>5} {'impl':16} {'tok/s':>9} {'TFLOP/s':>8} {'peak GB':>8} "
             f"{'ms/step':>8} {'ratio':>7}  loss first -> last"]  # fmt: skip
    groups = {}
    for r in runs:
        if r.kind == "train":
            groups.setdefault((r.model, r.context), {})[r.impl] = r
    ratios = {"flash": [], "cudnn": []}
    for (model, ctx), group in groups.items():
        ours = group.get("cuflash")
        ours_ok = ours is not None and not ours.note
        for impl, r in group.items():
            if r.note:
                lines.append(f"{model:9} {ctx:5} {r.batch:5} {impl:16} n/a: {r.note}")
                continue
            rel = ""
            if ours_ok and impl in ratios:
                ratios[impl].append(ours.tokens_per_s / r.tokens_per_s)
                rel = f"{ratios[impl][-1]:7.3f}"
            elif ours_ok and impl == "cuflash+compile":
                rel = f"{r.tokens_per_s / ours.tokens_per_s:7.3f}"
            loss = f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}" if r.losses else ""
            lines.append(f"{model:9} {ctx:5} {r.batch:5} {impl:16} {r.tokens_per_s:9.0f} {r.tflops:8.1f} "
                         f"{r.peak_gb:8.1f} {r.step_ms:8.1f} {rel:>7}  {loss}")  # fmt: skip
    for impl, rs in ratios.items():
        if rs:
            lines.append(ratio_summary(f"cuflash / SDPA {impl} training tokens/s", rs, "configurations"))
    infer_runs = [r for r in runs if r.kind == "infer"]
    if infer_runs:
        lines += ["", f"inference (prefill of context - {DECODE_TOKENS} tokens, then {DECODE_TOKENS} greedy tokens):",
                  f"{'model':9} {'ctx':>5} {'batch':>5} {'impl':8} {'prefill tok/s':>14} {'decode tok/s':>13}"]  # fmt: skip
        for r in infer_runs:
            if r.note:
                lines.append(f"{r.model:9} {r.context:5} {r.batch:5} {r.impl:8} n/a: {r.note}")
            else:
                lines.append(f"{r.model:9} {r.context:5} {r.batch:5} {r.impl:8} {r.prefill_tokens_per_s:14.0f} "
                             f"{r.decode_tokens_per_s:13.0f}")  # fmt: skip
    return "\n".join(lines)


def plot(runs: list[Run], env: dict, path: str) -> None:
    """Tokens/s bars per (model, context) and the loss curves of each training configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_runs = [r for r in runs if r.kind == "train" and not r.note]
    keys = sorted({(r.model, r.context) for r in train_runs})
    impls = [i for i in (*IMPLS, "cuflash+compile") if any(r.impl == i for r in train_runs)]
    points = [(f"{m}\n{c // 1024}k", {r.impl: r.tokens_per_s / 1e3 for r in train_runs if (r.model, r.context) == (m, c)})
              for m, c in keys]  # fmt: skip
    bars_path = path
    grouped_bars([("training throughput (k tokens/s)", points)], impls,
                 f"GPT training, {env['gpu']}, {env['date'][:10]}", "k tokens/s", bars_path, digits=1)  # fmt: skip
    loss_path = path.rsplit(".", 1)[0] + "-loss." + path.rsplit(".", 1)[-1]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(3.6 * max(1, len(keys)), 3.0), squeeze=False)
    for ax, (m, c) in zip(axes.flat, keys):
        for r in train_runs:
            if (r.model, r.context) == (m, c):
                ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.impl, marker=".")
        ax.set_title(f"{m} {c // 1024}k", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(loss_path, dpi=130)
    plt.close(fig)


def cli_main(models=tuple(MODELS), contexts=CONTEXTS, tokens: int = 16384, repeats: int = 5, peers: bool = True,
             compile_model: bool = True, inference: bool = True, json_path=None, plot_path=None, echo=None):  # fmt: skip
    import json

    import torch

    echo = echo or (lambda msg, err=False: print(msg, file=sys.stderr if err else sys.stdout, flush=True))
    env = environment()
    env["flop_model"] = FLOP_MODEL
    impls = IMPLS if peers else ("cuflash",)
    runs = []
    jobs = [("train", m, c, i) for m in models for c in contexts for i in impls]
    if compile_model:
        jobs.append(("compile", models[0], contexts[0], "cuflash"))
    if inference:
        jobs += [("infer", m, c, i) for m in models for c in contexts for i in impls]
    t_start = time.time()
    for n, (kind, m, c, impl) in enumerate(jobs):
        echo(f"[{n + 1}/{len(jobs)}] {kind} {m} context {c} {impl} ({time.time() - t_start:.0f} s)", err=True)
        try:
            if kind == "infer":
                run = infer(torch, m, c, tokens, impl)
            else:
                run = train(torch, m, c, tokens, impl, repeats, compiled=kind == "compile")
        except Exception as exc:  # noqa: BLE001 - a peer without a kernel is a result to report
            run = Run(m, c, max(1, tokens // c), impl + ("+compile" if kind == "compile" else ""),
                      kind="infer" if kind == "infer" else "train",
                      note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")  # fmt: skip
        runs.append(run)
        _release(torch)
    echo(format_table(runs, env))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": "e2e", "environment": env, "runs": [asdict(r) for r in runs]}, f, indent=1)
    if plot_path:
        plot(runs, env, plot_path)
    return runs


def replot(json_path: str, plot_path: str | None = None, echo=None) -> list[Run]:
    import json

    with open(json_path) as f:
        data = json.load(f)
    runs = [Run(**r) for r in data["runs"]]
    (echo or print)(format_table(runs, data["environment"]))
    if plot_path:
        plot(runs, data["environment"], plot_path)
    return runs
