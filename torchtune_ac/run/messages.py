"""What a user reads when a run stops, resumes or cannot resume: one place for the lines that say what was
saved and how to go on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from torchtune_ac.checkpoint import Progress
from torchtune_ac.data.samples import count_of
from torchtune_ac.errors import EXIT_NON_FINITE, EXIT_STOPPED, RunStopped, UserError
from torchtune_ac.runtime.non_finite import NonFiniteError
from torchtune_ac.runtime.rank_agreement import flatten_config

if TYPE_CHECKING:
    from torchtune_ac.run.length import RunLength

RESUME_HINT = "run the same command with resume_from_checkpoint=true"


def stopped(signal_name: str, progress: Progress, last_checkpoint: Optional[Path], *, saved: bool,
            announce: bool) -> RunStopped:
    """The stop on a signal, after the checkpoint of the current step (``saved``) or before any step."""
    if saved:
        what = f"after step {progress.step}: checkpoint {last_checkpoint} written"
    else:
        since = last_checkpoint.name if last_checkpoint else "the start (no step taken yet)"
        what = f"before step {progress.step + 1}: nothing new to save since {since}"
    return RunStopped(f"stopped by {signal_name} {what}; to continue, {RESUME_HINT}", exit_status=EXIT_STOPPED,
                      announce=announce)


def diverged(err: NonFiniteError, progress: Progress, last_checkpoint: Optional[Path], *,
             announce: bool) -> RunStopped:
    """The stop on a non-finite loss or gradient norm: nothing is saved, the newest checkpoint predates it."""
    newest = (f"the newest checkpoint is still {last_checkpoint}" if last_checkpoint
              else "there is no checkpoint yet")
    taken = ("with optimizer_in_bwd the parameters were stepped in backward, in memory only"
             if err.stepped else "no optimizer step took it in")
    fix = "lower the learning rate or check that step's data"
    if err.loss_scale is not None:
        key, value = err.loss_scale
        fix = (f"lower {key} (now {value:g}: it scales the loss and its gradient) or the learning rate, or check "
               "that step's data")
    return RunStopped(f"stopped at step {progress.step + 1}: {err.describe()}; {taken}, and nothing was saved "
                      f"({newest}): {fix}, then resume with resume_from_checkpoint=true", exit_status=EXIT_NON_FINITE,
                      announce=announce)


def stop_requested(signal_name: str, step: int, last_checkpoint: Optional[Path], *,
                   setting_up: Optional[str] = None) -> str:
    """The line printed as soon as a stop signal arrives (the current step may take minutes to finish), or during
    ``setting_up`` (what set-up does in batches before training: ``reference.PASS``)."""
    if setting_up is not None:
        return (f"{signal_name} received during {setting_up}: stopping after its current batch, before training, "
                "with nothing to save; Ctrl-C again aborts at once")
    return (f"{signal_name} received: finishing step {step} first, then saving a checkpoint and stopping; "
            f"Ctrl-C again aborts at once, losing what was done since {_newest(last_checkpoint)}")


def aborted(step: int, last_checkpoint: Optional[Path], *, setting_up: Optional[str] = None) -> str:
    """The line printed when a second Ctrl-C ends the run at once."""
    during = setting_up or f"step {step}"
    return (f"aborted by a second Ctrl-C during {during}: nothing since {_newest(last_checkpoint)} was saved; "
            f"to continue from there, {RESUME_HINT}")


def stopped_before_training(signal_name: str, during: str, *, announce: bool) -> RunStopped:
    """The stop on a signal during set-up's batches (``during``: ``the reference's pass (batch 3 of 40)``)."""
    return RunStopped(f"stopped by {signal_name} during {during}, before training: nothing to save; to continue, "
                      f"{RESUME_HINT}", exit_status=EXIT_STOPPED, announce=announce)


def _newest(last_checkpoint: Optional[Path]) -> str:
    return f"the newest checkpoint, {last_checkpoint}" if last_checkpoint else "the start (there is no checkpoint yet)"


def stopping(signal_name: str, step: int) -> str:
    """The line logged when a stop signal is agreed on, before the checkpoint is written."""
    return f"{signal_name} received: saving step {step}, then stopping (Ctrl-C again aborts at once)"


def finished_epochs_not_extended(checkpoint: Path, saved: Progress, steps_per_epoch: int, total_steps: int) -> UserError:
    """A finished epoch is not reopened: more steps per epoch would otherwise end in "nothing to do"."""
    return UserError(
        f"resume from {checkpoint}: the run finished its {saved.epoch} epoch(s) at step {saved.step}, but this "
        f"config makes {steps_per_epoch} steps per epoch ({total_steps} in all: max_steps_per_epoch or the data "
        "changed); finished epochs are not extended: raise epochs to train more, or start a new run in another "
        "output_dir"
    )


def hyperparameter_changes(saved: dict[str, Any], current: dict[str, Any], checkpoint: str) -> list[str]:
    """Each optimizer or schedule setting (``RecipeState.hyperparameters``) that differs between ``checkpoint``
    and this config, as ``optimizer.lr: 0.003 in step_0000003, 1e-05 now`` (an unset argument shows as
    ``(default)``; a section set on one side only, whole)."""
    changes = []
    for section in dict.fromkeys([*current, *saved]):
        was, now = saved.get(section), current.get(section)
        if isinstance(was, dict) and isinstance(now, dict):
            was_flat, now_flat = flatten_config(was, f"{section}."), flatten_config(now, f"{section}.")
            pairs = [(key, was_flat.get(key, "(default)"), now_flat.get(key, "(default)"))
                     for key in sorted(set(was_flat) | set(now_flat))]
        else:
            pairs = [(section, json.dumps(was, sort_keys=True), json.dumps(now, sort_keys=True))]
        changes += [f"{key}: {old} in {checkpoint}, {new} now" for key, old, new in pairs if old != new]
    return changes


def hyperparameters_changed(changes: list[str]) -> str:
    """The line a resume logs when its optimizer or schedule settings are not the checkpoint's."""
    return ("resume with other settings: " + "; ".join(changes) + " (the optimizer state carries over; the "
            "hyper-parameters and the schedule are this config's)")


