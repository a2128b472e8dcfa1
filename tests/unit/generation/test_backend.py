"""Generation backends: ``native`` is ``generate`` on the policy itself (and leaves its train/eval mode as it was),
``sync_weights`` refuses a module it does not generate from, and unknown names, and ``vllm`` where it cannot run,
are refused in one line naming ``generation.backend`` (``test_vllm_backend.py``: the vLLM backend itself)."""

import importlib.util

import pytest
import torch
from models_testlib import TINY, build_random_llama

from torchtune_ac.errors import UserError
from torchtune_ac.generation import SamplingConfig, generate
from torchtune_ac.generation.backend import GenerationBackend, NativeBackend, build_generation_backend

PROMPTS = [[5, 17, 23], [8, 9]]


def test_native_backend_is_generate_on_the_policy():
    model = build_random_llama(TINY, seed=1).train()
    backend = build_generation_backend("native", model, eos_ids=[3], pad_id=0)
    assert isinstance(backend, NativeBackend) and isinstance(backend, GenerationBackend)
    config = SamplingConfig(max_new_tokens=5, temperature=1.0)
    done = backend.generate(PROMPTS, config, generator=torch.Generator().manual_seed(2))
    assert model.training
    expected = generate(model.eval(), PROMPTS, config, eos_ids=[3], pad_id=0,
                        generator=torch.Generator().manual_seed(2))
    assert done == expected
    backend.sync_weights(model)
    with pytest.raises(ValueError, match="another module"):
        backend.sync_weights(build_random_llama(TINY, seed=1))


# The model here is on the CPU: with vLLM installed, the device is what is refused.
VLLM_REASON = "vLLM is not installed" if importlib.util.find_spec("vllm") is None else "needs a CUDA device"


@pytest.mark.parametrize("name, message", [("vllm", VLLM_REASON), ("sglang", "must be one of native, vllm")])
def test_other_backends_are_refused_in_one_line(name, message):
    model = build_random_llama(TINY, seed=1)
    with pytest.raises(UserError, match=f"generation.backend=.*{message}") as refused:
        build_generation_backend(name, model, eos_ids=[3], pad_id=0)
    assert "\n" not in str(refused.value)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_the_config_refuses_vllm_before_anything_is_built():
    from torchtune_ac.training.rollouts import GenerationBackend, GenerationConfig

    with pytest.raises(UserError, match="generation.backend=vllm: "):
        GenerationConfig(backend=GenerationBackend.VLLM)
    assert GenerationConfig().backend is GenerationBackend.NATIVE
