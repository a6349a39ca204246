import pytest
import torch

from recipes_lib import calc

LLAMA2_7B = calc.ModelShape(32000, 4096, 11008, 32, 32, 32)


def test_published_figures():
    assert calc.training_state_bytes(1, "bf16")["total"] == 16  # ZeRO: 2 + 2 + 4 + 8
    assert round(calc.param_count(LLAMA2_7B)["total"] / 1e9, 2) == 6.74
    assert round(calc.logits_bytes(4096, 8, 256_000, 2) / 1e9, 1) == 16.8
    assert calc.flops_per_token(10) == 60 and calc.flops_per_token(10, recompute=True) == 80


def test_qlora_7b_fits_a_t4_and_full_fine_tune_does_not():
    rows = calc.escalation_table(LLAMA2_7B, seq_len=512, batch_size=4, budget_bytes=16e9)
    assert not rows[0]["fits"]
    assert any(r["fits"] for r in rows if "QLoRA" in r["step"] or r["step"].startswith("+"))


def test_nf4_bytes_match_bitsandbytes_exactly():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from recipes_lib.memory import tensor_bytes
    from recipes_lib.quantization import _quant_tensors

    for double_quant in (True, False):
        layer = bnb.nn.Linear4bit(256, 192, bias=False, quant_type="nf4",
                                  compress_statistics=double_quant)
        layer.weight = bnb.nn.Params4bit(torch.randn(192, 256), requires_grad=False,
                                         quant_type="nf4", compress_statistics=double_quant)
        layer.weight = layer.weight._quantize("cpu")
        assert tensor_bytes(_quant_tensors(layer)) == calc.nf4_tensor_bytes(192, 256, double_quant)


def test_activation_formula_terms():
    none = calc.activation_bytes_per_layer(1024, 2, 512, 8, "none")
    sel = calc.activation_bytes_per_layer(1024, 2, 512, 8, "selective")
    full = calc.activation_bytes_per_layer(1024, 2, 512, 8, "full")
    sbh = 1024 * 2 * 512
    assert none == sbh * (34 + 5 * 8 * 1024 / 512) and sel == 34 * sbh and full == 2 * sbh
    assert calc.kv_cache_bytes(LLAMA2_7B, 4096, 1) == 2 * 32 * 4096 * 4096 * 2


def test_the_llama_layer_count_in_closed_form():
    """The op-by-op count's closed forms (``calc.llama_layer_bytes``' docstring), and peft's
    fp32 adapters keeping more than the full fine-tune they replace."""
    s = calc.PRESETS["Llama-3.2-1B"]
    h, kv, inter, heads = 2048, 512, 8192, 32
    full = calc.llama_layer_bytes(s, 2048, 1)
    lora = calc.llama_layer_bytes(s, 2048, 1, "lora", lora_rank=16)
    assert full["per_token"] == 20 * h + 4 * kv + 8 * inter + 4 * heads + 8
    assert lora["per_token"] == 36 * h + 4 * kv + 10 * inter + 4 * heads + 28 * 16 + 8
    assert full["total"] == 2048 * full["per_token"] and full["weight_copies"] == 0
    assert lora["per_token"] / 2048 == pytest.approx(77.285, abs=1e-3)
    bf16_adapters = calc.llama_layer_bytes(s, 2048, 1, "lora", fp32_adapters=False)
    assert bf16_adapters["per_token"] < full["per_token"] < lora["per_token"]
    mixed = calc.llama_layer_bytes(s, 2048, 1, "full", "bf16-mixed")
    assert mixed["weight_copies"] == 2 * calc.param_count(s)["linear"] / s.num_hidden_layers
    ckpt = calc.llama_layer_bytes(s, 2048, 1, "qlora", "bf16-mixed", checkpointing=True)
    assert ckpt["per_token"] == 4 * h
    fp32 = calc.llama_activation_bytes(s, 2048, 1, 4)["layers"] / s.num_hidden_layers
    assert fp32 == 2048 * (32 * h + 8 * kv + 16 * inter + 4 * heads + 8)


