"""GRPO composes as the SFT step does, on given rollouts (the same prompts, completions and rewards handed to every
side, as the TRL parity test hands TRL ours): FSDP2 on 2 processes trains as 1 process, every AC mode gives the loss
and gradients of none, and the optimizer step in backward trains as the step after it.

The rollouts go through the loop's own code (``rollout_batch``, the group advantages over every rank's completions,
the old log-probabilities of the generating policy) and the run's assembly (``parallel_testlib.build_model``): one
rollout of 4 prompts x 2 completions, ``num_iterations`` 2, the KL term on.
"""

import dataclasses

import pytest
import torch
from gloo_testlib import run_on_gloo_ranks
from models_testlib import TINY
from numerics import assert_close, assert_weights_trained_alike, llama_terms
from parallel_testlib import CPU, build_model, compiled_by_aot_eager
import parallel_testlib

from torchtune_ac.generation import SamplingConfig, generate
from torchtune_ac.models.families.llama import FAMILY as LLAMA
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.training.grpo import GRPOConfig, GRPOLossType, GRPOObjective, completion_logps, group_advantages
from torchtune_ac.training.rollouts import gathered_for_decoding, pack_completion_rows, rollout_batch
from torchtune_ac.training.step import train_step

ARGS = TINY
PROMPTS = [[5, 17, 30], [88, 9, 41, 60, 7], [3, 70], [11, 12, 13, 14]]
COMPLETIONS = [[44, 61, 2, 31, 12, 9], [40, 3, 3], [7, 8], [20, 19, 26, 3, 77, 50], [1, 2, 3, 4], [90],
               [33, 34, 35, 36, 37, 38], [8, 8]]  # two per prompt, a group's adjacent
REWARDS = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5, 0.0, 2.0])
TRUNCATED = [False, False, False, True, False, False, True, False]
MAX_NEW, TEMPERATURE, CHUNKS, LR = 6, 0.7, 3, 1e-2
ALONE = DistributedContext(0, 1, 0, CPU)


def grpo_config(loss_type: GRPOLossType) -> GRPOConfig:
    return GRPOConfig(num_generations=2, loss_type=loss_type, beta=0.04, num_iterations=2, epsilon_high=0.28)


@dataclasses.dataclass(frozen=True)
class Case(parallel_testlib.Case):
    model: str = "llama"

    @property
    def args(self):
        return ARGS

    @property
    def family(self):
        return LLAMA


