"""Hugging Face checkpoint files: reading config.json, loading named tensors in place (each rank reads only its
own region), and writing a checkpoint (one output shard at a time for a sharded model).

Everything here is in Hugging Face tensor names and knows no model family: how parameters are stored (whole,
stacked, in parts, encoded) comes in as a ``StoredLayout`` (``checkpoint/layout.py``), which the reader and the
writer each walk; ``torchtune_ac.models`` builds it through the model's family and calls these functions
(``load_hf``, ``save_hf``).
"""

from __future__ import annotations

import itertools
import math
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

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
from torchtune_ac.checkpoint.layout import (
    Piece,
    Region,
    StoredLayout,
    StoredTensor,
    by_stored_name,
    match_stored,
)
from torchtune_ac.checkpoint.safetensors_io import (
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
# With a vision-language model's processor files (its image processor, and the processor's own settings).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "preprocessor_config.json", "processor_config.json", "chat_template.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class HFModelFiles:
    """What a Hugging Face checkpoint of a model holds, before it is written.

    ``torchtune_ac.models.hf_model_files(model)`` makes one through the model's family; make it when saving (it
    holds the model's parameters, which ``to_empty`` replaces).

    Attributes:
        tensors: Hugging Face name -> the parameter (plain, or a DTensor of a sharded model).
        config: the config.json to write.
        layout: how the parameters are stored (``checkpoint/layout.py``): each stored tensor is written from the
            pieces of the parameters its first way names.
    """

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]
    layout: StoredLayout


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
    layout: StoredLayout,
    stored_name: Callable[[str], Optional[str]],
    copies: Mapping[str, str],
    headers_only: bool = False,
) -> None:
    """Copy the tensors of a Hugging Face checkpoint into ``targets``, in place, each cast to its target's dtype.

    Targets may be plain tensors or DTensors (a model built on meta, ``fully_shard``-ed, then ``to_empty``): each
    process reads only the region of each stored tensor that holds its own region of each target. Every name, shape
    and dtype is checked from the file headers against ``layout`` (``match_stored``), and a stored copy compared
    with its source, before any data is copied.

    Args:
        targets: Hugging Face tensor name -> the tensor to fill (not on meta).
        checkpoint_dir: directory with model.safetensors or a sharded index.
        layout: how the targets are stored (``checkpoint/layout.py``), the same names as ``targets``.
        stored_name: a name found in the files -> the name ``layout`` gives it; None for a tensor not loaded
            (derived, or of another model in the same files).
        copies: target names that are the same tensor as another (a tied ``lm_head.weight`` -> the embedding):
            a checkpoint may store them, and then they must equal their source; they are not loaded.
        headers_only: stop after the checks of the file headers, reading no weight (``tune validate``; targets may
            be on the meta device, and a stored copy is not compared).

    Raises:
        UserError: missing or unreadable files, missing or unexpected tensors, shape mismatches, a non-floating
            dtype, or a stored copy that differs from its source (naming the file and tensor).
        ValueError: ``layout`` is of other tensors than ``targets``.
    """
    checkpoint_dir = require_directory(checkpoint_dir, "checkpoint directory")
    if layout.ways.keys() != targets.keys():
        raise ValueError(f"the layout is of other tensors than the targets: {sorted(layout.ways.keys() ^ targets)}")
    found = by_stored_name(list_stored_tensors(checkpoint_dir), stored_name)
    chosen, problems = match_stored(layout, found, copies)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{checkpoint_dir}: " + "; ".join(problems[:5]) + more)
    if headers_only:
        return
    for alias, source in copies.items():
        if alias in found:
            (piece,) = chosen[source]  # a tied parameter is stored whole
            _check_copy_equal(found[alias], found[piece.stored], targets[source])
    _read_pieces(targets, chosen, found)


def _read_pieces(targets: Mapping[str, torch.Tensor], chosen: Mapping[str, tuple[Piece, ...]],
                 found: Mapping[str, StoredTensor]) -> None:
    """Copy each target's pieces into it (this process's region of it), one file open at a time (and the other
    sources of a decoded piece)."""
    regions = {target: local_region(targets[target]) for target in chosen}
    pieces = sorted(((str(found[p.sources[0]].file), target, p) for target, way in chosen.items() for p in way),
                    key=lambda item: item[0])
    for _, group in itertools.groupby(pieces, key=lambda item: item[0]):
        with ExitStack() as files:
            read = _reader(found, files)
            for _, target, piece in group:
                _copy_piece(*regions[target], piece, read)


