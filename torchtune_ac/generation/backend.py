"""Where rollouts are generated: the contract a generation backend meets, and the one built here.

``native`` decodes with the policy itself (``decode.generate``: the static KV cache, in the training process, on the
weights being trained, so there is nothing to copy after an optimizer step). ``vllm`` is a vLLM engine colocated in
the training process (``vllm_backend.py``), given the policy's weights after each step; refused before any weight
loads where it cannot run."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.generation.decode import Completions, SamplingConfig, generate
from torchtune_ac.generation.vllm_backend import ModelFiles, VLLMBackend, VLLMSettings, check_vllm_serves, import_vllm

BACKENDS = ("native", "vllm")


@runtime_checkable
class GenerationBackend(Protocol):
    """What the GRPO recipe asks of a rollout generator."""

    def generate(self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *,
                 generator: Optional[torch.Generator] = None) -> Completions:
        """Complete every prompt with the current policy."""
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Called after each optimizer step: make the next ``generate`` use ``model``'s new weights."""
        ...


class NativeBackend:
    """Generation with the policy module itself (``decode.generate``).

    Args:
        model: the policy (the module being trained).
        eos_ids: the tokens that end a completion.
        pad_id: what fills a finished row.
        check_every: see ``generate``.
        compile_decode: see ``generate``.
    """

    def __init__(self, model: nn.Module, *, eos_ids: Sequence[int], pad_id: int, check_every: int = 8,
                 compile_decode: bool = False) -> None:
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.check_every = check_every
        self.compile_decode = compile_decode

    def generate(self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *,
                 generator: Optional[torch.Generator] = None) -> Completions:
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            return generate(self.model, prompts, config, eos_ids=self.eos_ids, pad_id=self.pad_id,
                            generator=generator, check_every=self.check_every, compile_decode=self.compile_decode)
        finally:
            self.model.train(was_training)

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to copy: generation reads the policy's own parameters. A different module is refused (the
        backend would otherwise keep sampling from a stale one)."""
        if model is not self.model:
            raise ValueError("NativeBackend.sync_weights: generation reads the policy it was built with; got another "
                             "module")


def check_generation_backend(name: str, device: Optional[torch.device] = None, *, model: Optional[nn.Module] = None,
                             world_size: int = 1) -> None:
    """Refuse a backend this process cannot build, in one line naming the key, before any weight loads. Without
    ``device`` and ``model`` (a config read before the run's device and model are known) only the name and vLLM's
    presence are checked.

    Raises:
        UserError: ``name`` is unknown; or ``vllm`` and vLLM is not installed, or (``check_vllm_serves``) the run is
            not on CUDA, has several processes, or its model is not one vLLM serves.
    """
    if name not in BACKENDS:
        raise UserError(f"generation.backend={name!r}: must be one of {', '.join(BACKENDS)}")
    if name != "vllm":
        return
    if import_vllm() is None:
        raise UserError("generation.backend=vllm: vLLM is not installed (pip install vllm); use native")
    if device is not None and device.type != "cuda":
        raise UserError(f"generation.backend=vllm: needs a CUDA device (this run is on {device.type}); use native")
    if device is not None and model is not None:
        check_vllm_serves(model, device=device, world_size=world_size)


def build_generation_backend(name: str, model: nn.Module, *, eos_ids: Sequence[int], pad_id: int,
                             check_every: int = 8, compile_decode: bool = False,
                             vllm: Optional[VLLMSettings] = None,
                             model_files: Optional[ModelFiles] = None) -> GenerationBackend:
    """The backend ``name`` (``generation.backend``) over the policy ``model``.

    Args:
        vllm: the engine's settings (``vllm`` only; required there).
        model_files: the policy's Hugging Face files for the engine (``vllm`` only; default ``hf_model_files``).

    Raises:
        UserError: as ``check_generation_backend``.
    """
    check_generation_backend(name, next(model.parameters()).device)
    if name == "vllm":
        if vllm is None:
            raise ValueError("build_generation_backend: the vllm backend needs its settings (vllm=VLLMSettings(...))")
        extra = {} if model_files is None else {"model_files": model_files}
        return VLLMBackend(model, eos_ids=eos_ids, settings=vllm, **extra)
    return NativeBackend(model, eos_ids=eos_ids, pad_id=pad_id, check_every=check_every,
                         compile_decode=compile_decode)