def data_changed(checkpoint: Path, changes: list[str]) -> UserError:
    """A resume refused because the data is not what ``checkpoint`` trained on."""
    return UserError(
        f"resume from {checkpoint}: the training data changed since that checkpoint (" + "; ".join(changes)
        + "), so the run cannot continue exactly; to train on from its weights with this data, start a new run "
        f"with checkpoint_dir={checkpoint} and another output_dir"
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def disk_too_small(output_dir: str, free: int, checkpoint: int) -> UserError:
    """A run refused before its first step: its output_dir's file system cannot hold one checkpoint."""
    return UserError(
        f"output_dir {output_dir}: {_size(free)} free on its file system, less than one checkpoint of this run "
        f"(about {_size(checkpoint)}: the model in Hugging Face format, and the model and optimizer state a resume "
        "needs); make room, or choose an output_dir on another disk"
    )


def disk_may_fill(output_dir: str, free: int, needed: int, saves: int, size: Any, keep: Optional[int]) -> str:
    """The warning of a run whose kept checkpoints will not all fit (``size``: a ``phases.CheckpointSize``)."""
    if keep is None:
        kept = (f"keep_last_n_checkpoints: null keeps the Hugging Face files ({_size(size.hf_bytes)}) of each of its "
                f"{saves} checkpoints and the recipe state ({_size(size.recipe_bytes)}) of the newest two")
        fix = "make room, or set keep_last_n_checkpoints"
    else:
        kept = (f"keep_last_n_checkpoints={keep} keeps {keep} checkpoint(s) of about {_size(size.total)}, and one more "
                "while the next is written")
        fix = "make room" + (", or lower keep_last_n_checkpoints" if keep > 1 else "")
    return (f"output_dir {output_dir}: {_size(free)} free on its file system, and this run's checkpoints need about "
            f"{_size(needed)}: {kept}; a later save may stop the run with a full disk: {fix}")


def resharded(saved_world_size: int, world_size: int, *, dropout: bool) -> str:
    """The resume on another number of processes; what does not carry over is said only where there is some
    (``dropout``: the model draws dropout masks)."""
    return (f"resharded from {saved_world_size} process(es) to {world_size}: model, optimizer, scheduler and data "
            "order carry over" + ("; dropout masks do not (each rank's RNG state is its own)" if dropout else ""))


def no_checkpoint_yet(output_dir: str) -> str:
    return f"resume_from_checkpoint=true: {output_dir} holds no checkpoint yet, so the run starts at step 0"


def nothing_to_do(output_dir: str, step: int) -> str:
    return f"nothing to do: the run in {output_dir} already finished {step} step(s)"


def naming_dataset_val(err: UserError) -> UserError:
    """``err``, raised while reading ``dataset_val``, with that key in front (a line about the training data and one
    about the validation data may otherwise read alike); its type is kept (a missing file stays unavailable)."""
    message = str(err)
    return err if message.startswith("dataset_val") else type(err)(f"dataset_val: {message}")


def length_warnings(length: "RunLength", hyperparameters: Mapping[str, Any]) -> list[str]:
    """What the run's length makes worth a warning, as far as it is known (``tune validate``, the world size not
    known: the steps of one process, or the cap of ``max_steps_per_epoch`` x ``epochs``; a run: its steps, its data
    read): a warm-up the run ends before finishing
    (the learning rate never reaches the optimizer's), and the samples each epoch leaves out, the global batch
    not dividing them (``max_steps_per_epoch`` cutting the epoch short is the config's own choice, and not said).
    ``hyperparameters`` are the plan's (``RunPlan.hyperparameters``)."""
    warnings = []
    steps, at_most = length.total_steps, "" if length.world_size is not None else "at most "
    if steps is None and length.max_steps_per_epoch is not None:
        steps, at_most = length.max_steps_per_epoch * length.epochs, "at most "
    warmup = (hyperparameters.get("lr_scheduler") or {}).get("num_warmup_steps")
    per_step = length.optimizer_steps_per_step  # the schedule counts optimizer steps
    if steps is not None and isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= steps * per_step:
        lr = (hyperparameters.get("optimizer") or {}).get("lr")
        counted = f"{steps} step(s)" if per_step == 1 else f"{steps * per_step} optimizer step(s) ({per_step} a step)"
        warnings.append(f"lr_scheduler.num_warmup_steps={warmup}: the run has {at_most}{counted}, so it ends "
                        "still warming up and the learning rate never reaches "
                        + (f"optimizer.lr={lr}" if lr is not None else "the optimizer's lr")
                        + "; lower num_warmup_steps (or train longer)")
    if length.samples is not None and length.global_batch is not None and length.steps_per_epoch is not None:
        full_steps = length.samples // length.global_batch
        left = length.samples - full_steps * length.global_batch
        capped = length.max_steps_per_epoch is not None and full_steps > length.max_steps_per_epoch
        if left and not capped:
            warnings.append(
                f"dataset: {count_of(left, length.unit)} of {length.samples:,} not trained on in each epoch: the "
                f"global batch of {length.global_batch} does not divide them, and the last, incomplete batch is left "
                f"out; a global batch that divides {length.samples:,} uses every {length.unit}")
    return warnings
