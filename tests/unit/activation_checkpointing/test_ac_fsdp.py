"""Activation checkpointing composes with FSDP2: AC first, then fully_shard per block, then the root.

Two gloo processes on CPU train a tiny model with dropout for a few steps in every AC mode, on plain rows
first, then on packed rows (attention per document). The losses must be bit-identical to the same run without
AC (each rank replays the same ops, and the collectives add in the same order), and match, within rounding
(``numerics``), a single process that replays both ranks' micro-batches (same data, same per-rank RNG) and
averages their gradients.
"""

import pytest
import torch
import torch.nn.functional as F
from gloo_testlib import WORLD_SIZE, run_on_gloo_ranks
from numerics import assert_steps_alike, llama_terms
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing

STEPS = 3
VOCAB = 96
SETTINGS = [(None, None), ("full", None), ("selective", 2), ("selective", "op")]


ARGS = LlamaArgs(
    vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=64,
    max_seq_len=64, attn_dropout=0.1, resid_dropout=0.1,
)


def build_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ARGS)
    model.init_weights()
    return model


def make_batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 25), generator=generator)


def make_document_ids(step: int, rank: int) -> torch.Tensor | None:
    """None (plain rows) at step 0, then packed rows: documents of 4 to 12 tokens, a different layout per rank."""
    if step == 0:
        return None
    generator = torch.Generator().manual_seed(2000 * step + rank)
    rows = []
    for _ in range(2):
        lengths = torch.randint(4, 13, (24,), generator=generator)
        rows.append(torch.repeat_interleave(torch.arange(24), lengths)[:24])
    return torch.stack(rows)


def compute_loss(model: Llama, tokens: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    torch.manual_seed(10_000 + 100 * step + rank)  # the dropout masks of this rank's micro-batch
    logits = model(tokens[:, :-1], make_document_ids(step, rank))
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train_sharded(rank: int, out_path: str) -> None:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    losses = {}
    for mode, option in SETTINGS:
        model = build_model()
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        history = []
        for step in range(STEPS):
            loss = compute_loss(model, make_batch(step, rank), step, rank)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            history.append(loss.detach())
        losses[f"{mode}-{option}"] = torch.stack(history)
    torch.save(losses, f"{out_path}.{rank}")


def train_one_process() -> torch.Tensor:
    """Losses ``[step, rank]`` of one process running both ranks' micro-batches and averaging gradients."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for step in range(STEPS):
        losses = []
        for rank in range(WORLD_SIZE):
            loss = compute_loss(model, make_batch(step, rank), step, rank)
            (loss / WORLD_SIZE).backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        history.append(torch.stack(losses))
    return torch.stack(history)


@pytest.mark.numerics
@pytest.mark.distributed
def test_fsdp2_training_losses_are_unchanged_by_ac(tmp_path):
    out_path = str(tmp_path / "losses")
    run_on_gloo_ranks(train_sharded, out_path, store_dir=tmp_path)
    per_rank = [torch.load(f"{out_path}.{rank}") for rank in range(WORLD_SIZE)]

    reference = train_one_process()
    for rank, losses in enumerate(per_rank):
        no_ac = losses["None-None"]
        # A step's gradient: both ranks' 2 x 24 tokens.
        assert_steps_alike(no_ac.tolist(), reference[:, rank].tolist(),
                           terms=llama_terms(ARGS, 24, WORLD_SIZE * 2 * 24), what=f"rank {rank}'s loss")
        assert not torch.equal(no_ac[0], no_ac[-1])  # the steps really trained
        for name, ac_losses in losses.items():
            # Bit for bit: the same ops replayed on each rank, the same collectives in the same order.
            assert torch.equal(ac_losses, no_ac), (rank, name, ac_losses, no_ac)
