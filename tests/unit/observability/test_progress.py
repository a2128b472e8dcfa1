"""The progress report's choice of a bar or plain lines: a terminal that reports no width (a pseudo-terminal whose
size was never set) gets the plain lines, which it can show, not a bar fitted to 0 columns."""

from __future__ import annotations

import fcntl
import os
import struct
import termios

import pytest

from torchtune_ac.observability.progress import ProgressReporter, terminal_columns


@pytest.mark.parametrize("columns, bar", [(0, False), (80, True)])
def test_a_terminal_of_no_width_gets_plain_lines(columns, bar):
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        with os.fdopen(slave, "w", closefd=False) as stream:
            assert terminal_columns(stream) == columns
            progress = ProgressReporter(total=2, initial=0, every=1, enabled=True, stream=stream)
            assert progress.interactive is bar
            progress.update(step=1, loss=1.5, lr=1e-3, tokens_per_second=10, target_tokens_per_second=5)
            progress.close()
            stream.flush()
        shown = os.read(master, 65536).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert ("step 1/2 | loss 1.5000 | lr 1.00e-03" in shown) is not bar
    assert ("train:  50%" in shown) is bar
