"""One place that decides where code runs and in which precision.

cuda -> mps -> cpu; an autocast context that is a no-op where it does nothing; bf16 falls back to
fp16 (with a grad scaler) where the hardware lacks bf16, e.g. a Colab T4, and says so aloud.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import re
import shutil
import sys
import warnings
from collections.abc import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Each library behind torch's CPU kernels reads its own variable to cap the vector instructions it
# may use: ATen's kernels and Inductor's generated C++ (ATEN_CPU_CAPABILITY), oneDNN (bf16 and
# int8 matmuls), MKL (fp32 GEMM) and FBGEMM (torch.ao's int8 linear layers). Set together before
# a kernel runs, they make a newer CPU take the code paths an older one would take (its bf16
# fallbacks included), though not its clocks, caches or cores.
ISA_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
}
_CAP_VARIABLES = tuple(dict.fromkeys(v for cap in ISA_CAPS.values() for v in cap))


def pick_device(prefer: str | None = None) -> torch.device:
    """The best available device: cuda, then mps, then cpu.

    Args:
        prefer: force a device ("cpu", "cuda", "cuda:1", "mps"); None picks automatically.

    Returns:
        torch.device

    Raises:
        ValueError: if ``prefer`` names a device that is not available here.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if prefer is not None:
        device = torch.device(prefer)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"prefer={prefer!r}: CUDA is not available on this machine")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"prefer={prefer!r}: MPS is not available on this machine")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 math is supported natively on ``device``.

    Args:
        device: the device to ask about.

    Returns:
        True on Ampere and later GPUs, Apple GPUs and CPUs with AVX512-BF16 or AMX; False on
        pre-Ampere GPUs like the T4 and on CPUs that would emulate it.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        # Without AVX512-BF16 / AMX, bf16 matmuls are emulated: ~20x slower than fp32 (measured
        # on a 2-core AVX2 machine), so bf16 only counts as supported where oneDNN runs it.
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return device.type == "mps"


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn a requested precision into the one that will run, warning on a fallback.

    Args:
        precision: "fp32", "bf16", "fp16" or "auto" (bf16 on CUDA where supported, else fp16
            on CUDA, else fp32). On a CPU without native bf16, "bf16" and "fp16" run in fp32.
        device: where the computation runs.

    Returns:
        "fp32", "bf16" or "fp16".

    Raises:
        ValueError: for an unknown precision name.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    if precision == "auto":
        if supports_bf16(device):
            return "bf16" if device.type == "cuda" else "fp32"
        return "fp16" if device.type == "cuda" else "fp32"
    if precision == "bf16" and not supports_bf16(device) and device.type != "cuda":
        warnings.warn(
            f"precision='bf16': {describe_device(device)} has no native bf16 (emulated, far "
            "slower than fp32); running in fp32",
            stacklevel=2,
        )
        return "fp32"
    if precision == "bf16" and not supports_bf16(device):
        warnings.warn(
            f"precision='bf16': {describe_device(device)} has no native bf16; "
            "falling back to fp16 with a gradient scaler",
            stacklevel=2,
        )
        return "fp16"
    if precision == "fp16" and device.type == "cpu":
        warnings.warn("precision='fp16' on CPU: no fast fp16 kernels there; running in fp32",
                      stacklevel=2)
        return "fp32"
    return precision


def compute_dtype(device: torch.device) -> torch.dtype:
    """The low-precision dtype to compute in on ``device``: bf16, else fp16 (CUDA), else fp32.

    Args:
        device: where the model runs.

    Returns:
        ``torch.bfloat16`` where it is native, ``torch.float16`` on an older GPU (T4: with a
        gradient scaler), else ``torch.float32``.
    """
    if supports_bf16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else torch.float32


