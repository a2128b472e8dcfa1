"""Token-level cross-entropy, summed, so the caller can normalise by the global number of target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


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
