"""The switches that move memory from a CUDA device to the host: on a CPU, ``tune run`` refuses them with exit 2
and one line (nothing written); on CUDA (tests marked ``cuda``, skipped without a GPU) a run with them trains as
the run without them does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, hash_tree, run_tune_in_process, tune_run_argv

from torchtune_ac.observability.metrics import read_metrics

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="device=auto is CUDA on this machine")
# (overrides, the words the one error line must hold)
REFUSED = {
    "cpu_offload, device=cpu": (["fsdp.cpu_offload=true"], ["fsdp.cpu_offload=true with device=cpu"]),
    "cpu_offload, device=auto": (["fsdp.cpu_offload=true", "device=auto"], ["fsdp.cpu_offload=true:", "no CUDA here"]),
    "activation offloading, device=cpu": (["enable_activation_offloading=true"],
                                          ["enable_activation_offloading=true with device=cpu"]),
    "activation offloading, device=auto": (["enable_activation_offloading=true", "device=auto"],
                                           ["enable_activation_offloading=true:", "no CUDA here"]),
}


@pytest.mark.parametrize("case", [pytest.param(name, marks=NO_CUDA if "auto" in name else ()) for name in REFUSED])
def test_offloading_on_a_cpu_exits_2_with_one_line_and_writes_nothing(case: str, tmp_path: Path) -> None:
    overrides, words = REFUSED[case]
    before = hash_tree(tmp_path)
    result = run_tune_in_process(tune_run_argv(tmp_path / "out", *overrides))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tune: error: ") and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[0] for word in words), lines
    assert hash_tree(tmp_path) == before


# On CUDA: fp32, 5 steps of tiny/full; the offloaded run's optimizer steps on the CPU (other kernels than CUDA's),
# so the losses agree to float32 rounding accumulated over 5 steps, not bit for bit.
CUDA_RUN = ("device=cuda", "max_steps_per_epoch=5")
LOSS_RTOL = 1e-4


def _cuda_losses(output_dir: Path, *overrides: str) -> list[float]:
    check_success(run_tune_in_process(tune_run_argv(output_dir, *CUDA_RUN, *overrides)))
    return [record["loss"] for record in read_metrics(output_dir)]


@pytest.mark.cuda
@pytest.mark.parametrize("extra", [(), ("optimizer_in_bwd=true", "clip_grad_norm=null")],
                         ids=["step_after_backward", "step_in_backward"])
def test_cpu_offload_on_one_process_trains_as_without_it(extra: tuple[str, ...], tmp_path: Path) -> None:
    plain = _cuda_losses(tmp_path / "plain", *extra)
    offloaded = _cuda_losses(tmp_path / "offloaded", "fsdp.cpu_offload=true", *extra)
    assert len(offloaded) == len(plain) == 5
    for ours, expected in zip(offloaded, plain):
        assert abs(ours - expected) <= LOSS_RTOL * abs(expected), (offloaded, plain)


@pytest.mark.cuda
def test_activation_offloading_trains_as_without_it(tmp_path: Path) -> None:
    # The same kernels on the same values (the activations come back unchanged): the same losses.
    plain = _cuda_losses(tmp_path / "plain")
    offloaded = _cuda_losses(tmp_path / "offloaded", "enable_activation_offloading=true")
    assert len(offloaded) == 5 and offloaded == plain
