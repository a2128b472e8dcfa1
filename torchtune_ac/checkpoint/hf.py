"""Hugging Face checkpoints <-> models of any known family: reading config.json, loading weights in place
(each rank reads only its own region), and saving (one output shard at a time for a sharded model).

Everything family-specific goes through the model's ``ModelFamily`` (``torchtune_ac/models/family.py``): its
adapter names the tensors and translates config.json; nothing here reads a model's attributes.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ac.checkpoint.files import (
    is_writer_rank,
    process_group_active,
    read_json,
    require_directory,
    write_directory,
    write_json,
)
from torchtune_ac.checkpoint.safetensors_io import (
    StoredTensor,
    list_stored_tensors,
    local_region,
    open_safetensors,
    parse_shard_size,
    plan_shards,
    read_region,
    write_safetensors,
)
from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.models.families import FAMILIES, family_for_hf_config, require_family, retie_parameters
from torchtune_ac.models.family import ModelFamily, architecture_mismatches

PathLike = str | os.PathLike

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------


def config_path(checkpoint_dir: PathLike) -> Path:
    """The config.json of a checkpoint directory (or ``checkpoint_dir`` itself when it is a file).

    Raises:
        UnavailableError: the directory or its config.json is missing.
    """
    path = Path(checkpoint_dir)
    if path.is_file():
        return path
    path = require_directory(path, "checkpoint directory") / CONFIG_FILE
    if not path.is_file():
        raise UnavailableError(f"{path}: missing (every Hugging Face checkpoint directory has a config.json)")
    return path


def read_hf_config(checkpoint_dir: PathLike) -> dict:
    """Read a Hugging Face ``config.json``.

    Args:
        checkpoint_dir: a checkpoint directory, or the path of the config.json itself.

    Returns:
        The parsed JSON object.

    Raises:
        UserError: the directory or config.json is missing, or config.json is not a JSON object.
    """
    path = config_path(checkpoint_dir)
    config = read_json(path)
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def read_hf_args(checkpoint_dir: PathLike, **overrides: Any) -> tuple[ModelFamily, Any]:
    """The family and model arguments a checkpoint's config.json describes (errors name the file).

    Args:
        checkpoint_dir: a checkpoint directory, or the path of the config.json itself.
        **overrides: argument fields to set instead of what the config says (e.g. ``attn_dropout``).

    Raises:
        UserError: as ``read_hf_config``, an unsupported ``model_type`` (listing the supported ones), or a
            config the family's adapter refuses.
    """
    config = read_hf_config(checkpoint_dir)
    try:
        family = family_for_hf_config(config)
        return family, family.hf.args_from_hf_config(config, **overrides)
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
    theirs_family, theirs = read_hf_args(checkpoint_dir)
    path = config_path(checkpoint_dir)
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
    checkpoint_dir: Optional[str | os.PathLike | dict] = None,
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
        family = family_for_hf_config(checkpoint_dir)
        args = family.hf.args_from_hf_config(checkpoint_dir, **overrides)
    else:
        family, args = read_hf_args(checkpoint_dir, **overrides)
    return family.build(args)


@config_component
def llama_from_hf_config(
    config: str | os.PathLike | dict,
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
# Loading
# --------------------------------------------------------------------------------------------------------------


def _hf_targets(model: nn.Module, family: ModelFamily) -> tuple[dict[str, str], dict[str, torch.Tensor], dict[str, str]]:
    """Hugging Face name -> our name, our name -> tensor (tied aliases removed), and tied HF alias -> HF source.

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
    names = {hf.to_hf_name(name): name for name in tensors}
    tied_hf = {hf.to_hf_name(alias): hf.to_hf_name(source) for alias, source in tied.items()}
    return names, tensors, tied_hf


