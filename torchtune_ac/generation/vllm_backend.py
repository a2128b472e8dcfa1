"""Colocated vLLM generation (``generation.backend: vllm``): a vLLM engine in the training process, on its GPU,
given the policy's weights by Hugging Face name before the first rollout and after each step's optimizer steps.

Written against vLLM's offline API (``LLM``, ``SamplingParams``, ``LLM.generate`` on token ids, ``collective_rpc``,
``sleep``/``wake_up``) and tested here with a stand-in ``vllm`` module only: no GPU run of it has been made."""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ac.errors import UserError
from torchtune_ac.generation.decode import Completions, SamplingConfig
from torchtune_ac.models import hf_model_files
from torchtune_ac.models.families import family_of

# model -> its Hugging Face files (``torchtune_ac.models.hf_model_files``, or with adapters the merged model's).
ModelFiles = Callable[[nn.Module], Any]


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's settings: the longest prompt plus completion, the share of the GPU's memory it may take, whether
    it sleeps (weights and KV cache released) between rollouts, and its seed."""

    max_model_len: int
    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False
    seed: int = 0


def import_vllm() -> Optional[ModuleType]:
    """vLLM's package, or None where it is not installed."""
    try:
        return importlib.import_module("vllm")
    except ImportError:
        return None


def check_vllm_serves(model: nn.Module, *, device: torch.device, world_size: int) -> None:
    """Refuse, before any weight loads, a run this backend cannot generate for (``model`` on meta will do).

    Raises:
        UserError: vLLM is not installed, the run is not on a CUDA device, it has more than one process, or vLLM
            does not serve the model's architecture (each in one line naming ``generation.backend``).
    """
    key = "generation.backend=vllm"
    vllm = import_vllm()
    if vllm is None:
        raise UserError(f"{key}: vLLM is not installed (pip install vllm); use native")
    if device.type != "cuda":
        raise UserError(f"{key}: needs a CUDA device (this run is on {device.type}); use native")
    if world_size > 1:
        raise UserError(f"{key}: runs in one process only ({world_size} processes here: one engine per FSDP2 rank is "
                        "not built); use native, or one process")
    family = family_of(model)
    if family is None:
        raise UserError(f"{key}: {type(model).__name__} is of no known family: vLLM loads Hugging Face "
                        "architectures; use native")
    if family.images is not None:
        raise UserError(f"{key}: the {family.name} family is vision-language; this backend generates from text "
                        "prompts only; use native")
    architecture = family.hf.hf_config_from_args(family.args_of(model), torch.float32)["architectures"][0]
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if architecture not in supported:
        raise UserError(f"{key}: vLLM {getattr(vllm, '__version__', '')} does not serve {architecture} (the "
                        f"{family.name} family); use native")


