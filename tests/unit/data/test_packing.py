"""Packing: layout, document ids, labels at document boundaries, and equivalence with running documents apart."""

import json

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close, llama_terms

from torchtune_ac.data import (
    EMBEDDED_TOKENIZER_DIR,
    IGNORE_INDEX,
    build_sample,
    instruct_dataset,
    load_tokenizer,
    pack_samples,
    text_dataset,
)
from torchtune_ac.models.llama import Llama, LlamaArgs

M = IGNORE_INDEX
PAD = 99


def sample_of(length: int, first: int) -> dict:
    """A sample of tokens first, first+1, ... with every next token a target."""
    tokens = list(range(first, first + length))
    return build_sample(tokens, [True] * length, max_seq_len=None)


@pytest.mark.parametrize(
    "lengths, max_seq_len, expected_document_ids",
    [
        ([3, 4, 2], 8, [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]]),
        ([4, 4], 8, [[0, 0, 0, 0, 1, 1, 1, 1]]),  # exact fit: no padding, no pad id
        ([5, 5, 5], 6, [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]),
        ([2, 2, 2, 2], 5, [[0, 0, 1, 1, 2], [0, 0, 1, 1, 2]]),
    ],
)
def test_pack_layout_and_document_ids(lengths, max_seq_len, expected_document_ids):
    samples = [sample_of(n, 10 * i) for i, n in enumerate(lengths)]
    packed = pack_samples(samples, max_seq_len=max_seq_len, pad_id=PAD)
    assert [packed[i]["document_ids"] for i in range(len(packed))] == expected_document_ids
    # The documents, in order, followed by pad_id / IGNORE_INDEX for the tail of each sequence.
    kept = [
        (t, lab) for i in range(len(packed)) for t, lab in zip(packed[i]["tokens"], packed[i]["labels"]) if t != PAD
    ]
    assert kept == [pair for s in samples for pair in zip(s["tokens"], s["labels"])]
    for i in range(len(packed)):
        row = packed[i]
        assert len(row["tokens"]) == len(row["labels"]) == max_seq_len
        pad = [j for j, t in enumerate(row["tokens"]) if t == PAD]
        assert all(row["labels"][j] == M for j in pad)


def test_sample_longer_than_max_seq_len_is_a_bug():
    with pytest.raises(ValueError, match="does not fit max_seq_len=4"):
        pack_samples([sample_of(5, 0)], max_seq_len=4, pad_id=PAD)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_TOKENIZER_DIR)


def boundaries(row: dict) -> list[int]:
    """Positions i where token i ends a document that another document (or padding) follows."""
    ids = row["document_ids"]
    return [i for i in range(len(ids) - 1) if ids[i] != ids[i + 1]]


def test_label_at_document_end_is_ignore_after_eos(tokenizer):
    """Untruncated documents end with EOS: EOS is the target of the position before, and EOS itself predicts nothing."""
    packed = instruct_dataset(tokenizer, packed=True, max_seq_len=160)
    checked = 0
    for index in range(20):
        row = packed[index]
        for i in boundaries(row):
            assert row["tokens"][i] == tokenizer.eos_id
            assert row["labels"][i] == M
            assert row["labels"][i - 1] == tokenizer.eos_id
            assert row["tokens"][i + 1] in (tokenizer.bos_id, tokenizer.pad_id)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize(
    "lengths, max_seq_len, expected_document_ids, split",
    [
        # Every row full: a sample that does not fit goes on in the next row, as a document of its own there.
        ([3, 4, 2], 4, [[0, 0, 0, 1], [0, 0, 0, 1], [0, 1, 1, 1]], 2),
        ([10], 4, [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]], 1),
        ([4, 4], 4, [[0, 0, 0, 0], [0, 0, 0, 0]], 0),  # exact fits are not split
        ([2, 9, 2], 5, [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 2, 2]], 1),
    ],
)
def test_split_across_rows_fills_every_row_and_loses_nothing(lengths, max_seq_len, expected_document_ids, split):
    samples = [sample_of(n, 10 * i) for i, n in enumerate(lengths)]
    packed = pack_samples(samples, max_seq_len=max_seq_len, pad_id=PAD, split_across_rows=True)
    assert [packed[i]["document_ids"] for i in range(len(packed))] == expected_document_ids
    # Every token and label, in order; a piece that ends a row keeps its document's next token as its label.
    kept = [(t, lab) for row in packed for t, lab in zip(row["tokens"], row["labels"]) if t != PAD]
    assert kept == [pair for s in samples for pair in zip(s["tokens"], s["labels"])]
    assert (packed.packing.samples, packed.packing.rows, packed.packing.split) == (len(lengths), len(packed), split)


