"""What every planner shares: head-dim buckets, dtypes, architectures and their limits, the Launch
record, and the naming of kernel variants. Pure Python (no CuPy, no GPU)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

#: Head-dim buckets a kernel is compiled for. A head dim d runs in the smallest bucket >= d; the
#: columns between d and the bucket are zero-filled by predicated loads inside the kernel.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)

DTYPES = ("fp16", "bf16")

#: Oldest architecture the mma.sync / ldmatrix / cp.async kernels run on.
MIN_COMPUTE_CAPABILITY = (8, 0)

#: Architectures with known limits: the dynamic shared memory one CTA may use and the shared memory
#: per SM, in KB (CUDA programming guide, compute capabilities table). Other archs of compute
#: capability 8.0 or newer get the smallest of these (99 / 100 KB). sm_90 is not a target of its own:
#: a Hopper GPU loads sm_90a cubins (arch_for_capability), which use its wgmma and setmaxnreg.
MAX_SMEM_KB = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99}
SMEM_PER_SM_KB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228, 100: 228, 103: 228, 120: 100}
#: Every arch of compute capability 8.0 or newer that NVIDIA has shipped (what parse_arch accepts,
#: and what arch_for_capability can return for those GPUs).
KNOWN_ARCHS = (80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)

#: gridDim.x limit (CUDA programming guide, technical specifications).
MAX_GRID_X = 2**31 - 1


def head_dim_bucket(head_dim: int) -> int:
    """Smallest compiled head-dim bucket that holds ``head_dim``."""
    if head_dim < 1 or head_dim > HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim must be between 1 and {HEAD_DIM_BUCKETS[-1]}, got {head_dim}")
    return next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def arch_for_capability(major: int, minor: int) -> str:
    """NVRTC target for a device of compute capability (major, minor)."""
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"cuflash needs a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper); "
            f"this one is {major}.{minor}"
        )
    # sm_90a: the Hopper-specific target (wgmma, setmaxnreg); its cubins run on every 9.0 device.
    # A newer GPU than KNOWN_ARCHS lists still gets its own target (with the smallest known limits).
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


_ARCH_RE = re.compile(r"^sm_(\d{2,3})(a?)$")


def arch_number(arch: str) -> int:
    """'sm_90a' -> 90, 'sm_120' -> 120."""
    return int(_ARCH_RE.match(arch).group(1))


def parse_arch(arch: str) -> str:
    """Normalize a user-given arch ('90a', 'sm_90a', 'sm80', '8.0', 'compute_80') to 'sm_XY[a]'.

    Only the architectures of KNOWN_ARCHS are accepted (ValueError otherwise, before NVRTC sees
    them). 'sm_90' becomes 'sm_90a': Hopper processes load the sm_90a cubins, so an sm_90 cache
    would never be used."""
    a = arch.strip().lower().replace("compute_", "sm_")
    if "." in a:
        major, minor = a.split(".", 1)
        a = f"sm_{major}{minor}"
    if a.startswith("sm") and not a.startswith("sm_"):
        a = "sm_" + a[2:]
    if not a.startswith("sm_"):
        a = "sm_" + a
    m = _ARCH_RE.match(a)
    known = ", ".join(f"sm_{n}a" if n == 90 else f"sm_{n}" for n in KNOWN_ARCHS)
    # The "a" (arch-specific feature) targets exist from sm_90 on; cuflash builds only sm_90a of them.
    if not m or int(m.group(1)) not in KNOWN_ARCHS or (m.group(2) and int(m.group(1)) != 90):
        raise ValueError(f"unsupported arch {arch!r}: cuflash compiles for {known} (sm_90 means sm_90a)")
    n = int(m.group(1))  # without leading zeros: 'sm_090' is sm_90
    return "sm_90a" if n == 90 else f"sm_{n}"


def max_smem_bytes(arch: str) -> int:
    """Dynamic shared memory one CTA may use on ``arch``."""
    return MAX_SMEM_KB.get(arch_number(arch), 99) * 1024


def smem_per_sm_bytes(arch: str) -> int:
    return SMEM_PER_SM_KB.get(arch_number(arch), 100) * 1024


def ctas_per_sm_by_smem(smem_bytes: int, arch: str) -> int:
    """How many CTAs of ``smem_bytes`` dynamic shared memory one SM of ``arch`` holds (the system keeps
    1 KB per CTA beside it)."""
    return smem_per_sm_bytes(arch) // (smem_bytes + 1024)


def supports_pdl(arch: str) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on."""
    return arch_number(arch) >= 90


