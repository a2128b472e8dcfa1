"""The exception types the CLI turns into one line on stderr and a documented exit status, with no traceback.

``UserError`` is a mistake in the user's input (config, command line, files): exit status 2. ``UnavailableError``
is the kind of user error that depends on the machine (a file, directory, device or package missing here):
``tune validate`` reports it as a warning, since the run may happen elsewhere. ``RunStopped`` is a run that ended
early on purpose, after making safe what can be made safe (stopped by a signal after a checkpoint, or on a
non-finite loss before the optimizer could take it in). Anything else escaping is a bug in torchtune_ac and exits
1 with a traceback.
"""

EXIT_USER_ERROR = 2
# The run stopped on a non-finite loss or gradient norm; the newest checkpoint predates it.
EXIT_NON_FINITE = 3
# Interrupted at once (a second Ctrl-C): the shell's status for SIGINT.
EXIT_INTERRUPTED = 130
# Stopped by SIGTERM or a first Ctrl-C once every rank had finished its step and the checkpoint was written: the
# shell's status for SIGTERM, which schedulers already read as "terminated on request".
EXIT_STOPPED = 143
# The reader of stdout went away (`tune ls | head`): the shell's status for a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 141


class UserError(Exception):
    """A problem the user can fix: the message names the key, file or line and says what is allowed."""


class UnavailableError(UserError):
    """Something the run needs is missing or unavailable on this machine: a file or directory, a device, a package.

    An error for ``tune run``; a warning for ``tune validate``, which may run on another machine than the training
    one. A file that exists and contradicts the config is a plain ``UserError``, an error in both.
    """


class RunStopped(Exception):
    """The run ended before its last step, on purpose: the CLI prints ``tune: <message>`` when ``announce`` (one
    rank says it for all) and exits with ``exit_status``, without a traceback."""

    def __init__(self, message: str, *, exit_status: int, announce: bool = True) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        self.announce = announce
