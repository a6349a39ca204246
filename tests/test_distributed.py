"""Real 2-rank runs on CPU (gloo): loss parity with one process, per-rank bytes, faults."""

import os
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from recipes_lib import distributed, fsdp, train_state


@pytest.fixture
def launch_tag(monkeypatch, tmp_path) -> str:
    """A variable every process this test launches inherits (and keeps, orphaned or not), so
    that ranks launched at the same time by another test worker are not counted as its own.
    The launches' folders, kept when a run fails, go under the test's own tmp_path."""
    tag = f"test-{os.getpid()}-{uuid.uuid4().hex}"
    monkeypatch.setenv("RECIPES_TEST_LAUNCH", tag)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tag


def _rank_processes(tag: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(proc.name) != os.getpid() and tag.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_fsdp_and_ddp_losses_match_a_single_process(sharded_runs):
    ref = sharded_runs["single"]["losses"]
    for strategy in ("ddp", "fsdp"):
        for rank_result in sharded_runs[strategy]:
            diff = max(abs(a - b) for a, b in zip(rank_result["losses"], ref, strict=True))
            assert diff <= 1e-4, (strategy, diff)


def test_fsdp_halves_per_rank_training_state(sharded_runs):
    for ddp, fs in zip(sharded_runs["ddp"], sharded_runs["fsdp"], strict=True):
        ratio = fs["state_bytes"]["total"] / ddp["state_bytes"]["total"]
        assert 0.49 <= ratio <= 0.55, ratio
        assert ddp["state_bytes"] == sharded_runs["single"]["state_bytes"]


def test_sharded_checkpoint_round_trips_and_export_loads(sharded_runs, tiny_model_path):
    from recipes_lib.model import load_model

    for r in sharded_runs["fsdp"]:
        assert r["checkpoint"]["param_max_abs_diff"] == 0.0
        assert r["checkpoint"]["optimizer_max_abs_diff"] == 0.0
    exported = load_model(sharded_runs["tmp"] / "export")
    original = load_model(tiny_model_path)
    changed = max(float((a - b).detach().abs().max()) for a, b in
                  zip(exported.parameters(), original.parameters(), strict=True))
    assert changed > 0  # trained weights, not the original ones
    assert exported.config.num_hidden_layers == original.config.num_hidden_layers


@pytest.mark.harness
def test_a_rank_that_raises_is_reported_and_nothing_is_left_running(launch_tag):
    with pytest.raises(distributed.DistributedRunError, match="rank 1: RuntimeError: rank 1 "
                       "failed on purpose"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank", {"rank": 1})],
                           verbose=False)
    assert _rank_processes(launch_tag) == []


@pytest.mark.harness
def test_a_rank_killed_by_a_signal_is_named_with_its_last_output(launch_tag):
    """A C++ abort (seen once in CI: a gloo rank, SIGABRT) leaves no Python error: the message
    names the signal and shows what the rank wrote to stderr before it died."""
    with pytest.raises(distributed.DistributedRunError) as err:
        distributed.launch([("recipes_lib.distributed:fail_on_rank",
                             {"rank": 1, "mode": "abort"})], pg_timeout_s=20, verbose=False)
    message = str(err.value)
    assert "rank 1: killed by SIGABRT; its last output:\n    rank 1 aborts on purpose" in message
    assert "\n  rank 0: " in message  # its gloo error (peer gone), or stopped by torchrun
    assert _rank_processes(launch_tag) == []


def test_every_killed_rank_of_a_wide_job_is_named(tmp_path):
    """torchrun's failure summary (as it printed it when the CI failure was reproduced here),
    eight ranks each killed by a signal but rank 3 stopped by torchrun: each is read off the
    summary, beyond the 40 lines that are echoed as the last output."""
    from collections import deque
    entry = ("[{i}]:\n  time      : 2026-11-26_04:44:06\n  host      : localhost\n"
             "  rank      : {i} (local_rank: {i})\n  exitcode  : {code} (pid: 23{i})\n"
             "  error_file: <N/A>\n  traceback : Signal {sig} received by PID 23{i}\n")
    summary = "".join(entry.format(i=i, code=-15 if i == 3 else -6, sig=15 if i == 3 else 6)
                      for i in range(8))
    tail = deque((ln + "\n" for ln in summary.splitlines()), maxlen=200)
    message = distributed._failure_message(tmp_path, 8, 1, tail)
    assert [f"  rank {i}: killed by SIGABRT; its last output:" in message.splitlines()
            for i in range(8)] == [i != 3 for i in range(8)]
    assert "  rank 3: stopped by torchrun after another rank failed" in message


@pytest.mark.harness
def test_a_rank_that_dies_after_its_result_is_written_leaves_the_results_and_says_so(
        launch_tag, capfd):
    """Every rank finished its work, then one aborted while exiting (a gloo teardown abort,
    seen once in CI): the results are whole, so they are returned, and the crash is printed."""
    [results] = distributed.launch([("recipes_lib.distributed:fail_on_rank",
                                     {"rank": 1, "mode": "abort_at_exit"})], verbose=False)
    assert results == [{"rank": 0, "sum": 2.0}, {"rank": 1, "sum": 2.0}]
    err = capfd.readouterr().err
    assert "every rank finished its work, then a rank failed while shutting down" in err
    assert "rank 1: killed by SIGABRT" in err
    assert _rank_processes(launch_tag) == []


@pytest.mark.harness
def test_a_hung_rank_becomes_a_timeout_not_a_hang(launch_tag):
    with pytest.raises(distributed.DistributedRunError, match="Timed out"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank",
                             {"rank": 1, "mode": "hang"})], pg_timeout_s=3, verbose=False)
    assert _rank_processes(launch_tag) == []


