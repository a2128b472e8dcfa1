"""All tests: keep them off the user's home, and share helpers between unit and integration tests.

Hugging Face and W&B caches and settings go to a temporary folder, set in ``pytest_configure`` before any test
module imports ``datasets`` (which reads its cache location at import), and inherited by every ``tune``
subprocess. No test reaches the Hub: ``HF_HUB_OFFLINE=1``. A run that picks PyTorch's kernels
(``ATEN_CPU_CAPABILITY``, as ``scripts/test.sh --numerics`` does) gets a fresh inductor cache there too.

Under pytest-xdist (``scripts/test.sh`` runs 2 workers) each worker has its own folder, temporary paths and
embedded-checkpoint cache, and one OpenMP thread (``OMP_NUM_THREADS=1`` unless set: a worker is one core's work).
A test marked ``distributed`` launches several processes, each as busy as a worker: the workers take turns on one
lock for those, so that a 4-process test never runs beside another (8 processes on 2 cores, their collectives
waiting on descheduled peers) while tests of one process still run beside them.

This folder is on ``sys.path`` (pytest puts a conftest's folder there), so unit and integration tests share
``hf_families`` (tiny random checkpoints made with transformers' own classes) and ``tracker_readers``. So are
``scripts/`` (``gen_docs``) and ``scripts/bench/``, whose ``_measure`` (bytes kept for backward, peak resident
memory) the planner's tests measure with.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT_PATHS = [str(SCRIPTS), str(SCRIPTS / "bench")]
sys.path[:0] = SCRIPT_PATHS
pytest.register_assert_rewrite("hf_families", "numerics")

_ENV_DIRS = {
    "HF_HOME": "hf_home",
    "HF_DATASETS_CACHE": "hf_datasets_cache",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb_cache",
    "WANDB_CONFIG_DIR": "wandb_config",
    "WANDB_DATA_DIR": "wandb_data",
}
# Set by the controlling process for its xdist workers: the file they lock around a multi-process test.
PROCESSES_LOCK_ENV = "TORCHTUNE_AC_TESTS_PROCESSES_LOCK"
_root: list[str] = []


def pytest_configure(config) -> None:
    root = tempfile.mkdtemp(prefix="torchtune_ac-tests-")
    _root.append(root)
    if "PYTEST_XDIST_WORKER" in os.environ:
        _one_thread_per_worker()
    else:  # the workers, started after this, inherit it
        os.environ[PROCESSES_LOCK_ENV] = os.path.join(root, "processes.lock")
    for name, folder in _ENV_DIRS.items():
        os.environ[name] = os.path.join(root, folder)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "offline"
    # Subprocesses that measure memory import scripts/bench/_measure too.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*SCRIPT_PATHS, os.environ.get("PYTHONPATH")]))
    if "ATEN_CPU_CAPABILITY" in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # Inductor's on-disk cache is not keyed by the capability: a kernel cached by a vectorised run fails to
        # compile under ATEN_CPU_CAPABILITY=default ("'at::vec' has not been declared"). Compile afresh.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "torchinductor")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` need a CUDA device: skipped on a machine without one."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _one_thread_per_worker() -> None:
    """One OpenMP thread in this xdist worker and the processes it starts, unless the user chose a number."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # read by libgomp when torch is imported, and by every child process
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@contextlib.contextmanager
def _processes_lock(item: pytest.Item) -> Iterator[None]:
    """Hold the workers' shared lock while ``item`` (a test marked ``distributed``) runs; nothing without xdist."""
    path = os.environ.get(PROCESSES_LOCK_ENV)
    if "PYTEST_XDIST_WORKER" not in os.environ or path is None or item.get_closest_marker("distributed") is None:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> Iterator[None]:
    """Set-up, call and tear-down under the lock, so that a module fixture's multi-process run is inside it."""
    with _processes_lock(item):
        yield


def pytest_unconfigure(config) -> None:
    for root in _root:
        shutil.rmtree(root, ignore_errors=True)
