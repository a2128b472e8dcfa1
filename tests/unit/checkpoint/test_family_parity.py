"""Every supported family against transformers' own classes: a tiny random checkpoint written by transformers
loads through the family's adapter and gives transformers' logits; what we save, transformers loads back; and
every activation checkpointing mode trains it exactly like no AC."""

import json

import pytest
import torch
from hf_families import FAMILY_NAMES, HF_CLASSES, random_hf_model, write_hf_checkpoint
from numerics import assert_close, llama_terms

from torchtune_ac.models import (FAMILIES, family_of, from_hf_config, load_hf, load_hf_weights_, save_hf,
                                 transformer_blocks)
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing

CASES = [(family, tied) for family in FAMILY_NAMES for tied in (False, True)]
IDS = [f"{family}-{'tied' if tied else 'untied'}" for family, tied in CASES]
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))


def test_every_family_has_a_transformers_reference():
    # A family found by its builders only (Gemma 3 with images) is checked in its own module
    # (tests/unit/models/test_gemma3_vision_family.py): load_hf builds another family from its checkpoints.
    assert sorted(f.name for f in FAMILIES if f.hf.model_types_read) == FAMILY_NAMES


@pytest.mark.numerics
@pytest.mark.parametrize("family, tied", CASES, ids=IDS)
def test_logits_match_transformers(tmp_path, family, tied):
    reference = random_hf_model(family, seed=1, tie_word_embeddings=tied)
    reference.save_pretrained(tmp_path)

    model = load_hf(tmp_path).eval()

    assert family_of(model).name == family
    with torch.no_grad():
        expected = reference(TOKENS).logits
        # transformers adds in other orders (other attention kernels, RoPE and norm formulas): within rounding.
        assert_close(model(TOKENS), expected, terms=llama_terms(model.args, TOKENS.shape[1], 0, backward=False),
                     what="logits")


@pytest.mark.parametrize("family, tied", CASES, ids=IDS)
def test_round_trip_through_transformers(tmp_path, family, tied):
    write_hf_checkpoint(family, tmp_path / "source", seed=2, tie_word_embeddings=tied)
    model = load_hf(tmp_path / "source").eval()

    save_hf(model, tmp_path / "saved", bos_token_id=1, eos_token_id=2)

    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    model_type = next(f.hf.model_type for f in FAMILIES if f.name == family)  # gemma3 writes gemma3_text
    assert config["model_type"] == model_type and config["architectures"] == [HF_CLASSES[family][1].__name__]
    reloaded = HF_CLASSES[family][1].from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    with torch.no_grad():
        # Bit for bit: the same transformers model on the same weights (copied, not computed) runs the same kernels.
        assert torch.equal(reloaded(TOKENS).logits, random_hf_model(family, 2, tie_word_embeddings=tied)(TOKENS).logits)
    ours_again = load_hf(tmp_path / "saved").state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours_again[name], tensor), name


AC_MODES = {"none": {}, "full": {"ac_mode": "full"}, "every_2nd": {"ac_mode": "selective", "ac_option": 2},
            "per_op": {"ac_mode": "selective", "ac_option": "op"}}


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_ac_mode_gives_the_gradients_of_no_ac(tmp_path, family):
    write_hf_checkpoint(family, tmp_path, seed=3)
    labels = torch.roll(TOKENS, -1, dims=1)
    gradients = {}
    for mode, keys in AC_MODES.items():
        model = from_hf_config(str(tmp_path), attn_dropout=0.1, resid_dropout=0.1)
        load_hf_weights_(model, tmp_path)
        plan = setup_activation_checkpointing(model, **keys)
        blocks = len(transformer_blocks(model))  # a vision-language model's tower's blocks too
        assert len(plan.checkpointed_blocks) == {"none": 0, "every_2nd": blocks // 2}.get(mode, blocks)
        torch.manual_seed(0)
        logits = model.train()(TOKENS)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        gradients[mode] = {name: p.grad for name, p in model.named_parameters()}
    for mode, grads in gradients.items():
        for name, grad in grads.items():
            # Bit for bit: one process, the same ops replayed in the same order (the recompute only repeats them).
            assert torch.equal(grad, gradients["none"][name]), (mode, name)
