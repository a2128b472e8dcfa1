"""The images a vision-language step is planned with (the ``planned_images.*`` keys): how many each sample holds and
their size, from which their tokens and the vision tower's patches follow (``resolve_image_load``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError
from torchtune_ac.memory.planner.workload import ImageLoad


@dataclass(frozen=True)
class PlannedImagesConfig:
    """The ``planned_images.*`` keys: the images ``tune plan`` and ``ac_mode: auto`` assume in every sample of a
    vision-language model (a text-only model ignores them)."""

    per_sample: int = config_key(
        1, doc="Images in every sample, their tokens at the start of each row; 0: plan text-only batches (the vision "
        "tower still runs, on a blank image).", minimum=0)
    height: Optional[int] = config_key(
        None, doc="Height in pixels of every planned image, as the processor hands it to the model (rounded to its "
        "patch grid; Gemma 3's resizes every image to one size, which the plan takes whatever is set); null: the "
        "largest image the processor passes (its max_pixels, as a square), made smaller "
        "when per_sample of them would not fit max_seq_len. Set with width.", minimum=1)
    width: Optional[int] = config_key(
        None, doc="Width in pixels of every planned image (see height); set with height.", minimum=1)


def resolve_image_load(keys: PlannedImagesConfig, resized: Callable[[int, int], tuple[int, int, int]],
                       max_pixels: Optional[int], max_pixels_how: str, max_seq_len: int) -> Optional[ImageLoad]:
    """The images of every planned sample, None for text only (``per_sample: 0``).

    Args:
        keys: the ``planned_images.*`` keys.
        resized: ``(height, width) -> (height, width, tokens)``: an image's size as the model's processor resizes
            it, and its image tokens (``ImageInputs.resized``).
        max_pixels: the most pixels the processor passes without scaling an image down; ``max_pixels_how``: where
            that number came from, in words. None: the processor resizes every image to one size (``resized``'s).
        max_seq_len: tokens per row, which the images' tokens must fit.

    Raises:
        UserError: height without width (or the reverse), or images whose tokens do not fit ``max_seq_len``.
    """
    n = keys.per_sample
    if n == 0:
        return None
    if (keys.height is None) != (keys.width is None):
        raise UserError(f"planned_images.height={keys.height}, planned_images.width={keys.width}: set both, or "
                        "neither (the processor's largest image)")
    if keys.height is not None:
        height, width, tokens = resized(keys.height, keys.width)
        resized_how = "" if (height, width) == (keys.height, keys.width) else ", resized as the model's processor does"
        load = ImageLoad(n, height, width, tokens, f"planned_images.height and width{resized_how}")
    elif max_pixels is None:
        height, width, tokens = resized(1, 1)
        load = ImageLoad(n, height, width, tokens, "the one size the model's processor resizes every image to")
    else:
        load = _largest_square(n, resized, max_pixels, max_pixels_how, max_seq_len)
    if n * load.tokens > max_seq_len:
        raise UserError(f"planned_images: {n} image(s) of {load.height} x {load.width} pixels are {n} x {load.tokens} "
                        f"image tokens, more than max_seq_len={max_seq_len}: such a sample is dropped, never "
                        "trained; plan fewer or smaller images")
    return load


def _largest_square(n: int, resized: Callable[[int, int], tuple[int, int, int]], max_pixels: int,
                    max_pixels_how: str, max_seq_len: int) -> ImageLoad:
    """``n`` of the largest square image the processor passes, made smaller until ``n`` fit ``max_seq_len`` (an
    image of k x k merge units being k^2 tokens)."""
    unit = resized(1, 1)[0]  # the side of the smallest image: one token
    side = max(unit, math.isqrt(max_pixels) // unit * unit)
    how = f"the largest image the processor passes, as a square (max_pixels {max_pixels:,}: {max_pixels_how})"
    if n * (side // unit) ** 2 > max_seq_len:
        side = math.isqrt(max_seq_len // n) * unit
        if side == 0:
            raise UserError(f"planned_images.per_sample={n}: {n} images of one token each do not fit "
                            f"max_seq_len={max_seq_len}")
        how = (f"the largest square image of which {n} fit max_seq_len={max_seq_len} (the processor passes up to "
               f"{max_pixels:,} pixels: {max_pixels_how})")
    height, width, tokens = resized(side, side)
    return ImageLoad(n, height, width, tokens, how)
