"""Hugging Face checkpoints <-> models of any known family: the family's pure adapter composed with the file code
of ``torchtune_ac.checkpoint``.

The adapter (``models/families``) says what a model's tensors are called, how its checkpoints store them (as data,
compiled here into the model's ``StoredLayout``) and what its config.json holds; ``torchtune_ac.checkpoint.hf``
reads and writes the stored tensors by walking that layout, and knows no family. This module is the one place in
``models/`` that calls file code: it holds no file or collective code itself, and the rest of ``models/`` imports
from ``checkpoint`` only its pure vocabulary of stored layouts (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint.files import PathLike
from torchtune_ac.checkpoint.hf import (
    HFModelFiles,
    check_full_tensors,
    config_path,
    load_hf_tensors_,
    read_hf_config,
    save_hf_files,
)
from torchtune_ac.checkpoint.layout import StoredLayout, StoredTensor, build_layout, by_stored_name, match_stored
from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError
from torchtune_ac.models.families import FAMILIES, args_from_hf_config, require_family, retie_parameters
from torchtune_ac.models.family import ModelFamily, architecture_mismatches

# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------


def read_hf_args(checkpoint_dir: PathLike, **overrides: Any) -> tuple[ModelFamily, Any]:
    """The family and model arguments a checkpoint's config.json describes (errors name the file).

    Args:
        checkpoint_dir: a checkpoint directory, or the path of the config.json itself.
        **overrides: argument fields to set instead of what the config says (e.g. ``attn_dropout``).

    Raises:
        UserError: the file is missing or not a JSON object, an unsupported ``model_type`` (listing the supported
            ones), or a config the family's adapter refuses.
    """
    config = read_hf_config(checkpoint_dir)
    try:
        return args_from_hf_config(config, **overrides)
    except UserError as e:
        raise UserError(f"{config_path(checkpoint_dir)}: {e}") from None


def check_checkpoint_matches(model: nn.Module, checkpoint_dir: PathLike) -> None:
    """Refuse a checkpoint whose config.json describes another model than ``model``.

    The one comparison of checkpoint and model: same family, and every key of the family's ``architecture``
    equal (shapes, head layout, RoPE, norm, tying; dropout and the maximum length may differ). Equal shapes are
    not enough: 8 heads of 16 and 4 heads of 32 have the same weights' shapes but compute something else.

    Raises:
        UserError: naming config.json and each key that differs, or a model of no known family.
    """
    family = require_family(model, "a Hugging Face checkpoint (checkpoint_dir)")
    path = config_path(checkpoint_dir)
    config = read_hf_config(checkpoint_dir)
    if config.get("model_type") in family.hf.model_types_loaded:
        theirs_family = family
        try:
            theirs = family.hf.args_from_hf_config(config)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    else:
        theirs_family, theirs = read_hf_args(checkpoint_dir)
    if theirs_family is not family:
        raise UserError(
            f"{path}: model_type={theirs_family.hf.model_type!r} (a {theirs_family.name} checkpoint), "
            f"but the model is a {family.name} model"
        )
    mismatches = architecture_mismatches(family.hf.architecture(family.args_of(model)), family.hf.architecture(theirs))
    if mismatches:
        raise UserError(f"{path}: describes a different model than `model`: " + "; ".join(mismatches))


@config_component
def from_hf_config(
    checkpoint_dir: Optional[str | PathLike | dict] = None,
    *,
    attn_dropout: float = 0.0,
    resid_dropout: float = 0.0,
    max_seq_len: Optional[int] = None,
) -> nn.Module:
    """Build the model a Hugging Face config.json describes, of whichever supported family its ``model_type``
    names (weights left unset: the recipe loads them from ``checkpoint_dir``).

    In a config, ``model: {_component_: torchtune_ac.models.from_hf_config}`` reads the run's ``checkpoint_dir``;
    setting ``model.checkpoint_dir`` reads another one.

    Args:
        checkpoint_dir: a checkpoint directory, the path of a config.json, or the parsed config.json.
        attn_dropout: dropout on attention probabilities (overrides the config's ``attention_dropout``).
        resid_dropout: dropout on each residual branch.
        max_seq_len: longest sequence the model is meant for; None keeps ``max_position_embeddings``.

    Returns:
        The model, on the current default device.

    Raises:
        UserError: no config given, the file is missing or not JSON, the ``model_type`` is not supported (the
            message lists the supported ones), or the family refuses the config (naming the file and key).
    """
    if checkpoint_dir is None:
        raise UserError("from_hf_config: no config.json to read: set checkpoint_dir (or model.checkpoint_dir)")
    overrides: dict[str, Any] = dict(attn_dropout=attn_dropout, resid_dropout=resid_dropout)
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    if isinstance(checkpoint_dir, dict):
        family, args = args_from_hf_config(checkpoint_dir, **overrides)
    else:
        family, args = read_hf_args(checkpoint_dir, **overrides)
    return family.build(args)


@config_component
def llama_from_hf_config(
    config: str | PathLike | dict,
    *,
    attn_dropout: float = 0.0,
    resid_dropout: float = 0.0,
    max_seq_len: Optional[int] = None,
) -> nn.Module:
    """``from_hf_config`` for Llama configs only: any other ``model_type`` is refused.

    Raises:
        UserError: as ``from_hf_config``, or a config.json of another family.
    """
    parsed = config if isinstance(config, dict) else read_hf_config(config)
    if parsed.get("model_type") != "llama":
        where = "" if isinstance(config, dict) else f"{config_path(config)}: "
        raise UserError(f"{where}model_type={parsed.get('model_type')!r}: llama_from_hf_config reads Llama configs "
                        "only (use torchtune_ac.models.from_hf_config for any supported family)")
    return from_hf_config(config, attn_dropout=attn_dropout, resid_dropout=resid_dropout, max_seq_len=max_seq_len)


# --------------------------------------------------------------------------------------------------------------
# Names: a model's tensors as its family's adapter names them
# --------------------------------------------------------------------------------------------------------------


def _hf_tensors(model: nn.Module, family: ModelFamily) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Hugging Face name -> the model's tensor (tied aliases left out), and tied HF alias -> HF source.

    Raises:
        ValueError: a tie the family declares was broken (``to_empty`` allocates tied parameters separately).
    """
    hf = family.hf
    tensors = dict(model.state_dict(keep_vars=True))
    tied = hf.tied_parameters(family.args_of(model))
    for alias, source in tied.items():
        if tensors.get(alias) is not tensors[source]:
            raise ValueError(
                f"the model ties {alias} to {source}, but they are different tensors "
                f"(to_empty() unties them: assign the {source} parameter to {alias} again)"
            )
        del tensors[alias]
    return ({hf.to_hf_name(name): tensor for name, tensor in tensors.items()},
            {hf.to_hf_name(alias): hf.to_hf_name(source) for alias, source in tied.items()})


def stored_layout(model: nn.Module) -> StoredLayout:
    """How a Hugging Face checkpoint stores ``model``'s parameters (by Hugging Face name; a model on meta will do):
    its family's ``storage`` rules compiled against the parameters' shapes.

    Raises:
        UserError: a model of no known family.
    """
    family = require_family(model, "a Hugging Face checkpoint")
    return _stored_layout(family, _hf_tensors(model, family)[0])


def _stored_layout(family: ModelFamily, tensors: Mapping[str, torch.Tensor]) -> StoredLayout:
    return build_layout({name: tuple(t.shape) for name, t in tensors.items()}, family.hf.storage)


def stored_tensor_problems(model: nn.Module, headers: Mapping[str, StoredTensor], config: Mapping[str, Any]
                           ) -> list[str]:
    """What a checkpoint lacks or holds wrong for ``model``, from its headers alone (what loading checks first).

    Args:
        model: a model of a known family (on meta will do).
        headers: the checkpoint's tensors (``torchtune_ac.checkpoint.safetensors_io.list_stored_tensors``).
        config: its parsed config.json (``read_hf_config``), which tells the family which tensors are loaded.

    Returns:
        One line per missing tensor (or missing parts of a parameter stored in several), shape or dtype that the
        family's stored layout does not expect, and unexpected tensor, each naming its file; empty when the
        headers match the model.

    Raises:
        UserError: a model of no known family.
    """
    family = require_family(model, "a Hugging Face checkpoint")
    tensors, tied = _hf_tensors(model, family)
    found = by_stored_name(headers, lambda name: family.hf.stored_name(config, name))
    return match_stored(_stored_layout(family, tensors), found, tied)[1]


def hf_model_files(model: nn.Module, *, base_config: Optional[Mapping[str, Any]] = None,
                   **token_ids: Any) -> HFModelFiles:
    """What a Hugging Face checkpoint of ``model`` holds: its tensors by Hugging Face name, and its config.json
    (weights' dtype from the model), ready for ``torchtune_ac.checkpoint``'s writers.

    Args:
        model: a model of a known family (plain or with DTensor parameters).
        base_config: the config.json the model was loaded from (``read_hf_config``): config.json keeps every key of
            it that training did not change (``pad_token_id``, ``initializer_range``, ``use_cache``, ...).
        **token_ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` for config.json.

    Raises:
        UserError: a model of no known family.
        ValueError: its tied weights were untied.
    """
    family = require_family(model, "saving a Hugging Face checkpoint")
    tensors, _ = _hf_tensors(model, family)
    dtype = next(iter(tensors.values())).dtype
    args = family.args_of(model)
    config = family.hf.hf_config_from_args(args, dtype, base_config=base_config, **token_ids)
    return HFModelFiles(tensors, config, _stored_layout(family, tensors))


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def load_hf_weights_(model: nn.Module, checkpoint_dir: PathLike) -> None:
    """Copy the weights of a Hugging Face checkpoint into an existing model of a known family, in place.

    The model may hold plain tensors or DTensors (e.g. built on meta, ``fully_shard``-ed, then ``to_empty``):
    each process reads only the region of each tensor it holds. The checkpoint's config.json must describe the
    same model (``check_checkpoint_matches``), and every name, shape and dtype is checked from the file headers,
    and a present copy of a tied tensor compared with its source, before any data is copied. Weights are cast
    to the model's dtype.

    Args:
        model: a model of a known family (possibly sharded or with activation checkpointing; not on meta).
        checkpoint_dir: directory with config.json and model.safetensors or a sharded index.

    Raises:
        UserError: a model of no known family, missing or unreadable files, another model in config.json,
            missing / unexpected tensors, shape mismatches, a non-floating dtype, or a stored copy of a tied
            tensor that differs from its source.
        ValueError: the model is still on the meta device, or its tied weights were untied.
    """
    _load_hf_weights(model, checkpoint_dir, headers_only=False)


def check_checkpoint_tensors(model: nn.Module, checkpoint_dir: PathLike) -> None:
    """Check a Hugging Face checkpoint against ``model`` (on the meta device or not) as ``load_hf_weights_`` does
    before it copies anything: its config.json, and every name, shape and dtype from the file headers; no weight is
    read (``tune validate``).

    Raises:
        UserError: as ``load_hf_weights_``, in the same words, but for a tied copy's values, which are not read.
    """
    _load_hf_weights(model, checkpoint_dir, headers_only=True)


def _load_hf_weights(model: nn.Module, checkpoint_dir: PathLike, *, headers_only: bool) -> None:
    family = require_family(model, "a Hugging Face checkpoint (checkpoint_dir)")
    check_checkpoint_matches(model, checkpoint_dir)
    targets, tied = _hf_tensors(model, family)
    ours = {family.hf.to_hf_name(name): name for name in model.state_dict()}
    for hf_name, target in targets.items():
        if target.is_meta and not headers_only:  # a check of the headers needs no memory
            raise ValueError(f"{ours[hf_name]} is on the meta device: call model.to_empty(device=...) before loading")
    config = read_hf_config(checkpoint_dir)
    load_hf_tensors_(targets, checkpoint_dir, layout=_stored_layout(family, targets),
                     stored_name=lambda name: family.hf.stored_name(config, name), copies=tied,
                     headers_only=headers_only)


def load_hf(
    checkpoint_dir: PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build a model from a Hugging Face checkpoint directory, of whichever family its config.json names.

    The model is built on the meta device, allocated on ``device`` in ``dtype``, then filled by
    ``load_hf_weights_``, so memory is allocated once.

    Args:
        checkpoint_dir: directory with config.json and safetensors weights (single file or sharded).
        dtype: parameter dtype (weights are cast).
        device: where the parameters live.

    Returns:
        The loaded model.

    Raises:
        UserError: see ``read_hf_args`` and ``load_hf_weights_``.
    """
    family, args = read_hf_args(checkpoint_dir)
    with torch.device("meta"):
        model = family.build(args)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    retie_parameters(model)
    load_hf_weights_(model, checkpoint_dir)
    return model


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


def save_hf(
    model: nn.Module,
    out_dir: PathLike,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int | list[int]] = None,
    pad_token_id: Optional[int] = None,
    tokenizer_dir: Optional[PathLike] = None,
    base_config: Optional[Mapping[str, Any]] = None,
) -> PathLike:
    """Save a model of a known family as a Hugging Face checkpoint that ``AutoModelForCausalLM`` loads.

    Writes config.json and either ``model.safetensors`` (when everything fits in one shard) or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, into a temporary sibling
    directory that is then renamed to ``out_dir``. Activation checkpointing leaves parameter names unchanged, so
    such a model saves as is. A model sharded with FSDP2 (DTensor parameters) is saved by a collective call:
    every rank calls ``save_hf`` with the same arguments, and rank 0 writes the files, gathering one output
    shard at a time (never the whole model).

    Args:
        model: the model.
        out_dir: the checkpoint directory to create.
        max_shard_size: bytes per shard, as an int or a string like ``"5GB"`` / ``"500MiB"``.
        overwrite: replace an existing non-empty ``out_dir`` (only after the new one is complete).
        bos_token_id, eos_token_id, pad_token_id: recorded in config.json when given.
        tokenizer_dir: if given, its tokenizer files are copied in too (see ``copy_tokenizer_files``).
        base_config: the parsed config.json the model was loaded from (``read_hf_config``): config.json keeps
            every key of it that training did not change.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is not empty and ``overwrite`` is false (on every rank), a model of no known
            family, or a bad ``max_shard_size``.
    """
    files = hf_model_files(model, base_config=base_config, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id)
    return save_hf_files(files, out_dir, max_shard_size, overwrite=overwrite, tokenizer_dir=tokenizer_dir)


def save_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    args: Any,
    out_dir: PathLike,
    max_shard_size: int | str = "5GB",
    *,
    family: str = "llama",
    overwrite: bool = False,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int | list[int]] = None,
    pad_token_id: Optional[int] = None,
    tokenizer_dir: Optional[PathLike] = None,
) -> PathLike:
    """Write a Hugging Face checkpoint from a full (not sharded) state dict with our parameter names.

    Args:
        state_dict: full tensors named as in the family's model; a tied alias may be present (it is dropped).
        args: the model arguments (for config.json and the expected names and shapes).
        out_dir, max_shard_size, overwrite, bos_token_id, eos_token_id, pad_token_id, tokenizer_dir: as in
            ``save_hf``.
        family: the name of the model's family (``llama``, ...).

    Raises:
        UserError: as ``save_hf``, or an unknown family.
        ValueError: the state dict does not match ``args``, or holds DTensors.

    Returns:
        ``out_dir`` as a Path.
    """
    spec = next((f for f in FAMILIES if f.name == family), None)
    if spec is None:
        raise UserError(f"family={family!r}: not a known model family ({', '.join(f.name for f in FAMILIES)})")
    with torch.device("meta"):
        reference = spec.build(args)
    aliases = set(spec.hf.tied_parameters(args))
    layout = {name: tensor.shape for name, tensor in reference.state_dict().items() if name not in aliases}
    names = state_dict.keys() - (aliases - layout.keys())
    missing, unexpected = layout.keys() - names, names - layout.keys()
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    for name, shape in layout.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{name} has shape {list(state_dict[name].shape)}, expected {list(shape)}")
    check_full_tensors({name: state_dict[name] for name in layout})
    tensors = {spec.hf.to_hf_name(name): state_dict[name].detach().to("cpu").contiguous() for name in layout}
    config = spec.hf.hf_config_from_args(
        args, next(iter(tensors.values())).dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    files = HFModelFiles(tensors, config, _stored_layout(spec, tensors))
    return save_hf_files(files, out_dir, max_shard_size, overwrite=overwrite, tokenizer_dir=tokenizer_dir)
