"""Command line: ``cuflash info | precompile | cache list | cache prune | cache clear | bench``.

    cuflash info                                     versions, GPU, arch, kernel cache
    cuflash precompile --arch sm_90a --all -j 8      fill the kernel cache (no GPU needed)
    cuflash cache list                               one line per cached kernel variant
    cuflash cache prune [--max-size 2GiB]            remove entries this installation cannot load
    cuflash cache clear --yes                        empty the kernel cache
    cuflash bench --head-dim 128 --seqlen 4096       forward speed next to the peers

The kernel pipeline (NVRTC, logging) is cuflash/jit.py, the disk cache cuflash/cache.py; this module
only parses options, selects variants through cuflash/plan and prints.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import math
import os
import sys
import time

import click

from . import cache as kcache
from . import jit, plan
from ._version import __version__

#: Values of the three-way causal flag, shared by precompile and bench.
CAUSAL_CHOICES = {"causal": (True,), "no-causal": (False,), "both": (False, True)}
DTYPE_CHOICES = {"fp16": ("fp16",), "bf16": ("bf16",), "both": ("fp16", "bf16")}
#: Kernel families `precompile --kernels` selects, each with the plan function listing its variants.
KERNEL_FAMILIES = plan.ALL_SPECS
#: Options of `cuflash bench` that only --decode reads (they never reach cuflash.bench.cli_main).
DECODE_ONLY_OPTIONS = ("decode", "batch", "kv_heads")
#: Options of `cuflash bench` that only the variant benchmark (--variant, cuflash.bench_variants) reads.
VARIANT_ONLY_OPTIONS = ("variant", "window")
#: The attention variants `cuflash bench --variant` times against their peers.
BENCH_VARIANTS = ("window", "softcap", "alibi", "dropout")
#: Options of `cuflash bench` that only select the varlen benchmark (--varlen, cuflash.bench_varlen).
VARLEN_ONLY_OPTIONS = ("varlen",)
#: Options of `cuflash bench` that only belong to the end-to-end benchmark (--e2e, cuflash.bench_e2e).
E2E_ONLY_OPTIONS = ("e2e", "model", "compile_model", "inference")
#: Options of `cuflash bench` handled here (redrawing a saved run), not by the benchmark modules.
REPLOT_OPTIONS = ("from_json",)
#: The mode flag of `cuflash bench` that saves each kind of --json run (saved_run_kind).
SAVED_RUN_FLAGS = {"prefill": "", "decode": " --decode", "variant": " --variant", "varlen": " --varlen", "e2e": " --e2e"}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _given(ctx, name: str) -> bool:
    """Whether option ``name`` was given on the command line (or by the environment), not defaulted."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def saved_run_kind(path: str) -> str | None:
    """The kind of `cuflash bench --json` run saved at ``path`` (a SAVED_RUN_FLAGS key, told by the
    top-level keys each mode writes), or None where it is none of them."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "environment" not in data:
        return None
    if data.get("benchmark") in ("varlen", "e2e"):
        return data["benchmark"]
    if "decode" in data:
        return "decode"
    if "window_check" in data:
        return "variant"
    return "prefill" if "rows" in data else None


def human_size(n: int) -> str:
    """Bytes as a short human-readable string: 512 B, 3.4 KiB, 1.2 MiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """'2GiB', '500 MB', '1.5G', '123456' -> bytes (binary units for KiB/MiB/GiB and K/M/G)."""
    t = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1024**3, "gb": 1000**3, "gib": 1024**3}  # fmt: skip
    num = t.rstrip("bBkKmMgGiI")
    unit = t[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 500MB, 1048576)") from None
    if unit not in units or not math.isfinite(value) or value < 0:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 500MB, 1048576)")
    return int(value * units[unit])


