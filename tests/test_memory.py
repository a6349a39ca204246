import torch

from recipes_lib import memory


def test_categories_are_exact_for_a_linear_training_step():
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    param_bytes = sum(p.nbytes for p in model.parameters())

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer states now exist
    rep = memory.measure_memory(step, model, opt)
    assert rep.by_category["parameters"] == param_bytes
    assert rep.by_category["optimizer"] >= 2 * param_bytes  # exp_avg + exp_avg_sq (+ step)
    assert rep.peak_bytes >= param_bytes * 4  # params + grads + 2 moments
    assert rep.peak_bytes == sum(rep.by_category.values())


def test_activation_bytes_track_what_forward_saves_for_backward():
    model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 128))
    kept = []

    def forward(batch):
        return lambda: kept.append(model(torch.randn(batch, 128)))

    a = memory.measure_memory(forward(256), model).activation_bytes
    b = memory.measure_memory(forward(512), model).activation_bytes
    # ReLU's output (saved for both backward ops) + the final output: (1024 + 128) fp32 per row,
    # plus the input that the first Linear saves.
    assert a >= 256 * (1024 + 128) * 4
    assert 1.9 < b / a < 2.1


def test_tensor_bytes_counts_shared_storage_once():
    t = torch.zeros(100)
    assert memory.tensor_bytes([t, t[:10], t.view(10, 10)]) == 400
    assert memory.format_bytes(1536) == "1.50 KiB"


def test_several_forwards_in_one_measurement():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)

    def accumulate():
        for _ in range(3):
            model(x).sum().backward()

    rep = memory.measure_memory(accumulate, model)
    assert rep.by_category["gradients"] == sum(p.nbytes for p in model.parameters())


def test_frozen_parameters_are_measured_not_hooked():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    model[0].requires_grad_(False)
    rep = memory.measure_memory(lambda: model(torch.randn(4, 32)).sum().backward(), model)
    assert rep.by_category["parameters"] == sum(p.nbytes for p in model.parameters())
    assert rep.by_category["gradients"] <= sum(p.nbytes for p in model[1].parameters())


def test_tensor_bytes_looks_inside_nf4_tensors():
    from torchao.quantization import to_nf4

    w = to_nf4(torch.randn(128, 256, dtype=torch.bfloat16))
    packed = 128 * 256 // 2
    assert packed < memory.tensor_bytes([w]) < packed * 1.1
    frozen = torch.nn.Parameter(w, requires_grad=False)
    assert memory.tensor_bytes([frozen]) == memory.tensor_bytes([w])


def test_saved_tensor_bytes_by_dtype():
    lin = torch.nn.Linear(64, 64).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = memory.saved_tensor_bytes(lambda: torch.relu(lin(x)).float().sum())
    assert saved["torch.bfloat16"] >= 2 * 8 * 64 * 2  # x for the matmul, relu's output
    assert "torch.float32" not in saved  # weights (parameters) are not counted
