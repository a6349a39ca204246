import pytest
import torch

pytest.importorskip("bitsandbytes")

from recipes_lib import calc, data, quantization
from recipes_lib.model import keep_4bit_compute_dtype, load_model


def _peft_at_least(version: str) -> bool:
    """The installed peft is ``version`` or newer: where a release changed plain peft's
    behaviour, the tests below check each version's (docs/upstream.md)."""
    import peft
    from packaging.version import Version

    return Version(peft.__version__) >= Version(version)


@pytest.fixture(scope="module")
def nf4_model(tiny_model_path):
    return load_model(tiny_model_path, dtype=torch.float32,
                      quantization_config=quantization.nf4_config(compute_dtype=torch.float32))


def test_quantized_bytes_equal_the_calculator(nf4_model, tiny_model_path):
    stats = quantization.quantized_linear_stats(nf4_model)
    assert stats["bytes"] == sum(calc.nf4_tensor_bytes(o, i) for o, i in stats["shapes"])
    bf16 = load_model(tiny_model_path, dtype=torch.bfloat16)
    ratio = stats["bytes"] / quantization.linear_weight_bytes(bf16, stats["names"])
    assert 0.25 < ratio <= 0.28


def test_dequantized_weights_are_close_to_the_originals(nf4_model, tiny_model_path):
    import bitsandbytes.functional as bf

    dense = load_model(tiny_model_path)
    w = nf4_model.model.layers[0].mlp.up_proj.weight
    deq = bf.dequantize_4bit(w.data, w.quant_state)
    ref = dense.model.layers[0].mlp.up_proj.weight
    rel = float((deq.float() - ref.detach()).norm() / ref.detach().norm())
    assert rel < 0.12  # NF4's typical relative error for normally distributed weights


def test_lora_adapter_roundtrip_is_bit_identical(tiny_model_path, tokenizer, tmp_path):
    cfg = quantization.nf4_config(compute_dtype=torch.float32)
    model = quantization.add_lora(load_model(tiny_model_path, quantization_config=cfg), r=4)
    trainable, total = quantization.trainable_fraction(model)
    assert 0 < trainable / total < 0.05
    with torch.no_grad():  # make the adapter non-trivial (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    rows = data.load_corpus("topic", "test").select(range(4))
    examples = data.tokenize_examples(rows, tokenizer, 128, "sft")
    batch = data.collate(examples, tokenizer.pad_token_id)
    model.save_pretrained(tmp_path)
    reloaded = quantization.reload_adapter(tiny_model_path, tmp_path, cfg, dtype=torch.float32)
    merged = quantization.reload_adapter(tiny_model_path, tmp_path, cfg, dtype=torch.float32,
                                         merge=True)
    args = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref = model.eval()(**args).logits
        assert torch.equal(reloaded(**args).logits, ref)
        torch.testing.assert_close(merged(**args).logits, ref, rtol=1e-4, atol=1e-4)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # Outside recipes_lib: plain peft on a plain 4-bit base, and plain transformers on the merge.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain_base = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32), device_map={"": "cpu"})
    # the files load with plain transformers and peft; the one change is a compute choice: on
    # AVX512-BF16 CPUs bitsandbytes' fused bf16 inference kernel would ignore the fp32 compute
    # dtype, so it is switched off as load_model does, for a like-for-like comparison
    keep_4bit_compute_dtype(plain_base)
    plain_adapter = PeftModel.from_pretrained(plain_base, str(tmp_path)).eval()
    merged.save_pretrained(tmp_path / "merged")
    plain_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(plain_adapter(**args).logits, ref)
        assert torch.equal(plain_merged(**args).logits, merged(**args).logits)


