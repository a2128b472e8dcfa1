"""How a checkpoint stores a model's parameters: one map from regions of stored tensors to regions of parameters,
which the reader and the writer of ``checkpoint/hf.py`` each walk, and ``match_stored`` checks against headers.

Pure: no files, no collectives. A family's adapter declares, as data, what is not stored whole under its own name:
``Stacked`` (several parameters in one stored tensor: Phi-3's ``qkv_proj``), ``Split`` (one parameter stored as
several tensors: one expert's projection each) and ``Encoded`` (a parameter the files may hold encoded, read
through a ``Decoder``: MXFP4). ``build_layout`` compiles the declaration against the parameters' shapes into
``Piece``s: ``target[region]`` is stored at ``at`` of ``stored``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Protocol, Sequence, Union

import torch

Region = tuple[slice, ...]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a checkpoint as its header describes it: its file, its name there, shape and dtype."""

    file: Path
    name: str
    shape: Shape
    dtype: str  # safetensors dtype code, e.g. "BF16"

    @property
    def is_floating(self) -> bool:
        return self.dtype == "BF16" or self.dtype.startswith("F")


class Decoder(Protocol):
    """A stored tensor the files hold encoded, in tensors of their own (its sources); decoded on read, never
    written (``checkpoint/mxfp4.py``'s ``MXFP4`` is one)."""

    name: str

    def sources(self, stored: str) -> tuple[str, ...]:
        """The names, in the files, of the tensors that hold ``stored``."""

    def decoded_shape(self, sources: Sequence[StoredTensor]) -> tuple[Optional[Shape], list[str]]:
        """The shape the sources (their headers, in ``sources``' order) decode to, or what is wrong with them."""

    def read(self, stored: str, region: Region, read: Callable[[str, Region], torch.Tensor]) -> torch.Tensor:
        """``region`` of the decoded tensor, reading regions of its sources with ``read(name, region)``."""


@dataclass(frozen=True)
class Piece:
    """``target[region]`` is stored at ``at`` (its first index in each stored dim) of the tensor ``stored``, without
    the dims of ``target`` in ``squeezed`` (each of size 1 in ``region``); read through ``decoder`` if any."""

    target: str
    region: Region
    stored: str
    at: tuple[int, ...]
    squeezed: tuple[int, ...] = ()
    decoder: Optional[Decoder] = None

    @property
    def shape(self) -> Shape:
        """The piece's shape in the stored tensor."""
        return tuple(r.stop - r.start for d, r in enumerate(self.region) if d not in self.squeezed)

    @property
    def sources(self) -> tuple[str, ...]:
        """The tensors of the files it is read from."""
        return (self.stored,) if self.decoder is None else self.decoder.sources(self.stored)

    def stored_region(self, region: Region) -> Region:
        """Where ``region`` of the target (within ``self.region``) lies in the stored tensor."""
        kept = [(r, own) for d, (r, own) in enumerate(zip(region, self.region)) if d not in self.squeezed]
        return tuple(slice(r.start - own.start + a, r.stop - own.start + a) for (r, own), a in zip(kept, self.at))


Way = tuple[Piece, ...]  # the pieces one parameter is stored as, covering it exactly


def _whole(target: str, shape: Shape, decoder: Optional[Decoder] = None) -> Way:
    return (Piece(target, tuple(slice(0, n) for n in shape), target, (0,) * len(shape), decoder=decoder),)


def _matches(shapes: Mapping[str, Shape], suffix: str) -> list[tuple[str, str]]:
    """(prefix, parameter) of each parameter named ``prefix + suffix`` (``suffix`` whole name components)."""
    return [(name[:len(name) - len(suffix)], name) for name in shapes
            if name == suffix or name.endswith("." + suffix)]


@dataclass(frozen=True)
class Stacked:
    """Parameters stored one after the other along ``dim`` as one tensor, and read and written only so (Phi-3's
    ``self_attn.qkv_proj.weight``: the rows of q, then k, then v). Names end Hugging Face names: the rule applies
    wherever ``parts[0]`` does (in every block)."""

    stored: str
    parts: tuple[str, ...]
    dim: int = 0

    def ways(self, shapes: Mapping[str, Shape]) -> dict[str, tuple[Way, ...]]:
        out = {}
        for prefix, _ in _matches(shapes, self.parts[0]):
            offset = 0
            for part in self.parts:
                name = prefix + part
                if name not in shapes:
                    raise ValueError(f"{prefix + self.stored} stacks {name}, which is not a parameter")
                shape = shapes[name]
                at = tuple(offset if d == self.dim else 0 for d in range(len(shape)))
                out[name] = ((Piece(name, tuple(slice(0, n) for n in shape), prefix + self.stored, at),),)
                offset += shape[self.dim]
        return out


