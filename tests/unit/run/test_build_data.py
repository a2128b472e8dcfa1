"""The run's data loader: batches padded to lengths that repeat under ``compile: true`` (the padding ignored by the
loss), and pinned in host memory for a CUDA run; and what identifies the run's data."""

from __future__ import annotations

import gzip
import hashlib
import itertools
from pathlib import Path

import pytest
import torch
from numerics import assert_close

from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.config.validation import validate_config
from torchtune_ac.data import IGNORE_INDEX
from torchtune_ac.data.collate import COMPILED_LENGTH_MULTIPLE
from torchtune_ac.data.embedded import EMBEDDED_INSTRUCT_PATH, EMBEDDED_TOKENIZER_DIR
from torchtune_ac.data.tokenizer import load_tokenizer
from torchtune_ac.models import llama_tiny
from torchtune_ac.run.phases import build_data
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.training.objective import count_target_tokens, cross_entropy_sum
from torchtune_ac.runtime.parallelism import Parallelism

MAX_SEQ_LEN = 200  # not a multiple of 64: the longest batches are cut there, not rounded past it
CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CUDA = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))


def config(**overrides) -> FullFinetuneConfig:
    return validate_config(
        {
            "output_dir": "/tmp/out",
            "model": {"_component_": "torchtune_ac.models.llama_tiny"},
            "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": str(EMBEDDED_TOKENIZER_DIR)},
            "dataset": {"_component_": "torchtune_ac.data.instruct_dataset"},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
            "max_seq_len": MAX_SEQ_LEN,
            "batch_size": 4,
            **overrides,
        },
        FullFinetuneConfig,
        source="c.yaml",
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_TOKENIZER_DIR)


def batches(cfg, tokenizer, ctx=CPU, n=30):
    data = build_data(cfg, tokenizer, ctx)
    data.loader.set_epoch(0)
    return list(itertools.islice(data.loader, n))


def test_compiled_runs_get_batch_lengths_that_repeat(tokenizer):
    eager = {b["tokens"].shape[1] for b in batches(config(compile=False), tokenizer)}
    compiled = {b["tokens"].shape[1] for b in batches(config(compile=True), tokenizer)}
    assert len(eager) > len(compiled)  # eager: the longest sample of each batch, a new length most steps
    assert all(length % COMPILED_LENGTH_MULTIPLE == 0 or length == MAX_SEQ_LEN for length in compiled), compiled


def test_the_padding_of_compiled_runs_is_ignored_by_the_loss(tokenizer):
    """The same batches, padded to the longest sample and to the compiled length: the padding's labels are
    ignored, so the loss and the target count are those of the unpadded batch (within rounding: the causal
    attention rows of real tokens see no padding, but the kernels add over other lengths)."""
    torch.manual_seed(0)
    model = llama_tiny().eval()
    for eager, compiled in zip(batches(config(), tokenizer, n=4), batches(config(compile=True), tokenizer, n=4)):
        length = eager["tokens"].shape[1]
        assert torch.equal(compiled["tokens"][:, :length], eager["tokens"])
        assert (compiled["labels"][:, length:] == IGNORE_INDEX).all()
        assert torch.equal(count_target_tokens(compiled["labels"]), count_target_tokens(eager["labels"]))
        with torch.no_grad():
            loss = cross_entropy_sum(model(compiled["tokens"]), compiled["labels"])
            expected = cross_entropy_sum(model(eager["tokens"]), eager["labels"])
        targets = int(count_target_tokens(eager["labels"]))
        terms = 2 * model.args.n_layers * (model.args.dim + model.args.intermediate_dim + 2 * length) + targets
        assert_close(loss, expected, terms=terms, what="summed loss")


@pytest.mark.parametrize("ctx, pinned", [(CUDA, True), (CPU, False)])
def test_a_cuda_run_pins_its_batches(tokenizer, ctx, pinned):
    """Pinned host memory makes the batch's ``non_blocking`` copy to the GPU asynchronous; only the loader's
    setting is checked here (pinning needs a GPU)."""
    assert build_data(config(), tokenizer, ctx).loader.pin_memory is pinned


