"""The vLLM backend's glue, against a stand-in ``vllm`` module (vLLM needs a GPU; none here): the engine is built from
the policy's config.json with placeholder weights, the policy's weights reach it by Hugging Face name before the
first rollout and after each step (at the wake-up with sleep mode), prompts, sampling settings, per-request seeds
and stop tokens go through, completions come back as native's do; and the refusals, each in one line."""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from models_testlib import TINY, build_random_llama
from safetensors.torch import load_file

from torchtune_ac import models
from torchtune_ac.errors import UserError
from torchtune_ac.generation import SamplingConfig
from torchtune_ac.generation.backend import GenerationBackend, check_generation_backend
from torchtune_ac.generation.vllm_backend import VLLMBackend, VLLMSettings, check_vllm_serves, stored_tensors
from torchtune_ac.models import hf_model_files, save_hf
from torchtune_ac.models.families import family_of

EOS = 3
PROMPTS = [[5, 17, 23], [5, 17, 23], [8, 9]]


@dataclass
class Completion:  # vLLM's CompletionOutput, the fields read
    index: int
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Any = None


@dataclass
class RequestOutput:  # vLLM's RequestOutput, the fields read
    prompt_token_ids: list[int]
    outputs: list[Completion]


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


@dataclass
class FakeLLM:
    """Records what the backend asks; ``generate`` answers by a rule of the request's seed: ``length`` with 4 tokens
    for an even seed, else ``stop`` on EOS (token ids with the stop token for seeds ending in 1, 5 or 9, as vLLM
    returns them, without it otherwise)."""

    kwargs: dict[str, Any]
    calls: list[Any] = field(default_factory=list)
    loaded: list[dict[str, torch.Tensor]] = field(default_factory=list)
    requests: list[tuple[list[dict], list[SamplingParams]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = json.loads((Path(self.kwargs["model"]) / "config.json").read_text())
        model = types.SimpleNamespace(load_weights=self._load_weights)
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
        ENGINES.append(self)

    def _load_weights(self, weights):
        self.loaded.append({name: tensor.clone() for name, tensor in weights})

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append("load")
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake", tuple(tags)))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append("generate")
        self.requests.append((prompts, sampling_params))
        out = []
        for prompt, params in zip(prompts, sampling_params):
            seed = params.seed or 0  # None: unseeded
            if seed % 2 == 0:
                completion = Completion(0, [10 + seed % 7, 11, 12, 13], "length")
            else:
                body = [20 + seed % 5]
                completion = Completion(0, body + [EOS] if seed % 10 in (1, 5, 9) else body, "stop", EOS)
            out.append(RequestOutput(prompt["prompt_token_ids"], [completion]))
        return out


ENGINES: list[FakeLLM] = []


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the backend sets it to 0; put back after
    module = types.ModuleType("vllm")
    module.__version__ = "0.0-test"
    module.LLM = lambda **kwargs: FakeLLM(kwargs)
    module.SamplingParams = SamplingParams
    served = ["LlamaForCausalLM", "Qwen3MoeForCausalLM"]
    module.ModelRegistry = types.SimpleNamespace(get_supported_archs=lambda: served)
    monkeypatch.setitem(sys.modules, "vllm", module)
    ENGINES.clear()
    return module


def build_backend(model: torch.nn.Module, *, sleep: bool = False) -> VLLMBackend:
    # Built directly: build_generation_backend refuses vllm on this CPU (test_runs_it_cannot_serve_...).
    backend = VLLMBackend(model, eos_ids=[EOS], settings=VLLMSettings(48, gpu_memory_utilization=0.25,
                                                                       enable_sleep_mode=sleep, seed=7))
    assert isinstance(backend, VLLMBackend) and isinstance(backend, GenerationBackend)
    return backend


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in hf_model_files(model).tensors.items()}


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_the_engine_is_built_from_the_policys_config_with_placeholder_weights(fake_vllm) -> None:
    model = build_random_llama(TINY, seed=1)
    build_backend(model)
    (engine,) = ENGINES
    assert engine.config == hf_model_files(model).config
    for key, value in {"skip_tokenizer_init": True, "load_format": "dummy", "dtype": "float32", "seed": 7,
                       "max_model_len": 48, "gpu_memory_utilization": 0.25, "enable_sleep_mode": False,
                       "distributed_executor_backend": "uni",
                       "enable_prefix_caching": True}.items():
        assert engine.kwargs[key] == value, key
    assert engine.calls == []  # no weights handed over before the first rollout
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the worker in this process: tensors, not pickles


def test_prompts_settings_seeds_and_stop_tokens_go_through_and_completions_come_back(fake_vllm) -> None:
    model = build_random_llama(TINY, seed=1)
    backend = build_backend(model)
    config = SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9)
    done = backend.generate(PROMPTS, config, generator=torch.Generator().manual_seed(3))
    (engine,) = ENGINES
    assert engine.calls == ["load", "reset", "generate"]
    assert_same_weights(engine.loaded[0], expected_weights(model))
    prompts, params = engine.requests[0]
    assert prompts == [{"prompt_token_ids": p} for p in PROMPTS]
    seeds = torch.randint(0, 2**31 - 1, (3,), generator=torch.Generator().manual_seed(3)).tolist()
    assert [p.seed for p in params] == seeds and len(set(seeds)) == 3  # a request's own seed, from the generator
    for p in params:
        assert (p.n, p.temperature, p.top_k, p.top_p, p.max_tokens, p.stop_token_ids, p.detokenize) == (
            1, 0.7, 5, 0.9, 4, [EOS], False)
    expected_tokens, expected_cut = [], []
    for seed in seeds:  # FakeLLM's rule, with EOS ending every stopped completion as native's
        cut = seed % 2 == 0
        expected_tokens.append([10 + seed % 7, 11, 12, 13] if cut else [20 + seed % 5, EOS])
        expected_cut.append(cut)
    assert done.tokens == expected_tokens and done.truncated == expected_cut
    again = backend.generate(PROMPTS, config, generator=torch.Generator().manual_seed(3))
    assert again == done and engine.calls[-1] == "generate" and "load" not in engine.calls[3:]
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=4), generator=None)
    assert [p.top_k for p in engine.requests[-1][1]] == [-1] * 3  # top_k 0 (all) is vLLM's -1


