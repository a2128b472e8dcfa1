"""Generation: a static KV cache, sampling (temperature, top-k, top-p), stopping at end-of-sequence, batched; used by
the GRPO recipe's rollouts."""

from torchtune_ac.generation.decode import SamplingConfig, generate
from torchtune_ac.generation.kv_cache import KVCache

__all__ = ["KVCache", "SamplingConfig", "generate"]
