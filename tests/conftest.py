import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes_lib.published import ANSWERAI_LORA_TARGETS


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


# `make test` runs the suite on parallel workers (pytest-xdist, --dist loadfile): one worker
# per core, each with one thread, keeps both cores busy where one process kept 1.34 of 2 busy
# over the unit tests (CPU time over wall time; Python overhead, process starts, kernels too
# small for two threads). A file's
# tests stay together on one worker (its module fixtures built once, a notebook's cells in order
# in one kernel), and so do the files that share the two-rank torchrun job of `sharded_runs` (a
# session fixture: one job per worker that asks for it).
SHARDED_RUNS_FILES = ("test_context_parallel.py", "test_distributed.py", "test_fake_memory.py",
                      "test_fsdp_qlora.py", "test_trainers.py")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """With workers, the default model (the notebooks' and `sharded_runs`') is built here first,
    on every core, before the workers start (xdist starts them in its own, later hook). (Inductor's
    probe of the CPU's instruction sets, 7 s of the C++ compiler on an empty cache, was tried in a
    process beside it on 2026-12-06, so that the processes compiling early would find it cached:
    the build took 89 s instead of 78-79, more than the probe could save the processes after it:
    5 s each at most, for the few that compile before any other has cached it.)"""
    if session.config.getoption("numprocesses", None) and not hasattr(session.config,
                                                                      "workerinput"):
        import time

        from recipes_lib.model import build_tiny_model

        start = time.perf_counter()
        build_tiny_model(progress=False)
        # pytest's own clock starts after this hook: say what it leaves out
        SUMMARY.append(f"the default model, built or found in .cache before the tests: "
                       f"{time.perf_counter() - start:.0f} s, which pytest's time below leaves "
                       "out and make test's wall clock does not")


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "sharded_runs" if path.rsplit("/", 1)[-1] in SHARDED_RUNS_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndSharedRuns(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return LoadFileAndSharedRuns(config, log)


# The longest units, longest first, so that no worker starts a long one while the other runs out
# of work (seconds of the units' tests in make test on a 2-core Zen 4 EPYC, 2026-12-05: notebook
# 03 250, test_notebooks 141 (notebook 04 under papermill), notebook 01 103, sharded_runs 259
# (fourth, as before: a run that started it first was no faster), notebook 02 110, then the
# planner's 62, the published rows' 47, the architectures' 38 and torch.compile's 30, so that
# none of these is left for the end; every other file takes under 25).
LONGEST_FIRST = ("notebooks/03_optimizing_inference_speed.ipynb", "tests/test_notebooks.py",
                 "notebooks/01_large_models_limited_hardware.ipynb", "sharded_runs",
                 "notebooks/02_multi_gpu_training.ipynb", "tests/test_planner.py",
                 "tests/test_published.py", "tests/test_architectures.py",
                 "tests/test_compiling.py")


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # the order in which the scheduler hands units out
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda i: rank.get(_work_unit(i.nodeid), len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:  # the marker, not the keyword: a parameter id "gpu" is a keyword too
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bench_script():
    """``bench_script(name)``: ``bench/<name>.py`` imported as a module (bench/ holds scripts,
    not a package)."""
    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_model_path():
    """The default tiny base model (built once, cached in .cache/)."""
    from recipes_lib.model import build_tiny_model

    return build_tiny_model(progress=False)


# FSDP steps run for real on the 2 ranks above, compared with fake ones (test_fake_memory.py)
FSDP_FAKE_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
                    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 256}
# ... and FSDP + QLoRA (torchao's NF4, whose weights come in whole blocks of 64 x 256 values)
FSDP_FAKE_NF4_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256,
                        "intermediate_size": 512, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 256}
FSDP_FAKE_NF4_STACK = {"method": "qlora", "precision": "bf16-mixed", "fsdp_ranks": 2,
                       "checkpointing": True}
# ... with torchao's dequantization, dequantized in chunks, and in pure bf16 (fp32 adapters
# over bf16 weights: the adapters take an fp32 copy of their input, as peft's do)
FSDP_FAKE_NF4_VARIANTS = {"": {}, "_chunked": {"chunked_dequant": True},
                          "_bf16": {"precision": "bf16", "chunked_dequant": True},
                          # ... and as Answer.AI's train.py ran it: bf16 adapters on six of the
                          # seven projections (not o_proj), dropout
                          "_answerai": {"precision": "bf16", "chunked_dequant": True,
                                        "autocast_adapter_dtype": False, "lora_dropout": 0.1,
                                        "lora_targets": ANSWERAI_LORA_TARGETS}}
FSDP_FAKE_STACKS = [{"precision": "fp32", "fsdp_ranks": 2},
                    {"precision": "bf16-mixed", "fsdp_ranks": 2, "checkpointing": True},
                    {"method": "lora", "precision": "bf16-mixed", "fsdp_ranks": 2},
                    # a chunked loss, run as the root's forward (architectures.through_wrappers)
                    {"precision": "bf16-mixed", "fsdp_ranks": 2, "chunked_loss": 64}]
# ... and with FSDP's CPU offload (the shards, their gradients and optimizer states the host's)
FSDP_FAKE_OFFLOADED = [(FSDP_FAKE_CONFIG, {"precision": "bf16-mixed", "fsdp_ranks": 2,
                                           "fsdp_cpu_offload": True}),
                       (FSDP_FAKE_NF4_CONFIG, FSDP_FAKE_NF4_STACK | {"chunked_dequant": True,
                                                                     "fsdp_cpu_offload": True})]
# ... and a mixture of experts (grouped-GEMM experts: bf16 weights)
FSDP_FAKE_MOE = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
                 "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256}
