"""Helpers shared by the vision-language family tests (Qwen2.5-VL, Qwen3-VL, Gemma 3 with images): a batch of
random text with Qwen's images placed in it, and the checks every family's tower passes."""

from __future__ import annotations

import torch
from numerics import assert_close
from torch import nn

from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.models import family_of, transformer_blocks
from torchtune_ac.models.decoder_family import decoder_shard_groups
from torchtune_ac.models.families import shard_groups


def qwen_image_batch(rows: list[list[tuple[int, tuple[int, int]]]], seq_len: int, image_token: int,
                     patch_values: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random text tokens (below 96) with images placed in them, as Qwen's processor lays them out: per row,
    ``(start, (h, w))`` puts ``h * w / 4`` image tokens (2 x 2 patches merged) at ``start``.

    Returns:
        tokens ``[rows, seq_len]``, pixel_values ``[patches, patch_values]``, image_grid_thw ``[images, 3]``.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (len(rows), seq_len), generator=g)
    grids = []
    for r, images in enumerate(rows):
        for start, (h, w) in images:
            tokens[r, start:start + h * w // 4] = image_token
            grids.append([1, h, w])
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    return tokens, torch.randn(int(grid.prod(-1).sum()), patch_values, generator=g), grid


def assert_qwen_logits_match(model: nn.Module, reference: nn.Module, rows: list[list[tuple[int, tuple[int, int]]]],
                             *, seq_len: int, image_token: int, patch_values: int, terms: int) -> None:
    """Our logits against transformers' Qwen-VL model's on ``qwen_image_batch(rows, ...)``, within the rounding of
    ``terms`` summed products (transformers adds in other orders: attention kernels, per-window or per-frame loops).
    """
    tokens, pixels, grid = qwen_image_batch(rows, seq_len, image_token, patch_values)
    images = dict(pixel_values=pixels, image_grid_thw=grid) if len(grid) else {}
    with torch.no_grad():
        expected = reference(input_ids=tokens, mm_token_type_ids=(tokens == image_token).int(), **images).logits
        assert_close(model(tokens, **images), expected, terms=terms, what="logits")


def vision_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The named parameters of the tower and projector (its family's ``vision_modules``)."""
    return [(f"{module}.{name}", param) for module in family_of(model).vision_modules
            for name, param in model.get_submodule(module).named_parameters()]


def frozen_names(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if not param.requires_grad}


def names_under(model: nn.Module, *prefixes: str) -> set[str]:
    return {name for name, _ in model.named_parameters() if name.startswith(prefixes)}


def assert_a_batch_without_images_changes_nothing(model: nn.Module, tokens: torch.Tensor) -> None:
    """A text-only batch runs the blank image through every module of the tower and projector (FSDP2 gathers and
    reduces them on every process), and their gradients are zero."""
    model(tokens).sum().backward()
    for name, param in vision_parameters(model):
        assert param.grad is not None and not param.grad.any(), name


def assert_the_tower_blocks_come_first(model: nn.Module, tower_blocks: nn.ModuleList,
                                       vision_groups: tuple[tuple[nn.Module, ...], ...], ac_option: int,
                                       checkpointed: tuple[int, ...]) -> None:
    """Activation checkpointing and FSDP2 see the tower's blocks, then the decoder's; the vision groups are sharded
    before the decoder's; ``ac_option`` counts the tower's blocks and the decoder's."""
    assert list(transformer_blocks(model)) == [*tower_blocks, *model.layers]
    assert shard_groups(model) == (*vision_groups, *decoder_shard_groups(model))
    plan = setup_activation_checkpointing(model, ac_mode="selective", ac_option=ac_option)
    assert plan.checkpointed_blocks == checkpointed
