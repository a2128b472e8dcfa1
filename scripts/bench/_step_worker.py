"""A ``tune run`` that steps only when handed the turn: one side of ``bench_train.py --against`` (``_against.py``).

    python scripts/bench/_step_worker.py GO_FD REPORT_FD run full_finetune --config ... [overrides]

Runs ``torchtune_ac.cli.main`` of whichever checkout is first on ``PYTHONPATH`` (the revision or the working
tree), with ``torchtune_ac.training.step.train_step`` wrapped before the recipe imports it:

  * before the first step it writes ``{"ready": true}`` to REPORT_FD and waits for a byte on GO_FD;
  * after each step it writes ``{"time": seconds, "loss": loss}`` and waits for the next byte. ``time`` runs
    from the byte that started this iteration of the recipe's loop (its bookkeeping after the step before, the
    next batch, ``train_step``) to the end of ``train_step``: one whole iteration, the waiting excluded.

Nothing of the recipe is changed but the waiting; the side's own code sets up, trains, saves and exits.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time


def main() -> int:
    go_fd, report_fd = int(sys.argv[1]), int(sys.argv[2])
    go = os.fdopen(go_fd, "rb", buffering=0)
    report = os.fdopen(report_fd, "w", buffering=1)

    def wait_turn() -> float:
        if not go.read(1):
            raise SystemExit("bench_train --against: the benchmark went away")
        return time.perf_counter()

    from torchtune_ac.training import step as step_module

    real_train_step = step_module.train_step
    turn = {}

    @functools.wraps(real_train_step)
    def train_step(*args, **kwargs):
        if not turn:
            report.write(json.dumps({"ready": True}) + "\n")
            turn["start"] = wait_turn()
        result = real_train_step(*args, **kwargs)
        report.write(json.dumps({"time": time.perf_counter() - turn["start"], "loss": result.loss}) + "\n")
        turn["start"] = wait_turn()
        return result

    step_module.train_step = train_step
    from torchtune_ac import cli

    return cli.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
