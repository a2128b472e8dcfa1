"""The one exception type for mistakes in the user's input (config, command line, files).

The CLI turns a ``UserError`` into a short message on stderr and exit status 2, with no traceback.
Anything else escaping is a bug in torchtune_ac and exits 1 with a traceback.
"""


class UserError(Exception):
    """A problem the user can fix: the message names the key, file or line and says what is allowed."""
