"""Qwen2.5-VL: a vision tower (patch embedding, windowed-attention blocks, the patch merger that projects merged
patches into the decoder's width) and the Llama decoder, image features entering at the image tokens' embeddings.

Parameter names follow transformers 5's ``Qwen2_5_VLForConditionalGeneration`` one prefix away: the decoder's as
every Llama-style family's, the tower's under ``visual.`` exactly as transformers names them under
``model.visual.`` (``models/families/qwen2_5_vl.py`` maps them).

The tower (dynamic resolution): an image of ``grid (t, h, w)`` patches arrives as ``t * h * w`` rows of
``pixel_values``, every ``m * m`` consecutive rows one merge unit (``m``: ``spatial_merge_size``), as the
transformers processor lays them out. Blocks of ``fullatt_block_indexes`` attend within each frame; the others
within windows of ``window_size`` pixels (``window_size // patch_size // m`` merge units a side), for which the
rows are reordered window by window and put back after the merger. Each patch is rotated by a 2-D RoPE of its
(row, column).

The decoder: multimodal RoPE (``mrope_section``): each rotated pair takes its angle from one of three positions,
(time, row, column); text tokens have the three equal and count up; an image's tokens have ``(p, p + row,
p + column)`` from the position ``p`` where the image starts, and the text after it resumes at
``p + max(rows, columns)``. Positions restart at each packed document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ac.models.attention import document_runs, document_starts
from torchtune_ac.models.llama import (ACTIVATIONS, Llama, LlamaArgs, RMSNorm, TransformerBlock, last_block_rows,
                                      positions_from_document_ids, rotate_half)

_VISION_NORM_EPS = 1e-6  # transformers' Qwen2.5-VL tower and merger norms


@dataclass(frozen=True)
class VisionArgs:
    """Shape of a Qwen2.5-VL vision tower (config.json ``vision_config``)."""

    depth: int = 32
    dim: int = 1280
    intermediate_dim: int = 3420
    n_heads: int = 16
    out_dim: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    activation: str = "silu"
    rope_theta: float = 10_000.0

    def problems(self) -> list[str]:
        """What is wrong with these arguments, one line each (``vision.`` keys); empty when they are valid."""
        problems = [f"vision.{name}={getattr(self, name)} must be positive" for name in (
            "depth", "dim", "intermediate_dim", "n_heads", "out_dim", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "window_size") if getattr(self, name) <= 0]
        if problems:
            return problems
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            problems.append(f"vision.dim={self.dim}: must be n_heads={self.n_heads} heads of a multiple of 4")
        if self.window_size // self.patch_size // self.spatial_merge_size < 1:
            problems.append(f"vision.window_size={self.window_size}: must cover at least one merge unit "
                            f"({self.patch_size * self.spatial_merge_size} pixels)")
        outside = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if outside:
            problems.append(f"vision.fullatt_block_indexes: {outside} outside the {self.depth} blocks")
        if self.activation not in ACTIVATIONS:
            problems.append(f"vision.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        return problems

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """Values of one row of ``pixel_values``: a patch of every channel and frame."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen2_5_VLArgs(LlamaArgs):
    """The decoder's ``LlamaArgs`` (Qwen2's flags), the tower's ``VisionArgs``, the id of the image placeholder
    token and ``mrope_section``: how many rotated pairs of each head take their angle from the time, row and
    column positions (they sum to ``head_dim // 2``)."""

    vision: VisionArgs = VisionArgs()
    image_token_id: int = 151_655
    mrope_section: tuple[int, ...] = (16, 24, 24)

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = self.vision.problems()
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.resolved_head_dim:
            problems.append(f"mrope_section={list(self.mrope_section)}: must be 3 sizes summing to head_dim / 2 "
                            f"({self.resolved_head_dim // 2})")
        if self.vision.out_dim != self.dim:
            problems.append(f"vision.out_dim={self.vision.out_dim} must equal the decoder's dim={self.dim}")
        if not 0 <= self.image_token_id < self.vocab_size:
            problems.append(f"image_token_id={self.image_token_id} must be a token of the vocabulary "
                            f"({self.vocab_size})")
        if problems:
            raise ValueError("invalid Qwen2.5-VL model arguments: " + "; ".join(problems))