@pytest.mark.harness
def test_launcher_wall_clock_timeout_kills_every_rank(launch_tag):
    # 15 s: torchrun and its ranks start within it on a CI machine busy with the rest of the suite
    # (at 4 s, once, torchrun had not started a rank and there were no logs to name)
    with pytest.raises(distributed.DistributedRunError, match="timeout_s=15") as err:
        distributed.launch([("recipes_lib.distributed:fail_on_rank",
                             {"rank": 1, "mode": "hang"})], timeout_s=15, pg_timeout_s=600,
                           verbose=False)
    assert _rank_processes(launch_tag) == []
    logs = Path(str(err.value).rsplit("every rank's output: ", 1)[1].rstrip(")"))
    assert list(logs.glob("*/attempt_*/1/stderr.log"))  # kept, and named: the hung rank's output


def test_a_timeout_before_any_rank_started_says_so_instead_of_naming_empty_logs(launch_tag):
    # 0.2 s: less than torchrun needs to import torch, on any machine
    with pytest.raises(distributed.DistributedRunError, match="started no rank yet"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank",
                             {"rank": 1, "mode": "hang"})], timeout_s=0.2, verbose=False)
    assert _rank_processes(launch_tag) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nccl_without_gpus_is_refused_before_launch():
    with pytest.raises(ValueError, match="backend='nccl': needs CUDA GPUs"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank", {"rank": 0})],
                           backend="nccl")


@pytest.mark.parametrize("n_gpu, world_size, expected", [
    (0, 1, "gloo"), (0, 2, "gloo"), (1, 2, "gloo"), (1, 1, "nccl"), (8, 2, "nccl"),
])
def test_default_backend_needs_a_gpu_per_rank(monkeypatch, n_gpu, world_size, expected):
    # One Colab GPU with two ranks must fall back to gloo, not fail in check_backend.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n_gpu > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpu)
    assert distributed.default_backend(world_size) == expected
    assert distributed.check_backend(None, world_size) == expected


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank", {"rank": 0})], world_size=0)
    with pytest.raises(ValueError, match="target='nope'"):
        distributed.launch([("nope", {})])
    with pytest.raises(ValueError, match="backend='mpi'"):
        distributed.check_backend("mpi", 2)


def test_global_batch_helpers():
    assert distributed.check_global_batch(8, 2) == 4
    with pytest.raises(ValueError, match="global_batch_size=7"):
        distributed.check_global_batch(7, 2)
    batch = {"input_ids": torch.arange(8).view(4, 2)}
    assert distributed.rank_slice(batch, 1, 2)["input_ids"].tolist() == [[4, 5], [6, 7]]
    assert distributed.world() == (0, 1)
    assert distributed.all_reduce_sum(3.0) == 3.0


def test_init_outside_torchrun_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.init_distributed()


