"""The family interface: finding a model's family, the family a config.json names, blocks and init."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models_testlib import TINY

import torchtune_ac.models as models
from torchtune_ac.config.components import parse_component
from torchtune_ac.errors import UserError
from torchtune_ac.models import (
    FAMILIES,
    LLAMA,
    QWEN2,
    Llama,
    family_for_hf_config,
    family_of,
    from_hf_config,
    transformer_blocks,
)
from torchtune_ac.models.families import init_weights_, model_from_hf_config, retie_parameters
from torchtune_ac.models.family import architecture_mismatches

FAMILY_MODULES = sorted(p.stem for p in Path(models.__file__).parent.joinpath("families").glob("*.py")
                        if p.stem != "__init__")


class CustomModel(torch.nn.Module):
    def __init__(self, with_layers: bool = True) -> None:
        super().__init__()
        if with_layers:
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


def test_a_model_finds_its_family_through_subclasses():
    class Wrapped(Llama):  # as fully_shard does: a dynamic subclass of the model's class
        pass

    assert family_of(Llama(TINY)) is LLAMA
    assert family_of(Wrapped(TINY)) is LLAMA
    assert family_of(CustomModel()) is None


def test_a_model_is_of_the_family_whose_model_type_its_arguments_carry():
    qwen2_args = dataclasses.replace(TINY, model_type="qwen2", qkv_bias=True)
    assert family_of(Llama(qwen2_args)) is QWEN2
    assert family_of(Llama(dataclasses.replace(TINY, model_type="gpt2"))) is None
    with pytest.raises(ValueError, match="model_type='llama': these are not qwen2 arguments"):
        QWEN2.build(TINY)


def test_every_module_under_families_is_a_family_whose_builders_the_package_exports():
    assert sorted(family.name for family in FAMILIES) == FAMILY_MODULES  # one module per family, named for it
    for family in FAMILIES:
        assert getattr(models, family.name.upper()) is family
        for name, builder in family.builders.items():
            assert getattr(models, name) is builder, name
            assert builder.__module__ == f"torchtune_ac.models.families.{family.name}"


def test_every_torchtune_builder_a_family_replaces_is_one_of_its_builders():
    for family in FAMILIES:
        for torchtune, ours in family.torchtune_builders.items():
            assert torchtune.startswith("torchtune.models."), torchtune
            assert ours.ours in family.builders or (ours.ours == "from_hf_config" and ours.note), torchtune


def test_the_pure_config_reader_builds_the_family_its_model_type_names():
    config = QWEN2.hf.hf_config_from_args(dataclasses.replace(TINY, model_type="qwen2", qkv_bias=True), torch.float32)
    with torch.device("meta"):
        model = model_from_hf_config(config, attn_dropout=0.1)
    assert family_of(model) is QWEN2 and model.args.attn_dropout == 0.1


def test_every_family_reads_back_the_config_it_writes():
    for family in FAMILIES:
        name, builder = next(iter(family.builders.items()))
        with torch.device("meta"):
            model = builder()
        config = family.hf.hf_config_from_args(family.args_of(model), torch.bfloat16)
        if family.hf.model_types_read:
            assert family_for_hf_config(config) is family, name
        else:  # found by its builders only (Gemma 3 with images): its model_type is another family's to build
            assert config["model_type"] in family.hf.model_types_loaded, name
        assert family.hf.args_from_hf_config(config) == family.args_of(model), name


def test_an_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(UserError, match=r"model_type='gpt2': not a supported model family \(supported: 'llama'"):
        family_for_hf_config({"model_type": "gpt2"})


def test_custom_models_keep_the_layers_convention():
    assert len(transformer_blocks(CustomModel())) == 1
    with pytest.raises(UserError, match="CustomModel has no attribute 'layers'"):
        transformer_blocks(CustomModel(with_layers=False))
    with pytest.raises(UserError, match="CustomModel has no init_weights"):
        init_weights_(CustomModel())


def test_init_and_retie_go_through_the_family():
    args = TINY.__class__(**{**TINY.__dict__, "tie_embeddings": True})
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    assert model.output.weight is not model.tok_embeddings.weight
    retie_parameters(model)
    assert model.output.weight is model.tok_embeddings.weight
    torch.manual_seed(0)
    init_weights_(model)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert 0.015 < model.tok_embeddings.weight.std() < 0.025


def test_architecture_mismatches_name_each_key():
    ours = LLAMA.hf.architecture(TINY)
    theirs = {**ours, "num_attention_heads": 8, "rope_theta": 10000.000001, "rms_norm_eps": 1e-6}
    assert architecture_mismatches(ours, theirs) == [
        "num_attention_heads=8, model has 4",
        "rms_norm_eps=1e-06, model has 1e-05",
    ]
    assert architecture_mismatches(ours, dict(ours)) == []


def test_from_hf_config_reads_a_dict_a_file_or_a_directory(tmp_path):
    config = LLAMA.hf.hf_config_from_args(TINY, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (config, tmp_path / "config.json", str(tmp_path)):
        model = from_hf_config(source, attn_dropout=0.1, max_seq_len=64)
        assert isinstance(model, Llama)
        assert model.args == TINY.__class__(**{**TINY.__dict__, "attn_dropout": 0.1, "max_seq_len": 64})
    with pytest.raises(UserError, match="set checkpoint_dir"):
        from_hf_config()


def test_the_model_component_gets_the_runs_checkpoint_dir_unless_it_sets_one(tmp_path):
    for name, args in (("a", TINY), ("b", TINY.__class__(**{**TINY.__dict__, "n_layers": 3}))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(LLAMA.hf.hf_config_from_args(args, torch.float32)))
    plain = parse_component({"_component_": "torchtune_ac.models.from_hf_config"}, "model")
    own = parse_component({"_component_": "torchtune_ac.models.from_hf_config",
                           "checkpoint_dir": str(tmp_path / "b")}, "model")
    named = parse_component({"_component_": "torchtune_ac.models.llama_tiny"}, "model")
    with torch.device("meta"):
        assert len(plain.instantiate_with_defaults(checkpoint_dir=str(tmp_path / "a")).layers) == 2
        assert len(own.instantiate_with_defaults(checkpoint_dir=str(tmp_path / "a")).layers) == 3
        assert len(named.instantiate_with_defaults(checkpoint_dir=str(tmp_path / "a")).layers) == 8


def test_qkv_bias_adds_query_key_value_biases_initialised_to_zero():
    args = TINY.__class__(**{**TINY.__dict__, "qkv_bias": True})
    model = Llama(args)
    model.init_weights()
    biases = {name: p for name, p in model.named_parameters() if name.endswith(".bias")}
    assert sorted(biases) == sorted(f"layers.{i}.attn.{p}_proj.bias" for i in range(2) for p in "qkv")
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases.values())
    with pytest.raises(ValueError, match="qkv_bias=True, but llama has no q/k/v projection biases"):
        LLAMA.hf.architecture(args)
