"""Hugging Face checkpoint files: reading config.json, loading named tensors in place (each rank reads only its
own region), and writing a checkpoint (one output shard at a time for a sharded model).

Everything here is in Hugging Face tensor names and knows no model family: ``torchtune_ac.models`` translates a
model's names and config.json through its family's adapter and calls these functions (``load_hf``, ``save_hf``).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch.distributed.tensor import DTensor

from torchtune_ac.checkpoint.files import (
    PathLike,
    leads,
    read_json,
    require_directory,
    write_directory,
    write_json,
)
from torchtune_ac.checkpoint.mxfp4 import dequantize_mxfp4, dequantized_shape
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
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.runtime.distributed import DistributedContext, process_group_context

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TensorPart(Protocol):
    """A stored tensor that is one region of a larger tensor of the model: ``whole[region]``, without the dims in
    ``squeezed`` (each of size 1 in the region). One expert's ``gate_proj.weight`` of a layer's stacked experts is
    the part ``(experts.gate_up_proj, (e:e+1, 0:h, :), (0,))``. (``models.hf_adapter.StoredPart`` is one.)"""

    whole: str
    region: tuple[slice, ...]
    squeezed: tuple[int, ...]


class QuantizedPart(Protocol):
    """A stored tensor that is half of an MXFP4 weight (``checkpoint/mxfp4.py``): its ``role``, ``blocks`` or
    ``scales``, of the tensor ``whole``. (``models.hf_adapter.QuantizedPart`` is one.)"""

    whole: str
    role: str


def _part_shape(part: TensorPart) -> tuple[int, ...]:
    return tuple(r.stop - r.start for d, r in enumerate(part.region) if d not in part.squeezed)


@dataclass(frozen=True)
class HFModelFiles:
    """What a Hugging Face checkpoint of a model holds, before it is written.

    ``torchtune_ac.models.hf_model_files(model)`` makes one through the model's family; make it when saving (it
    holds the model's parameters, which ``to_empty`` replaces).

    Attributes:
        tensors: Hugging Face tensor name -> the tensor (plain, or a DTensor of a sharded model), one per stored
            tensor or part of one.
        config: the config.json to write.
        stacked: a stored tensor that is several of ``tensors`` stacked along dim 0 (Phi-3's ``qkv_proj``) -> their
            names, in order; those are stored only as part of it.
        parts: stored name -> the region of one of ``tensors`` it holds (a ``TensorPart``): a tensor with parts is
            written as its parts, in their order, not whole.
    """

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def stored_parts(self) -> dict[str, tuple[str, ...]]:
        """Each tensor to store -> the names of ``tensors`` it is made of, in the order of ``tensors``.

        Raises:
            ValueError: a stacked tensor names a part ``tensors`` lacks.
        """
        for name, parts in self.stacked.items():
            missing = [part for part in parts if part not in self.tensors]
            if missing:
                raise ValueError(f"{name} stacks {missing}, which are not among the tensors")
        part_of = {part: name for name, parts in self.stacked.items() for part in parts}
        layout: dict[str, tuple[str, ...]] = {}
        for name in self.tensors:
            stored = part_of.get(name)
            if stored is None:
                layout[name] = (name,)
            elif stored not in layout:
                layout[stored] = tuple(self.stacked[stored])
        return layout
    parts: Mapping[str, TensorPart] = dataclasses.field(default_factory=dict)


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


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def load_hf_tensors_(
    targets: Mapping[str, torch.Tensor],
    checkpoint_dir: PathLike,
    *,
    stored_name: Callable[[str], "Optional[str | TensorPart | QuantizedPart]"],
    copies: Mapping[str, str],
    stacked: Mapping[str, tuple[str, ...]] = {},
    headers_only: bool = False,
) -> None:
    """Copy the tensors of a Hugging Face checkpoint into ``targets``, in place, each cast to its target's dtype.

    Targets may be plain tensors or DTensors (a model built on meta, ``fully_shard``-ed, then ``to_empty``): each
    process reads only the region of each tensor it holds. Every name, shape and dtype is checked from the file
    headers, and a stored copy compared with its source, before any data is copied.

    Args:
        targets: Hugging Face tensor name -> the tensor to fill (not on meta).
        checkpoint_dir: directory with model.safetensors or a sharded index.
        stored_name: a name found in the files -> the target name it fills, or the ``TensorPart`` of a target it
            fills (one expert of stacked experts: the parts of a target must cover it exactly), or the
            ``QuantizedPart`` of a target stored in MXFP4 (dequantised exactly); None for a tensor not loaded
            (derived, or of another model in the same files).
        copies: target names that are the same tensor as another (a tied ``lm_head.weight`` -> the embedding):
            a checkpoint may store them, and then they must equal their source; they are not loaded.
        stacked: a stored tensor holding several targets stacked along dim 0 (Phi-3's ``qkv_proj``) -> their names,
            in order: each fills its target from its own rows.
        headers_only: stop after the checks of the file headers, reading no weight (``tune validate``; targets may
            be on the meta device, and a stored copy is not compared).

    Raises:
        UserError: missing or unreadable files, missing or unexpected tensors, shape mismatches, a non-floating
            dtype, or a stored copy that differs from its source (naming the file and tensor).
    """
    checkpoint_dir = require_directory(checkpoint_dir, "checkpoint directory")
    stored: dict[str, StoredTensor] = {}  # target name -> what the files hold for it
    stored_as: dict[str, str] = {}  # target name -> its name in the files
    first_row: dict[str, int] = {}  # target name -> its first row in a stacked tensor
    whole_shape: dict[str, tuple[int, ...]] = {}  # target name -> the shape of what holds it
    for name, parts in stacked.items():
        row = 0
        for part in parts:
            first_row[part], row = row, row + targets[part].shape[0]
        for part in parts:
            whole_shape[part] = (row, *targets[part].shape[1:])
    unexpected = []
    parts: dict[str, list[tuple[TensorPart, str, StoredTensor]]] = {}  # target name -> its stored parts
    quantized: dict[str, dict[str, tuple[str, StoredTensor]]] = {}  # target name -> role -> its stored half
    for file_name, tensor in sorted(list_stored_tensors(checkpoint_dir).items()):
        name = stored_name(file_name)
        if name is None:
            continue
        if hasattr(name, "role"):
            if name.whole in targets:
                quantized.setdefault(name.whole, {})[name.role] = (file_name, tensor)
            else:
                unexpected.append(f"{tensor.file.name}: unexpected tensor {file_name}")
            continue
        if not isinstance(name, str):
            if name.whole in targets:
                parts.setdefault(name.whole, []).append((name, file_name, tensor))
            else:
                unexpected.append(f"{tensor.file.name}: unexpected tensor {file_name}")
            continue
        holds = stacked.get(name, (name,))
        # A part of a stacked tensor is read from it only (a q_proj stored on its own is not Phi-3's layout).
        if name not in first_row and all(held in targets or held in copies for held in holds):
            for held in holds:
                stored[held], stored_as[held] = tensor, file_name
        else:
            unexpected.append(f"{tensor.file.name}: unexpected tensor {file_name}")
    problems = []
    for name, target in targets.items():
        if name in quantized and name not in stored:
            problems += _quantized_problems(name, tuple(target.shape), quantized[name])
            continue
        if name in parts and name not in stored:
            problems += _part_problems(name, tuple(target.shape), parts[name])
            continue
        if name not in stored:
            problem = f"missing tensor {next((s for s, holds in stacked.items() if name in holds), name)}"
        else:
            found, want = stored[name], whole_shape.get(name, tuple(target.shape))
            problem = None
            if found.shape != want:
                problem = f"{found.file.name}: {stored_as[name]} has shape {list(found.shape)}, expected {list(want)}"
            elif not found.is_floating:
                problem = (f"{found.file.name}: {stored_as[name]} has dtype {found.dtype}, expected a floating point "
                           "type")
        if problem is not None and problem not in problems:  # once for a stacked tensor, not once per part
            problems.append(problem)
    problems += unexpected
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{checkpoint_dir}: " + "; ".join(problems[:5]) + more)
    if headers_only:
        return
    for alias, source in copies.items():
        if alias in stored:
            _check_copy_equal(stored[alias], stored_as[alias], stored[source], stored_as[source], targets[source])

    for name, halves in quantized.items():
        if name not in stored:
            _copy_quantized(*local_region(targets[name]), halves)
    for name, found in parts.items():
        if name in stored:
            continue
        local, region = local_region(targets[name])
        for part, file_name, tensor in found:
            _copy_part(local, region, part, file_name, tensor)
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        if name in stored:
            by_file.setdefault(stored[name].file, []).append(name)
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            for name in names:
                local, region = local_region(targets[name])
                if name in first_row:  # its rows of the stacked tensor
                    rows = region[0]
                    region = (slice(rows.start + first_row[name], rows.stop + first_row[name]), *region[1:])
                if local.numel():
                    local.copy_(read_region(f, stored_as[name], region))


def _part_problems(name: str, shape: tuple[int, ...], found: list[tuple[TensorPart, str, StoredTensor]]) -> list[str]:
    """What is wrong with the stored parts of target ``name``: a shape that is not its region's, a non-floating
    dtype, a region stored twice or outside the target, or regions that do not cover it."""
    problems, regions, covered = [], set(), 0
    for part, file_name, tensor in found:
        want = _part_shape(part)
        if tensor.shape != want:
            problems.append(f"{tensor.file.name}: {file_name} has shape {list(tensor.shape)}, expected {list(want)}")
        if not tensor.is_floating:
            problems.append(f"{tensor.file.name}: {file_name} has dtype {tensor.dtype}, expected a floating point type")
        key = tuple((r.start, r.stop) for r in part.region)
        if key in regions or any(r.stop > n for r, n in zip(part.region, shape)):
            problems.append(f"{tensor.file.name}: {file_name} overlaps another part of {name} or lies outside it")
        regions.add(key)
        covered += math.prod(r.stop - r.start for r in part.region)
    if not problems and covered != math.prod(shape):
        problems.append(f"missing parts of {name} (the stored ones cover {covered} of its {math.prod(shape)} entries)")
    return problems


def _quantized_problems(name: str, shape: tuple[int, ...], halves: Mapping[str, tuple[str, StoredTensor]]) -> list[str]:
    """What is wrong with an MXFP4 target's stored blocks and scales (missing, of other shapes or dtypes)."""
    missing = [role for role in ("blocks", "scales") if role not in halves]
    if missing:
        return [f"missing tensor {name}_{missing[0]} (MXFP4 weights need their blocks and scales)"]
    (blocks_name, blocks), (scales_name, scales) = halves["blocks"], halves["scales"]
    problems = [f"{t.file.name}: {n} has dtype {t.dtype}, expected U8 (MXFP4)"
                for n, t in ((blocks_name, blocks), (scales_name, scales)) if t.dtype != "U8"]
    if len(blocks.shape) != 4 or blocks.shape[3] != 16 or scales.shape != blocks.shape[:3]:
        problems.append(f"{blocks.file.name}: {blocks_name} {list(blocks.shape)} and {scales_name} "
                        f"{list(scales.shape)} are not MXFP4 blocks [E, rows, groups, 16] and scales [E, rows, groups]")
    elif dequantized_shape(blocks.shape) != shape:
        problems.append(f"{blocks.file.name}: {blocks_name} holds a weight of shape "
                        f"{list(dequantized_shape(blocks.shape))}, expected {list(shape)}")
    return problems


def _copy_quantized(local: torch.Tensor, region: tuple[slice, ...], halves: Mapping[str, tuple[str, StoredTensor]]
                    ) -> None:
    """Dequantise what of an MXFP4 weight lies in this process's ``region`` (``[E, cols, rows]``) into ``local``."""
    if not local.numel():
        return
    experts, cols, rows = region
    (blocks_name, blocks), (scales_name, scales) = halves["blocks"], halves["scales"]
    with open_safetensors(blocks.file) as f:
        block_values = read_region(f, blocks_name, (experts, rows, slice(None), slice(None)))
    with open_safetensors(scales.file) as f:
        scale_values = read_region(f, scales_name, (experts, rows, slice(None)))
    local.copy_(dequantize_mxfp4(block_values, scale_values)[:, cols])


def _copy_part(local: torch.Tensor, region: tuple[slice, ...], part: TensorPart, file_name: str,
               tensor: StoredTensor) -> None:
    """Copy what of a stored part lies in this process's ``region`` of the target into ``local``."""
    overlap = [slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(part.region, region)]
    if any(o.start >= o.stop for o in overlap):
        return
    into_local = tuple(slice(o.start - r.start, o.stop - r.start) for o, r in zip(overlap, region))
    from_part = tuple(slice(o.start - p.start, o.stop - p.start)
                      for d, (o, p) in enumerate(zip(overlap, part.region)) if d not in part.squeezed)
    with open_safetensors(tensor.file) as f:
        values = read_region(f, file_name, from_part)
    local[into_local].copy_(values.reshape(local[into_local].shape))


def _check_copy_equal(
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


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


def write_hf_files(
    files: HFModelFiles,
    out_dir: Path,
    max_shard_size: int | str = "5GB",
    *,
    tokenizer_dir: Optional[PathLike] = None,
    chat_template: Optional[str] = None,
    processes: Optional[DistributedContext] = None,
) -> None:
    """Write a model's Hugging Face files (config.json, safetensors, tokenizer files) into an existing directory.

    DTensors among ``files.tensors`` (a model sharded with FSDP2) make this a collective call: every rank of
    ``processes`` calls it, each output shard's tensors are gathered (``full_tensor``), and rank 0 alone moves them
    to CPU, writes
    them and drops them before the next shard is gathered, so it holds at most one shard (``max_shard_size``, or
    one tensor larger than that) of full tensors, and every rank one full tensor on its device. Plain tensors are
    written by the caller.

    Args:
        files: the tensors and config.json (``torchtune_ac.models.hf_model_files``).
        out_dir: an existing, empty directory (the temporary one of ``write_directory``).
        max_shard_size: bytes per safetensors file, as an int or a string like ``"5GB"`` / ``"500MiB"``.
        tokenizer_dir: if given, its tokenizer files are copied in too (see ``copy_tokenizer_files``).
        chat_template: the chat template the tokenizer was used with, saved with its files.
        processes: the processes the model is sharded over (None: this process alone, plain tensors).

    Raises:
        UserError: a bad ``max_shard_size``.
        ValueError: DTensors but no ``processes``.
    """
    max_bytes = parse_shard_size(max_shard_size)
    tensors = files.tensors
    sharded = any(isinstance(t, DTensor) for t in tensors.values())
    if sharded and processes is None:
        raise ValueError("the model holds DTensors: every rank writes its files together (pass processes)")
    writer = not sharded or leads(processes)
    layout = files.stored_parts()  # stored name -> the tensors it stacks (itself alone, most often)
    parts_of: dict[str, list[str]] = {}  # a tensor written as its parts (one expert's projection each)
    for part_name, part in files.parts.items():
        parts_of.setdefault(part.whole, []).append(part_name)
    nbytes: dict[str, int] = {}
    for stored, holds in layout.items():
        if len(holds) == 1 and holds[0] in parts_of:
            itemsize = tensors[holds[0]].dtype.itemsize
            for part_name in parts_of[holds[0]]:
                nbytes[part_name] = math.prod(_part_shape(files.parts[part_name])) * itemsize
        else:
            nbytes[stored] = sum(math.prod(tensors[held].shape) * tensors[held].dtype.itemsize for held in holds)
    gathered: dict[str, torch.Tensor] = {}  # the one whole tensor whose parts are being written

    def full_tensor(name: str) -> torch.Tensor:
        tensor = tensors[name].detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            part = files.parts.get(name)
            if part is not None:
                # A whole's parts are consecutive: it is gathered once, for its first part.
                if part.whole not in gathered:
                    gathered.clear()
                    gathered[part.whole] = full_tensor(part.whole)
                full = gathered[part.whole][part.region].reshape(_part_shape(part)).clone()  # its own storage
                if writer:
                    out[name] = full.to("cpu").contiguous()
                continue
            stacked = []  # each stacked tensor gathered, and moved to the host, in turn
            for held in layout[name]:
                full = full_tensor(held)
                if writer:
                    stacked.append(full.to("cpu"))
            if writer:
                out[name] = (stacked[0] if len(stacked) == 1 else torch.cat(stacked)).contiguous()
        return out

    shards = plan_shards(nbytes, max_bytes)
    if not writer:
        for shard in shards:
            fetch(shard)  # take part in rank 0's gathers, one shard at a time
        return
    fetched, gather_failed = 0, False

    def fetch_counted(names: list[str]) -> dict[str, torch.Tensor]:
        nonlocal fetched, gather_failed
        try:
            out = fetch(names)
        except BaseException:
            gather_failed = True
            raise
        fetched += 1
        return out

    try:
        write_json(out_dir / CONFIG_FILE, dict(files.config))
        write_safetensors(out_dir, nbytes, max_bytes, fetch_counted)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, out_dir, chat_template=chat_template)
    except Exception:
        # A write failed (a full disk): still take part in the gathers the other ranks are waiting in, then raise.
        if sharded and not gather_failed:
            for shard in shards[fetched:]:
                fetch(shard)
        raise


def check_full_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse DTensors where full tensors are expected (a state dict saved by one process).

    Raises:
        ValueError: naming the first DTensor.
    """
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            raise ValueError(f"{name} is a DTensor: save the model with save_hf on every rank")


def save_hf_files(
    files: HFModelFiles,
    out_dir: PathLike,
    max_shard_size: int | str = "5GB",
    *,
    overwrite: bool = False,
    tokenizer_dir: Optional[PathLike] = None,
) -> Path:
    """Save ``files`` as a Hugging Face checkpoint directory (see ``write_hf_files``).

    Writes config.json and either ``model.safetensors`` (when everything fits in one shard) or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, into a temporary sibling
    directory that is then renamed to ``out_dir``. With DTensors every rank calls this with the same arguments.

    Args:
        files: the tensors and config.json.
        out_dir: the checkpoint directory to create.
        max_shard_size: bytes per shard, as an int or a string like ``"5GB"`` / ``"500MiB"``.
        overwrite: replace an existing non-empty ``out_dir`` (only after the new one is complete).
        tokenizer_dir: if given, its tokenizer files are copied in too (see ``copy_tokenizer_files``).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` is not empty and ``overwrite`` is false (on every rank), or a bad
            ``max_shard_size``.
    """
    parse_shard_size(max_shard_size)  # refuse a bad size before anything is created
    sharded = any(isinstance(t, DTensor) for t in files.tensors.values())
    # A sharded model is saved outside a run by every process it is sharded over: the default process group's.
    processes = process_group_context() if sharded else None
    return write_directory(
        out_dir,
        lambda tmp: write_hf_files(files, tmp, max_shard_size, tokenizer_dir=tokenizer_dir, processes=processes),
        overwrite=overwrite,
        processes=processes,
    )


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