@torch.no_grad()
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
    family = require_family(model, "a Hugging Face checkpoint (checkpoint_dir)")
    checkpoint_dir = require_directory(checkpoint_dir, "checkpoint directory")
    check_checkpoint_matches(model, checkpoint_dir)
    expected, targets, tied_hf = _hf_targets(model, family)
    for name, target in targets.items():
        if target.is_meta:
            raise ValueError(f"{name} is on the meta device: call model.to_empty(device=...) before loading")

    stored = list_stored_tensors(checkpoint_dir)
    problems = []
    for hf_name, name in expected.items():
        if hf_name not in stored:
            problems.append(f"missing tensor {hf_name}")
            continue
        found, want = stored[hf_name], tuple(targets[name].shape)
        if found.shape != want:
            problems.append(f"{found.file.name}: {hf_name} has shape {list(found.shape)}, expected {list(want)}")
        if not found.is_floating:
            problems.append(f"{found.file.name}: {hf_name} has dtype {found.dtype}, expected a floating point type")
    for hf_name in sorted(stored.keys() - expected.keys() - tied_hf.keys()):
        if not family.hf.is_derived_hf_tensor(hf_name):
            problems.append(f"{stored[hf_name].file.name}: unexpected tensor {hf_name}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{checkpoint_dir}: " + "; ".join(problems[:5]) + more)
    for alias, source in tied_hf.items():
        if alias in stored:
            _check_tied_copy_equal(stored[alias], alias, stored[source], source, targets[expected[source]])

    by_file: dict[Path, list[str]] = {}
    for hf_name in expected:
        by_file.setdefault(stored[hf_name].file, []).append(hf_name)
    for path, hf_names in by_file.items():
        with open_safetensors(path) as f:
            for hf_name in hf_names:
                local, region = local_region(targets[expected[hf_name]])
                if local.numel():
                    local.copy_(read_region(f, hf_name, region))


def _check_tied_copy_equal(
    copy: StoredTensor, copy_name: str, source: StoredTensor, source_name: str, target: torch.Tensor
) -> None:
    """A tied checkpoint may still carry the alias (``lm_head.weight``); accept it only if it is the source."""
    if copy.shape != source.shape:
        raise UserError(
            f"{copy.file}: {copy_name} has shape {list(copy.shape)}, but it is tied to {source_name} of shape "
            f"{list(source.shape)}"
        )
    _, region = local_region(target)
    with open_safetensors(copy.file) as f_copy, open_safetensors(source.file) as f_source:
        if not torch.equal(read_region(f_copy, copy_name, region), read_region(f_source, source_name, region)):
            raise UserError(f"{copy.file}: {copy_name} differs from {source_name}, but the model ties them")