def vision_window_order(grid_thw: list[list[int]], merge: int, units_per_window: int
                        ) -> tuple[torch.Tensor, list[int]]:
    """The merge units of every image reordered window by window, and each window's number of patches.

    Computed from the sizes alone, on the host (no tensor is read back).

    Returns:
        ``order[n_units]``: the unit at each new place (units numbered over the images in ``pixel_values``
        order), and the patch count of each window, in the new order (every frame's windows in turn).
    """
    order: list[int] = []
    sizes: list[int] = []
    side = units_per_window
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        for frame in range(t):
            first = len(order)
            for top in range(0, rows, side):
                for left in range(0, cols, side):
                    units = [first + r * cols + c for r in range(top, min(top + side, rows))
                             for c in range(left, min(left + side, cols))]
                    order += units
                    sizes.append(len(units) * merge**2)
    return torch.tensor(order, dtype=torch.long), sizes


def vision_patch_positions(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch ``[n_patches, 2]``, in ``pixel_values`` order (merge unit by merge unit)."""
    positions = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        per_unit = [x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for x in (rows, cols)]
        positions.append(torch.stack(per_unit, dim=-1).repeat(t, 1))
    return torch.cat(positions)


def segment_ids(sizes: list[int], device: torch.device) -> torch.Tensor:
    """``[sum(sizes)]``: the index of the segment each row belongs to."""
    return torch.tensor([index for index, size in enumerate(sizes) for _ in range(size)], device=device)


@dataclass(frozen=True)
class Segments:
    """Rows cut into consecutive segments (frames or windows) that attend only within themselves, laid out for one
    batched attention call: ``[n_segments, longest]`` rows, each segment padded to the longest.

    ``gather``: ``[n_segments * longest]`` row of each padded place (None when every segment is ``longest`` rows:
    the rows are a view); ``keys``: ``[n_segments, 1, 1, longest]``, the places that are rows (padding is no key);
    ``rows``: ``[n]`` the padded place of each row, to put the output back. Built once per forward, from sizes known
    on the host (nothing read back); the attention then costs ``n_segments * longest**2``, not ``n**2``."""

    count: int
    longest: int
    gather: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None

    @staticmethod
    def of(sizes: list[int], device: torch.device) -> "Segments":
        longest = max(sizes)
        if all(size == longest for size in sizes):
            return Segments(len(sizes), longest)
        sizes_t = torch.tensor(sizes, dtype=torch.long)
        place = torch.arange(longest)
        keys = place.unsqueeze(0) < sizes_t.unsqueeze(1)  # [n_segments, longest]
        starts = torch.cumsum(sizes_t, 0) - sizes_t
        gather = torch.where(keys, starts.unsqueeze(1) + place, 0).flatten()
        # from the host's sizes, not read back (the memory planner builds these under fake tensors)
        rows = torch.tensor([segment * longest + i for segment, size in enumerate(sizes) for i in range(size)])
        return Segments(len(sizes), longest, gather.to(device), keys.view(len(sizes), 1, 1, longest).to(device),
                        rows.to(device))


class VisionAttention(nn.Module):
    """Bidirectional attention within segments (frames or windows), with the tower's 2-D RoPE.

    ``mask``: the segments as ``Segments`` (one attention call over the segments, each padded to the longest), or a
    boolean ``[n, n]`` mask of which rows attend to which (one call over all rows)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=True)
        self.proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: "Segments | torch.Tensor") -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).unbind(1)  # [n, heads, head_dim] each
        # RoPE in float32, as transformers applies it; cos, sin: [n, 1, head_dim]
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        if isinstance(mask, torch.Tensor):
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, head_dim]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))
        segments = mask
        if segments.gather is not None:
            q, k, v = (t[segments.gather] for t in (q, k, v))
        # [n_segments, heads, longest, head_dim]
        q, k, v = (t.view(segments.count, segments.longest, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.keys)
        out = out.transpose(1, 2).reshape(segments.count * segments.longest, -1)
        return self.proj(out if segments.rows is None else out[segments.rows])


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_dim, bias=True)
        self.up_proj = nn.Linear(args.dim, args.intermediate_dim, bias=True)
        self.down_proj = nn.Linear(args.intermediate_dim, args.dim, bias=True)
        self.act = ACTIVATIONS[args.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x))``; ``out = h + mlp(norm2(h))``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.dim, _VISION_NORM_EPS)
        self.attn = VisionAttention(args)
        self.norm2 = RMSNorm(args.dim, _VISION_NORM_EPS)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: "Segments | torch.Tensor") -> torch.Tensor:
        h = x + self.attn(self.norm1(x), cos, sin, mask)
        return h + self.mlp(self.norm2(h))


