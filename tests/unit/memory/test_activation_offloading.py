"""Activation offloading's saved-tensor hooks: on a CPU (a plain copy standing in for pinned memory and streams)
they move exactly the inputs of the checkpointed blocks and give the gradients of the run without them, bit for
bit (the same ops on the same values); each unpack prefetches the activation backward needs next. On CUDA (marked
``cuda``), the copies are pinned and the gradients the same. The planner moves those inputs to the host."""

from __future__ import annotations

import pytest
import torch

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.activation_offloading import ActivationOffloader, _HostCopy, apply_activation_offloading
from torchtune_ac.memory.feature import OptimizerSpec
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan
from torchtune_ac.memory.planner import Workload, estimate_memory
from torchtune_ac.models import LlamaArgs
from torchtune_ac.models.llama import Llama
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode, apply_ac_plan

ARGS = LlamaArgs(vocab_size=96, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=160, max_seq_len=32,
                 attn_dropout=0.1, resid_dropout=0.1)
BATCH, SEQ = 2, 16


def _gradients(ac: ACConfig, offload: bool, device: str = "cpu") -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of two accumulated micro-batches (dropout on: the recompute replays the masks), and the bytes
    offloaded."""
    torch.manual_seed(0)
    model = Llama(ARGS).to(device)
    apply_ac_plan(model, ac.resolve(ARGS.n_layers))
    offloader = apply_activation_offloading(model) if offload else None
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=generator).to(device)
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    return grads, offloader.offloaded_bytes if offloader is not None else 0


@pytest.mark.parametrize("ac, checkpointed", [(ACConfig(ac_mode=ACMode.FULL), 4),
                                              (ACConfig(ac_mode=ACMode.SELECTIVE, ac_option=2), 2)])
def test_offloading_moves_the_checkpointed_blocks_inputs_and_keeps_the_gradients(ac, checkpointed):
    plain, _ = _gradients(ac, offload=False)
    offloaded, moved = _gradients(ac, offload=True)
    assert moved == 2 * checkpointed * BATCH * SEQ * ARGS.dim * 4  # micro-batches x blocks x [b, s, dim] fp32
    assert plain.keys() == offloaded.keys()
    for name, grad in plain.items():
        assert torch.equal(offloaded[name], grad), name


def test_unpacking_an_activation_prefetches_the_one_packed_before_it():
    offloader = ActivationOffloader()
    tensors = [torch.full((3,), float(i), requires_grad=True) for i in range(3)]
    handles = [offloader.pack(t * 1) for t in tensors]  # non-leaf activations, as blocks' inputs are
    assert all(isinstance(h, _HostCopy) for h in handles)
    assert offloader.pack(torch.ones(3)) is not None and not isinstance(offloader.pack(torch.ones(3)), _HostCopy)
    assert torch.equal(offloader.unpack(handles[2]), tensors[2].detach())
    assert handles[1].on_device is not None and handles[0].on_device is None  # the next one backward needs
    assert not isinstance(offloader.pack(torch.nn.Parameter(torch.ones(3))), _HostCopy)  # weights stay


FULL = ACConfig(ac_mode=ACMode.FULL)


def _plan(offload: bool, ac: ACConfig = FULL, device: str = "cuda"):
    return resolve_memory_plan(ac, MemoryConfig(enable_activation_offloading=offload), Llama(ARGS), clip_grad_norm=None,
                               optimizer=OptimizerSpec("torch.optim.AdamW"), device=device)


def test_the_planner_moves_the_checkpointed_inputs_to_the_host_but_two():
    estimates = {}
    batch, seq = 8, 512  # activations outweigh the optimizer step: the peak is in backward
    for offload in (False, True):
        plan = _plan(offload)
        workload = Workload(batch_size=batch, seq_len=seq).with_settings(plan.settings)
        estimates[offload], = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, [plan.ac])
    block_input = batch * seq * ARGS.dim * 4
    on, off = estimates[True], estimates[False]
    assert on.host_parts == {"activations": ARGS.n_layers * block_input}
    moved = min(off.activations, ARGS.n_layers * block_input) - 2 * block_input
    assert moved > 0 and on.activations == off.activations - moved
    assert on.total == off.total - moved


def test_offloading_is_refused_on_a_cpu_and_without_checkpointed_blocks():
    with pytest.raises(UserError, match=r"^enable_activation_offloading=true with device=cpu: "):
        _plan(True, device="cpu")
    with pytest.raises(UserError, match=r"^enable_activation_offloading=true with no activation checkpointing: "):
        _plan(True, ac=ACConfig(ac_mode=ACMode.NONE))
    with pytest.raises(UnavailableError, match=r"^enable_activation_offloading=true: .*this run is on cpu"):
        _plan(True, device="auto").check_device(torch.device("cpu"))


@pytest.mark.cuda
def test_on_cuda_the_copies_are_pinned_and_the_gradients_the_same():
    plain, _ = _gradients(FULL, offload=False, device="cuda")
    offloaded, moved = _gradients(FULL, offload=True, device="cuda")
    assert moved == 2 * ARGS.n_layers * BATCH * SEQ * ARGS.dim * 4
    for name, grad in plain.items():
        assert torch.equal(offloaded[name], grad), name
    offloader = ActivationOffloader()
    handle = offloader.pack(torch.ones(4, device="cuda", requires_grad=True) * 2)
    assert handle.host.is_pinned() and handle.host.device.type == "cpu"
    assert torch.equal(offloader.unpack(handle), torch.full((4,), 2.0, device="cuda"))
