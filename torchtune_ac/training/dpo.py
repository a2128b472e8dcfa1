"""Direct preference optimisation (Rafailov et al., 2023, "Direct Preference Optimization"): the objective of
``recipes/full_dpo.py``, its frozen reference model, and the reference's log-probabilities computed ahead.

    dpo:
      beta: 0.1               # how far the policy may move from the reference (IPO: its tau)
      label_smoothing: 0.0    # conservative DPO: the chance that a pair's preference is flipped
      loss_type: sigmoid      # or ipo
      reference: resident     # or precomputed
    ref_checkpoint_dir: null  # the reference's weights; null: the policy's starting weights

Each answer is scored by its log-probability summed over its tokens (prompt masked, ``data/preference.py``), under
the policy (``pi``) and the frozen reference (``ref``). With ``h = pi - ref`` for the chosen (``c``) and the
rejected (``r``) answer of a pair:

    sigmoid:  -(1 - e) log sigmoid(beta (h_c - h_r)) - e log sigmoid(-beta (h_c - h_r))     e = label_smoothing
    ipo:      (h_c / n_c - h_r / n_r - 1 / (2 beta))^2       n: the answer's tokens (TRL's per-token IPO)

The loss of a step is the mean over its pairs (``targets`` counts pairs), as TRL's ``DPOTrainer`` averages a batch.
Chosen and rejected go through the model in one forward: a batch's ``2b`` rows are the chosen sequences, then the
rejected ones (``collate_preference_batch``). With ``loss_chunks`` above 1 the log-probabilities come from
``sequence_logps.py``: never the whole logits.

Metrics (per pair, averaged like the loss; ``metrics.jsonl``, trackers, progress line):
``rewards_chosen`` / ``rewards_rejected`` (``beta * h``), ``rewards_margin`` (their difference), ``rewards_accuracy``
(the share of pairs whose chosen reward is the higher, a tie counting one half), ``logps_chosen`` /
``logps_rejected`` (the policy's summed log-probabilities). At step 0 the policy is the reference: every reward is 0,
every pair's loss ln 2 (sigmoid), and ``rewards_accuracy`` 0.5 by the tie rule (TRL counts ties as 0, so it logs
0 there). With a precomputed reference the two sides are computed in other batches, so the rewards are 0 only
within rounding, and the accuracy near 0.5.

The reference is a model of the policy's shape, sharded like it, frozen (no gradients, no optimizer state, eval
mode) and run under ``no_grad`` before the policy's forward. ``reference: precomputed`` runs it once over the data
before training (``run/reference.py``'s ``precompute_reference``), keeps two numbers per pair with the data,
and frees it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError
from torchtune_ac.training.sequence_logps import ChunkedSequenceLogProbs, sequence_logps
from torchtune_ac.training.objective import IGNORE_INDEX, LossParts, host_target_count, run_model

log = logging.getLogger("torchtune_ac.dpo")

DPO_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen",
               "logps_rejected")


class DPOLossType(str, enum.Enum):
    SIGMOID = "sigmoid"
    IPO = "ipo"


class ReferenceMode(str, enum.Enum):
    RESIDENT = "resident"  # the reference model stays, and runs before every policy forward
    PRECOMPUTED = "precomputed"  # its log-probabilities are computed once before training; it is then freed


@dataclass(frozen=True)
class DPOConfig:
    """The ``dpo.*`` keys (see the module docstring)."""

    beta: float = config_key(
        0.1, doc="How strongly the policy is held to the reference: the scale of the log-ratios in the loss (IPO: its "
        "regularisation tau). torchtune's DPOLoss beta.", exclusive_minimum=0.0, torchtune="loss.beta")
    label_smoothing: float = config_key(
        0.0, doc="Conservative DPO: the probability that a pair's preference is flipped (the sigmoid loss only); below "
        "0.5, where the loss is ln 2 whatever the policy and its gradient 0.", minimum=0.0, exclusive_maximum=0.5,
        torchtune="loss.label_smoothing")
    loss_type: DPOLossType = config_key(
        DPOLossType.SIGMOID, doc="sigmoid (DPO), or ipo (IPO, as TRL computes it: the log-ratios divided by the "
        "answer's tokens).")
    reference: ReferenceMode = config_key(
        ReferenceMode.RESIDENT, doc="resident: the reference model stays, sharded like the policy, and runs before "
        "every policy forward; precomputed: its log-probabilities are computed in a first pass over the data, kept "
        "with the pairs, and the model is freed.")

    def __post_init__(self) -> None:
        largest = torch.finfo(torch.float32).max  # the loss is computed in float32
        if self.beta > largest:
            raise UserError(f"dpo.beta={self.beta:g}: the loss multiplies the log-ratios by it in float32, whose "
                            f"largest finite value is {largest:.3g}, so no step could be finite; DPO's beta is "
                            "usually between 0.01 and 1")
        if self.loss_type is DPOLossType.IPO and 1 / (2 * self.beta) > largest:
            raise UserError(f"dpo.beta={self.beta:g}: IPO's target margin 1 / (2 beta) is not finite in float32 (the "
                            "loss's dtype), so no step could be finite; IPO's tau is usually between 0.01 and 1")
        if self.label_smoothing and self.loss_type is not DPOLossType.SIGMOID:
            raise UserError(f"dpo.label_smoothing={self.label_smoothing}: only the sigmoid loss has label smoothing "
                            f"(dpo.loss_type={self.loss_type.value}); set it to 0")


def describe_dpo(config: DPOConfig, ref_checkpoint_dir: Optional[str]) -> str:
    """One line on the loss and the reference, for ``tune validate`` and the run's log."""
    loss = f"{config.loss_type.value} loss, beta {config.beta:g}"
    if config.label_smoothing:
        loss += f", label smoothing {config.label_smoothing:g} (conservative DPO)"
    weights = ref_checkpoint_dir if ref_checkpoint_dir is not None else "the starting weights"
    how = ("resident, sharded like the policy, frozen" if config.reference is ReferenceMode.RESIDENT
           else "its log-probabilities computed before training, then freed")
    return f"{loss}; reference: {weights}, {how}"