def test_the_gemma2_layer_count_against_the_llama_count():
    """Gemma-2's two more norms (weights multiplied in fp32), eager attention's 3 c q and 8 bytes
    per score where SDPA keeps c (2q + 2kv) and a log-sum-exp, o_proj's own copy of its input
    (c q), and each norm's 1 + weight."""
    shape = calc.ModelShape.from_config(calc.CONFIGS["Gemma-2-2B"])
    h, q, kv, heads = 2304, 2048, 1024, 8
    llama, gemma = (calc.llama_layer_bytes(shape, 1024, 1, gemma2=g) for g in (False, True))
    assert gemma["per_token"] - llama["per_token"] == (
        2 * (4 * h + 4) + 12 * h + 2 * (q - 2 * kv) - 4 * heads + 8 * heads * 1024 + 2 * q)
    assert gemma["weight_copies"] - llama["weight_copies"] == 16 * h
    # the cache's keys and values beside the repeated heads eager attention keeps, in bf16 too
    assert gemma["kv_cache"] == 2 * 2 * kv * 1024 and llama["kv_cache"] == 0


def test_the_kv_cache_a_training_forward_holds_beside_sdpas_casts():
    """fp32 keys under bf16 autocast (RoPE's cos has the residual stream's dtype), QLoRA's fp32
    values too; nothing where SDPA keeps the cache's own tensors, nor with checkpointing."""
    s = calc.PRESETS["Llama-2-7B"]
    kv, tokens = 4096, 2 * 1024

    def cache(method, precision, **kw):
        return calc.llama_layer_bytes(s, 1024, 2, method, precision, **kw)["kv_cache"]

    assert cache("qlora", "bf16-mixed") == 8 * kv * tokens
    assert cache("full", "bf16-mixed") == 4 * kv * tokens
    assert cache("full", "bf16") == cache("lora", "bf16") == cache("full", "fp32") == 0
    assert cache("qlora", "bf16-mixed", checkpointing=True) == 0
    assert cache("qlora", "bf16-mixed", kv_cache=False) == 0


def test_the_phi3_layer_count_against_the_llama_count():
    """Phi-3's fused projections: a full fine-tune keeps o_proj's own input (``c q``) more,
    and without a KV cache the fused output the value views (``c (q + kv)``); peft's fp32
    adapters cast the attention norm's output once, not three times, and the MLP norm's once,
    not twice, with four ``lora_A`` outputs, not seven."""
    s = calc.CONFIGS["Phi-3-mini-4k-instruct"]
    shape = calc.ModelShape.from_config(s)
    h, q, kv, r = 3072, 3072, 3072, 16
    full, lora = ({fused: calc.llama_layer_bytes(shape, 2048, 1, method,
                                                 fused_projections=fused)["per_token"]
                   for fused in (False, True)} for method in ("full", "lora"))
    assert full[True] - full[False] == 2 * q
    assert lora[True] - lora[False] == -(2 * 4 * h + 4 * h) - 3 * 4 * r
    no_cache = calc.llama_layer_bytes(shape, 2048, 1, fused_projections=True, kv_cache=False)
    assert no_cache["per_token"] - full[True] == 2 * (q + kv)
    assert calc.llama_layer_bytes(shape, 2048, 1, kv_cache=False)["per_token"] == full[False]
    with pytest.raises(ValueError, match=r"lora_targets=\('q_proj',\).*qkv_proj"):
        calc.llama_layer_bytes(shape, 8, 1, "lora", lora_targets=("q_proj",),
                               fused_projections=True)


