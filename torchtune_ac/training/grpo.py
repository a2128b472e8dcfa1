"""Group relative policy optimisation (Shao et al., 2024, "DeepSeekMath"), exact to TRL 1.16's ``GRPOTrainer``: the
group-normalised advantages and the clipped policy-ratio loss of ``recipes/grpo.py``.

    grpo:
      num_generations: 8              # completions per prompt (a group)
      loss_type: dapo                 # grpo, bnpo, dr_grpo or dapo (TRL's default)
      epsilon: 0.2                    # the ratio's lower clip, 1 - epsilon
      epsilon_high: null              # its upper clip, 1 + epsilon_high (DAPO's clip-higher); null: epsilon
      beta: 0.0                       # the KL term to the reference (k3 estimator); 0: no reference is loaded
      num_iterations: 1               # passes over one batch of rollouts (old log-probabilities kept)
      importance_sampling_level: token  # or sequence (GSPO)
      scale_rewards: group            # group, batch or none
      kl_bias_correction: true        # the KL term times the ratio (TRL's use_bias_correction_kl)
      mask_truncated_completions: false

Per completion token ``t`` with log-probability ``p`` (policy, at the sampling temperature), ``p_old`` (the policy
that generated the rollouts; ``p`` itself, detached, with one iteration) and ``p_ref`` (the reference), and the
completion's advantage ``A``:

    r     = exp(p - p_old)                   (sequence level: exp of the mean of p - p_old over the completion)
    kl    = exp(p_ref - p) - (p_ref - p) - 1  (times r, 1 in value, with kl_bias_correction: TRL's default)
    loss  = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl

aggregated as TRL does: ``grpo`` the mean over completions of each one's token mean; ``bnpo`` and ``dapo`` the mean
over every completion token of the batch; ``dr_grpo`` the token sum over ``completions x max_new_tokens``.
``Objective.targets`` counts what each divides by (completions, tokens, or completions times the length), so the
step's division by the global count gives TRL's loss on one micro-batch and one process, and ``dapo``'s global
normalisation under accumulation and several processes (TRL's ``bnpo`` normalises each micro-batch alone).

The advantage of a completion is its reward minus its group's mean, divided (``scale_rewards``) by the group's
sample standard deviation (``group``), the whole batch's (``batch``) or nothing (``none``), plus 1e-4.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import nn

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError
from torchtune_ac.training.objective import IGNORE_INDEX, LossParts, host_target_count, run_model
from torchtune_ac.training.sequence_logps import ChunkedTokenLogProbs

# The objective's metrics, summed over its targets and averaged by the step as the loss is.
GRPO_METRICS = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")


class GRPOLossType(str, enum.Enum):
    GRPO = "grpo"
    BNPO = "bnpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"


class ImportanceSamplingLevel(str, enum.Enum):
    TOKEN = "token"
    SEQUENCE = "sequence"


class ScaleRewards(str, enum.Enum):
    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


@dataclass(frozen=True)
class GRPOConfig:
    """The ``grpo.*`` keys (see the module docstring)."""

    num_generations: int = config_key(
        8, doc="Completions sampled per prompt: a group, whose rewards are normalised together. TRL's "
        "num_generations.", minimum=2)
    loss_type: GRPOLossType = config_key(
        GRPOLossType.DAPO, doc="How the per-token losses are averaged: grpo (each completion's token mean, then the "
        "mean over completions), bnpo and dapo (the mean over every completion token), dr_grpo (the token sum over "
        "completions x generation.max_new_tokens). TRL's loss_type.")
    epsilon: float = config_key(
        0.2, doc="The policy ratio's lower clip, 1 - epsilon (and its upper one where epsilon_high is null).",
        minimum=0.0)
    epsilon_high: Optional[float] = config_key(
        None, doc="The ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher uses 0.28); null: epsilon.",
        minimum=0.0)
    beta: float = config_key(
        0.0, doc="The weight of the KL term to the reference (TRL's k3 estimator, per token); 0: no reference "
        "model is loaded.", minimum=0.0)
    num_iterations: int = config_key(
        1, doc="Optimizer steps taken on one batch of rollouts, the policy ratio against the log-probabilities of the "
        "policy that generated them. TRL's num_iterations (mu).", minimum=1)
    importance_sampling_level: ImportanceSamplingLevel = config_key(
        ImportanceSamplingLevel.TOKEN, doc="token: one policy ratio per token; sequence: one per completion, the "
        "exponential of its tokens' mean log-ratio (GSPO, with loss_type grpo).")
    scale_rewards: ScaleRewards = config_key(
        ScaleRewards.GROUP, doc="What the group-centred rewards are divided by: the group's standard deviation "
        "(group), the batch's (batch) or nothing (none, Dr. GRPO).")
    kl_bias_correction: bool = config_key(
        True, doc="The KL term multiplied by the policy ratio (1 in value, not in gradient), which makes its "
        "gradient the unbiased reverse-KL gradient (DeepSeek-V3.2). TRL's use_bias_correction_kl, on by default.")
    mask_truncated_completions: bool = config_key(
        False, doc="Completions that reached generation.max_new_tokens without an end-of-sequence token count for "
        "nothing in the loss (DAPO).")
    pack_completions: bool = config_key(
        False, doc="The log-probability and loss passes run over packed rows: each prompt with its completion whole, "
        "as many as fit in max_seq_len tokens a row, each attending to itself only (the model's packed forward), "
        "so short completions leave little padding. The same loss and gradients within rounding.")

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __post_init__(self) -> None:
        if self.epsilon < 0:  # the schema checks it too; a config built in Python comes here
            raise UserError(f"grpo.epsilon={self.epsilon:g}: must be at least 0 (the ratio is clipped to "
                            "[1 - epsilon, 1 + epsilon_high])")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise UserError(f"grpo.epsilon_high={self.epsilon_high:g}: must be at least 0, or null for epsilon")
        if self.num_generations < 2:
            raise UserError(f"grpo.num_generations={self.num_generations}: must be at least 2 (the advantages are "
                            "rewards relative to the other completions of the same prompt)")


def describe_grpo(config: GRPOConfig) -> str:
    """One line on the objective, for ``tune validate`` and the run's log."""
    clip = f"clip [{1 - config.epsilon:g}, {1 + config.resolved_epsilon_high:g}]"
    kl = f"KL beta {config.beta:g} to the starting weights" if config.beta else "no KL term (no reference)"
    level = ", sequence-level ratio (GSPO)" if config.importance_sampling_level is ImportanceSamplingLevel.SEQUENCE \
        else ""
    return (f"{config.loss_type.value} loss, {config.num_generations} completions per prompt, {clip}{level}, {kl}, "
            f"{config.num_iterations} iteration(s) per rollout, rewards scaled by {config.scale_rewards.value}")


