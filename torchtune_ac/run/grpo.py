"""GRPO on the run layer: the loop whose step is a rollout (``GRPOLoop``) and the set-up both GRPO recipes share
(``run_grpo``). One loop step:

    this rank's prompts x num_generations -> completions (sampler seeded from seed, step and data rank; FSDP2's
    weights gathered once) -> rewards (gathered over the ranks) -> group advantages -> old and reference
    log-probabilities where needed -> num_iterations optimizer steps on the same rollouts, the learning-rate
    schedule stepped after each (its length and warm-up counted in optimizer steps, as TRL's)

A resume is exact: the sampler's seed is a function of the step, and the prompts' order is the loader's.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtune_ac.data.batching import PROMPTS
from torchtune_ac.errors import UserError
from torchtune_ac.generation import SamplingConfig, VLLMSettings, build_generation_backend
from torchtune_ac.generation.backend import check_generation_backend
from torchtune_ac.lora.export import merged_model_files
from torchtune_ac.lora.mechanism import adapters_off
from torchtune_ac.models import hf_model_files
from torchtune_ac.models.families import family_of
from torchtune_ac.run.assemble import build_reference
from torchtune_ac.run.loop import Batch, TrainingLoop
from torchtune_ac.run.setup import SetupParts, run_recipe
from torchtune_ac.runtime.distributed import all_reduce_sum
from torchtune_ac.training.grpo import GRPOConfig, GRPOObjective, completion_logps, describe_grpo, group_advantages
from torchtune_ac.training.rewards import RewardError, score_completions
from torchtune_ac.training.rollouts import (
    GenerationConfig,
    Rewards,
    build_rewards,
    completion_texts,
    gathered_for_decoding,
    rollout_batch,
    sampler_seed,
)
from torchtune_ac.training.step import StepResult, move_batch

log = logging.getLogger("torchtune_ac.grpo")
SAMPLES_FILE = "samples.jsonl"


@dataclass(frozen=True)
class Rollouts:
    """What a GRPO step needs besides the model: the loss's and the sampler's settings, the rewards, the reference
    (a frozen model; None without ``beta`` or when it is the policy's base, ``reference_is_base``), and how often
    a few completions go to ``samples.jsonl``."""

    grpo: GRPOConfig
    generation: GenerationConfig
    rewards: Rewards
    reference: Optional[nn.Module]
    reference_is_base: bool
    n_chunks: int
    samples_every_n_steps: int
    samples_per_write: int = 4


class GRPOLoop(TrainingLoop):
    """The run layer's loop, each step a rollout and ``grpo.num_iterations`` optimizer steps on it (see the module
    docstring); the rewards, completion lengths and generation share join the step's ``metrics.jsonl`` record."""

    def __init__(self, *args: Any, rollouts: Rollouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rollouts = rollouts
        # generation.backend (generation/backend.py): completions come from it, and it is given the policy's new
        # weights after each step's optimizer steps.
        generation, cfg = rollouts.generation, self.run.cfg
        self.backend = build_generation_backend(
            generation.backend.value, self.training.model, eos_ids=[self.tokenizer.eos_id],
            pad_id=self.tokenizer.pad_id,
            vllm=VLLMSettings(cfg.max_seq_len, generation.vllm_gpu_memory_utilization,
                              generation.vllm_enable_sleep_mode, cfg.seed),
            # With adapters the engine serves the merged model (it has no adapters of its own).
            model_files=merged_model_files if rollouts.reference_is_base else hf_model_files,
            compile_decode=generation.compile)

    def step(self, micro_batches: Sequence[Batch]) -> StepResult:
        started = time.perf_counter()
        settings, ctx, tokenizer = self.rollouts, self.run.ctx, self.tokenizer
        g = settings.grpo.num_generations
        model = self.training.model
        generator = torch.Generator(device=ctx.device)
        generator.manual_seed(sampler_seed(self.run.cfg.seed, self.run.progress.step, ctx.data_parallel_rank))
        prompts, indices, completions, truncated = [], [], [], []
        with gathered_for_decoding(model):
            for batch in micro_batches:
                rows = [t[:n].tolist() for t, n in zip(batch["tokens"].cpu(), batch["prompt_lengths"].tolist())]
                repeated = [row for row in rows for _ in range(g)]  # a group's completions adjacent
                out = self.backend.generate(repeated, sampling_config(settings.generation), generator=generator)
                prompts.append(repeated)
                indices.append([i for i in batch["index"].tolist() for _ in range(g)])
                completions.append(out.tokens)
                truncated.append(out.truncated)
        generation_s = time.perf_counter() - started
        flat = [c for micro in completions for c in micro]
        table, names = self.score([p for micro in prompts for p in micro], [i for m in indices for i in m], flat)
        lengths = torch.tensor([len(c) for c in flat], dtype=torch.float32)
        cut = torch.tensor([t for micro in truncated for t in micro], dtype=torch.float32)
        local = torch.cat([table, lengths[:, None], cut[:, None]], dim=1)  # [n, rewards + 2]
        everything = gather_rows(local, ctx)  # [world * n, rewards + 2], rank by rank
        weights = torch.tensor(settings.rewards.weights, dtype=torch.float32)
        total = everything[:, :len(names)] @ weights
        advantages = group_advantages(total, g, settings.grpo.scale_rewards)
        n = local.shape[0]
        mine = advantages.advantages[ctx.data_parallel_rank * n:(ctx.data_parallel_rank + 1) * n]
        batches, offset = [], 0
        for micro_prompts, micro_completions, micro_cut in zip(prompts, completions, truncated):
            size = len(micro_prompts)
            batch = rollout_batch(micro_prompts, micro_completions, micro_cut, mine[offset:offset + size],
                                  pad_id=tokenizer.pad_id, mask_truncated=settings.grpo.mask_truncated_completions,
                                  pack_to=self.run.cfg.max_seq_len if settings.grpo.pack_completions else None)
            batches.append(self.with_fixed_logps(move_batch(batch, ctx.device)))
            offset += size
        results = []
        for iteration in range(settings.grpo.num_iterations):
            if iteration and self.training.scheduler is not None:
                # The schedule counts optimizer steps, as TRL's does; the loop steps it after the last one.
                self.training.scheduler.step()
            results.append(super().step(batches))
        self.backend.sync_weights(model)  # the next rollouts sample from the weights these steps made
        self.write_samples(prompts[0], completions[0], table, total[ctx.data_parallel_rank * n:], mine)
        extra = rollout_metrics(everything, total, advantages, names, g)
        extra["generation_share"] = generation_s / (time.perf_counter() - started)
        return merge_iterations(results, extra)

    def score(self, prompts: list[list[int]], indices: list[int], completions: list[list[int]]
              ) -> tuple[torch.Tensor, list[str]]:
        """Each reward function's scores ``[n, rewards]``; a failure on any rank stops every rank, before any
        optimizer step, in one line naming the function."""
        tokenizer, settings = self.tokenizer, self.rollouts
        texts = completion_texts(tokenizer.decode, completions, [tokenizer.eos_id])
        columns = {**self.data.loader.dataset.columns_of(indices),
                   "prompts": [tokenizer.decode(p, skip_special_tokens=True) for p in prompts],
                   "completion_lengths": [len(c) for c in completions],
                   "max_new_tokens": settings.generation.max_new_tokens}
        error: Optional[RewardError] = None
        try:
            table, _ = score_completions(settings.rewards.functions, settings.rewards.weights, texts, columns)
        except RewardError as err:
            error, table = err, torch.zeros(len(texts), len(settings.rewards.functions))
        failed = all_reduce_sum(torch.tensor([float(error is not None)]), self.run.ctx)
        if error is not None:
            raise error
        if failed.item():
            raise RewardError("a reward function failed on another process (its message is in that process's log)")
        return table, list(settings.rewards.functions)

    @torch.no_grad()
    def with_fixed_logps(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with the generating policy's log-probabilities (for more than one iteration) and the
        reference's (with ``beta``), computed once for the rollout."""
        settings, model = self.rollouts, self.training.model
        temperature, n_chunks = settings.generation.temperature, settings.n_chunks
        if settings.grpo.num_iterations > 1:
            batch["old_logps"] = completion_logps(model, batch, n_chunks=n_chunks, temperature=temperature)
        if settings.grpo.beta:
            if settings.reference_is_base:
                with adapters_off(model):
                    batch["ref_logps"] = completion_logps(model, batch, n_chunks=n_chunks, temperature=temperature)
            else:
                batch["ref_logps"] = completion_logps(settings.reference, batch, n_chunks=n_chunks,
                                                      temperature=temperature)
        return batch

    def write_samples(self, prompts: list[list[int]], completions: list[list[int]], table: torch.Tensor,
                      total: torch.Tensor, advantages: torch.Tensor) -> None:
        """A few of rank 0's completions with their rewards, every ``samples_every_n_steps`` steps."""
        step = self.run.progress.step + 1
        if not self.run.ctx.is_rank_zero or step % self.rollouts.samples_every_n_steps:
            return
        decode = self.tokenizer.decode
        names = list(self.rollouts.rewards.functions)
        with open(Path(self.run.cfg.output_dir) / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for i in range(min(self.rollouts.samples_per_write, len(prompts))):
                f.write(json.dumps({"step": step, "prompt": decode(prompts[i], skip_special_tokens=True),
                                    "completion": decode(completions[i], skip_special_tokens=True),
                                    "rewards": dict(zip(names, table[i].tolist())), "reward": float(total[i]),
                                    "advantage": float(advantages[i])}) + "\n")


def sampling_config(generation: GenerationConfig) -> SamplingConfig:
    """The ``generation:`` keys as the decoder takes them."""
    return SamplingConfig(generation.max_new_tokens, generation.temperature, generation.top_k, generation.top_p)


def gather_rows(local: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Every rank's ``local`` rows, rank by rank (``local`` itself in a world of one)."""
    if not ctx.is_distributed:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def rollout_metrics(everything: torch.Tensor, total: torch.Tensor, advantages: Any, names: list[str],
                    g: int) -> dict[str, float]:
    """The rollout's values for ``metrics.jsonl``, over every rank's completions: the reward (total, and each
    function's mean and standard deviation), its standard deviation within groups and the share of groups with
    none, and the completions' lengths and truncated share."""
    lengths, cut = everything[:, len(names)], everything[:, len(names) + 1]
    metrics = {"reward": float(total.mean()), "reward_std": float(advantages.group_std.mean()),
               "frac_reward_zero_std": float(advantages.zero_std.float().view(-1, g)[:, 0].mean())}
    for i, name in enumerate(names):
        column = everything[:, i]
        metrics[f"rewards/{name}/mean"] = float(column.mean())
        metrics[f"rewards/{name}/std"] = float(column.std()) if column.numel() > 1 else 0.0
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(cut.mean())})
    return metrics


def merge_iterations(results: list[StepResult], extra: dict[str, float]) -> StepResult:
    """One record for the step's ``num_iterations`` optimizer steps: their mean loss and objective metrics, the last
    gradient norm, the tokens and the counts (the tokens each expert received) of all."""
    k = len(results)
    own = {name: sum(r.extra[name] for r in results) / k for name in results[0].extra}
    counts = {name: torch.stack([torch.tensor(r.counts[name]) for r in results]).sum(0).tolist()
              for name in results[0].counts}
    return replace(results[-1], loss=sum(r.loss for r in results) / k,
                   input_tokens=sum(r.input_tokens for r in results),
                   target_tokens=sum(r.target_tokens for r in results), extra={**own, **extra}, counts=counts)


def model_positions(model: nn.Module) -> Optional[int]:
    """How many positions ``model`` (a meta build) attends over, where its family says."""
    family = family_of(model)
    return getattr(family.args_of(model), "max_seq_len", None) if family is not None else None


def check_lengths(cfg: Any, model: nn.Module) -> None:
    """Refuse a ``max_seq_len`` (the longest prompt plus ``generation.max_new_tokens``) past the model's positions.

    Raises:
        UserError: naming both keys and the model's positions.
    """
    positions = model_positions(model)
    if positions is not None and cfg.max_seq_len > positions:
        raise UserError(f"max_seq_len={cfg.max_seq_len} (prompts of up to {cfg.max_seq_len - cfg.generation.max_new_tokens}"
                        f" tokens plus generation.max_new_tokens={cfg.generation.max_new_tokens}): past the model's "
                        f"{positions} positions; lower one of them")


def run_grpo(cfg: Any, *, reference_is_base: bool) -> None:
    """Run GRPO from its config: the run layer's set-up with prompts, ``GRPOObjective`` and ``GRPOLoop``; the
    reference (with ``beta``) the starting weights, frozen and sharded like the policy, or with adapters
    (``reference_is_base``) the policy's own base with them off."""
    made: dict[str, Any] = {}

    def make_objective(parts: SetupParts) -> GRPOObjective:
        check_lengths(cfg, parts.model)
        check_generation_backend(cfg.generation.backend.value, parts.run.ctx.device, model=parts.model,
                                 world_size=parts.run.ctx.world_size)
        dataset = parts.data.loader.dataset
        rewards = build_rewards(cfg.rewards, cfg.reward_weights, columns=dataset.columns)
        if parts.run.ctx.is_rank_zero:
            log.info("grpo: %s; rewards %s", describe_grpo(cfg.grpo),
                     ", ".join(f"{name} x {w:g}" for name, w in zip(rewards.functions, rewards.weights)))
        reference = None
        if cfg.grpo.beta and not reference_is_base:
            reference = build_reference(copy.deepcopy(parts.model), parts.plan, ctx=parts.run.ctx, mesh=parts.mesh,
                                        checkpoint_dir=cfg.reference_checkpoint_dir)
        n_chunks = parts.plan.memory.settings.loss_chunks
        made["rollouts"] = Rollouts(cfg.grpo, cfg.generation, rewards, reference, reference_is_base,
                                    max(n_chunks, 1), cfg.samples_every_n_steps)
        return GRPOObjective(cfg.grpo, n_chunks=max(n_chunks, 1), temperature=cfg.generation.temperature,
                             max_new_tokens=cfg.generation.max_new_tokens)

    def make_loop(*args: Any, **kwargs: Any) -> GRPOLoop:
        return GRPOLoop(*args, rollouts=made["rollouts"], **kwargs)

    run_recipe(cfg, batching=PROMPTS, make_objective=make_objective, make_loop=make_loop)

