"""What a recipe trains on, as one value each (``SAMPLES``, ``PAIRS``, ``PROMPTS``): the type its dataset builders return, what
such data is called and which builders make it (the schema refuses another recipe's builder by its annotation),
how its samples become batches, and the keys a sample holds (a builder without an annotation is checked on its
first sample, ``check_kind``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchtune_ac.data.collate import collate_batch
from torchtune_ac.data.prompts import PromptDataset, blank_prompt, collate_prompts
from torchtune_ac.data.preference import PreferenceDataset, blank_preference_sample
from torchtune_ac.data.sampler import blank_sample
from torchtune_ac.data.samples import TokenizedDataset
from torchtune_ac.data.vision import collate_vision_batch
from torchtune_ac.data.vision_preference import collate_vision_preference_batch
from torchtune_ac.errors import UserError


@dataclass(frozen=True)
class Batching:
    """A recipe's kind of data, and how its samples become batches.

    Attributes:
        dataset_type: what its dataset builders return.
        kind: what such data is called, in messages.
        builders: the builders that make it, in messages.
        collate: makes a batch (called with ``pad_id``, ``pad_to_multiple_of`` and ``max_length``).
        blank: a copy of a sample that counts for nothing (what fills the last batch of a validation pass).
        keys: what every sample holds (one of these sets whole).
        not_keys: what no sample of this kind holds.
    """

    dataset_type: type
    kind: str
    builders: str
    collate: Callable[..., dict[str, torch.Tensor]] = collate_batch
    blank: Callable[[dict[str, Any]], dict[str, Any]] = blank_sample
    keys: tuple[tuple[str, ...], ...] = (("tokens", "labels"),)
    not_keys: tuple[str, ...] = ("pairs",)

    def collate_of(self, dataset: Any) -> Callable[..., dict[str, torch.Tensor]]:
        """``collate`` for ``dataset``: each batch one row of documents where the dataset asks for no padding (a
        vision dataset's ``padding_free``)."""
        if getattr(dataset, "padding_free", False):
            return functools.partial(self.collate, padding_free=True)
        return self.collate

    def check_kind(self, dataset: Any, key: str, path: str) -> None:
        """Raise ``UserError`` when ``dataset``'s first sample holds none of ``keys``' sets whole, or one of
        ``not_keys`` (a builder of another recipe's data)."""
        if not len(dataset):
            return
        sample = dataset[0]
        if any(all(name in sample for name in names) for names in self.keys) and not any(
                name in sample for name in self.not_keys):
            return
        missing = [name for name in self.keys[0] if name not in sample]
        held = [name for name in self.not_keys if name in sample]
        what = f"without {', '.join(missing)}" if missing else f"holding {', '.join(held)}"
        raise UserError(f"{key}: {path} gives samples {what}: not the {self.kind} this recipe trains on "
                        "(full_finetune trains on samples, full_dpo on preference pairs)")


# Tokens and labels, one row a sample; an image-text sample's images too (``collate_vision_batch`` adds them, and
# makes the batch of text-only samples ``collate_batch`` does).
SAMPLES = Batching(TokenizedDataset, "samples",
                   "torchtune_ac.data.instruct_dataset, chat_dataset, text_dataset or vision_dataset",
                   collate_vision_batch)
# Preference pairs: chosen rows, rejected rows; or packed, rows of whole pairs (each sequence a document). Pairs with
# images add them (``collate_vision_preference_batch``; text pairs are ``collate_preference_batch``'s).
PAIRS = Batching(PreferenceDataset, "preference pairs",
                 "torchtune_ac.data.preference_dataset or vision_preference_dataset",
                 collate_vision_preference_batch, blank_preference_sample,
                 keys=(("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"),
                       ("tokens", "labels", "pairs")),
                 not_keys=())
# Prompts and their dataset index (GRPO: the completions are the recipe's to make).
PROMPTS = Batching(PromptDataset, "prompts", "torchtune_ac.data.prompt_dataset", collate_prompts, blank_prompt,
                   keys=(("prompt", "index"),), not_keys=("pairs", "labels"))