def dtype_of(precision: str) -> torch.dtype:
    """The torch dtype for a resolved precision name.

    Args:
        precision: "fp32", "bf16" or "fp16".

    Returns:
        The dtype.

    Raises:
        ValueError: for another name.

    Example:
        >>> dtype_of("bf16")
        torch.bfloat16
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(_DTYPES)}")
    return _DTYPES[precision]


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Autocast to ``precision`` on ``device``; a no-op for fp32.

    Args:
        device: where the model runs.
        precision: "fp32", "bf16" or "fp16".

    Yields:
        Nothing: a context manager.
    """
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype_of(precision)):
        yield


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so that a timer reads real time (no-op on CPU).

    Args:
        device: the device whose queue to wait for.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in Linux's ``/proc/cpuinfo`` (the others repeat them).

    Args:
        path: the file.

    Returns:
        field -> value, e.g. {"model name": "AMD EPYC", "cpu family": "23", ...}; {} where the
        file does not exist (macOS, Windows).
    """
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:  # the end of the first processor's block
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    return fields


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``).

    Returns:
        The name, or '' where none is found.
    """
    name = cpuinfo().get("model name")
    if name:  # "Intel(R) Xeon(R) ..." -> "Intel Xeon ..."
        return " ".join(re.sub(r"\((R|TM|tm)\)", "", name).split())
    return platform.processor()


# AMD's core generations by CPUID family and model ranges, as Linux's arch/x86/kernel/cpu/amd.c
# sets its X86_FEATURE_ZEN1..5 (its Zen 1 includes Zen+). A cloud VM often names only "AMD EPYC",
# yet the generations differ in what a speed figure depends on: Zen 1 runs each 256-bit AVX2
# instruction on 128-bit units (half Zen 2's FMA width per cycle), Zen 4 adds AVX512.
_AMD_CORES = {0x17: {"Zen 1": ((0x00, 0x2F), (0x50, 0x5F)),
                     "Zen 2": ((0x30, 0x4F), (0x60, 0x7F), (0x90, 0x91), (0xA0, 0xAF))},
              0x19: {"Zen 3": ((0x00, 0x0F), (0x20, 0x5F)),
                     "Zen 4": ((0x10, 0x1F), (0x60, 0xAF))},
              0x1A: {"Zen 5": ((0x00, 0x2F), (0x40, 0x4F), (0x70, 0x7F))}}


def microarchitecture(vendor: str, family: int, model: int) -> str:
    """Name a CPU's core generation from its CPUID vendor, family and model.

    Args:
        vendor: CPUID's vendor string, e.g. "AuthenticAMD" or "GenuineIntel".
        family: the (extended) family, as ``/proc/cpuinfo``'s "cpu family" gives it.
        model: the (extended) model, as its "model" gives it.

    Returns:
        "family F model M", with AMD's Zen generation in front where known.

    Example:
        >>> microarchitecture("AuthenticAMD", 23, 1)
        'Zen 1, family 23 model 1'
    """
    ids = f"family {family} model {model}"
    if vendor == "AuthenticAMD":
        for name, ranges in _AMD_CORES.get(family, {}).items():
            if any(low <= model <= high for low, high in ranges):
                return f"{name}, {ids}"
    return ids


def cpu_microarchitecture() -> str:
    """This CPU's core generation (:func:`microarchitecture`, read from ``/proc/cpuinfo`` on an
    x86 Linux): what tells apart two hosts a hypervisor names alike, e.g. "AMD EPYC".

    Returns:
        E.g. 'Zen 1, family 23 model 1', or '' where ``/proc/cpuinfo`` gives no family.
    """
    fields = cpuinfo()
    if not fields.get("cpu family", "").isdigit() or not fields.get("model", "").isdigit():
        return ""
    return microarchitecture(fields.get("vendor_id", ""), int(fields["cpu family"]),
                             int(fields["model"]))


