"""Gemma 3 with images: a SigLIP vision tower, the projector (average pooling to ``mm_tokens_per_image`` tokens, a
``(1 + w)`` RMSNorm, a linear map), and Gemma 3's decoder, whose image tokens take the projected features and
attend to each other in both directions within each image.

Parameter names follow transformers 5's ``Gemma3ForConditionalGeneration`` one prefix away: the decoder's as the
text family's, the tower's under ``vision_tower.`` and the projector's under ``multi_modal_projector.`` exactly as
transformers names them under ``model.`` (``models/families/gemma3_vision.py`` maps them).

The tower: an image of ``image_size`` pixels a side is cut into ``(image_size / patch_size)^2`` patches, each
embedded by a convolution whose stride is its kernel, plus a learned position embedding; pre-norm LayerNorm blocks
of bidirectional attention and a GELU MLP; a final LayerNorm. The projector pools the grid of patches to
``sqrt(mm_tokens_per_image)`` a side.

The decoder's attention where a batch holds images: causal, or within the same image (a run of image tokens), and,
on sliding layers, no further back than the window; documents of a packed row never see each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from torchtune_ac.models.attention import DocumentRuns, document_runs
from torchtune_ac.models.llama import (ACTIVATIONS, Attention, Llama, LlamaArgs, RMSNorm, TransformerBlock, apply_rope,
                                      positions_from_document_ids)


@dataclass(frozen=True)
class SiglipArgs:
    """Shape of a SigLIP vision tower (config.json ``vision_config``; the defaults are Gemma 3's 400M tower)."""

    depth: int = 27
    dim: int = 1152
    intermediate_dim: int = 4304
    n_heads: int = 16
    image_size: int = 896
    patch_size: int = 14
    in_channels: int = 3
    norm_eps: float = 1e-6
    activation: str = "gelu_pytorch_tanh"

    def problems(self) -> list[str]:
        """What is wrong with these arguments, one line each (``vision.`` keys); empty when they are valid."""
        problems = [f"vision.{name}={getattr(self, name)} must be positive" for name in (
            "depth", "dim", "intermediate_dim", "n_heads", "image_size", "patch_size", "in_channels")
            if getattr(self, name) <= 0]
        if problems:
            return problems
        if self.dim % self.n_heads:
            problems.append(f"vision.dim={self.dim} must be a multiple of vision.n_heads={self.n_heads}")
        if self.image_size % self.patch_size:
            problems.append(f"vision.image_size={self.image_size} must be a multiple of "
                            f"vision.patch_size={self.patch_size}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"vision.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        return problems

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Gemma3VisionArgs(LlamaArgs):
    """The decoder's ``LlamaArgs`` (Gemma 3's flags), the tower's ``SiglipArgs``, how many tokens an image becomes
    (``mm_tokens_per_image``, a square) and the id of the image's placeholder token."""

    vision: SiglipArgs = SiglipArgs()
    mm_tokens_per_image: int = 256
    image_token_id: int = 262_144

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = self.vision.problems()
        side = math.isqrt(max(self.mm_tokens_per_image, 0))
        if self.mm_tokens_per_image <= 0 or side * side != self.mm_tokens_per_image:
            problems.append(f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square number")
        elif not problems and self.vision.patches_per_side % side:
            problems.append(f"mm_tokens_per_image={self.mm_tokens_per_image}: {side} tokens a side must divide the "
                            f"tower's {self.vision.patches_per_side} patches a side")
        if self.image_token_id < 0:
            problems.append(f"image_token_id={self.image_token_id} must be a token id")
        if problems:
            raise ValueError("invalid Gemma 3 vision model arguments: " + "; ".join(problems))

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)


class SiglipEmbeddings(nn.Module):
    """``pixel_values[n, channels, size, size]`` -> ``[n, patches, dim]``: each patch embedded, plus its position's
    embedding."""

    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(args.in_channels, args.dim, kernel_size=args.patch_size,
                                         stride=args.patch_size)
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [n, dim, side, side]
        x = x.flatten(2).transpose(1, 2)  # [n, patches, dim]
        return x + self.position_embedding.weight[:x.shape[1]]


class SiglipAttention(nn.Module):
    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.k_proj = nn.Linear(args.dim, args.dim)
        self.v_proj = nn.Linear(args.dim, args.dim)
        self.q_proj = nn.Linear(args.dim, args.dim)
        self.out_proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, patches, _ = x.shape
        q, k, v = (proj(x).view(n, patches, self.n_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [n, heads, patches, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, patches, -1))


class SiglipMLP(nn.Module):
    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.dim, args.intermediate_dim)
        self.fc2 = nn.Linear(args.intermediate_dim, args.dim)
        self.act = ACTIVATIONS[args.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(layer_norm1(x))``; ``out = h + mlp(layer_norm2(h))``."""

    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.self_attn = SiglipAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = SiglipMLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class SiglipEncoder(nn.Module):
    """The tower's blocks, under transformers' name (``encoder.layers``)."""

    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipBlock(args) for _ in range(args.depth))


class SiglipTower(nn.Module):
    """``pixel_values[n, channels, size, size]`` -> ``[n, patches, dim]``."""

    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = SiglipEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for block in self.encoder.layers:
            x = block(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """``[n, patches, vision dim]`` -> ``[n, mm_tokens_per_image, dim]``: the patch grid average-pooled to
    ``tokens_per_side`` a side, normed, and mapped to the decoder's width."""

    def __init__(self, args: Gemma3VisionArgs) -> None:
        super().__init__()
        self.patches_per_side = args.vision.patches_per_side
        self.kernel = self.patches_per_side // args.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(args.vision.dim, args.dim))
        self.mm_soft_emb_norm = RMSNorm(args.vision.dim, args.vision.norm_eps, offset=1.0)

    def forward(self, x: torch.Tensor, pool: bool = True) -> torch.Tensor:
        if pool:
            n, _, dim = x.shape
            grid = x.transpose(1, 2).reshape(n, dim, self.patches_per_side, self.patches_per_side)
            x = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)  # [n, tokens, vision dim]
        return (self.mm_soft_emb_norm(x) @ self.mm_input_projection_weight).to(x.dtype)


def image_attention_masks(tokens: torch.Tensor, image_token_id: int, window: Optional[int],
                          document_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Which keys each query sees in a batch with images: ``[b, 1, s, s]`` for the global layers, and for the
    sliding ones (None without a window).

    A query sees the keys before it and itself, and every token of its own image (a run of image tokens); a sliding
    layer's query sees no key W or more tokens behind it; no key of another document. Computed on the device.
    """
    b, s = tokens.shape
    is_image = tokens == image_token_id
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    image = torch.where(is_image, starts.cumsum(1), 0)  # [b, s]: the image each token is of (1, 2, ...), 0 for text
    index = torch.arange(s, device=tokens.device)
    behind = index.view(s, 1) - index.view(1, s)  # [s, s]: query index - key index
    allowed = (behind >= 0) | ((image.unsqueeze(2) == image.unsqueeze(1)) & is_image.unsqueeze(2))  # [b, s, s]
    if document_ids is not None:
        allowed = allowed & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
    sliding = None if window is None else allowed & (behind < window)
    return allowed.unsqueeze(1), None if sliding is None else sliding.unsqueeze(1)


class MaskedAttention(Attention):
    """Gemma 3's attention, which takes an explicit mask ``[b, 1, s, s]`` where a batch holds images (without one,
    the decoder's causal attention)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns],
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if mask is None:
            return super().forward(x, cos, sin, runs)
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim))  # [b, s, n_heads, hd]
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim))  # [b, s, n_kv, hd]
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, n_kv, s, hd]
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.scale, enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # [b, s, n_heads * hd] in