def _format_driver_version(v: int) -> str:
    """cudaDriverGetVersion's 12080 -> '12.8'."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _causal_options(f):
    """--causal / --no-causal / --both-causal (default): one parameter ``causal``."""
    f = click.option("--both-causal", "causal", flag_value="both", default=True, help="Causal and non-causal (default).")(f)
    f = click.option("--no-causal", "causal", flag_value="no-causal", help="Only non-causal attention.")(f)
    f = click.option("--causal", "causal", flag_value="causal", help="Only causal attention.")(f)
    return f


def _normalized(ctx, param, values, normalize):
    """Each value through ``normalize`` (ValueError -> usage error), duplicates removed, order kept."""
    out = []
    for v in values:
        try:
            n = normalize(v)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        if n not in out:
            out.append(n)
    return tuple(out)


def _known_arch(arch: str) -> str:
    """plan.parse_arch, then refused unless this NVRTC can compile for it (where NVRTC says which it can):
    an arch NVRTC does not know fails here, not in the middle of a compile."""
    a = plan.parse_arch(arch)
    try:
        from cupy.cuda import nvrtc

        supported = tuple(nvrtc.getSupportedArchs())
    except Exception:  # noqa: BLE001 - no NVRTC here: parse_arch's list decides alone
        return a
    if plan.arch_number(a) not in supported:
        major, minor = nvrtc.getVersion()
        known = ", ".join(plan.parse_arch(f"sm_{n}") for n in supported if n in plan.KNOWN_ARCHS) or "none"
        raise ValueError(f"NVRTC {major}.{minor} cannot compile for {a} (of cuflash's targets it knows {known})")
    return a


def _parse_archs(ctx, param, values):
    """Each --arch through _known_arch: known targets only (sm_90 means sm_90a)."""
    return _normalized(ctx, param, values, _known_arch)


def _parse_head_dims(ctx, param, values):
    """Head dims 1..256 -> their buckets."""
    return _normalized(ctx, param, values, plan.head_dim_bucket)


@contextlib.contextmanager
def _progress(total: int, label: str, every_s: float = 10.0):
    """A step() to call once per finished item: a progress bar on a terminal; elsewhere (CI logs, image
    builds), where click's bar would stay silent until the end, a line at the first item, then at most
    one every ``every_s`` seconds, and at the last."""
    if sys.stderr.isatty():
        with click.progressbar(length=total, label=label, show_pos=True, file=sys.stderr) as bar:
            yield lambda: bar.update(1)
        return
    t0 = time.perf_counter()
    state = {"done": 0, "shown": -every_s}

    def step():
        state["done"] += 1
        now = time.perf_counter() - t0
        if state["done"] in (1, total) or now - state["shown"] >= every_s:
            state["shown"] = now
            click.echo(f"{label}: {state['done']}/{total} ({now:.0f} s)", err=True)

    yield step


@contextlib.contextmanager
def _quiet_compile_log(quiet: bool):
    """Silence jit's per-compile INFO lines (here and in spawned workers) while a progress bar runs."""
    if not quiet:
        yield
        return
    old_level = jit.logger.level
    old_env = os.environ.get("CUFLASH_LOG_LEVEL")
    jit.logger.setLevel(logging.WARNING)
    os.environ["CUFLASH_LOG_LEVEL"] = "WARNING"  # read by spawned workers when they import jit
    try:
        yield
    finally:
        jit.logger.setLevel(old_level)
        if old_env is None:
            os.environ.pop("CUFLASH_LOG_LEVEL", None)
        else:
            os.environ["CUFLASH_LOG_LEVEL"] = old_env


def _table(rows: list[tuple], header: tuple) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(r) for r in rows)]


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cuflash")
def main():
    """cuflash: FlashAttention-2 on CuPy, kernels compiled at run time by NVRTC."""