class PatchEmbed(nn.Module):
    """One patch (every channel and frame) -> ``dim``: a convolution whose stride is its kernel."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch, stride the kernel: the convolution is one matrix product of each row
        # (channels, frames, pixels, the kernel's own order) with the flattened kernel, computed as that (on a CPU
        # several times faster than the convolution, forward and backward).
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(self.args.dim, -1))  # [n_patches, dim]


class PatchMerger(nn.Module):
    """The projector: each merge unit's ``m * m`` patches, normed, concatenated and projected to the decoder's width
    by a two-layer GELU MLP."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.unit_dim = args.dim * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.dim, _VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.unit_dim, self.unit_dim), nn.GELU(),
                                 nn.Linear(self.unit_dim, args.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.unit_dim))  # [n_units, out_dim]


class VisionTower(nn.Module):
    """``pixel_values[n_patches, patch_values]``, ``grid_thw[n_images, 3]`` -> ``[n_tokens, out_dim]``, the image
    tokens' embeddings, image after image."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        a, merge = self.args, self.args.spatial_merge_size
        unit = merge**2
        # sizes are read on the host (the collate code keeps the grids there)
        grid_thw = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        order, window_sizes = vision_window_order(grid_thw, merge, a.window_size // a.patch_size // merge)
        device = pixel_values.device
        order = order.to(device)
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].view(n, -1)  # window by window
        # 2-D RoPE: head_dim / 4 frequencies for the row, as many for the column, each pair's angle twice.
        quarter = a.head_dim // 2
        inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, quarter, 2, device=device, dtype=torch.float32) / quarter)
        positions = vision_patch_positions(grid_thw, merge).to(device)
        angles = (positions.float().unsqueeze(-1) * inv_freq).flatten(1)  # [n, head_dim / 2]
        angles = angles.view(n // unit, unit, -1)[order].view(n, -1)
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [n, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        # Full blocks attend within each frame, the others within each window; the rows are window by window, and a
        # frame's windows are consecutive, so both are consecutive segments (once per forward, for every block).
        frames = Segments.of([h * w for t, h, w in grid_thw for _ in range(t)], device)
        windows = Segments.of(window_sizes, device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in a.fullatt_block_indexes else windows)
        merged = self.merger(x)  # [n_units, out_dim], window by window
        return merged[torch.argsort(order)]


def blank_image(args: VisionArgs, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[list[int]]]:
    """The smallest image (one merge unit of zeros) and its grid: what the tower runs on when a batch has no image,
    so that every process runs the same modules (FSDP2's collectives) and the tower's gradients are defined."""
    m = args.spatial_merge_size
    return torch.zeros(m * m, args.patch_values, dtype=dtype, device=device), [[1, m, m]]


def resized_image(args: VisionArgs, height: int, width: int) -> tuple[int, int, int]:
    """The size an image of ``height x width`` pixels reaches the tower in, each side rounded to a multiple of a merge
    unit (``patch_size * spatial_merge_size`` pixels, at least one) as the processor rounds it, and its image tokens.
    The processor's pixel limits are the caller's (``data.vision`` refuses or scales an image over them)."""
    unit = args.patch_size * args.spatial_merge_size
    height, width = (max(unit, round(side / unit) * unit) for side in (height, width))
    return height, width, (height // unit) * (width // unit)


def planned_image_inputs(args: Qwen2_5_VLArgs, rows: int, seq_len: int, per_row: int, height: int,
                         width: int) -> dict[str, Any]:
    """A batch's inputs with ``per_row`` images of ``height x width`` pixels (``resized_image``'s) at the start of
    every row, then text, laid out as the processor and ``data.vision`` lay them out, for the memory planner:
    ``tokens`` ``[rows, seq_len]``, ``pixel_values`` ``[n_patches, patch_values]`` (float32, as the processor
    returns them), ``image_grid_thw`` (a list of grids: its values are read on the host) and ``positions``
    ``[3, rows, seq_len]`` (``mrope_positions``'s, built from the layout without reading the tokens back, so that
    they can be made under fake tensors)."""
    v = args.vision
    merge = v.spatial_merge_size
    grid = [1, height // v.patch_size, width // v.patch_size]
    side_rows, side_cols = grid[1] // merge, grid[2] // merge
    n = side_rows * side_cols  # image tokens of one image
    if per_row * n > seq_len:
        raise ValueError(f"{per_row} images of {n} tokens do not fit a row of {seq_len}")
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    tokens[:, :per_row * n] = args.image_token_id
    image = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(side_rows), torch.arange(side_cols),
                                       indexing="ij")).view(3, n)
    step = max(side_rows, side_cols)  # where the text after an image resumes
    parts = [image + i * step for i in range(per_row)]
    text = per_row * step
    parts.append(torch.arange(text, text + seq_len - per_row * n).expand(3, -1))
    positions = torch.cat(parts, dim=1).unsqueeze(1).expand(3, rows, seq_len)
    n_images = rows * per_row
    return {"tokens": tokens, "pixel_values": torch.zeros(n_images * grid[1] * grid[2], v.patch_values),
            "image_grid_thw": [list(grid)] * n_images, "positions": positions}


def mrope_positions(tokens: torch.Tensor, grid_thw: Optional[torch.Tensor], image_token_id: int, merge: int,
                    document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The three RoPE positions (time, row, column) ``[3, b, s]`` of every token (see the module docstring).

    Images are matched to runs of ``image_token_id`` in order, row after row, each taking as many tokens as its
    grid gives; positions restart at every document of ``document_ids``. Computed on the host.

    Raises:
        ValueError: the image tokens and the grids disagree.
    """
    tokens_h = tokens.cpu()
    b, s = tokens_h.shape
    grids = [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.cpu().tolist()]
    starts = (document_starts(document_ids).cpu() if document_ids is not None
              else torch.zeros(b, s, dtype=torch.bool))
    positions = torch.zeros(3, b, s, dtype=torch.long)
    next_image = 0
    for row in range(b):
        is_image = (tokens_h[row] == image_token_id).tolist()
        doc_start = starts[row].tolist()
        i, current = 0, 0
        while i < s:
            if doc_start[i]:
                current = 0
            if not is_image[i]:
                j = i + 1  # a run of text, up to the next image token or document
                while j < s and not is_image[j] and not doc_start[j]:
                    j += 1
                positions[:, row, i:j] = torch.arange(current, current + j - i)
                current += j - i
                i = j
                continue
            if next_image >= len(grids):
                raise ValueError(f"more image tokens than the {len(grids)} images' grids give (row {row})")
            t, h, w = grids[next_image]
            next_image += 1
            rows, cols = h // merge, w // merge
            n = t * rows * cols
            if i + n > s or not all(is_image[i:i + n]):
                raise ValueError(f"image {next_image - 1} of grid {(t, h, w)} needs {n} image tokens at row {row}, "
                                 f"token {i}")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols),
                                              indexing="ij")).view(3, n)
            positions[:, row, i:i + n] = grid + current
            current += max(rows, cols)
            i += n
    if next_image != len(grids):
        raise ValueError(f"{len(grids)} images' grids but image tokens for {next_image}")
    return positions.to(tokens.device)


