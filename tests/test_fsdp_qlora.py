import math

import pytest
import torch

pytest.importorskip("torchao")

from recipes_lib import calc, fsdp_qlora


class _Holder(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


def test_nf4_lora_matches_peft_lora_on_the_dequantized_weight():
    from peft import LoraConfig, inject_adapter_in_model

    linear = torch.nn.Linear(256, 128, bias=False)
    ours = fsdp_qlora.NF4LoRALinear(linear, r=4, alpha=8)
    torch.nn.init.normal_(ours.lora_b.weight)  # B = 0 at init would hide a scaling error
    dense = torch.nn.Linear(256, 128, bias=False)
    dense.weight.data = ours.weight.to(torch.float32).clone()
    ref = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]),
                                  _Holder(dense))
    ref.proj.lora_A["default"].weight.data = ours.lora_a.weight.data.clone()
    ref.proj.lora_B["default"].weight.data = ours.lora_b.weight.data.clone()
    x = torch.randn(3, 5, 256)
    out, expected = ours(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ours.lora_a.weight.grad, ref.proj.lora_A["default"].weight.grad,
                               rtol=1e-4, atol=1e-4)
    assert not ours.weight.requires_grad


def test_nf4_weight_is_close_to_the_original_and_starts_equal_to_the_base():
    linear = torch.nn.Linear(256, 128, bias=True)
    ours = fsdp_qlora.NF4LoRALinear(linear, r=8)
    rel = (ours.weight.to(torch.float32) - linear.weight).norm() / linear.weight.norm()
    assert rel < 0.15  # 4-bit: ~10 % relative error on a uniform init
    x = torch.randn(2, 256)
    torch.testing.assert_close(ours(x), torch.nn.functional.linear(
        x, ours.weight.to(torch.float32), linear.bias))


