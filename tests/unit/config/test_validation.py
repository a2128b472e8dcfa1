"""Schema validation: every problem is reported, each naming the key, the value and what is allowed."""

import sys

import pytest
import yaml

from torchtune_ac.config import ConfigError, DType, FullFinetuneConfig, validate_config
from torchtune_ac.config.components import (
    ALLOWED_ENV_VAR,
    Component,
    check_component_path,
    import_component,
    parse_component,
)
from torchtune_ac.errors import UserError
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode


def base_config(**changes):
    cfg = {
        "output_dir": "/tmp/out",
        "model": {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3},
        "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": "/tmp/tok"},
        "dataset": {"_component_": "torchtune_ac.data.instruct_dataset", "source": "data.jsonl"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
    }
    cfg.update(changes)
    return cfg


def problems_of(cfg):
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, FullFinetuneConfig, source="c.yaml")
    return info.value.problems


def test_valid_config_becomes_typed():
    cfg = validate_config(base_config(dtype="BF16", clip_grad_norm=1, batch_size=4), FullFinetuneConfig, source="c")
    assert cfg.dtype is DType.BF16
    assert cfg.clip_grad_norm == 1.0 and isinstance(cfg.clip_grad_norm, float)
    assert cfg.batch_size == 4
    assert cfg.optimizer == Component(key="optimizer", path="torch.optim.AdamW", kwargs={"lr": 1e-3})
    assert cfg.fsdp.reshard_after_forward is True


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"enable_activaton_checkpointing": True}, "enable_activaton_checkpointing: unknown key (did you mean enable_activation_checkpointing?)"),
        ({"batch_sise": 2}, "batch_sise: unknown key (did you mean batch_size?)"),
        ({"lr": 0.1}, "lr: unknown key (did you mean optimizer.lr?)"),
        ({"batch_size": "four"}, "batch_size='four': expected an integer"),
        ({"batch_size": 0}, "batch_size=0: must be >= 1"),
        ({"batch_size": True}, "batch_size=True: expected an integer"),
        ({"batch_size": 2.5}, "batch_size=2.5: expected an integer"),
        ({"epochs": -1}, "epochs=-1: must be >= 1"),
        ({"max_seq_len": 0}, "max_seq_len=0: must be >= 1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: must be >= 1"),
        ({"clip_grad_norm": 0}, "clip_grad_norm=0.0: must be > 0.0"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan: expected a number"),
        ({"seed": -1}, "seed=-1: must be >= 0"),
        ({"seed": 2**64}, "seed=18446744073709551616: must be <= 9223372036854775807"),
        ({"shuffle": "yes"}, "shuffle='yes': expected true or false"),
        ({"dtype": "fp16"}, "dtype='fp16': expected one of fp32, bf16"),
        ({"device": "tpu"}, "device='tpu': expected one of auto, cpu, cuda"),
        ({"output_dir": None}, "output_dir: must not be null"),
        ({"output_dir": ""}, "output_dir='': must not be empty"),
        ({"checkpoint_dir": " "}, "checkpoint_dir=' ': must not be empty"),
        ({"fsdp": {"reshard_after_forwards": True}}, "fsdp.reshard_after_forwards: unknown key (did you mean fsdp.reshard_after_forward?)"),
        ({"fsdp": 3}, "fsdp=3: expected a mapping"),
        ({"optimizer": "adamw"}, "optimizer='adamw': expected a mapping with _component_"),
        ({"optimizer": {"lr": 1}}, "optimizer: expected a mapping with a _component_ key"),
        ({"optimizer": {"_component_": "os.system"}}, "optimizer._component_=os.system: not allowed"),
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lrr": 1}}, "optimizer.lrr: not an argument of torch.optim.AdamW (did you mean lr?)"),
        ({"optimizer": {"_component_": "torch.optim.AdamWW"}}, "did you mean torch.optim.AdamW?"),
        ({"dataset": {"_component_": "torchtune_ac.data.instruct_dataset", "max_seq_len": 3}}, "dataset.max_seq_len: set by the recipe"),
        ({"lr_scheduler": {"_component_": "torch.optim.lr_scheduler.StepLR", "step_size": 2}},
         "lr_scheduler: torch.optim.lr_scheduler.StepLR takes no num_training_steps argument, which the recipe passes"),
    ],
)
def test_each_problem_is_named(changes, expected):
    problems = problems_of(base_config(**changes))
    assert any(expected in problem for problem in problems), problems


