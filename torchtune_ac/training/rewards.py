"""GRPO's reward functions and how their scores are checked: each takes the batch's completions (text) and, by
keyword, the dataset's columns (``answer``), and returns one float per completion; the run's reward is their
weighted sum. A function that raises, returns another number of scores, or a non-finite score stops the run in one
line naming it (``RewardError``), before the optimizer takes a step.

Built in: ``math_answer`` (the completion's final answer against the dataset's: ``math_verify`` where installed, a
numeric comparison of the last number otherwise), ``format_match`` (a regex), ``length_penalty``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError

RewardFunction = Callable[..., Sequence[float]]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(UserError):
    """A reward function failed or returned what the run cannot use (its name first)."""


def final_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators dropped; after ``####`` where there is one), or None."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


@config_component
def math_answer(completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion's final answer equals the dataset's ``answer``, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        verify = None
    scores = []
    for completion, expected in zip(completions, answer):
        if verify is not None:
            scores.append(float(bool(verify(parse(str(expected)), parse(completion)))))
            continue
        got, want = final_number(completion), final_number(str(expected))
        scores.append(float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6)))
    return scores


@config_component
def format_match(completions: Sequence[str], *, pattern: str, **_: Any) -> list[float]:
    """1.0 where the whole completion matches ``pattern`` (a regex, dot matching newlines), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.fullmatch(c.strip()) is not None) for c in completions]


@config_component
def length_penalty(completions: Sequence[str], completion_lengths: Sequence[int], *, max_new_tokens: int,
                   **_: Any) -> list[float]:
    """``-length / max_new_tokens`` per completion: 0 for an empty one, -1 for one that used every token."""
    return [-n / max_new_tokens for n in completion_lengths]


def score_completions(functions: Mapping[str, RewardFunction], weights: Sequence[float], completions: Sequence[str],
                      columns: Mapping[str, Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each function's scores ``[n, functions]`` and their weighted sum ``[n]`` (float32).

    Raises:
        RewardError: a function raised, returned other than one finite number per completion (named).
    """
    n = len(completions)
    per_function = []
    for name, function in functions.items():
        try:
            scores = function(completions=list(completions), **columns)
        except Exception as error:  # a user's function: whatever it raises is reported as its failure
            raise RewardError(f"reward {name} raised {type(error).__name__}: {error}") from error
        try:
            values = torch.tensor([float(s) for s in scores], dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise RewardError(f"reward {name} must return one float per completion: {error}") from error
        if values.shape != (n,):
            raise RewardError(f"reward {name} returned {values.numel()} scores for {n} completions")
        if not torch.isfinite(values).all():
            bad = int((~torch.isfinite(values)).nonzero()[0])
            raise RewardError(f"reward {name} returned {values[bad].item()} for completion {bad}: scores must be "
                              "finite")
        per_function.append(values)
    table = torch.stack(per_function, dim=1)  # [n, functions]
    return table, table @ torch.tensor(list(weights), dtype=torch.float32)
