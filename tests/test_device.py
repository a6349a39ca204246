import os
import subprocess
import sys

import pytest
import torch

from recipes_lib import device


def test_pick_device_cpu_and_bad_request():
    assert device.pick_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="prefer='cuda'"):
            device.pick_device("cuda")


def test_resolve_precision_names_and_fallbacks():
    cpu = torch.device("cpu")
    assert device.resolve_precision("fp32", cpu) == "fp32"
    assert device.resolve_precision("auto", cpu) in ("fp32", "bf16")
    with pytest.raises(ValueError, match="precision='int3'"):
        device.resolve_precision("int3", cpu)
    with pytest.warns(UserWarning, match="fp16"):
        assert device.resolve_precision("fp16", cpu) == "fp32"
    if not device.supports_bf16(cpu):
        with pytest.warns(UserWarning, match="no native bf16"):
            assert device.resolve_precision("bf16", cpu) == "fp32"


def test_autocast_is_noop_in_fp32():
    x = torch.randn(4, 4)
    with device.autocast(torch.device("cpu"), "fp32"):
        assert (x @ x).dtype == torch.float32
    with device.autocast(torch.device("cpu"), "bf16"):
        assert (x @ x).dtype == torch.bfloat16


def test_capabilities_report_every_fallback():
    caps = device.capabilities(torch.device("cpu"))
    assert {"device", "CUDA", "bf16", "bitsandbytes 4-bit", "flash-attn"} <= caps.keys()
    assert caps["flash-attn"] in ("yes", "no: PyTorch SDPA is used")


def test_cpu_description_names_the_model_isa_and_threads():
    described = device.describe_device(torch.device("cpu"))
    assert described.startswith("cpu")
    assert torch.backends.cpu.get_cpu_capability() in described
    assert f"{torch.get_num_threads()} threads" in described
    name = device.cpu_name()
    assert (name in described) if name else described.startswith("cpu (")


@pytest.mark.parametrize("vendor, family, model, named", [
    ("AuthenticAMD", 23, 1, "Zen 1"),  # EPYC 7001 (Naples): AVX2 on 128-bit units
    ("AuthenticAMD", 23, 8, "Zen 1"),  # Zen+ (Pinnacle Ridge), in the kernel's Zen 1 group
    ("AuthenticAMD", 23, 49, "Zen 2"),  # EPYC 7002 (Rome)
    ("AuthenticAMD", 25, 1, "Zen 3"),  # EPYC 7003 (Milan)
    ("AuthenticAMD", 25, 17, "Zen 4"),  # EPYC 9004 (Genoa): AVX512
    ("AuthenticAMD", 26, 2, "Zen 5"),  # EPYC 9005 (Turin)
    ("AuthenticAMD", 26, 0x55, None),  # a model the table does not know: the numbers alone
    ("AuthenticAMD", 31, 0, None),
    ("GenuineIntel", 6, 143, None),  # Sapphire Rapids: Intel's model names say the generation
])
def test_the_core_generation_is_named_from_cpuid_family_and_model(vendor, family, model, named):
    ids = f"family {family} model {model}"
    assert device.microarchitecture(vendor, family, model) == (f"{named}, {ids}" if named
                                                               else ids)


def test_the_description_names_this_cpus_core_generation_where_cpuinfo_gives_it():
    core = device.cpu_microarchitecture()
    described = device.describe_device(torch.device("cpu"))
    if core:
        assert f"({core}; " in described
    else:  # no /proc/cpuinfo family (macOS, Windows, some ARM kernels): nothing is guessed
        assert "family" not in described


