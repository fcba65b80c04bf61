"""Command line: ``cuflash info | precompile | cache list | cache clear | bench``.

    cuflash info                                     versions, GPU, arch, kernel cache
    cuflash precompile --arch sm_90a --all -j 8      fill the kernel cache (no GPU needed)
    cuflash cache list                               one line per cached kernel variant
    cuflash cache clear --yes                        empty the kernel cache
    cuflash bench --head-dim 128 --seqlen 4096       forward speed next to the peers

The kernel pipeline (cache, NVRTC, logging) is cuflash/jit.py; this module only parses options,
selects variants through cuflash/plan.py and prints.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import time

import click

from . import jit, plan
from ._version import __version__

#: Values of the three-way causal flag, shared by precompile and bench.
CAUSAL_CHOICES = {"causal": (True,), "no-causal": (False,), "both": (False, True)}
DTYPE_CHOICES = {"fp16": ("fp16",), "bf16": ("bf16",), "both": ("fp16", "bf16")}
#: Kernel families `precompile --kernels` selects, each with the plan function listing its variants.
KERNEL_FAMILIES = {"fwd": plan.all_fwd_specs, "bwd": plan.all_bwd_specs, "decode": plan.all_decode_specs}
#: Options of `cuflash bench` that only --decode reads (they never reach cuflash.bench.cli_main).
DECODE_ONLY_OPTIONS = ("decode", "batch", "kv_heads")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def human_size(n: int) -> str:
    """Bytes as a short human-readable string: 512 B, 3.4 KiB, 1.2 MiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


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


def _parse_archs(ctx, param, values):
    return _normalized(ctx, param, values, plan.parse_arch)


def _parse_head_dims(ctx, param, values):
    """Head dims 1..256 -> their buckets."""
    return _normalized(ctx, param, values, plan.head_dim_bucket)


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

    entries = jit.list_cache()
    damaged = sum(e.header is None for e in entries)
    total = sum(e.size for e in entries)
    extra = f", {damaged} damaged" if damaged else ""
    click.echo(f"Kernel cache   {jit.cache_dir()}")
    click.echo(f"               {len(entries)} entries, {human_size(total)}{extra}")


@main.command()
@click.option("--arch", "archs", multiple=True, callback=_parse_archs, metavar="ARCH",
              help="Target arch, e.g. sm_80, sm_86, sm_90a (repeatable). Default: the current GPU's.")
@click.option("--head-dim", "head_dims", multiple=True, type=int, callback=_parse_head_dims, metavar="D",
              help="Head dim 1..256, compiled as its bucket (repeatable).")
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="both", show_default=True)
@_causal_options
@click.option("--all", "all_", is_flag=True, help="Every head-dim bucket (narrow with --dtype / --causal).")
@click.option("--kernels", "kernels", multiple=True, type=click.Choice(list(KERNEL_FAMILIES)), metavar="FAMILY",
              help=f"Kernel families to build (repeatable): {', '.join(KERNEL_FAMILIES)}. Default: all of them.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Parallel NVRTC compiles (separate processes).")
@click.option("-v", "--verbose", is_flag=True, help="Log each compile and print registers / spills.")
def precompile(archs, head_dims, dtype, causal, all_, kernels, jobs, verbose):
    """Compile forward, backward and decode kernel variants into the disk cache (no GPU needed with --arch).

    Both load paths (16-byte vector and element-wise) are built for every selection.
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

    specs = []
    for arch in archs:
        for family in kernels or KERNEL_FAMILIES:
            specs += KERNEL_FAMILIES[family](
                arch, head_dims=dims, dtypes=DTYPE_CHOICES[dtype], causals=CAUSAL_CHOICES[causal], aligned=(True, False)
            )

    t0 = time.perf_counter()
    with _quiet_compile_log(not verbose), click.progressbar(
        length=len(specs), label="Compiling kernels", show_pos=True, file=sys.stderr
    ) as bar:
        try:
            results = jit.precompile(specs, jobs=jobs, on_done=lambda r: bar.update(1))
        except jit.CompileError as exc:
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
        f"{seconds:.1f}s, cache {jit.cache_dir()}"
    )


@main.group()
def cache():
    """Inspect or empty the kernel cache."""


@cache.command("list")
def cache_list():
    """One line per cache entry: variant, arch, registers, spills, size, NVRTC version."""
    entries = jit.list_cache()
    d = jit.cache_dir()
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


@cache.command("clear")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Delete every cached kernel."""
    d = jit.cache_dir()
    if not yes:
        click.confirm(f"Delete every cached kernel in {d}?", abort=True)
    n = jit.clear_cache()
    click.echo(f"Removed {n} file{'s' if n != 1 else ''} from {d}.")