def rollout(rows: range, config: GRPOConfig) -> dict[str, torch.Tensor]:
    """The loss pass's batch of completions ``rows`` (whole groups), their advantages normalised over all 8."""
    advantages = group_advantages(REWARDS, config.num_generations, config.scale_rewards).advantages
    prompts = [PROMPTS[i // config.num_generations] for i in rows]
    batch = rollout_batch(prompts, [COMPLETIONS[i] for i in rows], [TRUNCATED[i] for i in rows],
                          advantages[rows.start:rows.stop], pad_id=0, mask_truncated=False)
    # The reference's log-probabilities: given, one value per (row, column) of the widest layout, for any split.
    noise = torch.randn(len(COMPLETIONS), 16, generator=torch.Generator().manual_seed(3))[rows.start:rows.stop]
    batch["ref_logps"] = -2.0 + noise[:, :batch["labels"].shape[1]] * (batch["labels"] != -100)
    return batch


def train_rollout(assembled, ctx: DistributedContext, rows: range, config: GRPOConfig, *,
                  clip: float | None = 1.0) -> tuple[list, dict[str, torch.Tensor]]:
    """The loop's step on the given rollout: the generating policy's log-probabilities, then ``num_iterations``
    optimizer steps; the step results and the full weights after."""
    model = assembled.model
    batch = rollout(rows, config)
    with torch.no_grad():
        batch["old_logps"] = completion_logps(model, batch, n_chunks=CHUNKS, temperature=TEMPERATURE)
    objective = GRPOObjective(config, n_chunks=CHUNKS, temperature=TEMPERATURE, max_new_tokens=MAX_NEW)
    results = [train_step(model, assembled.stepper, [batch], ctx=ctx, objective=objective, clip_grad_norm=clip)
               for _ in range(config.num_iterations)]
    weights = {name: getattr(p, "full_tensor", lambda p=p: p)().detach().clone()
               for name, p in model.named_parameters()}
    return results, weights


def decode_greedily(model: torch.nn.Module, *, compile_decode: bool = False) -> list[list[int]]:
    """The prompts' greedy completions, as the rollout decodes them (the groups of a sharded model gathered)."""
    with gathered_for_decoding(model), compiled_by_aot_eager():
        return generate(model, PROMPTS, SamplingConfig(MAX_NEW, temperature=0), eos_ids=[2], pad_id=0,
                        compile_decode=compile_decode).tokens


LOSS_TYPES = (GRPOLossType.DAPO, GRPOLossType.GRPO)  # one normalised over every rank's tokens, one per completion


def train_on_two_ranks(rank: int, out: str) -> None:
    world = 2
    parallelism = Parallelism(world)
    mesh, ctx = parallelism.build_mesh("cpu"), DistributedContext(rank, world, 0, CPU, parallelism)
    half = len(COMPLETIONS) // world
    models = {loss_type: build_model(Case(), ctx, parallelism, mesh) for loss_type in LOSS_TYPES}
    # The rollout's decoding of the sharded policy (its groups gathered for it), compiled and eager: the same
    # completions. Compiled by aot_eager: Dynamo traces FSDP2's hooks here in seconds; inductor's kernels would take
    # 80 s a rank on a cold cache (measured), and their numbers are checked in one process (test_decode.py).
    decoded = [decode_greedily(models[LOSS_TYPES[0]].model, compile_decode=compiled) for compiled in (False, True)]
    assert decoded[1] == decoded[0], f"rank {rank}: compiled decoding {decoded[1]}, eager {decoded[0]}"
    runs = {loss_type: train_rollout(models[loss_type], ctx, range(rank * half, (rank + 1) * half),
                                     grpo_config(loss_type))
            for loss_type in LOSS_TYPES}
    runs["decoded"] = decoded[0]
    if rank == 0:
        torch.save(runs, out)


@pytest.mark.numerics
@pytest.mark.distributed
def test_fsdp2_on_two_processes_trains_given_rollouts_as_one_process(tmp_path):
    out = tmp_path / "two.pt"
    run_on_gloo_ranks(train_on_two_ranks, str(out), store_dir=tmp_path)
    two = torch.load(out, weights_only=False)
    assert two["decoded"] == decode_greedily(build_model(Case(), ALONE).model)
    width = max(len(PROMPTS[i // 2]) + len(c) for i, c in enumerate(COMPLETIONS))
    terms = llama_terms(ARGS, width, len(COMPLETIONS) * width)
    for loss_type in LOSS_TYPES:
        (one_results, one_weights), (two_results, two_weights) = (
            train_rollout(build_model(Case(), ALONE), ALONE, range(len(COMPLETIONS)), grpo_config(loss_type)),
            two[loss_type])
        for k, (a, b) in enumerate(zip(two_results, one_results)):
            what = f"{loss_type.value}, iteration {k + 1}"
            # The loss is a cancellation of per-token terms of the size of the advantages and log-probabilities.
            assert_close(a.loss, b.loss, terms=terms, magnitude=(1 + float(REWARDS.abs().max())) * 10,
                         what=f"{what}: loss")
            assert_close(a.grad_norm, b.grad_norm, terms=terms, what=f"{what}: gradient norm")
            assert a.target_tokens == b.target_tokens
            assert_close(torch.tensor(list(a.extra.values())), torch.tensor(list(b.extra.values())), terms=terms,
                         magnitude=10.0, what=f"{what}: metrics")
        assert_weights_trained_alike(two_weights, one_weights, lrs=[LR] * len(one_results), terms=terms)


@pytest.fixture(scope="module")
def given():
    """The rollout of all 8 completions with the generating policy's log-probabilities, and the loss and gradients
    of one GRPO pass over it without AC."""
    config = grpo_config(GRPOLossType.DAPO)
    batch = rollout(range(len(COMPLETIONS)), config)
    model = build_model(Case(), ALONE).model
    with torch.no_grad():
        batch["old_logps"] = completion_logps(model, batch, n_chunks=CHUNKS, temperature=TEMPERATURE) + 0.1
    return batch, loss_and_gradients(model, batch, config)


def loss_and_gradients(model, batch, config):
    objective = GRPOObjective(config, n_chunks=CHUNKS, temperature=TEMPERATURE, max_new_tokens=MAX_NEW)
    parts = objective(model, batch)
    parts.loss.backward()
    return parts, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("ac_mode, ac_option", [("full", None), ("selective", 1), ("selective", 2),
                                                ("selective", "op")])
def test_every_ac_mode_gives_the_loss_and_gradients_of_none_bit_for_bit(given, ac_mode, ac_option):
    batch, (plain, plain_grads) = given
    model = build_model(Case(ac_mode=ac_mode, ac_option=ac_option), ALONE).model
    parts, grads = loss_and_gradients(model, batch, grpo_config(GRPOLossType.DAPO))
    # Bit for bit: the recompute replays the same ops on the same inputs in one process.
    assert torch.equal(parts.loss, plain.loss) and torch.equal(parts.metrics, plain.metrics)
    assert all(torch.equal(grads[name], grad) for name, grad in plain_grads.items())


def test_the_step_in_backward_trains_given_rollouts_as_the_step_after_it():
    config = grpo_config(GRPOLossType.DAPO)
    (after, after_weights), (inside, inside_weights) = (
        train_rollout(build_model(Case(in_backward=in_backward), ALONE), ALONE, range(len(COMPLETIONS)), config,
                      clip=None) for in_backward in (False, True))
    n = sum(w.numel() for w in after_weights.values())
    for a, b in zip(after, inside):
        # The same forwards and backwards: equal losses and metrics; the norm adds its squares in another order.
        assert (a.loss, a.extra) == (b.loss, b.extra)
        assert_close(b.grad_norm, a.grad_norm, terms=n, what="gradient norm")
    assert all(torch.equal(inside_weights[name], w) for name, w in after_weights.items())


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type, level", [(GRPOLossType.DAPO, "token"), (GRPOLossType.GRPO, "sequence")])
def test_packed_completions_give_the_loss_and_gradients_of_one_a_row(given, loss_type, level):
    """``grpo.pack_completions``: the 8 sequences (3 to 10 tokens) in 3 rows of 24, each attending to itself
    only; the loss, metrics and gradients equal one sequence a row's within rounding (other shapes, other sums)."""
    batch, _ = given
    config = dataclasses.replace(grpo_config(loss_type), importance_sampling_level=level)
    lengths = [len(PROMPTS[i // 2]) + len(c) for i, c in enumerate(COMPLETIONS)]
    packed = {**batch, **pack_completion_rows(batch["tokens"], batch["labels"], lengths, pack_to=24, pad_id=0)}
    assert packed["packed_tokens"].shape == (3, 24) and packed["document_lengths"].sum() == 3 * 24
    plain, plain_grads = loss_and_gradients(build_model(Case(), ALONE).model, batch, config)
    parts, grads = loss_and_gradients(build_model(Case(), ALONE).model, packed, config)
    terms = llama_terms(ARGS, 24, 3 * 24)
    assert_close(parts.loss, plain.loss, terms=terms, magnitude=(1 + float(REWARDS.abs().max())) * 10, what="loss")
    assert_close(parts.metrics, plain.metrics, terms=terms, magnitude=10.0, what="metrics")
    for name, grad in plain_grads.items():
        assert_close(grads[name], grad, terms=terms, magnitude=float(grad.abs().max()) + 1e-3, what=name)