@dataclass(frozen=True)
class Launch:
    spec: object  # a kernel spec (KernelSpec, BwdSpec, DecodeSpec, ...)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    # Programmatic dependent launch (cuflash/launch.py): the kernel waits (griddepcontrol) for the
    # one before it on the stream, which may then let it start early. Only kernels written for it.
    pdl: bool = False
    # Forward: query tiles (varlen: scheduler slots) per head, FwdParams.num_m_blocks; grid[0] unless
    # the launch is persistent.
    m_blocks: int = 0
    # Persistent forward: (head, batch) pairs per group of its walk, FwdParams.sched_group (forward.py's
    # persistent_group); 0 for the other launches.
    sched_group: int = 0
    # Forward: the divisors of FwdParams' FastDiv fields (cuflash/params.py WALK_FIELDS order; plan/forward.py's
    # fwd_walk); () for the other launches.
    walk: tuple = ()

    def __post_init__(self):
        # The persistent forward's walk divides by its group size (flash_fwd_sm90_ws.cuh, tile_of): never launch
        # one without. (The persistent backward walks its items without groups.)
        if self.spec.family == "flash_fwd_sm90_ws" and getattr(self.spec.tile, "persistent", False):
            if self.sched_group < 1:
                raise ValueError(f"a persistent launch needs sched_group >= 1 (got {self.sched_group}): plan it with plan_forward")
            # Its stride in items is gridDim.x / cluster, and the kernel divides by walk[0] (FwdParams.walk_step;
            # the walk's length is params.walk_fields' check, where the record is packed)
            cluster = getattr(self.spec.tile, "cluster", 1)
            if not self.walk or self.walk[0] * cluster != self.grid[0]:
                raise ValueError(f"a persistent launch needs its walk's divisors, the first its grid in clusters "
                                 f"({self.grid[0]} // {cluster}); got {self.walk!r}: plan it with plan_forward")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Kernel registry: every kernel family, the header that defines it, its entry kernel and its
# parameter struct. The JIT (cuflash/jit.py) turns a spec into source with nothing but this.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelFamily:
    header: str  # cuda_src header that defines the kernel
    kernel: str  # C++ kernel function template in namespace cuflash; {args}: the spec's template_args()
    params: str  # parameter struct of cuda_src/params.h, the kernel's only argument
    # The argument is `const __grid_constant__` (it holds TMA tensor maps, which must stay in parameter space).
    grid_constant: bool = False


KERNEL_FAMILIES = {
    "flash_fwd": KernelFamily("flash_fwd.cuh", "flash_fwd_kernel<cuflash::FwdConfig<{args}>>", "FwdParams"),
    "flash_fwd_sm90": KernelFamily("flash_fwd_sm90.cuh", "flash_fwd_sm90_kernel<cuflash::Sm90FwdConfig<{args}>>",
                                   "FwdParams"),
    "flash_fwd_sm90_ws": KernelFamily("flash_fwd_sm90_ws.cuh",
                                      "flash_fwd_sm90_ws_kernel<cuflash::Sm90WsFwdConfig<{args}>>", "FwdTmaParams",
                                      grid_constant=True),
    "flash_bwd": KernelFamily("flash_bwd.cuh", "flash_bwd_kernel<cuflash::BwdConfig<{args}>>", "BwdParams"),
    "flash_bwd_sm90": KernelFamily("flash_bwd_sm90.cuh", "flash_bwd_sm90_kernel<cuflash::Sm90BwdConfig<{args}>>",
                                   "BwdParams"),
    "flash_bwd_sm90_ws": KernelFamily("flash_bwd_sm90_ws.cuh",
                                      "flash_bwd_sm90_ws_kernel<cuflash::Sm90WsBwdConfig<{args}>>", "BwdTmaParams",
                                      grid_constant=True),
    "flash_bwd_pre": KernelFamily("flash_bwd.cuh", "flash_bwd_pre_kernel<{args}>", "BwdParams"),
    "flash_bwd_convert": KernelFamily("flash_bwd.cuh", "flash_bwd_convert_kernel<{args}>", "BwdParams"),
    "flash_decode": KernelFamily("flash_decode.cuh", "flash_decode_kernel<cuflash::DecodeConfig<{args}>>",
                                 "DecodeParams"),
    "flash_decode_combine": KernelFamily("flash_decode_combine.cuh", "flash_decode_combine_kernel<{args}>",
                                         "DecodeParams"),
    "flash_decode_append": KernelFamily("flash_decode_append.cuh", "flash_decode_append_kernel<{args}>",
                                        "DecodeParams"),
    "rotary": KernelFamily("rotary.cuh", "rotary_kernel<{args}>", "RotaryParams"),
}  # fmt: skip


