"""The training objective: what a step minimises, as a function of the model and one micro-batch.

An ``Objective`` gives a micro-batch's summed loss and says how many positions it sums over; the step divides
every micro-batch's sum by the global count (over micro-batches and ranks), so the gradient is that of the mean
loss per target whatever the split. The count is asked for before any forward (``targets``), because that
division must be known before the first backward. Another objective (a distillation loss, a preference loss)
plugs in here without touching the step. An objective with values of its own to report (DPO's rewards) returns
``LossParts``: the loss and the sums of its ``metric_names`` over the same targets, which the step averages as
it averages the loss, in the same one read of the device.

``CrossEntropy`` is the default: token cross-entropy from the whole logits. The chunked loss (a memory
switch, ``torchtune_ac/memory/chunked_loss.py``) gives the same values without the whole logits. A model with
mixture-of-experts layers has its objective wrapped (``with_load_balancing``): the load-balancing loss is added
where the model asks for it, and reported with the tokens each expert received (values an objective sums over
the step without averaging them: its ``count_shapes``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ac.models.families import family_of
from torchtune_ac.models.moe import load_balancing_loss, moe_router_outputs

IGNORE_INDEX = -100
# The keys of a batch that the collate code (``data.collate_batch``) counted on the host, and that stay there when
# the batch moves to the device (``step.move_batch``): reading them costs no host synchronisation.
#   target_count: 0-d, the labels that are not ``IGNORE_INDEX`` (the chunked loss needs the number on the host)
#   document_lengths: [n_documents], a packed batch's documents, row after row (its attention needs them there)
#   sequence_count: 0-d, a packed preference batch's sequences (``data.preference.collate_packed_pairs``)
#   image_grid_thw: [n_images, 3], an image-text batch's image sizes in patches (the vision tower plans on them)
HOST_KEYS = frozenset({"target_count", "document_lengths", "sequence_count", "image_grid_thw"})
# The image tensors of an image-text batch (``data.vision``), passed to a vision-language model's forward, and the
# tokens' multimodal positions where the batch comes with them (the planner's, ``memory/planner/simulation.py``).
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "positions")


@dataclass(frozen=True)
class LossParts:
    """A micro-batch's summed loss with the sums of an objective's own metrics over the same targets.

    Attributes:
        loss: float32 0-d, what backward starts from.
        metrics: float32 ``[len(metric_names)]``, detached, in the objective's ``metric_names`` order.
    """

    loss: torch.Tensor
    metrics: torch.Tensor


class Objective(Protocol):
    """What a step minimises (see the module docstring).

    Attributes:
        metric_names: what the ``LossParts.metrics`` of ``__call__`` sum, in order; empty when it returns the loss
            alone.
        loss_name: what its loss is called where another term is added to it (``LoadBalancedObjective`` logs it
            apart): ``ce_loss``, ``dpo_loss``, ``grpo_loss``.
        loss_scale: the config key that scales the loss and its gradient, with its value (DPO's ``dpo.beta``), named
            when they are not finite; None when the config has none.
    """

    metric_names: tuple[str, ...]
    loss_name: str
    loss_scale: Optional[tuple[str, float]]

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """How many positions of ``batch`` the loss sums over (an int64 0-d tensor, on the batch's device)."""

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> "torch.Tensor | LossParts":
        """The micro-batch's summed loss (a float32 0-d tensor that backward can start from), or with
        ``metric_names``, ``LossParts``."""


def split_loss(output: "torch.Tensor | LossParts") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """An objective's output as ``(loss, metric sums or None)``."""
    return (output.loss, output.metrics) if isinstance(output, LossParts) else (output, None)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, computed in float32; ``labels == -100`` are ignored.

    Args:
        logits: ``[b, s, vocab]``.
        labels: ``[b, s]``, already shifted (``labels[:, i]`` is the target after ``tokens[:, i]``).
    """
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that contribute to the loss (int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()


def host_target_count(batch: Mapping[str, torch.Tensor]) -> Optional[int]:
    """The batch's number of targets from its host-side ``target_count``, or None when it carries none."""
    count = batch.get("target_count")
    return None if count is None else int(count)


def run_model(model: nn.Module, batch: Mapping[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """``model(tokens, document_ids, **kwargs)`` for ``batch``, with its host-side ``document_lengths`` when it is
    packed and the model's ``forward`` takes them (the built-in decoder does: see ``Llama.forward``), and its images
    (``IMAGE_KEYS``) when it has any (a vision-language model's forward takes them)."""
    lengths = batch.get("document_lengths")
    if lengths is not None and "document_lengths" in inspect.signature(model.forward).parameters:
        kwargs["document_lengths"] = lengths
    kwargs.update({key: batch[key] for key in IMAGE_KEYS if key in batch})
    return model(batch["tokens"], batch.get("document_ids"), **kwargs)


@dataclass(frozen=True)
class CrossEntropy:
    """Next-token cross-entropy over every labelled position, from the model's whole logits.

    Batches hold ``tokens`` and ``labels`` ``[b, s]`` and, when packed, ``document_ids``."""

    metric_names = ()
    loss_name = "ce_loss"
    loss_scale = None

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return count_target_tokens(batch["labels"])

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return cross_entropy_sum(run_model(model, batch), batch["labels"])


@dataclass(frozen=True)
class LoadBalancedObjective:
    """``inner`` with the mixture-of-experts load-balancing loss (``models.moe.load_balancing_loss``, as
    transformers computes it over every MoE layer of the forward, every token counted: batches carry no attention
    mask), added as ``coef * aux_loss`` per target when ``add`` (Hugging Face ``output_router_logits``).

    Reported beside ``inner``'s metrics: ``moe_aux_loss``, averaged over the targets as the loss is; when it is
    added, the two terms of the loss apart, ``inner``'s own (its ``loss_name``: ``dpo_loss``, ``ce_loss``) and
    ``moe_aux_term`` (``coef * moe_aux_loss``), which sum to the loss; and ``moe_expert_tokens``
    ``[MoE layers, experts]``, the token copies each expert received, summed over the step's micro-batches and ranks
    (a count: ``count_shapes``).
    """

    inner: Objective
    num_experts: int
    top_k: int
    moe_layers: int
    coef: float
    add: bool

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (*self.inner.metric_names, "moe_aux_loss", *((self.inner.loss_name, "moe_aux_term") if self.add else ()))

    @property
    def loss_name(self) -> str:
        return self.inner.loss_name

    @property
    def loss_scale(self) -> Optional[tuple[str, float]]:
        return self.inner.loss_scale

    @property
    def count_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"moe_expert_tokens": (self.moe_layers, self.num_experts)}

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.targets(batch)

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossParts:
        loss, metrics = split_loss(self.inner(model, batch))
        routed = moe_router_outputs(model)
        targets = self.inner.targets(batch).to(torch.float32)
        with torch.set_grad_enabled(self.add and torch.is_grad_enabled()):
            aux = load_balancing_loss([r.logits for r in routed], self.num_experts, self.top_k)
        terms = []  # the loss's two terms apart, when the aux loss is added: inner's own, then coef * aux
        if self.add:
            term = self.coef * aux * targets
            terms = [loss.detach().reshape(1), term.detach().reshape(1)]
            loss = loss + term
        counts = torch.stack([r.counts for r in routed]).to(torch.float32).flatten()
        own = [] if metrics is None else [metrics]
        return LossParts(loss, torch.cat([*own, (aux.detach() * targets).reshape(1), *terms, counts]))


def with_load_balancing(objective: Objective, model: nn.Module) -> Objective:
    """``objective`` for ``model``: wrapped in ``LoadBalancedObjective`` where the model has mixture-of-experts layers
    (its family's arguments carry ``moe``), as it is otherwise."""
    family = family_of(model)
    moe = getattr(family.args_of(model), "moe", None) if family is not None else None
    if moe is None:
        return objective
    layers = sum(moe.is_sparse(layer) for layer in range(family.args_of(model).n_layers))
    return LoadBalancedObjective(objective, moe.num_experts, moe.top_k, layers, moe.aux_loss_coef, moe.aux_loss)


def metric_count_shapes(objective: Objective) -> Mapping[str, tuple[int, ...]]:
    """The values ``objective`` counts (summed over a step, not averaged over its targets): name -> shape, the tail of
    its ``LossParts.metrics`` after its ``metric_names``, in this order; none for most objectives."""
    return getattr(objective, "count_shapes", {})
