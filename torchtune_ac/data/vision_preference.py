"""Preference pairs whose prompt carries images, for DPO on a vision-language model (``full_dpo``, ``lora_dpo``).

    dataset:
      _component_: torchtune_ac.data.vision_preference_dataset
      source: pairs.jsonl

A record is in TRL's vision preference layout: ``images`` (or ``image``, one; as ``data/vision.py`` reads them),
``prompt`` (the messages before the answer, with ``{"type": "image"}`` parts or ``<image>`` in a string content),
``chosen`` and ``rejected`` (each the assistant's answer: a list of messages, or one message). The prompt is rendered
by the model's transformers processor up to the generation prompt and processed with its images; each answer is the
rest of the rendering of prompt and answer, tokenized without special tokens (TRL 1.16's
``DataCollatorForVisionPreference`` splits them the same way). Chosen and rejected share the prompt's tokens, image
tokens included, and its images: a batch's ``2b`` rows (chosen, then rejected) give the tower each pair's images
twice, once per row, in row order. Only the answers' tokens are targets.

A pair longer than ``max_seq_len`` (its prompt and longer answer) is dropped with a count, never truncated through
its images (``drop_long_samples: false`` refuses it instead). Pairs are not packed. The processor's per-token outputs
(Qwen's ``mm_token_type_ids``) are not kept: the model finds image tokens by their id.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.datasets import Sources, register_preparer
from torchtune_ac.data.embedded import EMBEDDED_VLM_PREFERENCE_PATH
from torchtune_ac.data.preference import (
    ANSWERS,
    EncodedPair,
    PreferenceDataset,
    collate_preference_batch,
    pair_sample,
)
from torchtune_ac.data.records import Record
from torchtune_ac.data.sources import load_records
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.data.vision import (PreparedVisionDataset, images_folder, max_pixels_of, prepare_messages,
                                     process_records, processor_and_length, with_source)
from torchtune_ac.errors import UserError

# The processor's outputs a pair rebuilds (the tokens) or does not keep (per-token lists).
_NOT_KEPT = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


class VisionPreferenceDataset(PreferenceDataset):
    """``PreferenceDataset``'s pairs, each with its prompt's image tensors as the processor returned them
    (Qwen2.5-VL: ``pixel_values`` ``[n_patches, values]``, ``image_grid_thw`` ``[n_images, 3]``; none for a pair
    without images)."""

    def __init__(self) -> None:
        super().__init__()
        self._images: list[dict[str, torch.Tensor]] = []

    def append(self, sample: dict[str, Any]) -> None:
        super().append(sample)
        self._images.append({key: value for key, value in sample.items() if isinstance(value, torch.Tensor)})

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**super().__getitem__(index), **self._images[index % len(self)]}


def _answer_messages(value: Any, name: str, location: str) -> list[dict[str, Any]]:
    """An answer column as a list of assistant messages without images.

    Raises:
        UserError: not a message or list of messages, a turn not the assistant's, or an image in it.
    """
    messages = [value] if isinstance(value, dict) else value
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise UserError(f"{location}: '{name}' must be the answer's messages (a list of {{\"role\", \"content\"}}), "
                        "as TRL's vision preference layout has it")
    for message in messages:
        if message.get("role") != "assistant":
            raise UserError(f"{location}: '{name}' holds a {message.get('role')!r} turn; an answer is the assistant's")
        content = message.get("content")
        parts = content if isinstance(content, list) else []
        if any(isinstance(part, dict) and part.get("type") == "image" for part in parts):
            raise UserError(f"{location}: '{name}' holds an image; images go in the prompt, shared by both answers")
    return [{**m, "content": m["content"] if isinstance(m["content"], list) else
             [{"type": "text", "text": m["content"]}]} for m in messages]


def process_vision_pair(record: Record, processor: Any, *, base_dir: Path, resize_images: bool = False
                        ) -> dict[str, Any]:
    """One record as a pair sample: ``pair_sample``'s tokens and labels, and the prompt's image tensors.

    Raises:
        UserError: a missing or malformed column, an answer that is empty or not distinct, the images as
            ``vision.prepare_messages`` refuses them, or a chat template under which the prompt's rendering is not a
            prefix of the prompt and answer's.
    """
    value, location = record.value, record.location
    if not isinstance(value, dict):
        raise UserError(f"{location}: a vision preference record must be a JSON object")
    missing = [name for name in ("prompt", *ANSWERS) if name not in value]
    if missing:
        raise UserError(f"{location}: no {', '.join(repr(m) for m in missing)} column; a vision preference record "
                        "holds 'images', 'prompt', 'chosen' and 'rejected' (TRL's layout)")
    prompt = value["prompt"]
    if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt:
        raise UserError(f"{location}: 'prompt' must be a non-empty list of messages")
    images = {key: value[key] for key in ("images", "image") if key in value}
    messages = prepare_messages({"messages": prompt, **images}, base_dir=base_dir, location=location,
                                max_pixels=max_pixels_of(processor), resize_images=resize_images)
    answers = [_answer_messages(value[name], name, location) for name in ANSWERS]
    if answers[0] == answers[1]:
        raise UserError(f"{location}: 'chosen' and 'rejected' are the same answer")
    prompt_text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pictures = [part["image"] for message in messages for part in message["content"] if part.get("type") == "image"]
    output = processor(text=[prompt_text], images=pictures or None, add_special_tokens=False, return_tensors="pt")
    encoded = []
    for name, answer in zip(ANSWERS, answers):
        text = processor.apply_chat_template(messages + answer, tokenize=False)
        if not text.startswith(prompt_text):
            raise UserError(f"{location}: the processor's chat template does not render the prompt as the start of "
                            f"the prompt with its '{name}' answer, so the answer's tokens cannot be told apart")
        tokens = processor.tokenizer(text[len(prompt_text):], add_special_tokens=False)["input_ids"]
        if not tokens:
            raise UserError(f"{location}: '{name}' is empty")
        encoded.append(tokens)
    sample: dict[str, Any] = pair_sample(EncodedPair(output["input_ids"][0].tolist(), *encoded))
    sample.update({key: tensor for key, tensor in output.items() if key not in _NOT_KEPT})
    return sample


def build_vision_preference_dataset(source: str | list[str], processor: Any, *, max_seq_len: int,
                                    resize_images: bool = False, drop_long_samples: bool = True,
                                    split: str = "train", records: Optional[list[Record]] = None
                                    ) -> VisionPreferenceDataset:
    """Read, check and process every pair, before any weight loads (see the module docstring); ``records``:
    ``source``'s, when they are read already.

    Raises:
        UserError: a bad record, a pair over ``max_seq_len`` without ``drop_long_samples``, or no pair left.
    """
    samples, report = process_records(
        source, lambda record, base_dir: process_vision_pair(record, processor, base_dir=base_dir,
                                                             resize_images=resize_images),
        length=lambda sample: max(len(sample[f"{name}_tokens"]) for name in ANSWERS), max_seq_len=max_seq_len,
        drop_long_samples=drop_long_samples, split=split, unit="pair", sample="pair",
        counted="prompt, image tokens and the longer answer", cut="an answer", records=records)
    dataset = VisionPreferenceDataset()
    for sample in samples:
        dataset.append(sample)
    dataset.report = report
    return dataset


def collate_vision_preference_batch(samples: Sequence[dict[str, Any]], **padding: Any) -> dict[str, torch.Tensor]:
    """``collate_preference_batch``'s ``2b`` rows, plus each image tensor of the pairs concatenated along dim 0 in
    row order: the chosen rows' pairs, then the rejected rows' (the same images again: each row's image tokens take
    their own features). Pairs without images add none; text-only batches are ``collate_preference_batch``'s."""
    batch = collate_preference_batch(samples, **padding)
    keys = dict.fromkeys(key for sample in samples for key, value in sample.items() if isinstance(value, torch.Tensor))
    for key in keys:
        present = [sample[key] for sample in samples if key in sample]
        batch[key] = torch.cat(present + present)
    return batch


