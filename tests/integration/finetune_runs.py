"""Helpers for the integration tests: run ``tune run full_finetune`` and read back what a run left behind."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import psutil
import torch
from safetensors.torch import load_file

from torchtune_ac.checkpoint import (
    LATEST_POINTER,
    OUTPUT_LOCK_FILE,
    RECIPE_STATE_DIR,
    TRAINER_STATE_FILE,
    list_checkpoints,
    resolve_hf_checkpoint,
)
from torchtune_ac.checkpoint.manifest import check_against_manifest
from torchtune_ac.cli import main as tune_main
from torchtune_ac.observability.metrics import METRICS_FILE, read_metrics

# Keeps one run on the embedded tiny model to a few seconds: short sequences, small batches.
SHORT_RUN = ("max_seq_len=64", "batch_size=4", "max_steps_per_epoch=5")
DROPOUT = ("model.attn_dropout=0.1", "model.resid_dropout=0.1")
HF_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stderr: str


def tune_run_argv(output_dir: str | Path, *overrides: str, nproc: int = 1) -> list[str]:
    """``tune`` arguments for a ``tiny/full`` run into ``output_dir`` (later overrides win)."""
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return ["run", *launcher, "full_finetune", "--config", "tiny/full", *SHORT_RUN, f"output_dir={output_dir}",
            *overrides]


def run_tune_in_process(argv: Sequence[str]) -> CliResult:
    """Call the ``tune`` entry point in this process (world size 1 only) and capture what it prints on stderr.

    Runs with one intra-op thread, like the ``tune`` subprocesses (see ``subprocess_env``): on a shared 2-core
    machine two spinning OpenMP threads per process make a run many times slower.
    """
    stderr = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(stderr):
            code = tune_main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return CliResult(code, stderr.getvalue())


def subprocess_env() -> dict[str, str]:
    """This process's environment for a child ``tune``; one intra-op thread per process keeps a shared 2-core
    machine from oversubscribing (the elastic launcher sets the same for its workers)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def tune_command(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torchtune_ac.cli", *argv]


def run_tune_subprocess(argv: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``tune`` as its own process (the real console path) and wait for it."""
    return subprocess.run(tune_command(argv), capture_output=True, text=True, env=subprocess_env(),
                          timeout=timeout, check=False)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a ``tune`` process and every process it started, as a crash would: each elastic worker leads its own
    session, so killing the launcher's process group alone would leave the workers training (and writing)."""
    try:
        workers = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    psutil.wait_procs(workers, timeout=30)


def check_success(result: CliResult | subprocess.CompletedProcess) -> None:
    """Fail with the run's stderr when it did not exit 0."""
    if result.returncode != 0:
        raise AssertionError(f"tune exited {result.returncode}:\n{result.stderr[-4000:]}")


def read_losses(output_dir: str | Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def logged_steps(output_dir: str | Path) -> list[int]:
    """Steps logged in ``metrics.jsonl`` so far (tolerates a half-written last line of a running process)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            break
    return steps


def final_checkpoint(output_dir: str | Path) -> Path:
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise AssertionError(f"{output_dir} holds no checkpoint")
    return checkpoints[-1]


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def resume_from_the_checkpoint_before_last(reference_dir: Path, resumed_dir: Path,
                                           argv: Sequence[str]) -> None:
    """Copy a finished run into ``resumed_dir`` without its last checkpoint and the metrics logged after the one
    before, run ``argv`` there with ``resume_from_checkpoint=true``, and check it ends as the reference did, bit for
    bit: every step's loss and the final weights (the same process count and batches, every RNG restored)."""
    *_, earlier, last = list_checkpoints(reference_dir)
    shutil.copytree(reference_dir, resumed_dir)
    shutil.rmtree(resumed_dir / last.name)
    metrics = resumed_dir / METRICS_FILE
    resumed_at = int(earlier.name.removeprefix("step_"))
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= resumed_at]
    metrics.write_text("".join(line + "\n" for line in kept))
    check_success(run_tune_in_process([*argv, "resume_from_checkpoint=true"]))
    assert read_losses(resumed_dir) == read_losses(reference_dir)
    ours, theirs = load_weights(final_checkpoint(resumed_dir)), load_weights(final_checkpoint(reference_dir))
    assert ours.keys() == theirs.keys()
    assert [name for name in theirs if not torch.equal(ours[name], theirs[name])] == []


def hash_tree(root: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``root``, and ``"folder"`` for every folder (empty if it does
    not exist), so that a folder left behind, even an empty one, shows too."""
    if not root.exists():
        return {}
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
        for path in sorted(root.rglob("*"))
    }


def assert_only_complete_checkpoints(output_dir: Path, world_size: int) -> int:
    """Check what a (possibly killed) run left: every ``step_*`` directory is a loadable Hugging Face checkpoint
    that matches its manifest, the newest also holds complete recipe state, ``latest`` names one of the newest two,
    and anything else is ``metrics.jsonl``, the lock of a run killed outright (which the next run takes over), or hidden ``.tmp-``
    debris that nothing reads.

    Returns:
        The step of the newest checkpoint.
    """
    checkpoints = list_checkpoints(output_dir)
    assert checkpoints, f"{output_dir}: no checkpoint"
    names = {path.name for path in checkpoints} | {METRICS_FILE, OUTPUT_LOCK_FILE, LATEST_POINTER}
    for entry in output_dir.iterdir():
        if entry.name not in names:
            assert entry.name.startswith(".") and ".tmp-" in entry.name, f"unexpected entry {entry}"
    for checkpoint in checkpoints:
        assert check_against_manifest(checkpoint, hashes=True) is None, check_against_manifest(checkpoint, hashes=True)
        for name in HF_MODEL_FILES:
            assert (checkpoint / name).is_file(), f"{checkpoint} lacks {name}"
        json.loads((checkpoint / "config.json").read_text())
        assert load_weights(checkpoint), f"{checkpoint}: empty model.safetensors"
    newest = checkpoints[-1]
    # A run killed between renaming a checkpoint into place and checking it leaves latest on the one before.
    assert resolve_hf_checkpoint(output_dir) in checkpoints[-2:], f"{output_dir / LATEST_POINTER}: not a checkpoint"
    state_dir = newest / RECIPE_STATE_DIR
    expected = [TRAINER_STATE_FILE, ".metadata", *(f"rng_rank{r}.pt" for r in range(world_size))]
    for name in expected:
        assert (state_dir / name).is_file(), f"newest checkpoint {newest} lacks {RECIPE_STATE_DIR}/{name}"
    assert list(state_dir.glob("*.distcp")), f"{state_dir}: no DCP shards"
    step = json.loads((state_dir / TRAINER_STATE_FILE).read_text())["progress"]["step"]
    assert newest.name == f"step_{step:07d}", f"{newest} records step {step}"
    return step
