"""torch.compile as a recipe: the compiled step equals eager, its cost and break-even are
counted, and a machine without a compiler gets a clear error."""

import math

import pytest
import torch

from recipes_lib import compiling
from recipes_lib.model import small_llama


def test_break_even_is_compile_time_over_the_gain():
    assert compiling.break_even_calls(0.010, 0.006, 2.0) == pytest.approx(500.0)
    assert compiling.break_even_calls(0.010, 0.012, 2.0) == math.inf


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    ok, why = compiling.compile_available("cpu")
    assert not ok and "C++ compiler" in why
    assert compiling.warm_up.__wrapped__("cpu") == 0.0  # nothing to warm: the error comes later
    with pytest.raises(ValueError, match="device='cpu': torch.compile is not available here"):
        compiling.require_compile("cpu")
    with pytest.raises(ValueError, match="torch.compile is not available"):
        compiling.width_sweep([32, 64, 128])


def test_sweep_sizes_are_checked_before_anything_compiles():
    with pytest.raises(ValueError, match="hidden_sizes=\\[32, 64\\]: a sweep needs at least three"):
        compiling.width_sweep([32, 64])
    with pytest.raises(ValueError, match="num_hidden_layers=0: must be >= 1"):
        compiling.width_sweep([32, 64, 128], num_hidden_layers=0)


def test_the_width_sweeps_models_have_the_depth_asked_for(monkeypatch):
    """Notebook 03 sweeps 1-layer models at the CI size and 2-layer ones in make run."""
    from recipes_lib.timing import Timing

    depths = []

    def step(make, batch, repeats):
        depths.append(make().config.num_hidden_layers)
        return compiling.CompileComparison(Timing(0.01, [0.01]), Timing(0.005, [0.005]), 1.0, 0.0)
    monkeypatch.setattr(compiling, "training_step", step)
    monkeypatch.setattr("recipes_lib.sweep.machine_peaks", lambda device: None)  # not timed here
    compiling.width_sweep([32, 64, 128], seq_len=16, num_hidden_layers=3, repeats=1)
    compiling.width_sweep([32, 64, 128], seq_len=16, repeats=1)
    assert depths == [3, 3, 3, 2, 2, 2]


def test_a_timed_first_compile_leaves_the_process_one_time_costs_out(monkeypatch):
    """What only a process's first compilation pays (Inductor's instruction-set probe, its
    worker pool) is paid before the clock starts, once per device type."""
    import time

    paid = []
    monkeypatch.setattr(compiling, "warm_up", lambda device_type: paid.append(device_type)
                        or time.sleep(0.5))
    out, seconds = compiling.first_call(lambda: 7, "cpu")
    assert out == 7 and paid == ["cpu"] and seconds < 0.5


@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_the_warm_up_runs_once_per_process():
    from torch._inductor import cpu_vec_isa

    compiling.warm_up("cpu")
    assert compiling.warm_up("cpu") == compiling.warm_up("cpu")  # cached: not run again
    assert compiling.warm_up.cache_info().hits >= 2
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1  # the probe, done


@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_compiled_training_step_equals_eager():
    ids = torch.randint(3, 128, (2, 16))
    r = compiling.training_step(lambda: small_llama(vocab_size=128, hidden_size=32,
                                                    num_hidden_layers=1, max_positions=16),
                                {"input_ids": ids, "labels": ids}, repeats=1)
    assert r.max_abs_diff <= 1e-5 and r.compile_s > 0
    assert r.break_even == compiling.break_even_calls(r.eager_s, r.compiled_s, r.compile_s)



@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_each_measured_compile_is_a_first_compile_not_a_recompile():
    """Dynamo keys what it has seen on the code object: without the reset in ``compare``, the
    second size of a sweep recompiles with dynamic shapes (several times slower to compile)."""
    def f(x):
        return torch.nn.functional.silu(x) * 2

    compiled = torch.compile(f)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (4, 8):  # the same code object at a second shape
            x = torch.randn(n)
            r = compiling.compare(lambda x=x: f(x), lambda x=x: compiled(x), repeats=1)
            assert r.max_abs_diff <= 1e-6