def _reader(found: Mapping[str, StoredTensor], files: ExitStack) -> Callable[[str, Region], torch.Tensor]:
    """``read(name, region)``: a region of stored tensor ``name``, its file opened once, kept open in ``files``."""
    opened: dict[Path, Any] = {}

    def read(name: str, region: Region) -> torch.Tensor:
        tensor = found[name]
        if tensor.file not in opened:
            opened[tensor.file] = files.enter_context(open_safetensors(tensor.file))
        return read_region(opened[tensor.file], tensor.name, region)

    return read


def _copy_piece(local: torch.Tensor, region: Region, piece: Piece,
                read: Callable[[str, Region], torch.Tensor]) -> None:
    """Copy what of ``piece`` lies in this process's ``region`` of its target into ``local`` (that region)."""
    overlap = tuple(slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(piece.region, region))
    if any(o.start >= o.stop for o in overlap):
        return
    into_local = tuple(slice(o.start - r.start, o.stop - r.start) for o, r in zip(overlap, region))
    stored_region = piece.stored_region(overlap)
    values = read(piece.stored, stored_region) if piece.decoder is None else piece.decoder.read(
        piece.stored, stored_region, read)
    local[into_local].copy_(values.reshape(local[into_local].shape))


def _check_copy_equal(copy: StoredTensor, source: StoredTensor, target: torch.Tensor) -> None:
    """A tied checkpoint may still carry the alias (``lm_head.weight``); accept it only if it is the source (stored
    whole: a tied parameter is)."""
    if copy.shape != source.shape:
        raise UserError(
            f"{copy.file}: {copy.name} has shape {list(copy.shape)}, but it is tied to {source.name} of shape "
            f"{list(source.shape)}"
        )
    _, region = local_region(target)
    with open_safetensors(copy.file) as f_copy, open_safetensors(source.file) as f_source:
        if not torch.equal(read_region(f_copy, copy.name, region), read_region(f_source, source.name, region)):
            raise UserError(f"{copy.file}: {copy.name} differs from {source.name}, but the model ties them")


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
    to CPU, writes them and drops them before the next shard is gathered, so it holds at most one shard
    (``max_shard_size``, or one tensor larger than that) of full tensors, and every rank one full parameter on its
    device. Each stored tensor is made from the pieces ``files.layout`` writes it from. Plain tensors are written by
    the caller.

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
    sharded = any(isinstance(t, DTensor) for t in files.tensors.values())
    if sharded and processes is None:
        raise ValueError("the model holds DTensors: every rank writes its files together (pass processes)")
    writer = not sharded or leads(processes)
    written = files.layout.written()  # stored name -> its pieces
    nbytes = {stored: math.prod(files.layout.stored_shapes[stored]) * files.tensors[pieces[0].target].dtype.itemsize
              for stored, pieces in written.items()}
    fetch = _stored_tensors(files.tensors, written, files.layout.stored_shapes, writer)
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


def _stored_tensors(
    tensors: Mapping[str, torch.Tensor], written: Mapping[str, tuple[Piece, ...]],
    shapes: Mapping[str, tuple[int, ...]], writer: bool,
) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """``fetch(names)``: the stored tensors ``names``, on the host, made from the pieces of the parameters (each
    gathered, when a DTensor, once for its consecutive pieces: one full parameter held at a time); on a rank that
    does not write, only the gathers, and nothing returned."""
    gathered: dict[str, torch.Tensor] = {}  # the parameter whose pieces are being written

    def full(name: str) -> torch.Tensor:
        if name not in gathered:
            gathered.clear()
            tensor = tensors[name].detach()
            gathered[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return gathered[name]

    def make(stored: str) -> Optional[torch.Tensor]:
        pieces = written[stored]
        if len(pieces) == 1 and pieces[0].shape == shapes[stored] == tuple(tensors[pieces[0].target].shape):
            whole = full(pieces[0].target)  # stored as itself: no copy on a host
            return whole.to("cpu").contiguous() if writer else None
        out = torch.empty(shapes[stored], dtype=tensors[pieces[0].target].dtype) if writer else None
        for piece in pieces:
            values = full(piece.target)[piece.region]
            if out is not None:
                out[piece.stored_region(piece.region)] = values.reshape(piece.shape)
        return out

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        made = {name: make(name) for name in names}
        return made if writer else {}

    return fetch


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
