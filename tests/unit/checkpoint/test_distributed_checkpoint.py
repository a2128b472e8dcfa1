"""Checkpoints across processes (2 gloo ranks): a checkpoint written by 1 process loads into 2 FSDP2 processes and
one written by 2 loads into 1, weights and optimizer state identical (optimizer step after or in backward); a rank
that cannot write its files makes every rank stop with the same one-line error instead of leaving the others
waiting; ranks started with different configs, or that do not share output_dir, are refused at start-up."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_testlib import run_on_gloo_ranks
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from torchtune_ac.checkpoint import (
    Progress,
    RunShape,
    RecipeState,
    check_shared_directory,
    list_checkpoints,
    load_checkpoint,
    safetensors_io,
    save_checkpoint,
)
from torchtune_ac.checkpoint.manifest import check_against_manifest
from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_in_backward import build_optimizer, optimizers_to_checkpoint
from torchtune_ac.models import Llama, LlamaArgs, hf_model_files
from torchtune_ac.runtime.distributed import DistributedContext, process_group_context
from torchtune_ac.runtime.rank_agreement import check_same_config
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import train_step

pytestmark = pytest.mark.distributed

ARGS = LlamaArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=64)
SHAPE = RunShape(world_size=1, batch_size=4, gradient_accumulation_steps=1, model_args={}, data={})
MODES = (False, True)  # optimizer step after backward, in backward
FULL = StateDictOptions(full_state_dict=True)  # every rank gets every full tensor


def _model(sharded: bool, in_backward: bool) -> tuple[Llama, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Llama(ARGS)
    model.init_weights(0.02)
    if sharded:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
    optimizer = build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2), model, in_backward=in_backward)
    return model, optimizer


def _step(model: Llama, optimizer: torch.optim.Optimizer, ctx: DistributedContext, seed: int) -> None:
    """One step on the global batch of 4 sequences: rank r of w takes its 4/w of them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (4, 16), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    share = 4 // ctx.world_size
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
    train_step(model, optimizer, [{"tokens": tokens[rows], "labels": labels[rows]}], ctx=ctx)


def _full_state(model: Llama, optimizer: torch.optim.Optimizer) -> dict:
    optimizers = optimizers_to_checkpoint(optimizer)
    return {"model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, optimizers, options=FULL)["state"]}


def _assert_same_state(ours: dict, expected: dict) -> None:
    """Bit for bit: a checkpoint gives back the bytes it saved; resharding copies them, it computes nothing."""
    assert sorted(ours["model"]) == sorted(expected["model"])
    for name, value in expected["model"].items():
        assert torch.equal(ours["model"][name], value), name
    assert sorted(ours["optimizer"]) == sorted(expected["optimizer"])
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(ours["optimizer"][name][key]), torch.as_tensor(value)), (name, key)


def _save(output_dir: Path, model: Llama, optimizer: torch.optim.Optimizer, step: int) -> Path:
    return save_checkpoint(output_dir, model=model, hf_files=hf_model_files(model),
                           optimizers=optimizers_to_checkpoint(optimizer),
                           state=RecipeState(Progress(step, 0, step), SHAPE, hyperparameters={}, data={}),
                           processes=process_group_context())


def _load(path: Path, model: Llama, optimizer: torch.optim.Optimizer) -> None:
    load_checkpoint(path, model=model, optimizers=optimizers_to_checkpoint(optimizer), processes=process_group_context())


def _resharded_on_two_ranks(rank: int, root: Path) -> None:
    ctx = DistributedContext(rank, 2, 0, torch.device("cpu"))
    for in_backward in MODES:
        mode = root / f"in_backward_{in_backward}"
        model, optimizer = _model(sharded=True, in_backward=in_backward)
        _load(list_checkpoints(mode / "one")[-1], model, optimizer)  # 1 -> 2
        _assert_same_state(_full_state(model, optimizer), torch.load(mode / "one_full.pt", weights_only=False))
        _step(model, optimizer, ctx, seed=2)
        _save(mode / "two", model, optimizer, 2)
        full = _full_state(model, optimizer)
        if rank == 0:
            torch.save(full, mode / "two_full.pt")


@pytest.mark.slow
def test_checkpoints_reshard_from_1_to_2_processes_and_back(tmp_path):
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    for in_backward in MODES:
        mode = tmp_path / f"in_backward_{in_backward}"
        model, optimizer = _model(sharded=False, in_backward=in_backward)
        _step(model, optimizer, ctx, seed=1)
        _save(mode / "one", model, optimizer, 1)
        torch.save(_full_state(model, optimizer), mode / "one_full.pt")

    run_on_gloo_ranks(_resharded_on_two_ranks, tmp_path, store_dir=tmp_path)

    for in_backward in MODES:
        mode = tmp_path / f"in_backward_{in_backward}"
        model, optimizer = _model(sharded=False, in_backward=in_backward)
        _load(list_checkpoints(mode / "two")[-1], model, optimizer)  # 2 -> 1
        _assert_same_state(_full_state(model, optimizer), torch.load(mode / "two_full.pt", weights_only=False))


def _expect_user_error(parts: tuple[str, ...], call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(part in message for part in parts), (parts, message)
    return message


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "injected")


def _agreement_on_two_ranks(rank: int, root: Path) -> None:
    # Different configs: refused on every rank, naming the key and both values.
    _expect_user_error(("batch_size is 8 on rank 0", "but 4 on rank 1", "same config"),
                       lambda: check_same_config({"batch_size": 8 if rank == 0 else 4, "seed": 0},
                                                 DistributedContext(rank, 2, 0, torch.device("cpu"))))
    check_same_config({"batch_size": 4, "optimizer": {"lr": 1e-3}}, DistributedContext(rank, 2, 0, torch.device("cpu")))

    # A directory of the same name that is not shared (each rank its own): refused, naming the rank.
    _expect_user_error(("rank 1 (host", "cannot see the file rank 0", "every node shares"),
                       lambda: check_shared_directory(root / f"local_disk_of_rank_{rank}", "output_dir",
                                                      process_group_context()))
    check_shared_directory(root / "shared", "output_dir", process_group_context())  # created, then removed
    dist.barrier()
    assert not (root / "shared").exists() and not (root / f"local_disk_of_rank_{rank}").exists() or rank == 1

    # A full disk on one rank only, in DCP's shard writer or in rank 0's Hugging Face writer (while rank 1 waits in
    # the gathers): every rank raises the same one line, the partial checkpoint is removed, step 1 is intact.
    out = root / "run"
    model, optimizer = _model(sharded=True, in_backward=False)
    _save(out, model, optimizer, 1)
    for failing_rank, module, name in ((1, dcp_filesystem, "_write_item"), (0, safetensors_io, "save_file")):
        with pytest.MonkeyPatch.context() as patch:
            if rank == failing_rank:
                patch.setattr(module, name, _disk_full)
            _expect_user_error((f"rank {failing_rank}:", "No space left on device", "the newest is still step_0000001"),
                               lambda: _save(out, model, optimizer, 2))
        dist.barrier()
        assert [c.name for c in list_checkpoints(out)] == ["step_0000001"]
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
        assert check_against_manifest(out / "step_0000001", hashes=True, processes=process_group_context()) is None
    _save(out, model, optimizer, 2)  # and the next save works
    assert [c.name for c in list_checkpoints(out)] == ["step_0000001", "step_0000002"]


def test_ranks_agree_on_failures_configs_and_the_output_dir(tmp_path):
    run_on_gloo_ranks(_agreement_on_two_ranks, tmp_path, store_dir=tmp_path)