@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_a_cold_compile_writes_its_kernels_to_a_new_empty_folder_and_they_outlive_it():
    """Inductor keeps compiled C++ kernels in its cache folder: a compile timed in the user's
    warm folder would skip the C++ compiler and report half a first run's time."""
    import os
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    def f(x):
        return torch.nn.functional.silu(x).cumsum(0) * 3

    user_dir = cache_dir()  # sets TORCHINDUCTOR_CACHE_DIR where it was unset
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    torch._dynamo.reset()
    compiled, x = torch.compile(f), torch.randn(32)
    with compiling.cold_compile():
        inside = Path(cache_dir())
        assert inside != Path(user_dir) and not any(inside.iterdir())
        compiled(x)
        assert any(p.is_file() for p in inside.rglob("*")), "the kernels went elsewhere"
    assert not inside.exists()  # deleted on exit
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before == user_dir
    torch.testing.assert_close(compiled(x), f(x))  # the loaded kernels still run


def test_a_cold_compile_whose_call_raises_leaves_no_folder():
    """PyTorch's fresh_cache keeps its folder when the body raises (for debugging): a refused
    compile (a decode step that recompiles at every token) left one in /tmp per run."""
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with pytest.raises(RuntimeError, match="on purpose"), compiling.cold_compile():
        inside = Path(cache_dir())
        (inside / "kernel.cpp").write_text("// generated")
        raise RuntimeError("on purpose")
    assert not inside.exists() and not inside.parent.exists()


@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_compiled_generation_equals_eager_static_cache():
    model = small_llama(vocab_size=128, hidden_size=32, num_hidden_layers=1, max_positions=32)
    ids = torch.randint(3, 128, (1, 8))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    r = compiling.generation(model, ids, new_tokens=4, repeats=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    # every step's logits: the same tokens chosen, the same scores to fp32 rounding
    assert r.max_abs_diff <= 1e-5 and r.compile_s > 0
    with pytest.raises(ValueError, match="new_tokens=0"):
        compiling.generation(model, ids, new_tokens=0)


def test_generation_sweep_sizes_are_checked_first():
    with pytest.raises(ValueError, match="hidden_sizes=\\[64, 32, 128\\]"):
        compiling.generation_sweep([64, 32, 128])


@pytest.mark.skipif(not compiling.compile_available("cpu")[0], reason="no C++ compiler")
def test_a_decode_step_that_recompiles_every_token_is_named():
    from recipes_lib import model as models

    path = models.build_tiny_model(spec=models.TinyModelSpec.smallest("gemma2"), progress=False)
    with pytest.warns(UserWarning, match="no SDPA"):
        gemma = models.load_model(path)
    # dynamo gives up after its recompile limit (8); 1 reaches it sooner, the same way
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(
            ValueError, match="recompiles at every generated token.*sliding_attention"):
        compiling.generation(gemma, torch.randint(5, 300, (1, 8)), new_tokens=4, repeats=1)


def test_a_comparison_records_its_figures_and_never_repaid_as_minus_one():
    from recipes_lib.results import Results
    from recipes_lib.timing import Timing

    faster = compiling.CompileComparison(Timing(0.010, [0.010]), Timing(0.006, [0.006]), 2.0, 0.0)
    slower = compiling.CompileComparison(Timing(0.010, [0.010]), Timing(0.012, [0.012]), 2.0, 0.0)
    res = Results("test", "cpu")
    faster.record(res, "compiled_generation", per="tokens", calls=32, speedup_unit="x eager")
    slower.record(res, "torch_compile", suffix="_hidden_64")
    assert res.get("compiled_generation", "speedup").value == pytest.approx(10 / 6)
    assert res.get("compiled_generation", "compile_s").value == 2.0
    assert res.get("compiled_generation", "break_even_tokens").value == pytest.approx(500 * 32)
    assert res.get("torch_compile", "break_even_steps_hidden_64").value == -1.0
    assert "repaid after 16,000 tokens" in faster.summary("tokens", 32)
    assert "never repaid" in slower.summary()
