import pytest
import torch

from recipes_lib import fsdp, train_state


def test_decoder_layers_finds_every_block(small_llama):
    layers = fsdp.decoder_layers(small_llama)
    assert len(layers) == small_llama.config.num_hidden_layers
    with pytest.raises(ValueError, match="Linear has no decoder blocks"):
        fsdp.decoder_layers(torch.nn.Linear(2, 2))


def test_mixed_precision_policy():
    policy = fsdp.mixed_precision_policy("bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert fsdp.mixed_precision_policy("fp32").param_dtype is None
    with pytest.raises(ValueError, match="precision='int8'"):
        fsdp.mixed_precision_policy("int8")


def test_shard_model_needs_a_process_group(small_llama):
    with pytest.raises(RuntimeError, match="no process group"):
        fsdp.shard_model(small_llama)


def test_local_state_bytes_counts_params_grads_and_adam(small_llama):
    n = sum(p.numel() for p in small_llama.parameters())
    opt = torch.optim.AdamW(small_llama.parameters())
    small_llama(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8))
                ).loss.backward()
    opt.step()
    b = fsdp.local_state_bytes(small_llama, opt)
    assert b["parameters"] == 4 * n and b["gradients"] == 4 * n
    assert 8 * n <= b["optimizer"] <= 8 * n + 4 * len(opt.state)  # two moments + step counters
    assert b["total"] == b["parameters"] + b["gradients"] + b["optimizer"]


def test_train_sharded_rejects_bad_arguments(tiny_model_path):
    with pytest.raises(ValueError, match="strategy='zero9'"):
        fsdp.train_sharded(str(tiny_model_path), strategy="zero9")
    with pytest.raises(ValueError, match="use strategy='fsdp'"):
        fsdp.train_sharded(str(tiny_model_path), strategy="single", precision="bf16", steps=1,
                           global_batch_size=2)


def test_load_sharded_missing_folder(small_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint"):
        train_state.load_sharded(small_llama, torch.optim.AdamW(small_llama.parameters()),
                                 tmp_path / "missing")


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_fp16_under_fsdp_gets_the_sharded_grad_scaler(small_llama, one_rank_group):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from recipes_lib.train import make_grad_scaler

    assert make_grad_scaler(small_llama, "fp32", torch.device("cpu")) is None
    assert type(make_grad_scaler(small_llama, "fp16", torch.device("cpu"))) is torch.amp.GradScaler
    sharded = fsdp.shard_model(small_llama, precision="bf16")
    assert isinstance(make_grad_scaler(sharded, "fp16", torch.device("cpu")), ShardedGradScaler)
    assert sharded.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # fp32 master shards
