"""The Qwen3-VL family against transformers' ``Qwen3VLForConditionalGeneration``: logits with no image, one and two
images (of one size and of several) through the same model (DeepStack, interleaved multimodal RoPE, the resampled
position grid); the published 8B's shapes and parameter count; the tower's share of activation checkpointing and
sharding; freezing; the refusals."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hf_families import random_hf_model, write_hf_checkpoint
from numerics import assert_close, llama_terms
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from vision_testlib import (assert_a_batch_without_images_changes_nothing, assert_qwen_logits_match,
                            assert_the_tower_blocks_come_first, frozen_names, names_under, qwen_image_batch)

import torchtune_ac.models.families.qwen3_vl as qwen3_vl
from torchtune_ac.errors import UserError
from torchtune_ac.models import QWEN3_VL, check_checkpoint_matches, family_of, load_hf
from torchtune_ac.models.vision.checks import check_model_takes_images
from torchtune_ac.models.vision.qwen3_vl import interleaved_mrope_axes, interpolation_matrix

IMAGE = 98  # QWEN3_VL_TINY's image token
PATCH_VALUES = 3 * 2 * 16 * 16
# Qwen/Qwen3-VL-8B-Instruct's config.json (the keys that matter), as published: nested, RoPE as rope_scaling.
PUBLISHED_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_text", "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
                    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "vocab_size": 151936,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    "vision_config": {"model_type": "qwen3_vl", "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
                      "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
                      "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def _batch(rows: list[list[tuple[int, int]]], seq_len: int, seed: int = 0):
    return qwen_image_batch(rows, seq_len, IMAGE, PATCH_VALUES, seed)


def _terms(model, seq_len):
    vision = model.args.vision
    tower = (vision.depth * (5 * vision.dim + vision.intermediate_dim + 64) + 8 * vision.dim + PATCH_VALUES
             + 2 * vision.grid_side)
    return llama_terms(model.args, seq_len, 0, backward=False) + tower


CASES = {
    "one_image": [[(2, (4, 4))]],
    # two images in one row (one larger than the 4 x 4 position grid, one smaller on a side), one in the other
    "two_images": [[(1, (6, 8)), (16, (2, 4))], [(4, (4, 4))]],
    "two_images_of_one_size": [[(2, (4, 8))], [(5, (4, 8))]],  # the tower attends within both in one call
    "text_only": [[], []],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_hf_checkpoint("qwen3_vl", tmp_path_factory.mktemp("vlm"), seed=1)
    return path, random_hf_model("qwen3_vl", seed=1), load_hf(path).eval()


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tiny, case):
    _, reference, model = tiny
    assert_qwen_logits_match(model, reference, CASES[case], seq_len=24, image_token=IMAGE, patch_values=PATCH_VALUES,
                             terms=_terms(model, 24))


def test_the_rotated_pairs_take_rows_and_columns_interleaved():
    # pair i: the row where i % 3 == 1 and i < 3 * 20, the column where i % 3 == 2 and i < 3 * 20, else the time
    axes = interleaved_mrope_axes((24, 20, 20), 64).tolist()
    assert axes[:6] == [0, 1, 2, 0, 1, 2] and axes[57:] == [0, 1, 2, 0, 0, 0, 0]
    assert [axes.count(axis) for axis in (0, 1, 2)] == [24, 20, 20]


@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_the_position_grid_is_resampled_as_bilinear_interpolation_with_corners_aligned(size):
    table = torch.randn(1, 5, 4, 4, generator=torch.Generator().manual_seed(size))  # [1, dim, side, side]
    expected = F.interpolate(table, size=(size, size + 2), mode="bilinear", align_corners=True)
    ours = torch.einsum("hi,wj,dij->dhw", interpolation_matrix(size, 4), interpolation_matrix(size + 2, 4), table[0])
    assert_close(ours, expected[0], terms=4, what="resampled grid")


@pytest.mark.parametrize("name", ["qwen3_vl_8b"])
def test_builders_have_the_published_shapes_and_transformers_parameter_count(name):
    assert QWEN3_VL.hf.args_from_hf_config(PUBLISHED_8B) == qwen3_vl.QWEN3_VL_8B
    with torch.device("meta"):
        ours = getattr(qwen3_vl, name)()
        theirs = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**PUBLISHED_8B))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 8_767_123_696


def test_the_tower_blocks_come_first_for_ac_and_sharding(tiny):
    path, _, _ = tiny
    model = load_hf(path)
    visual = model.visual
    groups = ((visual.patch_embed, visual.pos_embed), (visual.deepstack_merger_list[0],),
              (visual.deepstack_merger_list[1],), (visual.merger,))
    # ac_option 2: of 3 tower blocks, then 3 decoder blocks
    assert_the_tower_blocks_come_first(model, visual.blocks, groups, ac_option=2, checkpointed=(1, 3, 5))


def test_a_batch_without_images_runs_the_tower_and_changes_nothing(tiny):
    # DeepStack mergers included
    assert_a_batch_without_images_changes_nothing(load_hf(tiny[0]), _batch([[]], 12)[0])


def test_freezing_the_tower_and_the_projectors_by_builder_keys():
    with torch.device("meta"):
        model = qwen3_vl.qwen3_vl_tiny(freeze_vision_tower=True)
        both = qwen3_vl.qwen3_vl_tiny(freeze_vision_tower=True, freeze_projector=True)
    assert "visual.pos_embed.weight" in frozen_names(model)
    assert frozen_names(model) == names_under(model, "visual.blocks.", "visual.patch_embed.", "visual.pos_embed.")
    assert frozen_names(both) == names_under(both, "visual.")
    assert family_of(model) is QWEN3_VL


def test_a_tower_that_does_not_match_the_checkpoint_is_refused(tiny):
    path, _, model = tiny
    args = dataclasses.replace(model.args, vision=dataclasses.replace(model.args.vision, deepstack_visual_indexes=(1,),
                                                                      num_position_embeddings=9))
    with torch.device("meta"):
        other = QWEN3_VL.build(args)
    with pytest.raises(UserError, match=r"vision_config.deepstack_visual_indexes=\[0, 1\], model has \[1\].*"
                                        r"vision_config.num_position_embeddings=16, model has 9"):
        check_checkpoint_matches(other, path)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("vision_config"), "vision_config: missing"),
    (lambda c: c["vision_config"].update(deepstack_visual_indexes=[8, 27]),
     r"vision.deepstack_visual_indexes=\[8, 27\]: must be distinct blocks of the 27"),
    (lambda c: c["vision_config"].update(num_position_embeddings=2300), "must be a square"),
])
def test_configs_the_family_cannot_build_are_refused(change, message):
    config = {**PUBLISHED_8B, "vision_config": dict(PUBLISHED_8B["vision_config"])}
    change(config)
    with pytest.raises(UserError, match=message):
        QWEN3_VL.hf.args_from_hf_config(config)


def test_images_of_the_other_patch_size_are_refused(tiny):
    sample = {"tokens": [1, 2] + [IMAGE] * 4 + [3], "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(UserError, match=r"the processor's patches hold 1176 values, the model's vision tower takes "
                                        r"1536 \(in_channels=3 x temporal_patch_size=2 x patch_size=16\^2\)"):
        check_model_takes_images(tiny[2], {**sample, "pixel_values": torch.zeros(16, 3 * 2 * 14 * 14)}, "dataset")
    check_model_takes_images(tiny[2], {**sample, "pixel_values": torch.zeros(16, PATCH_VALUES)}, "dataset")


def test_packed_documents_give_each_document_its_own_logits(tiny):
    _, _, model = tiny
    first, pixels_a, grid_a = _batch([[(2, (4, 4))]], 10, seed=1)
    second, pixels_b, grid_b = _batch([[(3, (2, 4))]], 8, seed=2)
    packed = torch.cat([first, second], dim=1)
    document_ids = torch.tensor([[0] * 10 + [1] * 8])
    with torch.no_grad():
        together = model(packed, document_ids=document_ids, pixel_values=torch.cat([pixels_a, pixels_b]),
                         image_grid_thw=torch.cat([grid_a, grid_b]))
        alone = torch.cat([model(first, pixel_values=pixels_a, image_grid_thw=grid_a),
                           model(second, pixel_values=pixels_b, image_grid_thw=grid_b)], dim=1)
    # the same sums over each document's keys, in other kernels' orders
    assert_close(together, alone, terms=_terms(model, 10), what="packed logits")


def test_the_position_resampling_weights_stay_float32_under_a_bf16_default():
    """``tune plan`` builds the model with bf16 as torch's default dtype: the weights must not follow it (a bf16
    ``zeros`` under float32 taps stopped the planner on a dtype error)."""
    from torchtune_ac.models.vision.qwen3_vl import interpolation_matrix

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        weights = interpolation_matrix(5, 3)
    finally:
        torch.set_default_dtype(previous)
    assert weights.dtype == torch.float32 and torch.allclose(weights.sum(1), torch.ones(5))


@pytest.mark.numerics
def test_the_loss_at_the_targets_only_is_the_whole_logits_loss(tiny, monkeypatch):
    # loss_chunks 1: the head reads the targets' rows only and the last block (after the DeepStack layers) computes
    # those rows alone, in packed documents with images; the loss and every gradient are the whole logits' within
    # rounding.
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.models import llama
    from torchtune_ac.training.objective import IGNORE_INDEX, CrossEntropy

    _, _, model = tiny
    first, pixels_a, grid_a = _batch([[(2, (4, 4))]], 10, seed=1)
    second, pixels_b, grid_b = _batch([[(3, (2, 4))]], 8, seed=2)
    tokens = torch.cat([first, second], dim=1)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, torch.rand(18, generator=torch.Generator().manual_seed(3)) < 0.6] = IGNORE_INDEX
    batch = {"tokens": tokens, "labels": labels, "document_ids": torch.tensor([[0] * 10 + [1] * 8]),
             "pixel_values": torch.cat([pixels_a, pixels_b]), "image_grid_thw": torch.cat([grid_a, grid_b])}
    calls = []
    forward_rows = llama.Attention.forward_rows
    monkeypatch.setattr(llama.Attention, "forward_rows", lambda *a, **k: calls.append(1) or forward_rows(*a, **k))

    def run(objective):
        model.zero_grad(set_to_none=True)
        loss = objective(model, batch)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    loss, grads = run(loss_objective(1))
    assert calls  # the last block ran at the target rows
    expected, expected_grads = run(CrossEntropy())
    terms = 2 * _terms(model, 10) + int((labels != IGNORE_INDEX).sum())
    assert_close(loss, expected, terms=terms, what="loss")
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, terms=terms, what=name)
