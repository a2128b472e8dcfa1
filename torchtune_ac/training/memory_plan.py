"""The memory switches, resolved in one place: activation checkpointing, the optimizer step in backward, and
the chunked loss. ``resolve_memory_plan`` turns the config keys and the model into a ``MemoryPlan``, a frozen
value that the recipe's step follows, ``tune validate`` prints, and the memory planner estimates.

    optimizer_in_bwd: false | true     # step each parameter in backward; its gradient is freed at once
    loss_chunks: null | N              # N > 1: project and score the targets N chunks at a time

``loss_chunks: null`` (the default) chooses from the vocabulary: ``DEFAULT_LOSS_CHUNKS`` chunks when it has at
least ``CHUNKED_LOSS_MIN_VOCAB`` tokens (the logits then outweigh everything else a step keeps), else the
whole logits (see the README's "Fitting a bigger model" for the measurements behind this).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.training.activation_checkpointing import ACConfig, ACPlan

DEFAULT_LOSS_CHUNKS = 8
CHUNKED_LOSS_MIN_VOCAB = 32_000


@dataclass(frozen=True)
class MemoryConfig:
    """The memory switches besides activation checkpointing (top-level config keys)."""

    # Step each parameter's optimizer in backward, as soon as its gradient is final, and free the gradient.
    optimizer_in_bwd: bool = False
    # Chunks of the output projection + cross-entropy; null: DEFAULT_LOSS_CHUNKS for large vocabularies, else 1.
    loss_chunks: Optional[int] = field(default=None, metadata={"minimum": 1})


@dataclass(frozen=True)
class MemoryPlan:
    """What a training step does to save memory.

    Attributes:
        ac: which blocks are checkpointed, and how.
        optimizer_in_backward: each parameter is stepped in backward and its gradient freed at once.
        loss_chunks: 1 for the whole logits, else the number of checkpointed chunks of the loss.
        vocab_size: the vocabulary the loss projects to (None when the model's family is unknown).
    """

    ac: ACPlan
    optimizer_in_backward: bool
    loss_chunks: int
    vocab_size: Optional[int] = None

    def describe(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines for ``tune validate`` and the recipe's log."""
        vocab = f" (vocabulary {self.vocab_size:,})" if self.vocab_size else ""
        if self.loss_chunks > 1:
            loss = (f"{self.loss_chunks} chunks{vocab}: targets only, each chunk's logits recomputed in "
                    "backward, never the whole logits")
        else:
            loss = f"whole logits{vocab}"
        step = ("in backward: each parameter stepped as its gradient is ready, gradients freed at once"
                if self.optimizer_in_backward else "after backward")
        return [("activation checkpointing", str(self.ac)), ("optimizer step", step), ("loss", loss)]


def takes_output_head(model: nn.Module) -> bool:
    """Whether the model's forward accepts ``head=`` (the chunked loss runs through it)."""
    return "head" in inspect.signature(model.forward).parameters


def _vocab_size(model: nn.Module) -> Optional[int]:
    family = family_of(model)
    return None if family is None else family.hf.architecture(family.args_of(model))["vocab_size"]


def resolve_memory_plan(
    ac: ACConfig, memory: MemoryConfig, model: nn.Module, *, clip_grad_norm: Optional[float]
) -> MemoryPlan:
    """Resolve the memory switches for ``model`` (built, or on the meta device).

    Args:
        ac: the activation-checkpointing keys.
        memory: ``optimizer_in_bwd`` and ``loss_chunks``.
        model: the model the run trains.
        clip_grad_norm: the config's value (clipping needs the total norm before any parameter is stepped).

    Returns:
        The plan.

    Raises:
        UserError: one line naming the keys of a combination that cannot work: ``optimizer_in_bwd`` with
            ``clip_grad_norm``, or ``loss_chunks`` > 1 for a model whose forward takes no output head; and the
            AC problems of ``ACConfig.resolve``.
    """
    plan = ac.resolve(len(transformer_blocks(model)))
    if memory.optimizer_in_bwd and clip_grad_norm is not None:
        raise UserError(
            f"optimizer_in_bwd=true with clip_grad_norm={clip_grad_norm}: in backward each parameter is updated as "
            "soon as its gradient is ready, before the total norm that clipping scales by is known; set "
            "clip_grad_norm: null, or optimizer_in_bwd: false"
        )
    vocab_size = _vocab_size(model)
    chunks = memory.loss_chunks
    if chunks is None:
        chunks = DEFAULT_LOSS_CHUNKS if vocab_size is not None and vocab_size >= CHUNKED_LOSS_MIN_VOCAB else 1
    if chunks > 1 and not takes_output_head(model):
        raise UserError(
            f"loss_chunks={chunks}: the chunked loss runs through the model's output head, and "
            f"{type(model).__name__}.forward takes no `head` argument; set loss_chunks: 1"
        )
    return MemoryPlan(ac=plan, optimizer_in_backward=memory.optimizer_in_bwd, loss_chunks=chunks, vocab_size=vocab_size)
