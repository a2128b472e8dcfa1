"""The DPO objective: the loss formulas against float64, sequence log-probabilities chunked against the whole logits
(values, gradients, under FSDP2, never the whole logits), one concatenated forward, the step-0 exactness (every
pair's loss ln 2), the metrics the step and the evaluation report, and the precomputed reference."""

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo_testlib import run_on_gloo_ranks
from models_testlib import TINY, build_random_llama
from numerics import assert_all_close, assert_close, llama_terms, rounding_bound
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.data import (
    EMBEDDED_TOKENIZER_DIR,
    collate_preference_batch,
    load_tokenizer,
    preference_dataset,
)
from torchtune_ac.run.reference import precompute_reference_logps
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.training.dpo import (
    DPO_METRICS,
    DPOConfig,
    DPOLossType,
    DPOObjective,
    answer_logps,
    dpo_loss,
    freeze_reference,
)
from torchtune_ac.training.sequence_logps import ChunkedSequenceLogProbs, sequence_logps
from torchtune_ac.training.evaluation import evaluate_objective
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import OptimizerStepper, train_step

CTX = DistributedContext(0, 1, 0, torch.device("cpu"))
ARGS = dataclasses.replace(TINY, vocab_size=512)  # the embedded tokenizer's vocabulary
LN2 = math.log(2)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Six pairs of the embedded tokenizer, strings and message lists, of different lengths."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    records = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": f"{2 * i + 1} or so"}
               for i in range(4)]
    records += [{"chosen": [{"role": "user", "content": "name a fruit"}, {"role": "assistant", "content": f"apple {i}"}],
                 "rejected": [{"role": "user", "content": "name a fruit"}, {"role": "assistant", "content": "stone"}]}
                for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    return preference_dataset(tokenizer, source=str(path)), tokenizer


def batch_of(dataset, indices, pad_id):
    return collate_preference_batch([dataset[i] for i in indices], pad_id=pad_id)


# --------------------------------------------------------------------------------------------------------- the loss


def float64_loss(policy, reference, config, lengths):
    pc, pr = policy.double().chunk(2)
    rc, rr = reference.double().chunk(2)
    h_c, h_r = pc - rc, pr - rr
    if config.loss_type is DPOLossType.IPO:
        n_c, n_r = lengths.double().chunk(2)
        return (h_c / n_c - h_r / n_r - 1 / (2 * config.beta)) ** 2
    e = config.label_smoothing
    return -(1 - e) * F.logsigmoid(config.beta * (h_c - h_r)) - e * F.logsigmoid(-config.beta * (h_c - h_r))


@pytest.mark.parametrize("config", [DPOConfig(beta=0.1), DPOConfig(beta=0.5, label_smoothing=0.2),
                                    DPOConfig(beta=0.3, loss_type=DPOLossType.IPO)],
                         ids=["sigmoid", "conservative", "ipo"])
def test_the_loss_is_the_formula(config):
    generator = torch.Generator().manual_seed(0)
    policy = -30 * torch.rand(8, generator=generator)
    reference = policy + torch.randn(8, generator=generator)
    lengths = torch.randint(1, 20, (8,), generator=generator)
    terms = dpo_loss(policy, reference, config, answer_tokens=lengths)
    # A handful of float32 operations on values of size |policy|: the rounding of a few terms of that size.
    f32 = torch.float32
    assert_close(terms.losses, float64_loss(policy, reference, config, lengths), terms=8, magnitude=30.0, dtype=f32,
                 what="loss")
    ratios = (policy.double() - reference.double()) * config.beta
    assert_close(terms.rewards_chosen, ratios[:4], terms=2, magnitude=30.0, dtype=f32)
    assert_close(terms.rewards_rejected, ratios[4:], terms=2, magnitude=30.0, dtype=f32)


def test_equal_policy_and_reference_give_ln2_and_zero_rewards():
    logps = -torch.rand(6) * 50
    terms = dpo_loss(logps, logps.clone(), DPOConfig(beta=0.1, label_smoothing=0.3))
    assert torch.equal(terms.losses, torch.full((3,), LN2, dtype=torch.float32))  # softplus(0), exactly
    assert torch.equal(terms.rewards_chosen, torch.zeros(3)) and torch.equal(terms.rewards_rejected, torch.zeros(3))


# ------------------------------------------------------------------------------------- sequence log-probabilities

VOCAB, DIM = 1000, 16


def head_terms(labels):
    """The logits (``DIM``), the softmax and the hidden states' gradient (``VOCAB`` each), the tokens summed into a
    row and into the weight's gradient."""
    return DIM + 2 * VOCAB + labels.numel()


@pytest.mark.numerics
@pytest.mark.parametrize("n_chunks", [1, 3, 1000])
def test_chunked_sequence_logps_and_gradients_equal_the_whole_logits(n_chunks):
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, (4, 30), generator=generator)
    labels[torch.rand(4, 30, generator=generator) < 0.4] = IGNORE_INDEX
    hidden = torch.randn(4, 30, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=generator, requires_grad=True)
    upstream = torch.randn(4, generator=generator)  # a row's gradient, as DPO's log-sigmoid gives
    results = []
    for head in (lambda h, w: sequence_logps(F.linear(h, w), labels), ChunkedSequenceLogProbs(labels, n_chunks)):
        logps = head(hidden, weight)
        results.append((logps, *torch.autograd.grad((logps * upstream).sum(), (hidden, weight))))
    (whole, h_whole, w_whole), (chunked, h_chunked, w_chunked) = results
    assert_close(chunked, whole, terms=head_terms(labels), what="log-probabilities")
    assert_close(h_chunked, h_whole, terms=head_terms(labels), what="hidden states' gradient")
    assert_close(w_chunked, w_whole, terms=head_terms(labels), what="weight's gradient")


