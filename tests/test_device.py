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


def test_capabilities_name_each_fallback_on_cpu():
    caps = device.capabilities(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert caps["FlexAttention training"].startswith("no (forward only on CPU)")
    assert caps["CPU vector ISA"].split()[0] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NEON",
                                                 "SVE256", "VSX")
    assert "trust_remote_code=False" in caps["safe loading"]