@dataclass(frozen=True)
class Advantages:
    """Per completion ``[n]`` float32: the advantage, its group's reward standard deviation, and whether it is 0."""

    advantages: torch.Tensor
    group_std: torch.Tensor
    zero_std: torch.Tensor


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: ScaleRewards) -> Advantages:
    """TRL's advantages: ``rewards`` ``[n]`` (``n / num_generations`` groups, a group's completions adjacent) minus
    their group's mean, divided by the standard deviation ``scale`` names (sample, n - 1) plus 1e-4."""
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [groups, g]
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    group_std = grouped.std(dim=1).repeat_interleave(num_generations)
    std = rewards.std().expand_as(rewards) if scale is ScaleRewards.BATCH and rewards.numel() > 1 else group_std
    if scale is ScaleRewards.BATCH and rewards.numel() == 1:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale is not ScaleRewards.NONE:
        advantages = advantages / (std + 1e-4)
    return Advantages(advantages, group_std, torch.isclose(std, torch.zeros_like(std)))


@dataclass(frozen=True)
class TokenTerms:
    """Per completion token ``[b, s]`` (0 where not a loss token): the loss before aggregation, and the detached
    KL and clip indicators the metrics average."""

    losses: torch.Tensor
    kl: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def grpo_token_losses(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
                      advantages: torch.Tensor, mask: torch.Tensor, config: GRPOConfig) -> TokenTerms:
    """The per-token loss of the module docstring.

    Args:
        logps: ``[b, s]`` float32, the policy's log-probability of each label (gradient flows).
        old_logps: ``[b, s]``, the generating policy's; None: ``logps`` detached (one iteration).
        ref_logps: ``[b, s]``, the reference's; None without the KL term.
        advantages: ``[b]``.
        mask: ``[b, s]`` bool, the loss tokens.
        config: clip range, beta, importance-sampling level.
    """
    maskf = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = (logps - old) * maskf
    if config.importance_sampling_level is ImportanceSamplingLevel.SEQUENCE:
        log_ratio = (log_ratio.sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [b, 1]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.resolved_epsilon_high)
    adv = advantages.float().unsqueeze(-1)  # [b, 1]
    losses = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if config.beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if config.kl_bias_correction:
            kl = kl * ratio
        losses = losses + config.beta * kl
    losses = losses.expand_as(logps) * maskf
    low = ((ratio < 1 - config.epsilon) & (adv < 0)).expand_as(mask) & mask
    high = ((ratio > 1 + config.resolved_epsilon_high) & (adv > 0)).expand_as(mask) & mask
    return TokenTerms(losses, (kl * maskf).detach(), low, high)