@dataclass(frozen=True)
class PairTerms:
    """Per pair: the loss and the rewards (``beta * (policy - reference)``, detached)."""

    losses: torch.Tensor  # [b]
    rewards_chosen: torch.Tensor  # [b]
    rewards_rejected: torch.Tensor  # [b]


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, config: DPOConfig,
             answer_tokens: Optional[torch.Tensor] = None) -> PairTerms:
    """Each pair's loss (see the module docstring), in float32.

    Args:
        policy_logps: ``[2b]``: the chosen answers' summed log-probabilities, then the rejected ones'.
        reference_logps: ``[2b]``, the same under the reference (no gradient flows into them).
        config: beta, label smoothing, loss type.
        answer_tokens: ``[2b]``, each answer's token count (required for IPO).

    Returns:
        The per-pair terms.
    """
    policy_chosen, policy_rejected = policy_logps.float().chunk(2)
    reference_chosen, reference_rejected = reference_logps.detach().float().chunk(2)
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    if config.loss_type is DPOLossType.IPO:
        chosen_tokens, rejected_tokens = answer_tokens.float().clamp(min=1).chunk(2)
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * config.beta)) ** 2
    else:
        margin = config.beta * (chosen_ratio - rejected_ratio)
        losses = -F.logsigmoid(margin)
        if config.label_smoothing:
            losses = (1 - config.label_smoothing) * losses - config.label_smoothing * F.logsigmoid(-margin)
    return PairTerms(losses, config.beta * chosen_ratio.detach(), config.beta * rejected_ratio.detach())


