"""The Qwen2.5-VL family against transformers' ``Qwen2_5_VLForConditionalGeneration``: logits with one image, two
images and none, through the same model; both checkpoint layouts; the published sizes; the tower's share of
activation checkpointing and sharding; freezing; the refusals."""

import dataclasses

import pytest
import torch
from hf_families import random_hf_model, write_tiny_vlm_checkpoint
from numerics import assert_close, llama_terms
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from vision_testlib import (assert_a_batch_without_images_changes_nothing, assert_qwen_logits_match,
                            assert_the_tower_blocks_come_first, frozen_names, names_under, qwen_image_batch)

import torchtune_ac.models.families.qwen2 as qwen2
import torchtune_ac.models.families.qwen2_5_vl as qwen2_5_vl
from torchtune_ac.errors import UserError
from torchtune_ac.models import QWEN2_5_VL, check_checkpoint_matches, family_of, load_hf
from torchtune_ac.models.vision.checks import check_model_takes_images
from torchtune_ac.models.vision.qwen2_5_vl import mrope_positions

IMAGE = 98  # QWEN2_5_VL_TINY's image token
PATCH_VALUES = 3 * 2 * 14 * 14
# Published config.json files (the keys that matter), as Qwen ships them: flat, transformers 4's names.
_VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
           "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
           "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2}
_TEXT = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
         "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "use_sliding_window": False,
         "sliding_window": 32768, "image_token_id": 151655, "video_token_id": 151656,
         "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
PUBLISHED = {
    "qwen2_5_vl_3b": {**_TEXT, "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                      "num_hidden_layers": 36, "num_key_value_heads": 2, "tie_word_embeddings": True,
                      "vocab_size": 151936, "vision_config": {**_VISION, "out_hidden_size": 2048}},
    "qwen2_5_vl_7b": {**_TEXT, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                      "num_hidden_layers": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                      "vocab_size": 152064, "vision_config": {**_VISION, "out_hidden_size": 3584}},
}


def _batch(rows: list[list[tuple[int, int]]], seq_len: int, seed: int = 0):
    return qwen_image_batch(rows, seq_len, IMAGE, PATCH_VALUES, seed)


def _terms(model, seq_len):
    vision = model.args.vision
    tower = vision.depth * (5 * vision.dim + vision.intermediate_dim + 64) + 4 * vision.dim + PATCH_VALUES
    return llama_terms(model.args, seq_len, 0, backward=False) + tower


CASES = {
    "one_image": [[(2, (4, 4))]],
    # two images in one row (windows of 2 x 2 merge units: 2 of them, and one cut short), one in the other
    "two_images": [[(1, (4, 8)), (12, (6, 4))], [(4, (4, 4))]],
    "text_only": [[], []],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=1)
    return path, random_hf_model("qwen2_5_vl", seed=1), load_hf(path).eval()


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tiny, case):
    _, reference, model = tiny
    assert_qwen_logits_match(model, reference, CASES[case], seq_len=24, image_token=IMAGE, patch_values=PATCH_VALUES,
                             terms=_terms(model, 24))


def test_the_published_layout_loads_the_same_weights(tiny, tmp_path):
    path, _, model = tiny
    legacy = load_hf(write_tiny_vlm_checkpoint(tmp_path, seed=1, legacy_layout=True))
    assert legacy.args == model.args
    for name, tensor in model.state_dict().items():
        assert torch.equal(legacy.state_dict()[name], tensor), name


def test_packed_documents_restart_their_positions():
    tokens, _, grid = _batch([[(2, (4, 8))]], 12)
    packed = torch.cat([tokens, tokens], dim=1)
    document_ids = torch.tensor([[0] * 12 + [1] * 12])
    positions = mrope_positions(packed, torch.cat([grid, grid]), IMAGE, 2, document_ids)
    alone = mrope_positions(tokens, grid, IMAGE, 2)
    assert torch.equal(positions[..., 12:], alone) and torch.equal(positions[..., :12], alone)
    # the image's tokens: time 2, rows 2-3, columns 2-5 (2 x 4 merge units from position 2); text resumes at 2 + 4
    assert positions[:, 0, 2:10].tolist() == [[2] * 8, [2, 2, 2, 2, 3, 3, 3, 3], [2, 3, 4, 5] * 2]
    assert positions[0, 0, 10:12].tolist() == [6, 7]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builders_have_the_published_shapes_and_transformers_parameter_count(name):
    config = PUBLISHED[name]
    assert QWEN2_5_VL.hf.args_from_hf_config(config) == getattr(qwen2_5_vl, name.upper())
    with torch.device("meta"):
        ours = getattr(qwen2_5_vl, name)()
        theirs = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**{
            **{k: v for k, v in config.items() if k != "rope_scaling"},
            "vision_config": {**config["vision_config"], "in_channels": 3}}))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())  # a tied weight counted once on both sides
    assert count == {"qwen2_5_vl_3b": 3_754_622_976, "qwen2_5_vl_7b": 8_292_166_656}[name]


