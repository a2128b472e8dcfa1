"""Rank 0's progress report: a tqdm bar on a terminal, plain lines everywhere else.

A bar redraws itself with carriage returns; in a SLURM log, a CI log or ``nohup.out`` each redraw stays in the
file as one more very long line. When the stream is not a terminal (or one that reports no width) the bar is off
and a plain line is printed every ``every`` steps (the recipe passes ``log_every_n_steps``) and at the last step.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping, Optional, TextIO

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def terminal_columns(stream: TextIO) -> int:
    """The width the terminal behind ``stream`` reports; 0 when it reports none (or cannot be asked)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class ProgressReporter:
    """Shows training progress on ``stream`` (rank 0 only: ``enabled`` is false elsewhere)."""

    def __init__(self, *, total: int, initial: int, every: int, enabled: bool, stream: Optional[TextIO] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.initial, self.every = total, initial, every
        self.enabled = enabled
        # A terminal that reports no width (a pseudo-terminal whose size was never set) gets the plain lines: a bar
        # fitted to 0 columns shows nothing there.
        self.interactive = enabled and self.stream.isatty() and terminal_columns(self.stream) > 0
        self.started = time.perf_counter()
        self.val_loss: Optional[float] = None
        self.bar = tqdm(total=total, initial=initial, desc="train", disable=not self.interactive, dynamic_ncols=True,
                        file=self.stream)

    def update(self, *, step: int, loss: float, lr: float, tokens_per_second: float,
               target_tokens_per_second: float, val_loss: Optional[float] = None,
               extra: Mapping[str, float] = {}) -> None:
        """Report that optimizer step ``step`` (1-based, counted over the whole run) is done (``val_loss``: the
        validation loss computed after it, if one was; shown until the next; ``extra``: the recipe's own values of
        the step, shown after the loss)."""
        if val_loss is not None:
            self.val_loss = val_loss
        if self.interactive:
            self.bar.update(1)
            postfix = dict(loss=f"{loss:.4f}", **{k: f"{v:.4g}" for k, v in extra.items()}, lr=f"{lr:.2e}",
                           tok_s=f"{tokens_per_second:,.0f}", tgt_s=f"{target_tokens_per_second:,.0f}")
            if self.val_loss is not None:
                postfix["val_loss"] = f"{self.val_loss:.4f}"
            self.bar.set_postfix(**postfix)
            return
        if not self.enabled or (step % self.every != 0 and step != self.total and val_loss is None):
            return
        elapsed = time.perf_counter() - self.started
        done = step - self.initial
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        validation = f" | val_loss {self.val_loss:.4f}" if self.val_loss is not None else ""
        own = "".join(f" | {k} {v:.4g}" for k, v in extra.items())
        print(
            f"step {step}/{self.total} | loss {loss:.4f}{own}{validation} | lr {lr:.2e} | tokens/s {tokens_per_second:,.0f} | "
            f"target tokens/s {target_tokens_per_second:,.0f} | elapsed {format_duration(elapsed)} | "
            f"eta {format_duration(eta)}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        self.bar.close()