def batch_sequences(batch: Mapping[str, torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
    """A batch's ``sequence_ids`` and how many sequences it holds: a packed batch's (``collate_packed_pairs``), or
    None and its rows (``collate_preference_batch``: a sequence a row)."""
    if "sequence_ids" in batch:
        return batch["sequence_ids"], int(batch["sequence_count"])  # a host value: no synchronisation
    return None, batch["labels"].shape[0]


def answer_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[2p]`` each answer's target count, chosen then rejected."""
    sequence_ids, n_sequences = batch_sequences(batch)
    targets = batch["labels"] != IGNORE_INDEX
    if sequence_ids is None:
        return targets.sum(dim=1)
    return targets.new_zeros(n_sequences, dtype=torch.long).index_add_(0, sequence_ids.flatten(),
                                                                       targets.flatten().long())


def answer_logps(model: nn.Module, batch: Mapping[str, torch.Tensor], n_chunks: int) -> torch.Tensor:
    """Every answer's summed log-probability of its labels under ``model``: ``[2p]`` float32 (a row's, or a packed
    sequence's), from the whole logits (``n_chunks`` 1) or through ``ChunkedSequenceLogProbs``."""
    sequence_ids, n_sequences = batch_sequences(batch)
    if n_chunks > 1:
        head = ChunkedSequenceLogProbs(batch["labels"], n_chunks, host_target_count(batch), sequence_ids,
                                       n_sequences)
        return run_model(model, batch, head=head)
    return sequence_logps(run_model(model, batch), batch["labels"], sequence_ids, n_sequences)


def freeze_reference(model: nn.Module) -> nn.Module:
    """``model`` as a reference: no parameter takes a gradient, and it stays in eval mode (no dropout)."""
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def reference_logps(reference: nn.Module, batch: Mapping[str, torch.Tensor], n_chunks: int) -> torch.Tensor:
    """The reference's ``[2b]`` summed log-probabilities of a batch's answers (no graph is kept)."""
    return answer_logps(reference, batch, n_chunks)


@dataclass(frozen=True)
class DPOObjective:
    """The step's objective (``training/objective.py``) for preference pairs.

    Batches are ``collate_preference_batch``'s: ``2b`` rows, chosen then rejected, and ``reference_logps`` when they
    were precomputed; or packed rows (``collate_packed_pairs``), whose ``sequence_ids`` number the same ``2p``
    sequences in the same order. ``targets`` counts the pairs with a target (an evaluation's filler pairs count for
    nothing).

    Attributes:
        config: the ``dpo`` keys.
        n_chunks: the resolved ``loss_chunks`` (1: the whole logits).
        reference: the resident reference model; None when every batch carries ``reference_logps``.
    """

    config: DPOConfig
    n_chunks: int = 1
    reference: Optional[nn.Module] = None
    metric_names = DPO_METRICS
    loss_name = "dpo_loss"

    @property
    def loss_scale(self) -> tuple[str, float]:
        return "dpo.beta", self.config.beta

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return pair_mask(answer_tokens(batch)).sum()

    def reference_logps(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The batch's precomputed reference log-probabilities, or the resident reference's."""
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if self.reference is None:
            raise ValueError("a DPO batch without reference_logps needs a resident reference model")
        return reference_logps(self.reference, batch, self.n_chunks)

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossParts:
        reference = self.reference_logps(batch)  # first: its forward's memory is gone before the policy's
        policy = answer_logps(model, batch, self.n_chunks)
        tokens = answer_tokens(batch)  # [2p]
        terms = dpo_loss(policy, reference, self.config, answer_tokens=tokens)
        valid = pair_mask(tokens).float()  # [p]
        chosen, rejected = terms.rewards_chosen, terms.rewards_rejected
        accuracy = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
        policy_chosen, policy_rejected = policy.detach().chunk(2)
        metrics = torch.stack([chosen, rejected, accuracy, chosen - rejected, policy_chosen, policy_rejected])
        return LossParts((terms.losses * valid).sum(), (metrics * valid).sum(dim=1))  # [6, b] -> [6]


def pair_mask(answer_tokens: torch.Tensor) -> torch.Tensor:
    """``[p]`` bool: the pairs whose chosen answer has a target, from ``answer_tokens`` ``[2p]``."""
    return answer_tokens[: answer_tokens.shape[0] // 2] > 0
