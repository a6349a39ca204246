"""Every recipe function on every architecture the course names, at the smallest size: the
blocks, adapter targets, head and attention each recipe touches are found without Llama names,
and each recipe still equals its reference there (tied heads and Gemma-2's soft-capping
included)."""

import warnings

import pytest
import torch

from recipes_lib import architectures, checkpointing, chunked_loss, data, distillation
from recipes_lib import model as models
from recipes_lib.memory import saved_tensor_bytes

ARCHS = models.ARCHITECTURES
# what transformers calls the linear layers of one block (checked, not derived, here)
TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
}
TIED = {"qwen2", "qwen3", "gemma2"}


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request):
    return request.param, models.build_tiny_model(spec=models.TinyModelSpec.smallest(
        request.param), progress=False)


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has no SDPA attention")
        return models.load_model(path, **kw)


def _batch(path, n=3, length=96):
    tok = models.load_tokenizer(path)
    examples = data.tokenize_examples(data.load_corpus("topic", "train").select(range(n)), tok,
                                      length, "sft")
    return data.collate(examples, tok.pad_token_id)


def test_blocks_targets_and_head_are_found_without_llama_names(arch_path):
    arch, path = arch_path
    model = _load(path)
    info = architectures.describe(model)
    assert info["blocks"].startswith(f"{model.config.num_hidden_layers} x ")
    expected = TARGETS.get(arch, TARGETS["llama"])
    assert sorted(info["adapter_targets"]) == sorted(expected)
    assert info["tied_embeddings"] == (arch in TIED)
    assert (info["final_logit_softcap"] is not None) == (arch == "gemma2")


def test_load_says_which_attention_ran(arch_path):
    arch, path = arch_path
    if arch == "gemma2":
        with pytest.warns(UserWarning, match="Gemma2ForCausalLM has no SDPA.*'eager'"):
            model = models.load_model(path)
    else:
        model = models.load_model(path)
    assert model.config._attn_implementation == ("eager" if arch == "gemma2" else "sdpa")


def test_chunked_ce_equals_the_models_own_loss_and_gradients(arch_path):
    _, path = arch_path
    model, batch = _load(path, dtype=torch.float64), _batch(path)
    n = int((batch["labels"][:, 1:] != -100).sum())
    # transformers' own loss upcasts to fp32: the reference is its fp64 logits (soft-capped)
    logits = model(**batch).logits[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())
    (g_ref,) = torch.autograd.grad(ref, architectures.lm_head_weight(model))
    got = chunked_loss.ChunkedCausalLMLoss(chunk_size=16)(model, batch) / n
    (g_got,) = torch.autograd.grad(got, architectures.lm_head_weight(model))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-9, atol=1e-12)


def test_distillation_equals_kd_on_full_logits(arch_path):
    _, path = arch_path
    teacher, batch = _load(path, dtype=torch.float64), _batch(path)
    student = distillation.make_student(teacher, 0.5, 0.5).double()
    assert type(student) is type(teacher) and distillation.param_ratio(student, teacher) < 0.5
    labels = batch["labels"][:, 1:]
    ref = distillation.kd_loss(student(**batch).logits[:, :-1], teacher(**batch).logits[:, :-1],
                               labels, temperature=2.0, alpha=0.5)
    got = distillation.DistillationLoss(teacher, 2.0, 0.5, chunk_size=16)(student, batch)
    torch.testing.assert_close(got / (labels != -100).sum(), ref, rtol=1e-10, atol=1e-10)


