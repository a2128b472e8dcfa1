"""Schema validation: every problem is reported, each naming the key, the value and what is allowed."""

import pytest

from torchtune_ac.config import ConfigError, DType, FullFinetuneConfig, validate_config
from torchtune_ac.config.components import ALLOWED_ENV_VAR, Component, check_component_path, parse_component
from torchtune_ac.errors import UserError


def base_config(**changes):
    cfg = {
        "output_dir": "/tmp/out",
        "model": {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3},
        "tokenizer": {"_component_": "torch.nn.Identity"},
        "dataset": {"_component_": "torch.utils.data.TensorDataset"},
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
        ({"batch_size": "four"}, "batch_size='four': expected an integer"),
        ({"batch_size": 0}, "batch_size=0: must be >= 1"),
        ({"batch_size": True}, "batch_size=True: expected an integer"),
        ({"batch_size": 2.5}, "batch_size=2.5: expected an integer"),
        ({"epochs": -1}, "epochs=-1: must be >= 1"),
        ({"max_seq_len": 0}, "max_seq_len=0: must be >= 1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: must be >= 1"),
        ({"clip_grad_norm": 0}, "clip_grad_norm=0.0: must be > 0.0"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan: expected a number"),
        ({"shuffle": "yes"}, "shuffle='yes': expected true or false"),
        ({"dtype": "fp16"}, "dtype='fp16': expected one of fp32, bf16"),
        ({"device": "tpu"}, "device='tpu': expected one of auto, cpu, cuda"),
        ({"output_dir": None}, "output_dir: must not be null"),
        ({"fsdp": {"reshard_after_forwards": True}}, "fsdp.reshard_after_forwards: unknown key (did you mean fsdp.reshard_after_forward?)"),
        ({"fsdp": 3}, "fsdp=3: expected a mapping"),
        ({"optimizer": "adamw"}, "optimizer='adamw': expected a mapping with _component_"),
        ({"optimizer": {"lr": 1}}, "optimizer: expected a mapping with a _component_ key"),
        ({"optimizer": {"_component_": "os.system"}}, "optimizer._component_=os.system: not allowed"),
        ({"optimizer": {"_component_": "torch.optim.AdamW", "lrr": 1}}, "optimizer.lrr: not an argument of torch.optim.AdamW (did you mean lr?)"),
        ({"optimizer": {"_component_": "torch.optim.AdamWW"}}, "did you mean torch.optim.AdamW?"),
        ({"dataset": {"_component_": "torch.utils.data.TensorDataset", "max_seq_len": 3}}, "dataset.max_seq_len: set by the recipe"),
    ],
)
def test_each_problem_is_named(changes, expected):
    problems = problems_of(base_config(**changes))
    assert any(expected in problem for problem in problems), problems


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
    assert "--allow-component mypkg" in str(info.value)
    assert f"{ALLOWED_ENV_VAR}=mypkg" in str(info.value)


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
