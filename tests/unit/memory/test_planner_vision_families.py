"""The planner with Qwen3-VL's and Gemma 3's images, checked as ``test_planner_vision.py`` checks Qwen2.5-VL's: the
simulated step keeps what a real forward with the same images keeps, its step's peak is within 15 % of a measured
step's, and the plan states the images it assumed (Gemma 3's: the one size its processor resizes to)."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _measure import measure_saved_activation_bytes

from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.memory.planner import ImageLoad, Workload, candidate_plans, estimate_memory
from torchtune_ac.models.families import family_of
from torchtune_ac.run.plan import planned_image_load
from torchtune_ac.memory.chunked_loss import loss_objective

REPO = Path(__file__).resolve().parents[3]
# family module -> (its tiny model's arguments constant, overrides of the tower's, of the model's). Gemma 3's tiny
# tower takes 56-pixel images (16 patches); at 224 pixels (256 patches, pooled to 64 tokens) the tower weighs in the
# measured step as Qwen3-VL's 256-pixel image does (256 patches, 64 tokens).
CASES = {
    "qwen3_vl": ("QWEN3_VL_TINY", {}, {}),
    "gemma3_vision": ("GEMMA3_VISION_TINY", {"image_size": 224}, {"mm_tokens_per_image": 64}),
}
# The images of the saved-activations check: two per row (Qwen3-VL: 64 pixels, 2 x 2 merge units of 32; Gemma 3: its
# one size, 56 pixels, pooled to 4 tokens).
LOADS = {"qwen3_vl": ImageLoad(2, 64, 64, 4), "gemma3_vision": ImageLoad(2, 56, 56, 4)}
# The measured step's image: one a row, of 64 image tokens.
MEASURED = {"qwen3_vl": ImageLoad(1, 256, 256, 64), "gemma3_vision": ImageLoad(1, 224, 224, 64)}


def tiny_args(family: str, measured: bool):
    """The family's builder and its tiny model's arguments, as ``CASES`` changes them for the measured step."""
    module = importlib.import_module(f"torchtune_ac.models.families.{family}")
    name, vision, top = CASES[family]
    args = getattr(module, name)
    if measured:
        args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, **vision), **top)
    return module.build, args


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3_vision"])
def test_saved_activations_with_images_equal_what_a_real_forward_keeps(family):
    build, args = tiny_args(family, measured=False)
    load = LOADS[family]
    none = candidate_plans(args.n_layers + args.vision.depth)[0]
    estimate = estimate_memory(lambda: build(args), adamw, Workload(batch_size=2, seq_len=64, images=load), [none])[0]
    torch.manual_seed(0)
    model = build(args)
    model.init_weights()
    inputs = family_of(model).images.batch(args, 2, 64, load.per_sample, load.height, load.width)
    labels = torch.randint(0, args.vocab_size, (2, 64))
    # The run's forward: Qwen3-VL's positions from the tokens and grids (the simulation is handed them); the pixels
    # are the batch's, which the planner counts apart.
    images = {"image_grid_thw": torch.tensor(inputs["image_grid_thw"])} if "image_grid_thw" in inputs else {}
    pixels = torch.randn_like(inputs["pixel_values"])
    measured = measure_saved_activation_bytes(
        lambda p: loss_objective(1)(model, {"tokens": inputs["tokens"], "labels": labels, "pixel_values": p, **images}),
        pixels, exclude=[*model.parameters(), pixels])
    assert estimate.saved_activations == pytest.approx(measured, rel=0.01)
    text_only = estimate_memory(lambda: build(args), adamw, Workload(batch_size=2, seq_len=64), [none])[0]
    assert text_only.saved_activations < estimate.saved_activations  # the images' activations are counted


MEASURE_STEPS = textwrap.dedent("""
    import dataclasses, gc, importlib, json, sys, psutil, torch
    from _measure import return_freed_memory_to_os, track_peak_rss
    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.training.step import train_step
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    results = {}
    for family, name, vision, top, rows, seq_len, per_row, side, modes in json.loads(sys.argv[1]):
        module = importlib.import_module(f"torchtune_ac.models.families.{family}")
        args = getattr(module, name)
        args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, **vision), **top)
        inputs = module.FAMILY.images.batch(args, rows, seq_len, per_row, side, side)
        batch = {"tokens": inputs["tokens"], "labels": torch.roll(inputs["tokens"], -1, dims=1),
                 "pixel_values": torch.randn_like(inputs["pixel_values"])}
        if "image_grid_thw" in inputs:  # the collate code's grids; positions are the model's to compute
            batch["image_grid_thw"] = torch.tensor(inputs["image_grid_thw"])
        measured = []
        for mode in modes:
            torch.manual_seed(0)
            model = module.build(args)
            model.init_weights()
            setup_activation_checkpointing(model, ac_mode=mode)
            stepper = build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-5), model, in_backward=False)
            train_step(model, stepper, [batch], ctx=ctx, objective=loss_objective(1))  # allocates the optimizer state
            return_freed_memory_to_os()
            before = psutil.Process().memory_info().rss
            with track_peak_rss() as peak:
                train_step(model, stepper, [batch], ctx=ctx, objective=loss_objective(1))
            measured.append(peak.peak_bytes - before)
            del model, stepper
            gc.collect()
        results[family] = [measured, sum(t.untyped_storage().nbytes() for t in batch.values())]
        del batch, inputs
        gc.collect()
    print(json.dumps(results))
