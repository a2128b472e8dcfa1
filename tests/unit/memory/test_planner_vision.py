"""The planner with images (``Workload.images``): a vision-language step keeps what a real forward with the same
images keeps, its step's peak is within 15 % of a measured step's, its vision tower is simulated whole while the
decoder is extrapolated, a frozen tower has no gradients or optimizer state, and the images' size is resolved and
stated (``planned_images.*``)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _measure import measure_saved_activation_bytes

from torchtune_ac.cli import load_recipe, load_recipe_config, main, resolve_recipe_path
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR
from torchtune_ac.errors import UserError
from torchtune_ac.memory.planner import ImageLoad, Workload, candidate_plans, estimate_memory
from torchtune_ac.memory.planner.images import PlannedImagesConfig, resolve_image_load
from torchtune_ac.memory.planner.simulation import _simulate
from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY, build, freeze_
from torchtune_ac.models.vision.qwen2_5_vl import mrope_positions, planned_image_inputs, resized_image
from torchtune_ac.run.plan import planned_image_load
from torchtune_ac.memory.chunked_loss import loss_objective

REPO = Path(__file__).resolve().parents[3]
ARGS = QWEN2_5_VL_TINY
# 1 and 2 images of 56 x 56 pixels (4 tokens each), 1 of 112 x 112 (16 tokens): what tune plan assumes for tiny/vlm
# and larger loads.
LOADS = {"none": None, "1 x 56": ImageLoad(1, 56, 56, 4), "2 x 56": ImageLoad(2, 56, 56, 4),
         "1 x 112": ImageLoad(1, 112, 112, 16)}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


def workload(images):
    return Workload(batch_size=2, seq_len=64, images=images)


@pytest.fixture(scope="module")
def estimates():
    none = candidate_plans(ARGS.n_layers + ARGS.vision.depth)[0]
    return {name: estimate_memory(lambda: build(ARGS), adamw, workload(load), [none])[0]
            for name, load in LOADS.items()}


def test_the_planned_layout_is_the_processor_s_and_its_positions_are_mrope_s():
    inputs = planned_image_inputs(ARGS, 2, 64, 2, 56, 112)
    grids = torch.tensor(inputs["image_grid_thw"])
    assert grids.tolist() == [[1, 4, 8]] * 4 and inputs["pixel_values"].shape == (4 * 32, ARGS.vision.patch_values)
    assert int((inputs["tokens"] == ARGS.image_token_id).sum()) == 4 * 8
    expected = mrope_positions(inputs["tokens"], grids, ARGS.image_token_id, ARGS.vision.spatial_merge_size)
    assert torch.equal(inputs["positions"], expected)


@pytest.mark.parametrize("name", [name for name in LOADS if name != "none"])
def test_saved_activations_with_images_equal_what_a_real_forward_keeps(estimates, name):
    load = LOADS[name]
    torch.manual_seed(0)
    model = build(ARGS)
    model.init_weights()
    inputs = planned_image_inputs(ARGS, 2, 64, load.per_sample, load.height, load.width)
    labels = torch.randint(0, ARGS.vocab_size, (2, 64))
    grids = torch.tensor(inputs["image_grid_thw"])
    pixels = torch.randn_like(inputs["pixel_values"])
    # The run's forward: positions from the tokens and grids (the simulation is handed them); the pixels are the
    # batch's, which the planner counts apart.
    measured = measure_saved_activation_bytes(
        lambda p: loss_objective(1)(model, {"tokens": inputs["tokens"], "labels": labels, "pixel_values": p,
                                            "image_grid_thw": grids}),
        pixels, exclude=[*model.parameters(), pixels])
    assert estimates[name].saved_activations == pytest.approx(measured, rel=0.01)


def test_images_add_to_the_step_as_their_count_and_size_grow(estimates):
    peaks = {name: e.step_peak for name, e in estimates.items()}
    assert peaks["none"] < peaks["1 x 56"] < peaks["2 x 56"] < peaks["1 x 112"]
    # The parameters and optimizer state are the same model's whatever its batch.
    assert len({(e.parameters, e.optimizer) for e in estimates.values()}) == 1


def test_a_frozen_tower_has_no_gradients_or_optimizer_state_in_the_plan():
    plan = candidate_plans(ARGS.n_layers + ARGS.vision.depth)[-1]
    tower = build(ARGS).visual
    tower_params = [p for m in (tower.patch_embed, tower.blocks) for p in m.parameters()]
    trained, frozen = (estimate_memory(lambda f=f: freeze_(build(ARGS), vision_tower=f, projector=False), adamw,
                                       workload(LOADS["1 x 56"]), [plan])[0] for f in (False, True))
    assert trained.parameters == frozen.parameters
    # AdamW's two fp32 states of each tower parameter, and its fp32 step count.
    tower_state = sum(2 * 4 * p.numel() + 4 for p in tower_params)
    assert trained.optimizer - frozen.optimizer == tower_state
    assert frozen.step_peak < trained.step_peak


def test_the_decoder_is_extrapolated_with_the_tower_simulated_whole():
    # 2 tower blocks and 6 decoder blocks: simulated with 2 + 2 and 2 + 4, extrapolated to 2 + 6.
    args = dataclasses.replace(ARGS, n_layers=6)
    load = workload(LOADS["1 x 56"])
    plan = candidate_plans(args.n_layers + args.vision.depth)[3]  # every 2nd of the tower's blocks, then these
    estimate = estimate_memory(lambda: build(args), adamw, load, [plan])[0]
    whole = _simulate(lambda: build(args), adamw, plan.mode.value, plan.option, None, load)
    peak = max(p.value for p in whole.peaks.values())
    assert estimate.step_peak == pytest.approx(peak + whole.batch, rel=0.03)
    assert estimate.saved_activations == pytest.approx(whole.saved_activations, rel=0.01)


def resized(height, width):
    return resized_image(ARGS.vision, height, width)


@pytest.mark.parametrize("keys, max_seq_len, expected", [
    (PlannedImagesConfig(), 64, (1, 112, 112, 16)),  # the processor's max_pixels, 112 x 112
    (PlannedImagesConfig(per_sample=8), 64, (8, 56, 56, 4)),  # made smaller to fit the row
    (PlannedImagesConfig(height=60, width=90), 64, (1, 56, 84, 6)),  # rounded to the 28-pixel grid
    (PlannedImagesConfig(per_sample=0), 64, None),
])
def test_the_planned_size_is_the_user_s_or_the_largest_the_processor_passes_that_fits(keys, max_seq_len, expected):
    load = resolve_image_load(keys, resized, 112 * 112, "its file", max_seq_len)
    assert (None if load is None else (load.per_sample, load.height, load.width, load.tokens)) == expected


@pytest.mark.parametrize("keys, message", [
    (PlannedImagesConfig(height=56), "set both, or neither"),
    (PlannedImagesConfig(per_sample=2, height=224, width=224), "2 x 64 image tokens, more than max_seq_len=64"),
])
def test_planned_images_that_cannot_be_planned_are_refused_naming_the_keys(keys, message):
    with pytest.raises(UserError, match=message):
        resolve_image_load(keys, resized, 112 * 112, "its file", 64)


def _vlm_config(*overrides):
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    return load_recipe_config(recipe, "tiny/vlm", list(overrides), [])


@pytest.mark.parametrize("overrides, expected, how", [
    ((), (1, 56, 56, 4), "planned_images.height and width"),  # tiny/vlm's: the embedded task's images
    (("planned_images.height=null", "planned_images.width=null", f"dataset.processor={EMBEDDED_VLM_PROCESSOR_DIR}"),
     (1, 112, 112, 16), "preprocessor_config.json"),  # its processor's max_pixels
    (("planned_images.per_sample=0",), None, None),
])
def test_a_config_s_images_are_planned_from_its_keys_or_its_processor(overrides, expected, how):
    cfg = _vlm_config(*overrides)
    load = planned_image_load(cfg, build_meta_model(cfg.model, cfg.checkpoint_dir))
    assert (None if load is None else (load.per_sample, load.height, load.width, load.tokens)) == expected
    assert load is None or how in load.describe()


def test_tune_plan_refuses_images_that_do_not_fit_in_one_line(capsys):
    assert main(["plan", "--config", "tiny/vlm", "planned_images.height=560", "planned_images.width=560"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 x 400 image tokens, more than max_seq_len=64" in err[0]


MEASURE_STEPS = textwrap.dedent("""
    import gc, json, sys, psutil, torch
    from _measure import return_freed_memory_to_os, track_peak_rss
    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY, build
    from torchtune_ac.models.vision.qwen2_5_vl import planned_image_inputs
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.training.step import train_step
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    rows, seq_len, per_row, side = json.loads(sys.argv[1])
    inputs = planned_image_inputs(QWEN2_5_VL_TINY, rows, seq_len, per_row, side, side)
    batch = [{"tokens": inputs["tokens"], "labels": torch.roll(inputs["tokens"], -1, dims=1),
              "pixel_values": torch.randn_like(inputs["pixel_values"]),
              "image_grid_thw": torch.tensor(inputs["image_grid_thw"])}]
    measured = []
    for mode in json.loads(sys.argv[2]):
        torch.manual_seed(0)
        model = build(QWEN2_5_VL_TINY)
        model.init_weights()
        setup_activation_checkpointing(model, ac_mode=mode)
        stepper = build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-5), model, in_backward=False)
        train_step(model, stepper, batch, ctx=ctx, objective=loss_objective(1))  # allocates the optimizer state
        return_freed_memory_to_os()
        before = psutil.Process().memory_info().rss
        with track_peak_rss() as peak:
            train_step(model, stepper, batch, ctx=ctx, objective=loss_objective(1))
        measured.append(peak.peak_bytes - before)
        del model, stepper
        gc.collect()
    print(json.dumps([measured, sum(t.untyped_storage().nbytes() for t in batch[0].values())]))
""")


def test_the_estimated_step_peak_with_images_is_within_15_percent_of_a_measured_step():
    """As ``test_planner.py``'s text step: 8 rows of 128 tokens, each with an image of 224 x 224 pixels (64 tokens,
    256 patches: the tower attends over 2,048 at once). The batch exists before the measured step; the plan counts
    it in the step (the collate code makes one every step)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    modes = ["none", "full"]
    result = subprocess.run([sys.executable, "-c", MEASURE_STEPS, json.dumps([8, 128, 1, 224]), json.dumps(modes)],
                            capture_output=True, text=True, env=env, check=True)
    measured, batch = json.loads(result.stdout.split("\n")[-2])
    plans = candidate_plans(ARGS.n_layers + ARGS.vision.depth)
    load = Workload(batch_size=8, seq_len=128, images=ImageLoad(1, 224, 224, 64))
    for mode, bytes_ in zip(modes, measured):
        plan = plans[0] if mode == "none" else plans[-1]
        estimate = estimate_memory(lambda: build(ARGS), adamw, load, [plan])[0]
        assert estimate.step_peak == pytest.approx(bytes_ + batch, rel=0.15), mode