@main.command()
def info():
    """Versions, GPUs (and the arch cuflash compiles for), kernel cache."""
    click.echo(f"cuflash        {__version__}")
    try:
        import cupy
    except ImportError:
        cupy = None
        click.echo("CuPy           not installed (pip install 'cuflash[cuda12]' or 'cuflash[cuda13]')")
    else:
        click.echo(f"CuPy           {cupy.__version__}")

    try:
        major, minor = jit.nvrtc_version()
        nvrtc = f"{major}.{minor}"
    except Exception as exc:  # noqa: BLE001 - missing library, missing CuPy: say why
        nvrtc = f"unavailable ({type(exc).__name__}: {exc})"
    click.echo(f"NVRTC          {nvrtc}")

    driver = "none"
    if cupy is not None:
        try:
            v = cupy.cuda.runtime.driverGetVersion()
            if v:
                driver = _format_driver_version(v)
        except Exception:  # noqa: BLE001 - no driver at all
            pass
    click.echo(f"CUDA driver    {driver}")

    gpus = []
    if cupy is not None:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - cudaErrorNoDevice / InsufficientDriver
            count = 0
        for i in range(count):
            try:
                props = cupy.cuda.runtime.getDeviceProperties(i)
                name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
                cc = f"{props['major']}.{props['minor']}"
            except Exception as exc:  # noqa: BLE001
                gpus.append(f"GPU {i}: unavailable ({exc})")
                continue
            try:
                arch = jit.device_arch(i)
            except Exception as exc:  # noqa: BLE001 - older than sm_80
                arch = f"unsupported ({exc})"
            gpus.append(f"GPU {i}          {name}, compute capability {cc}, kernels for {arch}")
    if gpus:
        for line in gpus:
            click.echo(line)
    else:
        click.echo("GPU            no GPU (kernels can still be compiled: cuflash precompile --arch sm_90a ...)")

    entries = kcache.list_entries()
    damaged = sum(e.header is None for e in entries)
    total = sum(e.size for e in entries)
    extra = f", {damaged} damaged" if damaged else ""
    click.echo(f"Kernel cache   {kcache.cache_dir()}")
    click.echo(f"               {len(entries)} entries, {human_size(total)}{extra}")


@main.command()
@click.option("--arch", "archs", multiple=True, callback=_parse_archs, metavar="ARCH",
              help="Target GPU arch (repeatable): sm_80 (A100), sm_86, sm_87, sm_89 (L4, RTX 40xx), sm_90a "
                   "(H100, H200; sm_90 means sm_90a), sm_100, sm_101, sm_103, sm_110, sm_120, sm_121 (those the "
                   "installed NVRTC knows). Default: the current GPU's.")
@click.option("--head-dim", "head_dims", multiple=True, type=int, callback=_parse_head_dims, metavar="D",
              help="Head dim 1..256, compiled as its bucket (repeatable).")
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="both", show_default=True)
@_causal_options
@click.option("--all", "all_", is_flag=True, help="Every head-dim bucket (narrow with --dtype / --causal).")
@click.option("--kernels", "kernels", multiple=True, type=click.Choice(list(KERNEL_FAMILIES)), metavar="FAMILY",
              help=f"Kernel families to build (repeatable): {', '.join(KERNEL_FAMILIES)}. Default: all of them.")
@click.option("--variant", "variant", multiple=True, type=click.Choice(list(plan.MOD_NAMES.values())),
              help="Build the kernels of this combination of attention variants (repeatable: --variant window "
                   "--variant softcap builds what a model using both calls) instead of the plain ones. A window "
                   "kernel carries causal in its window, so window kernels are built non-causal.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Parallel NVRTC compiles (separate processes).")
