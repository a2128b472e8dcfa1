"""The chunked loss equals the whole-logits loss (value and gradients), never holds the whole logits, and keeps for
backward only the gradients of the targets' hidden states and of the output weight."""

import dataclasses
import logging

import pytest
import torch
from _measure import measure_saved_activation_bytes
from gloo_testlib import run_on_gloo_ranks
from models_testlib import TINY
from numerics import assert_all_close, assert_close, llama_terms, rounding_bound
from torch.distributed.fsdp import fully_shard

from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropy
from torchtune_ac.models import Llama
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.training.objective import IGNORE_INDEX, cross_entropy_sum

VOCAB, DIM = 1000, 16


def labels_with_ignored(b: int, s: int, vocab: int, seed: int, ignored: float = 0.4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (b, s), generator=generator)
    labels[torch.rand((b, s), generator=generator) < ignored] = IGNORE_INDEX
    return labels


def whole_and_chunked(labels: torch.Tensor, n_chunks: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*labels.shape, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=generator, requires_grad=True)
    results = []
    for head in (lambda h, w: cross_entropy_sum(torch.nn.functional.linear(h, w), labels),
                 ChunkedCrossEntropy(labels, n_chunks)):
        loss = head(hidden, weight)
        h_grad, w_grad = torch.autograd.grad(loss, (hidden, weight))
        results.append((loss, h_grad, w_grad))
    return results


def head_terms(labels: torch.Tensor) -> int:
    """The additions behind the head's loss and gradients: the logits (``DIM``), the softmax and the hidden
    states' gradient (``VOCAB`` each), and the tokens summed into the loss and the weight's gradient."""
    return DIM + 2 * VOCAB + labels.numel()


@pytest.mark.numerics
@pytest.mark.parametrize("n_chunks", [1, 3, 8, 1000])  # 1000 > targets: every target a chunk of its own
def test_chunked_loss_and_gradients_equal_the_whole_logits(n_chunks):
    labels = labels_with_ignored(3, 40, VOCAB, seed=1)
    (whole, h_whole, w_whole), (chunked, h_chunked, w_chunked) = whole_and_chunked(labels, n_chunks)
    assert_close(chunked, whole, terms=head_terms(labels), what="loss")
    assert_close(h_chunked, h_whole, terms=head_terms(labels), what="hidden states' gradient")
    assert_close(w_chunked, w_whole, terms=head_terms(labels), what="weight's gradient")
    # Exactly zero: ignored positions never reach the projection; their gradient is the zeros indexing fills in.
    assert torch.equal(h_chunked[labels == IGNORE_INDEX], torch.zeros_like(h_chunked[labels == IGNORE_INDEX]))


def test_a_batch_without_targets_gives_a_zero_loss_linked_to_the_weights():
    labels = torch.full((2, 5), IGNORE_INDEX)
    (whole, _, w_whole), (chunked, _, w_chunked) = whole_and_chunked(labels, 4)
    # Exact: with no target nothing is added, so both losses and both weight gradients are zeros.
    assert chunked.item() == whole.item() == 0.0
    assert torch.equal(w_chunked, w_whole)


def test_backward_keeps_only_the_targets_hidden_state_gradients_and_the_weight_gradient():
    labels = labels_with_ignored(4, 256, VOCAB, seed=2, ignored=0.5)
    hidden = torch.randn(4, 256, DIM, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, requires_grad=True)
    n_targets = int((labels != IGNORE_INDEX).sum())

    whole = measure_saved_activation_bytes(
        lambda h: cross_entropy_sum(torch.nn.functional.linear(h, weight), labels), hidden, exclude=[weight])
    # The input itself is not counted (a view of it would otherwise count as a storage an op produced).
    chunked = measure_saved_activation_bytes(ChunkedCrossEntropy(labels, 8), hidden, weight, exclude=[weight, hidden])

    logits_bytes = 4 * 256 * VOCAB * 4
    assert whole >= logits_bytes  # the whole logits (and their log-softmax) are kept
    # The targets' hidden-state gradients, the weight's gradient, labels and the mask: no chunk's logits.
    assert chunked <= n_targets * DIM * 4 + VOCAB * DIM * 4 + labels.numel() * (8 + 1) + n_targets * 8 + 4096
    assert chunked < logits_bytes / 10


