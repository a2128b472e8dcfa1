"""PEFT's names for a model's adapters, pure: each adapted linear's Hugging Face module name (through the model's
family, ``models/hf_adapter.py``), PEFT's tensor keys (``base_model.model.<hf name>.lora_A.weight``, ``lora_B``,
``lora_magnitude_vector``) and adapter_config.json's keys; the check of a PEFT folder against them."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.checkpoint.layout import Stacked
from torchtune_ac.lora.config import AdapterConfig, AdapterKind
from torchtune_ac.lora.mechanism import AdaptedLinear, adapted_linears
from torchtune_ac.models.families import family_of, require_family

PEFT_PREFIX = "base_model.model."
# Our parameter's name within an adapted linear -> PEFT's.
PEFT_PARTS = {"lora_a.weight": "lora_A.weight", "lora_b.weight": "lora_B.weight",
              "lora_magnitude": "lora_magnitude_vector"}


def hf_module_name(model: nn.Module, name: str) -> str:
    """An adapted linear's module name in Hugging Face's layout (``layers.0.attn.q_proj`` ->
    ``model.layers.0.self_attn.q_proj``).

    Raises:
        UserError: the model is of no known family, or the family stores this linear stacked with others (Phi-3's
            ``qkv_proj``), which PEFT adapts as one.
    """
    family = require_family(model, "adapters saved in PEFT's format")
    hf_weight = family.hf.to_hf_name(f"{name}.weight")
    for rule in family.hf.storage:
        if isinstance(rule, Stacked) and any(hf_weight == p or hf_weight.endswith("." + p) for p in rule.parts):
            raise UserError(f"adapter.targets: {name.rsplit('.', 1)[-1]} is stored as part of {rule.stored} in "
                            f"Hugging Face's layout of this model, which PEFT adapts whole; name other linears")
    return hf_weight[: -len(".weight")]


def check_peft_names(model: nn.Module, targets: Mapping[str, nn.Module]) -> None:
    """Every target has a PEFT name (see ``hf_module_name``); run on the meta model before any weight is loaded."""
    if family_of(model) is None:
        raise UserError("adapter: the model is of no model family of torchtune_ac's, so its adapters have no PEFT "
                        "names; use a family's builder (torchtune_ac.models)")
    for name in targets:
        hf_module_name(model, name)


def peft_keys(model: nn.Module) -> dict[str, tuple[AdaptedLinear, str, str]]:
    """PEFT's tensor name -> (the adapted linear, our parameter's name in it, its full name in ``model``)."""
    keys = {}
    for name, linear in adapted_linears(model):
        module = hf_module_name(model, name)
        for ours, theirs in PEFT_PARTS.items():
            if ours == "lora_magnitude" and linear.lora_magnitude is None:
                continue
            keys[f"{PEFT_PREFIX}{module}.{theirs}"] = (linear, ours, f"{name}.{ours}")
    return keys


def adapter_tensor(linear: AdaptedLinear, part: str) -> torch.Tensor:
    return linear.lora_magnitude if part == "lora_magnitude" else getattr(linear, part.split(".")[0]).weight


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters by PEFT's names (plain tensors or DTensors, as the model holds them)."""
    return {key: adapter_tensor(linear, part) for key, (linear, part, _) in peft_keys(model).items()}


def peft_target_modules(config: AdapterConfig) -> list[str]:
    return list(config.targets) + (["lm_head"] if config.output else [])


def peft_excluded_modules(model: nn.Module) -> Optional[str]:
    """PEFT's ``exclude_modules`` for ``model``: a regular expression over the Hugging Face names of its family's
    ``vision_modules`` (``model\\.visual\\..*``), so that PEFT's suffix match of ``target_modules`` finds the
    language model's linears alone, as ``find_targets`` does; None for a text-only model."""
    family = family_of(model)
    if family is None or not family.vision_modules:
        return None
    prefixes = []
    for module in family.vision_modules:
        name = next(name for name, _ in getattr(model, module).named_parameters())
        hf = family.hf.to_hf_name(f"{module}.{name}")
        prefixes.append(re.escape(hf[: -len(name)]))
    return f"({'|'.join(prefixes)}).*"


def peft_config(config: AdapterConfig, *, base_model: Optional[str] = None,
                exclude_modules: Optional[str] = None) -> dict[str, Any]:
    """adapter_config.json: PEFT's ``LoraConfig`` for these adapters (the keys ``PeftModel.from_pretrained`` reads;
    it fills in the others' defaults); ``exclude_modules`` from ``peft_excluded_modules``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
            "target_modules": peft_target_modules(config), "use_dora": config.kind is AdapterKind.DORA,
            "use_rslora": False, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True,
            **({"exclude_modules": exclude_modules} if exclude_modules else {})}


def check_adapter_folder(model: nn.Module, config: AdapterConfig, folder: str, peft: Mapping[str, Any],
                         shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a PEFT folder (its adapter_config.json ``peft`` and tensor ``shapes``) that is not for this base and
    these adapters: another kind or rank, scale, names or shapes. ``model`` has its adapters (on any device).

    Raises:
        UserError: one line, naming the first difference.
    """
    where = f"adapter.checkpoint_dir={folder}"
    if peft.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: a {peft.get('peft_type')} adapter, not LoRA")
    kind = AdapterKind.DORA if peft.get("use_dora") else AdapterKind.LORA
    for key, theirs, ours in (("r", peft.get("r"), config.rank), ("kind", kind.value, config.kind.value),
                              ("lora_alpha", peft.get("lora_alpha"), config.alpha)):
        if theirs != ours:
            raise UserError(f"{where}: its {key} is {theirs}, this run's adapter section says {ours}: set the "
                            "adapter section as the folder was trained")
    if peft.get("use_rslora"):
        raise UserError(f"{where}: an rsLoRA adapter (scale alpha / sqrt(r)); this run scales by alpha / r")
    expected = {key: tuple(adapter_tensor(linear, part).shape) for key, (linear, part, _) in peft_keys(model).items()}
    extra = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes))
    copies = [key for key in extra if key.endswith(".base_layer.weight")]
    if copies:  # PEFT's save_embedding_layers="auto" with lm_head or embed_tokens among the targets
        raise UserError(f"{where}: {copies[0]} is a copy of a base weight, which PEFT saves with the adapters of an "
                        "embedding or lm_head: this run takes the base from checkpoint_dir alone; save the adapters "
                        "again with save_pretrained(..., save_embedding_layers=False)")
    if extra or missing:
        what = (f"{extra[0]} is not an adapter of this model" if extra
                else f"{missing[0]} is missing (its targets: {', '.join(peft.get('target_modules') or [])})")
        raise UserError(f"{where}: not an adapter of this base with these targets: {what} "
                        f"({len(extra)} unexpected, {len(missing)} missing)")
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise UserError(f"{where}: {key} is {list(shapes[key])}, this model's is {list(shape)}: an adapter of "
                            "another base")
