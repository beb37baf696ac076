"""The one exception type a user sees.

Every error caused by the user's input (a bad flag, a missing dataset, a run that conflicts with an
existing manifest) is raised as :class:`CaptureError`. The CLI prints its message as one line on stderr
and exits with status 2; anything else is a bug and keeps its traceback.
"""


class CaptureError(Exception):
    """A user-facing error: one line, no traceback."""
