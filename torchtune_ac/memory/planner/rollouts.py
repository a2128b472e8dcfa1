"""The memory of a GRPO step's rollouts, counted from shapes (``generation/decode.py`` allocates exactly these): the
KV cache of every completion at the prompt plus ``max_new_tokens``, the decode's logits and the sampler's working
copies, and the prompt batch's forward. It is alive before the training step, not with its activations: the step's
peak is the larger of the two above the resident parameters, optimizer state and reference. The loss pass over the
completions is the planner's simulated step itself (``batch_size`` completions of ``max_seq_len`` tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# float32 [rows, vocab] tensors the sampler holds at once at its peak (``decode.sample_next`` with top-p: the
# scaled logits, the sorted logits, their probabilities, the cumulative sum and the masked copy), besides the sort
# order (int64).
SAMPLER_FLOAT32_COPIES = 5


@dataclass(frozen=True)
class RolloutStep:
    """What one process generates per micro-batch.

    Attributes:
        rows: completions (prompts x ``num_generations``).
        prompt_len: the longest prompt, in tokens.
        max_new_tokens: the completions' length at most.
        reference: a reference model stays resident (``beta > 0`` and no adapters: with adapters the reference is
            the base with them off, no second model).
    """

    rows: int
    prompt_len: int
    max_new_tokens: int
    reference: bool = False

    @property
    def length(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclass(frozen=True)
class ModelShape:
    """The facts of a decoder the rollouts' tensors are sized by (``LlamaArgs``' names)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    intermediate_dim: int
    vocab_size: int
    n_windows: int = 1  # distinct attention windows (full attention counts as one): one mask each


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes per process (see the module docstring).

    Attributes:
        kv_cache: keys and values of every layer, ``[rows, n_kv, prompt + new, head_dim]`` each.
        logits: the decode's last-position logits ``[rows, vocab]`` in the model's dtype, the sampler's float32
            copies and its int64 sort order.
        prefill: the prompt batch's forward, the largest of its transients alive at once: the MLP's gate, up and
            product ``[rows, prompt, intermediate]``, the attention scores ``[rows, heads, prompt, prompt + new]`` (as
            SDPA's math kernel and the explicit soft-capped path hold them), and the masks (bool, one per window).
    """

    kv_cache: int
    logits: int
    prefill: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.logits + self.prefill


def rollout_memory(step: RolloutStep, shape: ModelShape, dtype: torch.dtype, tensor_parallel: int = 1) -> RolloutMemory:
    """The rollouts' bytes on one process (heads divided over ``tensor_parallel`` ranks)."""
    item = torch.empty((), dtype=dtype).element_size()
    rows, total, prompt = step.rows, step.length, step.prompt_len
    n_kv, n_heads = shape.n_kv_heads // tensor_parallel, shape.n_heads // tensor_parallel
    kv_cache = shape.n_layers * 2 * rows * n_kv * total * shape.head_dim * item
    logits = rows * shape.vocab_size * (item + SAMPLER_FLOAT32_COPIES * 4 + 8)
    mlp = 3 * rows * prompt * (shape.intermediate_dim // tensor_parallel) * item
    scores = rows * n_heads * prompt * total * item
    masks = shape.n_windows * rows * prompt * total
    return RolloutMemory(kv_cache=kv_cache, logits=logits, prefill=max(mlp, scores) + masks)


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The shape of a ``Llama``-style ``model`` (its ``args``; the windows of its layers)."""
    args = model.args
    windows = {args.window_of(layer) for layer in range(args.n_layers)}
    return ModelShape(n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      head_dim=args.resolved_head_dim, dim=args.dim, intermediate_dim=args.intermediate_dim,
                      vocab_size=args.vocab_size, n_windows=len(windows))
