"""Hugging Face Llama checkpoints <-> torchtune_ac models: config translation, loading and atomic saving.

Only safetensors files are read (never pickles). Loading checks every tensor name, shape and dtype from the
file headers before any data is copied, so a bad checkpoint fails before the model is touched. Parameters
that are sharded DTensors (FSDP2) are filled by reading only the rows each rank owns; saving such a model
gathers one output shard at a time, so no rank ever holds the whole model.

Our names map to Hugging Face names one prefix away::

    tok_embeddings.weight              model.embed_tokens.weight
    layers.{i}.attn_norm.weight        model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{q,k,v,o}_proj.*   model.layers.{i}.self_attn.{q,k,v,o}_proj.*
    layers.{i}.mlp_norm.weight         model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.*                   model.layers.{i}.mlp.*
    norm.weight                        model.norm.weight
    output.weight                      lm_head.weight   (absent when embeddings are tied)
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtune_ac.errors import UserError
from torchtune_ac.models.llama import Llama, LlamaArgs, RopeScaling

PathLike = str | os.PathLike

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Order matters only for readability: no prefix here is a prefix of another.
_BLOCK_PREFIXES = (
    ("attn_norm.", "input_layernorm."),
    ("attn.", "self_attn."),
    ("mlp_norm.", "post_attention_layernorm."),
    ("mlp.", "mlp."),
)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# Older Hugging Face conversions stored the rotary inverse frequencies; they are derived, not learned.
_IGNORED_HF_SUFFIX = ".rotary_emb.inv_freq"
_HF_DEFAULT_ROPE_THETA = 10000.0
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_REQUIRED = object()


# --------------------------------------------------------------------------------------------------------------
# Names and configs
# --------------------------------------------------------------------------------------------------------------


def convert_name_to_hf(name: str) -> str:
    """Translate one of our parameter names to its Hugging Face name.

    Args:
        name: e.g. ``layers.3.attn.q_proj.weight``.

    Returns:
        e.g. ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: the name is not a parameter of ``Llama``.
    """
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match:
        index, rest = match.groups()
        for ours, theirs in _BLOCK_PREFIXES:
            if rest.startswith(ours):
                return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama equivalent")


def _read_value(
    d: dict, key: str, kind: type, problems: list[str], default: Any = _REQUIRED, prefix: str = ""
) -> Any:
    """``d[key]`` checked to be of ``kind`` (ints accepted as floats); problems are appended, not raised."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            problems.append(f"{prefix}{key}: missing")
            return None
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        problems.append(f"{prefix}{key}={value!r}: must be {kind.__name__}")
        return None
    return value


