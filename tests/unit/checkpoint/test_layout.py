"""The stored-layout map (``checkpoint/layout.py``): what each rule compiles to, how headers are matched against it,
and every family's map against the headers of what it writes (what ``tune validate`` can check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtune_ac.checkpoint.layout import (
    EACH,
    Encoded,
    Piece,
    Split,
    Stacked,
    StoredTensor,
    build_layout,
    match_stored,
)
from torchtune_ac.checkpoint.mxfp4 import MXFP4
from torchtune_ac.models import FAMILIES, stored_layout, stored_tensor_problems

FILE = Path("model.safetensors")
QKV = Stacked("attn.qkv.weight", ("attn.q.weight", "attn.k.weight", "attn.v.weight"))
EXPERTS = Split("experts.gate_up", "experts.{0}.{1}.weight", (EACH, ("gate", "up")), whole_too=True)
SHAPES = {"l.0.attn.q.weight": (4, 3), "l.0.attn.k.weight": (2, 3), "l.0.attn.v.weight": (2, 3),
          "l.0.experts.gate_up": (2, 6, 3), "l.0.norm.weight": (3,)}
LAYOUT = build_layout(SHAPES, (QKV, EXPERTS))


def headers(shapes, dtype="F32"):
    return {name: StoredTensor(FILE, name, tuple(shape), dtype) for name, shape in shapes.items()}


def test_each_rule_compiles_to_pieces_of_stored_tensors():
    assert LAYOUT.ways["l.0.attn.k.weight"] == ((Piece("l.0.attn.k.weight", (slice(0, 2), slice(0, 3)),
                                                       "l.0.attn.qkv.weight", (4, 0)),),)
    split, whole = LAYOUT.ways["l.0.experts.gate_up"]
    assert split[3] == Piece("l.0.experts.gate_up", (slice(1, 2), slice(3, 6), slice(0, 3)), "l.0.experts.1.up.weight",
                             (0, 0), (0,))
    assert [p.stored for p in whole] == ["l.0.experts.gate_up"]
    assert LAYOUT.ways["l.0.norm.weight"][0][0].stored == "l.0.norm.weight"
    assert LAYOUT.stored_shapes["l.0.attn.qkv.weight"] == (8, 3)
    assert LAYOUT.stored_shapes["l.0.experts.0.gate.weight"] == (3, 3)
    # Written in the parameters' order, the stacked tensor at its first part's place.
    assert list(LAYOUT.written()) == ["l.0.attn.qkv.weight", "l.0.experts.0.gate.weight", "l.0.experts.0.up.weight",
                                      "l.0.experts.1.gate.weight", "l.0.experts.1.up.weight", "l.0.norm.weight"]
    encoded = build_layout({"e.w": (2, 64, 3)}, (Encoded("e.w", MXFP4),))
    assert [p.sources for way in encoded.ways["e.w"] for p in way] == [("e.w",), ("e.w_blocks", "e.w_scales")]


@pytest.mark.parametrize("rules, message", [
    ((QKV, QKV), "named by two storage rules"),
    ((Stacked("attn.qkv.weight", ("attn.q.weight", "attn.z.weight")),), "stacks l.0.attn.z.weight"),
    ((Split("experts.gate_up", "x{0}{1}", (EACH, ("a", "b", "c", "d"))),), "cannot be cut in 4 equal parts"),
    ((Stacked("qk", ("attn.q.weight", "experts.gate_up")),), "do not tile one tensor"),
])
def test_a_rule_that_does_not_fit_the_shapes_is_refused(rules, message):
    with pytest.raises(ValueError, match=message):
        build_layout(SHAPES, rules)


WRITTEN = {name: LAYOUT.stored_shapes[name] for name in LAYOUT.written()}
FUSED = {**{k: v for k, v in WRITTEN.items() if ".experts." not in k}, "l.0.experts.gate_up": (2, 6, 3)}


@pytest.mark.parametrize("stored, expected", [
    (WRITTEN, []),
    (FUSED, []),  # the other way of reading the experts
    ({k: v for k, v in WRITTEN.items() if k != "l.0.attn.qkv.weight"}, ["missing tensor l.0.attn.qkv.weight"]),
    ({k: v for k, v in WRITTEN.items() if k != "l.0.experts.1.up.weight"},
     ["missing parts of l.0.experts.gate_up: l.0.experts.1.up.weight"]),
    ({**WRITTEN, "l.0.attn.qkv.weight": (6, 3)},
     ["model.safetensors: l.0.attn.qkv.weight has shape [6, 3], expected [8, 3]"]),
    ({**WRITTEN, "l.0.attn.q.weight": (4, 3)}, ["model.safetensors: unexpected tensor l.0.attn.q.weight"]),
    ({**WRITTEN, "l.0.experts.gate_up": (2, 6, 3)}, ["model.safetensors: unexpected tensor l.0.experts.gate_up"]),
])
def test_headers_are_matched_against_the_map(stored, expected):
    chosen, problems = match_stored(LAYOUT, headers(stored))
    assert problems == expected
    if not problems:
        assert chosen.keys() == LAYOUT.ways.keys()


def test_a_non_floating_tensor_and_bad_mxfp4_halves_are_named():
    assert match_stored(LAYOUT, headers(WRITTEN, "I64"))[1][0] == (
        "model.safetensors: l.0.attn.qkv.weight has dtype I64, expected a floating point type")
    encoded = build_layout({"e.w": (2, 64, 3)}, (Encoded("e.w", MXFP4),))
    found = {"e.w_blocks": StoredTensor(FILE, "e.w_blocks", (2, 3, 2, 16), "U8"),
             "e.w_scales": StoredTensor(FILE, "e.w_scales", (2, 3, 2), "U8")}
    assert match_stored(encoded, found)[1] == []
    found["e.w_scales"] = StoredTensor(FILE, "e.w_scales", (2, 3, 2), "F32")
    assert match_stored(encoded, found)[1] == ["model.safetensors: e.w_scales has dtype F32, expected U8 (MXFP4)"]
    del found["e.w_scales"]
    assert match_stored(encoded, found)[1] == ["missing tensor e.w_scales"]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_s_map_accepts_the_headers_it_writes_and_names_what_is_missing(family):
    # Its tiny model where it has one (Qwen3-MoE's: the 30B's 18,432 expert tensors take seconds to match).
    builder = next((b for name, b in family.builders.items() if "tiny" in name), next(iter(family.builders.values())))
    with torch.device("meta"):
        model = builder()
    layout = stored_layout(model)
    written = {name: layout.stored_shapes[name] for name in layout.written()}
    config = family.hf.hf_config_from_args(family.args_of(model), torch.bfloat16)
    assert stored_tensor_problems(model, headers(written, "BF16"), config) == []
    last = list(written)[-1]
    del written[last]
    assert stored_tensor_problems(model, headers(written, "BF16"), config) == [f"missing tensor {last}"]
