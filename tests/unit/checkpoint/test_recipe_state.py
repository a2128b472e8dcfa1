"""A run's checkpoints in one process: the manifest comes last, resume takes the newest checkpoint that passes it
(skipping a damaged one with a line naming the bad file), older checkpoints are pruned only once the new one is
verified, a full disk costs nothing that was there before, and what may change on resume is the global batch's
split, not the global batch."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtune_ac.checkpoint import (
    MANIFEST_FILE,
    RECIPE_STATE_DIR,
    Progress,
    RunShape,
    RecipeState,
    check_resume_shape,
    choose_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    safetensors_io,
    save_checkpoint,
)
from torchtune_ac.checkpoint.manifest import check_against_manifest, write_manifest_without
from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.models import Llama, LlamaArgs, hf_model_files

TINY = LlamaArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=64)
SHAPE = RunShape(world_size=1, batch_size=4, gradient_accumulation_steps=1, model_args={"n_layers": 2},
                 data={"seed": 0})


def _state(step: int) -> RecipeState:
    return RecipeState(Progress(step, 0, step), SHAPE, hyperparameters={}, data={})


def _trained(seed: int = 0) -> tuple[Llama, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Llama(TINY)
    model.init_weights(0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    return model, optimizer


def _save(output_dir: Path, model: Llama, optimizer: torch.optim.Optimizer, step: int, **kwargs) -> Path:
    return save_checkpoint(output_dir, model=model, hf_files=hf_model_files(model), optimizers=[optimizer],
                           state=_state(step), **kwargs)


def _resumable(output_dir: Path) -> list[str]:
    return [c.name for c in list_checkpoints(output_dir) if (c / RECIPE_STATE_DIR).exists()]


def test_each_checkpoint_ends_with_a_manifest_that_it_passes(tmp_path):
    model, optimizer = _trained()
    path = _save(tmp_path, model, optimizer, 3)
    assert (path / MANIFEST_FILE).is_file()
    assert check_against_manifest(path, hashes=True) is None
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(listed) == on_disk
    assert choose_resume_checkpoint(tmp_path, hashes=True).checkpoint == path


@pytest.mark.parametrize(
    "keep_last_n, whole, model_only",
    [
        (None, ["step_0000003", "step_0000004"], ["step_0000001", "step_0000002"]),  # recipe state in the newest 2
        (1, ["step_0000004"], []),
        (3, ["step_0000002", "step_0000003", "step_0000004"], []),
    ],
)
def test_older_checkpoints_are_pruned_as_keep_last_n_checkpoints_says(tmp_path, keep_last_n, whole, model_only):
    model, optimizer = _trained()
    for step in range(1, 5):
        _save(tmp_path, model, optimizer, step, keep_last_n=keep_last_n)
    assert [c.name for c in list_checkpoints(tmp_path)] == sorted(whole + model_only)
    assert _resumable(tmp_path) == whole
    for checkpoint in list_checkpoints(tmp_path):  # a pruned checkpoint's manifest no longer lists what went
        assert check_against_manifest(checkpoint, hashes=True) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no debris


def _break_newest_distcp(output_dir: Path) -> Path:
    distcp = next((list_checkpoints(output_dir)[-1] / RECIPE_STATE_DIR).glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:1000])
    return distcp


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one_with_the_file_named(tmp_path):
    first, first_optimizer = _trained(seed=0)
    _save(tmp_path, first, first_optimizer, 1)
    second, second_optimizer = _trained(seed=1)
    _save(tmp_path, second, second_optimizer, 2)
    distcp = _break_newest_distcp(tmp_path)

    for hashes in (False, True):
        choice = choose_resume_checkpoint(tmp_path, hashes=hashes)
        assert choice.checkpoint == tmp_path / "step_0000001"
        assert len(choice.skipped) == 1 and str(distcp) in choice.skipped[0] and "truncated" in choice.skipped[0]

    restored, restored_optimizer = _trained(seed=2)
    load_checkpoint(choice.checkpoint, model=restored, optimizers=[restored_optimizer])
    for name, value in first.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name  # loaded bytes: bit for bit

    # The next save (a resumed run at step 2) replaces the damaged one, which is then pruned like any other.
    _save(tmp_path, second, second_optimizer, 2)
    assert choose_resume_checkpoint(tmp_path, hashes=True) == type(choice)(tmp_path / "step_0000002")


def _stepped(lr: float, betas: tuple[float, float], in_backward: bool):
    """The tiny model and its stepper (AdamW with these settings, stepped once if ``lr`` is not None)."""
    torch.manual_seed(0)
    model = Llama(TINY)
    model.init_weights(0.02)
    stepper = build_optimizer(lambda params: torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.01),
                              model, in_backward=in_backward)
    model(torch.randint(0, TINY.vocab_size, (2, 16))).float().logsumexp(-1).mean().backward()
    stepper.update(model, clip_grad_norm=None)
    return model, stepper


@pytest.mark.parametrize("in_backward", [False, True], ids=["step_after_backward", "step_in_backward"])
def test_a_resume_loads_the_optimizer_state_and_keeps_the_hyperparameters_it_was_built_with(tmp_path, in_backward):
    """The checkpoint's learning rate and betas used to replace the new config's (a new lr was ignored)."""
    model, saved = _stepped(3e-3, (0.9, 0.999), in_backward)
    path = save_checkpoint(tmp_path, model=model, hf_files=hf_model_files(model),
                           optimizers=saved.optimizers_to_checkpoint(), state=_state(1))
    restored_model, restored = _stepped(1e-5, (0.8, 0.95), in_backward)  # other settings, other moments
    load_checkpoint(path, model=restored_model, optimizers=restored.optimizers_to_checkpoint())
    for ours, theirs in zip(restored.optimizers_to_checkpoint(), saved.optimizers_to_checkpoint(), strict=True):
        (group,) = ours.param_groups
        assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-5, (0.8, 0.95), 0.01)
        for param, saved_param in zip(group["params"], theirs.param_groups[0]["params"], strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours.state[param][key], theirs.state[saved_param][key]), key
    # What a scheduler drives: the step in backward's groups are still its per-parameter optimizers' own dicts.
    driven = restored.optimizer.param_groups
    assert all(group["lr"] == 1e-5 for group in driven)
    if in_backward:
        assert all(a is b for a, (b,) in zip(driven, (o.param_groups for o in restored.optimizer.optimizers)))


def test_checkpoints_newer_than_a_resumed_save_are_removed_once_it_is_verified(tmp_path):
    model, optimizer = _trained()
    for step in (1, 2, 3):
        _save(tmp_path, model, optimizer, step)
    _break_newest_distcp(tmp_path)  # step 3: the run resumes from step 2 ...
    _save(tmp_path, model, optimizer, 2)  # ... and its first save supersedes step 3's timeline
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_0000001", "step_0000002"]


def test_when_every_checkpoint_is_damaged_resume_refuses_in_one_line_naming_each(tmp_path):
    model, optimizer = _trained()
    _save(tmp_path, model, optimizer, 1)
    state = tmp_path / "step_0000001" / RECIPE_STATE_DIR / "trainer_state.json"
    state.write_text(state.read_text()[:20])  # what a JSONDecodeError traceback used to come from
    with pytest.raises(UserError) as caught:
        choose_resume_checkpoint(tmp_path, hashes=True)
    message = str(caught.value)
    assert "\n" not in message and "no checkpoint in" in message and str(state) in message


@pytest.mark.parametrize("newest", ["model_only", "foreign"])
def test_a_newest_checkpoint_without_recipe_state_is_refused_not_replaced(tmp_path, newest):
    """A resume used to start over (or from an older checkpoint) and delete such a folder at its first save."""
    model, optimizer = _trained()
    _save(tmp_path, model, optimizer, 1)
    if newest == "model_only":  # a checkpoint whose recipe state was deleted to save space
        _save(tmp_path, model, optimizer, 2)
        write_manifest_without(tmp_path / "step_0000002", f"{RECIPE_STATE_DIR}/")
        shutil.rmtree(tmp_path / "step_0000002" / RECIPE_STATE_DIR)
    else:  # not written by a run at all
        (tmp_path / "step_0000002").mkdir()
        (tmp_path / "step_0000002" / "notes.txt").write_text("mine\n")
    for hashes in (False, True):
        with pytest.raises(UserError) as caught:
            choose_resume_checkpoint(tmp_path, hashes=hashes)
        assert str(caught.value).startswith(
            f"resume_from_checkpoint=true: {tmp_path / 'step_0000002'} has no recipe state to continue from "
            "(recipe_state/ is missing), and a resume from step_0000001 would replace or delete it"
        ), caught.value


def test_a_newest_checkpoint_whose_recipe_state_folder_was_deleted_is_refused_not_skipped(tmp_path):
    """It used to be skipped as damaged, and the resume from step 1 then replaced it at its first save."""
    model, optimizer = _trained()
    for step in (1, 2):
        _save(tmp_path, model, optimizer, step)
    newest = tmp_path / "step_0000002"
    shutil.rmtree(newest / RECIPE_STATE_DIR)  # the manifest still lists it
    for hashes in (False, True):
        with pytest.raises(UserError) as caught:
            choose_resume_checkpoint(tmp_path, hashes=hashes)
        assert str(caught.value) == (
            f"resume_from_checkpoint=true: {newest} has no recipe state to continue from (recipe_state/ was deleted: "
            "its manifest lists it), and a resume from step_0000001 would replace or delete it when it saves; nothing "
            f"was changed: to resume from step_0000001, move step_0000002 out of {tmp_path}; to train on from its "
            f"weights, start a new run with checkpoint_dir={newest} and another output_dir"
        )


def test_no_checkpoint_at_all_means_starting_at_step_0(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # an interrupted run before its first checkpoint
    assert choose_resume_checkpoint(tmp_path, hashes=True).checkpoint is None
    assert choose_resume_checkpoint(tmp_path / "missing", hashes=False).checkpoint is None


def _disk_full_after(nbytes: int):
    """A safetensors writer that writes ``nbytes`` of the file, then fails as a full disk does."""

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    return save_file


def test_a_full_disk_during_a_save_is_one_line_and_costs_no_earlier_checkpoint(tmp_path, monkeypatch):
    model, optimizer = _trained()
    _save(tmp_path, model, optimizer, 1)
    _save(tmp_path, model, optimizer, 2)
    before = {c.name: load_file(c / "model.safetensors") for c in list_checkpoints(tmp_path)}
    monkeypatch.setattr(safetensors_io, "save_file", _disk_full_after(1000))
    with pytest.raises(UserError) as caught:
        _save(tmp_path, model, optimizer, 3)
    message = str(caught.value)
    assert "\n" not in message
    for part in ("step_0000003 could not be written", "No space left on device (ENOSPC)", "model.safetensors",
                 "the newest is still step_0000002", "resume_from_checkpoint=true"):
        assert part in message, (part, message)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_0000001", "step_0000002"]
    assert _resumable(tmp_path) == ["step_0000001", "step_0000002"]  # nothing pruned
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the partial save is gone
    for checkpoint in list_checkpoints(tmp_path):
        assert check_against_manifest(checkpoint, hashes=True) is None
        after = load_file(checkpoint / "model.safetensors")
        assert all(torch.equal(after[name], before[checkpoint.name][name]) for name in after)  # the saved bytes


def test_a_bug_while_saving_is_not_passed_off_as_a_full_disk(tmp_path, monkeypatch):
    model, optimizer = _trained()

    def broken(tensors, filename, metadata=None):
        raise KeyError("a bug")

    monkeypatch.setattr(safetensors_io, "save_file", broken)
    with pytest.raises(Exception) as caught:
        _save(tmp_path, model, optimizer, 1)
    assert not isinstance(caught.value, UserError)
    assert list(tmp_path.iterdir()) == []


# saved (world, batch, accumulation) -> resumed, and whether the resume may continue
SPLITS = [
    ((1, 4, 1), (2, 2, 1), None),
    ((2, 2, 1), (1, 4, 1), None),
    ((2, 2, 1), (1, 2, 2), None),
    ((1, 4, 1), (4, 1, 1), None),
    ((1, 4, 1), (1, 2, 1), "the global batch was 4 (batch_size 4 x gradient_accumulation_steps 1 x 1 process(es)), "
                           "now 2 (batch_size 2 x gradient_accumulation_steps 1 x 1 process(es)) (batch_size was 4, now 2)"),
    ((2, 2, 1), (1, 2, 1), "(world_size was 2, now 1)"),
]


@pytest.mark.parametrize("saved, resumed, refusal", SPLITS)
def test_resume_may_change_how_the_global_batch_is_split_but_not_its_size(saved, resumed, refusal):
    def shape(split):
        world, batch, accumulation = split
        return dataclasses.replace(SHAPE, world_size=world, batch_size=batch, gradient_accumulation_steps=accumulation)

    if refusal is None:
        check_resume_shape(Path("step_0000005"), shape(saved), shape(resumed))
        return
    with pytest.raises(UserError) as caught:
        check_resume_shape(Path("step_0000005"), shape(saved), shape(resumed))
    assert refusal in str(caught.value)