AC_MODES = [{}, {"ac_mode": "full"}, {"ac_mode": "selective", "ac_option": 2},
            {"ac_mode": "selective", "ac_option": "op"}]


@pytest.mark.numerics
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ac", AC_MODES, ids=["none", "full", "every_2nd", "per_op"])
def test_the_model_head_gives_the_whole_logits_loss_in_every_ac_mode(tied, ac):
    args = dataclasses.replace(TINY, tie_embeddings=tied, attn_dropout=0.1, resid_dropout=0.1)
    torch.manual_seed(0)
    reference = Llama(args)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    labels = labels_with_ignored(2, 24, args.vocab_size, seed=3)
    grads = []
    for chunks in (None, 5):
        model = Llama(args)
        model.load_state_dict(reference.state_dict())
        setup_activation_checkpointing(model, **ac)
        torch.manual_seed(1)
        if chunks is None:
            loss = cross_entropy_sum(model(tokens), labels)
        else:
            loss = model(tokens, head=ChunkedCrossEntropy(labels, chunks))
        loss.backward()
        grads.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    (whole, whole_grads), (chunked, chunked_grads) = grads
    assert_close(chunked, whole, terms=llama_terms(args, 24, labels.numel(), backward=False), what="loss")
    assert_all_close(chunked_grads, whole_grads, terms=llama_terms(args, 24, labels.numel()), what="gradient")


@pytest.mark.numerics
def test_compiled_blocks_with_the_chunked_head_match_eager_whole_logits():
    args = dataclasses.replace(TINY, n_layers=2)
    torch.manual_seed(0)
    eager = Llama(args)
    compiled = Llama(args)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    labels = labels_with_ignored(2, 24, args.vocab_size, seed=4)
    whole = cross_entropy_sum(eager(tokens), labels)
    chunked = compiled(tokens, head=ChunkedCrossEntropy(labels, 3))
    whole.backward()
    chunked.backward()
    # Inductor fuses and reorders the blocks' sums: within rounding, not bit for bit.
    assert_close(chunked, whole, terms=llama_terms(args, 24, labels.numel(), backward=False), what="loss")
    assert_all_close({name: p.grad for name, p in compiled.named_parameters()},
                     {name: p.grad for name, p in eager.named_parameters()},
                     terms=llama_terms(args, 24, labels.numel()), what="gradient")


def sharded_chunked_loss(rank: int, out: str) -> None:
    args = dataclasses.replace(TINY, vocab_size=97, tie_embeddings=True)
    results = {}
    for chunks in (None, 8):
        torch.manual_seed(0)
        model = Llama(args)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
        tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(rank))
        labels = labels_with_ignored(2, 24, args.vocab_size, seed=10 + rank)
        gathers = []
        all_gather = torch.distributed.all_gather_into_tensor

        def counting(*a, **k):
            gathers.append(1)
            return all_gather(*a, **k)

        torch.distributed.all_gather_into_tensor = counting
        try:
            if chunks is None:
                loss = cross_entropy_sum(model(tokens), labels)
            else:
                loss = model(tokens, head=ChunkedCrossEntropy(labels, chunks))
            loss.backward()
        finally:
            torch.distributed.all_gather_into_tensor = all_gather
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        results[chunks] = (loss.detach(), grads, len(gathers))
    if rank == 0:
        torch.save(results, out)


@pytest.mark.numerics
@pytest.mark.distributed
def test_under_fsdp2_the_output_weight_is_gathered_once_and_the_gradients_match(tmp_path):
    out = tmp_path / "results.pt"
    run_on_gloo_ranks(sharded_chunked_loss, str(out), store_dir=tmp_path)
    results = torch.load(out, weights_only=False)
    (whole, whole_grads, whole_gathers), (chunked, chunked_grads, chunked_gathers) = results[None], results[8]
    assert chunked_gathers == whole_gathers  # no extra all-gather per chunk
    args = dataclasses.replace(TINY, vocab_size=97)
    # Each rank's 2 x 24 tokens; the gradients also add the 2 ranks' halves.
    assert_close(chunked, whole, terms=llama_terms(args, 24, 48, backward=False), what="loss")
    assert_all_close(chunked_grads, whole_grads, terms=llama_terms(args, 24, 2 * 48), what="gradient")