def test_a_stop_of_each_kind_is_read_as_native_reads_it(fake_vllm) -> None:
    """Whatever the seeds: a ``length`` finish is truncated, a ``stop`` on EOS ends with EOS exactly once."""
    backend = build_backend(build_random_llama(TINY, seed=1))
    done = backend.generate(PROMPTS * 8, SamplingConfig(max_new_tokens=4), generator=torch.Generator().manual_seed(0))
    assert set(done.truncated) == {True, False}
    for tokens, cut in zip(done.tokens, done.truncated):
        assert (len(tokens), tokens.count(EOS)) == ((4, 0) if cut else (2, 1)) and (cut or tokens[-1] == EOS)


def test_each_step_hands_the_new_weights_over(fake_vllm) -> None:
    model = build_random_llama(TINY, seed=1)
    backend = build_backend(model)
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    backend.sync_weights(model)
    (engine,) = ENGINES
    assert engine.calls == ["load", "reset", "generate", "load", "reset"]
    assert_same_weights(engine.loaded[1], expected_weights(model))
    assert not torch.equal(engine.loaded[1]["model.embed_tokens.weight"], engine.loaded[0]["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="another module"):
        backend.sync_weights(build_random_llama(TINY, seed=1))


def test_with_sleep_mode_the_weights_follow_at_each_wake_up(fake_vllm) -> None:
    model = build_random_llama(TINY, seed=1)
    backend = build_backend(model, sleep=True)
    (engine,) = ENGINES
    assert engine.kwargs["enable_sleep_mode"] is True and engine.calls == [("sleep", 2)]
    rollout = [("wake", ("weights",)), "load", "reset", ("wake", ("kv_cache",)), "generate", ("sleep", 2)]
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    assert engine.calls == [("sleep", 2), *rollout]
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    backend.sync_weights(model)
    assert engine.calls == [("sleep", 2), *rollout]  # asleep: the hand-over waits for the next rollout
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    assert engine.calls == [("sleep", 2), *rollout, *rollout]
    assert_same_weights(engine.loaded[1], expected_weights(model))


def test_parameters_stored_in_parts_reach_the_engine_as_a_checkpoint_stores_them(tmp_path: Path) -> None:
    """A mixture of experts (its experts stored one by one): the tensors handed over are the saved checkpoint's."""
    torch.manual_seed(0)
    model = models.qwen3_moe_tiny()
    family_of(model).init_weights(model)
    saved = save_hf(model, tmp_path / "ckpt")
    files = hf_model_files(model)
    assert files.layout.written().keys() != files.tensors.keys()  # some parameters are stored in parts
    handed = dict(stored_tensors(files))
    assert_same_weights(handed, load_file(saved / "model.safetensors"))


@pytest.mark.parametrize("case, message", [
    ("absent", "generation.backend=vllm: vLLM is not installed"),
    ("cpu", "generation.backend=vllm: needs a CUDA device (this run is on cpu)"),
    ("two processes", "generation.backend=vllm: runs in one process only (2 processes here"),
    ("qwen3", "generation.backend=vllm: vLLM 0.0-test does not serve Qwen3ForCausalLM (the qwen3 family)"),
    ("vision", "the qwen2_5_vl family is vision-language"),
])
def test_runs_it_cannot_serve_are_refused_in_one_line(case, message, fake_vllm, monkeypatch) -> None:
    model = build_random_llama(TINY, seed=1)
    device, world_size = torch.device("cuda"), 1
    if case == "absent":
        monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    elif case == "cpu":
        device = torch.device("cpu")
    elif case == "two processes":
        world_size = 2
    else:
        with torch.device("meta"):
            model = models.qwen3_0_6b() if case == "qwen3" else models.qwen2_5_vl_tiny()
    with pytest.raises(UserError) as refused:
        check_generation_backend("vllm", device, model=model, world_size=world_size)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_vllm_serves_on_one_cuda_process_passes(fake_vllm) -> None:
    check_vllm_serves(build_random_llama(TINY, seed=1), device=torch.device("cuda"), world_size=1)


def test_with_adapters_the_engine_is_handed_the_merged_weights(fake_vllm) -> None:
    """``lora_grpo``'s hand-over (``model_files=merged_model_files``): a plain model's names, each adapted linear's
    weight merged (B A added), so the engine needs no adapters."""
    from torchtune_ac.lora.config import AdapterConfig
    from torchtune_ac.lora.export import merged_model_files
    from torchtune_ac.lora.mechanism import adapted_linears, apply_adapters, initialize_adapters_

    model = build_random_llama(TINY, seed=1)
    plain_names = set(hf_model_files(model).tensors)
    base_q = model.layers[0].attn.q_proj.weight.detach().clone()
    apply_adapters(model, AdapterConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    initialize_adapters_(model, seed=0)
    with torch.no_grad():
        for _, linear in adapted_linears(model):
            linear.lora_b.weight.normal_()  # B starts at 0: make the merge visible
    backend = VLLMBackend(model, eos_ids=[EOS], settings=VLLMSettings(48), model_files=merged_model_files)
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    (engine,) = ENGINES
    handed = engine.loaded[0]
    assert set(handed) == plain_names and engine.config == merged_model_files(model).config
    assert_same_weights(handed, {n: t.detach() for n, t in merged_model_files(model).tensors.items()})
    q = handed["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, base_q) and torch.equal(handed["model.layers.0.self_attn.k_proj.weight"],
                                                      model.layers[0].attn.k_proj.weight.detach())


def test_compiled_decoding_with_the_vllm_backend_is_refused_not_ignored() -> None:
    """generation.compile is the native backend's: with vllm it would be silently ignored, so it is refused."""
    from torchtune_ac.training.rollouts import GenerationBackend as Backend, GenerationConfig

    with pytest.raises(UserError, match="generation.compile=true applies to the native backend"):
        GenerationConfig(compile=True, backend=Backend.VLLM)
    assert GenerationConfig(compile=True).compile