class Gemma3VisionBlock(TransformerBlock):
    """Gemma 3's block (``models/families/gemma3.py``'s ``Gemma3Block``: the attention's and the MLP's outputs
    normed before they join the residual), whose attention takes the image mask."""

    def __init__(self, args: LlamaArgs, window: Optional[int] = None, layer: int = 0) -> None:
        super().__init__(args, window, layer)
        self.attn = MaskedAttention(args, window)
        self.post_attn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.post_mlp_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.resid_dropout(self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, runs, mask)))
        return h + self.resid_dropout(self.post_mlp_norm(self.mlp(self.mlp_norm(h))))


class Gemma3Vision(Llama):
    """Gemma 3's decoder, ``vision_tower`` (SigLIP) and ``multi_modal_projector``.

    ``forward(tokens, ..., pixel_values=None)``: ``Llama.forward``'s arguments, and the batch's images
    (``pixel_values[n_images, channels, image_size, image_size]``, as the transformers processor returns them),
    whose ``mm_tokens_per_image`` features each replace the embeddings of the image tokens, image after image.
    Without images the tower and projector run on one blank patch, joined to the decoder times zero: the logits
    are the text-only model's, and every process runs every module (FSDP2's collectives).
    """

    def __init__(self, args: Gemma3VisionArgs) -> None:
        super().__init__(args, Gemma3VisionBlock)
        self.vision_tower = SiglipTower(args.vision)
        self.multi_modal_projector = Gemma3Projector(args)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n_images, mm_tokens_per_image, dim]`` of ``pixel_values``.

        Raises:
            ValueError: images of another shape than the tower's.
        """
        vision = self.args.vision
        expected = (vision.in_channels, vision.image_size, vision.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)}: the vision tower takes "
                             f"[n_images, {', '.join(map(str, expected))}]")
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def _blank_features(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tower and projector on one patch of zeros, unpooled: every parameter takes part, cheaply."""
        patch = self.args.vision.patch_size
        blank = torch.zeros(1, self.args.vision.in_channels, patch, patch, dtype=dtype, device=device)
        return self.multi_modal_projector(self.vision_tower(blank), pool=False)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: Optional[torch.Tensor] = None,
        head: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        document_lengths: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` (or the head's result), as ``Llama.forward``.

        Raises:
            ValueError: image tokens that are not ``mm_tokens_per_image`` per image.
        """
        args: Gemma3VisionArgs = self.args
        b, s = tokens.shape
        is_image = tokens == args.image_token_id
        # An image token beyond the vocabulary (transformers allows it) is embedded as token 0, then replaced.
        ids = tokens.masked_fill(is_image, 0) if args.image_token_id >= args.vocab_size else tokens
        h = self.tok_embeddings(ids)  # [b, s, dim]
        h = h * torch.tensor(args.dim**0.5, dtype=h.dtype).item()  # rounded to the dtype, as the decoder's
        masks = None
        if pixel_values is None:
            h = h + 0.0 * self._blank_features(h.dtype, h.device).sum()
        else:
            features = self.image_features(pixel_values).to(h.dtype).flatten(0, 1)  # [n_images * tokens, dim]
            # Under fake tensors (the memory planner's simulated step) there are no values to count: its layout is
            # the planner's own.
            count = None if is_fake(is_image) else int(is_image.sum())
            if count is not None and count != features.shape[0]:
                raise ValueError(f"{count} image tokens, but {pixel_values.shape[0]} images of "
                                 f"{args.mm_tokens_per_image} tokens give {features.shape[0]}")
            h = h.masked_scatter(is_image.unsqueeze(-1), features)
            masks = image_attention_masks(tokens, args.image_token_id, args.sliding_window, document_ids)
        runs = None
        if positions is None:
            positions = (torch.arange(s, device=tokens.device).expand(b, s) if document_ids is None
                         else positions_from_document_ids(document_ids))
            if document_ids is not None and masks is None:
                runs = document_runs(document_ids, document_lengths)
        full = self.rope_cos_sin(positions, h.dtype)
        sliding = self.rope_cos_sin(positions, h.dtype, sliding=True)
        for index, layer in enumerate(self.layers):
            window = args.window_of(index)
            cos, sin = sliding if window is not None else full
            h = layer(h, cos, sin, runs, None if masks is None else masks[window is not None])
        return self.output(self.norm(h), head)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)  # the linears, embeddings and RMSNorms of every part
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.Conv2d)):
                module.reset_parameters()
        nn.init.normal_(self.vision_tower.embeddings.patch_embedding.weight, mean=0.0, std=std)
        nn.init.zeros_(self.vision_tower.embeddings.patch_embedding.bias)
        nn.init.normal_(self.multi_modal_projector.mm_input_projection_weight, mean=0.0, std=std)

    @torch.no_grad()
    def init_parameter_(self, name: str, tensor: torch.Tensor, generator: Optional[torch.Generator],
                        std: float = 0.02) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if isinstance(owner, nn.LayerNorm):
            tensor.fill_(1.0 if attr == "weight" else 0.0)
        elif isinstance(owner, nn.Conv2d) and attr == "bias":
            tensor.zero_()
        elif isinstance(owner, (nn.Conv2d, Gemma3Projector)):  # the patch embedding, the projection
            tensor.normal_(mean=0.0, std=std, generator=generator)
        else:
            super().init_parameter_(name, tensor, generator, std)


def resized_image(args: Gemma3VisionArgs, height: int, width: int) -> tuple[int, int, int]:
    """The size any image reaches the tower in (the processor resizes every one to ``image_size`` a side; pan and
    scan's crops are images of their own) and its image tokens, ``mm_tokens_per_image``."""
    side = args.vision.image_size
    return side, side, args.mm_tokens_per_image


def planned_image_inputs(args: Gemma3VisionArgs, rows: int, seq_len: int, per_row: int, height: int,
                         width: int) -> dict[str, Any]:
    """A batch's inputs with ``per_row`` images (``resized_image``'s size whatever ``height x width``) at the start
    of every row, each image's tokens a run of its own (one text token after each, as the processor's end-of-image
    token), then text, for the memory planner: ``tokens`` ``[rows, seq_len]`` and ``pixel_values`` ``[rows *
    per_row, channels, size, size]`` (float32, as the processor returns them), made of shapes only.

    Raises:
        ValueError: the images' tokens do not fit a row.
    """
    n = args.mm_tokens_per_image
    if per_row * n > seq_len:
        raise ValueError(f"{per_row} images of {n} tokens do not fit a row of {seq_len}")
    stride = n + 1 if per_row * (n + 1) - 1 <= seq_len else n  # the text token between images when it fits
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    for i in range(per_row):
        tokens[:, i * stride:i * stride + n] = args.image_token_id
    v = args.vision
    return {"tokens": tokens,
            "pixel_values": torch.zeros(rows * per_row, v.in_channels, v.image_size, v.image_size)}