@config_component
def vision_preference_dataset(
    tokenizer: Tokenizer,
    *,
    source: Sources = EMBEDDED_VLM_PREFERENCE_PATH,
    processor: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    resize_images: bool = False,
    drop_long_samples: bool = True,
    split: str = "train",
) -> VisionPreferenceDataset:
    """Preference pairs with images in the prompt (see the module docstring), processed by the model's processor.

    Args:
        tokenizer: From :func:`load_tokenizer` (its folder holds the processor unless ``processor`` is set).
        source: a ``.jsonl`` / ``.json`` file of records, a folder, or a Hub dataset (``sources.load_records``);
            image paths are relative to a file's folder. Defaults to the embedded coloured-shapes pairs.
        processor: folder of the transformers processor; None: the tokenizer's folder.
        max_seq_len: longest sequence (prompt with its image tokens, and an answer); defaults to
            ``tokenizer.max_seq_len``.
        resize_images: let the processor scale down an image over its pixel limit (else it is refused).
        drop_long_samples: drop a pair longer than ``max_seq_len`` with a count (else refuse it).
        split: split of a folder or Hub dataset.

    Raises:
        UserError: as ``build_vision_preference_dataset``, or ``max_seq_len`` unset.
    """
    return prepare_vision_preference_dataset(tokenizer, source=source, processor=processor, max_seq_len=max_seq_len,
                                             resize_images=resize_images, drop_long_samples=drop_long_samples,
                                             split=split).build()


def prepare_vision_preference_dataset(tokenizer: Tokenizer, *, source: Sources = EMBEDDED_VLM_PREFERENCE_PATH,
                                      processor: Optional[str] = None, max_seq_len: Optional[int] = None,
                                      resize_images: bool = False, drop_long_samples: bool = True,
                                      split: str = "train") -> PreparedVisionDataset:
    """``vision_preference_dataset`` up to its records (the same arguments): what ``tune validate`` checks.

    Raises:
        UserError: ``max_seq_len`` unset, no processor, or a source that cannot be read.
    """
    max_seq_len, loaded = processor_and_length(
        tokenizer, processor, max_seq_len,
        "vision_preference_dataset: set max_seq_len (a pair with images is never truncated)")
    records = load_records(source, split=split)

    def build() -> VisionPreferenceDataset:
        return with_source(build_vision_preference_dataset(
            source, loaded, max_seq_len=max_seq_len, resize_images=resize_images, drop_long_samples=drop_long_samples,
            split=split, records=records), source, split)

    return PreparedVisionDataset(source if isinstance(source, str) else ", ".join(source), records, functools.partial(
        process_vision_pair, processor=loaded, base_dir=images_folder(source), resize_images=resize_images), build)


register_preparer(vision_preference_dataset, prepare_vision_preference_dataset)
