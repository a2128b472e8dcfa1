"""Checkpoints of tensor-parallel runs: DCP reshards between layouts, and the Hugging Face export of a split model is
the export of one process.

One process trains a step and saves; 4 gloo ranks load that into FSDP2 2 x TP 2 (TP 1 -> TP 2), train a step and
save, and load their own checkpoint into FSDP2 over 4 ranks without TP (2 x 2 -> 4 flat); one process loads the
2 x 2 checkpoint (TP 2 -> TP 1) and exports it. Weights and optimizer state must be the saved bytes, bit for bit:
resharding copies them and computes nothing. The tiny Llama has tied embeddings (one weight, split along the
vocabulary, serves both) and an uneven vocabulary (250 rows over 2 x 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from gloo_testlib import run_on_gloo_ranks
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from torchtune_ac.checkpoint import (
    Progress,
    RunShape,
    RecipeState,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from torchtune_ac.models import hf_model_files, save_hf
from torchtune_ac.models.families.llama import FAMILY as LLAMA
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.run.assemble import AssemblyPlan, build_training
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import Stepper, train_step

pytestmark = pytest.mark.distributed

ARGS = dataclasses.replace(LLAMA_TINY, vocab_size=250, n_layers=2, tie_embeddings=True)
SHAPE = RunShape(world_size=1, batch_size=4, gradient_accumulation_steps=1, model_args={}, data={})
FULL = StateDictOptions(full_state_dict=True)
CPU = torch.device("cpu")


def _model(tp: int = 1, world_size: int = 1) -> tuple[nn.Module, Stepper]:
    """The model on ``world_size`` ranks through the run's order (``build_training``), ``tp`` of them splitting each
    layer (FSDP2 over the rest); one plain process for a world of 1."""
    with torch.device("meta"):
        model = LLAMA.build(ARGS)
    parallelism = Parallelism(world_size, tensor=tp)
    ctx = DistributedContext(dist.get_rank() if world_size > 1 else 0, world_size, 0, CPU, parallelism=parallelism)
    plan = AssemblyPlan(DType.FP32, MemoryPlan(ACConfig().resolve(ARGS.n_layers)), seed=3)
    assembled = build_training(model, plan, ctx=ctx, make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    return assembled.model, assembled.stepper


def _step(model: nn.Module, stepper: Stepper, ctx: DistributedContext, dp_rank: int, dp_degree: int,
          seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (4, 16), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    rows = slice(dp_rank * 4 // dp_degree, (dp_rank + 1) * 4 // dp_degree)
    train_step(model, stepper, [{"tokens": tokens[rows], "labels": labels[rows]}], ctx=ctx)


def _save(output_dir: Path, model: nn.Module, stepper: Stepper, step: int,
          ctx: Optional[DistributedContext] = None) -> Path:
    return save_checkpoint(output_dir, model=model, hf_files=hf_model_files(model), optimizers=[stepper.optimizer],
                           state=RecipeState(Progress(step, 0, step), SHAPE, hyperparameters={}, data={}),
                           processes=ctx)


def _load(output_dir: Path, model: nn.Module, stepper: Stepper,
          ctx: Optional[DistributedContext] = None) -> None:
    load_checkpoint(list_checkpoints(output_dir)[-1], model=model, optimizers=[stepper.optimizer], processes=ctx)


def _full_state(model: nn.Module, stepper: Stepper) -> dict:
    return {"model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, [stepper.optimizer], options=FULL)["state"]}


def _assert_same_state(ours: dict, expected: dict, what: str) -> None:
    """Bit for bit: a checkpoint gives back the bytes it saved."""
    assert sorted(ours["model"]) == sorted(expected["model"]), what
    for name, value in expected["model"].items():
        assert torch.equal(ours["model"][name], value), (what, name)
    assert sorted(ours["optimizer"]) == sorted(expected["optimizer"]), what
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(ours["optimizer"][name][key]), torch.as_tensor(value)), (what, name, key)


def _on_four_ranks(rank: int, root: Path) -> None:
    ctx = DistributedContext(rank, 4, 0, CPU)
    model, stepper = _model(tp=2, world_size=4)
    _load(root / "one", model, stepper, ctx)  # TP 1 -> FSDP 2 x TP 2
    _assert_same_state(_full_state(model, stepper), torch.load(root / "one_full.pt", weights_only=False),
                       "1 process -> 2 x 2")
    _step(model, stepper, ctx, rank // 2, 2, seed=2)
    _save(root / "tp", model, stepper, 2, ctx)
    full = _full_state(model, stepper)
    if rank == 0:
        torch.save(full, root / "tp_full.pt")

    flat, flat_stepper = _model(tp=1, world_size=4)
    _load(root / "tp", flat, flat_stepper, ctx)  # 2 x 2 -> FSDP 4, no TP
    _assert_same_state(_full_state(flat, flat_stepper), full, "2 x 2 -> 4 flat")


def test_checkpoints_reshard_across_tensor_parallel_layouts_and_export_as_one_process(tmp_path: Path) -> None:
    model, stepper = _model()
    _step(model, stepper, DistributedContext(0, 1, 0, CPU), 0, 1, seed=1)
    _save(tmp_path / "one", model, stepper, 1)
    torch.save(_full_state(model, stepper), tmp_path / "one_full.pt")

    run_on_gloo_ranks(_on_four_ranks, tmp_path, store_dir=tmp_path, world_size=4)

    model, stepper = _model()
    _load(tmp_path / "tp", model, stepper)  # 2 x 2 -> 1 process
    _assert_same_state(_full_state(model, stepper), torch.load(tmp_path / "tp_full.pt", weights_only=False),
                       "2 x 2 -> 1 process")
    # The Hugging Face files the 2 x 2 run wrote (gathered from its shards) are one process's export of the same
    # weights: the same config.json, the same tensors bit for bit.
    exported = save_hf(model, tmp_path / "exported")
    written = list_checkpoints(tmp_path / "tp")[-1]
    assert (written / "config.json").read_text() == (Path(exported) / "config.json").read_text()
    ours, theirs = load_file(written / "model.safetensors"), load_file(Path(exported) / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" not in ours  # tied: saved once
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
