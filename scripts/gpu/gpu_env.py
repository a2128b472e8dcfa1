"""The GPU check's first stage (``scripts/gpu/gpu_check.sh``): what this machine is, in one JSON file, before any test.

    python scripts/gpu/gpu_env.py --out DIR      # writes DIR/gpu_env.json and prints it

Records the interpreter, torch, CUDA, NCCL, the device and its capability, the packages the suite needs (and
which are missing), ``varlen_attn``'s signature and what ``models.attention.VARLEN_SUPPORT`` detected from it, a
bf16 matrix product's rate (the ceiling MFU is read against), and how long the recipe's build of a 1B model with
random initialisation takes (the model of the benchmark stage).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PACKAGES = ("transformers", "safetensors", "tokenizers", "omegaconf", "hydra", "antlr4", "torchao", "datasets", "tqdm",
            "psutil", "pytest")


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as error:  # noqa: BLE001 - a package that fails to import is recorded, not fatal
            versions[name] = None if isinstance(error, ModuleNotFoundError) else f"fails: {error}"[:200]
    return versions


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """A bf16 ``n x n x n`` product's rate on random data, the mean of ``repeats`` after three warm-ups."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def build_seconds(model: str, device: torch.device = torch.device("cuda")) -> float:
    """The recipe's build of ``model`` on ``device`` (this GPU) in bf16, initialised from a seed (no checkpoint).
    A CPU ``device`` runs the same calls without a GPU (tests/integration/test_gpu_suite_on_cpu.py)."""
    from torchtune_ac.config.components import Component
    from torchtune_ac.config.meta_model import build_meta_model
    from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.parallel.fsdp import FSDPConfig
    from torchtune_ac.runtime.dtypes import DType
    from torchtune_ac.activation_checkpointing import ACConfig

    on_cuda = device.type == "cuda"
    component = Component(key="model", path=f"torchtune_ac.models.{model}")
    plan = resolve_memory_plan(ACConfig(), MemoryConfig(), build_meta_model(component), clip_grad_norm=None,
                               dtype=torch.bfloat16, device=device.type)
    start = time.perf_counter()
    built = build_training(build_meta_model(component), AssemblyPlan(dtype=DType.BF16, memory=plan, seed=0),
                           ctx=DistributedContext(0, 1, 0, device)).model
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del built
    if on_cuda:
        torch.cuda.empty_cache()
    return seconds


def torch_pin() -> str | None:
    """The torch version ``constraints.txt`` pins (``torch==X``), or None."""
    path = Path(__file__).resolve().parent.parent / "constraints.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("torch=="):
            return line.split("==", 1)[1].strip()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_env.json")
    parser.add_argument("--build-model", default="llama3_2_1b", help="builder whose random-init build is timed")
    args = parser.parse_args()
    record: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": sys.version.split()[0],
                    "executable": sys.executable, "platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "packages": package_versions()}
    problems = []
    # The torch the suite is pinned to (constraints.txt), against this machine's: a GPU run on another release
    # proves that release, not the pin (the experts' gradients rely on 2.13's FSDP2 over a group of one).
    record["torch_pin"] = torch_pin()
    record["torch_matches_pin"] = record["torch_pin"] == torch.__version__.split("+")[0]
    if not record["torch_matches_pin"]:
        print(f"gpu_env: torch {torch.__version__} here, pinned {record['torch_pin']}: this run proves the former",
              flush=True)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                      memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count,
                      nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None)
    from torchtune_ac.models import attention

    varlen = getattr(attention, "varlen_attn", None)
    record["varlen_attn_signature"] = str(inspect.signature(varlen)) if varlen is not None else None
    record["varlen_support"] = {"present": attention.VARLEN_SUPPORT.present,
                                "window_size": attention.VARLEN_SUPPORT.window_size,
                                "enable_gqa": attention.VARLEN_SUPPORT.enable_gqa}
    if torch.cuda.is_available():
        from torchtune_ac.runtime.process_memory import cublas_workspace_bytes

        # The cuBLAS workspaces a step holds in the caching allocator, as the planner counts them.
        for key, measure in (("cublas_workspaces_mib", lambda: cublas_workspace_bytes(torch.device("cuda"))[0] / 2**20),
                             ("bf16_matmul_tflops", matmul_tflops),
                             (f"build_{args.build_model}_bf16_s", lambda: build_seconds(args.build_model))):
            try:
                record[key] = round(measure(), 2)
            except Exception:  # noqa: BLE001 - recorded for the report; the later stages still run
                problems.append(f"{key}: {traceback.format_exc(limit=3)}")
    record["problems"] = problems
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_env.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