@click.option("-v", "--verbose", is_flag=True, help="Log each compile and print registers / spills.")
def precompile(archs, head_dims, dtype, causal, all_, kernels, variant, jobs, verbose):
    """Compile kernels ahead of time into the disk cache, so the first calls on a GPU load instead of
    compiling. Needs no GPU with --arch (e.g. in a container build or CI).

    Both load paths (16-byte vector and element-wise) are built for every selection. Exits non-zero
    if a kernel fails to compile or the cache cannot be written.
    """
    if not archs:
        try:
            archs = (jit.device_arch(0),)
        except Exception as exc:  # noqa: BLE001 - no GPU, no driver, too old a GPU
            raise click.UsageError(
                f"no usable GPU to take the arch from ({type(exc).__name__}: {exc}); "
                "pass the target explicitly, e.g. --arch sm_90a (H100/H200) or --arch sm_80 (A100)"
            ) from None
    if all_ and head_dims:
        raise click.UsageError("--all already selects every head dim; drop --head-dim or --all")
    if not all_ and not head_dims:
        raise click.UsageError("say which kernels to build: --head-dim D (repeatable) or --all")
    dims = plan.HEAD_DIM_BUCKETS if all_ else head_dims

    mods = sum(bit for bit, name in plan.MOD_NAMES.items() if name in variant)
    causals = (False,) if mods & plan.MOD_WINDOW else CAUSAL_CHOICES[causal]
    specs = []
    for arch in archs:
        for family in kernels or KERNEL_FAMILIES:
            specs += KERNEL_FAMILIES[family](
                arch, head_dims=dims, dtypes=DTYPE_CHOICES[dtype], causals=causals, aligned=(True, False), mods=(mods,)
            )
    specs = list(dict.fromkeys(specs))
    if not all(jit.is_cached(s) for s in specs):  # something to compile: the cache must take it (a full,
        try:  # read-only cache, e.g. baked into an image, only reports)
            kcache.check_writable()
        except kcache.CacheWriteError as exc:
            raise click.ClickException(str(exc)) from None

    t0 = time.perf_counter()
    with _quiet_compile_log(not verbose), _progress(len(specs), "Compiling kernels") as step:
        try:
            results = jit.precompile(specs, jobs=jobs, on_done=lambda r: step())
        except (jit.CompileError, kcache.CacheWriteError) as exc:
            raise click.ClickException(str(exc)) from None
    seconds = time.perf_counter() - t0

    compiled = [r for r in results if r[1] == "compiled"]
    n_cached = len(results) - len(compiled)
    if verbose:
        for name, _, header in sorted(compiled):
            p = header.get("ptxas", {})
            click.echo(
                f"  {name}: {p.get('registers', '?')} registers, {p.get('spill_stores', '?')} B spill stores, "
                f"{p.get('spill_loads', '?')} B spill loads, {header.get('compile_seconds', 0):.1f}s"
            )
    click.echo(
        f"{len(results)} variants: {len(compiled)} compiled, {n_cached} already cached, "
        f"{seconds:.1f}s, cache {kcache.cache_dir()}"
    )
    # ptxas's notes that a variant's wgmma lost their asynchrony (jit._WGMMA_NOTES): correct kernels that run
    # 20% and more slower, worth a line whatever --verbose says (a new NVRTC may start drawing them)
    serialized = sorted(name for name, _, header in results
                        if any(k.startswith("wgmma_") for k in header.get("ptxas", {})))  # fmt: skip
    if serialized:
        click.echo(f"warning: ptxas serialized the wgmma of {len(serialized)} variant(s) (C7513 / C7515 / C7517: "
                   f"correct, slower): {', '.join(serialized[:5])}{' ...' if len(serialized) > 5 else ''}", err=True)


@main.group()
def cache():
    """Inspect, prune or empty the kernel cache (CUFLASH_CACHE_DIR, default $XDG_CACHE_HOME/cuflash, else ~/.cache/cuflash)."""


@cache.command("list")
def cache_list():
    """One line per cache entry: variant, arch, registers, spills, size, NVRTC version."""
    entries = kcache.list_entries()
    d = kcache.cache_dir()
    if not entries:
        click.echo(f"The kernel cache is empty ({d}).")
        return
    rows = []
    for e in entries:
        if e.header is None:
            rows.append((e.path.name, "DAMAGED", "", "", human_size(e.size), e.error or ""))
            continue
        h = e.header
        p = h.get("ptxas", {})
        # Spill bytes come from ptxas's -v report, absent when NVRTC served the program from its cache.
        spills = p["spill_stores"] + p["spill_loads"] if "spill_stores" in p and "spill_loads" in p else "?"
        nvrtc = ".".join(str(x) for x in h.get("nvrtc", [])) or "?"
        rows.append((h.get("name", e.path.name), h.get("arch", "?"), p.get("registers", "?"), spills,
                     human_size(e.size), nvrtc))
    for line in _table(rows, ("variant", "arch", "regs", "spill B", "size", "nvrtc")):
        click.echo(line)
    damaged = sum(e.header is None for e in entries)
    total = human_size(sum(e.size for e in entries))
    click.echo(f"{len(entries)} entries ({damaged} damaged), {total}, in {d}")