def aggregate_losses(terms: TokenTerms, mask: torch.Tensor, loss_type: GRPOLossType) -> torch.Tensor:
    """The summed loss whose division by ``GRPOObjective.targets`` (over the step) is TRL's: per completion the
    token mean for ``grpo``, else the token sum."""
    if loss_type is GRPOLossType.GRPO:
        return (terms.losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return terms.losses.sum()


def count_grpo_targets(mask: torch.Tensor, loss_type: GRPOLossType, max_new_tokens: int) -> torch.Tensor:
    """What ``loss_type`` divides the summed loss by, for one micro-batch (int64 0-d): its completions (``grpo``),
    completions x ``max_new_tokens`` (``dr_grpo``), or its loss tokens (``bnpo``, ``dapo``)."""
    rows = torch.tensor(mask.shape[0], device=mask.device)
    if loss_type is GRPOLossType.GRPO:
        return rows
    if loss_type is GRPOLossType.DR_GRPO:
        return rows * max_new_tokens
    return mask.sum()


def completion_logps(model: nn.Module, batch: Mapping[str, torch.Tensor], *, n_chunks: int, temperature: float,
                     entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[b, s]`` float32: the log-probability of each of ``batch``'s labels at ``temperature``, 0 where ignored,
    chunk by chunk (never the whole logits); ``entropy``, a ``[b, s]`` buffer, is filled where given. A batch with
    packed rows (``rollout_batch(..., pack_to=...)``) runs the model over those, and the values are laid back in
    its one-sequence-a-row layout."""
    if "unpack_index" in batch:
        return _packed_completion_logps(model, batch, n_chunks=n_chunks, temperature=temperature, entropy=entropy)
    head = ChunkedTokenLogProbs(batch["labels"], max(n_chunks, 1), temperature=temperature,
                                n_targets=host_target_count(batch), entropy=entropy)
    return run_model(model, batch, head=head)


def _packed_completion_logps(model: nn.Module, batch: Mapping[str, torch.Tensor], *, n_chunks: int,
                             temperature: float, entropy: Optional[torch.Tensor]) -> torch.Tensor:
    packed = {"tokens": batch["packed_tokens"], "labels": batch["packed_labels"],
              "document_ids": batch["packed_document_ids"], "document_lengths": batch["document_lengths"],
              "target_count": batch["target_count"]}
    packed_entropy = None if entropy is None else torch.zeros(packed["labels"].shape, dtype=torch.float32,
                                                               device=entropy.device)
    logps = completion_logps(model, packed, n_chunks=n_chunks, temperature=temperature, entropy=packed_entropy)
    index = batch["unpack_index"]  # [b, s]: each position's place in the packed rows, flattened; -1: padding
    inside, where = index >= 0, index.clamp(min=0)
    if entropy is not None:
        entropy.copy_(packed_entropy.flatten()[where].masked_fill(~inside, 0.0))
    return logps.flatten()[where].masked_fill(~inside, 0.0)


@dataclass(frozen=True)
class GRPOObjective:
    """The GRPO loss of a micro-batch of rollouts, for the step (an ``Objective``).

    Batches hold ``tokens`` and ``labels`` ``[b, s]`` (one prompt and its completion per row, right-padded; labels
    the completion's tokens, shifted, ``IGNORE_INDEX`` elsewhere and on masked completions), ``advantages`` ``[b]``,
    and where needed ``old_logps`` and ``ref_logps`` ``[b, s]`` (computed once per rollout batch, aligned with the
    labels). Reported: ``GRPO_METRICS``, averaged over the targets as the loss is.
    """

    config: GRPOConfig
    n_chunks: int
    temperature: float
    max_new_tokens: int
    metric_names = GRPO_METRICS
    loss_name = "grpo_loss"

    @property
    def loss_scale(self) -> Optional[tuple[str, float]]:
        return ("grpo.beta", self.config.beta) if self.config.beta else None

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return count_grpo_targets(batch["labels"] != IGNORE_INDEX, self.config.loss_type, self.max_new_tokens)

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossParts:
        mask = batch["labels"] != IGNORE_INDEX
        entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        logps = completion_logps(model, batch, n_chunks=self.n_chunks, temperature=self.temperature,
                                 entropy=entropy)
        terms = grpo_token_losses(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask,
                                  self.config)
        loss = aggregate_losses(terms, mask, self.config.loss_type)
        values = (terms.kl, entropy, terms.low_clipped.float(), terms.high_clipped.float(),
                  (terms.low_clipped | terms.high_clipped).float())
        # Each metric aggregated as the loss is (a token mean per completion for grpo, a token sum otherwise).
        metrics = torch.stack([aggregate_losses(TokenTerms(v, v, v, v), mask, self.config.loss_type) for v in values])
        return LossParts(loss, metrics.detach())
