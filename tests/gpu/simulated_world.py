"""Rank 0 of a world of N processes, simulated in one process with torch's fake process group.

``dist.init_process_group("fake", ...)`` answers every collective at once without moving a byte (an all-gather's
output is left as allocated), so one device holds exactly what one rank of the world would: its shards, its
optimizer state, the gathered block of the moment. The model is the config's real one, built by the recipe's own
order (``build_training``, the plan ``tune plan --nproc N`` makes), and one step of ``train_step`` runs on a batch
of the config's shape. The loss is not meaningful (the gathered weights are whatever memory held); the memory and
the shapes are. ``tests/gpu/test_fake_world_cuda.py`` runs it on CUDA at Llama 3.1 8B and 70B scale;
``tests/integration/test_gpu_suite_on_cpu.py`` runs the same function on a CPU with a tiny model.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from planned import plan_config
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtune_ac.memory.planner import describe_setting
from torchtune_ac.run.assemble import build_training
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.non_finite import NonFiniteError
from torchtune_ac.training.step import train_step

GiB = 2**30


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` under the fake backend, torn down after (or refused if a process
    group exists already: the simulation must not reuse a real one)."""
    if dist.is_initialized():
        raise RuntimeError("a process group exists already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel()
               * (t.to_local() if hasattr(t, "to_local") else t).element_size() for t in tensors)


def simulate_rank_zero(config: str, overrides: Sequence[str], *, world_size: int, device: torch.device) -> dict:
    """One step of rank 0 of ``world_size`` (``fake_world`` must be entered), with what it held against the plan.

    Returns:
        ``planned_*``: the planner's estimate for the config's AC setting (GiB), ``tune plan --nproc N``'s row;
        ``parameters_gib`` and
        ``optimizer_gib``: what rank 0 holds after the step (its shards, counted from the tensors; the optimizer's
        state without its scalar step counters);
        ``peak_allocated_gib`` (CUDA only: the caching allocator's peak, from before the build); ``finite``:
        whether the fake collectives' outputs gave a finite loss (they need not); ``seconds``.
    """
    cfg, plan, model, estimate = plan_config("full_finetune", config, overrides, world_size=world_size)
    ctx = DistributedContext(0, world_size, 0, device, parallelism=plan.parallelism)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    training = build_training(model, plan, ctx=ctx,
                              mesh=plan.parallelism.build_mesh(device.type),
                              make_optimizer=cfg.optimizer.instantiate)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, plan.model.vocab_size, (cfg.batch_size, cfg.max_seq_len), generator=generator)
    batch = {"tokens": tokens.to(device), "labels": torch.roll(tokens, -1, 1).to(device)}
    finite = True
    try:
        train_step(training.model, training.stepper, [batch] * cfg.gradient_accumulation_steps, ctx=ctx,
                   objective=training.objective, clip_grad_norm=cfg.clip_grad_norm)
    except NonFiniteError:  # the gathered weights are uninitialised memory: step anyway, for the optimizer's state
        finite = False
        training.stepper.update(training.model, None, check_norm=lambda norm: None)
    if on_cuda:
        torch.cuda.synchronize()
    optimizer_state = [t for optimizer in training.stepper.optimizers_to_checkpoint()
                       for state in optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0]  # not the step counters
    result = {"config": config, "world_size": world_size, "device": str(device), "finite": finite,
              "ac": describe_setting(plan.memory.ac), "seconds": round(time.perf_counter() - start, 2),
              "parameters_gib": local_bytes(training.model.parameters()) / GiB,
              "optimizer_gib": local_bytes(optimizer_state) / GiB,
              "planned_parameters_gib": estimate.parameters / GiB, "planned_optimizer_gib": estimate.optimizer / GiB,
              "planned_total_gib": estimate.total / GiB}
    if on_cuda:
        result["peak_allocated_gib"] = (torch.cuda.max_memory_allocated() - before) / GiB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    del training, batch
    if on_cuda:
        torch.cuda.empty_cache()
    return result


def random_init_overrides(output_dir: Path, tokenizer: Path, device: str) -> list[str]:
    """A built-in config on ``device`` from the seed's random weights (nothing downloaded): no checkpoint, the
    embedded tokenizer (the plan needs none; the config's validation wants a path)."""
    return [f"output_dir={output_dir}", "checkpoint_dir=null", f"tokenizer.path={tokenizer}", f"device={device}"]