EACH = None  # a ``Split`` cut: one stored tensor per index of the dim, which they do not have


@dataclass(frozen=True)
class Split:
    """A parameter stored as several tensors, and written so: cut along its dims 0, 1, ... by ``cuts``, each
    ``EACH`` (one tensor per index) or names (that many equal parts), the piece of indices ``(i, j, ...)`` named
    ``stored.format(i or its name, j or its name, ...)``. With ``whole_too``, the parameter stored whole under its own
    name is read too (Qwen3-MoE's fused experts, beside the published one tensor per expert and projection)."""

    param: str
    stored: str
    cuts: tuple[Optional[tuple[str, ...]], ...]
    whole_too: bool = False

    def ways(self, shapes: Mapping[str, Shape]) -> dict[str, tuple[Way, ...]]:
        out = {}
        for prefix, name in _matches(shapes, self.param):
            shape = shapes[name]
            axes = []  # per cut dim: (label, slice) of each piece
            for dim, cut in enumerate(self.cuts):
                n = shape[dim] if cut is EACH else len(cut)
                if shape[dim] % n:
                    raise ValueError(f"{name} {list(shape)}: dim {dim} cannot be cut in {n} equal parts")
                size = shape[dim] // n
                axes.append([(i if cut is EACH else cut[i], slice(i * size, (i + 1) * size)) for i in range(n)])
            squeezed = tuple(d for d, cut in enumerate(self.cuts) if cut is EACH)
            rest = tuple(slice(0, n) for n in shape[len(self.cuts):])
            split = tuple(
                Piece(name, (*(s for _, s in cell), *rest), prefix + self.stored.format(*(label for label, _ in cell)),
                      (0,) * (len(shape) - len(squeezed)), squeezed)
                for cell in itertools.product(*axes))
            out[name] = (split, _whole(name, shape)) if self.whole_too else (split,)
        return out


@dataclass(frozen=True)
class Encoded:
    """A parameter written whole, and read whole or, where the files hold it so, through ``decoder`` (gpt-oss's
    experts in MXFP4)."""

    param: str
    decoder: Decoder

    def ways(self, shapes: Mapping[str, Shape]) -> dict[str, tuple[Way, ...]]:
        return {name: (_whole(name, shapes[name]), _whole(name, shapes[name], self.decoder))
                for _, name in _matches(shapes, self.param)}


StorageRule = Union[Stacked, Split, Encoded]


@dataclass(frozen=True)
class StoredLayout:
    """How a checkpoint stores a model: each parameter (by Hugging Face name, in the model's order) -> its ways of
    being stored, the first the one written; ``stored_shapes``: each stored tensor's shape."""

    ways: Mapping[str, tuple[Way, ...]]
    stored_shapes: Mapping[str, Shape]

    def written(self) -> dict[str, Way]:
        """Each stored tensor written, in the order of the parameters (a stacked one at its first part's place) ->
        its pieces."""
        out: dict[str, list[Piece]] = {}
        for ways in self.ways.values():
            for piece in ways[0]:
                out.setdefault(piece.stored, []).append(piece)
        return {name: tuple(pieces) for name, pieces in out.items()}