def _read_rope(
    d: dict, max_position_embeddings: int | None, problems: list[str]
) -> tuple[float | None, RopeScaling | None]:
    """Rope theta and scaling from either the transformers 5 form (``rope_parameters``) or the older one
    (top-level ``rope_theta`` plus ``rope_scaling``)."""
    rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = d.get(rope_key) or {}
    if not isinstance(rope, dict):
        problems.append(f"{rope_key}={rope!r}: must be an object")
        return None, None
    theta = _read_value(rope, "rope_theta", float, problems, default=None, prefix=f"{rope_key}.")
    if theta is None:
        theta = _read_value(d, "rope_theta", float, problems, default=_HF_DEFAULT_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        problems.append(f"{rope_key}.rope_type={rope_type!r}: only 'llama3' or 'default' RoPE is supported")
        return theta, None
    prefix = f"{rope_key}."
    values = {key: _read_value(rope, key, float, problems, prefix=prefix) for key in
              ("factor", "low_freq_factor", "high_freq_factor")}
    # transformers falls back to max_position_embeddings too when this key is absent.
    original = _read_value(rope, "original_max_position_embeddings", int, problems,
                           default=max_position_embeddings, prefix=prefix)
    if None in values.values() or original is None:
        return theta, None
    return theta, RopeScaling(original_max_position_embeddings=original, **values)


def llama_args_from_hf_config(d: dict, **overrides: Any) -> LlamaArgs:
    """Translate a Hugging Face Llama ``config.json`` (as a dict) to ``LlamaArgs``.

    Reads both the transformers 5 rope form (``rope_parameters``) and the older one (``rope_theta`` and
    ``rope_scaling``). Missing optional keys take transformers' defaults.

    Args:
        d: the parsed config.json.
        **overrides: ``LlamaArgs`` fields to set instead of what the config says (e.g. ``attn_dropout``).

    Returns:
        The model arguments.

    Raises:
        UserError: listing every unsupported or invalid key (model_type other than llama, attention_bias or
            mlp_bias true, hidden_act other than silu, rope type other than llama3/default, bad values).
    """
    problems: list[str] = []
    model_type = d.get("model_type")
    if model_type != "llama":
        problems.append(f"model_type={model_type!r}: only 'llama' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            problems.append(f"{key}={d[key]!r}: projections with biases are not supported")
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        problems.append(f"hidden_act={hidden_act!r}: only 'silu' is supported")

    dim = _read_value(d, "hidden_size", int, problems)
    n_heads = _read_value(d, "num_attention_heads", int, problems)
    max_pos = _read_value(d, "max_position_embeddings", int, problems, default=2048)
    fields = dict(
        vocab_size=_read_value(d, "vocab_size", int, problems),
        dim=dim,
        n_layers=_read_value(d, "num_hidden_layers", int, problems),
        n_heads=n_heads,
        n_kv_heads=_read_value(d, "num_key_value_heads", int, problems, default=n_heads),
        intermediate_dim=_read_value(d, "intermediate_size", int, problems),
        max_seq_len=max_pos,
        norm_eps=_read_value(d, "rms_norm_eps", float, problems, default=1e-6),
        tie_embeddings=_read_value(d, "tie_word_embeddings", bool, problems, default=False),
        head_dim=_read_value(d, "head_dim", int, problems, default=None),
        attn_dropout=_read_value(d, "attention_dropout", float, problems, default=0.0),
    )
    fields["rope_theta"], fields["rope_scaling"] = _read_rope(d, max_pos, problems)
    if problems:
        raise UserError("unsupported Hugging Face Llama config: " + "; ".join(problems))
    # An explicit head_dim equal to the default is dropped so args compare equal to the builders'.
    if dim and n_heads and fields["head_dim"] == dim // n_heads and dim % n_heads == 0:
        fields["head_dim"] = None
    fields.update(overrides)
    try:
        return LlamaArgs(**fields)
    except ValueError as e:
        raise UserError(f"Hugging Face Llama config: {e}") from None


def hf_config_from_llama_args(
    args: LlamaArgs,
    dtype: torch.dtype,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict:
    """Translate ``LlamaArgs`` to a Hugging Face ``config.json`` dict that ``LlamaForCausalLM`` loads.

    Rope settings are written as top-level ``rope_theta`` plus ``rope_scaling``: the form of the published
    Llama checkpoints, read correctly by transformers 4.x and 5.x alike. ``resid_dropout`` has no
    Hugging Face equivalent and is not written.

    Args:
        args: the model arguments.
        dtype: dtype of the saved weights, recorded as ``dtype``.
        bos_token_id, eos_token_id, pad_token_id: special token ids, when known (else null).

    Returns:
        The config as a JSON-serialisable dict.
    """
    scaling = args.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": args.attn_dropout,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (expected JSON)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None


def _require_checkpoint_dir(checkpoint_dir: PathLike) -> Path:
    path = Path(checkpoint_dir)
    if not path.exists():
        raise UserError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UserError(f"checkpoint directory {path} is not a directory")
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
    path = _config_path(checkpoint_dir)
    config = _read_json(path)
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _config_path(checkpoint_dir: PathLike) -> Path:
    path = Path(checkpoint_dir)
    if path.is_file():
        return path
    path = _require_checkpoint_dir(path) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing (every Hugging Face checkpoint directory has a config.json)")
    return path


def read_llama_args(checkpoint_dir: PathLike, **overrides: Any) -> LlamaArgs:
    """``LlamaArgs`` from a Hugging Face config.json (errors name the file).

    Args:
        checkpoint_dir: a checkpoint directory, or the path of the config.json itself.
        **overrides: as in ``llama_args_from_hf_config``.

    Raises:
        UserError: as ``read_hf_config`` and ``llama_args_from_hf_config``, prefixed with the file.
    """
    config = read_hf_config(checkpoint_dir)
    try:
        return llama_args_from_hf_config(config, **overrides)
    except UserError as e:
        raise UserError(f"{_config_path(checkpoint_dir)}: {e}") from None


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StoredTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _read_headers(path: Path) -> dict[str, _StoredTensor]:
    with _open_safetensors(path) as f:
        out = {}
        for name in f.keys():
            part = f.get_slice(name)
            out[name] = _StoredTensor(path, tuple(part.get_shape()), part.get_dtype())
        return out


def _list_stored_tensors(checkpoint_dir: Path) -> dict[str, _StoredTensor]:
    """Every tensor of the checkpoint (Hugging Face name -> file, shape, dtype), from headers only."""
    single, index = checkpoint_dir / WEIGHTS_FILE, checkpoint_dir / INDEX_FILE
    # Same precedence as transformers: a single file wins over an index.
    if single.is_file():
        return _read_headers(single)
    if not index.is_file():
        pickles = sorted(p.name for p in checkpoint_dir.glob("*.bin")) + sorted(
            p.name for p in checkpoint_dir.glob("*.pt")
        )
        found = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise UserError(f"{checkpoint_dir}: no weights: expected {WEIGHTS_FILE} or {INDEX_FILE}{found}")
    weight_map = _read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    headers: dict[str, dict[str, _StoredTensor]] = {}
    for file_name in sorted(set(weight_map.values())):
        shard = checkpoint_dir / file_name
        if not shard.is_file():
            tensor = next(n for n, f in weight_map.items() if f == file_name)
            raise UserError(f"{index}: names shard {file_name} (for {tensor}), but {shard} does not exist")
        headers[file_name] = _read_headers(shard)
    stored = {}
    for name, file_name in weight_map.items():
        if name not in headers[file_name]:
            raise UserError(f"{index}: says {name} is in {file_name}, but that file has no such tensor")
        stored[name] = headers[file_name][name]
    return stored


def _is_floating(safetensors_dtype: str) -> bool:
    return safetensors_dtype == "BF16" or safetensors_dtype.startswith("F")


def local_region(target: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this process writes into and which region of the full tensor it holds.

    A DTensor (e.g. sharded by FSDP2 on dim 0) holds only its own rows; a plain tensor holds everything.
    """
    if isinstance(target, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        region = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        return target.to_local(), region
    return target, tuple(slice(0, n) for n in target.shape)


def _read_region(f, name: str, region: tuple[slice, ...]) -> torch.Tensor:
    if not region:  # a 0-d tensor cannot be sliced
        return f.get_tensor(name)
    return f.get_slice(name)[region]


def _check_config_matches(checkpoint_dir: Path, args: LlamaArgs) -> None:
    """Fail when the checkpoint's head layout, RoPE or norm settings differ from the model's: shapes would
    still match (e.g. 8 heads of 16 vs 4 heads of 32), so the weights would load and silently compute
    something else."""
    config_args = read_llama_args(checkpoint_dir)
    mismatches = []
    for field, hf_key in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                          ("resolved_head_dim", "head_dim")):
        ours, theirs = getattr(args, field), getattr(config_args, field)
        if ours != theirs:
            mismatches.append(f"{hf_key}={theirs} but the model has {field.removeprefix('resolved_')}={ours}")
    for field, hf_key in (("rope_theta", "rope_theta"), ("norm_eps", "rms_norm_eps")):
        ours, theirs = getattr(args, field), getattr(config_args, field)
        if not math.isclose(ours, theirs, rel_tol=1e-6):
            mismatches.append(f"{hf_key}={theirs} but the model has {field}={ours}")
    if args.rope_scaling != config_args.rope_scaling:
        mismatches.append(f"rope scaling {config_args.rope_scaling} but the model has {args.rope_scaling}")
    if mismatches:
        raise UserError(f"{checkpoint_dir / CONFIG_FILE}: " + "; ".join(mismatches))


@torch.no_grad()
def load_hf_weights_(model: nn.Module, checkpoint_dir: PathLike) -> None:
    """Copy the weights of a Hugging Face Llama checkpoint into an existing model, in place.

    The model may hold plain tensors or DTensors (e.g. built on meta, ``fully_shard``-ed, then
    ``to_empty``): each process reads only the region of each tensor it holds, through
    ``safe_open(...).get_slice``. Every name, shape and dtype is checked from the file headers, and a
    present ``lm_head.weight`` of a tied model is compared with the embedding, before any data is copied.
    Weights are cast to the model's dtype.

    Args:
        model: a ``Llama`` (possibly sharded or with activation checkpointing applied; not on meta).
        checkpoint_dir: directory with config.json and model.safetensors or a sharded index.

    Raises:
        UserError: missing or unreadable files, missing / unexpected tensors, shape mismatches, a
            non-floating dtype, head counts, RoPE or norm settings that differ from the model's, or an untied
            ``lm_head.weight`` in a checkpoint loaded into a model with tied embeddings.
        ValueError: the model is still on the meta device, or its tied weights were untied.
    """
    checkpoint_dir = _require_checkpoint_dir(checkpoint_dir)
    args: LlamaArgs = model.args
    _check_config_matches(checkpoint_dir, args)
    targets = dict(model.state_dict(keep_vars=True))
    if args.tie_embeddings:
        if targets.get("output.weight") is not targets["tok_embeddings.weight"]:
            raise ValueError(
                "the model has tie_embeddings=True but output.weight is not tok_embeddings.weight "
                "(to_empty() unties them: assign model.output.weight = model.tok_embeddings.weight)"
            )
        del targets["output.weight"]
    for name, target in targets.items():
        if target.is_meta:
            raise ValueError(f"{name} is on the meta device: call model.to_empty(device=...) before loading")
    expected = {convert_name_to_hf(name): name for name in targets}

    stored = _list_stored_tensors(checkpoint_dir)
    problems = []
    for hf_name, name in expected.items():
        if hf_name not in stored:
            problems.append(f"missing tensor {hf_name}")
            continue
        found, want = stored[hf_name], tuple(targets[name].shape)
        if found.shape != want:
            problems.append(f"{found.file.name}: {hf_name} has shape {list(found.shape)}, expected {list(want)}")
        if not _is_floating(found.dtype):
            problems.append(f"{found.file.name}: {hf_name} has dtype {found.dtype}, expected a floating point type")
    tied_head = "lm_head.weight" if args.tie_embeddings and "lm_head.weight" in stored else None
    for hf_name in sorted(stored.keys() - expected.keys() - {tied_head}):
        if not hf_name.endswith(_IGNORED_HF_SUFFIX):
            problems.append(f"{stored[hf_name].file.name}: unexpected tensor {hf_name}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{checkpoint_dir}: " + "; ".join(problems[:5]) + more)

    if tied_head is not None:
        _check_tied_head_equal(stored, targets["tok_embeddings.weight"])

    by_file: dict[Path, list[str]] = {}
    for hf_name in expected:
        by_file.setdefault(stored[hf_name].file, []).append(hf_name)
    for path, hf_names in by_file.items():
        with _open_safetensors(path) as f:
            for hf_name in hf_names:
                local, region = local_region(targets[expected[hf_name]])
                if local.numel():
                    local.copy_(_read_region(f, hf_name, region))


def _check_tied_head_equal(stored: dict[str, _StoredTensor], embedding: torch.Tensor) -> None:
    """A tied checkpoint may still carry ``lm_head.weight``; accept it only if it is the embedding."""
    _, region = local_region(embedding)
    head, embed = stored["lm_head.weight"], stored["model.embed_tokens.weight"]
    if head.shape != embed.shape:
        raise UserError(
            f"{head.file}: lm_head.weight has shape {list(head.shape)}, but embeddings are tied "
            f"(tie_word_embeddings) to model.embed_tokens.weight of shape {list(embed.shape)}"
        )
    with _open_safetensors(head.file) as f_head, _open_safetensors(embed.file) as f_embed:
        if not torch.equal(_read_region(f_head, "lm_head.weight", region),
                           _read_region(f_embed, "model.embed_tokens.weight", region)):
            raise UserError(
                f"{head.file}: lm_head.weight differs from model.embed_tokens.weight, but the model "
                "ties embeddings (tie_word_embeddings=true)"
            )


def load_hf(
    checkpoint_dir: PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Llama:
    """Build a ``Llama`` from a Hugging Face checkpoint directory.

    The model is built on the meta device, allocated on ``device`` in ``dtype``, then filled by
    ``load_hf_weights_``, so memory is allocated once.

    Args:
        checkpoint_dir: directory with config.json and safetensors weights (single file or sharded).
        dtype: parameter dtype (weights are cast).
        device: where the parameters live.

    Returns:
        The loaded model.

    Raises:
        UserError: see ``read_hf_config``, ``llama_args_from_hf_config`` and ``load_hf_weights_``.
    """
    args = read_llama_args(checkpoint_dir)
    with torch.device("meta"):
        model = Llama(args)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if args.tie_embeddings:
        # to_empty() gives every module its own new tensor, which would untie the output layer.
        model.output.weight = model.tok_embeddings.weight
    load_hf_weights_(model, checkpoint_dir)
    return model


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


def parse_shard_size(size: int | str) -> int:
    """Bytes from ``5000000``, ``"5GB"`` (10**9) or ``"500MiB"`` (2**20), as transformers reads them, except
    that units are case-insensitive: ``"5Gb"`` is 5 GB here, where transformers reads a lowercase b as bits.

    Raises:
        UserError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
        unit = (match.group(2) or "").upper() if match else None
        value = int(float(match.group(1)) * _SIZE_UNITS[unit]) if match else 0
    if value <= 0:
        raise UserError(
            f"max_shard_size={size!r}: expected a positive number of bytes or a size like '5GB' or '500MiB'"
        )
    return value


def _hf_layout(args: LlamaArgs) -> dict[str, torch.Size]:
    """Our parameter names -> full shapes, in model order, without ``output.weight`` when it is tied."""
    with torch.device("meta"):
        reference = Llama(args).state_dict()
    if args.tie_embeddings:
        reference.pop("output.weight")
    return {name: ref.shape for name, ref in reference.items()}


def _check_against_layout(state_dict: dict[str, torch.Tensor], layout: dict[str, torch.Size]) -> None:
    """Names and (global) shapes of ``state_dict`` match the model's (a tied ``output.weight`` may be present)."""
    names = state_dict.keys() - ({"output.weight"} - layout.keys())
    missing, unexpected = layout.keys() - names, names - layout.keys()
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    for name, shape in layout.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{name} has shape {list(state_dict[name].shape)}, expected {list(shape)}")


def _hf_tensors_from_state_dict(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face names, in model order, as contiguous CPU tensors."""
    layout = _hf_layout(args)
    _check_against_layout(state_dict, layout)
    out = {}
    for name in layout:
        tensor = state_dict[name]
        if isinstance(tensor, DTensor):
            raise ValueError(f"{name} is a DTensor: save the model with save_hf on every rank")
        out[convert_name_to_hf(name)] = tensor.detach().to("cpu").contiguous()
    return out


def _plan_shards(nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own (as transformers does)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in nbytes.items():
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _finish_files(root: Path) -> None:
    """Give files the usual permissions and flush them before the directory is renamed into place.

    safetensors creates its files readable by their owner only (0600) whatever the umask; a checkpoint
    should be as readable as any other file the user writes. Flushing means a crash cannot leave a
    complete-looking checkpoint whose files are empty.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in root.iterdir():
        os.chmod(path, 0o666 & ~umask)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _out_dir_problem(out_dir: Path, overwrite: bool) -> str | None:
    """Why a checkpoint may not be written to ``out_dir``, or None."""
    if out_dir.exists():
        if not out_dir.is_dir():
            return f"{out_dir}: exists and is not a directory"
        if not overwrite and any(out_dir.iterdir()):
            return f"{out_dir}: directory is not empty (choose another directory or overwrite it)"
    return None


def _write_dir_atomically(out_dir: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a fresh sibling directory, then rename it to ``out_dir``.

    A non-empty ``out_dir`` is replaced only if ``overwrite``, and only once the new one is complete.
    """
    problem = _out_dir_problem(out_dir, overwrite)
    if problem:
        raise UserError(problem)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the renames below stay on one file system and are atomic.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        write(tmp)
        _finish_files(tmp)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex}"
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except BaseException:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    args: LlamaArgs,
    out_dir: PathLike,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    tokenizer_dir: PathLike | None = None,
) -> Path:
    """Write a Hugging Face Llama checkpoint from a full state dict with our parameter names.

    Writes config.json and either ``model.safetensors`` (when everything fits in one shard) or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, all into a temporary
    sibling directory that is then renamed to ``out_dir``.

    Args:
        state_dict: full (not sharded) tensors named as in ``Llama``; ``output.weight`` is dropped when tied.
        args: the model arguments (for config.json).
        out_dir: the checkpoint directory to create.
        max_shard_size: bytes per shard, as an int or a string like ``"5GB"`` / ``"500MiB"``.
        overwrite: replace an existing non-empty ``out_dir`` (only after the new one is complete).
        bos_token_id, eos_token_id, pad_token_id: recorded in config.json when given.
        tokenizer_dir: if given, its tokenizer files are copied in too (see ``copy_tokenizer_files``).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is not empty and ``overwrite`` is false, or a bad ``max_shard_size``.
        ValueError: the state dict does not match ``args``, or holds DTensors.
    """
    out_dir = Path(out_dir)
    max_bytes = parse_shard_size(max_shard_size)
    tensors = _hf_tensors_from_state_dict(state_dict, args)
    config = hf_config_from_llama_args(
        args,
        tensors["model.embed_tokens.weight"].dtype,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    nbytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    return _write_hf_checkpoint(
        out_dir, overwrite, config, nbytes, max_bytes, lambda names: {n: tensors[n] for n in names}, tokenizer_dir
    )


def _write_hf_checkpoint(
    out_dir: Path,
    overwrite: bool,
    config: dict[str, Any],
    nbytes: dict[str, int],
    max_bytes: int,
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    tokenizer_dir: PathLike | None,
) -> Path:
    """Write config.json and the weights (``nbytes``: Hugging Face name -> size, in order) atomically.

    ``fetch(names)`` returns the CPU tensors of one output shard; it is called once per shard, in order, and
    its tensors are dropped once that shard is written.
    """
    shards = _plan_shards(nbytes, max_bytes)

    def write(tmp: Path) -> None:
        _write_json(tmp / CONFIG_FILE, config)
        if len(shards) == 1:
            save_file(fetch(shards[0]), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(shards, start=1):
                file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(fetch(names), str(tmp / file_name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file_name))
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)

    return _write_dir_atomically(out_dir, overwrite, write)


def _save_hf_sharded(
    state_dict: dict[str, torch.Tensor],
    args: LlamaArgs,
    out_dir: Path,
    max_bytes: int,
    overwrite: bool,
    tokenizer_dir: PathLike | None,
    config_ids: dict[str, Any],
) -> Path:
    """``save_hf`` for a model whose parameters are DTensors: a collective call, rank 0 writes.

    Each output shard's tensors are gathered (``full_tensor``, on every rank), moved to CPU on rank 0 only,
    written, and dropped before the next shard is gathered: rank 0 holds at most one shard (``max_bytes``, or
    one tensor larger than that) of full tensors in CPU memory, and every rank one full tensor on its device.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("the model holds DTensors but no process group is initialised")
    layout = _hf_layout(args)
    _check_against_layout(state_dict, layout)
    ours = {convert_name_to_hf(name): name for name in layout}
    nbytes = {hf: math.prod(layout[name]) * state_dict[name].dtype.itemsize for hf, name in ours.items()}
    config = hf_config_from_llama_args(args, state_dict["tok_embeddings.weight"].dtype, **config_ids)
    writer = dist.get_rank() == 0
    # Every rank learns whether rank 0 may write before anyone starts gathering (else the others would wait
    # in a collective that rank 0 never joins).
    problem = [_out_dir_problem(out_dir, overwrite) if writer else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise UserError(problem[0])

    def gather(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for hf_name in names:
            tensor = state_dict[ours[hf_name]].detach()
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if writer:
                out[hf_name] = full.to("cpu").contiguous()
        return out

    if writer:
        return _write_hf_checkpoint(out_dir, overwrite, config, nbytes, max_bytes, gather, tokenizer_dir)
    for names in _plan_shards(nbytes, max_bytes):
        gather(names)
    return out_dir


def save_hf(
    model: nn.Module,
    out_dir: PathLike,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    tokenizer_dir: PathLike | None = None,
) -> Path:
    """Save a ``Llama`` as a Hugging Face checkpoint that ``AutoModelForCausalLM`` loads.

    Activation checkpointing (``setup_activation_checkpointing``) leaves parameter names unchanged, so such a
    model saves as is. A model sharded with FSDP2 (DTensor parameters) is saved by a collective call: every
    rank calls ``save_hf`` with the same arguments, and rank 0 writes the files, gathering one output shard
    at a time (at most ``max_shard_size`` of full tensors in its CPU memory, never the whole model).

    Args:
        model: the model (with ``.args``).
        out_dir, max_shard_size, overwrite, bos_token_id, eos_token_id, pad_token_id, tokenizer_dir:
            as in ``save_hf_state_dict``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: as ``save_hf_state_dict``.
    """
    state_dict = model.state_dict()
    if any(isinstance(t, DTensor) for t in state_dict.values()):
        ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
        return _save_hf_sharded(
            state_dict, model.args, Path(out_dir), parse_shard_size(max_shard_size), overwrite, tokenizer_dir, ids
        )
    return save_hf_state_dict(
        state_dict,
        model.args,
        out_dir,
        max_shard_size,
        overwrite=overwrite,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tokenizer_dir=tokenizer_dir,
    )


def copy_tokenizer_files(src_dir: PathLike, dst_dir: PathLike) -> list[Path]:
    """Copy the tokenizer and generation files that exist in ``src_dir`` (see ``TOKENIZER_FILES``).

    Args:
        src_dir: e.g. the checkpoint a fine-tune started from.
        dst_dir: an existing directory.

    Returns:
        The copied files, in ``dst_dir``.

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
    return copied