def test_an_unknown_key_like_nothing_gets_no_suggestion():
    # Top level: no key to suggest, only where a variable of one's own goes.
    assert problems_of(base_config(frobnicate=1)) == [
        "frobnicate: unknown key (a variable of your own goes under vars:, read as ${vars.frobnicate})"]
    assert problems_of(base_config(fsdp={"frobnicate": 1})) == ["fsdp.frobnicate: unknown key"]


def test_missing_required_keys():
    cfg = base_config()
    del cfg["model"], cfg["output_dir"]
    problems = problems_of(cfg)
    assert "model: required key is missing" in problems
    assert "output_dir: required key is missing" in problems


def test_all_problems_are_collected_into_one_error():
    with pytest.raises(ConfigError) as info:
        validate_config(base_config(batch_size=0, seed="x", dtype="fp8"), FullFinetuneConfig, source="c.yaml")
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("c.yaml: 3 problems:")


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Was "c.yaml: batch_size=0: ...": the value came from the command line, not the file.
        (["batch_size=0"], "command line: batch_size=0: must be >= 1"),
        (["++optimizer.lr=abc", "batch_size=0"], "command line: 2 problems:\n  - optimizer.lr='abc': "),
        ([], "c.yaml: batch_size=0: must be >= 1"),
        (["seed=x"], "c.yaml: 2 problems:\n  - batch_size=0: must be >= 1\n  - command line: seed='x': expected an "
                     "integer"),
    ],
)
def test_problems_name_the_command_line_for_the_values_it_set(overrides, message):
    values = {"batch_size": 0, **({"seed": "x"} if "seed=x" in overrides else {})}
    if "++optimizer.lr=abc" in overrides:
        values["optimizer"] = {"_component_": "torch.optim.AdamW", "lr": "abc"}
    with pytest.raises(ConfigError) as info:
        validate_config(base_config(**values), FullFinetuneConfig, source="c.yaml", overrides=overrides)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "extra, overrides, message",
    [
        # Each was "c.yaml: ...: unknown key": an override of a key inside an unknown group made that group.
        ({"optimzer": {"lr": 1e-4}}, ["optimzer.lr=1e-4"], "command line: optimzer: unknown key (did you mean "
                                                            "optimizer?)"),
        ({"foo": {"bar": 1}}, ["+foo.bar=1"], "command line: foo: unknown key"),
        ({"fsdpp": {"param_dtype": "bf16"}}, ["fsdpp.param_dtype=bf16"], "command line: fsdpp: unknown key"),
        # The YAML's own unknown group stays the YAML's, whatever else the command line sets.
        ({"fsdpp": {"param_dtype": "bf16"}}, ["fsdp.param_dtype=bf16"], "c.yaml: fsdpp: unknown key"),
    ],
)
def test_unknown_dotted_keys_set_on_the_command_line_are_blamed_on_it(extra, overrides, message):
    with pytest.raises(ConfigError) as info:
        validate_config(base_config(**extra), FullFinetuneConfig, source="c.yaml", overrides=overrides)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "path",
    [
        "os.system",
        "subprocess.run",
        "builtins.eval",
        "torch.hub.load",
        "torch.load",
        "torch.utils.cpp_extension.load_inline",
        "torch.ops.load_library",
        "torch._dynamo.reset",
        "torchvision.models.resnet18",
        "torchtune_ac_evil.x",
        "eval",
        "a..b",
    ],
)
def test_foreign_components_are_refused_before_import(path, monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    with pytest.raises(UserError):
        check_component_path(path, "model")


def test_refusal_says_how_to_allow(monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    with pytest.raises(UserError) as info:
        check_component_path("mypkg.models.build", "model")
    assert str(info.value).endswith(f"to allow it, pass --allow-component mypkg.models.build or set "
                                    f"{ALLOWED_ENV_VAR}=mypkg.models.build")


def test_the_hint_for_torch_load_allows_torch_load_and_nothing_more(monkeypatch):
    """The hint was --allow-component torch, which allows all of torch."""
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    with pytest.raises(UserError) as info:
        check_component_path("torch.load", "model")
    assert str(info.value).endswith(
        f"to allow it, pass --allow-component torch.load or set {ALLOWED_ENV_VAR}=torch.load")
    # What the hint says works, for torch.load (defined in torch.serialization) and only for it.
    import torch

    check_component_path("torch.load", "model", extra_allowed=["torch.load"])
    assert import_component("torch.load", "model", extra_allowed=["torch.load"]) is torch.load
    with pytest.raises(UserError, match="torch.save: not allowed"):
        check_component_path("torch.save", "model", extra_allowed=["torch.load"])


def test_explicit_allow_by_flag_and_env(monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    check_component_path("collections.OrderedDict", "model", extra_allowed=["collections"])
    monkeypatch.setenv(ALLOWED_ENV_VAR, "json, collections")
    check_component_path("collections.OrderedDict", "model")


def test_component_instantiation_with_nested_components():
    node = {
        "_component_": "torch.nn.Sequential",
    }
    component = parse_component(node, "model")
    assert component.instantiate().__class__.__name__ == "Sequential"
    opt = parse_component({"_component_": "torch.optim.SGD", "lr": 0.5}, "optimizer")
    import torch

    p = torch.nn.Parameter(torch.ones(1))
    optimizer = opt.instantiate([p])
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_component_errors_at_instantiation_name_the_key():
    component = parse_component({"_component_": "torch.optim.SGD", "lr": -1.0}, "optimizer")
    import torch

    with pytest.raises(UserError, match=r"^optimizer \(torch.optim.SGD\): Invalid learning rate"):
        component.instantiate([torch.nn.Parameter(torch.ones(1))])


def test_a_builder_refusing_its_argument_is_named_by_the_dotted_key(tmp_path):
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer

    (tmp_path / "d.jsonl").write_text('{"instruction": "i", "output": "o"}\n')
    node = {"_component_": "torchtune_ac.data.instruct_dataset", "source": str(tmp_path / "d.jsonl")}
    with pytest.raises(UserError, match=r"^dataset\.template='foo': must be one of alpaca, chat$"):
        parse_component({**node, "template": "foo"}, "dataset").instantiate(load_tokenizer(EMBEDDED_TOKENIZER_DIR))
    # A message about something else (here a file) is passed on as it is.
    with pytest.raises(UserError, match=r"^dataset source \S+missing.jsonl does not exist$"):
        parse_component({**node, "source": str(tmp_path / "missing.jsonl")}, "dataset").instantiate(
            load_tokenizer(EMBEDDED_TOKENIZER_DIR))


# Paths that pass the string check but lead to something a config must not call: os.system under another name,
# torch functions that unpickle, write or delete files, run shell commands or import code, torchtune_ac
# functions that write files, and callables that are not builders.
REFUSED_AFTER_IMPORT = [
    ("torch.nn.parallel.distributed.os.system", "torch.nn.parallel.distributed.os is the module os"),
    ("torchtune_ac.cli.os.system", "torchtune_ac.cli.os is the module os"),
    ("torchtune_ac.config.components.importlib.import_module", "is the module importlib"),
    ("torchtune_ac.cli.Path", "it is pathlib.Path"),
    ("torchtune_ac.models.save_hf", "it is torchtune_ac.models.hf_checkpoint.save_hf"),
    ("torchtune_ac.checkpoint.save_checkpoint", "not allowed"),
    ("torch.nn.functional.relu", "not allowed"),
    ("torch.nn.Module.load_state_dict", "not allowed"),
    ("torch.optim.Optimizer.load_state_dict", "not allowed"),
]
REFUSED_BEFORE_IMPORT = [
    "os.system",
    "torch.os.system",
    "torch.load",
    "torch.save",
    "torch.serialization.load",
    "torch.onnx.export",
    "torch.hub.load",
    "torch.utils.collect_env.run",
    "torch.utils.model_zoo.load_url",
    "torch.distributed.checkpoint.load",
    "torch.utils.data.TensorDataset",
    "torch._C._set_grad_enabled",
    "torchtune_ac._recipes.full_finetune.run",
]


@pytest.mark.parametrize("path, reason", REFUSED_AFTER_IMPORT)
def test_objects_reached_through_allowed_paths_are_refused(path, reason, monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    check_component_path(path, "model")  # the string looks allowed...
    problems = problems_of(base_config(model={"_component_": path}))
    assert any(p.startswith(f"model._component_={path}: not allowed") and reason in p for p in problems), problems


@pytest.mark.parametrize("path", REFUSED_BEFORE_IMPORT)
def test_paths_outside_the_default_components_are_refused_before_import(path, monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    with pytest.raises(UserError, match=f"model._component_={path}: (not allowed|private names)"):
        check_component_path(path, "model")


@pytest.mark.parametrize(
    "path",
    [
        "torch.optim.AdamW",
        "torch.optim.Adafactor",  # defined in a private submodule of torch.optim
        "torch.optim.lr_scheduler.StepLR",
        "torch.nn.Linear",
        "torchtune_ac.models.llama_tiny",
        "torchtune_ac.models.families.llama.llama3_8b",  # the same builder by its defining module
        "torchtune_ac.data.load_tokenizer",
        "torchtune_ac.data.chat_dataset",
        "torchtune_ac.training.cosine_schedule_with_warmup",
        # torchao's low-bit AdamW, by their exact paths (the last is private in torchao)
        "torchao.optim.AdamW8bit",
        "torchao.optim.AdamW4bit",
        "torchao.optim._AdamW",
    ],
)
def test_default_components_are_allowed(path, monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    assert callable(parse_component({"_component_": path}, "model").target())


@pytest.mark.parametrize("path", ["torchao.optim.AdamWFp8", "torchao.optim.CPUOffloadOptimizer", "torchao.quantization.quantize_"])
def test_other_torchao_objects_need_allowing(path, monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    with pytest.raises(UserError, match=f"optimizer._component_={path}: not allowed"):
        check_component_path(path, "optimizer")


def test_a_missing_optional_package_is_a_user_error_naming_its_extra(monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` meets when it is not installed
    problems = problems_of(base_config(optimizer={"_component_": "torchao.optim.AdamW8bit", "lr": 1e-5}))
    assert problems == ["optimizer._component_=torchao.optim.AdamW8bit: needs the torchao package, which is not "
                        "installed: pip install 'torchtune_ac[ao]'"]


def test_an_allowed_prefix_admits_what_it_defines_not_what_it_imported(monkeypatch):
    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    assert parse_component({"_component_": "textwrap.dedent"}, "m", extra_allowed=["textwrap"]).target()("  x") == "x"
    # logging does `from string import Template`: allowing logging does not allow string.Template.
    component = parse_component({"_component_": "logging.Template"}, "m", extra_allowed=["logging"])
    with pytest.raises(UserError, match=r"not allowed \(it is string.Template\)"):
        component.target()


def test_validating_a_config_runs_no_foreign_code(tmp_path, monkeypatch):
    """`tune validate` builds the model component on the meta device: os.system in disguise must not get there."""
    from torchtune_ac.cli import main

    monkeypatch.delenv(ALLOWED_ENV_VAR, raising=False)
    marker = tmp_path / "pwned"
    for path in ("torch.nn.parallel.distributed.os.system", "torchtune_ac.cli.os.system"):
        argv = ["validate", "--config", "tiny/full", f"model._component_={path}", f"+model.command=touch {marker}"]
        assert main(argv) == 2
    assert not marker.exists()


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lr": "abc"}},
         "optimizer.lr='abc': expected float | torch.Tensor (argument of torch.optim.AdamW)"),
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "betas": 0.9}}, "optimizer.betas=0.9: expected tuple"),
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": "yes"}},
         "optimizer.fused='yes': expected bool | None"),
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lr": None}}, "optimizer.lr=null: expected float | torch.Tensor"),
        ({"model": {"_component_": "torchtune_ac.models.llama_tiny", "attn_dropout": True}},
         "model.attn_dropout=True: expected float (argument of torchtune_ac.models.llama_tiny)"),
        ({"lr_scheduler": {"_component_": "torchtune_ac.training.cosine_schedule_with_warmup", "num_warmup_steps": 1.5}},
         "lr_scheduler.num_warmup_steps=1.5: expected int"),
        # nested components are checked too
        ({"model": {"_component_": "torch.nn.Sequential", "a": {"_component_": "torch.nn.Linear", "in_features": "2"}}},
         "model.a.in_features='2': expected int (argument of torch.nn.Linear)"),
    ],
)
def test_component_argument_values_are_checked_against_annotations(changes, expected):
    problems = problems_of(base_config(**changes))
    assert any(expected in p for p in problems), problems


def test_component_arguments_that_fit_their_annotations_pass():
    cfg = validate_config(
        base_config(
            optimizer={"_component_": "torch.optim.AdamW", "lr": 1, "weight_decay": 0, "fused": None, "betas": [0.9, 0.95]},
            model={"_component_": "torchtune_ac.models.llama_tiny", "attn_dropout": 0, "max_seq_len": None},
        ),
        FullFinetuneConfig,
        source="c",
    )
    assert cfg.optimizer.kwargs["lr"] == 1


def test_activation_checkpointing_problems_are_listed_with_the_others():
    problems = problems_of(base_config(batch_size=0, ac_mode="sometimes", ac_option=True))
    assert problems[0] == "batch_size=0: must be >= 1"
    assert any(p.startswith("ac_mode='sometimes': unknown mode") for p in problems), problems
    assert any(p.startswith("ac_option=true: a boolean is not allowed") for p in problems), problems
    # Each problem once, in the AC module's words.
    problems = problems_of(base_config(enable_activation_checkpointing="maybe", ac_mode=5))
    assert problems == [
        "enable_activation_checkpointing='maybe': must be true or false",
        "ac_mode=5: unknown mode; allowed: none, full, selective, auto",
    ]


def test_the_layer_bound_of_ac_option_waits_for_the_model():
    cfg = validate_config(base_config(ac_mode="selective", ac_option=99), FullFinetuneConfig, source="c")
    assert cfg.ac == ACConfig(None, ACMode.SELECTIVE, 99)  # no layer count yet: checked against the built model
    assert problems_of(base_config(ac_mode="selective", ac_option=0)) == [
        "ac_option=0: must be an integer k from 1 to the model's layer count"
    ]


def test_vars_holds_the_users_own_variables_for_interpolation(tmp_path):
    """``vars:`` is the documented place for variables read only through ``${vars.name}``: its keys are not
    checked, every other key still is."""
    from torchtune_ac.config import load_config

    path = tmp_path / "c.yaml"
    config = base_config(max_seq_len="${vars.mylen}", batch_size="${vars.bs}")
    path.write_text(yaml.safe_dump({"vars": {"mylen": 128, "bs": 4, "note": "x"}, **config}))
    cfg = validate_config(load_config(str(path)), FullFinetuneConfig, source=str(path))
    assert (cfg.max_seq_len, cfg.batch_size) == (128, 4)
    cfg = validate_config(load_config(str(path), ["vars.mylen=64"]), FullFinetuneConfig, source=str(path),
                          overrides=["vars.mylen=64"])
    assert cfg.max_seq_len == 64


@pytest.mark.parametrize(
    "extra, problem",
    [
        # A top-level key of one's own is still a typo to the schema, and the message says where it goes instead.
        ({"mylen": 128}, "mylen: unknown key (a variable of your own goes under vars:, read as ${vars.mylen})"),
        ({"vars": 3}, "vars=3: expected a mapping of your own variables (name: value), used as ${vars.name}"),
        ({"vars": {"a": 1}, "batch_sise": 2}, "batch_sise: unknown key (did you mean batch_size?)"),
    ],
)
def test_keys_outside_vars_are_still_checked(extra, problem):
    assert problems_of(base_config(**extra)) == [problem]


def test_a_recipe_refuses_the_other_recipes_data_naming_both():
    from torchtune_ac.config.schema import FullDPOConfig

    with pytest.raises(UserError) as caught:  # a fine-tuning config given to full_dpo
        validate_config(base_config(), FullDPOConfig, source="c.yaml")
    assert str(caught.value).startswith("dataset: torchtune_ac.data.instruct_dataset makes samples, which the "
                                        "full_finetune recipe trains on; the full_dpo recipe trains on preference "
                                        "pairs (torchtune_ac.data.preference_dataset")
    pairs = {"_component_": "torchtune_ac.data.preference_dataset"}
    with pytest.raises(UserError, match="dataset_val: torchtune_ac.data.preference_dataset makes preference pairs, "
                                        "which the full_dpo recipe trains on; the full_finetune recipe trains on "
                                        "samples"):
        validate_config(base_config(dataset_val=pairs), FullFinetuneConfig, source="c.yaml")
    # A DPO config, its own keys included: each is named as full_dpo's.
    assert problems_of(base_config(dataset=pairs, dpo={"beta": 0.1})) == [
        "dpo: unknown key (a key of the full_dpo recipe: is this config for `tune run full_dpo`?)"]


def test_a_builder_without_a_return_annotation_is_checked_on_its_first_sample():
    from torchtune_ac.data.batching import PAIRS, SAMPLES

    samples = [{"tokens": [1, 2], "labels": [2, -100]}]
    SAMPLES.check_kind(samples, "dataset", "my.builder")
    with pytest.raises(UserError, match="dataset: my.builder gives samples without chosen_tokens, chosen_labels, "
                                        "rejected_tokens, rejected_labels: not the preference pairs this recipe"):
        PAIRS.check_kind(samples, "dataset", "my.builder")
