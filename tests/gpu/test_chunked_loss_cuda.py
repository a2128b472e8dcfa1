"""The chunked loss at Llama 3 scale on CUDA (vocabulary 128,256, dim 4096, 2 x 4096 tokens, bf16): the loss and
its gradients against the whole logits in float32, its peak memory against theirs, and its time.

Both sides compute the logits from the same bf16 hidden states and weight; the whole-logits side upcasts them to
float32 for the cross-entropy, as the chunked side does per chunk. The matmuls round their bf16 products
differently per chunk shape, so the comparison is at bf16's relative precision of the largest value (2e-2);
the peak must drop by most of the float32 logits' bytes. The time is printed (``-s``) and not asserted:
``scripts/gpu/gpu_check.sh`` records it."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropy
from torchtune_ac.training.objective import IGNORE_INDEX, cross_entropy_sum

VOCAB, DIM, BATCH, SEQ, CHUNKS = 128_256, 4096, 2, 4096, 8
BF16_TOLERANCE = 2e-2


def inputs():
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(BATCH, SEQ, DIM, device="cuda", generator=generator) * 0.5).bfloat16()
    weight = (torch.randn(VOCAB, DIM, device="cuda", generator=generator) * DIM**-0.5).bfloat16()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=generator)
    labels[:, :64] = IGNORE_INDEX  # a prompt
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def run(head, hidden, weight):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = head(hidden, weight)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.cuda.synchronize()
    return loss.detach().float(), [g.float() for g in grads], time.perf_counter() - start, \
        torch.cuda.max_memory_allocated() - before


def test_chunked_loss_at_llama3_scale_matches_the_whole_logits_with_less_memory():
    hidden, weight, labels = inputs()
    whole = run(lambda h, w: cross_entropy_sum(F.linear(h, w).float(), labels), hidden, weight)  # warm-up
    chunked = run(ChunkedCrossEntropy(labels, CHUNKS), hidden, weight)
    whole = run(lambda h, w: cross_entropy_sum(F.linear(h, w).float(), labels), hidden, weight)
    (loss, grads, seconds, peak), (ref_loss, ref_grads, ref_seconds, ref_peak) = chunked, whole
    assert abs(float(loss) - float(ref_loss)) <= BF16_TOLERANCE * abs(float(ref_loss))
    for grad, ref_grad, name in zip(grads, ref_grads, ("hidden", "weight")):
        difference, scale = float((grad - ref_grad).abs().max()), float(ref_grad.abs().max())
        assert difference <= BF16_TOLERANCE * scale, f"{name}'s gradient: {difference:.3g} > 2e-2 x {scale:.3g}"
    logits_fp32 = BATCH * SEQ * VOCAB * 4
    assert ref_peak - peak >= 0.7 * logits_fp32, (peak, ref_peak)
    print(f"chunked loss ({CHUNKS} chunks): {seconds * 1e3:.1f} ms, peak {peak / 2**30:.2f} GiB; whole logits: "
          f"{ref_seconds * 1e3:.1f} ms, peak {ref_peak / 2**30:.2f} GiB")