def test_checkpointing_keeps_gradients_and_saves_fewer_activations(arch_path):
    _, path = arch_path
    model, batch = _load(path, dtype=torch.float64), _batch(path)

    def grads():
        model.zero_grad()
        saved = sum(saved_tensor_bytes(lambda: model(**batch).loss.backward()).values())
        return saved, [p.grad.clone() for p in model.parameters()]

    saved_plain, g_plain = grads()
    checkpointing.enable_activation_checkpointing(model.train())
    saved_ckpt, g_ckpt = grads()
    assert saved_ckpt < 0.7 * saved_plain, (saved_ckpt, saved_plain)
    for a, b in zip(g_plain, g_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_qlora_adapts_every_block_linear_and_trains(arch_path):
    pytest.importorskip("bitsandbytes")
    from recipes_lib import quantization
    from recipes_lib.train import TrainConfig, train

    _, path = arch_path
    model = quantization.add_lora(_load(path, quantization_config=quantization.nf4_config(
        compute_dtype=torch.float32)), r=4)
    targets = architectures.adapter_targets(model)
    assert targets == architectures.adapter_targets(model.get_base_model())
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_B")]
    assert len(adapted) == len(targets) * model.config.num_hidden_layers
    tok = models.load_tokenizer(path)
    examples = data.tokenize_examples(data.load_corpus("topic", "train").select(range(2)), tok,
                                      96, "sft")
    run = train(model, examples, tok.pad_token_id, TrainConfig(steps=1, micro_batch_size=2,
                                                               lr=1e-2, progress=False))
    assert all(torch.isfinite(torch.tensor(run.losses)))
    assert all(bool(m.weight.abs().sum() > 0) for n, m in model.named_modules()
               if n.endswith(".lora_B.default"))


def test_fsdp2_shards_the_architectures_own_blocks(arch_path, tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from recipes_lib import fsdp

    _, path = arch_path
    model, batch = _load(path), _batch(path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        sharded = fsdp.shard_model(model)
        blocks = architectures.decoder_layers(sharded)
        assert len(blocks) == model.config.num_hidden_layers
        assert all(isinstance(b, FSDPModule) for b in blocks) and isinstance(sharded, FSDPModule)
        sharded(**batch).loss.backward()
    finally:
        dist.destroy_process_group()
    assert all(p.grad is not None for p in sharded.parameters())


def test_nf4_lora_adapts_the_architectures_own_linears(arch_path):
    """Under FSDP2 on 2 real ranks: ``test_fsdp_qlora.py`` (Llama) and the Phi-3 run there."""
    pytest.importorskip("torchao")
    from recipes_lib import fsdp_qlora

    arch, path = arch_path
    model = fsdp_qlora.apply_nf4_lora(_load(path), r=4, alpha=8)
    swapped = [m for m in model.modules() if isinstance(m, fsdp_qlora.NF4LoRALinear)]
    n_targets = len(TARGETS.get(arch, TARGETS["llama"]))
    assert len(swapped) == n_targets * model.config.num_hidden_layers
    loss = model(**_batch(path)).loss
    loss.backward()
    assert torch.isfinite(loss) and all(m.lora_b.weight.grad is not None for m in swapped)


def test_blockwise_attention_plugs_in_and_equals_the_model_s_own(arch_path):
    from recipes_lib import sparse_attention

    arch, path = arch_path
    model, batch = _load(path, dtype=torch.float64), _batch(path)
    ref = model(**batch).logits
    # Gemma-2's soft-capped scores and alternating sliding layers go through it too
    model.set_attn_implementation(sparse_attention.register_with_transformers(None))
    got = model(**batch).logits
    keep = batch["attention_mask"].bool()
    # Gemma-2 has no SDPA path: its reference is transformers' eager attention, whose softmax
    # runs in fp32 whatever the model's dtype (fp32 rounding, ~1e-7 of the scores)
    tol = 1e-5 if arch == "gemma2" else 1e-9
    torch.testing.assert_close(got[keep], ref[keep], rtol=tol, atol=tol)


def test_an_architecture_without_what_a_recipe_needs_is_named():
    class NoBlocks(torch.nn.Module):
        _no_split_modules = ("MissingBlock",)

    with pytest.raises(ValueError, match=r"NoBlocks has no decoder blocks.*MissingBlock"):
        architectures.decoder_layers(NoBlocks())

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Conv1d(4, 4, 1)

    class ConvOnly(torch.nn.Module):
        _no_split_modules = ("Block",)

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block()])

    with pytest.raises(ValueError, match="ConvOnly's decoder blocks hold no nn.Linear"):
        architectures.adapter_targets(ConvOnly())


def test_lora_targets_another_architecture_names_are_refused_with_this_ones(arch_path):
    _, path = arch_path
    model = _load(path)
    own = architectures.adapter_targets(model)
    architectures.check_adapter_targets(model, list(own))  # its own names, and suffixes, pass
    architectures.check_adapter_targets(model, "all-linear")
    foreign = [t for t in TARGETS["llama"] + TARGETS["phi3"] if t not in own]
    with pytest.raises(ValueError) as err:
        architectures.check_adapter_targets(model, [own[0]] + foreign)
    message = str(err.value)
    assert message.startswith("target_modules: ") and repr(own[0]) not in message
    assert all(repr(t) in message for t in foreign) and ", ".join(own) in message


def test_fake_tensors_measure_every_architecture_exactly(arch_path):
    """The fake-tensor meter builds each architecture with the attention transformers has for
    it (Gemma-2: eager, its s x s scores counted) and counts what a real step allocates."""
    from transformers import AutoConfig

    from recipes_lib import fake_memory

    arch, path = arch_path
    config = AutoConfig.from_pretrained(path)
    assert architectures.supports_sdpa(config) == (arch != "gemma2")
    assert architectures.default_attention(config) == ("eager" if arch == "gemma2" else "sdpa")
    if arch not in ("gemma2", "phi3"):  # the eager path and the fused projections; the rest
        return                          # are Llama's path, which test_fake_memory covers
    r = fake_memory.fake_vs_real(config, fake_memory.Stack(method="lora", checkpointing=True),
                                 seq_len=64, batch_size=2)
    assert r["fake"].by_category == r["real"].by_category and r["peak_ratio"] == 1.0


@pytest.mark.parametrize("name, scaling", [("CohereConfig", {}),
                                           ("GraniteConfig", {"logits_scaling": 4.0})])
def test_a_model_that_rescales_its_logits_is_refused_by_the_chunked_losses(name, scaling):
    # the chunked losses multiply by the head's weight (and apply Gemma-2's soft cap); Cohere's
    # logit_scale and Granite's logits_scaling act after the head, so they would be left out
    import transformers

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 2}
    config = getattr(transformers, name)(**sizes, **scaling)
    model = transformers.AutoModelForCausalLM.from_config(config)
    attr = next(a for a in architectures.HEAD_SCALINGS if getattr(config, a, None) not in (None, 1))
    with pytest.raises(ValueError, match=f"applies config.{attr}="):
        architectures.lm_head_weight(model)
    if name == "GraniteConfig":  # its default, 1, changes nothing
        plain = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**sizes))
        assert architectures.lm_head_weight(plain) is plain.get_output_embeddings().weight


