import pytest
import torch

from recipes_lib.numerics import collect_parameters, max_abs_diff
from recipes_lib.offload import CPUOffloadOptimizer
from recipes_lib.train import optimizer_step


def _run(model, opt, steps=5):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        model(x).square().mean().backward()
        optimizer_step(model, opt, max_grad_norm=0.05)  # clipping active
    return collect_parameters(model)


def test_offloaded_adamw_equals_plain_adamw_with_clipping():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    b = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    b.load_state_dict(a.state_dict())
    ref = _run(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1))
    off = CPUOffloadOptimizer(b.parameters(), lr=1e-2, weight_decay=0.1)
    got = _run(b, off)
    assert max_abs_diff(got, ref) <= 1e-6
    assert off.state_bytes("cpu") == 3 * sum(p.nbytes for p in b.parameters()) + 4 * 4


def test_scheduler_sees_the_inner_param_groups_and_bad_input():
    m = torch.nn.Linear(4, 4)
    off = CPUOffloadOptimizer(m.parameters(), lr=0.5)
    assert off.param_groups[0]["lr"] == 0.5
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="params: no parameter requires grad"):
        CPUOffloadOptimizer(m.parameters())


@pytest.mark.gpu
def test_offload_frees_device_optimizer_state():
    m = torch.nn.Linear(1024, 1024).cuda()
    off = CPUOffloadOptimizer(m.parameters(), lr=1e-3)
    m(torch.randn(8, 1024, device="cuda")).sum().backward()
    off.step()
    assert off.state_bytes("cuda") == 0 and off.state_bytes("cpu") > 0


def test_compare_with_adamw_trains_both_in_the_one_loop_to_the_same_weights(small_llama):
    import copy

    from recipes_lib import offload, train

    examples = [{"input_ids": list(range(3, 40)), "labels": list(range(3, 40))}] * 8
    runs = offload.compare_with_adamw(lambda: copy.deepcopy(small_llama), examples, 0,
                                      train.TrainConfig(steps=3, micro_batch_size=4, lr=1e-3,
                                                        weight_decay=0.01, progress=False))
    assert list(runs) == ["AdamW", "CPU-offloaded AdamW"]
    plain, off = runs["AdamW"], runs["CPU-offloaded AdamW"]
    assert plain["losses"][0] == off["losses"][0]  # same start
    assert max_abs_diff(off["parameters"], plain["parameters"]) <= 1e-6
    assert max_abs_diff(plain["parameters"], collect_parameters(small_llama)) > 0  # it trained
