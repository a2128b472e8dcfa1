"""Gemma 3 with images against transformers' ``Gemma3ForConditionalGeneration``: logits with no image, one and two,
and a text-only batch, through the same model; every checkpoint layout in, transformers' out; the published sizes;
the tower's share of activation checkpointing and sharding; freezing; the refusals."""

import dataclasses
import json

import pytest
import torch
from hf_families import GEMMA3_TINY, TINY_SHAPE, randomize_
from numerics import assert_close, llama_terms
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from vision_testlib import (assert_a_batch_without_images_changes_nothing, assert_the_tower_blocks_come_first,
                            frozen_names, names_under)

import torchtune_ac.models.families.gemma3_vision as gemma3_vision
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.errors import UserError
from torchtune_ac.models import (GEMMA3, GEMMA3_VISION, check_checkpoint_matches, family_for_hf_config, family_of,
                                 load_hf_weights_, save_hf)
from torchtune_ac.models.families import init_weights_
from torchtune_ac.models.vision.checks import check_model_takes_images

BOI, EOI, IMAGE = 96, 97, 98  # the tiny checkpoint's image tokens, beyond the random text tokens' range
TOKENS_PER_IMAGE = 4
SEQ_LEN = 20  # longer than the sliding layer's 6-token window
HF_CONFIG = dict(
    text_config={**TINY_SHAPE, **GEMMA3_TINY, "vocab_size": 100},
    vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "image_size": 56, "patch_size": 14, "vision_use_head": False},
    mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
)
# Published config.json files (the keys that matter; Google's vision_config leaves the rest to the defaults).
_VISION = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
           "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}
_TEXT = {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
         "sliding_window": 1024}
PUBLISHED = {
    "gemma3_4b_vision": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                         "num_attention_heads": 8, "num_key_value_heads": 4},
    "gemma3_12b_vision": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                          "num_attention_heads": 16, "num_key_value_heads": 8},
    "gemma3_27b_vision": {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                          "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                          "query_pre_attn_scalar": 168},
}
COUNTS = {"gemma3_4b_vision": 4_300_079_472, "gemma3_12b_vision": 12_187_325_040,
          "gemma3_27b_vision": 27_432_406_640}


def published(name: str) -> dict:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
            "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
            "text_config": {**_TEXT, **PUBLISHED[name]}, "vision_config": _VISION}


