"""Generation: a static KV cache, sampling (temperature, top-k, top-p), stopping at end-of-sequence, batched; and the
backends the GRPO recipe's rollouts go through (``backend.py``: the policy itself, or a colocated vLLM engine in
``vllm_backend.py``)."""

from torchtune_ac.generation.backend import GenerationBackend, NativeBackend, build_generation_backend
from torchtune_ac.generation.decode import Completions, SamplingConfig, generate
from torchtune_ac.generation.kv_cache import KVCache
from torchtune_ac.generation.vllm_backend import VLLMBackend, VLLMSettings

__all__ = ["Completions", "GenerationBackend", "KVCache", "NativeBackend", "SamplingConfig", "VLLMBackend",
           "VLLMSettings", "build_generation_backend", "generate"]
