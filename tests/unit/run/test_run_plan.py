"""The run's plan is resolved once: by rank 0, whose answer every rank applies, and computed in one place (the run's
length); the launcher checks only what ranks would report each on its own; the run applies the plan in one written
order."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_testlib import run_on_gloo_ranks

from torchtune_ac.config.components import Component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.config.validation import validate_config
from torchtune_ac.data.embedded import EMBEDDED_TOKENIZER_DIR
from torchtune_ac.errors import UserError
from torchtune_ac.memory import plan as memory_plan
from torchtune_ac.models.families import transformer_blocks
import torchtune_ac.run as run_package
from torchtune_ac.run import assemble
from torchtune_ac.run import plan as run_plan
from torchtune_ac.run.assemble import AssemblyPlan, build_training
from torchtune_ac.run.phases import build_data
from torchtune_ac.run.plan import resolve_length, resolve_run_plan
from torchtune_ac.run.preflight import check_launch
from torchtune_ac.run.session import Run, plan_run
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.activation_checkpointing.mechanism import is_checkpointed
from torchtune_ac.runtime.parallelism import Parallelism

MiB = 2**20
# 40 MiB per process for the tiny model at 64 tokens x 4 samples: some plan fits a process whose own fixed cost is 0.
BUDGET_GIB = 40 / 1024


def config(output_dir: Path, **overrides) -> FullFinetuneConfig:
    return validate_config(
        {
            "output_dir": str(output_dir),
            "model": {"_component_": "torchtune_ac.models.llama_tiny"},
            "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": str(EMBEDDED_TOKENIZER_DIR)},
            "dataset": {"_component_": "torchtune_ac.data.instruct_dataset"},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
            "max_seq_len": 64,
            "batch_size": 4,
            "device": "cpu",
            **overrides,
        },
        FullFinetuneConfig,
        source="c.yaml",
    )


def _count_meta_builds(counted: list) -> None:
    """Count, in this process, every build of the model component on the meta device."""
    real = Component.instantiate_with_defaults

    def counting(self, *args, **kwargs):
        if self.key == "model" and torch.empty(0).device.type == "meta":
            counted.append(self.path)
        return real(self, *args, **kwargs)

    Component.instantiate_with_defaults = counting


def _rank_zero_plans_for_both(rank: int, output_dir: str) -> None:
    cfg = config(Path(output_dir), enable_activation_checkpointing=None, ac_mode="auto", ac_memory_budget_gib=BUDGET_GIB)
    ctx = DistributedContext(rank, 2, 0, torch.device("cpu"))
    # Each rank measures another fixed cost of its own: on rank 1 the whole budget, so that nothing fits there.
    run_plan.process_fixed_bytes = lambda device: ((0 if rank == 0 else 40 * MiB), "stood in for")
    planned, meta_builds = [], []
    real_choose = memory_plan.choose_plan
    memory_plan.choose_plan = lambda *args, **kwargs: planned.append(rank) or real_choose(*args, **kwargs)
    _count_meta_builds(meta_builds)

    tokenizer = cfg.tokenizer.instantiate()
    model = build_meta_model(cfg.model, cfg.checkpoint_dir)
    plan = plan_run(Run(cfg, ctx), model, tokenizer=tokenizer)
    data = build_data(cfg, tokenizer, ctx)
    plan = plan.with_data(data.samples, len(data.loader))
    training = build_training(model,
                              AssemblyPlan(dtype=plan.dtype, memory=plan.memory, fsdp=plan.fsdp, compile=plan.compile,
                                           seed=0), ctx=ctx, make_optimizer=cfg.optimizer.instantiate)
    applied = [is_checkpointed(block) for block in transformer_blocks(training.model)]

    answers: list = [None, None]
    dist.all_gather_object(answers, (plan, applied, planned, meta_builds))
    (plan0, applied0, planned0, _), (plan1, applied1, planned1, _) = answers
    assert planned0 == [0] and planned1 == []  # the planner ran once, on rank 0
    assert plan1 == plan0 and applied1 == applied0  # rank 1 applies rank 0's plan
    # Rank 0's choice, for its own fixed cost, is what both applied: the blocks its plan checkpoints.
    assert plan0.memory.estimate.fixed == 0
    assert applied0 == [i in plan0.memory.ac.checkpointed_blocks for i in range(len(applied0))]
    assert meta_builds == ["torchtune_ac.models.llama_tiny"]  # one meta build in this process
    if rank == 1:  # its own memory would not have planned at all
        with pytest.raises(UserError, match="no plan fits"):
            resolve_run_plan(cfg, build_meta_model(cfg.model), world_size=2, device=ctx.device)


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_zero_resolves_the_plan_and_every_rank_applies_it(tmp_path):
    run_on_gloo_ranks(_rank_zero_plans_for_both, str(tmp_path / "out"), store_dir=tmp_path)


@pytest.mark.parametrize("world_size, batches, expected", [
    (1, 40, (40, 40)),  # 40 batches of 4 per epoch: 40 steps
    (2, 20, (10, 20)),  # with 2 micro-batches per step: 10 steps, and 2 epochs
    (None, None, (None, None)),  # tune validate: the data is not read
])
def test_the_run_s_length_is_computed_in_one_place(tmp_path, world_size, batches, expected):
    accumulation = 1 if world_size == 1 else 2
    cfg = config(tmp_path, gradient_accumulation_steps=accumulation, epochs=1 if world_size == 1 else 2)
    length = resolve_length(cfg, Parallelism(world_size), samples=None if batches is None else 160, batches_per_epoch=batches)
    assert (length.steps_per_epoch, length.total_steps) == expected
    assert length.global_batch == (None if world_size is None else 4 * accumulation * world_size)


def test_a_dataset_too_small_for_one_step_is_refused_naming_the_keys(tmp_path):
    with pytest.raises(UserError, match="3 samples make 1 batch.* fewer than gradient_accumulation_steps=2"):
        resolve_length(config(tmp_path, gradient_accumulation_steps=2), Parallelism(1), samples=3, batches_per_epoch=1)


def test_the_launcher_checks_only_what_ranks_would_each_report_on_their_own(tmp_path, monkeypatch):
    cfg = config(tmp_path, device="cuda")
    check_launch(cfg, world_size=2, nproc_per_node=2)  # no CUDA here: every rank would say so alike
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_launch(cfg, world_size=4, nproc_per_node=2)
    with pytest.raises(UserError, match="--nproc_per_node 4: this node has 2 visible GPU"):
        check_launch(cfg, world_size=4, nproc_per_node=4)
    with pytest.raises(UserError, match="fsdp.replicate_degree=3"):
        check_launch(config(tmp_path, fsdp={"replicate_degree": 3}), world_size=4, nproc_per_node=2)


def test_the_order_of_application_is_one_function():
    """``build_training`` applies the plan in the written order: adapters, AC, activation offloading, compile, tensor
    parallelism, expert parallelism, FSDP2, materialise, load or initialise (the adapters' values after the base),
    then the stepper (optimizer) and the scheduler."""
    source = inspect.getsource(assemble.build_training)
    calls = [node for node in ast.walk(ast.parse(source.lstrip())) if isinstance(node, ast.Call)]
    named = sorted((node.lineno, ast.unparse(node.func)) for node in calls)
    order = ["apply_adapters", "apply_ac_plan", "apply_activation_offloading", "block.compile", "apply_tensor_parallel",
             "apply_expert_parallel", "shard_model",
             "model.to_empty",
             "load_hf_weights_", "initialize_weights_", "load_or_initialize_adapters_", "memory.build_stepper",
             "make_scheduler"]
    lines = {name: next(line for line, called in named if called == name) for name in order}
    assert [lines[name] for name in order] == sorted(lines.values())


WRITTEN_STEP = re.compile(r"(\d+)\. ([A-Za-z][A-Za-z0-9 ]*?)(?=[:,]|  |$)", re.M)


def _written_order(text: str) -> list[str]:
    """The numbered steps of ``text`` (``1. activation checkpointing  2. ...``), lower case, in number order."""
    steps = {int(number): name.strip().lower() for number, name in WRITTEN_STEP.findall(text)}
    assert sorted(steps) == list(range(1, len(steps) + 1)), steps
    return [steps[number] for number in sorted(steps)]


def test_the_written_order_is_the_same_in_the_code_and_in_every_place_that_shows_it():
    """``build_training``'s numbered comments, its module's docstring, ``run/__init__.py`` and
    docs/architecture.md's list name the same steps in the same order."""
    comments = "\n".join(line.strip().lstrip("# ") for line in inspect.getsource(assemble.build_training).splitlines()
                         if line.strip().startswith("#"))
    code = _written_order(comments)
    assert code[:7] == ["adapters", "activation checkpointing", "activation offloading", "compile",
                        "tensor parallelism", "expert parallelism", "fsdp2"]
    docstring = assemble.__doc__.split("\n\n")[1]
    package = run_package.__doc__.split("assemble.py")[1].split("weights.py")[0]
    docs = (Path(__file__).resolve().parents[3] / "docs/architecture.md").read_text()
    written = docs.split("## The written order")[1].split("\n\nEach step")[0]
    for shown in (docstring, package, written):
        assert _written_order(shown) == code