""")
MODES = ["none", "full"]


@pytest.fixture(scope="module")
def measured_steps():
    """Per family: the measured step's peak under each of ``MODES``, and its batch's bytes (8 rows of 128 tokens,
    ``MEASURED``'s image in each), in one fresh process (as ``test_planner_vision.py``'s Qwen2.5-VL step)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    specs = [[family, name, vision, top, 8, 128, MEASURED[family].per_sample, MEASURED[family].height, MODES]
             for family, (name, vision, top) in CASES.items()]
    result = subprocess.run([sys.executable, "-c", MEASURE_STEPS, json.dumps(specs)], capture_output=True, text=True,
                            env=env, check=True)
    return json.loads(result.stdout.split("\n")[-2])


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3_vision"])
def test_the_estimated_step_peak_with_images_is_within_15_percent_of_a_measured_step(measured_steps, family):
    build, args = tiny_args(family, measured=True)
    measured, batch = measured_steps[family]
    plans = candidate_plans(args.n_layers + args.vision.depth)
    load = Workload(batch_size=8, seq_len=128, images=MEASURED[family])
    estimates = estimate_memory(lambda: build(args), adamw, load, [plans[0], plans[-1]])  # none, full
    for mode, estimate, bytes_ in zip(MODES, estimates, measured):
        assert estimate.step_peak == pytest.approx(bytes_ + batch, rel=0.15), mode


def _config(model, *overrides):
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    return load_recipe_config(recipe, "tiny/vlm", [f"model._component_=torchtune_ac.models.{model}", *overrides], [])


@pytest.mark.parametrize("model, overrides, expected, how", [
    ("qwen3_vl_tiny", (), (1, 64, 64, 4), "resized as the model's processor does"),  # 56 -> 2 x 2 units of 32
    ("gemma3_vision_tiny", (), (1, 56, 56, 4), "planned_images.height and width"),
    ("gemma3_vision_tiny", ("planned_images.height=null", "planned_images.width=null", "planned_images.per_sample=3"),
     (3, 56, 56, 4), "the one size the model's processor resizes every image to"),
    ("gemma3_vision_tiny", ("planned_images.height=900", "planned_images.width=300"), (1, 56, 56, 4),
     "resized as the model's processor does"),
])
def test_a_config_s_images_are_planned_at_the_size_the_family_s_processor_gives(model, overrides, expected, how):
    cfg = _config(model, *overrides)
    load = planned_image_load(cfg, build_meta_model(cfg.model, cfg.checkpoint_dir))
    assert (load.per_sample, load.height, load.width, load.tokens) == expected
    assert how in load.describe()


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3_vision"])
def test_a_real_batch_whose_image_tokens_are_not_its_images_is_still_refused(family):
    # The models skip counting the image tokens under fake tensors only (the planner's simulation).
    build, args = tiny_args(family, measured=False)
    model = build(args)
    inputs = family_of(model).images.batch(args, 1, 16, 1, 64, 64)
    tokens = inputs["tokens"].clone()
    tokens[0, 0] = 0  # one image token fewer than the image gives
    images = {"image_grid_thw": torch.tensor(inputs["image_grid_thw"])} if "image_grid_thw" in inputs else {}
    with pytest.raises(ValueError, match=r"^\d+ image tokens,? but"):  # the model's count, not mrope_positions'
        model(tokens, pixel_values=torch.randn_like(inputs["pixel_values"]), **images)