def test_held_bytes_split_4bit_layers_rest_of_base_and_adapters(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    dense = load_model(tiny_model_path)  # the reference: fp32 weights, no 4-bit layers
    cfg = quantization.nf4_config(compute_dtype=torch.bfloat16)
    prepared = quantization.add_lora(
        load_model(tiny_model_path, dtype=torch.bfloat16, quantization_config=cfg), r=4)
    held = quantization.held_bytes_by_kind(prepared)
    assert set(held) == set(quantization.HELD_KINDS)
    stats = quantization.quantized_linear_stats(prepared)
    assert held["4-bit layers"]["bytes"] == sum(calc.nf4_tensor_bytes(o, i)
                                                for o, i in stats["shapes"])
    rest = sum(p.numel() for p in dense.parameters()) - stats["params"]
    assert held["unquantized base"] == {"bytes": 4 * rest, "dtypes": ["float32"]}  # k-bit prep
    assert held["adapters"] == {"bytes": 4 * quantization.trainable_fraction(prepared)[0],
                                "dtypes": ["float32"]}
    # TRL's SFTTrainer path: no k-bit preparation, adapters cast to bf16
    trl_like = get_peft_model(
        load_model(tiny_model_path, dtype=torch.bfloat16, quantization_config=cfg),
        LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    for p in trl_like.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    trl_held = quantization.held_bytes_by_kind(trl_like)
    assert trl_held["4-bit layers"] == held["4-bit layers"]
    assert trl_held["unquantized base"] == {"bytes": 2 * rest, "dtypes": ["bfloat16"]}
    assert trl_held["adapters"]["bytes"] * 2 == held["adapters"]["bytes"]
    table = quantization.held_bytes_table({"course": held, "TRL": trl_held})
    assert table.loc["unquantized base (dtype)"].tolist() == ["float32", "bfloat16"]
    assert table.loc["4-bit layers (bytes)", "TRL"] == held["4-bit layers"]["bytes"]


def test_the_calculators_qlora_base_is_what_bitsandbytes_holds(tiny_model_path):
    """The escalation's QLoRA row: the decoder layers' linear weights in NF4 (with their scales
    and code tables), the embeddings, head and norms in bf16, as transformers loads the base:
    to the byte. Counting every weight at NF4's 0.516 bytes, as the row did, was 15 % under
    on this model and 40 % under on Llama-3.2-1B."""
    cfg = quantization.nf4_config(compute_dtype=torch.bfloat16)
    base = load_model(tiny_model_path, dtype=torch.bfloat16, quantization_config=cfg)
    held = quantization.held_bytes_by_kind(base.requires_grad_(False))  # the frozen base
    assert held["unquantized base"]["dtypes"] == ["bfloat16"]
    shape = calc.ModelShape.from_config(base.config)
    row = next(r for r in calc.escalation_table(shape, 64, 1, 2**40, 1, lora_fraction=0.0)
               if r["step"] == "QLoRA (NF4 base)")
    held_bytes = held["4-bit layers"]["bytes"] + held["unquantized base"]["bytes"]
    assert row["state_GiB"] * 2**30 == held_bytes


def test_bad_inputs(nf4_model, monkeypatch):
    with pytest.raises(ValueError, match="r=0"):
        quantization.add_lora(nf4_model, r=0)
    with pytest.raises(ValueError, match="dropout=1.5"):
        quantization.add_lora(nf4_model, dropout=1.5)
    with pytest.raises(ValueError, match="compute_dtype"):
        quantization.nf4_config(compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="no bitsandbytes 4-bit"):
        quantization.quantized_linear_stats(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model: has no bitsandbytes 4-bit"):
        quantization.held_bytes_by_kind(torch.nn.Linear(2, 2))
    monkeypatch.setattr(quantization, "has_module", lambda name: False)
    with pytest.raises(ImportError, match="needs bitsandbytes"):
        quantization.nf4_config()


def test_lora_with_checkpointing_trains(tiny_model_path, tokenizer):
    from recipes_lib.grad_accumulation import forward_backward

    cfg = quantization.nf4_config(compute_dtype=torch.float32)
    model = quantization.add_lora(load_model(tiny_model_path, quantization_config=cfg), r=4,
                                  gradient_checkpointing=True)
    assert model.get_base_model().is_activation_checkpointing
    rows = data.load_corpus("topic", "test").select(range(4))
    examples = data.tokenize_examples(rows, tokenizer, 128, "sft")
    batch = data.collate(examples, tokenizer.pad_token_id)
    model.train()
    forward_backward(model, batch)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_4bit_layers_keep_their_compute_dtype_on_every_cpu(nf4_model):
    """bitsandbytes' fused bf16 CPU kernel (AVX512-BF16 CPUs) stays off in what load_model gives."""
    layers = [m for m in nf4_model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    assert keep_4bit_compute_dtype(nf4_model) == 0  # nothing left to switch


def test_lora_says_which_linear_layers_peft_left_without_adapters(small_llama, monkeypatch):
    """On transformers 5, peft up to 0.21 maps the names an MoE's experts had in transformers 4
    (gate_proj, up_proj, down_proj) onto their 3-D parameters by name alone: DeepSeek-V3's dense
    first layer and shared experts lose their adapters under "all-linear". add_lora says which,
    as plain peft leaves them (every other linear layer wrapped); peft 0.22 adapts them, and
    add_lora says nothing, nor for a Llama."""
    import warnings

    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipes_lib import fake_memory, planner
    from recipes_lib.architectures import unadapted_linears
    from recipes_lib.fake_memory import Stack

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=1, n_group=1, topk_group=1)
    six = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")] + [
        f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    left = [] if _peft_at_least("0.22") else six

    def said(model):  # add_lora's warnings about layers left without adapters
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # no other filter: pytest.warns would re-raise peft's
            wrapped = quantization.add_lora(model, r=4)
        return wrapped, [str(w.message) for w in caught if "without adapters" in str(w.message)]

    lora, warnings_said = said(AutoModelForCausalLM.from_config(config))
    assert len(warnings_said) == bool(left)
    base = lora.get_base_model()
    adapted = {n for n, m in base.named_modules() if isinstance(m, BaseTunerLayer)}
    bare = [n for n, m in base.named_modules() if type(m) is torch.nn.Linear and ".layers." in n
            and not any(n.startswith(a + ".") for a in adapted) and n not in adapted]
    assert unadapted_linears(lora, "all-linear") == bare == left
    assert unadapted_linears(lora, ["gate_proj"]) == left[::3]
    assert unadapted_linears(lora, "mlp.*") == []  # a regular expression: peft's business
    info = fake_memory.expert_adapters(config)  # on the meta device, as the planner builds it
    assert info["unadapted"] == left and info["layers"] == 1
    out = {"notes": []}
    planner.note_expert_adapters(config, {"step": "LoRA", "measured_GiB": 1.0},
                                 Stack(method="lora", precision="bf16"), 32, 1, out)
    assert ("6 linear layers get no adapter (model.layers.0.mlp.gate_proj, "
            in "".join(out["notes"])) == bool(left), out["notes"]
    llama, none = said(small_llama)
    assert none == [] and unadapted_linears(llama, "all-linear") == []
    # what add_lora says where peft leaves them (peft 0.21's DeepSeek-V3, whatever is installed)
    monkeypatch.setattr(quantization, "unadapted_linears", lambda model, targets: six)
    _, [warning] = said(AutoModelForCausalLM.from_config(config))
    assert warning.startswith("target_modules='all-linear': peft left 6 linear layers of "
                              "DeepseekV3ForCausalLM without adapters (model.layers.0.mlp."
                              "gate_proj, "), warning


def _tiny_moe(model_type, **fields):
    """A 2-layer mixture of experts of ``model_type``, 4 experts (top 2), random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": 2} | fields
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))


def _wrapped_saying(model, **kw):
    """add_lora's model and the messages it warned with."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # no other filter: pytest.warns would re-raise peft's
        wrapped = quantization.add_lora(model, r=4, **kw)
    return wrapped, [str(w.message) for w in caught
                     if w.filename == __file__ or "recipes_lib" in w.filename]


@pytest.mark.parametrize("model_type, fields", [
    ("qwen2_moe", {"num_experts": 4, "shared_expert_intermediate_size": 32}),
    ("gpt_oss", {"num_local_experts": 4})])
def test_lora_says_which_routed_experts_peft_left_frozen_and_target_parameters_trains_them(
        model_type, fields):
    """peft maps no MLP name onto GPT-OSS's 3-D experts, nor up to 0.21 onto Qwen2-MoE's:
    "all-linear" leaves every expert frozen, as plain peft does. add_lora says so with the
    target_parameters that adapt them, and says nothing where peft adapts them (Qwen2-MoE from
    peft 0.22); with those targets, the adapted model's logits equal the base's (LoRA's B starts
    at zero) and one backward reaches every expert's adapters."""
    from peft import LoraConfig, get_peft_model

    from recipes_lib.architectures import frozen_experts

    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
               for p in ("gate_up_proj", "down_proj")]
    frozen_by_peft = model_type == "gpt_oss" or not _peft_at_least("0.22")
    plain = get_peft_model(_tiny_moe(model_type, **fields),
                           LoraConfig(r=4, target_modules="all-linear"))
    trained = [n for n, p in plain.named_parameters() if ".experts." in n and p.requires_grad]
    assert bool(trained) != frozen_by_peft, trained
    # transformers 5 keeps them as 3-D parameters, which "all-linear" cannot wrap as linear layers
    assert [n for n, p in _tiny_moe(model_type, **fields).named_parameters() if p.dim() == 3] == (
        experts)
    lora, said = _wrapped_saying(_tiny_moe(model_type, **fields))
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    if frozen_by_peft:
        assert frozen_experts(lora, "all-linear") == experts
        [said] = said
        assert said.startswith("target_modules='all-linear': peft adapted none of ") and \
            "routed experts (mlp.experts.gate_up_proj, mlp.experts.down_proj, in 2 layers)" in said
        assert said.endswith(f"target_parameters={targets!r} adapts them (one adapter per "
                             "expert)")
    else:
        assert frozen_experts(lora, "all-linear") == [] and said == []
    assert frozen_experts(lora, ["q_proj", "v_proj"]) == []  # the attention alone, on purpose
    base = _tiny_moe(model_type, **fields)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        reference = base(input_ids=ids).logits
    adapted, none = _wrapped_saying(base, target_parameters=targets)
    assert none == [] and frozen_experts(adapted, "all-linear") == []
    out = adapted(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, reference)
    out.loss.backward()
    grads = [n for n, p in adapted.named_parameters() if ".experts." in n and "lora_B" in n
             and p.grad is not None and p.grad.any()]  # B starts at zero, so A's grads do too
    assert len(grads) == 4  # both parameters of both layers
    with pytest.raises(ValueError, match=r"^target_parameters='mlp\.experts': a list"):
        quantization.add_lora(_tiny_moe(model_type, **fields), target_parameters="mlp.experts")


def test_peft_converts_qwen3_moe_and_gives_the_fused_gate_up_twice_the_rank():
    """Where peft converts (Qwen3-MoE), nothing is frozen: the fused gate_up_proj's adapter gets
    rank 2r (gate's r and up's r), the rank pattern peft's own check calls unmatched
    (known_warnings silences that message)."""
    from peft.tuners.lora.layer import ParamWrapper

    from recipes_lib.architectures import frozen_experts

    lora, said = _wrapped_saying(_tiny_moe("qwen3_moe", num_experts=4))
    assert said == [] and frozen_experts(lora, "all-linear") == []
    ranks = {m.parameter_name: m.r["default"] for m in lora.modules()
             if isinstance(m, ParamWrapper)}
    assert ranks == {"gate_up_proj": 8, "down_proj": 4, "weight": 4}, ranks  # weight: the router
    # Qwen3-Next's linear attention holds a 3-D conv1d weight: not an expert
    hybrid, said = _wrapped_saying(_tiny_moe("qwen3_next", num_experts=4))
    assert frozen_experts(hybrid, "all-linear") == []  # (its shared experts' warning is said)
    assert not any("peft adapted none of" in m for m in said), said
    assert any(p.dim() == 3 and "conv1d" in n for n, p in hybrid.named_parameters())


@pytest.mark.parametrize("model_type, fields, router", [
    ("llama4_text", {"num_local_experts": 4, "interleave_moe_layer_step": 1}, "Llama4Router"),
    ("phimoe", {"num_local_experts": 4}, "PhimoeTopKRouter")])
def test_a_router_returning_a_tuple_is_left_out_of_all_linear_and_refused_by_name(
        model_type, fields, router):
    """Llama 4's and Phi-3.5-MoE's routers are nn.Linear subclasses returning a tuple: peft's
    "all-linear" wraps them and its LoRA layer fails at the first forward. add_lora leaves them
    out, said aloud (and says the experts stay frozen); named, they are refused."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from recipes_lib.architectures import adapter_targets, not_linear_maps, unadapted_linears

    ids = torch.randint(0, 128, (2, 16))
    plain = get_peft_model(_tiny_moe(model_type, **fields),
                           LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'dtype'"):
        plain(input_ids=ids)
    model = _tiny_moe(model_type, **fields)
    assert not_linear_maps(model) == {"router": router}
    lora, said = _wrapped_saying(model)
    assert said[0].startswith(f"target_modules='all-linear': {type(model).__name__}'s router "
                              f"({router}) is an nn.Linear whose forward is not its linear "
                              "map"), said
    assert "peft adapted none of" in said[1]  # "all-linear" asked for the experts too
    wrapped = {n.rsplit(".", 1)[-1] for n, m in lora.get_base_model().named_modules()
               if isinstance(m, BaseTunerLayer) and ".layers." in n}
    assert wrapped == set(adapter_targets(model)) - {"router"}
    assert unadapted_linears(lora, "all-linear") == []  # the router, left out on purpose
    lora(input_ids=ids, labels=ids).loss.backward()
    from recipes_lib import trainers  # the Trainer settings the planner hands out
    from recipes_lib.architectures import meta_model
    from recipes_lib.fake_memory import Stack

    settings = trainers.stack_settings(Stack(method="lora"), 4,
                                       meta_model(model.config, quiet=True))
    assert settings["lora"]["target_modules"] == [t for t in adapter_targets(model)
                                                  if t != "router"]
    assert any(f"router ({router}) is an nn.Linear" in note for note in settings["notes"])
    with pytest.raises(ValueError, match=rf"^target_modules: 'router' names {router}, an "
                                         r"nn.Linear whose forward is not its linear map"):
        quantization.add_lora(_tiny_moe(model_type, **fields), target_modules=["q_proj", "router"])


def test_the_planner_measures_a_mixture_of_experts_with_its_frozen_experts_adapted():
    """GPT-OSS under "all-linear": expert_adapters reports the frozen experts (no adapted copy to
    keep), and the planner's note says so and measures the step again with the experts in
    target_parameters (Stack.lora_parameters), which the Trainer settings carry. That step on
    fake tensors is the real one, and it trains each expert's adapters on top of the
    "all-linear" ones."""
    import json
    from dataclasses import asdict

    from recipes_lib import fake_memory, planner, trainers
    from recipes_lib.fake_memory import Stack

    config = _tiny_moe("gpt_oss", num_local_experts=4).config
    lora = Stack(method="lora", precision="bf16")
    info = fake_memory.expert_adapters(config, lora)
    assert info["architecture"] == "GptOssForCausalLM" and len(info["frozen"]) == 4
    assert info["layers"] == info["adapter_params"] == info["layer_bytes"] == 0
    assert fake_memory.expert_adapters(config, Stack(method="lora", lora_targets=("q_proj",))) \
        is None
    experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    adapted = Stack(method="lora", precision="bf16", lora_parameters=experts)
    assert adapted.label == ("LoRA r=16 on all-linear and mlp.experts.gate_up_proj+"
                             "mlp.experts.down_proj, bf16, adamw")
    fake = fake_memory.measure_step(config, adapted, 32, 1)
    real = fake_memory.measure_step(config, adapted, 32, 1, fake=False)
    assert fake.by_category == real.by_category and fake.peak_bytes == real.peak_bytes
    shipped = json.loads(json.dumps(asdict(adapted)))  # as distributed.launch hands it to ranks
    assert fake_memory.real_rank_step(config.to_dict(), shipped, 32, 1) == real.by_category
    with_experts = fake_memory.expert_adapters(config, adapted)
    assert with_experts["frozen"] == [] and with_experts["layers"] == 2
    # rank 16 on 4 experts of gate_up (64 -> 2 x 64) and down (64 -> 64), per layer
    assert with_experts["adapter_params"] == 2 * 4 * 16 * ((64 + 128) + (64 + 64))
    out = {"notes": []}
    row = fake_memory.measure_step(config, lora, 32, 1).peak_bytes / 2**30
    planner.note_expert_adapters(config, {"step": "LoRA", "measured_GiB": row}, lora, 32, 1, out)
    [note] = out["notes"]
    assert note.startswith("target_modules='all-linear': peft adapted none of "
                           "GptOssForCausalLM's routed experts"), note
    assert out["expert_adapters"]["experts_adapted_GiB"] == fake.peak_bytes / 2**30 > row
    assert f"with target_parameters={list(experts)} too: " in note
    assert trainers.stack_settings(adapted, 1)["lora"]["target_parameters"] == list(experts)
    # the hub's GPT-OSS ships MXFP4 experts, which from_pretrained keeps over a BitsAndBytesConfig
    meta = planner.settings_model(config, adapted)
    code = trainers.format_settings(trainers.stack_settings(adapted, 1, meta), "openai/gpt-oss-20b")
    assert "quantization_config=Mxfp4Config(dequantize=True))" in code.splitlines()[0], code
    qlora = trainers.stack_settings(Stack(method="qlora", precision="bf16"), 1, meta)
    assert any(n.startswith("the hub's gpt_oss checkpoints ship MXFP4 experts, and from_pretrained"
                            " keeps") for n in qlora["notes"]), qlora["notes"]
    with pytest.raises(ValueError, match=r"^lora_parameters with method='full'"):
        Stack(lora_parameters=experts)
    with pytest.raises(ValueError, match=r"^lora_parameters='mlp\.experts': a tuple"):
        Stack(method="lora", lora_parameters="mlp.experts")


def test_a_linear_layer_whose_forward_refuses_a_plain_row_is_not_a_linear_map(small_llama):
    """DeepSeek-V4's grouped output projection (an nn.Linear of one group's width) splits its
    input into groups: a plain row is refused, and LoRA's update would not fit its output. The
    probe names it; transformers' Linear layers that are linear maps are not named."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    from recipes_lib.architectures import not_linear_maps

    assert not_linear_maps(small_llama) == {}
    small_llama.model.layers[0].self_attn.o_proj = DeepseekV4GroupedLinear(16, 64, n_groups=4)
    assert not_linear_maps(small_llama) == {"o_proj": "DeepseekV4GroupedLinear"}