def test_memory_plan_describes_the_chunked_loss_as_it_works():
    """The chunked loss computes each chunk's gradients in forward: the summary must not say it recomputes."""
    from torchtune_ac.activation_checkpointing.mechanism import ACMode, ACPlan
    from torchtune_ac.memory.features import MemorySettings
    from torchtune_ac.memory.plan import MemoryPlan

    plan = MemoryPlan(ac=ACPlan(ACMode.NONE, None, (), 8), settings=MemorySettings(loss_chunks=8),
                      vocab_size=32_000)
    loss = dict(plan.describe())["loss"]
    assert loss.startswith("8 chunks (vocabulary 32,000): targets only")
    assert "logits recomputed" not in loss and "nothing recomputed in backward" in loss


@pytest.mark.numerics
def test_a_bf16_weight_gradient_is_summed_over_the_chunks_in_float32():
    """The output weight's gradient of a bf16 head, over 256 chunks of 2 targets, against float64 from the same
    bf16 inputs. Every target is token 0, so row 0 sums 512 terms of one sign (as a frequent token's row does).

    Summed in float32, the result carries the bf16 roundings of each token's term (its logits and their
    gradient), of each chunk's product, and of the total: a random walk over 512 + 256 roundings of a chunk's
    size, plus one of the total. Summed in bf16, the running total is rounded at each of the 256 chunks, each
    time by up to half a bf16 unit of the total so far: 3 times that bound here (float32: a seventh of it)."""
    vocab, dim, n, chunks = 64, 16, 512, 256
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, n, dim, generator=generator).abs() + 0.5).bfloat16()
    weight = (0.1 * torch.randn(vocab, dim, generator=generator)).bfloat16()
    labels = torch.zeros(1, n, dtype=torch.long)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ChunkedCrossEntropy(labels, chunks)(h, w).backward()
    assert w.grad.dtype == torch.bfloat16

    h64, w64 = hidden.double(), weight.double().requires_grad_()
    logits = torch.nn.functional.linear(h64[0], w64)  # [n, vocab]
    cross_entropy_sum(logits[None], labels).backward()
    grad_logits = logits.detach().softmax(-1) - torch.nn.functional.one_hot(labels[0], vocab)
    # [chunks, vocab, dim]: each chunk's product, the largest value the float32 sum adds at a time
    products = torch.einsum("kcv,kcd->kvd", grad_logits.view(chunks, -1, vocab), h64.view(chunks, -1, dim))
    bound = (rounding_bound(n + chunks, float(products.abs().max()), torch.bfloat16)
             + torch.finfo(torch.bfloat16).eps * float(w64.grad.abs().max()))
    difference = float((w.grad.double() - w64.grad).abs().max())
    assert difference <= bound, (difference, bound)