# ... and DeepSeek-V3's latent attention and fp32 router (its own FSDP group: fsdp.shard_model)
FSDP_FAKE_DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
                      "intermediate_size": 128, "moe_intermediate_size": 32,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                      "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1,
                      "topk_group": 1, "max_position_embeddings": 256}
FSDP_FAKE_MOE_STACKS = [(FSDP_FAKE_MOE, {"precision": "bf16", "fsdp_ranks": 2}),
                        (FSDP_FAKE_MOE, {"method": "lora", "fsdp_ranks": 2,
                                         "checkpointing": True}),
                        (FSDP_FAKE_DEEPSEEK, {"precision": "bf16", "fsdp_ranks": 2}),
                        # fp32 experts, computed in the bf16 copies FSDP's policy gathers
                        (FSDP_FAKE_MOE, {"precision": "bf16-mixed", "fsdp_ranks": 2,
                                         "checkpointing": True})]


@pytest.fixture(scope="session")
def sharded_runs(tiny_model_path, tmp_path_factory):
    """One torchrun job of 2 ranks (each start costs ~10 s here): DDP, FSDP (with a sharded
    checkpoint and an export), FSDP over an NF4 QLoRA model and context parallelism (ring
    attention, a model step split over the ranks); and the single-process reference
    of the first two, same data and global batch."""
    from recipes_lib import distributed, fsdp
    from recipes_lib.model import TinyModelSpec, build_tiny_model

    tmp = tmp_path_factory.mktemp("dist")
    phi3 = build_tiny_model(spec=TinyModelSpec.smallest("phi3"), progress=False)
    smallest = build_tiny_model(spec=TinyModelSpec.smallest(), progress=False)
    kw = {"model_path": str(tiny_model_path), "steps": 3, "global_batch_size": 4, "seq_len": 64,
          "lr": 3e-4}
    runs = distributed.launch({  # named calls: the results come back under these names
        "ddp": ("recipes_lib.fsdp:train_sharded", dict(kw, strategy="ddp")),
        "fsdp": ("recipes_lib.fsdp:train_sharded", dict(kw, strategy="fsdp",
                                                        checkpoint_dir=str(tmp / "ckpt"),
                                                        export_dir=str(tmp / "export"))),
        "fsdp_qlora": ("recipes_lib.fsdp_qlora:train_fsdp_qlora",
                       {"model_path": str(tiny_model_path), "steps": 2, "global_batch_size": 4}),
        "ring_attention": ("recipes_lib.context_parallel:check_against_dense", {"seq_len": 64}),
        "context_parallel": ("recipes_lib.context_parallel:compare_with_one_rank",
                             {"seq_len": 256, "budget_mib": 12, "search_limit": 4096}),
        # Trainer with FSDP2 settings, and a course loss in Trainer, on CPU ranks
        # (test_trainers.py); FSDP + QLoRA on Phi-3's fused projections (test_fsdp_qlora.py)
        "trainer_fsdp": ("recipes_lib.trainers:fsdp_rank_state",
                         {"model_path": str(tiny_model_path), "steps": 1}),
        "trainer_course_loss": ("recipes_lib.trainers:course_loss_against_own",
                                {"model_path": str(smallest)}),
        "fsdp_qlora_phi3": ("recipes_lib.fsdp_qlora:train_fsdp_qlora",
                            {"model_path": str(phi3), "steps": 2, "global_batch_size": 4}),
        **{f"fake_memory_{i}": ("recipes_lib.fake_memory:real_rank_step", {
            "model": FSDP_FAKE_CONFIG, "stack": stack, "seq_len": 64, "batch_size": 4})
           for i, stack in enumerate(FSDP_FAKE_STACKS)},
        **{f"fake_memory_nf4{suffix}": ("recipes_lib.fake_memory:real_rank_step", {
            "model": FSDP_FAKE_NF4_CONFIG, "stack": FSDP_FAKE_NF4_STACK | extra, "seq_len": 64,
            "batch_size": 4}) for suffix, extra in FSDP_FAKE_NF4_VARIANTS.items()},
        **{f"fake_memory_offloaded_{i}": ("recipes_lib.fake_memory:real_rank_step", {
            "model": config, "stack": stack, "seq_len": 64, "batch_size": 4})
           for i, (config, stack) in enumerate(FSDP_FAKE_OFFLOADED)},
        **{f"fake_memory_moe_{i}": ("recipes_lib.fake_memory:real_rank_step", {
            "model": config, "stack": stack, "seq_len": 64, "batch_size": 4})
           for i, (config, stack) in enumerate(FSDP_FAKE_MOE_STACKS)}},
        verbose=False)
    assert list(runs)[:3] == ["ddp", "fsdp", "fsdp_qlora"]
    assert all(len(r) == 2 for r in runs.values())
    single = fsdp.train_sharded(strategy="single", measure_repeats=0, **kw)
    return {**runs, "single": single, "tmp": tmp, "kw": kw}


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from recipes_lib.model import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture
def small_llama():
    """An untrained 2-layer Llama, fast enough for exact-equivalence tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


@pytest.fixture
def varlen_batch():
    """16 right-padded sequences of different lengths, prompts masked with -100."""
    from recipes_lib.data import collate

    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(16):
        n = 6 + int(torch.randint(0, 20, (1,), generator=g))
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        prompt = 2 + i % 5
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return collate(examples, pad_token_id=0)


SUMMARY: list[str] = []  # lines for the end of the test output (figures the issues ask to see)


@pytest.fixture
def summary() -> list[str]:
    """Append a line here to have it printed in the test summary."""
    return SUMMARY


def pytest_terminal_summary(terminalreporter):
    for line in SUMMARY:
        terminalreporter.write_line(line)