def test_apply_nf4_lora_freezes_all_but_adapters_and_counts_bytes(tiny_model_path):
    from recipes_lib.model import load_model

    model = fsdp_qlora.apply_nf4_lora(load_model(tiny_model_path), r=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    b = fsdp_qlora.nf4_base_bytes(model)
    assert 0.25 <= b["nf4_local"] / b["bf16_full"] <= 0.30
    out = model(input_ids=torch.randint(0, 500, (2, 8)), labels=torch.randint(0, 500, (2, 8)))
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_adapters_on_some_layers_leave_the_others_quantized_and_frozen(tiny_model_path):
    """``adapter_modules``: every linear layer of the blocks is NF4 (the same base bytes as
    with adapters everywhere), and only the named ones carry adapters, as Answer.AI's train.py
    runs QLoRA (its "all": not ``o_proj``); a frozen NF4 layer computes the dequantized linear."""
    from recipes_lib.model import load_model

    six = ("k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj")
    every = fsdp_qlora.apply_nf4_lora(load_model(tiny_model_path), r=4)
    some = fsdp_qlora.apply_nf4_lora(load_model(tiny_model_path), r=4, adapter_modules=six)
    assert fsdp_qlora.nf4_base_bytes(some) == fsdp_qlora.nf4_base_bytes(every)
    o_proj = [m for n, m in some.named_modules() if n.endswith("o_proj")]
    assert o_proj and all(type(m) is fsdp_qlora.NF4Linear for m in o_proj)
    trainable = {n.split(".")[-3] for n, p in some.named_parameters() if p.requires_grad}
    assert trainable == set(six)
    linear = torch.nn.Linear(256, 128, bias=True)
    frozen = fsdp_qlora.NF4Linear(linear, base_dtype=torch.float32)
    x = torch.randn(2, 256)
    torch.testing.assert_close(frozen(x), torch.nn.functional.linear(
        x, frozen.weight.to(torch.float32), linear.bias))
    with pytest.raises(ValueError, match=r"adapter_modules=\('o_proj',\): none of the"):
        fsdp_qlora.apply_nf4_lora(load_model(tiny_model_path), target_modules=("q_proj",),
                                  adapter_modules=("o_proj",))


def test_chunked_dequantization_equals_torchaos_and_holds_only_its_output():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from recipes_lib.memory import measure_memory

    to_nf4 = fsdp_qlora._nf4()[0]
    w = to_nf4(torch.randn(96, 512, dtype=torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float32):  # chunks that split a scaler block too
        for chunk in (32, 4096, fsdp_qlora.DEQUANT_CHUNK):
            assert torch.equal(fsdp_qlora.dequantize_chunked(w, dtype, chunk), w.to(dtype))
    with FakeTensorMode(allow_non_fake_inputs=True):
        big = to_nf4(torch.empty(4096, 4096, dtype=torch.bfloat16))
        torchao = measure_memory(lambda: big.to(torch.bfloat16)).activation_bytes
        ours = measure_memory(lambda: fsdp_qlora.dequantize_chunked(big, torch.bfloat16)
                              ).activation_bytes
    n = 4096 * 4096
    assert torchao / n > 13  # int64 indices and four more full-size tensors at once
    # the bf16 output, and the scales (one per block of 64) as they are dequantized
    assert 2 * n <= ours <= 2 * n + n / 16


def test_a_chunked_nf4_layer_trains_as_torchaos():
    linear = torch.nn.Linear(256, 128, bias=True)
    torch.manual_seed(0)
    ref = fsdp_qlora.NF4LoRALinear(linear, r=4, alpha=8)
    torch.manual_seed(0)
    ours = fsdp_qlora.NF4LoRALinear(linear, r=4, alpha=8, chunked_dequant=True)
    for m in (ref, ours):
        torch.nn.init.ones_(m.lora_b.weight)
    x = torch.randn(3, 5, 256, dtype=torch.float32)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [m(v) for m, v in zip((ref, ours), xs)]
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        out.square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ref.lora_a.weight.grad, ours.lora_a.weight.grad)


def test_fp32_adapters_over_a_bf16_base_cast_their_input_as_peft_does():
    """Without autocast, peft's LoRA layers give fp32 adapters an fp32 copy of a bf16 input and
    return their output in bf16; a bf16 input into fp32 weights would not multiply at all."""
    linear = torch.nn.Linear(256, 128, bias=False)
    ours = fsdp_qlora.NF4LoRALinear(linear, r=4, alpha=8, chunked_dequant=True)
    torch.nn.init.normal_(ours.lora_b.weight)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    out = ours(x)
    base = torch.nn.functional.linear(x, ours.weight.to(torch.bfloat16))
    adapted = ours.lora_b(ours.lora_a(x.float())) * ours.scaling
    assert out.dtype == torch.bfloat16 and ours.lora_a.weight.dtype == torch.float32
    assert torch.equal(out, base + adapted.to(torch.bfloat16))


def test_adapters_in_the_bases_dtype_take_no_copy_of_their_input():
    """``adapter_dtype=torch.bfloat16`` (peft before 0.11 gave adapters the base weight's dtype):
    bf16 adapters over a bf16 base compute on the input as it comes, no fp32 copy."""
    linear = torch.nn.Linear(256, 128, bias=False)
    ours = fsdp_qlora.NF4LoRALinear(linear, r=4, alpha=8, adapter_dtype=torch.bfloat16)
    torch.nn.init.normal_(ours.lora_b.weight)
    assert ours.lora_a.weight.dtype == ours.lora_b.weight.dtype == torch.bfloat16
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    base = torch.nn.functional.linear(x, ours.weight.to(torch.bfloat16))
    assert torch.equal(ours(x), base + ours.lora_b(ours.lora_a(x)) * ours.scaling)


def test_bad_inputs():
    with pytest.raises(ValueError, match="r=0"):
        fsdp_qlora.NF4LoRALinear(torch.nn.Linear(256, 128), r=0)
    with pytest.raises(ValueError, match="not a multiple of NF4 blocks"):
        fsdp_qlora.NF4LoRALinear(torch.nn.Linear(10, 10))
    with pytest.raises(ValueError, match="target_modules"):
        fsdp_qlora.apply_nf4_lora(torch.nn.Sequential(torch.nn.Linear(256, 256)),
                                  target_modules=("nothing",))
    w = fsdp_qlora._nf4()[0](torch.randn(64, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="chunk_bytes=40"):
        fsdp_qlora.dequantize_chunked(w, torch.bfloat16, chunk_bytes=40)


def test_fsdp_shards_the_nf4_base_across_two_ranks(sharded_runs):
    ranks = sharded_runs["fsdp_qlora"]
    for r in ranks:
        assert r["nf4_bytes_per_rank"] / r["bf16_base_bytes"] <= 0.15
        assert abs(r["nf4_bytes_per_rank"] / r["nf4_bytes_unsharded"] - 0.5) < 0.01
        assert r["losses"] == ranks[0]["losses"]
        assert all(math.isfinite(x) for x in r["losses"])
    assert calc.bytes_per_param("nf4_dq") / 2 / 2 < 0.15


def test_fsdp_qlora_shards_phi3s_fused_projections_too(sharded_runs):
    """Phi-3 fuses q/k/v and gate/up: the default targets are its own linear layers
    (``architectures.adapter_targets``), so every one is quantized, adapted and sharded."""
    ranks = sharded_runs["fsdp_qlora_phi3"]
    for r in ranks:
        assert abs(r["nf4_bytes_per_rank"] / r["nf4_bytes_unsharded"] - 0.5) < 0.01
        assert r["losses"] == ranks[0]["losses"] and all(math.isfinite(x) for x in r["losses"])
    assert ranks[0]["trainable_params"] > 0