def decode_at_mrope_positions(model: Llama, h: torch.Tensor, tokens: torch.Tensor, positions: Optional[torch.Tensor],
                              document_ids: Optional[torch.Tensor], document_lengths: Optional[torch.Tensor],
                              head: Any, after_layer: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
                              changed_layers: int = 0) -> torch.Tensor:
    """The decoder half of a Qwen VL forward (Qwen2.5-VL's, Qwen3-VL's): ``model``'s blocks over the embedded
    ``h [b, s, dim]`` (image features in place) at multimodal ``positions`` (``[3, b, s]``; ``[b, s]`` text ones
    on all three axes; None: the text's own, each document's from 0, read nothing back to the host), then the norm
    and the output (or ``head``'s result). ``after_layer(k, h)`` is the hidden state after block ``k`` for the first
    ``changed_layers`` blocks (Qwen3-VL's DeepStack features). A head that reads the targets only has the last block
    compute those rows alone where it can (``last_block_rows``) and where nothing changes its output after it."""
    if positions is None:
        b, s = tokens.shape
        positions = (positions_from_document_ids(document_ids) if document_ids is not None
                     else torch.arange(s, device=tokens.device).expand(b, s))
    if positions.ndim == 2:
        positions = positions.unsqueeze(0).expand(3, -1, -1)
    runs = document_runs(document_ids, document_lengths) if document_ids is not None else None
    cos, sin = model.mrope_cos_sin(positions, h.dtype)
    rows = last_block_rows(head, model.layers[-1], tokens.shape[1]) if len(model.layers) > changed_layers else None
    for index, layer in enumerate(model.layers):
        last = index == len(model.layers) - 1
        h = layer(h, cos, sin, runs, rows=rows) if last and rows is not None else layer(h, cos, sin, runs)
        if index < changed_layers:
            h = after_layer(index, h)
    return model.output(model.norm(h), head)  # [b, s, vocab], or the head's result


