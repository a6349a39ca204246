import pytest
import torch

from recipes_lib import litgpt_memory
from recipes_lib.fake_memory import Stack

pytest.importorskip("lit_gpt", reason="litgpt's model: pip install litgpt==0.1.0.dev1")

TINY = litgpt_memory.TINY
LORA = Stack(method="lora", precision="bf16", lora_rank=8, lora_targets=("q_proj", "v_proj"),
             lora_dropout=0.05, loss="litgpt", autocast_adapter_dtype=False, gpu_dropout=True)
QLORA = Stack(**{**LORA.__dict__, "method": "qlora", "nf4_keeps_input": True})


@pytest.mark.parametrize("stack", [LORA, QLORA, Stack(**{**LORA.__dict__, "precision": "fp32",
                                                         "gpu_dropout": False})],
                         ids=["lora", "qlora-bnb-0.41", "lora-fp32-cpu-dropout"])
def test_fake_step_equals_the_real_step_in_every_category(stack):
    """litgpt's model on fake tensors counts what a real step on this CPU allocates, category
    by category (its 4-bit layers through bitsandbytes' CPU kernels)."""
    if stack.method == "qlora":
        pytest.importorskip("bitsandbytes")
    fake = litgpt_memory.measure_step(TINY, stack, seq_len=160, batch_size=2)
    real = litgpt_memory.measure_step(TINY, stack, seq_len=160, batch_size=2, fake=False)
    assert real.peak_bytes > 0
    assert fake.by_category == real.by_category


def test_the_loss_is_litgpts_chunked_cross_entropy():
    """The loop's loss (summed, divided by the target count in ``forward_backward``) equals
    litgpt's own ``chunked_cross_entropy`` on the model's chunked logits, and the full
    cross-entropy over the concatenated logits (300 tokens: three chunks, the last short)."""
    from lit_gpt.utils import chunked_cross_entropy

    torch.manual_seed(0)
    stack = Stack(**{**LORA.__dict__, "precision": "fp32", "lora_dropout": 0.0,
                     "gpu_dropout": False})
    net, _ = litgpt_memory.build_model(TINY, stack, 256, fake=False)
    ids = torch.randint(0, TINY["vocab_size"], (2, 200))
    loss = litgpt_memory.LitGPTModelLoss()(net, {"input_ids": ids, "labels": ids})
    logits = net(ids, lm_head_chunk_size=litgpt_memory.CHUNK)
    logits[-1] = logits[-1][..., :-1, :]
    reference = chunked_cross_entropy(logits, ids[..., 1:])
    torch.testing.assert_close(loss / (2 * 199), reference)
    full = torch.nn.functional.cross_entropy(torch.cat(logits, 1).flatten(0, 1),
                                             ids[..., 1:].flatten())
    torch.testing.assert_close(reference, full)


@pytest.mark.parametrize("name, trainable", [("Llama-2-7b-hf", 4_194_304),
                                             ("Llama-2-13b-hf", 6_553_600),
                                             ("phi-1_5", 1_572_864),
                                             ("stablelm-base-alpha-3b", 2_097_152)])
def test_litgpts_models_train_the_sources_count(name, trainable):
    """LoRA r=8 on q and v of litgpt's own models trains what litgpt's resource table says."""
    net, _ = litgpt_memory.build_model(name, LORA, 1024)
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == trainable


def test_qlora_quantizes_every_linear_layer_the_heads_too():
    """Lightning's BitsandbytesPrecision, as litgpt's scripts call it, leaves no 16-bit
    linear layer: the 4-bit weights are NF4 with double quantization."""
    bnb = pytest.importorskip("bitsandbytes")
    net, _ = litgpt_memory.build_model(TINY, QLORA, 64)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
    assert isinstance(net.lm_head.linear, bnb.nn.Linear4bit)
    state = net.lm_head.linear.weight.quant_state
    assert state.quant_type == "nf4" and state.nested


@pytest.mark.parametrize("change, match", [
    ({"method": "full", "autocast_adapter_dtype": True}, "stack.method='full'"),
    ({"precision": "bf16-mixed"}, "stack.precision='bf16-mixed'"),
    ({"loss": "course"}, "stack.loss='course'"),
    ({"autocast_adapter_dtype": True}, "stack.autocast_adapter_dtype=True"),
    ({"lora_targets": ("q_proj", "query_key_value")}, "not 'query_key_value'"),
    ({"checkpointing": True}, "stack.checkpointing=True: litgpt's finetune/lora.py"),
    ({"grad_accum_steps": 2}, "stack.grad_accum_steps=2"),
])
def test_a_stack_litgpt_could_not_run_names_its_field(change, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        litgpt_memory.measure_step(TINY, Stack(**{**LORA.__dict__, **change}), 64)


def test_bad_model_and_sizes_name_the_parameter():
    with pytest.raises(ValueError, match="model='Llama-2-7B': not one of litgpt's .* config "
                                         "names .*Llama-2-7b-hf"):
        litgpt_memory.measure_step("Llama-2-7B", LORA, 64)
    with pytest.raises(ValueError, match="seq_len=600: litgpt's tiny-llama takes 2 to 512"):
        litgpt_memory.measure_step(TINY, LORA, 600)
    with pytest.raises(ValueError, match="batch_size=0"):
        litgpt_memory.measure_step(TINY, LORA, 64, batch_size=0)
