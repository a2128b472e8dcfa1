"""Qwen3-VL: a vision tower (patch embedding with learned positions, full-attention blocks, the merger and the
DeepStack mergers) and the Qwen3 decoder (q/k norms), image features entering at the image tokens' embeddings and,
DeepStack's, added to the first decoder layers' outputs at the same tokens.

Parameter names follow transformers 5's ``Qwen3VLForConditionalGeneration`` one prefix away, as Qwen2.5-VL's
(``models/families/qwen3_vl.py`` maps them).

The tower: an image of ``grid (t, h, w)`` patches arrives as ``t * h * w`` rows of ``pixel_values``, merge unit by
merge unit, as for Qwen2.5-VL. Each patch adds a learned position embedding: a square table of
``num_position_embeddings`` entries resampled (bilinear, corners aligned) to the image's ``h x w``. Blocks
(LayerNorm, a GELU MLP) attend within each frame, with the 2-D RoPE of Qwen2.5-VL's tower. After block
``deepstack_visual_indexes[k]``, DeepStack merger ``k`` (its norm over the concatenated merge unit) projects the
patches to the decoder's width: those features are added to the image tokens' hidden states after decoder layer
``k`` (in the tower's block order).

The decoder: multimodal RoPE with the same three positions per token as Qwen2.5-VL (``mrope_positions``), but the
rotated pairs take them interleaved: pair ``i`` turns with the row when ``i % 3 == 1`` and ``i < 3 *
mrope_section[1]``, with the column when ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, else with the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from torchtune_ac.models.llama import ACTIVATIONS, Llama, LlamaArgs, TransformerBlock, rotate_half
from torchtune_ac.models.vision.qwen2_5_vl import (blank_image, decode_at_mrope_positions, mrope_positions,
                                                  vision_patch_positions)

_VISION_NORM_EPS = 1e-6  # transformers' Qwen3-VL tower and merger norms


@dataclass(frozen=True)
class VisionArgs:
    """Shape of a Qwen3-VL vision tower (config.json ``vision_config``)."""

    depth: int = 27
    dim: int = 1152
    intermediate_dim: int = 4304
    n_heads: int = 16
    out_dim: int = 4096
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    activation: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    def problems(self) -> list[str]:
        """What is wrong with these arguments, one line each (``vision.`` keys); empty when they are valid."""
        problems = [f"vision.{name}={getattr(self, name)} must be positive" for name in (
            "depth", "dim", "intermediate_dim", "n_heads", "out_dim", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "num_position_embeddings") if getattr(self, name) <= 0]
        if problems:
            return problems
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            problems.append(f"vision.dim={self.dim}: must be n_heads={self.n_heads} heads of a multiple of 4")
        if self.grid_side**2 != self.num_position_embeddings:
            problems.append(f"vision.num_position_embeddings={self.num_position_embeddings}: must be a square "
                            "(the side of the learned position grid)")
        indexes = self.deepstack_visual_indexes
        outside = [i for i in indexes if not 0 <= i < self.depth]
        if outside or len(set(indexes)) != len(indexes):
            problems.append(f"vision.deepstack_visual_indexes={list(indexes)}: must be distinct blocks of the "
                            f"{self.depth}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"vision.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        return problems

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def grid_side(self) -> int:
        return round(self.num_position_embeddings**0.5)

    @property
    def patch_values(self) -> int:
        """Values of one row of ``pixel_values``: a patch of every channel and frame."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen3_VLArgs(LlamaArgs):
    """The decoder's ``LlamaArgs`` (Qwen3's flags), the tower's ``VisionArgs``, the id of the image placeholder
    token and ``mrope_section``: how many rotated pairs of each head take their angle from the time, row and
    column positions (they sum to ``head_dim // 2``; interleaved, see the module docstring)."""

    vision: VisionArgs = VisionArgs()
    image_token_id: int = 151_655
    mrope_section: tuple[int, ...] = (24, 20, 20)

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = self.vision.problems()
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.resolved_head_dim:
            problems.append(f"mrope_section={list(self.mrope_section)}: must be 3 sizes summing to head_dim / 2 "
                            f"({self.resolved_head_dim // 2})")
        if self.vision.out_dim != self.dim:
            problems.append(f"vision.out_dim={self.vision.out_dim} must equal the decoder's dim={self.dim}")
        if len(self.vision.deepstack_visual_indexes) > self.n_layers:
            problems.append(f"vision.deepstack_visual_indexes: {len(self.vision.deepstack_visual_indexes)} DeepStack "
                            f"features for {self.n_layers} decoder layers")
        if not 0 <= self.image_token_id < self.vocab_size:
            problems.append(f"image_token_id={self.image_token_id} must be a token of the vocabulary "
                            f"({self.vocab_size})")
        if problems:
            raise ValueError("invalid Qwen3-VL model arguments: " + "; ".join(problems))