class LargestVocabTensor(TorchDispatchMode):
    """Records the most rows of any new tensor (not a view, such as the output weight transposed) an op makes
    whose last dimension is the vocabulary."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


def test_the_chunked_objective_never_makes_the_whole_logits(pairs):
    dataset, tokenizer = pairs
    batch = batch_of(dataset, range(6), tokenizer.pad_id)
    model = build_random_llama(ARGS, seed=0)
    objective = DPOObjective(DPOConfig(), n_chunks=4, reference=freeze_reference(copy.deepcopy(model)))
    targets = int(batch["target_count"])
    with LargestVocabTensor(ARGS.vocab_size) as spy:
        objective(model, batch).loss.backward()
    assert 0 < spy.rows <= math.ceil(targets / 4)  # one chunk of targets at a time, forward and backward
    assert batch["tokens"].numel() > 4 * spy.rows


def test_chosen_and_rejected_go_through_one_forward(pairs):
    dataset, tokenizer = pairs
    batch = batch_of(dataset, range(3), tokenizer.pad_id)
    model, reference = build_random_llama(ARGS, seed=0), freeze_reference(build_random_llama(ARGS, seed=1))
    calls = {"policy": [], "reference": []}
    model.register_forward_hook(lambda m, args, out: calls["policy"].append(args[0].shape[0]))
    reference.register_forward_hook(lambda m, args, out: calls["reference"].append(args[0].shape[0]))
    DPOObjective(DPOConfig(), reference=reference)(model, batch)
    assert calls == {"policy": [6], "reference": [6]}  # 3 pairs: 6 rows, once each


@pytest.mark.numerics
@pytest.mark.parametrize("n_chunks", [1, 3])
def test_step_zero_every_pair_costs_ln2_with_zero_rewards_and_half_accuracy(pairs, n_chunks):
    dataset, tokenizer = pairs
    model = build_random_llama(ARGS, seed=0).train()
    reference = freeze_reference(copy.deepcopy(model))
    objective = DPOObjective(DPOConfig(beta=0.1), n_chunks=n_chunks, reference=reference)
    micro = [batch_of(dataset, [0, 4, 2], tokenizer.pad_id), batch_of(dataset, [1, 3, 5], tokenizer.pad_id)]
    stepper = OptimizerStepper(torch.optim.SGD(model.parameters(), lr=0.0))
    result = train_step(model, stepper, micro, ctx=CTX, objective=objective)
    # The reference is the policy, run through the same ops: the log-ratios are 0 exactly, each pair's loss is
    # float32(ln 2), and the mean of 6 of them rounds 6 additions.
    answer_tokens = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in micro)
    assert result.target_tokens == answer_tokens  # the tokens scored; the loss is a mean over the 6 pairs
    assert_close(result.loss, LN2, terms=6, what="step-0 loss")
    assert result.extra["rewards_chosen"] == result.extra["rewards_rejected"] == result.extra["rewards_margin"] == 0
    assert result.extra["rewards_accuracy"] == 0.5  # every pair a tie
    assert list(result.extra) == list(DPO_METRICS)
    logps = answer_logps(model, collate_preference_batch([dataset[i] for i in range(6)], pad_id=tokenizer.pad_id),
                         1).detach()
    assert_close(result.extra["logps_chosen"], logps[:6].mean(), terms=llama_terms(ARGS, 40, 40, backward=False))


def test_a_huge_beta_stops_naming_dpo_beta_and_one_that_cannot_be_finite_is_refused(pairs):
    from torchtune_ac.checkpoint import Progress
    from torchtune_ac.errors import UserError
    from torchtune_ac.run.messages import diverged
    from torchtune_ac.runtime.non_finite import NonFiniteError

    dataset, tokenizer = pairs
    model = build_random_llama(ARGS, seed=0).train()
    objective = DPOObjective(DPOConfig(beta=1e30), reference=freeze_reference(copy.deepcopy(model)))
    stepper = OptimizerStepper(torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.raises(NonFiniteError) as caught:  # ln 2 at step 1, but a gradient of beta / 2 per log-ratio
        train_step(model, stepper, [batch_of(dataset, [0, 1], tokenizer.pad_id)], ctx=CTX, objective=objective)
    assert caught.value.what == "gradient norm" and caught.value.loss_scale == ("dpo.beta", 1e30)
    line = str(diverged(caught.value, Progress(), None, announce=True))
    assert "lower dpo.beta (now 1e+30: it scales the loss and its gradient) or the learning rate" in line
    # Decided and documented (issue 51): docs/preference-tuning.md says what such a run does, in its words.
    page = (Path(__file__).parents[3] / "docs" / "preference-tuning.md").read_text()
    assert "**A huge `dpo.beta`.**" in page
    assert "lower dpo.beta (now 1e+30: it scales the loss and its gradient) or the learning\nrate" in page
    for config, message in [(dict(beta=1e39), "dpo.beta=1e+39: the loss multiplies the log-ratios by it in float32"),
                            (dict(beta=1e-39, loss_type=DPOLossType.IPO),
                             "dpo.beta=1e-39: IPO's target margin 1 / (2 beta) is not finite in float32")]:
        with pytest.raises(UserError, match=re.escape(message)):
            DPOConfig(**config)
    DPOConfig(beta=1e-39)  # the sigmoid loss stays finite (and learns nothing)


@pytest.mark.numerics
def test_chunked_objective_gradients_equal_the_whole_logits(pairs):
    dataset, tokenizer = pairs
    batch = batch_of(dataset, range(6), tokenizer.pad_id)
    policy = build_random_llama(ARGS, seed=0).train()
    reference = freeze_reference(build_random_llama(ARGS, seed=5))
    results = []
    for n_chunks in (1, 4):
        model = copy.deepcopy(policy)
        parts = DPOObjective(DPOConfig(beta=0.5), n_chunks=n_chunks, reference=reference)(model, batch)
        parts.loss.backward()
        results.append((parts, {name: p.grad for name, p in model.named_parameters()}))
    (whole, whole_grads), (chunked, chunked_grads) = results
    tokens, seq = batch["tokens"].numel(), batch["tokens"].shape[1]
    assert_close(chunked.loss, whole.loss, terms=llama_terms(ARGS, seq, tokens, backward=False), magnitude=1.0)
    assert_all_close(chunked_grads, whole_grads, terms=llama_terms(ARGS, seq, tokens), what="gradient")


def test_the_reference_takes_no_gradient_and_stays_in_eval_mode(pairs):
    dataset, tokenizer = pairs
    model = build_random_llama(ARGS, seed=0).train()
    reference = freeze_reference(build_random_llama(ARGS, seed=1).train())
    DPOObjective(DPOConfig(), reference=reference)(model, batch_of(dataset, range(2), tokenizer.pad_id)).loss.backward()
    assert not reference.training and all(p.grad is None and not p.requires_grad for p in reference.parameters())
    assert all(p.grad is not None for p in model.parameters())


def test_the_evaluation_reports_loss_and_reward_accuracy(pairs):
    dataset, tokenizer = pairs
    model = build_random_llama(ARGS, seed=0)
    objective = DPOObjective(DPOConfig(), reference=freeze_reference(build_random_llama(ARGS, seed=1)))
    from torchtune_ac.data import blank_preference_sample
    from torchtune_ac.data.sampler import evaluation_batches

    batches = list(evaluation_batches(dataset, batch_size=4, pad_id=tokenizer.pad_id,
                                      collate=collate_preference_batch, blank=blank_preference_sample))
    evaluation = evaluate_objective(model, batches, ctx=CTX, objective=objective)
    # The same pairs in one batch, by hand: the two fillers of the second batch count for nothing.
    parts = objective(model, batch_of(dataset, range(6), tokenizer.pad_id))
    bound = rounding_bound(llama_terms(ARGS, 40, 240, backward=False), 1.0)
    assert abs(evaluation.loss - float(parts.loss.detach()) / 6) <= bound
    accuracy = float(parts.metrics[DPO_METRICS.index("rewards_accuracy")]) / 6
    assert evaluation.metrics["rewards_accuracy"] == accuracy and accuracy in {k / 12 for k in range(13)}


# ---------------------------------------------------------------------------------------- the precomputed reference


@pytest.mark.numerics
def test_precomputed_reference_logps_equal_the_resident_ones(pairs):
    dataset, tokenizer = pairs
    dataset = copy.deepcopy(dataset)
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    precompute_reference_logps(reference, dataset, batch_size=4, ctx=CTX, pad_id=tokenizer.pad_id, n_chunks=2)
    batch = batch_of(dataset, range(6), tokenizer.pad_id)
    resident = DPOObjective(DPOConfig(), reference=reference).reference_logps(
        {k: v for k, v in batch.items() if k != "reference_logps"})
    # Another batch's padding (4 pairs, then 2 and 2 fillers) adds in the same order per row, within rounding.
    assert_close(batch["reference_logps"], resident, terms=llama_terms(ARGS, 40, 40, backward=False))
    model = build_random_llama(ARGS, seed=0)
    precomputed = DPOObjective(DPOConfig())(model, batch)  # no reference model at all
    assert_close(precomputed.loss, DPOObjective(DPOConfig(), reference=reference)(model, batch).loss,
                 terms=llama_terms(ARGS, 40, 40, backward=False), magnitude=1.0)


def precompute_on_ranks(rank, dataset, pad_id, out):
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    ctx = DistributedContext(rank, 2, rank, torch.device("cpu"))
    precompute_reference_logps(reference, dataset, batch_size=2, ctx=ctx, pad_id=pad_id)
    if rank == 0:
        torch.save(torch.tensor([dataset[i]["reference_logps"] for i in range(len(dataset))]), out)


@pytest.mark.distributed
def test_precomputing_on_two_ranks_gives_every_rank_every_pair(pairs, tmp_path):
    dataset, tokenizer = pairs
    single = copy.deepcopy(dataset)
    precompute_reference_logps(freeze_reference(build_random_llama(ARGS, seed=3)), single, batch_size=4, ctx=CTX,
                               pad_id=tokenizer.pad_id)
    run_on_gloo_ranks(precompute_on_ranks, dataset, tokenizer.pad_id, str(tmp_path / "out.pt"), store_dir=tmp_path)
    two = torch.load(tmp_path / "out.pt")
    expected = torch.tensor([single[i]["reference_logps"] for i in range(len(single))])
    assert_close(two, expected, terms=llama_terms(ARGS, 40, 40, backward=False))


def sharded_sequence_logps(rank, out):
    args = dataclasses.replace(TINY, vocab_size=97, tie_embeddings=True)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (4, 20), generator=generator)
    labels = torch.randint(0, args.vocab_size, (4, 20), generator=generator)
    labels[:, :5] = IGNORE_INDEX
    results = {}
    for chunks in (1, 6):
        torch.manual_seed(0)
        model = build_random_llama(args, seed=0).train()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
        batch = {"tokens": tokens, "labels": labels}
        logps = answer_logps(model, batch, chunks)
        (torch.sigmoid(logps) * torch.arange(1.0, 5.0)).sum().backward()  # a loss that is not a sum of tokens
        results[chunks] = (logps.detach(), {name: p.grad.full_tensor() for name, p in model.named_parameters()})
    if rank == 0:
        torch.save(results, out)


@pytest.mark.numerics
@pytest.mark.distributed
def test_under_fsdp2_chunked_logps_backward_matches_the_whole_logits(tmp_path):
    out = tmp_path / "results.pt"
    run_on_gloo_ranks(sharded_sequence_logps, str(out), store_dir=tmp_path)
    results = torch.load(out, weights_only=False)
    (whole, whole_grads), (chunked, chunked_grads) = results[1], results[6]
    args = dataclasses.replace(TINY, vocab_size=97)
    assert_close(chunked, whole, terms=llama_terms(args, 20, 80, backward=False), what="log-probabilities")
    assert_all_close(chunked_grads, whole_grads, terms=llama_terms(args, 20, 2 * 80), what="gradient")


# ------------------------------------------------------------------------------- what the SFT step guarantees too

AC_MODES = [{"ac_mode": "full"}, {"ac_mode": "selective", "ac_option": 2}, {"ac_mode": "selective", "ac_option": "op"}]


@pytest.mark.parametrize("n_chunks", [1, 3])
@pytest.mark.parametrize("ac", AC_MODES, ids=["full", "every_2nd", "per_op"])
def test_every_ac_mode_gives_the_loss_and_gradients_of_no_ac_bit_for_bit(pairs, ac, n_chunks):
    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing

    dataset, tokenizer = pairs
    batch = batch_of(dataset, range(6), tokenizer.pad_id)
    policy = build_random_llama(ARGS, seed=0).train()
    reference = freeze_reference(build_random_llama(ARGS, seed=5))
    results = []
    for options in ({}, ac):
        model = copy.deepcopy(policy)
        setup_activation_checkpointing(model, **options)
        parts = DPOObjective(DPOConfig(), n_chunks=n_chunks, reference=reference)(model, batch)
        parts.loss.backward()
        results.append((parts, {name: p.grad for name, p in model.named_parameters()}))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    # Bit for bit: the recompute replays the same ops on the same inputs in one process.
    assert torch.equal(checkpointed.loss, plain.loss) and torch.equal(checkpointed.metrics, plain.metrics)
    assert all(torch.equal(checkpointed_grads[name], grad) for name, grad in plain_grads.items())


def test_the_step_in_backward_trains_as_the_step_after_it(pairs):
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer

    dataset, tokenizer = pairs
    batches = [[batch_of(dataset, [0, 4, 2], tokenizer.pad_id)], [batch_of(dataset, [1, 3, 5], tokenizer.pad_id)]]
    reference = freeze_reference(build_random_llama(ARGS, seed=5))
    runs = []
    for in_backward in (False, True):
        model = build_random_llama(ARGS, seed=0).train()
        stepper = build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2), model, in_backward=in_backward)
        objective = DPOObjective(DPOConfig(), reference=reference)
        history = [train_step(model, stepper, micro, ctx=CTX, objective=objective) for micro in batches * 2]
        runs.append((history, {name: p.detach() for name, p in model.named_parameters()}))
    (after, after_weights), (inside, inside_weights) = runs
    n = sum(p.numel() for p in after_weights.values())
    for a, b in zip(after, inside):
        # The same forward and backward: the losses and metrics are equal; the norm adds its squares in another
        # order (per parameter as each is stepped).
        assert (a.loss, a.extra) == (b.loss, b.extra)
        assert_close(b.grad_norm, a.grad_norm, terms=n, what="gradient norm")
    assert all(torch.equal(inside_weights[name], w) for name, w in after_weights.items())