@cache.command("prune")
@click.option("--max-size", "max_size", default=None, metavar="SIZE",
              help="Then keep only the most recently used entries that fit in SIZE, e.g. 2GiB.")
@click.option("-v", "--verbose", is_flag=True, help="List each removed file and why.")
def cache_prune(max_size, verbose):
    """Remove the entries this installation can never load again: damaged ones, ones built by another
    cuflash or NVRTC version (in a folder several environments share, those of the others too), and
    temporary files of interrupted compiles."""
    try:
        max_bytes = None if max_size is None else parse_size(max_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-size") from None
    try:
        nvrtc = jit.nvrtc_version()
    except Exception:  # noqa: BLE001 - no NVRTC here: keep entries of every NVRTC version
        nvrtc = None
    r = kcache.prune(version=__version__, nvrtc=nvrtc, max_bytes=max_bytes)
    if verbose:
        for name, why in r.removed:
            click.echo(f"  removed {name}: {why}")
    click.echo(
        f"Removed {len(r.removed)} file{'s' if len(r.removed) != 1 else ''} ({human_size(r.freed_bytes)}); "
        f"kept {r.kept} entries ({human_size(r.kept_bytes)}) in {kcache.cache_dir()}."
    )


@cache.command("clear")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Delete every cached kernel."""
    d = kcache.cache_dir()
    if not yes:
        click.confirm(f"Delete every cached kernel in {d}?", abort=True)
    n = kcache.clear()
    click.echo(f"Removed {n} file{'s' if n != 1 else ''} from {d}.")


def gpu_problem() -> str | None:
    """Why no CUDA GPU can run kernels here (None: one can)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU is visible"
        jit.device_arch(cupy.cuda.Device().id)
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no device, too old a GPU: say which
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return None


def plot_problem(path: str) -> str | None:
    """Why --plot PATH cannot be drawn (None: it can): matplotlib missing, or a folder that is not there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'cuflash[plot]'"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path}: the folder {folder} does not exist"
    return None


@main.command()
@click.option("--head-dim", multiple=True, type=int, default=(64, 128, 256), show_default=True,
              help="Head dims (repeatable); --decode: default 128.")
@click.option("--seqlen", multiple=True, type=int, default=(512, 1024, 2048, 4096, 8192, 16384), show_default=True,
              help="Sequence lengths (repeatable); --decode: cache lengths, default 4k..128k.")
@click.option("--tokens", type=int, default=16384, show_default=True, help="Prefill: batch = tokens // seqlen.")
@click.option("--hidden", type=int, default=2048, show_default=True, help="Prefill: nheads = hidden // headdim.")
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="bf16", show_default=True)
@_causal_options
@click.option("--op", type=click.Choice(["fwd", "bwd", "fwd+bwd", "all"]), default="fwd", show_default=True,
              help="Prefill: forward, backward alone, forward+backward, or all three.")
@click.option("--repeats", type=int, default=30, show_default=True, help="Timed runs per point (median).")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also time torch SDPA FlashAttention-2 and cuDNN (needs torch).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a figure, grouped bars per shape (needs matplotlib: the plot extra).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Print the table of a saved --json run of any mode, told from the file (and draw --plot; an "
                   "explicit --op picks one operation of a prefill run) instead of running: no GPU needed.")
@click.option("--decode", is_flag=True,
              help="Decode with a KV cache instead: one query token against caches of --seqlen tokens, KV bytes "
                   "read per second.")
@click.option("--batch", "batch", multiple=True, type=int, help="--decode: batch sizes (default 1, 8, 64).")
@click.option("--kv-heads", "kv_heads", multiple=True, type=int,
              help="--decode: kv heads next to 32 query heads (default 32 and 8).")
@click.option("--variant", "variant", multiple=True, type=click.Choice([*BENCH_VARIANTS, "all"]),
              help="Time an attention variant (repeatable) against the peer that runs it: FlexAttention for "
                   "window / softcap / alibi, SDPA FlashAttention-2 for dropout (--op fwd, bwd or all).")
@click.option("--window", "window", type=int, default=1024, show_default=True,
              help="--variant window: keys of the causal sliding window.")
@click.option("--varlen", is_flag=True,
              help="Packed variable-length batches instead: --tokens tokens of sequences with lengths uniform in "
                   "[1, 2 x mean] for each mean given by --seqlen (default 512..8k), against cuflash on an even batch "
                   "and FlexAttention with a document mask (--op fwd, bwd or all).")
@click.option("--e2e", is_flag=True,
              help="End to end, as the FA2 paper: GPT models trained for a few steps (--repeats timed steps, "
                   "--tokens per step, contexts from --seqlen, default 2k and 8k) and a prefill + greedy decode run, "
                   "with cuflash, SDPA FlashAttention-2 and SDPA cuDNN as the model's attention (needs torch).")
@click.option("--model", "model", multiple=True, type=click.Choice(["gpt-1.3b", "gpt-2.7b"]),
              help="--e2e: the GPT configurations (default both).")
@click.option("--compile/--no-compile", "compile_model", default=True, show_default=True,
              help="--e2e: also train cuflash's model with each block under torch.compile (first model, first context).")
@click.option("--inference/--no-inference", "inference", default=True, show_default=True,
              help="--e2e: also time prefill and greedy decode with a KV cache.")
@click.pass_context
def bench(ctx, **options):
    """Time cuflash next to torch's FlashAttention-2 and cuDNN, in one run on the same GPU and inputs,
    and print TFLOP/s (prefill) or KV TB/s (--decode) with the ratios.

    Prefill runs the FlashAttention-2 paper's grid (batch x seqlen = 16k tokens, 2048 hidden, head
    dims 64/128/256, causal and not). Needs a CUDA GPU, except --from-json.
    """
    decode, batch, kv_heads = (options.pop(name) for name in DECODE_ONLY_OPTIONS)
    variant, window = (options.pop(name) for name in VARIANT_ONLY_OPTIONS)
    (varlen,) = (options.pop(name) for name in VARLEN_ONLY_OPTIONS)
    e2e, models, compile_model, inference = (options.pop(name) for name in E2E_ONLY_OPTIONS)
    from_json = options.pop("from_json")
    if from_json is not None and options["json_path"]:
        raise click.UsageError("--from-json redraws a saved run; --json writes a new one: use one of them")
    if from_json is not None:  # a saved run is redrawn by the mode that saved it
        mode = "decode" if decode else "variant" if variant else "varlen" if varlen else "e2e" if e2e else "prefill"
        kind = saved_run_kind(from_json)
        if kind is None:
            raise click.ClickException(f"{from_json} is not a saved `cuflash bench{SAVED_RUN_FLAGS[mode]} --json` run")
        if mode == "prefill" and kind != "prefill":  # no mode flag given: the file's
            decode, varlen, e2e = kind == "decode", kind == "varlen", kind == "e2e"
            variant = ("all",) if kind == "variant" else variant
        elif kind != mode:
            give = f", or give {SAVED_RUN_FLAGS[kind].strip()}" if kind != "prefill" else ""
            raise click.UsageError(f"{from_json} holds a `cuflash bench{SAVED_RUN_FLAGS[kind]} --json` run, not a "
                                   f"`cuflash bench{SAVED_RUN_FLAGS[mode]}` one: leave out the mode flag{give}")  # fmt: skip
    # (what sizes a new run, --window, --op of the modes that time fwd / bwd apart, ..., a redraw ignores)
    replot = from_json is not None
    if e2e and (varlen or decode or variant):
        raise click.UsageError("--e2e trains and runs whole models; it does not combine with --varlen, --decode or --variant")
    if models and not e2e:
        raise click.UsageError("--model applies to --e2e only")
    if not replot and not ({"window", "all"} & set(variant)) and _given(ctx, "window"):
        raise click.UsageError("--window applies to --variant window (or all) only")
    if varlen and (decode or variant):
        raise click.UsageError("--varlen times packed prefill batches; it does not combine with --decode or --variant")
    if not replot and varlen and options["op"] == "fwd+bwd":
        raise click.UsageError("--varlen times --op fwd, bwd or all (forward and backward apart)")
    if not decode and (batch or kv_heads):
        raise click.UsageError("--batch and --kv-heads apply to --decode only")
    if variant and decode:
        raise click.UsageError("--variant times prefill (forward, backward); decode variants are not benchmarked here")
    if not replot and variant and options["op"] == "fwd+bwd":
        raise click.UsageError("--variant times --op fwd, bwd or all (forward and backward apart)")
    module = ("cuflash.bench_decode" if decode else "cuflash.bench_variants" if variant else
              "cuflash.bench_varlen" if varlen else "cuflash.bench_e2e" if e2e else "cuflash.bench")  # fmt: skip
    if options["plot_path"]:  # checked before a run that would end without its figure
        problem = plot_problem(options["plot_path"])
        if problem is not None:
            raise click.UsageError(problem)
    if from_json is None:
        problem = gpu_problem()
        if problem is not None:
            raise click.ClickException(f"cuflash bench needs a CUDA GPU ({problem}); --from-json redraws a saved run")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise click.ClickException(f"the benchmark module {module} could not be imported: {exc}") from None
    if from_json is not None:
        kw = {}
        if not decode and not variant and not varlen and not e2e and _given(ctx, "op") and options["op"] != "all":
            kw["ops"] = (options["op"],)  # an explicit --op picks that operation out of the saved run
        try:
            mod.replot(from_json, options["plot_path"], **kw)
        except (KeyError, TypeError, ValueError) as exc:
            raise click.ClickException(f"{from_json} is not a saved `cuflash bench{SAVED_RUN_FLAGS[mode]} --json` run "
                                       f"({type(exc).__name__}: {exc})") from None
        return
    if decode:
        _bench_decode(ctx, mod, options, batch, kv_heads)
        return
    if variant:
        variants = BENCH_VARIANTS if "all" in variant else tuple(dict.fromkeys(variant))
        mod.cli_main(variants=variants, window=window, **options)
        return
    if e2e:
        given = functools.partial(_given, ctx)
        mod.cli_main(models=models or tuple(mod.MODELS), contexts=options["seqlen"] if given("seqlen") else mod.CONTEXTS,
                     tokens=options["tokens"], repeats=options["repeats"] if given("repeats") else 5,
                     peers=options["peers"], compile_model=compile_model, inference=inference,
                     json_path=options["json_path"], plot_path=options["plot_path"])  # fmt: skip
        return
    if varlen:
        seqlens = options.pop("seqlen")  # the means of the length distribution
        means = seqlens if _given(ctx, "seqlen") else mod.MEANS
        mod.cli_main(means=means, **options)
        return
    mod.cli_main(**options)


def _bench_decode(ctx, mod, options, batch, kv_heads):
    """`cuflash bench --decode`: hand the decode grid to cuflash.bench_decode.cli_main (None = its default)."""
    given = functools.partial(_given, ctx)
    mod.cli_main(
        head_dim=options["head_dim"] if given("head_dim") else None,
        cache_len=options["seqlen"] if given("seqlen") else None,
        batch=batch or None,
        kv_heads=kv_heads or None,
        dtype=options["dtype"],
        repeats=options["repeats"],
        peers=options["peers"],
        json_path=options["json_path"],
        plot_path=options["plot_path"],
    )


if __name__ == "__main__":  # pragma: no cover
    main()