def test_a_course_loss_runs_as_the_forward_of_a_wrapped_model(small_llama, varlen_batch):
    """A loss that reads the decoder and the head itself (``bypasses_forward``) runs inside the
    wrapper's own call (where DDP prepares its all-reduce and an FSDP2 root gathers the
    embeddings and the head; DataParallel stands in for them on one CPU): the same loss and
    gradients as on the bare model, the wrapper's hooks run, and the model's forward is its own
    again afterwards, an instance attribute such as accelerate's autocast wrapper included. A
    loss that calls the model itself gets the wrapper, as before."""
    from recipes_lib.grad_accumulation import batch_gradients, forward_backward

    loss = chunked_loss.ChunkedCausalLMLoss(chunk_size=16)
    bare = batch_gradients(small_llama, varlen_batch)
    wrapped = torch.nn.DataParallel(small_llama)
    calls = []
    wrapped.register_forward_pre_hook(lambda mod, args: calls.append("wrapper"))
    wrapped_loss = forward_backward(wrapped, varlen_batch, 2, loss_fn=loss)
    got = {n.removeprefix("module."): p.grad for n, p in wrapped.named_parameters()}
    assert calls == ["wrapper", "wrapper"]  # one call a micro-batch
    assert max(float((got[n] - g).abs().max()) for n, g in bare.items()) < 1e-6
    small_llama.zero_grad(set_to_none=True)
    assert float(wrapped_loss) == pytest.approx(float(forward_backward(small_llama, varlen_batch,
                                                                       2, loss_fn=loss)))
    assert "forward" not in vars(small_llama)
    # a loss that calls the model itself (bypasses_forward unset) is handed the wrapper
    from recipes_lib.fake_memory import TransformersLoss

    calls.clear()
    assert float(forward_backward(wrapped, varlen_batch, 2, loss_fn=TransformersLoss())) == \
        pytest.approx(float(wrapped_loss))
    assert calls == ["wrapper", "wrapper"]
    own = small_llama.forward
    small_llama.forward = own  # an instance attribute, as accelerate's prepare sets
    architectures.through_wrappers(wrapped, lambda m: None)
    assert vars(small_llama)["forward"] is own