def load_hf(checkpoint_dir: PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
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


def _check_names_and_shapes(state_dict: dict[str, torch.Tensor], layout: dict[str, torch.Size],
                            aliases: set[str]) -> None:
    """Names and (global) shapes of ``state_dict`` match ``layout`` (a tied alias may be present)."""
    names = state_dict.keys() - (aliases - layout.keys())
    missing, unexpected = layout.keys() - names, names - layout.keys()
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    for name, shape in layout.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{name} has shape {list(state_dict[name].shape)}, expected {list(shape)}")


def write_hf_files(
    model: nn.Module,
    out_dir: Path,
    max_shard_size: int | str = "5GB",
    *,
    tokenizer_dir: Optional[PathLike] = None,
    chat_template: Optional[str] = None,
    base_config: Optional[Mapping[str, Any]] = None,
    **token_ids: Any,
) -> None:
    """Write a model's Hugging Face files (config.json, safetensors, tokenizer files) into an existing directory.

    A model sharded with FSDP2 makes this a collective call: every rank calls it, each output shard's tensors
    are gathered (``full_tensor``), and rank 0 alone moves them to CPU, writes them and drops them before the
    next shard is gathered, so it holds at most one shard (``max_shard_size``, or one tensor larger than that)
    of full tensors, and every rank one full tensor on its device. A plain model is written by the caller.

    Args:
        model: a model of a known family (plain or with DTensor parameters).
        out_dir: an existing, empty directory (the temporary one of ``write_directory``).
        max_shard_size: bytes per safetensors file, as an int or a string like ``"5GB"`` / ``"500MiB"``.
        tokenizer_dir: if given, its tokenizer files are copied in too (see ``copy_tokenizer_files``).
        chat_template: the chat template the tokenizer was used with, saved with its files.
        base_config: the config.json the model was loaded from, whose other keys config.json keeps (see the
            adapter's ``hf_config_from_args``).
        **token_ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` for config.json.

    Raises:
        UserError: a model of no known family, or a bad ``max_shard_size``.
    """
    family = require_family(model, "saving a Hugging Face checkpoint")
    max_bytes = parse_shard_size(max_shard_size)
    names, tensors, _ = _hf_targets(model, family)
    sharded = any(isinstance(t, DTensor) for t in tensors.values())
    if sharded and not process_group_active():
        raise ValueError("the model holds DTensors but no process group is initialised")
    writer = not sharded or is_writer_rank()
    nbytes = {hf_name: math.prod(tensors[name].shape) * tensors[name].dtype.itemsize for hf_name, name in names.items()}

    def fetch(hf_names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for hf_name in hf_names:
            tensor = tensors[names[hf_name]].detach()
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if writer:
                out[hf_name] = full.to("cpu").contiguous()
        return out

    shards = plan_shards(nbytes, max_bytes)
    if not writer:
        for shard in shards:
            fetch(shard)  # take part in rank 0's gathers, one shard at a time
        return
    fetched, gather_failed = 0, False

    def fetch_counted(hf_names: list[str]) -> dict[str, torch.Tensor]:
        nonlocal fetched, gather_failed
        try:
            out = fetch(hf_names)
        except BaseException:
            gather_failed = True
            raise
        fetched += 1
        return out

    try:
        dtype = tensors[next(iter(tensors))].dtype
        write_json(out_dir / CONFIG_FILE,
                   family.hf.hf_config_from_args(family.args_of(model), dtype, base_config=base_config, **token_ids))
        write_safetensors(out_dir, nbytes, max_bytes, fetch_counted)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, out_dir, chat_template=chat_template)
    except Exception:
        # A write failed (a full disk): still take part in the gathers the other ranks are waiting in, then raise.
        if sharded and not gather_failed:
            for shard in shards[fetched:]:
                fetch(shard)
        raise


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
) -> Path:
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
            every key of it that the model does not define (``initializer_range``, ``use_cache``, ...).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is not empty and ``overwrite`` is false (on every rank), a model of no known
            family, or a bad ``max_shard_size``.
    """
    parse_shard_size(max_shard_size)  # refuse a bad size before anything is created
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    token_ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return write_directory(
        out_dir,
        lambda tmp: write_hf_files(model, tmp, max_shard_size, tokenizer_dir=tokenizer_dir, base_config=base_config,
                                   **token_ids),
        overwrite=overwrite,
        collective=sharded,
    )


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
) -> Path:
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
    """
    spec = next((f for f in FAMILIES if f.name == family), None)
    if spec is None:
        raise UserError(f"family={family!r}: not a known model family ({', '.join(f.name for f in FAMILIES)})")
    with torch.device("meta"):
        reference = spec.build(args)
    names, layout_tensors, _ = _hf_targets(reference, spec)
    layout = {name: tensor.shape for name, tensor in layout_tensors.items()}
    _check_names_and_shapes(state_dict, layout, set(spec.hf.tied_parameters(args)))
    for name in layout:
        if isinstance(state_dict[name], DTensor):
            raise ValueError(f"{name} is a DTensor: save the model with save_hf on every rank")
    tensors = {hf_name: state_dict[name].detach().to("cpu").contiguous() for hf_name, name in names.items()}
    config = spec.hf.hf_config_from_args(
        args, next(iter(tensors.values())).dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    nbytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    max_bytes = parse_shard_size(max_shard_size)

    def write(tmp: Path) -> None:
        write_json(tmp / CONFIG_FILE, config)
        write_safetensors(tmp, nbytes, max_bytes, lambda hf_names: {n: tensors[n] for n in hf_names})
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)

    return write_directory(out_dir, write, overwrite=overwrite)


def copy_tokenizer_files(src_dir: PathLike, dst_dir: PathLike, *, chat_template: Optional[str] = None) -> list[Path]:
    """Copy the tokenizer and generation files that exist in ``src_dir`` (see ``TOKENIZER_FILES``).

    Args:
        src_dir: e.g. the checkpoint a fine-tune started from.
        dst_dir: an existing directory.
        chat_template: the chat template the run used: unless the copied files already give it, it is written to
            ``chat_template.jinja`` (which transformers reads before ``tokenizer_config.json``), and a different
            ``chat_template`` in the copied ``tokenizer_config.json`` is removed, so ``apply_chat_template`` on
            the saved tokenizer renders what the model was trained on.

    Returns:
        The copied (and written) files, in ``dst_dir``.

    Raises:
        UserError: ``src_dir`` is not a directory.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not src.is_dir():
        raise UserError(f"tokenizer directory {src} does not exist or is not a directory")
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(dst / name)
    if chat_template is not None and _saved_chat_template(dst) != chat_template:
        (dst / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        if dst / CHAT_TEMPLATE_FILE not in copied:
            copied.append(dst / CHAT_TEMPLATE_FILE)
        config_path = dst / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else None
        if isinstance(config, dict) and "chat_template" in config:
            del config["chat_template"]
            write_json(config_path, config)
    return copied


def _saved_chat_template(folder: Path) -> Optional[str]:
    """The chat template transformers would read from ``folder``: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or the ``default`` of a list of named ones)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None
