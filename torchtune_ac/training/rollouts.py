"""GRPO's rollouts: the ``generation:`` keys, the sampler's seed, decoding under FSDP2 with the weights gathered once,
the reward functions as the config names them, and the loss pass's batch made from prompts and completions."""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError
from torchtune_ac.generation.backend import check_generation_backend
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.rewards import RewardFunction

# What the rollout hands every reward function by keyword, besides the dataset's columns.
ROLLOUT_KEYWORDS = ("completions", "prompts", "completion_lengths", "max_new_tokens")


class GenerationBackend(str, enum.Enum):
    NATIVE = "native"
    VLLM = "vllm"  # refused where it cannot run (generation/backend.py)


@dataclass(frozen=True)
class GenerationConfig:
    """The ``generation.*`` keys: how the policy samples its completions."""

    max_new_tokens: int = config_key(
        64, doc="The most tokens a completion may have; one that reaches it without an end-of-sequence token is "
        "truncated (grpo.mask_truncated_completions). The prompt plus this must fit the model's positions.",
        minimum=1)
    temperature: float = config_key(
        1.0, doc="Sampling temperature; the loss's log-probabilities are taken at the same one (TRL does too).",
        exclusive_minimum=0.0)
    top_p: float = config_key(
        1.0, doc="Sample from the smallest set of tokens whose probability reaches this; 1: all.",
        exclusive_minimum=0.0, maximum=1.0)
    top_k: int = config_key(0, doc="Sample from the k likeliest tokens; 0: all.", minimum=0)
    compile: bool = config_key(
        False, doc="native backend: torch.compile the one-token decode step (static shapes; the KV cache padded to a "
        "multiple of 16 slots, so prompt batches of nearby widths reuse the compiled code). Compiling takes tens of "
        "seconds once per model, batch size and cache length; it pays where per-op overhead dominates a step (small "
        "models, CPU). Sampled tokens can differ from eager ones by rounding.")
    backend: GenerationBackend = config_key(
        GenerationBackend.NATIVE, doc="native: the policy itself with a static KV cache, batched. vllm: a vLLM engine "
        "in the training process on its GPU, given the policy's weights after each step (one process, a CUDA device "
        "and vLLM installed, else refused in one line; not yet run on a GPU here: docs/grpo.md).")
    vllm_gpu_memory_utilization: float = config_key(
        0.3, doc="generation.backend=vllm: the share of the GPU's memory the engine may take (weights and KV cache); "
        "the policy, its optimizer state and the loss pass share the GPU with it.", exclusive_minimum=0.0,
        maximum=1.0)
    vllm_enable_sleep_mode: bool = config_key(
        False, doc="generation.backend=vllm: the engine releases its weights and KV cache after each rollout (more "
        "memory for the loss pass; the weights are handed over again at the next rollout).")

    def __post_init__(self) -> None:
        if self.compile and self.backend is GenerationBackend.VLLM:
            raise UserError("generation.compile=true applies to the native backend; vLLM compiles its own decoding: "
                            "set generation.compile=false with generation.backend=vllm")
        check_generation_backend(self.backend.value)


def sampler_seed(seed: int, step: int, rank: int) -> int:
    """The sampler's seed of one step on one rank: a resume redraws the same completions with no state saved."""
    return ((seed * 1_000_003 + step) * 1_009 + rank) % (2**63 - 1)


@contextlib.contextmanager
def gathered_for_decoding(model: nn.Module) -> Iterator[None]:
    """Inside the block, an FSDP2-sharded ``model`` keeps each group's weights gathered after its first forward, so
    decoding all-gathers once per generation, not once per token; resharded after. Nothing for a model that is not
    sharded."""
    from torch.distributed.fsdp import FSDPModule

    groups = [(module, group) for module in model.modules() if isinstance(module, FSDPModule)
              for group in module._get_fsdp_state()._fsdp_param_groups]
    # FSDP2 has no getter for the setting: each group's post-forward mesh is saved and put back as it was.
    saved = [(group, group.post_forward_mesh_info) for _, group in groups]
    for module, _ in groups:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for group, mesh_info in saved:
            group.post_forward_mesh_info = mesh_info
        for module in {id(m): m for m, _ in groups}.values():
            module.reshard()


@dataclass(frozen=True)
class Rewards:
    """The run's reward functions by name (their config arguments bound) and their weights."""

    functions: Mapping[str, RewardFunction]
    weights: tuple[float, ...]