def test_the_tower_blocks_come_first_for_ac_and_sharding(tiny):
    path, _, _ = tiny
    model = load_hf(path)
    # ac_option 3: the third of 2 tower blocks and 2 decoder blocks, decoder layer 0
    visual = model.visual
    assert_the_tower_blocks_come_first(model, visual.blocks, ((visual.patch_embed,), (visual.merger,)), ac_option=3,
                                       checkpointed=(2,))


def test_a_batch_without_images_runs_the_tower_and_changes_nothing(tiny):
    assert_a_batch_without_images_changes_nothing(load_hf(tiny[0]), _batch([[]], 12)[0])


def test_freezing_the_tower_and_the_projector_by_builder_keys():
    with torch.device("meta"):
        model = qwen2_5_vl.qwen2_5_vl_3b(freeze_vision_tower=True)
        both = qwen2_5_vl.qwen2_5_vl_3b(freeze_vision_tower=True, freeze_projector=True)
    assert frozen_names(model) == names_under(model, "visual.blocks.", "visual.patch_embed.")
    assert frozen_names(both) == names_under(both, "visual.")
    assert family_of(model) is QWEN2_5_VL


def test_a_tower_that_does_not_match_the_checkpoint_is_refused(tiny):
    path, _, model = tiny
    args = dataclasses.replace(model.args, vision=dataclasses.replace(model.args.vision, depth=3,
                                                                      fullatt_block_indexes=(2,)))
    with torch.device("meta"):
        other = QWEN2_5_VL.build(args)
    with pytest.raises(UserError, match=r"vision_config.depth=2, model has 3.*vision_config.fullatt_block_indexes"):
        check_checkpoint_matches(other, path)


def test_a_text_only_config_is_not_a_vision_language_checkpoint():
    config = {k: v for k, v in PUBLISHED["qwen2_5_vl_3b"].items() if k != "vision_config"}
    with pytest.raises(UserError, match="vision_config: missing"):
        QWEN2_5_VL.hf.args_from_hf_config(config)


def _sample(h=4, w=4, values=PATCH_VALUES, image_tokens=4):
    return {"tokens": [1, 2] + [IMAGE] * image_tokens + [3], "pixel_values": torch.zeros(h * w, values),
            "image_grid_thw": torch.tensor([[1, h, w]])}


@pytest.mark.parametrize("sample, message", [
    (_sample(values=3 * 2 * 16 * 16), r"dataset: the processor's patches hold 1536 values, the model's vision tower "
                                      r"takes 1176 \(in_channels=3 x temporal_patch_size=2 x patch_size=14\^2\)"),
    (_sample(image_tokens=16), "dataset: the first sample has 16 tokens of the model's image_token_id=98 but its "
                               "images make 4 with the model's spatial_merge_size=2"),
])
def test_images_the_tower_cannot_take_are_refused(tiny, sample, message):
    with pytest.raises(UserError, match=message):
        check_model_takes_images(tiny[2], sample, "dataset")
    check_model_takes_images(tiny[2], _sample(), "dataset")  # the processor's sizes: accepted


def test_a_text_only_model_given_images_is_refused():
    with torch.device("meta"):
        model = qwen2.qwen2_5_0_5b()
    with pytest.raises(UserError, match=r"dataset: its samples hold images, but the model \(qwen2\) is text-only"):
        check_model_takes_images(model, _sample(), "dataset")
    check_model_takes_images(model, {"tokens": [1, 2]}, "dataset")


