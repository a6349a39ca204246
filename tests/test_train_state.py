import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recipes_lib import train, train_state

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS = 14


sys.path.insert(0, str(WORKER.parent))
from resume_worker import run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return run(str(tmp / "ckpt"), str(tmp / "out.json"), STEPS)


def test_killed_at_a_random_step_resumes_bit_identical(tmp_path, uninterrupted, summary):
    kill_after = random.Random().randint(2, STEPS - 3)
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "ckpt"),
                             str(tmp_path / "out.json"), str(STEPS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until the run is past step kill_after, then SIGKILL it
        found = train_state.latest(tmp_path / "ckpt")
        if found is not None and train_state.step_of(found) >= kill_after:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out.json").exists(), "the run finished before it was killed"
    resumed = run(str(tmp_path / "ckpt"), str(tmp_path / "out.json"), STEPS)
    diff = max(abs(a - b) for a, b in zip(resumed["losses"], uninterrupted["losses"]))
    summary.append(f"resume: process SIGKILLed past step {kill_after} of {STEPS}, resumed; "
                   f"max loss difference vs an uninterrupted run: {diff} (fp32, CPU)")
    assert len(resumed["losses"]) == STEPS and diff == 0.0
    assert resumed["target_tokens"] == uninterrupted["target_tokens"]


def test_torn_checkpoint_is_never_picked_up(tmp_path, uninterrupted, monkeypatch):
    publish = train_state._publish

    def die(root, tmp, final, keep):  # as if the process died in step 5's save, before the rename
        if final.name == "step-000005":
            raise KeyboardInterrupt
        publish(root, tmp, final, keep)
    monkeypatch.setattr(train_state, "_publish", die)
    with pytest.raises(KeyboardInterrupt):
        run(str(tmp_path / "ckpt"), str(tmp_path / "out.json"), STEPS)
    assert (tmp_path / "ckpt" / "step-000005.tmp").exists()
    assert train_state.latest(tmp_path / "ckpt").name == "step-000004"
    monkeypatch.undo()
    resumed = run(str(tmp_path / "ckpt"), str(tmp_path / "out.json"), STEPS)
    assert resumed["losses"] == uninterrupted["losses"]
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


def test_a_checkpoint_past_the_configured_steps_is_refused(tmp_path, uninterrupted):
    """A shorter run pointed at a longer run's folder would return that run's weights and
    losses as its own: refused, naming the folder and both step counts."""
    ckpt = tmp_path / "ckpt"
    run(str(ckpt), str(tmp_path / "out.json"), 4)
    assert train_state.step_of(train_state.latest(ckpt)) == 4
    with pytest.raises(ValueError, match="checkpoint_dir=.*holds step 4, beyond steps=3"):
        run(str(ckpt), str(tmp_path / "out.json"), 3)
    assert run(str(ckpt), str(tmp_path / "out.json"), 5)["losses"][:4] == (
        uninterrupted["losses"][:4])  # more steps continue it
    with pytest.raises(ValueError, match="path=.*not a checkpoint folder"):
        train_state.step_of(tmp_path)


def test_checkpoint_files_are_safe_to_load(tmp_path, small_llama, varlen_batch):
    opt = torch.optim.AdamW(small_llama.parameters())
    path = train_state.save(tmp_path, 3, small_llama, opt, None, None,
                            {"losses": [1.0], "step_times": [0.1], "target_tokens": 5})
    torch.load(path / train_state.STATE, weights_only=True)  # no pickled code needed
    assert (path / train_state.WEIGHTS).exists() and train_state.latest(tmp_path) == path


def test_a_checkpoint_from_another_model_is_refused(tmp_path, small_llama):
    opt = torch.optim.AdamW(small_llama.parameters())
    path = train_state.save(tmp_path, 1, small_llama, opt, None, None,
                            {"losses": [], "step_times": [], "target_tokens": 0})
    small_llama.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_state.load(path, small_llama, opt, None, None)


def test_bad_checkpoint_settings():
    with pytest.raises(ValueError, match="checkpoint_every"):
        train.TrainConfig(checkpoint_every=-1).validate()
