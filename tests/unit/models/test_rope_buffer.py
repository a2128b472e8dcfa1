"""RoPE's inverse frequencies are a buffer on the model's device (a forward copies nothing from the host): not in
the state dict, float32 whatever the model is cast to, and filled again when a model built on the meta device is
allocated (``to_empty``), as every run builds it."""

from __future__ import annotations

import dataclasses

import torch
from models_testlib import TINY

from torchtune_ac.models import Llama
from torchtune_ac.models.llama import compute_rope_inv_freq
from torchtune_ac.run.assemble import place_buffers_

SLIDING = dataclasses.replace(TINY, sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                              sliding_rope_theta=10.0)


def _expected(args) -> dict[str, torch.Tensor]:
    expected = {"rope_inv_freq": compute_rope_inv_freq(args.resolved_head_dim, args.rope_theta, args.rope_scaling)}
    if args.sliding_rope_theta is not None:
        expected["sliding_rope_inv_freq"] = compute_rope_inv_freq(args.resolved_head_dim, args.sliding_rope_theta,
                                                                  None)
    return expected


def test_the_frequencies_are_buffers_that_no_checkpoint_holds():
    for args in (TINY, SLIDING):
        model = Llama(args)
        buffers = dict(model.named_buffers())
        assert buffers.keys() == _expected(args).keys()
        for name, values in _expected(args).items():
            assert torch.equal(buffers[name], values), name
        assert not any("inv_freq" in key for key in model.state_dict())


def test_a_model_built_on_meta_and_allocated_has_its_frequencies_in_float32():
    for args in (TINY, SLIDING):
        with torch.device("meta"):
            model = Llama(args)
        assert model.rope_inv_freq.is_meta
        model.to(torch.bfloat16).to_empty(device="cpu")
        for name, values in _expected(args).items():
            buffer = getattr(model, name)
            assert buffer.dtype == torch.float32 and torch.equal(buffer, values), name


def test_a_model_built_on_meta_computes_what_a_model_built_on_the_cpu_does():
    torch.manual_seed(0)
    reference = Llama(SLIDING)
    with torch.device("meta"):
        model = Llama(SLIDING)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, SLIDING.vocab_size, (2, 12))
    assert torch.equal(model(tokens), reference(tokens))  # the same ops on the same values


def test_buffers_go_to_the_computing_device_when_the_parameters_stay_on_the_host():
    """``fsdp.cpu_offload`` allocates the parameters on the CPU and computes on the GPU: the run puts the buffers
    on the GPU (``place_buffers_``). Shown here with the meta device standing in for the GPU; the offloaded run
    itself needs CUDA."""
    model = Llama(SLIDING)
    place_buffers_(model, torch.device("meta"))
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