def cpu_flags() -> set[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (x86 Linux).

    Returns:
        E.g. {"avx2", "fma", "avx512_bf16", ...}; an empty set where the file gives none.

    Example:
        >>> cpu_flags() == set() or "fpu" in cpu_flags() or "fp" in cpu_flags()
        True
    """
    return set(cpuinfo().get("flags", "").split())


def native_cpu_isa() -> str:
    """The vector ISA this CPU's hardware offers, named as torch names its kernel levels
    (``AVX512``, ``AVX2``, ``DEFAULT``), whatever :data:`ISA_CAPS`' variables say: read from
    ``/proc/cpuinfo``'s flags on x86 Linux (with ATen's own tests: AVX512 needs the F, BW, VL
    and DQ subsets, AVX2 needs FMA too), else torch's level.

    Returns:
        "AVX512", "AVX2" or "DEFAULT" (or torch's level name elsewhere).
    """
    flags = cpu_flags()
    if not flags or platform.machine() not in ("x86_64", "AMD64"):
        return torch.backends.cpu.get_cpu_capability()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


def cap_cpu_isa(isa: str) -> dict[str, str]:
    """Make this process's later kernels and every process it starts (papermill's kernels,
    torchrun's ranks) run the CPU code paths of an ``isa``-only CPU: sets :data:`ISA_CAPS`'
    variables, and points Inductor at a cache folder of its own (``<cache>-<isa>``). Call it
    before a kernel runs: ATen reads its variable at the first one.

    Args:
        isa: a key of :data:`ISA_CAPS`, e.g. "avx2".

    Returns:
        The ISA variables set, name -> value.

    Raises:
        ValueError: if ``isa`` is not one of :data:`ISA_CAPS`.

    Example:
        >>> cap_cpu_isa("avx2")["ATEN_CPU_CAPABILITY"]  # doctest: +SKIP
        'avx2'
    """
    if isa not in ISA_CAPS:
        raise ValueError(f"isa={isa!r}: expected one of {sorted(ISA_CAPS)}")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.environ.update(ISA_CAPS[isa])
    # Inductor's FX-graph cache does not key on the ISA: graphs compiled uncapped and served to a
    # capped process gave wrong losses here (torch 2.13: a compiled cross-entropy 5.43 for 6.13),
    # so a capped run compiles into a cache of its own.
    if not cache_dir().endswith(f"-{isa}"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{cache_dir()}-{isa}"
    level, order = torch.backends.cpu.get_cpu_capability(), ("DEFAULT", "AVX2", "AVX512")
    if level in order and order.index(level) > order.index(isa.upper()):
        warnings.warn(f"cap_cpu_isa({isa!r}): this process had chosen its kernels already and "
                      f"keeps {level}; the processes it starts run {isa.upper()}'s",
                      stacklevel=2)
    return dict(ISA_CAPS[isa])


def isa_cap() -> str:
    """'' when the CPU kernels may use all the hardware offers; else which of
    :data:`ISA_CAPS`' variables hold them back, e.g.
    ``'ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, ...'``.

    Returns:
        The variables set, as text ('' for none).
    """
    return ", ".join(f"{k}={os.environ[k]}" for k in _CAP_VARIABLES if os.environ.get(k))


def describe_device(device: torch.device) -> str:
    """A human-readable device name, e.g. 'cpu: AMD EPYC (Zen 1, family 23 model 1; x86_64 AVX2,
    2 threads)' or 'cuda: Tesla T4'. A CPU's speed figures depend on its core generation
    (:func:`cpu_microarchitecture`) and vector ISA (torch's kernel level: AVX2, AVX512, ...) as
    much as on its cores, so all are named, and a cap on the ISA (:func:`cap_cpu_isa`) with the
    hardware's own: 'x86_64 AVX2 capped, hardware AVX512'.

    Args:
        device: the device to describe.

    Returns:
        One line naming it.
    """
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return "mps: Apple GPU"
    name = cpu_name()
    capped = f" capped, hardware {native_cpu_isa()}" if isa_cap() else ""
    core = cpu_microarchitecture()
    return (f"cpu{': ' + name if name else ''} ({core + '; ' if core else ''}{platform.machine()} "
            f"{torch.backends.cpu.get_cpu_capability()}{capped}, "
            f"{torch.get_num_threads()} threads)")


def has_module(name: str) -> bool:
    """Whether an optional package is importable, without importing it.

    Args:
        name: the module's dotted name.

    Returns:
        True if it can be imported.

    Example:
        >>> has_module("torch"), has_module("no_such_package")
        (True, False)
    """
    return importlib.util.find_spec(name) is not None


# bitsandbytes 0.50's CPU backend, where the CPU has AVX512-BF16, loads this Hub kernel through the
# ``kernels`` package when it is imported (bitsandbytes/backends/cpu/ops.py) for one token's bf16
# product with 4-bit weights (``gemv_4bit``); offline, or where it is refused, its own kernel runs.
BNB_HUB_KERNEL = "kernels-community/quantization-bitsandbytes"


def bnb_cpu_gemv_kernel() -> str:
    """Which kernel bitsandbytes' CPU backend runs for a single token's bf16 product with 4-bit
    weights (``gemv_4bit``: batch-1 decode through NF4 layers), without importing it (importing
    bitsandbytes is what asks the Hub).

    Returns:
        "" where the question does not arise (no bitsandbytes, a CPU without AVX512-BF16 in
        ``/proc/cpuinfo``'s flags, or an imported bitsandbytes that asks for no kernel); else
        which kernel was loaded, where bitsandbytes has been imported, or that it asks the Hub
        for :data:`BNB_HUB_KERNEL` when imported.

    Example:
        >>> bnb_cpu_gemv_kernel() == "" or BNB_HUB_KERNEL in bnb_cpu_gemv_kernel()
        True
    """
    if not has_module("bitsandbytes") or "avx512_bf16" not in cpu_flags():
        return ""
    ops = sys.modules.get("bitsandbytes.backends.cpu.ops")
    if ops is not None and not hasattr(ops, "gemm_4bit_forward_kernel"):
        return ""  # imported, and this bitsandbytes asked the Hub for nothing
    if ops is None:
        return (f"on this CPU (AVX512-BF16) bitsandbytes asks the Hub for {BNB_HUB_KERNEL} when "
                "imported and runs it for one token's bf16 product with 4-bit weights; offline "
                "(HF_HUB_OFFLINE=1) it keeps its own unless that kernel is cached")
    if ops.gemm_4bit_forward_kernel is None:
        return (f"bitsandbytes' own kernel for one token's bf16 product with 4-bit weights "
                f"({BNB_HUB_KERNEL} not loaded: offline, not cached or refused)")
    return (f"the Hub's {BNB_HUB_KERNEL} for one token's bf16 product with 4-bit weights, "
            "loaded when bitsandbytes was imported")


def capabilities(device: torch.device | None = None) -> dict[str, str]:
    """What this machine can do, and which fallback each recipe takes when it cannot.

    Args:
        device: the notebook's device (default: :func:`pick_device`'s choice).

    Returns:
        A mapping capability -> one line ("yes" or "no: <fallback>"), shown in notebooks' first
        cells.
    """
    device = device or pick_device()
    cuda = torch.cuda.is_available()
    bf16 = supports_bf16(device)
    bnb_cpu = "" if cuda else bnb_cpu_gemv_kernel()
    return {
        "device": describe_device(device),
        "CUDA": "yes" if cuda else "no: everything runs on CPU; GPU-only cells say they skip",
        "bf16": "yes" if bf16 else ("no: fp16 autocast with a gradient scaler" if cuda
                                    else "no (emulated, ~20x slower): fp32"),
        "bitsandbytes 4-bit": (
            ("yes (CUDA kernels)" if cuda else "yes (CPU backend, slower than CUDA"
             + (f"; {bnb_cpu}" if bnb_cpu else "") + ")")
            if has_module("bitsandbytes")
            else "no: QLoRA cells raise a clear error; pip install bitsandbytes"
        ),
        "flash-attn": "yes" if has_module("flash_attn") else "no: PyTorch SDPA is used",
        "FlexAttention training": ("yes" if cuda else "no (forward only on CPU): blockwise "
                                   "SDPA attention (sparse_attention) instead"),
        "CPU vector ISA": (f"{torch.backends.cpu.get_cpu_capability()} (int8 matmuls gain most "
                           "with VNNI / AMX)" + (f"; capped by {isa_cap()}, the hardware has "
                                                f"{native_cpu_isa()}" if isa_cap() else "")),
        "torch.compile": ("yes" if cuda or shutil.which("g++") or shutil.which("clang++")
                          else "no C++ compiler: eager kernels only"),
        "Liger-Kernel": ("yes" if has_module("liger_kernel")
                         else "no: chunked_loss (plain PyTorch) computes the fused losses"),
        "torchao": "yes" if has_module("torchao") else "no",
        "safe loading": "trust_remote_code=False; torch.load(weights_only=True); safetensors",
    }