@pytest.mark.numerics
def test_the_towers_segmented_attention_is_the_dense_masks(monkeypatch):
    # Windows and frames attend in one call over [segments, longest] (padded where sizes differ): the tower's output
    # and gradients are those of one call over every row with the dense [n, n] mask of the same segments.
    from torchtune_ac.models.vision import qwen2_5_vl as vl

    torch.manual_seed(0)
    tower = vl.VisionTower(qwen2_5_vl.QWEN2_5_VL_TINY.vision)
    for parameter in tower.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    grids = [[1, 6, 10], [2, 4, 4], [1, 2, 2]]  # uneven windows, frames of three sizes, two frames of one image
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_VALUES)

    def run():
        tower.zero_grad()
        out = tower(pixels, grids)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in tower.named_parameters()}

    out, grads = run()
    monkeypatch.setattr(vl.Segments, "of", staticmethod(
        lambda sizes, device: (lambda ids: ids.unsqueeze(0) == ids.unsqueeze(1))(vl.segment_ids(sizes, device))))
    expected, expected_grads = run()
    vision = qwen2_5_vl.QWEN2_5_VL_TINY.vision
    terms = 2 * vision.depth * (5 * vision.dim + vision.intermediate_dim + 64) + PATCH_VALUES
    assert_close(out, expected, terms=terms, what="tower output")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, terms=terms, what=name)


@pytest.mark.numerics
def test_a_padding_free_batch_has_the_padded_batchs_loss_and_gradients():
    # The embedded task's samples as one row of documents (``padding_free``) against one padded row each: the same
    # targets, positions restarting per document, attention within each, so the same loss and weight gradients.
    from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR, EMBEDDED_VLM_TRAIN_PATH
    from torchtune_ac.data.vision import build_vision_dataset, collate_vision_batch, load_vision_processor
    from torchtune_ac.training.objective import CrossEntropy

    processor = load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)
    samples = list(build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=64))[:4]
    pad = processor.tokenizer.pad_token_id
    padded = collate_vision_batch(samples, pad_id=pad)
    free = collate_vision_batch(samples, pad_id=pad, padding_free=True, pad_to_multiple_of=8)
    lengths = [len(sample["tokens"]) for sample in samples]
    tail = -sum(lengths) % 8
    assert free["tokens"].shape == (1, sum(lengths) + tail)
    assert free["document_lengths"].tolist() == lengths + ([tail] if tail else [])
    assert int(free["target_count"]) == int(padded["target_count"]) > 0
    torch.manual_seed(0)
    model = qwen2_5_vl.build(qwen2_5_vl.QWEN2_5_VL_TINY)
    model.init_weights()

    def run(batch):
        model.zero_grad()
        loss = CrossEntropy()(model, batch)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, grads = run(free)
    expected, expected_grads = run(padded)
    terms = 2 * _terms(model, padded["tokens"].shape[1]) + sum(lengths)
    assert_close(loss, expected, terms=terms, what="loss")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, terms=terms, what=name)


@pytest.mark.numerics
@pytest.mark.parametrize("padding_free", [False, True])
def test_the_loss_at_the_targets_only_is_the_whole_logits_loss(padding_free):
    # ``loss_chunks: 1``: the head reads the targets' rows only, and the last block computes those rows only
    # (``TargetHead``); the loss and every gradient are the whole logits' within rounding.
    from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR, EMBEDDED_VLM_TRAIN_PATH
    from torchtune_ac.data.vision import build_vision_dataset, collate_vision_batch, load_vision_processor
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.training.objective import CrossEntropy

    processor = load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)
    samples = list(build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=64))[:4]
    batch = collate_vision_batch(samples, pad_id=processor.tokenizer.pad_token_id, padding_free=padding_free)
    torch.manual_seed(0)
    model = qwen2_5_vl.build(qwen2_5_vl.QWEN2_5_VL_TINY)
    model.init_weights(std=0.2)  # attention far from uniform: a row that saw the wrong keys would show

    def run(objective):
        model.zero_grad()
        loss = objective(model, batch)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, grads = run(loss_objective(1))
    expected, expected_grads = run(CrossEntropy())
    terms = 2 * _terms(model, batch["tokens"].shape[1]) + int(batch["target_count"])
    assert_close(loss, expected, terms=terms, what="loss")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, terms=terms, what=name)