@pytest.mark.harness
def test_rank_killed_under_torchrun_resumes_from_sharded_checkpoint(tiny_model_path, sharded_runs,
                                                                    tmp_path, monkeypatch,
                                                                    summary):
    """Rank 1 is SIGKILLed after step 2 of 3; torchrun restarts both ranks, which resume from the
    sharded checkpoint of step 1 and end with the losses of the uninterrupted FSDP run."""
    ref = sharded_runs["fsdp"][0]
    [[got, got1]] = distributed.launch([("recipes_lib.fsdp:train_sharded", dict(
        sharded_runs["kw"], strategy="fsdp", resume_dir=str(tmp_path), checkpoint_every=1,
        measure_repeats=0, on_step=("recipes_lib.distributed:kill_rank_after",
                                    {"rank": 1, "step": 2})))], max_restarts=1, verbose=False)
    diff = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True))
    assert ref["restart_count"] == 0 and got["restart_count"] == got1["restart_count"] == 1
    assert got["resumed_from"] == got1["resumed_from"] == 1
    assert diff == 0.0, (ref["losses"], got["losses"])
    assert not list(tmp_path.glob("*.tmp")) and train_state.latest(tmp_path).name == "step-000003"
    summary.append(f"torchrun restart: rank 1 SIGKILLed after step 2 of 3, both ranks restarted "
                   f"from the sharded step-1 checkpoint; max loss difference vs an "
                   f"uninterrupted run: {diff} (FSDP, 2 gloo ranks, fp32)")


def test_one_rank_fsdp_run_checkpoints_and_resumes(tiny_model_path, tmp_path):
    # A process group of one rank still holds DTensor parameters under FSDP: the sharded layout.
    # (In this process, so no torchrun start-up: a one-rank gloo group on a file store.)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        kw = {"model_path": str(tiny_model_path), "strategy": "fsdp", "steps": 2,
              "global_batch_size": 2, "seq_len": 32, "resume_dir": str(tmp_path / "ckpt"),
              "measure_repeats": 0}
        first = fsdp.train_sharded(**kw)
        again = fsdp.train_sharded(**dict(kw, steps=3))
    finally:
        dist.destroy_process_group()
    assert first["resumed_from"] == 0 and again["resumed_from"] == 2
    assert again["losses"][:2] == first["losses"] and len(again["losses"]) == 3
    assert (tmp_path / "ckpt" / "step-000003" / "shards" / ".metadata").exists()


def test_sharded_checkpoint_outside_torchrun_is_refused(tmp_path):
    (tmp_path / "step-000002" / "shards").mkdir(parents=True)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sharded \\(multi-process\\) checkpoint"):
        train_state.load(tmp_path / "step-000002", m, torch.optim.AdamW(m.parameters()), None,
                         None)


def test_bad_max_restarts():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        distributed.launch([("recipes_lib.distributed:fail_on_rank", {"rank": 0})],
                           max_restarts=-1)


def test_rank_output_reads_as_a_console_shows_it():
    """What torchrun's --tee copies of rank 0 (each line tagged, tqdm's carriage returns turned
    into tagged lines) is echoed untagged, each progress bar redrawn in place over the last one,
    blank lines and start-up chatter left out, nothing after a traceback starts."""
    import io

    out = io.StringIO()
    console = distributed._RankConsole(out)
    for line in ["[default0]:",
                 "[default0]:demo:   0%|          | 0/4 [00:00<?, ?it/s][default0]:hello",
                 "[default0]:demo:  50%|█████     | 2/4 [00:00<00:00, 19.94it/s]",
                 "[default0]:demo: 100%|██████████| 4/4 [00:00<00:00, 19.91it/s]",
                 "[default0]:                                        ",
                 "[default0]:I1127 12:00:00.000 123 init.cpp:1] start-up chatter",
                 "[default0]:done, values[0]: 3",
                 "[default0]:x: 100%|██████████| 1/1 [00:00<00:00, 9.9it/s]",
                 "[rank0]:Traceback (most recent call last):",
                 "[rank0]:  File \"x.py\", line 1"]:
        console.write(line)
    console.close()
    assert out.getvalue() == (
        "\rdemo:   0%|          | 0/4 [00:00<?, ?it/s]\nhello\n"
        "\rdemo:  50%|█████     | 2/4 [00:00<00:00, 19.94it/s]"
        "\rdemo: 100%|██████████| 4/4 [00:00<00:00, 19.91it/s]\n"
        "done, values[0]: 3\n"
        "\rx: 100%|██████████| 1/1 [00:00<00:00, 9.9it/s]\n")