def build_rewards(components: Sequence[Any], weights: Optional[Sequence[float]], *,
                  columns: Sequence[str]) -> Rewards:
    """The ``rewards`` components as functions, each checked against the dataset's ``columns``.

    Raises:
        UserError: ``reward_weights`` of another length, or a reward needing an argument that neither the rollout,
            the config nor the dataset gives (``answer``).
    """
    if weights is not None and len(weights) != len(components):
        raise UserError(f"reward_weights: {len(weights)} weight(s) for {len(components)} reward(s); give one each, "
                        "or null for 1.0 each")
    functions: dict[str, RewardFunction] = {}
    for component in components:
        target = component.target()
        name = getattr(target, "__name__", component.path.rsplit(".", 1)[-1])
        if name in functions:
            name = f"{name}_{len(functions)}"
        given = set(component.kwargs) | set(ROLLOUT_KEYWORDS) | set(columns)
        needed = [p.name for p in inspect.signature(target).parameters.values()
                  if p.default is inspect.Parameter.empty and p.name not in given
                  and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
        if needed:
            raise UserError(f"{component.key}: {component.path} needs {', '.join(needed)}, which the dataset does not "
                            f"have (its columns: {', '.join(columns) or 'none'}); name the column in the data, or "
                            "give it in the reward's config")
        functions[name] = functools.partial(target, **component.kwargs) if component.kwargs else target
    return Rewards(functions, tuple(weights) if weights is not None else (1.0,) * len(functions))


def rollout_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  truncated: Sequence[bool], advantages: torch.Tensor, *, pad_id: int,
                  mask_truncated: bool, pack_to: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The loss pass's batch: one prompt and its completion per row, right-padded, with labels on the completion's
    tokens only (none on a truncated completion when ``mask_truncated``), and each row's advantage.

    Args:
        pack_to: also the same sequences packed, in order, into rows of this many tokens (``pack_completion_rows``),
            which ``completion_logps`` runs the model over; None: not packed.

    Returns:
        ``tokens``, ``labels`` ``[n, longest]``, ``advantages`` ``[n]``, and the host-side ``target_count``; packed,
        also ``pack_completion_rows``' keys.
    """
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens[row, :len(prompt) + len(completion)] = torch.tensor([*prompt, *completion], dtype=torch.long)
        if completion and not (mask_truncated and truncated[row]):
            # labels[i] is the token after tokens[i]: the completion's tokens follow the prompt's last one.
            labels[row, len(prompt) - 1:len(prompt) - 1 + len(completion)] = torch.tensor(completion)
    batch = {"tokens": tokens, "labels": labels, "advantages": advantages.float(),
             "target_count": (labels != IGNORE_INDEX).sum()}
    if pack_to is not None:
        batch.update(pack_completion_rows(tokens, labels, [len(p) + len(c) for p, c in zip(prompts, completions)],
                                          pack_to=pack_to, pad_id=pad_id))
    return batch


def pack_completion_rows(tokens: torch.Tensor, labels: torch.Tensor, lengths: Sequence[int], *, pack_to: int,
                         pad_id: int) -> dict[str, torch.Tensor]:
    """The sequences of ``tokens`` / ``labels`` ``[n, s]`` (row i's first ``lengths[i]`` positions, labels already
    shifted within each) packed whole, in order, into rows of ``pack_to`` tokens: a sequence that does not fit the
    rest of a row starts the next. Document ids number the sequences of a row 0, 1, ... and its padding tail one
    more (``data/packing.py``'s layout).

    Returns:
        ``packed_tokens``, ``packed_labels``, ``packed_document_ids`` ``[rows, pack_to]``; the host-side
        ``document_lengths`` (each row's documents and padding tail, row after row); ``unpack_index`` ``[n, s]``:
        where each position of ``tokens`` is in the packed rows flattened, -1 past its sequence.
    """
    places, row, used = [], 0, 0  # (row, offset) of each sequence
    for length in lengths:
        if length > pack_to:
            raise ValueError(f"pack_completion_rows: a sequence of {length} tokens does not fit rows of {pack_to}")
        if used + length > pack_to:
            row, used = row + 1, 0
        places.append((row, used))
        used += length
    rows = row + 1
    packed_tokens = torch.full((rows, pack_to), pad_id, dtype=torch.long)
    packed_labels = torch.full((rows, pack_to), IGNORE_INDEX, dtype=torch.long)
    document_ids = torch.zeros((rows, pack_to), dtype=torch.long)
    unpack_index = torch.full(tokens.shape, -1, dtype=torch.long)
    documents: list[list[int]] = [[] for _ in range(rows)]
    for i, ((r, at), length) in enumerate(zip(places, lengths)):
        packed_tokens[r, at:at + length] = tokens[i, :length]
        packed_labels[r, at:at + length] = labels[i, :length]
        document_ids[r, at:at + length] = len(documents[r])
        unpack_index[i, :length] = torch.arange(r * pack_to + at, r * pack_to + at + length)
        documents[r].append(length)
    for r, docs in enumerate(documents):
        tail = pack_to - sum(docs)
        if tail:
            document_ids[r, pack_to - tail:] = len(docs)
            docs.append(tail)
    return {"packed_tokens": packed_tokens, "packed_labels": packed_labels, "packed_document_ids": document_ids,
            "document_lengths": torch.tensor([n for docs in documents for n in docs]), "unpack_index": unpack_index}


def completion_texts(decode: Callable[..., str], completions: Sequence[Sequence[int]],
                     eos_ids: Sequence[int]) -> list[str]:
    """Each completion as text, without its end-of-sequence token."""
    return [decode([t for t in c if t not in eos_ids], skip_special_tokens=True) for c in completions]