def _batch(rows: list[list[int]], seed: int = 0):
    """Random text tokens with images (``<boi>``, 4 image tokens, ``<eoi>``) starting at the given places."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BOI, (len(rows), SEQ_LEN), generator=g)
    for row, starts in enumerate(rows):
        for start in starts:
            tokens[row, start:start + TOKENS_PER_IMAGE + 2] = torch.tensor([BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI])
    n_images = sum(len(starts) for starts in rows)
    return tokens, torch.randn(n_images, 3, 56, 56, generator=g) if n_images else None


CASES = {
    "one_image": [[3]],
    # two images in one row (the second across the window of the sliding layer from its first tokens), none in the
    # other
    "two_images": [[1, 11], []],
    "text_only": [[], []],
}


def _terms(model) -> int:
    vision = model.args.vision
    patches = vision.patches_per_side**2
    tower = vision.depth * (6 * vision.dim + vision.intermediate_dim + patches) + 3 * 14 * 14 + 2 * vision.dim
    return llama_terms(model.args, SEQ_LEN, 0, backward=False) + tower


def _reference(seed: int) -> Gemma3ForConditionalGeneration:
    model = Gemma3ForConditionalGeneration(Gemma3Config(**HF_CONFIG, attn_implementation="eager"))
    randomize_(model, seed, norm_offset=1.0)
    return model.eval()


def load_vision(path) -> torch.nn.Module:
    """The checkpoint at ``path`` in a Gemma 3 vision model (its builder's way: arguments, then the weights)."""
    args = GEMMA3_VISION.hf.args_from_hf_config(json.loads((path / "config.json").read_text()))
    model = GEMMA3_VISION.build(args)
    load_hf_weights_(model, path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision")
    reference = _reference(seed=3)
    reference.save_pretrained(path)
    return path, reference, load_vision(path)


def _expected(reference, tokens, pixels, *, bidirectional: bool = True):
    with torch.no_grad():
        types = (tokens == IMAGE).long() if bidirectional and pixels is not None else None
        return reference(input_ids=tokens, pixel_values=pixels, token_type_ids=types).logits


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tiny, case):
    _, reference, model = tiny
    tokens, pixels = _batch(CASES[case])
    with torch.no_grad():
        # transformers adds in other orders (attention kernels, pooling): within rounding.
        assert_close(model(tokens, pixel_values=pixels), _expected(reference, tokens, pixels), terms=_terms(model),
                     what="logits")


def test_the_image_tokens_attend_to_their_whole_image(tiny):
    """The parity test can fail: with causal attention over the image tokens, the logits differ."""
    _, reference, model = tiny
    tokens, pixels = _batch(CASES["two_images"])
    with torch.no_grad():
        ours = model(tokens, pixel_values=pixels)
        causal = _expected(reference, tokens, pixels, bidirectional=False)
    assert (ours - causal).abs().max() > 1e-3


def test_packed_documents_are_the_documents_alone(tiny):
    _, _, model = tiny
    tokens, pixels = _batch([[3], [2]])
    packed = tokens.reshape(1, 2 * SEQ_LEN)
    document_ids = torch.tensor([[0] * SEQ_LEN + [1] * SEQ_LEN])
    with torch.no_grad():
        alone = model(tokens, pixel_values=pixels)
        together = model(packed, document_ids, pixel_values=pixels)
    torch.testing.assert_close(together.view(2, SEQ_LEN, -1), alone, atol=1e-5, rtol=0)


def _to_layout(path, layout: str) -> None:
    """Rename what transformers wrote (``language_model.model.``, ``vision_tower.``, ``multi_modal_projector.``) to
    Google's published names or to transformers 5's in-memory ones."""
    weights = load_file(path / "model.safetensors")
    if layout == "google":
        renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in weights.items()}
    else:
        renamed = {("model." + name if name.startswith(("vision_tower.", "multi_modal_projector.")) else
                    name.replace("language_model.model.", "model.language_model.", 1)): t
                   for name, t in weights.items()}
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["google", "transformers_5"])
def test_every_layout_loads_the_same_weights(tiny, tmp_path, layout):
    path, reference, model = tiny
    reference.save_pretrained(tmp_path)
    _to_layout(tmp_path, layout)
    other = load_vision(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name


def test_saved_checkpoints_reload_in_transformers_with_the_same_logits(tiny, tmp_path):
    path, reference, model = tiny
    save_hf(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma3", ["Gemma3ForConditionalGeneration"])
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    tokens, pixels = _batch(CASES["two_images"])
    # The same weights in the same transformers code: the same bits.
    assert torch.equal(_expected(reloaded, tokens, pixels), _expected(reference, tokens, pixels))
    again = load_vision(tmp_path / "saved")
    assert again.args == model.args


def test_the_text_family_still_builds_the_text_tower_of_a_multimodal_checkpoint(tiny):
    path, _, _ = tiny
    assert family_for_hf_config(json.loads((path / "config.json").read_text())) is GEMMA3


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builders_have_the_published_shapes_and_transformers_parameter_count(name):
    config = published(name)
    assert GEMMA3_VISION.hf.args_from_hf_config(config) == getattr(gemma3_vision, name.upper())
    with torch.device("meta"):
        ours = getattr(gemma3_vision, name)()
        theirs = Gemma3ForConditionalGeneration(Gemma3Config(**{k: v for k, v in config.items()
                                                                if k not in ("architectures", "model_type")}))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())  # a tied weight counted once on both sides
    assert count == COUNTS[name]
    assert family_of(ours) is GEMMA3_VISION


def test_the_tower_blocks_come_first_for_ac_and_sharding():
    model = gemma3_vision.gemma3_vision_tiny()
    tower = model.vision_tower
    # ac_option 3: the third of 2 tower blocks and 2 decoder blocks, decoder layer 0
    assert_the_tower_blocks_come_first(model, tower.encoder.layers,
                                       ((tower.embeddings,), (tower.post_layernorm, model.multi_modal_projector)),
                                       ac_option=3, checkpointed=(2,))


def test_a_batch_without_images_runs_the_tower_and_changes_nothing(tiny):
    assert_a_batch_without_images_changes_nothing(load_vision(tiny[0]).train(), _batch(CASES["text_only"])[0])


def test_activation_checkpointing_trains_both_towers_exactly_like_none(tiny):
    path = tiny[0]
    tokens, pixels = _batch(CASES["two_images"])
    grads = []
    for ac_mode in (None, "full"):
        model = load_vision(path).train()
        plan = setup_activation_checkpointing(model, ac_mode=ac_mode)
        assert plan.checkpointed_blocks == (() if ac_mode is None else (0, 1, 2, 3))  # 2 tower blocks, 2 decoder
        model(tokens, pixel_values=pixels).logsumexp(-1).mean().backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        # Bit for bit: AC replays the same ops in the same order in one process.
        assert grad is not None and torch.equal(grads[1][name], grad), name


def test_freezing_the_tower_and_the_projector_by_builder_keys():
    model = gemma3_vision.gemma3_vision_tiny(freeze_vision_tower=True)
    both = gemma3_vision.gemma3_vision_tiny(freeze_vision_tower=True, freeze_projector=True)
    assert frozen_names(model) == names_under(model, "vision_tower.")
    assert frozen_names(both) == names_under(both, "vision_tower.", "multi_modal_projector.")


def test_a_tower_that_does_not_match_the_checkpoint_is_refused(tiny):
    path, _, model = tiny
    args = dataclasses.replace(model.args, vision=dataclasses.replace(model.args.vision, depth=3))
    with torch.device("meta"):
        other = GEMMA3_VISION.build(args)
    with pytest.raises(UserError, match=r"vision_config.num_hidden_layers=2, model has 3"):
        check_checkpoint_matches(other, path)


@pytest.mark.parametrize("change, message", [
    ({"vision_config": None}, "vision_config: missing"),
    ({"mm_tokens_per_image": 5}, "mm_tokens_per_image=5 must be a square number"),
    ({"vision_config": {**_VISION, "model_type": "clip_vision_model"}}, "only a SigLIP tower"),
])
def test_configs_it_cannot_build_are_refused(change, message):
    with pytest.raises(UserError, match=message):
        GEMMA3_VISION.hf.args_from_hf_config({**published("gemma3_4b_vision"), **change})


def test_images_of_another_size_than_the_towers_are_refused(tiny):
    tokens, _ = _batch([[3]])
    with pytest.raises(ValueError, match=r"pixel_values of shape \[1, 3, 28, 28\]: the vision tower takes "
                                         r"\[n_images, 3, 56, 56\]"):
        tiny[2](tokens, pixel_values=torch.zeros(1, 3, 28, 28))


def test_each_parameter_is_initialised_as_init_weights_does():
    """The rule for one parameter (how a sharded model is initialised) is ``init_weights``'s, the tower's included."""
    model = gemma3_vision.gemma3_vision_tiny()
    torch.manual_seed(0)
    init_weights_(model)
    for name, param in model.named_parameters():
        drawn = torch.empty(param.shape)
        GEMMA3_VISION.init_parameter(model, name, drawn, torch.Generator().manual_seed(7))
        if torch.all(param == param.flatten()[0]):
            assert torch.equal(drawn, param.detach()), name
        else:
            torch.manual_seed(7)
            assert torch.equal(drawn, torch.empty(param.shape).normal_(0.0, 0.02)), name


def test_a_processor_whose_tokens_per_image_are_not_the_models_is_refused(tiny):
    tokens, pixels = _batch([[3]])
    sample = {"tokens": tokens[0].tolist(), "pixel_values": pixels}
    check_model_takes_images(tiny[2], sample, "dataset")  # 4 image tokens for one image: accepted
    sample["tokens"] = sample["tokens"][:5] + sample["tokens"][6:]
    with pytest.raises(UserError, match=r"dataset: the first sample has 3 tokens of the model's image_token_id=98 "
                                        r"for 1 images of the model's mm_tokens_per_image=4"):
        check_model_takes_images(tiny[2], sample, "dataset")