def test_the_layer_count_of_a_gpus_dropout_and_of_bitsandbytes_before_0_43_2():
    """A GPU's dropout keeps a 1-byte mask where CPU's keeps fp32 noise (3 bytes less per
    adapted input); bitsandbytes' old 4-bit matmul kept each 4-bit layer's input, in bf16: the
    norms' outputs (one each, q, k and v share theirs, as gate and up do) and SwiGLU's product
    (SDPA's output, o_proj's input, is kept already), and under checkpointing SDPA's output
    too."""
    s = calc.PRESETS["Llama-3.2-1B"]
    h, inter = 2048, 8192
    qv = {"lora_targets": ("q_proj", "v_proj"), "lora_dropout": 0.05}
    cpu = calc.llama_layer_bytes(s, 2048, 1, "lora", **qv)["per_token"]
    gpu = calc.llama_layer_bytes(s, 2048, 1, "lora", gpu_dropout=True, **qv)["per_token"]
    assert cpu - gpu == 3 * 2 * h
    new = calc.llama_layer_bytes(s, 2048, 1, "qlora", fp32_adapters=False)["per_token"]
    old = calc.llama_layer_bytes(s, 2048, 1, "qlora", fp32_adapters=False,
                                 nf4_keeps_input=True)["per_token"]
    assert old == new  # bf16 adapters on every linear keep each input already
    q_only = {"lora_targets": ("q_proj",), "fp32_adapters": False}
    new = calc.llama_layer_bytes(s, 2048, 1, "qlora", "bf16", **q_only)["per_token"]
    old = calc.llama_layer_bytes(s, 2048, 1, "qlora", "bf16", nf4_keeps_input=True,
                                 **q_only)["per_token"]
    assert old - new == 2 * h + 2 * inter  # the MLP norm's output and SwiGLU's product
    ckpt = calc.llama_layer_bytes(s, 2048, 1, "qlora", "bf16", checkpointing=True,
                                  nf4_keeps_input=True)["per_token"]
    assert ckpt == 2 * h + (2 * h + 2 * h + 2 * h + 2 * inter)
    mixed = calc.llama_layer_bytes(s, 2048, 1, "qlora", "bf16-mixed", checkpointing=True,
                                   nf4_keeps_input=True)["per_token"]
    assert mixed == 4 * h + 2 * (3 * h + h + 2 * h + inter)  # a bf16 cast per module but o_proj


@pytest.mark.parametrize("call, match", [
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, "dora"), "method='dora'"),
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, precision="fp8"), "precision='fp8'"),
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, "lora", lora_targets=("qkv_proj",)),
     "lora_targets=\\('qkv_proj',\\)"),
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, "lora", lora_rank=0), "lora_rank=0"),
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, "lora", lora_dropout=1.0),
     "lora_dropout=1.0"),
    (lambda: calc.llama_layer_bytes(LLAMA2_7B, 8, 1, "lora", nf4_keeps_input=True),
     "nf4_keeps_input=True with method='lora'"),
    (lambda: calc.llama_activation_bytes(LLAMA2_7B, 8, 1, 1), "bytes_per_value=1"),
    (lambda: calc.bytes_per_param("int3"), "fmt='int3'"),
    (lambda: calc.optimizer_bytes(1, "lion"), "optimizer='lion'"),
    (lambda: calc.activation_bytes_per_layer(0, 1, 1, 1), "seq_len=0"),
    (lambda: calc.activation_bytes_per_layer(1, 1, 1, 1, "some"), "recompute='some'"),
    (lambda: calc.escalation_table(LLAMA2_7B, 512, 4, -1), "budget_bytes=-1"),
    (lambda: calc.lora_param_count(LLAMA2_7B, 0), "rank=0"),
    (lambda: calc.ModelShape.from_config({"hidden_size": 8}), "config:"),
])
def test_bad_inputs_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_data_parallel_bytes_follow_zero():
    shape = calc.PRESETS["Llama-3.1-8B"]
    p = calc.param_count(shape)["total"]
    ddp = calc.data_parallel_bytes(shape, 8, "ddp", 1024, 1)
    z2 = calc.data_parallel_bytes(shape, 8, "zero2", 1024, 1)
    fs = calc.data_parallel_bytes(shape, 8, "fsdp", 1024, 1)
    off = calc.data_parallel_bytes(shape, 8, "fsdp_offload", 1024, 1)
    assert ddp["state"] == 16 * p and z2["state"] == 2 * p + 14 * p / 8
    assert fs["state"] == 2 * p and off["state"] == 0 and off["cpu_total"] == 2 * p
    assert ddp["gpu_total"] > z2["gpu_total"] > fs["gpu_total"] > off["gpu_total"]
    assert round(p / 1e9, 2) == 8.03


