import pytest
import torch

from recipes_lib import calc, ptq


def test_int8_linear_close_to_fp32():
    lin = torch.nn.Sequential(torch.nn.Linear(256, 128))
    q = ptq.quantize_int8_dynamic(lin)
    x = torch.randn(64, 256)
    ref, out = lin(x), q(x)
    # per-channel int8 weights + per-tensor int8 activations: relative error of ~1 %
    assert ((out - ref).norm() / ref.norm()).item() < 0.02


def test_model_bytes_match_the_calculator(small_llama):
    q = ptq.quantize_int8_dynamic(small_llama)
    stats = ptq.int8_linear_bytes(q)
    shapes = [(small_llama.get_submodule(n).out_features, small_llama.get_submodule(n).in_features)
              for n in ptq.linear_names(small_llama)]
    assert stats["bytes"] == sum(calc.int8_linear_bytes(o, i) for o, i in shapes)
    assert stats["params"] == sum(o * i for o, i in shapes)
    # the original is untouched
    assert all(type(small_llama.get_submodule(n)) is torch.nn.Linear
               for n in ptq.linear_names(small_llama))


def test_logits_close_and_skip_keeps_layers_fp32(small_llama):
    ids = torch.randint(0, 128, (2, 16))
    q = ptq.quantize_int8_dynamic(small_llama, skip=["lm_head"])
    assert type(q.lm_head) is torch.nn.Linear
    with torch.no_grad():
        ref, out = small_llama(input_ids=ids).logits, q(input_ids=ids).logits
    assert float((out - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_sensitivity_and_outliers(small_llama):
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def loss(m):
        with torch.no_grad():
            return float(m(input_ids=ids, labels=ids).loss)
    names = ptq.linear_names(small_llama)[:3]
    sens = ptq.layer_sensitivity(small_llama, loss, names, progress=False)
    assert set(sens) == set(names)
    out = ptq.activation_outliers(small_llama, batch)
    assert set(out) == set(ptq.linear_names(small_llama)) and min(out.values()) >= 1.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="no torch.nn.Linear"):
        ptq.quantize_int8_dynamic(torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1)))
    with pytest.raises(ValueError, match="skip"):
        ptq.quantize_int8_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), skip=["nope"])
    with pytest.raises(ValueError, match="all were skipped"):
        ptq.quantize_int8_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), skip=["0"])
    with pytest.raises(ValueError, match="fp32 CPU"):
        ptq.quantize_int8_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)).half())
    with pytest.raises(ValueError, match="no int8 Linear"):
        ptq.int8_linear_bytes(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_amdahl():
    assert calc.amdahl_speedup(1.0, 2.0) == 2.0 and calc.amdahl_speedup(0.0, 9.0) == 1.0
    with pytest.raises(ValueError, match="fraction"):
        calc.amdahl_speedup(1.5, 2.0)


def test_the_deprecated_int8_api_is_still_there():
    # ptq keeps torch.ao's dynamic int8 on CPU because torchao's kept API is ~15x slower here
    # (module docstring). When this fails, move quantize_int8_dynamic to quantize_int8_torchao.
    from torch.ao import quantization

    assert callable(getattr(quantization, "quantize_dynamic", None)), \
        "torch.ao.quantization.quantize_dynamic is gone: switch ptq to quantize_int8_torchao"


def test_torchao_int8_agrees_with_the_torch_ao_path(small_llama):
    ids = torch.randint(0, 128, (2, 16))
    with torch.inference_mode():
        ref = small_llama(input_ids=ids).logits
        old = ptq.quantize_int8_dynamic(small_llama)(input_ids=ids).logits
        new = ptq.quantize_int8_torchao(small_llama)(input_ids=ids).logits
    # both int8 (per-channel weights, dynamic activations): each within a few % of fp32
    for out in (old, new):
        assert float((out - ref).norm() / ref.norm()) < 0.05


def test_compare_int8_backends_times_every_path(small_llama):
    ids = torch.randint(0, 128, (2, 16))
    out = ptq.compare_int8_backends(small_llama, {"input_ids": ids}, repeats=1,
                                    compile_torchao=False)
    assert set(out) == {"fp32", "torch.ao dynamic int8", "torchao int8 (eager)"}
    assert out["fp32"]["speedup_vs_fp32"] == 1.0 and out["fp32"]["max_abs_logit_diff"] == 0.0
    assert all(r["seconds"] > 0 and r["max_abs_logit_diff"] < 1.0 for r in out.values())


def test_the_int8_backends_are_recorded_with_the_claim_for_ours(small_llama, tmp_path):
    from recipes_lib.results import Results

    r = Results("ptq_test", "cpu", tmp_path)
    ids = torch.randint(0, 128, (2, 16))
    out = ptq.check_int8_backends(r, small_llama, {"input_ids": ids}, repeats=1,
                                  compile_torchao=False, strict=False)
    for name, row in out.items():
        assert r.get("int8", f"prefill_speedup, {name}").value == row["speedup_vs_fp32"]
    assert r.get("int8", "max_logit_diff, torchao int8 (eager)").value == pytest.approx(
        out["torchao int8 (eager)"]["max_abs_logit_diff"])
    (claim,) = r.claims
    assert claim.value == pytest.approx(out["torchao int8 (eager)"]["seconds"]
                                        / out["torch.ao dynamic int8"]["seconds"])


def test_weight_only_int8_is_close_to_fp32_and_a_quarter_of_its_bytes():
    from recipes_lib.memory import tensor_bytes

    mlp = ptq._mlp(256)
    wo = ptq.quantize_int8_weight_only(mlp)
    x = torch.randn(1, 256)
    with torch.inference_mode():
        ref, out = mlp(x), wo(x)
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.02
    assert tensor_bytes(wo.parameters()) / tensor_bytes(mlp.parameters()) < 0.27


def test_int8_sweeps_time_each_size():
    dec = ptq.decode_sweep([64, 128, 256], repeats=1, compile_weight_only=False)
    assert dec.sizes == [64, 128, 256] and set(dec.extra) == {"dynamic int8"}
    pre = ptq.prefill_sweep([1, 8, 64], hidden=128, repeats=1)
    assert len(pre.speedups) == 3 and pre.recipe == "int8" and pre.dimension == "rows"
    with pytest.raises(ValueError, match="at least three sizes"):
        ptq.decode_sweep([64, 128], compile_weight_only=False)
    bf16 = ptq.decode_sweep([64, 128, 256], repeats=1, compile_weight_only=False,
                            dtype=torch.bfloat16)
    assert bf16.recipe == "int8_weight_only_bf16" and set(bf16.extra) == {"fp32"}
    with pytest.raises(ValueError, match="dtype=torch.int8: decode_sweep takes"):
        ptq.decode_sweep([64, 128, 256], compile_weight_only=False, dtype=torch.int8)


def test_compiled_weight_only_int8_reads_int8_weights_only_with_bf16_activations():
    """What the decode sweep's text says: with bf16 activations Inductor lowers torchao's
    weight-only int8 to PyTorch's CPU kernel; with fp32 (or fp16) ones it writes the
    dequantized weight and runs an ordinary matmul (why it wins at no width in fp32)."""
    from torch._inductor.utils import run_and_get_code

    from recipes_lib.compiling import compile_available

    if not compile_available("cpu")[0]:
        pytest.skip("no C++ compiler for torch.compile")
    for dtype, lowered in ((torch.bfloat16, True), (torch.float32, False), (torch.float16, False)):
        wo = ptq.quantize_int8_weight_only(ptq._mlp(64).to(dtype))
        torch._dynamo.reset()
        with torch.inference_mode():
            _, code = run_and_get_code(torch.compile(wo), torch.randn(1, 64, dtype=dtype))
        assert ("_weight_int8pack_mm" in "".join(code)) == lowered, dtype