class SpecBase:
    """What every kernel spec provides (subclasses are frozen dataclasses with ``family`` and ``arch``
    fields): the registry entry of its family, the C++ call of its entry kernel, and the most dynamic
    shared memory a launch of it may ask for (the limit its loaded function is given)."""

    family: str
    arch: str
    threads: ClassVar[int]

    @property
    def kernel_family(self) -> KernelFamily:
        return KERNEL_FAMILIES[self.family]

    def entry_kernel(self) -> str:
        """The templated kernel this variant instantiates, e.g. ``flash_fwd_kernel<cuflash::FwdConfig<...>>``."""
        return self.kernel_family.kernel.format(args=self.template_args())

    @property
    def launch_smem_limit(self) -> int:
        return self.smem_bytes


#: The attention variants, bits of a spec's ``mods`` and of the kernels' kMods (cuda_src/masks.cuh).
#: MOD_VARLEN is the packed variable-length batch (cuda_src/varlen.cuh): the same math, rows found
#: through cu_seqlens; forward and backward only.
MOD_WINDOW, MOD_SOFTCAP, MOD_ALIBI, MOD_DROPOUT, MOD_VARLEN = 1, 2, 4, 8, 16
MOD_NAMES = {MOD_WINDOW: "window", MOD_SOFTCAP: "softcap", MOD_ALIBI: "alibi", MOD_DROPOUT: "dropout",
             MOD_VARLEN: "varlen"}  # fmt: skip
#: The score variants (what changes the math).
ALL_MODS = MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI | MOD_DROPOUT
#: What a forward or backward kernel can compile.
FWD_BWD_MODS = ALL_MODS | MOD_VARLEN


def check_mods(mods: int, allowed: int = FWD_BWD_MODS) -> int:
    """``mods`` as an int of variant bits, all of them in ``allowed``."""
    if mods != int(mods) or mods < 0 or mods & ~allowed:
        names = [MOD_NAMES[b] for b in MOD_NAMES if b & allowed]
        raise ValueError(f"mods must combine the variant bits of {names}, got {mods!r}")
    return int(mods)


def mods_tag(mods: int) -> str:
    """The variants in a variant name: '' for none, else e.g. '_window_softcap'."""
    return "".join(f"_{name}" for bit, name in MOD_NAMES.items() if mods & bit)


def mods_arg(mods: int) -> str:
    """The variants as the last C++ template argument: nothing for none (the default 0), so a plain
    variant's source is what it was before the variants existed."""
    return f", {mods}" if mods else ""


def load_tag(aligned: bool) -> str:
    """The load path in a variant name: 16-byte vector loads or element-wise loads."""
    return "vec16" if aligned else "scalar"


def arch_tag(arch: str) -> str:
    """The arch in a variant name (and kernel symbol): sm_90a -> sm90a."""
    return arch.replace("_", "")


def cpp_bool(x: bool) -> str:
    """A Python bool as a C++ template argument."""
    return "true" if x else "false"


class TiledSpec(SpecBase):
    """What the forward and backward main-kernel specs share: threads and min_blocks from ``tile``, and
    the variant name (family, head dim, dtype, causal, the tile's common fields, ``tile_fields``, load
    path, arch)."""

    def _variant_name(self, tile_fields: str) -> str:
        t = self.tile
        return (
            f"{self.family}_hd{self.head_dim}_{self.dtype}_{'causal' if self.causal else 'full'}"
            f"_bm{t.block_m}_bn{t.block_n}_w{t.warps}_mb{t.min_blocks}_st{t.stages}{tile_fields}{mods_tag(self.mods)}"
            f"_{load_tag(self.aligned)}_{arch_tag(self.arch)}"
        )

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    @property
    def min_blocks(self) -> int:
        return self.tile.min_blocks


@dataclass(frozen=True)
class HopperSpec(TiledSpec):
    """What the Hopper (wgmma) kernel specs share: sm_90a, the 16-byte load path, a name spelling the
    tile's common fields."""

    head_dim: int  # bucket
    dtype: str
    causal: bool
    tile: object
    arch: str = "sm_90a"
    family: str = ""
    aligned: bool = True
    mods: int = 0  # attention variants (MOD_* bits)

    @property
    def name(self) -> str:
        return self._variant_name("")