def test_parallelism_table_picks_the_least_sharding_that_fits():
    rows = calc.parallelism_table(8, 80 * 2**30)
    assert [r["choose"] for r in rows] == ["ddp", "ddp", "zero2", "fsdp_offload"]
    tiny = calc.parallelism_table(8, 1.0)
    assert all(r["choose"] == "does not fit" for r in tiny)
    with pytest.raises(ValueError, match="strategy='zero1'"):
        calc.data_parallel_bytes(calc.PRESETS["Llama-3.2-1B"], 8, "zero1", 128, 1)
    with pytest.raises(ValueError, match="gpu_bytes=0"):
        calc.parallelism_table(8, 0)


# real sizes, built on the meta device (no memory): heads wider than hidden / heads (Qwen3,
# Gemma-2, Mistral-Nemo) and Gemma-2's sliding-window layers
WIDE_HEAD_CONFIGS = {
    "Qwen3-0.6B": ("Qwen3Config", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "tie_word_embeddings": True}),
    "Gemma-2-2B": ("Gemma2Config", {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "sliding_window": 4096}),
    "Mistral-Nemo-12B": ("MistralConfig", {
        "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 14336,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "sliding_window": None}),
}


@pytest.mark.parametrize("name", WIDE_HEAD_CONFIGS)
def test_parameter_count_follows_the_configs_head_dim(name):
    import transformers

    config_class, sizes = WIDE_HEAD_CONFIGS[name]
    config = getattr(transformers, config_class)(**sizes)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    shape = calc.ModelShape.from_config(config)
    assert shape.head_dim == sizes["head_dim"] != shape.hidden_size // shape.num_attention_heads
    # what the count leaves out (query/key norms, Gemma's extra norms) is below 0.01 % here
    assert calc.param_count(shape)["total"] == pytest.approx(real, rel=1e-4)


# real sizes of decoders with a plain (up, down) MLP, and two gated ones (Phi-3's gate_up fused)
MLP_CONFIGS = {
    "Pythia-1B": ({"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 2048,
                   "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_attention_heads": 8}, 2),
    "Phi-2": ({"model_type": "phi", "vocab_size": 51200, "hidden_size": 2560,
               "intermediate_size": 10240, "num_hidden_layers": 32, "num_attention_heads": 32,
               "partial_rotary_factor": 0.4}, 2),
    "StarCoder2-3B": ({"model_type": "starcoder2", "vocab_size": 49152, "hidden_size": 3072,
                       "intermediate_size": 12288, "num_hidden_layers": 30,
                       "num_attention_heads": 24, "num_key_value_heads": 2,
                       "bos_token_id": 0, "eos_token_id": 0}, 2),
    "Phi-3-mini": ({"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
                    "intermediate_size": 8192, "num_hidden_layers": 32,
                    "num_attention_heads": 32}, 3),
    "Llama-2-7B": ({"model_type": "llama", **{k: v for k, v in vars(LLAMA2_7B).items()
                                              if v is not None}}, 3),
}


@pytest.mark.parametrize("name", MLP_CONFIGS)
def test_parameter_count_follows_the_architectures_mlp(name):
    """A plain MLP has two matrices, a gated one three: Pythia-1B counted as gated was 1.28 B
    (published: 1.01 B), Phi-2 3.62 B (2.78 B), StarCoder2-3B 4.16 B (3.03 B)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields, matrices = MLP_CONFIGS[name]
    shape = calc.ModelShape.from_config(fields)
    assert shape.mlp_matrices == matrices
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    real = sum(p.numel() for p in model.parameters())
    # what the count leaves out (biases, LayerNorm's shifts) is below 0.1 % here
    assert calc.param_count(shape)["total"] == pytest.approx(real, rel=1e-3)


@pytest.mark.parametrize("name", MLP_CONFIGS)
def test_a_layers_linear_shapes_are_its_projections_then_its_mlp(name):
    """param_count and the QLoRA row both read these; the totals are checked against the
    models transformers builds above."""
    shape = calc.ModelShape.from_config(MLP_CONFIGS[name][0])
    shapes = calc.layer_linear_shapes(shape)
    assert len(shapes) == 4 + shape.mlp_matrices
    assert shapes[-1] == (shape.hidden_size, shape.intermediate_size)  # down


def test_the_adapters_count_is_what_peft_trains(small_llama):
    """peft's all-linear LoRA on a GQA Llama: the trainable parameters it reports."""
    from peft import LoraConfig, get_peft_model

    shape = calc.ModelShape.from_config(small_llama.config.to_dict())
    model = get_peft_model(small_llama, LoraConfig(r=4, target_modules="all-linear"))
    trainable, _ = model.get_nb_trainable_parameters()
    assert calc.lora_param_count(shape, 4) == trainable


def test_an_mlp_of_neither_kind_is_refused():
    with pytest.raises(ValueError, match="mlp_matrices=4"):
        calc.ModelShape(32000, 4096, 11008, 32, 32, 32, mlp_matrices=4)
    assert calc.ModelShape.from_config(vars(LLAMA2_7B)).mlp_matrices == 3  # no model_type


def test_model_shape_reads_which_layers_slide():
    import transformers

    gemma = calc.ModelShape.from_config(transformers.Gemma2Config(
        **WIDE_HEAD_CONFIGS["Gemma-2-2B"][1]))
    assert (gemma.sliding_window, gemma.sliding_layers) == (4096, 13)  # every other layer
    mistral = calc.ModelShape.from_config({**vars(LLAMA2_7B), "sliding_window": 4096})
    assert mistral.sliding_layers == 32  # a window and no layer types: every layer
    qwen = calc.ModelShape.from_config(transformers.Qwen2Config(sliding_window=4096,
                                                                use_sliding_window=False))
    assert (qwen.sliding_window, qwen.sliding_layers) == (None, 0)  # a window it does not use
    # a config.json that leaves the window out gets the class's default, as the model does
    bare = {k: v for k, v in WIDE_HEAD_CONFIGS["Gemma-2-2B"][1].items() if k != "sliding_window"}
    assert calc.ModelShape.from_config({"model_type": "gemma2", **bare}).sliding_layers == 13
    sizes = {k: v for k, v in vars(LLAMA2_7B).items() if v is not None}  # no sliding_window
    mistral = calc.ModelShape.from_config({"model_type": "mistral", **sizes})
    assert (mistral.sliding_window, mistral.sliding_layers) == (
        transformers.MistralConfig().sliding_window, 32)
    off = calc.ModelShape.from_config({"model_type": "mistral", **sizes,
                                       "sliding_window": None})  # Mistral-7B-v0.3's config.json
    assert (off.sliding_window, off.sliding_layers) == (None, 0)
    # beyond the window, only the full-attention layers' cache grows
    grown = calc.kv_cache_bytes(gemma, 8192, 1) - calc.kv_cache_bytes(gemma, 4096, 1)
    assert grown == 13 * 4096 * calc.kv_cache_bytes_per_token(gemma) / 26
    with pytest.raises(ValueError, match="sliding_layers"):
        calc.ModelShape(32000, 4096, 11008, 32, 32, 32, sliding_layers=2)
    with pytest.raises(ValueError, match="sliding_window"):
        calc.ModelShape(32000, 4096, 11008, 32, 32, 32, sliding_window=0, sliding_layers=2)


@pytest.mark.parametrize("model_type, softcap", [("llama", None), ("gemma2", 50.0),
                                                 ("gemma2", None)])
def test_eager_attentions_score_bytes_are_what_autograd_keeps(model_type, softcap):
    """The bytes per score (batch x heads x s x s) that ModelShape counts for an architecture
    transformers runs with eager attention, against the tensors autograd saves, counted with
    saved-tensor hooks in a real bf16-autocast forward of one eager layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"attn_logit_softcapping": softcap, "head_dim": 32} if model_type == "gemma2" else {}
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=128, **extra)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).train()
    s, heads = 96, 2
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (s, s):  # a score-sized tensor, once per storage
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(64, (1, s)))
    per_score = sum(kept.values()) / (heads * s * s)
    expected = calc.EAGER_SCORE_BYTES + (calc.SOFTCAP_SCORE_BYTES if softcap else 0)
    assert per_score == expected
    if model_type == "gemma2":  # transformers has no SDPA for it: the shape carries the count
        assert calc.ModelShape.from_config(config).score_bytes == expected
    else:  # Llama has SDPA: a flash kernel keeps no scores, nothing to count
        assert calc.ModelShape.from_config(config).score_bytes == 0


def test_a_shape_with_score_bytes_counts_its_scores_even_where_flash_is_asked():
    sdpa = calc.ModelShape(1000, 256, 512, 4, 4, 2)
    eager = calc.ModelShape(1000, 256, 512, 4, 4, 2, score_bytes=8)
    s, b = 512, 2
    for recompute, layers in (("none", 4), ("full", 1), ("selective", 0)):
        gap = (calc.activation_bytes(eager, s, b, recompute, flash_attention=True)["total"]
               - calc.activation_bytes(sdpa, s, b, recompute, flash_attention=True)["total"])
        assert gap == layers * 8 * 4 * s * s * b  # full: the layer recomputed in backward


DENSE_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
                  "phi3", "olmo2", "granite", "cohere", "smollm3", "starcoder2", "gpt_neox",
                  "stablelm", "glm4", "exaone4", "helium")


def test_the_count_check_passes_dense_decoders_and_refuses_hybrids():
    """At each architecture's default (full-size) config, built on the meta device: what the
    formulas leave out of a dense decoder stays under 0.2 %; a hybrid's layers miss by more
    than the 1 % tolerance and are refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for model_type in DENSE_DECODERS:
        config = AutoConfig.for_model(model_type)
        calc.check_counted(config, model_type)
        with torch.device("meta"):
            real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        counted = calc.param_count(calc.ModelShape.from_config(config))["total"]
        assert counted == pytest.approx(real, rel=2e-3), model_type
    for model_type in ("qwen3_5_text", "lfm2", "falcon_h1", "recurrent_gemma"):
        with pytest.raises(ValueError, match=f"^{model_type}: the calculator counts"):
            calc.check_counted(AutoConfig.for_model(model_type), model_type)
    calc.check_counted({"hidden_size": 64})  # not a transformers config: nothing to build
    # Gemma-4: global layers twice as wide in head_dim; transformers refuses to read head_dim
    # for the whole model (a RuntimeError a caller catching ValueError would not see)
    with pytest.raises(ValueError, match=r"^config: a 'gemma4_text' config whose layers differ "
                                         r"in head_dim \(per_layer_config, layers 5, 11, 17, 23, "
                                         r"29\).*fake_memory.measure_step"):
        calc.ModelShape.from_config(AutoConfig.for_model("gemma4_text"))