@main.command()
@click.option("--head-dim", multiple=True, type=int, default=(64, 128, 256), show_default=True)
@click.option("--seqlen", multiple=True, type=int, default=(512, 1024, 2048, 4096, 8192, 16384), show_default=True)
@click.option("--tokens", type=int, default=16384, show_default=True, help="batch = tokens // seqlen.")
@click.option("--hidden", type=int, default=2048, show_default=True, help="nheads = hidden // headdim.")
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="bf16", show_default=True)
@_causal_options
@click.option("--op", type=click.Choice(["fwd", "bwd", "fwd+bwd", "all"]), default="fwd", show_default=True,
              help="Forward, backward alone, forward+backward, or all three.")
@click.option("--repeats", type=int, default=30, show_default=True, help="Timed runs per point (median).")
@click.option("--peers/--no-peers", default=True, show_default=True, help="Also time torch SDPA FA2 and cuDNN.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a plot (needs matplotlib).")
@click.option("--decode", is_flag=True,
              help="Decode with a KV cache instead (cuflash.bench_decode): one query token against caches of "
                   "--seqlen tokens (default 4k..128k), head dim 128 unless --head-dim; reads --dtype, --repeats, "
                   "--peers, --json.")
@click.option("--batch", "batch", multiple=True, type=int, help="--decode: batch sizes (default 1, 8, 64).")
@click.option("--kv-heads", "kv_heads", multiple=True, type=int,
              help="--decode: kv heads next to 32 query heads (default 32 and 8).")
@click.pass_context
def bench(ctx, **options):
    """Prefill speed (forward, backward) on the FA2 paper's grid, side by side with the peers.

    The options reach cuflash.bench.cli_main as keywords: ``causal`` is "causal", "no-causal" or
    "both"; ``dtype`` is "fp16", "bf16" or "both"; --json / --plot are ``json_path`` / ``plot_path``.
    """
    decode, batch, kv_heads = (options.pop(name) for name in DECODE_ONLY_OPTIONS)
    if decode:
        _bench_decode(ctx, options, batch, kv_heads)
        return
    if batch or kv_heads:
        raise click.UsageError("--batch and --kv-heads apply to --decode only")
    try:
        bench_mod = importlib.import_module("cuflash.bench")
    except ImportError as exc:
        raise click.ClickException(f"the benchmark module cuflash.bench could not be imported: {exc}") from None
    if not hasattr(bench_mod, "cli_main"):
        raise click.ClickException("cuflash.bench has no cli_main(); the installation is incomplete")
    bench_mod.cli_main(**options)


def _bench_decode(ctx, options, batch, kv_heads):
    """`cuflash bench --decode`: hand the decode grid to cuflash.bench_decode.cli_main (None = its default)."""
    from click.core import ParameterSource

    given = lambda name: ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)  # noqa: E731
    try:
        mod = importlib.import_module("cuflash.bench_decode")
    except ImportError as exc:
        raise click.ClickException(f"the benchmark module cuflash.bench_decode could not be imported: {exc}") from None
    mod.cli_main(
        head_dim=options["head_dim"] if given("head_dim") else None,
        cache_len=options["seqlen"] if given("seqlen") else None,
        batch=batch or None,
        kv_heads=kv_heads or None,
        dtype=options["dtype"],
        repeats=options["repeats"],
        peers=options["peers"],
        json_path=options["json_path"],
    )


if __name__ == "__main__":  # pragma: no cover
    main()
