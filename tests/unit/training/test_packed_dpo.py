"""Packed DPO (``dataset.packed: true`` for preference pairs): pairs go whole into rows of up to ``2 * max_seq_len``
tokens, each sequence a document of its own; the log-probabilities, the loss, its metrics and gradients equal the
padded batch's within rounding, under every AC mode and the chunked loss, with the reference resident or
precomputed, on 1 and 2 processes."""

import copy
import dataclasses
import json

import pytest
import torch
from gloo_testlib import run_on_gloo_ranks
from models_testlib import TINY, build_random_llama
from numerics import assert_all_close, assert_close, llama_terms
from torch.distributed.fsdp import fully_shard

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, collate_preference_batch, load_tokenizer, preference_dataset
from torchtune_ac.data.preference import blank_preference_sample
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.run.reference import precompute_reference_logps
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.training.dpo import DPO_METRICS, DPOConfig, DPOLossType, DPOObjective, answer_logps, freeze_reference
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.step import OptimizerStepper, train_step

CTX = DistributedContext(0, 1, 0, torch.device("cpu"))
ARGS = dataclasses.replace(TINY, vocab_size=512)  # the embedded tokenizer's vocabulary
MAX_SEQ_LEN = 40  # rows of 80 tokens: the 9 pairs make 7 rows, two of them with two pairs
# A sequence is at most MAX_SEQ_LEN tokens, a padded batch of the 9 pairs 18 of them.
FORWARD = llama_terms(ARGS, MAX_SEQ_LEN, 18 * MAX_SEQ_LEN, backward=False)
BOTH = llama_terms(ARGS, MAX_SEQ_LEN, 18 * MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same 9 pairs (strings and message lists, one truncated), padded and packed, and the tokenizer."""
    records = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i) + " because" * i,
                "rejected": f"{2 * i + 1} or so"} for i in range(6)]
    question = {"role": "user", "content": "name a fruit"}
    records += [{"chosen": [question, {"role": "assistant", "content": f"apple {i}"}],
                 "rejected": [question, {"role": "assistant", "content": "stone"}]} for i in range(2)]
    records.append({"prompt": "tell me a long story " * 6, "chosen": "once upon a time " * 8, "rejected": "no"})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    padded = preference_dataset(tokenizer, source=str(path), max_seq_len=MAX_SEQ_LEN)
    packed = preference_dataset(tokenizer, source=str(path), max_seq_len=MAX_SEQ_LEN, packed=True)
    return padded, packed, tokenizer


def padded_batch(padded, tokenizer, pairs=None):
    return collate_preference_batch([padded[i] for i in pairs or range(len(padded))], pad_id=tokenizer.pad_id)


def packed_batch(packed, tokenizer, rows=None):
    return collate_preference_batch([packed[i] for i in rows or range(len(packed))], pad_id=tokenizer.pad_id)


# --------------------------------------------------------------------------------------------------------- the rows


def test_pairs_go_whole_and_in_order_into_rows_of_twice_max_seq_len(datasets):
    padded, packed, _ = datasets
    assert packed.pair_count == len(padded) == 9 and len(packed) == 7
    assert packed.packing.describe() == "9 samples -> 7 rows of 80 tokens, 76.1 % filled"
    pair = 0
    for row in range(len(packed)):
        sample = packed[row]
        assert len(sample["tokens"]) <= 2 * MAX_SEQ_LEN
        assert packed.pair_range(row, row + 1) == (pair, pair + sample["pairs"])
        ids = sample["document_ids"]
        assert sorted(set(ids)) == list(range(2 * sample["pairs"]))  # chosen 2k, rejected 2k + 1
        for k in range(sample["pairs"]):  # each sequence is the padded dataset's, truncated as it is
            for side, name in enumerate(("chosen", "rejected")):
                positions = [i for i, d in enumerate(ids) if d == 2 * k + side]
                assert positions == list(range(positions[0], positions[0] + len(positions)))  # one run
                assert [sample["tokens"][i] for i in positions] == padded[pair + k][f"{name}_tokens"]
                assert [sample["labels"][i] for i in positions] == padded[pair + k][f"{name}_labels"]
        pair += sample["pairs"]
    assert pair == len(padded)
    assert packed.pair_range(5, 99) == (7, 9)


def test_the_batch_numbers_sequences_as_the_padded_batch_numbers_rows(datasets):
    padded, packed, tokenizer = datasets
    ours, theirs = packed_batch(packed, tokenizer), padded_batch(padded, tokenizer)
    assert int(ours["sequence_count"]) == theirs["tokens"].shape[0] == 18
    assert ours["tokens"].shape[0] == 7 and int(ours["target_count"]) == int(theirs["target_count"])
    for sequence in range(18):  # chosen 0..8, then rejected 9..17: the same targets, in the same order
        mask = (ours["sequence_ids"] == sequence) & (ours["labels"] != IGNORE_INDEX)
        expected = theirs["labels"][sequence]
        assert ours["labels"][mask].tolist() == expected[expected != IGNORE_INDEX].tolist()


def test_an_evaluation_pass_fills_its_last_batch_with_rows_that_count_for_nothing(datasets):
    _, packed, tokenizer = datasets
    objective = DPOObjective(DPOConfig(), reference=freeze_reference(build_random_llama(ARGS, seed=1)))
    batches = list(evaluation_batches(packed, batch_size=4, pad_id=tokenizer.pad_id,
                                      collate=collate_preference_batch, blank=blank_preference_sample))
    assert [int(objective.targets(b)) for b in batches] == [6, 3]  # rows 4-6 and a filler copy of row 0


# ----------------------------------------------------------------------------------------- the same numbers as padded

AC_MODES = [{}, {"ac_mode": "full"}, {"ac_mode": "selective", "ac_option": 2},
            {"ac_mode": "selective", "ac_option": "op"}]


def objective_and_grads(model, objective, batch):
    parts = objective(model, batch)
    parts.loss.backward()
    return parts, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("n_chunks", [1, 3])
@pytest.mark.parametrize("ac", AC_MODES, ids=["no_ac", "full", "every_2nd", "per_op"])
def test_packed_loss_metrics_and_gradients_equal_padded(datasets, ac, n_chunks):
    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing

    padded, packed, tokenizer = datasets
    policy = build_random_llama(ARGS, seed=0).train()
    objective = DPOObjective(DPOConfig(beta=0.5), n_chunks=n_chunks,
                             reference=freeze_reference(build_random_llama(ARGS, seed=5)))
    expected, expected_grads = objective_and_grads(copy.deepcopy(policy), objective, padded_batch(padded, tokenizer))
    results = []
    for options in ({}, ac):
        model = copy.deepcopy(policy)
        setup_activation_checkpointing(model, **options)
        results.append(objective_and_grads(model, objective, packed_batch(packed, tokenizer)))
    (plain, plain_grads), (ours, grads) = results
    # Bit for bit against packed without AC: the recompute replays the same ops on the same inputs in one process.
    assert torch.equal(ours.loss, plain.loss) and torch.equal(ours.metrics, plain.metrics)
    assert all(torch.equal(grads[name], grad) for name, grad in plain_grads.items())
    # Against padded: the same sequences through other kernels (per-document attention), within rounding.
    assert_close(ours.loss, expected.loss, terms=FORWARD, magnitude=9.0, what="loss")
    assert_close(ours.metrics, expected.metrics, terms=FORWARD, what="metrics")
    assert_all_close(grads, expected_grads, terms=BOTH, what="gradient")


SHORT_PAIRS = [("What is 1 + 1?", "2", "Maybe 3."), ("What is 2 + 2?", "4", "Maybe 5."),
               ("What is 3 + 3?", "6", "Maybe 7."), ("Capital of France?", "Paris", "Rome, I think."),
               ("Colour of the sky?", "Blue", "Green."), ("What is 5 - 2?", "3", "Maybe 4."),
               ("Opposite of hot?", "Cold", "Warm.")]


def test_short_pairs_that_all_fit_one_row_pack_and_score_as_padded(tmp_path):
    """Seven short pairs fit one row of 2 x 256 tokens: packing refused them ("none of the 7 pairs is left: every one
    differs only past max_seq_len=256"), as it did a single pair, because the one row was stored only after the
    emptiness check."""
    path = tmp_path / "seven.jsonl"
    path.write_text("".join(json.dumps(dict(prompt=p, chosen=c, rejected=r)) + "\n" for p, c, r in SHORT_PAIRS))
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    padded = preference_dataset(tokenizer, source=str(path), max_seq_len=256)
    packed = preference_dataset(tokenizer, source=str(path), max_seq_len=256, packed=True)
    assert len(packed) == 1 and packed.pair_count == len(padded) == 7 and packed[0]["pairs"] == 7
    (path := tmp_path / "one.jsonl").write_text(json.dumps(dict(zip(("prompt", "chosen", "rejected"),
                                                                    SHORT_PAIRS[0]))) + "\n")
    one = preference_dataset(tokenizer, source=str(path), max_seq_len=256, packed=True)
    assert len(one) == 1 and one.pair_count == 1
    policy = build_random_llama(ARGS, seed=0).train()
    objective = DPOObjective(DPOConfig(beta=0.5), reference=freeze_reference(build_random_llama(ARGS, seed=5)))
    expected, expected_grads = objective_and_grads(copy.deepcopy(policy), objective, padded_batch(padded, tokenizer))
    ours, grads = objective_and_grads(copy.deepcopy(policy), objective, packed_batch(packed, tokenizer))
    row = len(packed[0]["tokens"])  # every sequence of the pairs, attended over and summed
    forward = llama_terms(ARGS, row, row, backward=False)
    assert_close(ours.loss, expected.loss, terms=forward, magnitude=9.0, what="loss")
    assert_close(ours.metrics, expected.metrics, terms=forward, what="metrics")
    assert_all_close(grads, expected_grads, terms=llama_terms(ARGS, row, row), what="gradient")


@pytest.mark.numerics
def test_ipo_counts_each_packed_answer_s_own_tokens(datasets):
    padded, packed, tokenizer = datasets
    model = build_random_llama(ARGS, seed=0)
    objective = DPOObjective(DPOConfig(beta=0.3, loss_type=DPOLossType.IPO),
                             reference=freeze_reference(build_random_llama(ARGS, seed=5)))
    ours, expected = (objective(model, packed_batch(packed, tokenizer)),
                      objective(model, padded_batch(padded, tokenizer)))
    assert_close(ours.loss, expected.loss, terms=FORWARD, what="IPO loss")


def test_a_precomputed_reference_of_packed_rows_equals_the_resident_one_and_padded(datasets):
    padded, packed, tokenizer = datasets
    padded, packed = copy.deepcopy(padded), copy.deepcopy(packed)
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    precompute_reference_logps(reference, packed, batch_size=3, ctx=CTX, pad_id=tokenizer.pad_id, n_chunks=2)
    precompute_reference_logps(reference, padded, batch_size=4, ctx=CTX, pad_id=tokenizer.pad_id)
    batch = packed_batch(packed, tokenizer)
    resident = DPOObjective(DPOConfig(), reference=reference).reference_logps(
        {k: v for k, v in batch.items() if k != "reference_logps"})
    assert_close(batch["reference_logps"], resident, terms=FORWARD)
    assert_close(batch["reference_logps"], padded_batch(padded, tokenizer)["reference_logps"], terms=FORWARD)
    model = build_random_llama(ARGS, seed=0)
    assert_close(DPOObjective(DPOConfig())(model, batch).loss,
                 DPOObjective(DPOConfig(), reference=reference)(model, batch).loss, terms=FORWARD, magnitude=9.0)


def test_only_the_rows_a_run_reads_are_precomputed_each_holding_its_pairs(datasets):
    """The pass over the samples a run reads (``indices``): packed, a sample is a row of several pairs, each put
    where the whole pass puts it; a row not read raises."""
    padded, packed, tokenizer = datasets
    whole, some = copy.deepcopy(packed), copy.deepcopy(packed)
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    precompute_reference_logps(reference, whole, batch_size=2, ctx=CTX, pad_id=tokenizer.pad_id)
    read = [len(packed) - 1, 0]
    precompute_reference_logps(reference, some, batch_size=2, ctx=CTX, pad_id=tokenizer.pad_id, indices=read)
    for row in read:
        assert_close(torch.tensor(some[row]["reference_logps"]), torch.tensor(whole[row]["reference_logps"]),
                     terms=FORWARD)
    if len(packed) > 2:
        with pytest.raises(ValueError, match="row 1 has no precomputed reference log-probabilities"):
            some[1]


# ---------------------------------------------------------------------------------------------------- 2 processes

RANK_ROWS = ([0, 1, 2, 3], [4, 5, 6])  # 6 pairs and 3


def packed_step_on_ranks(rank, packed, pad_id, out):
    ctx = DistributedContext(rank, 2, rank, torch.device("cpu"))
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    precompute_reference_logps(reference, packed, batch_size=2, ctx=ctx, pad_id=pad_id, n_chunks=2)
    model = build_random_llama(ARGS, seed=0).train()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=False)
    batch = collate_preference_batch([packed[i] for i in RANK_ROWS[rank]], pad_id=pad_id)
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    result = train_step(model, OptimizerStepper(torch.optim.SGD(model.parameters(), lr=1.0)), [batch], ctx=ctx,
                        objective=DPOObjective(DPOConfig(beta=0.5), n_chunks=2))
    grads = {name: before[name] - p.full_tensor() for name, p in model.named_parameters()}  # SGD, lr 1: the gradient
    if rank == 0:
        torch.save({"result": result, "grads": grads,
                    "reference": torch.tensor([pair for i in range(len(packed))
                                               for pair in packed[i]["reference_logps"]])}, out)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_on_packed_rows_step_as_one_on_padded_pairs(datasets, tmp_path):
    padded, packed, tokenizer = datasets
    padded = copy.deepcopy(padded)
    reference = freeze_reference(build_random_llama(ARGS, seed=3))
    precompute_reference_logps(reference, padded, batch_size=9, ctx=CTX, pad_id=tokenizer.pad_id)
    model = build_random_llama(ARGS, seed=0).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = train_step(model, OptimizerStepper(torch.optim.SGD(model.parameters(), lr=1.0)),
                          [padded_batch(padded, tokenizer)], ctx=CTX, objective=DPOObjective(DPOConfig(beta=0.5)))
    expected_grads = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    run_on_gloo_ranks(packed_step_on_ranks, packed, tokenizer.pad_id, str(tmp_path / "out.pt"), store_dir=tmp_path)
    two = torch.load(tmp_path / "out.pt", weights_only=False)
    assert_close(two["reference"], torch.tensor([padded[i]["reference_logps"] for i in range(len(padded))]),
                 terms=FORWARD, what="reference log-probabilities")
    result = two["result"]
    assert result.target_tokens == expected.target_tokens
    assert_close(result.loss, expected.loss, terms=FORWARD, magnitude=1.0, what="loss")
    for name in DPO_METRICS:
        assert_close(result.extra[name], expected.extra[name], terms=FORWARD,
                     magnitude=max(1.0, abs(expected.extra[name])), what=name)
    assert_all_close(two["grads"], expected_grads, terms=BOTH, what="gradient")