def test_cpuinfo_reads_the_first_processors_block_only(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("\nprocessor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n"
                    "model\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n"
                    "processor\t: 1\nmodel name\t: another\n\n")
    assert device.cpuinfo(str(path)) == {
        "processor": "0", "vendor_id": "AuthenticAMD", "cpu family": "23", "model": "1",
        "model name": "AMD EPYC", "flags": "fpu avx2 fma"}
    assert device.cpuinfo(str(tmp_path / "absent")) == {}  # macOS, Windows: nothing guessed


def test_capabilities_name_each_fallback_on_cpu():
    caps = device.capabilities(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert caps["FlexAttention training"].startswith("no (forward only on CPU)")
    assert caps["CPU vector ISA"].split()[0] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NEON",
                                                 "SVE256", "VSX")
    assert "trust_remote_code=False" in caps["safe loading"]


def test_native_isa_is_a_torch_level_at_least_the_one_running():
    order = ("DEFAULT", "AVX2", "AVX512")
    native, running = device.native_cpu_isa(), torch.backends.cpu.get_cpu_capability()
    if running in order:  # x86: a cap can only lower the level torch runs
        assert order.index(native) >= order.index(running)


def test_capping_the_isa_runs_the_lower_kernels_and_says_so():
    if device.native_cpu_isa() not in ("AVX2", "AVX512"):
        pytest.skip(f"no AVX2 here ({device.native_cpu_isa()}): nothing to cap to")
    # a fresh process: torch fixes its kernel level at the first kernel
    code = ("import torch; from recipes_lib import checks, device; device.cap_cpu_isa('avx2'); "
            "print(torch.backends.cpu.get_cpu_capability()); print(device.isa_cap()); "
            "print(device.describe_device(torch.device('cpu'))); "
            "print(checks.is_reference_machine()[1]); "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())")
    env = {k: v for k, v in os.environ.items()
           if k not in device.ISA_CAPS["avx2"] and k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    assert out[0] == "AVX2"
    assert out[1] == ", ".join(f"{k}={v}" for k, v in device.ISA_CAPS["avx2"].items())
    assert f"AVX2 capped, hardware {device.native_cpu_isa()}" in out[2]
    if device.native_cpu_isa() != "AVX2":  # capped is not the reference machine
        assert f"hardware_isa {device.native_cpu_isa()} (reference: AVX2)" in out[3]
    # compiled graphs are not shared with uncapped runs (Inductor's cache does not key on the ISA)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert out[4] == f"{default_cache_dir()}-avx2"


def test_capping_an_unknown_isa_names_the_parameter():
    with pytest.raises(ValueError, match="isa='avx3'"):
        device.cap_cpu_isa("avx3")


def test_bitsandbytes_cpu_kernel_is_said_without_importing_it(monkeypatch):
    """On a CPU with AVX512-BF16, bitsandbytes asks the Hub for a kernel when imported: the
    capability line says so before the import and which kernel loaded after it."""
    import types

    if not device.has_module("bitsandbytes"):
        pytest.skip("bitsandbytes is not installed")
    ops = "bitsandbytes.backends.cpu.ops"
    monkeypatch.setattr(device, "cpuinfo", lambda: {"flags": "fpu avx2 avx512f"})
    assert device.bnb_cpu_gemv_kernel() == ""  # no AVX512-BF16: bitsandbytes' own, no question
    monkeypatch.setattr(device, "cpuinfo", lambda: {"flags": "avx2 avx512f avx512_bf16"})
    monkeypatch.delitem(sys.modules, ops, raising=False)
    before = device.bnb_cpu_gemv_kernel()
    assert f"asks the Hub for {device.BNB_HUB_KERNEL} when imported" in before
    assert ops not in sys.modules  # saying so did not import it
    monkeypatch.setitem(sys.modules, ops, types.SimpleNamespace())  # a version without it
    assert device.bnb_cpu_gemv_kernel() == ""
    monkeypatch.setitem(sys.modules, ops, types.SimpleNamespace(gemm_4bit_forward_kernel=None))
    assert device.bnb_cpu_gemv_kernel().startswith("bitsandbytes' own kernel")
    monkeypatch.setitem(sys.modules, ops, types.SimpleNamespace(gemm_4bit_forward_kernel=print))
    assert device.bnb_cpu_gemv_kernel().startswith(f"the Hub's {device.BNB_HUB_KERNEL}")
    if not torch.cuda.is_available():
        assert device.bnb_cpu_gemv_kernel() in device.capabilities(
            torch.device("cpu"))["bitsandbytes 4-bit"]


def test_bitsandbytes_cpu_kernel_is_read_from_the_library_as_it_names_it():
    """Where this CPU has AVX512-BF16, bitsandbytes' CPU backend keeps the Hub kernel (or None)
    in the module global the line reads."""
    if not device.has_module("bitsandbytes"):
        pytest.skip("bitsandbytes is not installed")
    if "avx512_bf16" not in device.cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes asks the Hub for nothing")
    import bitsandbytes  # noqa: F401  (registers the CPU backend's kernels)
    from bitsandbytes.backends.cpu import ops

    assert hasattr(ops, "gemm_4bit_forward_kernel")
    said = device.bnb_cpu_gemv_kernel()
    assert said.startswith("bitsandbytes' own kernel" if ops.gemm_4bit_forward_kernel is None
                           else f"the Hub's {device.BNB_HUB_KERNEL}")