def interpolation_matrix(size: int, side: int) -> torch.Tensor:
    """``[size, side]``: the bilinear weights (corners aligned) that resample ``side`` positions to ``size``."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    weights = torch.zeros(size, side, dtype=torch.float32)
    for offset in (0, 1):  # the two taps, clamped to the table (a clamped tap has weight 0)
        taps = (floor.long() + offset).clamp(0, side - 1)
        weights.scatter_add_(1, taps.unsqueeze(1), (1 - (src - floor - offset).abs()).clamp(min=0).unsqueeze(1))
    return weights


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame, with the tower's 2-D RoPE: frames of one size in one batched call,
    else one call per frame (no ``[n, n]`` mask over the whole batch's patches)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=True)
        self.proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).unbind(1)  # [n, heads, head_dim] each
        # RoPE in float32, as transformers applies it; cos, sin: [n, 1, head_dim]
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        if len(set(frames)) == 1:  # [n_frames, heads, frame, head_dim]
            q, k, v = (t.view(len(frames), frames[0], self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1)
        else:
            out = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in chunk)).transpose(0, 1)
                             for chunk in zip(*(t.split(frames) for t in (q, k, v)))]).reshape(n, -1)
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(args.dim, args.intermediate_dim, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_dim, args.dim, bias=True)
        self.act = ACTIVATIONS[args.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block (LayerNorms): ``h = x + attn(norm1(x))``; ``out = h + mlp(norm2(h))``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=_VISION_NORM_EPS)
        self.attn = VisionAttention(args)
        self.norm2 = nn.LayerNorm(args.dim, eps=_VISION_NORM_EPS)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), cos, sin, frames)
        return h + self.mlp(self.norm2(h))


class PatchEmbed(nn.Module):
    """One patch (every channel and frame) -> ``dim``: a convolution whose stride is its kernel, with a bias."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        a = self.args
        x = pixel_values.view(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, a.dim)  # [n_patches, dim]


class PatchMerger(nn.Module):
    """Each merge unit's ``m * m`` patches, normed (each patch, or after concatenation: ``norm_unit``, the DeepStack
    mergers), concatenated and projected to the decoder's width by a two-layer GELU MLP."""

    def __init__(self, args: VisionArgs, norm_unit: bool) -> None:
        super().__init__()
        self.unit_dim = args.dim * args.spatial_merge_size**2
        self.norm_unit = norm_unit
        self.norm = nn.LayerNorm(self.unit_dim if norm_unit else args.dim, eps=_VISION_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.unit_dim, self.unit_dim)
        self.linear_fc2 = nn.Linear(self.unit_dim, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.unit_dim)) if self.norm_unit else self.norm(x).view(-1, self.unit_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [n_units, out_dim]


class VisionTower(nn.Module):
    """``pixel_values[n_patches, patch_values]``, ``grid_thw[n_images, 3]`` -> the image tokens' embeddings
    ``[n_tokens, out_dim]`` and the DeepStack features (a list of as many), image after image."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.dim)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args, norm_unit=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args, norm_unit=True) for _ in args.deepstack_visual_indexes)

    def position_embeddings(self, grid_thw: list[list[int]]) -> torch.Tensor:
        """``[n_patches, dim]`` float32: the learned grid resampled to each image's, in ``pixel_values`` order."""
        side, m = self.args.grid_side, self.args.spatial_merge_size
        # called as a module (not read as a weight): FSDP2 gathers a group on its modules' calls
        table = self.pos_embed(torch.arange(side * side, device=self.pos_embed.weight.device))
        table = table.float().view(side, side * self.args.dim)
        out = []
        for t, h, w in grid_thw:
            rows = interpolation_matrix(h, side).to(table.device) @ table  # [h, side * dim]
            grid = torch.einsum("wj,hjd->hwd", interpolation_matrix(w, side).to(table.device),
                                rows.view(h, side, -1))  # [h, w, dim]
            units = grid.view(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)  # merge unit by unit
            out.append(units.repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        a = self.args
        # sizes are read on the host (the collate code keeps the grids there)
        grid_thw = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grid_thw).to(x.dtype)
        # 2-D RoPE as Qwen2.5-VL's tower: head_dim / 4 frequencies for the row, as many for the column.
        quarter = a.head_dim // 2
        inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, quarter, 2, device=device, dtype=torch.float32) / quarter)
        positions = vision_patch_positions(grid_thw, a.spatial_merge_size).to(device)
        angles = (positions.float().unsqueeze(-1) * inv_freq).flatten(1)  # [n, head_dim / 2]
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [n, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        frames = [h * w for t, h, w in grid_thw for _ in range(t)]  # each frame's patches attend within it
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if index in a.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[a.deepstack_visual_indexes.index(index)](x))
        return self.merger(x), deepstack