def stored_tensors(files: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor a Hugging Face checkpoint of ``files`` stores, by its stored name, on the parameters' device: a
    parameter stored whole is handed as itself; one stored in parts (Phi-3's fused q/k/v, MoE experts one by one) or
    stacked is assembled as ``save_hf``'s writer assembles it. A model sharded in a world of one (FSDP2 for CPU
    offload) holds DTensors: each is its whole tensor there."""
    layout = files.layout

    def whole(name: str) -> torch.Tensor:
        tensor = files.tensors[name].detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    for stored, pieces in layout.written().items():
        first = whole(pieces[0].target)
        shape = layout.stored_shapes[stored]
        if len(pieces) == 1 and pieces[0].shape == tuple(shape) == tuple(first.shape):
            yield stored, first
            continue
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
        for piece in pieces:
            out[piece.stored_region(piece.region)] = whole(piece.target)[piece.region].reshape(piece.shape)
        yield stored, out


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run by ``collective_rpc`` on the engine's worker (in this process): the model loads them by HF name."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMBackend:
    """Generation by a vLLM engine colocated with the policy (one process, one GPU).

    The engine starts with placeholder weights (``load_format="dummy"``) from the policy's config.json, and no
    tokenizer (prompts go in and completions come out as token ids); the policy's weights are handed to it, by
    their Hugging Face names, before the first rollout and, from ``sync_weights``, after each optimizer step. With
    ``enable_sleep_mode`` the engine releases its weights and KV cache after each rollout, and the hand-over waits
    for the next one.

    Args:
        model: the policy.
        eos_ids: the tokens that end a completion (given as ``stop_token_ids``: the engine reads no tokenizer).
        settings: the engine's settings.
        model_files: the policy's Hugging Face files (``hf_model_files``; with adapters, the merged model's).
    """

    def __init__(self, model: nn.Module, *, eos_ids: Sequence[int], settings: VLLMSettings,
                 model_files: ModelFiles = hf_model_files) -> None:
        vllm = import_vllm()
        if vllm is None:
            raise UserError("generation.backend=vllm: vLLM is not installed (pip install vllm); use native")
        self.vllm, self.model, self.settings = vllm, model, settings
        self.eos_ids = tuple(eos_ids)
        self.model_files = model_files
        # config.json is all the engine reads from disk; it builds the architecture and waits for our weights.
        self._engine_dir = tempfile.TemporaryDirectory(prefix="torchtune_ac_vllm_")
        config = dict(model_files(model).config)
        Path(self._engine_dir.name, "config.json").write_text(json.dumps(config, indent=2))
        # The engine and its one worker in this process (vLLM reads this when the engine is made): the weights are
        # handed over as tensors on the GPU, not pickled to another process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        dtype = next(model.parameters()).dtype
        self.llm = vllm.LLM(
            model=self._engine_dir.name, skip_tokenizer_init=True, load_format="dummy",
            dtype=str(dtype).removeprefix("torch."), seed=settings.seed, max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=settings.enable_sleep_mode,
            distributed_executor_backend="uni", enable_prefix_caching=True)
        self._stale = True  # the engine's weights are placeholders until the first hand-over
        if settings.enable_sleep_mode:
            self.llm.sleep(level=2)  # the policy trains first; the engine wakes for its first rollout

    def generate(self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *,
                 generator: Optional[torch.Generator] = None) -> Completions:
        """One request a prompt (a group's repeated prompts share their KV through the prefix cache), each seeded
        from ``generator`` (the same generator state draws the same seeds); no log-probabilities are requested: the
        loss takes them from the policy, as with ``native``."""
        if self._stale:
            self._hand_over()
        if self.settings.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        seeds = (torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator, device=generator.device).tolist()
                 if generator is not None else [None] * len(prompts))
        params = [self.vllm.SamplingParams(
            n=1, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k if config.top_k else -1,
            max_tokens=config.max_new_tokens, seed=seed, stop_token_ids=list(self.eos_ids), detokenize=False,
        ) for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        if self.settings.enable_sleep_mode:
            self.llm.sleep(level=2)
            self._stale = True
        tokens, truncated = [], []
        for output in outputs:
            (completion,) = output.outputs
            ids = list(completion.token_ids)
            stop = completion.stop_reason
            if completion.finish_reason == "stop" and stop in self.eos_ids and ids[-1:] != [stop]:
                ids.append(stop)  # the end-of-sequence token is part of the completion, as native's
            tokens.append(ids)
            truncated.append(completion.finish_reason == "length")
        return Completions(tokens, truncated)

    def sync_weights(self, model: nn.Module) -> None:
        """Hand the policy's new weights to the engine (with sleep mode, at its next wake-up)."""
        if model is not self.model:
            raise ValueError("VLLMBackend.sync_weights: the engine follows the policy it was built with; got another "
                             "module")
        self._stale = True
        if not self.settings.enable_sleep_mode:
            self._hand_over()

    def _hand_over(self) -> None:
        if self.settings.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        with torch.no_grad():
            weights = list(stored_tensors(self.model_files(self.model)))
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()  # cached prompts' KV came from the old weights
        self._stale = False
