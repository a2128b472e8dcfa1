"""A vision-language model composes with the memory features as a text model does, on the tiny Qwen2.5-VL
(``tiny/vlm``'s model) assembled by the run's own order (``parallel_testlib.build_model``) and given image-text
batches: every AC mode over both towers gives the loss and gradients of none, the optimizer step in backward trains
as the step after it (a frozen tower too), AC on Qwen3-VL's towers (its DeepStack features cross them) gives
the loss and gradients of none, torchao's 8-bit AdamW trains with state for the trained parameters
only, and HSDP (2 replicas x 2 shards on 4 gloo ranks, both towers sharded) trains as one process; FSDP2 on 2
gloo ranks (one rank's rows without an image) trains the tiny Qwen3-VL and Gemma 3 as one process. (FSDP2 on 2
processes, the chunked loss, freezing and resume run through ``tune run`` in tests/integration/test_vlm_runs.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gloo_testlib import run_on_gloo_ranks
from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
from torch.distributed.tensor import DTensor, Replicate, Shard
from parallel_testlib import CPU, build_model
import parallel_testlib

from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
from torchtune_ac.activation_checkpointing.mechanism import is_checkpointed
from torchtune_ac.memory.features import MemorySettings
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.models.families import gemma3_vision, qwen3_vl
from torchtune_ac.models.families.qwen2_5_vl import FAMILY, QWEN2_5_VL_TINY, freeze_
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import train_step

ALONE = DistributedContext(0, 1, 0, CPU)
IMAGE = QWEN2_5_VL_TINY.image_token_id
BLOCKS = QWEN2_5_VL_TINY.vision.depth + QWEN2_5_VL_TINY.n_layers  # the tower's blocks, then the decoder's
STEPS = 3
# The other tiny VLMs, by builder name: their family and arguments (the same image token id, 516).
OTHERS = {"qwen3_vl_tiny": (qwen3_vl.FAMILY, qwen3_vl.QWEN3_VL_TINY),
          "gemma3_vision_tiny": (gemma3_vision.FAMILY, gemma3_vision.GEMMA3_VISION_TINY)}
# Per row of 24 tokens, the images as (first token, (patch rows, patch columns)): 4 patches merge into a token.
ROWS = [[(2, (4, 4))], [(1, (4, 8)), (14, (4, 4))], [], [(6, (8, 4))]]
LENGTH = 24


@dataclasses.dataclass(frozen=True)
class Case(parallel_testlib.Case):
    model: str = "qwen2_5_vl_tiny"
    frozen_tower: bool = False

    @property
    def args(self):
        return OTHERS[self.model][1] if self.model in OTHERS else QWEN2_5_VL_TINY

    @property
    def family(self):
        if self.model in OTHERS:
            return OTHERS[self.model][0]
        freeze = self.frozen_tower
        return dataclasses.replace(FAMILY, build=lambda args: freeze_(FAMILY.build(args), vision_tower=freeze,
                                                                      projector=False))

    def memory(self) -> MemoryPlan:  # ac_option counts the tower's blocks and the decoder's, as a run does
        ac = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=self.ac_mode, ac_option=self.ac_option,
                             n_layers=self.args.vision.depth + self.args.n_layers)
        return MemoryPlan(ac, MemorySettings(optimizer_in_bwd=self.in_backward, loss_chunks=self.loss_chunks))


def image_batch(step: int, first: int = 0, count: int = len(ROWS), *, case: Case = Case(),
                rows: list = ROWS) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch for ``case``'s model: random text with ``rows``' images placed in it, their pixels;
    rows ``first`` to ``first + count`` of it (no image keys where those rows hold no image, as the collate makes).
    Gemma 3's images are ``mm_tokens_per_image`` tokens and one pixel tensor each, whatever the grid."""
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, 96, (len(rows), LENGTH), generator=g)
    gemma = case.model == "gemma3_vision_tiny"
    grids = []
    for r, images in enumerate(rows):
        for start, (h, w) in images:
            tokens[r, start:start + (case.args.mm_tokens_per_image if gemma else h * w // 4)] = IMAGE
            grids.append([1, h, w])
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[labels == IMAGE] = IGNORE_INDEX
    grid = torch.tensor(grids)
    images_before = [sum(len(r) for r in rows[:k]) for k in (first, first + count)]
    out = {"tokens": tokens[first:first + count], "labels": labels[first:first + count]}
    if images_before[1] == images_before[0]:
        return out
    if gemma:  # [images, 3, side, side]
        side = case.args.vision.image_size
        out["pixel_values"] = torch.randn(len(grids), 3, side, side, generator=g)[slice(*images_before)]
    else:  # [patches, 3 x frames x patch^2], each image's grid
        vision = case.args.vision
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size ** 2,
                             generator=g)
        patches_before = [int(grid[:i].prod(-1).sum()) for i in images_before]
        out["pixel_values"] = pixels[patches_before[0]:patches_before[1]]
        out["image_grid_thw"] = grid[images_before[0]:images_before[1]]
    return out


def loss_and_gradients(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """One forward and backward: the loss, the gradients, and which blocks (tower's first) are checkpointed."""
    model = build_model(case, ALONE).model
    loss = case.memory().objective()(model, image_batch(0, case=case))  # the summed cross-entropy
    loss.backward()
    checkpointed = [i for i, block in enumerate(transformer_blocks(model)) if is_checkpointed(block)]
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, checkpointed


def train(case: Case, *, clip: float | None = None, ctx: DistributedContext = ALONE, parallelism=None, mesh=None,
          rows: list = ROWS):
    """STEPS steps on ``rows``' batches (this data-parallel rank taking its rows): the step results, the full
    weights after, and what trained them."""
    assembled = build_model(case, ctx, parallelism, mesh)
    share = len(rows) // ctx.world_size
    results = [train_step(assembled.model, assembled.stepper,
                          [image_batch(step, ctx.rank * share, share, case=case, rows=rows)], ctx=ctx,
                          objective=case.memory().objective(), clip_grad_norm=clip) for step in range(STEPS)]
    weights = {name: getattr(p, "full_tensor", lambda p=p: p)().detach().clone()
               for name, p in assembled.model.named_parameters()}
    return results, weights, assembled


@pytest.fixture(scope="module")
def plain():
    return loss_and_gradients(Case())


@pytest.mark.parametrize("ac_mode, ac_option, blocks", [("full", None, [0, 1, 2, 3]), ("selective", 1, [0, 1, 2, 3]),
                                                        ("selective", 2, [1, 3]), ("selective", 3, [2]),
                                                        ("selective", "op", [0, 1, 2, 3])],
                         ids=["full", "every_block", "a_tower_and_a_decoder_block", "decoder_block_0", "per_op"])
def test_every_ac_mode_on_both_towers_gives_the_loss_and_gradients_of_none_bit_for_bit(plain, ac_mode, ac_option,
                                                                                        blocks):
    loss, grads, checkpointed = loss_and_gradients(Case(ac_mode=ac_mode, ac_option=ac_option))
    assert checkpointed == blocks  # ac_option counts the tower's 2 blocks, then the decoder's 2
    # Bit for bit: the recompute replays the same ops on the same inputs in one process.
    plain_loss, plain_grads, none = plain
    assert none == []
    assert torch.equal(loss, plain_loss)
    assert plain_grads["visual.blocks.0.attn.qkv.weight"].any()  # the tower's blocks train (and recompute)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.fixture(scope="module")
def qwen3_vl_plain():
    return loss_and_gradients(Case(model="qwen3_vl_tiny"))


@pytest.mark.parametrize("ac_mode, ac_option, blocks", [("full", None, [0, 1, 2, 3, 4, 5]),
                                                        ("selective", 2, [1, 3, 5])], ids=["full", "every_2nd"])
def test_ac_on_qwen3_vl_s_towers_gives_the_loss_and_gradients_of_none_bit_for_bit(qwen3_vl_plain, ac_mode, ac_option,
                                                                                   blocks):
    # Its DeepStack features leave tower blocks 0 and 1 and join decoder layers 0 and 1: checkpointed on both sides.
    plain_loss, plain_grads, none = qwen3_vl_plain
    loss, grads, checkpointed = loss_and_gradients(Case(model="qwen3_vl_tiny", ac_mode=ac_mode, ac_option=ac_option))
    assert (none, checkpointed) == ([], blocks)  # the tower's 3 blocks, then the decoder's 3
    assert torch.equal(loss, plain_loss)
    assert plain_grads["visual.deepstack_merger_list.0.linear_fc1.weight"].any()
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("frozen_tower", [False, True], ids=["both_towers", "frozen_tower"])
def test_the_step_in_backward_trains_as_the_step_after_it(frozen_tower):
    (after, after_weights, _), (inside, inside_weights, _) = (
        train(Case(in_backward=in_backward, frozen_tower=frozen_tower)) for in_backward in (False, True))
    n = sum(w.numel() for w in after_weights.values())
    for a, b in zip(after, inside):
        # The same forwards and backwards: equal losses; the norm adds its squares in another order.
        assert a.loss == b.loss
        assert_close(torch.tensor(b.grad_norm), torch.tensor(a.grad_norm), terms=n, what="gradient norm")
    for name, weight in after_weights.items():
        assert torch.equal(inside_weights[name], weight), name


def test_8_bit_adamw_trains_with_state_for_the_trained_parameters_only(monkeypatch):
    # torchao compiles its update per parameter shape (minutes on a CPU): here it runs eagerly, the same arithmetic.
    monkeypatch.setattr(torch, "compile", lambda function=None, **options: function)
    results, weights, assembled = train(Case(optimizer="adamw8bit", frozen_tower=True), clip=1.0)
    start = build_model(Case(frozen_tower=True), ALONE).model
    optimizer = assembled.stepper.optimizer
    assert results[-1].loss < results[0].loss, [r.loss for r in results]
    for name, param in assembled.model.named_parameters():
        trained = not torch.equal(weights[name], start.get_parameter(name))
        frozen = name.startswith(("visual.patch_embed.", "visual.blocks."))
        assert trained is not frozen and (param in optimizer.state) is not frozen, name
    state = optimizer.state[assembled.model.get_parameter("layers.0.mlp.gate_proj.weight")]["exp_avg"]
    assert type(state).__name__ == "OptimState8bit"


def train_on_hsdp_ranks(rank: int, out: str) -> None:
    world = 4
    parallelism = Parallelism(world, replicate=2)
    ctx = DistributedContext(rank, world, 0, CPU, parallelism)
    results, weights, assembled = train(Case(), clip=1.0, ctx=ctx, parallelism=parallelism,
                                        mesh=parallelism.build_mesh("cpu"))
    tower = assembled.model.visual.blocks[0].attn.qkv.weight  # the tower is sharded too: replicated x sharded
    assert isinstance(tower, DTensor) and tower.placements == (Replicate(), Shard(0)), tower
    if rank == 0:
        torch.save(([(r.loss, r.grad_norm) for r in results], weights), out)


@pytest.mark.numerics
@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_2_replicas_x_2_shards_trains_image_batches_as_one_process(tmp_path):
    """Each of 4 ranks takes one row of the global batch (rank 2's has no image: its tower runs on a blank one)."""
    out = tmp_path / "hsdp.pt"
    run_on_gloo_ranks(train_on_hsdp_ranks, str(out), store_dir=tmp_path, world_size=4)
    hsdp, hsdp_weights = torch.load(out, weights_only=False)
    one, one_weights, _ = train(Case(), clip=1.0)
    # Both towers' reductions; the decoder's are the longer (as test_vlm_runs.py's TERMS)
    terms = 2 * llama_terms(QWEN2_5_VL_TINY, LENGTH, len(ROWS) * LENGTH)
    assert_steps_alike([loss for loss, _ in hsdp], [r.loss for r in one], terms=terms, what="loss")
    assert_steps_alike([norm for _, norm in hsdp], [r.grad_norm for r in one], terms=terms, what="gradient norm")
    assert_weights_trained_alike(hsdp_weights, one_weights, lrs=[1e-2] * STEPS, terms=terms)


# Rank 1's rows hold no image: its tower runs on a blank one (Gemma 3: one blank patch).
ROWS_RANK_1_WITHOUT_IMAGES = [ROWS[0], ROWS[1], [], []]
OTHER_CASES = [Case(model=name, loss_chunks=2) for name in OTHERS]


def train_other_families_on_fsdp_ranks(rank: int, out: str) -> None:
    world = 2
    parallelism = Parallelism(world)
    ctx = DistributedContext(rank, world, 0, CPU, parallelism)
    trained = [train(case, clip=1.0, ctx=ctx, parallelism=parallelism, mesh=parallelism.build_mesh("cpu"),
                     rows=ROWS_RANK_1_WITHOUT_IMAGES)[:2] for case in OTHER_CASES]
    if rank == 0:
        torch.save([([(r.loss, r.grad_norm) for r in results], weights) for results, weights in trained], out)


@pytest.mark.numerics
@pytest.mark.distributed
def test_fsdp2_on_2_processes_trains_qwen3_vl_and_gemma3_as_one_process(tmp_path):
    """One spawn of 2 gloo ranks trains both tiny models in turn (Qwen2.5-VL's 2 processes run through tune run)."""
    out = tmp_path / "fsdp.pt"
    run_on_gloo_ranks(train_other_families_on_fsdp_ranks, str(out), store_dir=tmp_path, world_size=2)
    trained = torch.load(out, weights_only=False)
    assert len(trained) == len(OTHER_CASES)
    for case, (two, two_weights) in zip(OTHER_CASES, trained):
        one, one_weights, _ = train(case, clip=1.0, rows=ROWS_RANK_1_WITHOUT_IMAGES)
        assert len(two) == STEPS
        terms = 2 * llama_terms(case.args, LENGTH, len(ROWS) * LENGTH)  # both towers, as the HSDP test's
        assert_steps_alike([loss for loss, _ in two], [r.loss for r in one], terms=terms, what=f"{case.model} loss")
        assert_steps_alike([norm for _, norm in two], [r.grad_norm for r in one], terms=terms,
                           what=f"{case.model} gradient norm")
        assert two_weights.keys() == one_weights.keys()
        assert_weights_trained_alike(two_weights, one_weights, lrs=[1e-2] * STEPS, terms=terms)
