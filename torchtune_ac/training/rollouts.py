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
        GenerationBackend.NATIVE, doc="native: the policy itself with a static KV cache, batched. vllm: refused in "
        "one line (colocated vLLM generation is not built in this version; without vLLM installed or a CUDA device "
        "the refusal says so).")

    def __post_init__(self) -> None:
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
                  mask_truncated: bool) -> dict[str, torch.Tensor]:
    """The loss pass's batch: one prompt and its completion per row, right-padded, with labels on the completion's
    tokens only (none on a truncated completion when ``mask_truncated``), and each row's advantage.

    Returns:
        ``tokens``, ``labels`` ``[n, longest]``, ``advantages`` ``[n]``, and the host-side ``target_count``.
    """
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens[row, :len(prompt) + len(completion)] = torch.tensor([*prompt, *completion], dtype=torch.long)
        if completion and not (mask_truncated and truncated[row]):
            # labels[i] is the token after tokens[i]: the completion's tokens follow the prompt's last one.
            labels[row, len(prompt) - 1:len(prompt) - 1 + len(completion)] = torch.tensor(completion)
    return {"tokens": tokens, "labels": labels, "advantages": advantages.float(),
            "target_count": (labels != IGNORE_INDEX).sum()}


def completion_texts(decode: Callable[..., str], completions: Sequence[Sequence[int]],
                     eos_ids: Sequence[int]) -> list[str]:
    """Each completion as text, without its end-of-sequence token."""
    return [decode([t for t in c if t not in eos_ids], skip_special_tokens=True) for c in completions]
