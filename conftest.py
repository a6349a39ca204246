"""What every pytest run in this repository does, whichever paths it is given (``make test``
runs ``tests`` and ``notebooks``; ``pytest notebooks/01_...ipynb --nbval-lax`` alone must behave
the same): results go to a temporary folder, and parallel workers get one thread each.
tests/conftest.py holds the fixtures and how the work is split between workers."""

import os
import shutil
import tempfile

import torch

# Results from the notebooks and tests go to a temporary folder, never the committed results/
# and README, unless RECIPES_RESULTS_DIR names one. Made here, in the process pytest starts,
# before xdist starts its workers: they and nbval's kernels inherit the variable; removed when
# that process ends (pytest_unconfigure).
_OWN_RESULTS_DIR = None
if "RECIPES_RESULTS_DIR" not in os.environ:
    _OWN_RESULTS_DIR = os.environ["RECIPES_RESULTS_DIR"] = tempfile.mkdtemp(
        prefix="recipes-results-")

# Everything else the run writes to the temporary directory goes to one folder of its own, removed
# at the end the same way: nbval kills its kernels, so their scratch folders (model.scratch_folder:
# notebook 02's checkpoints, notebook 01's adapter), a torchrun job's folder kept because a test
# failed a rank on purpose, and pytest's own tmp_path folders would otherwise stay behind, ~300 MB
# a run. TMPDIR reaches the workers, kernels and ranks; Inductor's compile cache stays where it
# was (its default follows TMPDIR), so compile times do not change from run to run.
_OWN_TMPDIR = None
if "RECIPES_TEST_TMPDIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    _OWN_TMPDIR = tempfile.mkdtemp(prefix="recipes-tests-")
    os.environ["RECIPES_TEST_TMPDIR"] = os.environ["TMPDIR"] = tempfile.tempdir = _OWN_TMPDIR


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        for folder in (_OWN_RESULTS_DIR, _OWN_TMPDIR):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def pytest_configure(config):
    """One thread per core for each xdist worker and the notebook kernels it starts (they
    inherit OMP_NUM_THREADS). Without it, two workers of two threads each on the 2-core reference
    ran notebook 03's teacher fine-tune in 323 s instead of 40 s, and notebook 01's QLoRA
    fine-tune in 314 s instead of 35 s.

    The third-party noise ``recipes_lib`` silences when imported (``known_warnings``) is given
    to pytest too: pytest restores the warning filters after every test, so those installed by
    the first import stop working at the second test, and the summary filled with them (84 of
    a run's 104 warnings)."""
    from recipes_lib.known_warnings import WARNING_NOISE

    for module, message, category in WARNING_NOISE:
        config.addinivalue_line("filterwarnings",
                                f"ignore:{message}:{category.__name__}:{module}")
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        threads = max(1, (os.cpu_count() or 1) // int(worker["workercount"]))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