def build_layout(shapes: Mapping[str, Shape], rules: Iterable[StorageRule] = ()) -> StoredLayout:
    """The stored layout of parameters of ``shapes`` (Hugging Face name -> shape) under a family's ``rules``; a
    parameter no rule names is stored whole under its own name.

    Raises:
        ValueError: a parameter named by two rules, a rule that does not fit the shapes, or a stored tensor its
            pieces do not tile.
    """
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    declared: dict[str, tuple[Way, ...]] = {}
    for rule in rules:
        for name, ways in rule.ways(shapes).items():
            if name in declared:
                raise ValueError(f"{name} is named by two storage rules")
            declared[name] = ways
    ways = {name: declared.get(name) or (_whole(name, shape),) for name, shape in shapes.items()}
    tiles: dict[tuple[str, bool], list[Piece]] = {}
    for name, options in ways.items():
        if any(piece.decoder is not None for piece in options[0]):
            raise ValueError(f"{name}: a way read through a decoder cannot be the one written")
        for piece in (p for way in options for p in way):
            tiles.setdefault((piece.stored, piece.decoder is None), []).append(piece)
    stored_shapes: dict[str, Shape] = {}
    for (stored, _), pieces in tiles.items():
        shape = tuple(max(p.at[d] + p.shape[d] for p in pieces) for d in range(len(pieces[0].shape)))
        if sum(math.prod(p.shape) for p in pieces) != math.prod(shape) or stored_shapes.get(stored, shape) != shape:
            raise ValueError(f"{stored}: its pieces do not tile one tensor")
        stored_shapes[stored] = shape
    return StoredLayout(ways, stored_shapes)


def by_stored_name(headers: Mapping[str, StoredTensor], stored_name: Callable[[str], Optional[str]]
                   ) -> dict[str, StoredTensor]:
    """A checkpoint's headers by the names a layout gives its stored tensors (``stored_name``: a name in the files
    -> that name, or None for a tensor not loaded: derived, or of another model in the same files)."""
    out = {}
    for name, tensor in sorted(headers.items()):
        stored = stored_name(name)
        if stored is not None:
            out[stored] = tensor
    return out


def match_stored(layout: StoredLayout, found: Mapping[str, StoredTensor], copies: Iterable[str] = ()
                 ) -> tuple[dict[str, Way], list[str]]:
    """Which way each parameter is stored in a checkpoint, from its headers, and what is wrong with it.

    A parameter is read the first of its ways whose tensors the files hold (some of them: the others are then
    missing). Every other tensor is unexpected, but for ``copies`` (tied aliases the caller compares).

    Args:
        layout: the model's stored layout.
        found: the checkpoint's headers, by stored name (``by_stored_name``).
        copies: stored names that may be present besides the layout's (a tied ``lm_head.weight``).

    Returns:
        Parameter -> the way it is read (parameters with a problem left out), and one line per problem: a missing
        tensor (or the missing parts of a parameter stored in several), a shape or dtype the layout does not
        expect, an unexpected tensor; each naming the file and tensor.
    """
    chosen, problems, checked, used = {}, [], set(), set(copies)
    for target, ways in layout.ways.items():
        way = next((w for w in ways if any(s in found for p in w for s in p.sources)), None)
        used.update(s for p in (way or ()) for s in p.sources)
        missing = [s for p in (way or ways[0]) for s in p.sources if s not in found]
        if missing and way is not None and len({p.stored for p in way}) > 1:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            problems.append(f"missing parts of {target}: {', '.join(missing[:3])}{more}")
            continue
        if missing:
            problems.append(f"missing tensor {missing[0]}")
            continue
        chosen[target] = way
        for piece in way:
            if (piece.stored, piece.decoder is None) not in checked:
                checked.add((piece.stored, piece.decoder is None))
                problems += _stored_problems(piece, layout.stored_shapes[piece.stored], found)
    problems += [f"{t.file.name}: unexpected tensor {t.name}" for name, t in found.items() if name not in used]
    return chosen, list(dict.fromkeys(problems))  # a stacked tensor's problem once, not once per part


def _stored_problems(piece: Piece, want: Shape, found: Mapping[str, StoredTensor]) -> list[str]:
    """What is wrong with the stored tensor ``piece`` is read from: its shape (decoded), its dtype."""
    sources = [found[name] for name in piece.sources]
    if piece.decoder is not None:
        shape, problems = piece.decoder.decoded_shape(sources)
        if problems or shape == want:
            return problems
        return [f"{sources[0].file.name}: {', '.join(t.name for t in sources)} ({piece.decoder.name}) hold a tensor "
                f"of shape {list(shape)}, expected {list(want)}"]
    (tensor,) = sources
    if tensor.shape != want:
        return [f"{tensor.file.name}: {tensor.name} has shape {list(tensor.shape)}, expected {list(want)}"]
    if not tensor.is_floating:
        return [f"{tensor.file.name}: {tensor.name} has dtype {tensor.dtype}, expected a floating point type"]
    return []