def test_packing_is_said_in_samples_to_rows_and_its_fill(tokenizer, caplog):
    """The log said "N samples" of packed rows, and nothing when packing changed nothing."""
    plain = build_data(config(), tokenizer, CPU)
    assert (plain.described, plain.unit) == (f"{plain.samples:,} samples", "sample")
    packed = build_data(config(dataset={"_component_": "torchtune_ac.data.instruct_dataset", "packed": True}),
                        tokenizer, CPU)
    report = packed.loader.dataset.packing
    tokens = sum(sum(1 for t in row["tokens"] if t != tokenizer.pad_id) for row in packed.loader.dataset)
    assert (report.samples, report.rows, packed.samples, packed.unit) == (plain.samples, packed.samples,
                                                                          len(packed.loader.dataset), "row")
    assert packed.described == (f"packed: {plain.samples:,} samples -> {packed.samples:,} rows of {MAX_SEQ_LEN} "
                                f"tokens, {100 * tokens / (packed.samples * MAX_SEQ_LEN):.1f} % filled")
    assert packed.samples < plain.samples / 2
    assert not [r for r in caplog.records if "packing changed nothing" in r.getMessage()]
    # At 40 tokens no sample fits beside the one before it: packing makes one row of each.
    caplog.clear()
    unchanged = build_data(config(max_seq_len=40, dataset={"_component_": "torchtune_ac.data.instruct_dataset",
                                                           "packed": True}), tokenizer, CPU)
    fill = unchanged.loader.dataset.packing.fill
    said = [r.getMessage() for r in caplog.records if "packing" in r.getMessage()]
    assert said == [f"data: packing changed nothing: each of the {unchanged.samples:,} rows of max_seq_len=40 tokens "
                    f"holds one sample (none fit beside the one before it), {100 * fill:.1f} % filled on average; "
                    "raise max_seq_len, or set packed: false"]


def test_the_run_identifies_every_file_of_a_list_of_sources(tokenizer, tmp_path):
    """The builders prepare before they build; what a checkpoint records of the data still names each file a list
    reads, a compressed one by its own bytes."""
    lines = Path(EMBEDDED_INSTRUCT_PATH).read_bytes().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines[:40]))
    (tmp_path / "more").mkdir()
    compressed = gzip.compress(b"".join(lines[40:100]))
    (tmp_path / "more" / "b.jsonl.gz").write_bytes(compressed)
    source = [str(tmp_path / "a.jsonl"), str(tmp_path / "more" / "b.jsonl.gz")]
    data = build_data(config(dataset={"_component_": "torchtune_ac.data.instruct_dataset", "source": source}),
                      tokenizer, CPU)
    assert data.samples == 100
    assert data.identity == {
        "source": f"{source[0]} + {source[1]}", "root": str(tmp_path), "samples": 100,
        "files": [{"name": "a.jsonl", "bytes": (tmp_path / "a.jsonl").stat().st_size,
                   "sha256": hashlib.sha256(b"".join(lines[:40])).hexdigest()},
                  {"name": "more/b.jsonl.gz", "bytes": len(compressed),
                   "sha256": hashlib.sha256(compressed).hexdigest()}],
    }


def test_the_data_report_is_said_by_rank_0_only_under_tensor_parallelism(tokenizer, caplog, monkeypatch):
    """Every rank of the first tensor-parallel group reads data rank 0's share, and each said the report."""
    import torchtune_ac.run.phases as phases

    monkeypatch.setattr(phases, "identify_data", lambda *args, **kwargs: {})  # its hashing gathers over the ranks
    cfg = config(max_seq_len=40)  # some samples are cut there: the dataset has a report
    for rank in range(2):
        ctx = DistributedContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"),
                                 parallelism=Parallelism(2, tensor=2))
        assert ctx.data_parallel_rank == 0
        report = build_data(cfg, tokenizer, ctx).loader.dataset.report
    assert report and [r.getMessage() for r in caplog.records if r.getMessage() == report] == [report]
