"""Start-up checks that catch, before anything heavy, what would otherwise fail at step 1 or later.

- The tokenizer against the model: a tokenizer with more tokens than the model's vocabulary (or a special-token id
  beyond it) would make an embedding lookup index past the table at the first batch that holds such an id.
- Chat data against the tokenizer: a dataset rendered with a chat template needs a tokenizer that has one (or a
  ``tokenizer.chat_template`` naming one), or the run would stop only once the model is built.
- The optimizer and the LR scheduler, built once on a stand-in parameter: an argument the class itself rejects
  (``optimizer.betas=[0.9]``) is reported naming the key at start-up, and by ``tune validate``, instead of after
  the model is built and sharded.
"""

from __future__ import annotations

from typing import Optional

import torch

from torchtune_ac.config.components import Component
from torchtune_ac.data import uses_chat_template
from torchtune_ac.errors import UnavailableError, UserError

# A schedule built for the stand-in checks only: long enough for any warm-up a real run could ask for.
_STAND_IN_TRAINING_STEPS = 1_000_000


def check_tokenizer_fits(tokenizer: Component, vocab_size: Optional[int]) -> None:
    """Build the tokenizer and check its ids fit the model's vocabulary (``vocab_size``; None: unknown model).

    Raises:
        UnavailableError: the tokenizer's files are not on this machine.
        UserError: the tokenizer's files are broken, or it has more tokens, or a special-token id, beyond the
            model's vocabulary (naming the tokenizer file and both sizes).
    """
    built = tokenizer.instantiate()
    if vocab_size is None:
        return
    problems = []
    if built.vocab_size > vocab_size:
        problems.append(f"it has {built.vocab_size:,} tokens (ids up to {built.vocab_size - 1:,})")
    for name in ("bos", "eos", "pad"):
        token_id = getattr(built, f"{name}_id")
        if token_id is not None and token_id >= vocab_size and built.vocab_size <= vocab_size:
            problems.append(f"its {name} id is {token_id:,}")
    if problems:
        raise UserError(
            f"tokenizer {built.path}: {' and '.join(problems)}, but the model's vocabulary has {vocab_size:,} tokens "
            f"(ids 0 to {vocab_size - 1:,}): such an id would index past the embedding table; use the tokenizer "
            "that belongs to the model's checkpoint, or a model whose vocab_size covers it"
        )


def check_chat_template(tokenizer: Component, dataset: Component) -> None:
    """Refuse chat data with a tokenizer that has no chat template.

    Raises:
        UserError: the dataset renders chat and the tokenizer has no template (naming the tokenizer folder and how
            to name a template).
    """
    if not uses_chat_template(dataset.target(), dataset.kwargs):
        return
    try:
        built = tokenizer.instantiate()
    except UnavailableError:
        return  # not on this machine: check_tokenizer_fits says so
    try:
        built.require_chat_template()
    except UserError as err:
        raise UserError(f"{dataset.key}: {err}") from None


def check_optimizer_builds(optimizer: Component, lr_scheduler: Optional[Component]) -> None:
    """Build the optimizer on one stand-in parameter, and the LR scheduler on that optimizer.

    Raises:
        UserError: either rejected its arguments (naming the key, the class and the arguments).
    """
    stand_in = torch.nn.Parameter(torch.zeros(1))
    built = optimizer.instantiate([stand_in])
    if lr_scheduler is not None:
        lr_scheduler.instantiate(built, num_training_steps=_STAND_IN_TRAINING_STEPS)
