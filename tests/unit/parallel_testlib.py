"""What the parallelism tests share: a tiny model trained for a few steps on gloo ranks under a split (tensor or
expert parallelism, with FSDP2 over the mesh's other dimensions) against one process training the same model from
the same weights on the same global batches.

Both sides are assembled by the run's own order (``run/assemble.py``'s ``build_training``), so a test trains what a
run would train. A test file subclasses ``Case`` with the tiny models it trains (``args``, ``family``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from numerics import assert_steps_alike, llama_terms
from torch.distributed.device_mesh import DeviceMesh

from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
from torchtune_ac.memory.features import MemorySettings
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models.families import ModelFamily
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.run.assemble import AssembledModel, AssemblyPlan, build_training
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import train_step

CPU = torch.device("cpu")
ROWS, LENGTH, STEPS = 4, 32, 3
DOCUMENTS = (10, 15, 7)  # each packed row
SEED = 7


@dataclass(frozen=True)
class Case:
    """One training run: a tiny model (``model`` names it; a subclass's ``args`` is its architecture) and how it is
    trained."""

    model: str
    packed: bool = False
    loss_chunks: int = 1  # > 1: the chunked loss (on the vocabulary shards under TP)
    ac_mode: str = "none"
    ac_option: Any = None
    in_backward: bool = False
    compile: bool = False
    offload: bool = False  # activation offloading (on a CPU its hooks copy within host memory)
    optimizer: str = "adamw"  # or "adamw8bit": torchao's

    @property
    def args(self) -> LlamaArgs:
        raise NotImplementedError("a test file's Case names its tiny models")

    @property
    def family(self) -> ModelFamily:
        raise NotImplementedError("a test file's Case names its tiny models' families")

    def memory(self) -> MemoryPlan:
        ac = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=self.ac_mode, ac_option=self.ac_option,
                             n_layers=self.args.n_layers)
        return MemoryPlan(ac, MemorySettings(optimizer_in_bwd=self.in_backward, loss_chunks=self.loss_chunks,
                                             enable_activation_offloading=self.offload))


def batch(case: Case, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch: ROWS x LENGTH random tokens, packed as DOCUMENTS per row when asked."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, case.args.vocab_size, (ROWS, LENGTH), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    out = {"tokens": tokens, "labels": labels}
    if case.packed:
        row = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENTS)])
        out["document_ids"] = row.expand(ROWS, LENGTH).clone()
        out["document_lengths"] = torch.tensor(DOCUMENTS * ROWS)
    return out


def rows(batch: dict[str, torch.Tensor], first: int, count: int) -> dict[str, torch.Tensor]:
    """Rows ``first`` to ``first + count`` of a global batch, with their documents' lengths."""
    out = {key: value[first:first + count] for key, value in batch.items() if key != "document_lengths"}
    if "document_lengths" in batch:
        per_row = len(DOCUMENTS)
        out["document_lengths"] = batch["document_lengths"][first * per_row:(first + count) * per_row]
    return out


def adamw8bit() -> type:
    import torchao.optim  # only where it is used: importing torchao takes seconds

    return torchao.optim.AdamW8bit


@contextlib.contextmanager
def compiled_by_aot_eager() -> Iterator[None]:
    """``torch.compile`` with the aot_eager backend: Dynamo and AOTAutograd trace a block with its hooks and
    collectives as inductor's would, in seconds where inductor's CPU code generation takes minutes."""
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        yield
    finally:
        torch.compile = compile_


def build_model(case: Case, ctx: DistributedContext, parallelism: Optional[Parallelism] = None,
                mesh: Optional[DeviceMesh] = None) -> AssembledModel:
    """``case``'s model through the run's order, its weights drawn from SEED (the same for any
    split), with its stepper (AdamW at 1e-2, after backward or in it); ``mesh`` None: one plain process."""
    with torch.device("meta"):
        model = case.family.build(case.args)
    plan = AssemblyPlan(dtype=DType.FP32, memory=case.memory(), parallelism=parallelism or Parallelism(1),
                        compile=case.compile, seed=SEED)
    optimizer = torch.optim.AdamW if case.optimizer == "adamw" else adamw8bit()
    with compiled_by_aot_eager():
        return build_training(model, plan, ctx=ctx, mesh=mesh, make_optimizer=lambda params: optimizer(params, lr=1e-2))


def train(case: Case, assembled: AssembledModel, ctx: DistributedContext, dp_rank: int = 0,
          dp_degree: int = 1) -> tuple[list[float], list[float]]:
    """STEPS steps on the global batches, this data-parallel rank taking its rows; the losses and gradient norms.
    The objective is the memory plan's loss alone (a mixture's load-balancing loss, per process, is not one
    process's over the whole batch)."""
    objective = case.memory().objective()
    share = ROWS // dp_degree
    losses, norms = [], []
    for step in range(STEPS):
        result = train_step(assembled.model, assembled.stepper, [rows(batch(case, step), dp_rank * share, share)],
                            ctx=ctx, objective=objective, clip_grad_norm=None if case.in_backward else 1.0)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return losses, norms


def assert_trains_as_one_process(case: Case, rank: int, world_size: int, parallelism: Parallelism,
                                 mesh: DeviceMesh, *, dp_rank: int, dp_degree: int, check_split=None) -> None:
    """``case`` trained by this process alone and on ``mesh`` (this is rank ``rank`` of ``world_size``, data-parallel
    rank ``dp_rank`` of ``dp_degree``), step by step alike (``numerics.assert_steps_alike``: the split sums the same
    terms in another order). ``check_split(model)`` looks at the split model before it trains."""
    # One process's run, on rank 0 alone (the others would repeat it, on the same cores), then handed to every rank.
    alone = DistributedContext(0, 1, 0, CPU)
    handed = [train(case, build_model(case, alone), alone) if rank == 0 else None]
    dist.broadcast_object_list(handed, src=0)
    expected = handed[0]
    ctx = DistributedContext(rank, world_size, 0, CPU)
    split = build_model(case, ctx, parallelism, mesh)
    if check_split is not None:
        check_split(split.model)
    losses, norms = train(case, split, ctx, dp_rank, dp_degree)
    terms = llama_terms(case.args, LENGTH, ROWS * LENGTH)
    what = f"{case} on {dict(parallelism.mesh_shape)}"
    assert_steps_alike(losses, expected[0], terms=terms, what=f"{what}: loss")
    assert_steps_alike(norms, expected[1], terms=terms, what=f"{what}: gradient norm")
