"""Whether a model takes a dataset's images, checked on the meta build before any weight loads: a text-only model
given images, or a vision tower whose patch, merge or image-token settings (Gemma 3: image size, tokens per image)
are not the processor's."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import family_of
from torchtune_ac.models.vision.gemma3 import Gemma3VisionArgs


def check_model_takes_images(model: nn.Module, sample: Mapping[str, Any], what: str) -> None:
    """Refuse ``sample`` (the dataset's first) when it holds images ``model`` cannot take.

    Args:
        model: the run's model (on the meta device or not).
        sample: a processed sample: ``tokens`` (a preference pair's ``chosen_tokens``), and ``pixel_values``
            ``[n_patches, values]`` with ``image_grid_thw`` ``[n_images, 3]`` where it holds images (Gemma 3:
            ``pixel_values[n_images, channels, size, size]``).
        what: the config key of the data, for messages (``dataset``).

    Raises:
        UserError: one line naming the key, the model's setting and the processor's.
    """
    if sample.get("pixel_values") is None:
        return
    family = family_of(model)
    if "pixel_values" not in inspect.signature(model.forward).parameters or family is None:
        name = family.name if family is not None else type(model).__name__
        raise UserError(f"{what}: its samples hold images, but the model ({name}) is text-only: use a "
                        "vision-language model (qwen2_5_vl_3b, qwen2_5_vl_7b, qwen3_vl_8b, or from_hf_config over a "
                        "Qwen2.5-VL or Qwen3-VL checkpoint; gemma3_4b_vision, gemma3_12b_vision, gemma3_27b_vision; "
                        "docs/vision.md)")
    args = family.args_of(model)
    if isinstance(args, Gemma3VisionArgs):
        _check_gemma3_images(args, sample, what)
        return
    vision = args.vision
    width = sample["pixel_values"].shape[-1]
    if width != vision.patch_values:
        raise UserError(f"{what}: the processor's patches hold {width} values, the model's vision tower takes "
                        f"{vision.patch_values} (in_channels={vision.in_channels} x temporal_patch_size="
                        f"{vision.temporal_patch_size} x patch_size={vision.patch_size}^2): the processor's patch "
                        "sizes are not the model's")
    grid = torch.as_tensor(sample["image_grid_thw"]).reshape(-1, 3)
    tokens = torch.as_tensor(sample["tokens"] if "tokens" in sample else sample["chosen_tokens"])  # a pair's prompt
    found = int((tokens == args.image_token_id).sum())
    merge = vision.spatial_merge_size
    expected = int(grid.prod(-1).sum()) // merge**2
    if found != expected:
        raise UserError(f"{what}: the first sample has {found} tokens of the model's image_token_id="
                        f"{args.image_token_id} but its images make {expected} with the model's spatial_merge_size="
                        f"{merge}: the processor's merge size or image token is not the model's")


def _check_gemma3_images(args: Gemma3VisionArgs, sample: Mapping[str, Any], what: str) -> None:
    """Gemma 3's images: the tower's size and channels, and ``mm_tokens_per_image`` image tokens per image."""
    vision = args.vision
    shape = list(sample["pixel_values"].shape)
    expected = [vision.in_channels, vision.image_size, vision.image_size]
    if shape[1:] != expected:
        raise UserError(f"{what}: the processor's images are {shape[1:]} (channels, height, width), the model's vision "
                        f"tower takes {expected}: the processor's image size is not the model's")
    tokens = sample["tokens"] if "tokens" in sample else sample["chosen_tokens"]  # a pair's prompt
    found = int((torch.as_tensor(tokens) == args.image_token_id).sum())
    if found != shape[0] * args.mm_tokens_per_image:
        raise UserError(f"{what}: the first sample has {found} tokens of the model's image_token_id="
                        f"{args.image_token_id} for {shape[0]} images of the model's mm_tokens_per_image="
                        f"{args.mm_tokens_per_image}: the processor's image token or image_seq_length is not the "
                        "model's")