def test_packed_text_splits_long_documents_across_rows(tmp_path, tokenizer):
    """Packed text used to cut each document at max_seq_len: eight 3,000-word documents at 128 tokens lost 42,070
    of 43,094 target tokens. Now each goes on in the next rows, and every target is trained on."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(300)) for i in range(8)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    packed = text_dataset(tokenizer, source=str(path), packed=True, max_seq_len=128)
    whole = [tokenizer.encode(d, add_bos=True, add_eos=True) for d in docs]
    assert all(len(doc) > 128 for doc in whole)  # the test's premise
    assert packed.report is None  # nothing truncated, nothing dropped
    stream = [t for row in packed for t in row["tokens"]]
    assert stream[:sum(map(len, whole))] == [t for doc in whole for t in doc]
    targets = sum(label != M for row in packed for label in row["labels"])
    assert targets == sum(len(doc) - 1 for doc in whole)  # every next token of every document
    assert len(packed) == -(-sum(map(len, whole)) // 128)
    # A row's first piece restarts at document id 0, and the piece a row ends with predicts its document's next
    # token, which the next row starts with.
    for row, following in zip(list(packed), list(packed)[1:]):
        assert row["labels"][-1] == following["tokens"][0] and following["document_ids"][0] == 0
    assert packed.packing.describe() == (f"8 samples -> {len(packed)} rows of 128 tokens, "
                                         f"{100 * sum(map(len, whole)) / (128 * len(packed)):.1f} % filled "
                                         "(8 documents split across rows)")


def test_unpacked_text_truncation_says_what_a_document_loses(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": "word " * 40}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    whole, short = (tokenizer.encode(text, add_bos=True, add_eos=True) for text in ("word " * 40, "hi"))
    ds = text_dataset(tokenizer, source=str(path), max_seq_len=16)
    # Was the instruct wording, "(a truncated response is trained without its end and EOS)".
    assert ds.report == (f"data {path}: 1 of 2 documents is longer than max_seq_len=16 and was truncated, losing "
                         f"{len(whole) - 17} of {len(whole) + len(short) - 2} target tokens (the rest of a truncated "
                         "document is not trained on; packed: true splits long documents across rows)")


def run_loss_sum(model: Llama, tokens: list[int], labels: list[int], document_ids=None) -> torch.Tensor:
    tokens_t = torch.tensor([tokens])
    docs = None if document_ids is None else torch.tensor([document_ids])
    logits = model(tokens_t, document_ids=docs)  # [1, s, vocab]
    return F.cross_entropy(logits.flatten(0, 1), torch.tensor(labels), ignore_index=M, reduction="sum")


@pytest.mark.numerics
def test_packed_loss_equals_sum_over_separate_documents(tokenizer):
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64)
    model = Llama(args).eval()
    model.init_weights(std=0.2)
    singles = instruct_dataset(tokenizer, max_seq_len=200)
    packed = instruct_dataset(tokenizer, max_seq_len=200, packed=True)
    row = packed[0]
    n_docs = max(row["document_ids"])  # the last id is the padding tail
    assert n_docs >= 3 and row["tokens"][-1] == tokenizer.pad_id
    with torch.no_grad():
        separate = sum(run_loss_sum(model, singles[i]["tokens"], singles[i]["labels"]) for i in range(n_docs))
        together = run_loss_sum(model, row["tokens"], row["labels"], row["document_ids"])
        leaking = run_loss_sum(model, row["tokens"], row["labels"])  # no document_ids: documents see each other
    # One row of 200 tokens against each document alone: other matmul blocks and another order of the sum.
    assert_close(together, separate, terms=llama_terms(args, 200, 200, backward=False), what="summed loss")
    assert (leaking - separate).abs() > 1e-2
