"""One exception type for every failure a user can cause or fix.

The CLI prints ``KimiQuantError`` as a single line and exits non-zero; anything else is a bug
and keeps its traceback (``--debug`` shows tracebacks for both).
"""


class KimiQuantError(Exception):
    """A failure explained in one line (bad input, unsupported target, full disk, ...)."""

    exit_code = 2


class UnsupportedTarget(KimiQuantError):
    pass


class BadCheckpoint(KimiQuantError):
    """The source checkpoint is damaged or inconsistent (names the file and tensor)."""


class RecipeError(KimiQuantError):
    """The recipe cannot be applied to this model (refused before any work starts)."""


class ValidationFailed(KimiQuantError):
    """The output converted fine but its perplexity rose past the user's bound (--max-ppl-increase)."""

    exit_code = 3