class Qwen2_5_VL(Llama):
    """The decoder (``Llama`` with Qwen2's flags) and ``visual``, the vision tower with its merger.

    ``forward(tokens, ..., pixel_values=None, image_grid_thw=None)``: ``Llama.forward``'s arguments, and the images
    of the batch (``pixel_values[n_patches, patch_values]`` and ``image_grid_thw[n_images, 3]``, as the
    transformers processor returns them, or the grids as a list), whose features replace the embeddings of the image tokens in order.
    Without images the tower runs on ``blank_image`` and its output joins the decoder times zero: the logits are
    the text-only model's, and every process runs every module.
    """

    def __init__(self, args: Qwen2_5_VLArgs, block: Callable[..., nn.Module] = TransformerBlock) -> None:
        super().__init__(args, block)
        self.visual = VisionTower(args.vision)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: Optional[torch.Tensor] = None,
        head: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        document_lengths: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_thw: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` (or the head's result), as ``Llama.forward``; ``positions``: ``[3, b, s]``
        multimodal positions (or ``[b, s]`` text ones), computed from the tokens and grids when None.

        Raises:
            ValueError: image tokens that do not match the images' grids, or images without grids.
        """
        args: Qwen2_5_VLArgs = self.args
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw go together")
        if positions is None and image_grid_thw is not None:
            # Checks that the image tokens are the grids' (given positions, the caller vouches for them).
            grids = torch.tensor(image_grid_thw) if isinstance(image_grid_thw, list) else image_grid_thw
            positions = mrope_positions(tokens, grids, args.image_token_id, args.vision.spatial_merge_size,
                                        document_ids)
        h = self.tok_embeddings(tokens)  # [b, s, dim]
        if pixel_values is None:
            blank, grid = blank_image(args.vision, h.dtype, h.device)
            h = h + 0.0 * self.visual(blank, grid).sum()
        else:
            features = self.visual(pixel_values, image_grid_thw).to(h.dtype)  # [n_image_tokens, dim]
            h = h.masked_scatter((tokens == args.image_token_id).unsqueeze(-1), features)
        return decode_at_mrope_positions(self, h, tokens, positions, document_ids, document_lengths, head)

    def mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[b, 1, s, head_dim]`` of ``positions[3, b, s]``: the first ``mrope_section[0]``
        frequencies turn with the time position, the next ``[1]`` with the row, the last ``[2]`` with the column."""
        freqs = positions.float().unsqueeze(-1) * self.rope_inv_freq  # [3, b, s, head_dim / 2]
        parts = freqs.split(list(self.args.mrope_section), dim=-1)
        freqs = torch.cat([part[i] for i, part in enumerate(parts)], dim=-1)  # [b, s, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)
        nn.init.normal_(self.visual.patch_embed.proj.weight, mean=0.0, std=std)

    @torch.no_grad()
    def init_parameter_(self, name: str, tensor: torch.Tensor, generator: torch.Generator, std: float = 0.02) -> None:
        if name == "visual.patch_embed.proj.weight":
            tensor.normal_(mean=0.0, std=std, generator=generator)
        else:
            super().init_parameter_(name, tensor, generator, std)

