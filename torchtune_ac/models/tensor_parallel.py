"""A family's tensor-parallel plan: which of its modules are split across the GPUs of a tensor-parallel group, and
how. Pure data; ``parallel/tensor_parallel.py`` applies it with ``torch.distributed.tensor.parallel``.

Megatron-style tensor parallelism with sequence parallelism, over a group of ``degree`` processes that all see the
same batch:

    tokens ──▶ embedding (table split along the vocabulary) ──▶ scattered along the sequence
    per block:  norm on this rank's 1/degree of the sequence (SEQUENCE)
                ──▶ gathered along the sequence (GATHER) ──▶ q/k/v or gate/up split by columns (COLUMN): this
                rank's heads, this rank's MLP columns; per-head q/k norms on this rank's heads (HEADS)
                ──▶ o/down split by rows (ROW): partial sums, reduced and scattered along the sequence
                ──▶ (Gemma 3's post-norms on the sequence shard, SEQUENCE) ──▶ residual add, on the shard
    final norm (SEQUENCE) ──▶ output projection split along the vocabulary (VOCAB_OUTPUT)

So a block's residual stream and norms hold ``1/degree`` of the sequence, its attention and MLP ``1/degree`` of the
heads and columns, and nothing but the norms' small weights is replicated.

Heads are split in contiguous runs: rank r holds query heads ``[r * H/d, (r + 1) * H/d)`` and key/value heads
``[r * K/d, (r + 1) * K/d)``; with grouped-query attention (query head ``i`` reads key/value head ``i // (H/K)``)
those query heads read exactly those key/value heads, so attention runs on each rank's heads alone. Fewer
key/value heads than the degree would need each one copied to several ranks; that is refused
(``degree_problems``), not done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping


class Split(Enum):
    """How one module runs under tensor parallelism (``parallel/tensor_parallel.py`` maps each to a torch
    ``ParallelStyle``)."""

    #: an embedding table split along the vocabulary (its rows); each rank looks up the tokens it holds, and the
    #: partial lookups are summed and scattered along the sequence: the sequence split begins.
    VOCAB_EMBEDDING = "vocab_embedding"
    #: a norm run on this rank's part of the sequence, its weight replicated (its gradient summed over the group).
    SEQUENCE = "sequence"
    #: a module whose first input is gathered along the sequence (the sequence split ends); its other inputs (RoPE
    #: tables, the documents of a packed batch) are whole on every rank already and pass as they are.
    GATHER = "gather"
    #: a linear layer split by output features (its weight's rows): this rank's heads, or MLP columns.
    COLUMN = "column"
    #: a linear layer split by input features (its weight's columns): its partial outputs are summed and scattered
    #: along the sequence (a reduce-scatter): the sequence split begins again.
    ROW = "row"
    #: a norm over ``head_dim``, applied per head (q/k norms), on this rank's heads; its weight replicated.
    HEADS = "heads"
    #: the output projection split along the vocabulary: its input gathered along the sequence; the logits
    #: gathered whole, or a loss head (the chunked loss) computed on the vocabulary shards.
    VOCAB_OUTPUT = "vocab_output"


@dataclass(frozen=True)
class TensorParallelPlan:
    """A model's tensor-parallel plan.

    Attributes:
        root: module path from the model's root -> its split (the embedding, the final norm, the output).
        block: module path within a transformer block -> its split, the same for every block.
        divisible: sizes the degree must divide, by the name a message gives them (``n_heads``: each rank holds
            whole heads; ``intermediate_dim``: whole MLP columns).
    """

    root: Mapping[str, Split]
    block: Mapping[str, Split]
    divisible: Mapping[str, int] = field(default_factory=dict)

    def degree_problems(self, degree: int) -> list[str]:
        """What ``degree`` processes cannot split, one ``name=value`` each (empty when every size divides)."""
        problems = []
        for name, size in self.divisible.items():
            if size % degree:
                fewer = f" (fewer than {degree}: heads are not copied across ranks)" if size < degree else ""
                problems.append(f"{name}={size}{fewer}")
        return problems


def tensor_parallel_problem(plan: TensorParallelPlan, degree: int, key: str = "tensor_parallel_dim") -> str | None:
    """The one-line refusal of a degree the plan cannot take, naming the numbers; None when it can."""
    problems = plan.degree_problems(degree)
    if not problems:
        return None
    return f"{key}={degree}: must divide " + ", ".join(problems)