def interleaved_mrope_axes(mrope_section: tuple[int, ...], pairs: int) -> torch.Tensor:
    """``[pairs]``: which of the three positions (0 time, 1 row, 2 column) each rotated pair turns with."""
    axes = torch.zeros(pairs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:3 * mrope_section[axis]:3] = axis
    return axes


class Qwen3_VL(Llama):
    """The decoder (``Llama`` with Qwen3's flags) and ``visual``, the vision tower with its mergers.

    ``forward(tokens, ..., pixel_values=None, image_grid_thw=None)`` as ``Qwen2_5_VL.forward``; DeepStack feature
    ``k`` is added to the image tokens' hidden states after decoder layer ``k``. Without images the tower runs on
    ``blank_image`` and its outputs join the decoder times zero.
    """

    def __init__(self, args: Qwen3_VLArgs, block: Callable[..., nn.Module] = TransformerBlock) -> None:
        super().__init__(args, block)
        self.visual = VisionTower(args.vision)
        self.register_buffer("mrope_axes", interleaved_mrope_axes(args.mrope_section, args.rotary_dim // 2),
                             persistent=False)

    def _reset_rope_frequencies(self) -> None:
        super()._reset_rope_frequencies()
        if hasattr(self, "mrope_axes"):  # integers: put back after a cast or ``to_empty``
            axes = interleaved_mrope_axes(self.args.mrope_section, self.args.rotary_dim // 2)
            device = self.mrope_axes.device
            self.mrope_axes = axes.to(device) if device.type != "meta" else torch.empty_like(axes, device="meta")

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
        args: Qwen3_VLArgs = self.args
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw go together")
        h = self.tok_embeddings(tokens)  # [b, s, dim]
        is_image = tokens == args.image_token_id
        if pixel_values is None:
            blank, grid = blank_image(args.vision, h.dtype, h.device)
            features, deepstack = self.visual(blank, grid)
            h = h + 0.0 * sum(f.sum() for f in (features, *deepstack))
            deepstack = []
        else:
            features, deepstack = self.visual(pixel_values, image_grid_thw)  # [n_image_tokens, dim] each
            # Under fake tensors (the memory planner's simulated step) there are no values to count: its layout is
            # the planner's own.
            if not is_fake(is_image) and int(is_image.sum()) != features.shape[0]:
                raise ValueError(f"{int(is_image.sum())} image tokens but the images give {features.shape[0]}")
            h = h.masked_scatter(is_image.unsqueeze(-1), features.to(h.dtype))
        if positions is None and image_grid_thw is not None:
            positions = mrope_positions(tokens, image_grid_thw, args.image_token_id, args.vision.spatial_merge_size,
                                        document_ids)

        def add_deepstack(index: int, h: torch.Tensor) -> torch.Tensor:  # h + 0 outside the image tokens: exact
            return h + torch.zeros_like(h).masked_scatter(is_image.unsqueeze(-1), deepstack[index].to(h.dtype))

        return decode_at_mrope_positions(self, h, tokens, positions, document_ids, document_lengths, head,
                                         add_deepstack, changed_layers=len(deepstack))

    def mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[b, 1, s, head_dim]`` of ``positions[3, b, s]``, the pairs interleaved."""
        per_pair = positions.permute(1, 2, 0)[..., self.mrope_axes]  # [b, s, head_dim / 2]
        freqs = per_pair.float() * self.rope_inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)
        nn.init.normal_(self.visual.patch_embed.proj.weight, mean=0.0, std=std)
        nn.init.zeros_(self.visual.patch_embed.proj.bias)
        for module in self.visual.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    @torch.no_grad()
    def init_parameter_(self, name: str, tensor: torch.Tensor, generator: torch.Generator, std: float = 0.02) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if name == "visual.patch_embed.proj.weight":
            tensor.normal_(mean=0.0, std=std, generator=generator)
        elif name == "visual.patch_embed.proj.bias" or (isinstance(owner, nn.LayerNorm) and attr == "bias"):
            tensor.zero_()
        elif isinstance(owner, nn.LayerNorm):
            tensor.fill_(1.0)
        else:
            super().init_parameter_(name, tensor, generator, std)