@pytest.mark.numerics
def test_the_compiled_chunks_match_eager_and_compile_once_for_every_length():
    """``compiled``: each chunk's loss and logits' gradient through inductor, equal to eager within rounding, on
    batches of three target counts (chunks of about 24 to 40 targets) with no recompile: the chunk's length is
    symbolic."""
    recompiles = []
    handler = logging.Handler()
    handler.emit = lambda record: recompiles.append(record.getMessage())
    dynamo = logging.getLogger("torch._dynamo")  # torch._logging stops propagation there
    dynamo.addHandler(handler)
    torch._logging.set_logs(recompiles=True)
    try:
        for ignored in (0.0, 0.2, 0.4):
            labels = labels_with_ignored(3, 40, VOCAB, seed=5, ignored=ignored)
            results = []
            for compiled in (False, True):
                generator = torch.Generator().manual_seed(6)
                hidden = torch.randn(3, 40, DIM, generator=generator, requires_grad=True)
                weight = torch.randn(VOCAB, DIM, generator=generator, requires_grad=True)
                loss = ChunkedCrossEntropy(labels, 3, compiled=compiled)(hidden, weight)
                results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
            for what, eager, compiled in zip(("loss", "hidden states' gradient", "weight's gradient"), *results):
                assert_close(compiled, eager, terms=head_terms(labels), what=f"{what}, {ignored:.0%} ignored")
    finally:
        torch._logging.set_logs()
        dynamo.removeHandler(handler)
    assert not [m for m in recompiles if m.startswith("Recompiling function")], recompiles


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_a_run_compiles_its_chunked_loss_when_it_compiles_its_blocks(compile_blocks):
    from torchtune_ac.activation_checkpointing.config import ACConfig
    from torchtune_ac.config.components import parse_component
    from torchtune_ac.config.meta_model import build_meta_model
    from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective
    from torchtune_ac.memory.features import MemorySettings
    from torchtune_ac.memory.plan import MemoryPlan
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.runtime.dtypes import DType

    model = build_meta_model(parse_component({"_component_": "torchtune_ac.models.llama_tiny"}, "model"))
    plan = AssemblyPlan(DType.FP32, MemoryPlan(ac=ACConfig().resolve(8), settings=MemorySettings(loss_chunks=4)),
                        compile=compile_blocks)
    training = build_training(model, plan, ctx=DistributedContext(0, 1, 0, torch.device("cpu")))
    assert training.objective == ChunkedCrossEntropyObjective(4, compiled=compile_blocks)


def test_loss_chunks_1_is_the_whole_logits_loss_where_the_output_takes_no_head():
    # loss_chunks 1 projects the targets only through the output's head; an adapter on the output projection
    # (adapter.output) computes the logits itself and takes no head: the loss is then the whole logits', op for op.
    from torchtune_ac.lora.config import AdapterConfig
    from torchtune_ac.lora.mechanism import apply_adapters
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.training.objective import CrossEntropy

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(TINY, tie_embeddings=False))
    model.init_weights()
    apply_adapters(model, AdapterConfig(targets=["q_proj"], output=True))
    batch = {"tokens": torch.randint(0, TINY.vocab_size, (2, 8)),
             "labels": labels_with_ignored(2, 8, TINY.vocab_size, seed=1)}
    assert not model.output.takes_head
    # the same ops in the same order (whole logits, then the cross-entropy): bit for bit
    assert torch.equal(loss_objective(1)(model, batch), CrossEntropy()(model, batch))


@pytest.mark.numerics
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("ac", [{}, {"ac_mode": "full"}], ids=["none", "full"])
def test_loss_chunks_1_projects_the_targets_only_with_the_whole_logits_loss(packed, ac):
    # loss_chunks 1: the head projects the targets only (the text decoder computes every row of its last block:
    # the vision-language decoders' target rows are tested in their families' tests); grouped keys and values,
    # packed documents, AC; the loss and every gradient are the whole logits' within rounding.
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.training.objective import CrossEntropy

    torch.manual_seed(0)
    reference = Llama(TINY)
    reference.init_weights(std=0.2)  # attention far from uniform: a row that saw the wrong keys would show
    tokens = torch.randint(0, TINY.vocab_size, (2, 24))
    batch = {"tokens": tokens, "labels": labels_with_ignored(2, 24, TINY.vocab_size, seed=3, ignored=0.7)}
    if packed:
        batch["document_ids"] = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [0] * 11 + [1] * 13])
    results = []
    for objective in (loss_objective(1), CrossEntropy()):
        model = Llama(TINY)
        model.load_state_dict(reference.state_dict())
        setup_activation_checkpointing(model, **ac)
        loss = objective(model, batch)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (rows, rows_grads), (whole, whole_grads) = results
    n = int((batch["labels"] != IGNORE_INDEX).sum())
    assert_close(rows, whole, terms=llama_terms(TINY, 24, n, backward=False), what="loss")
    assert_all_close(rows_grads, whole_grads, terms=llama_terms(TINY, 24, n), what="gradient")
