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


#: how to get the CPU build of PyTorch (the default wheel on Linux is a multi-GB CUDA build)
TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu (or torch from your registry)"


def require_torch(what: str) -> None:
    """Refuse ``what`` in one line when PyTorch is missing: converting, planning, verifying and publishing
    run without it; the model's forward (validation, calibration) needs it."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a module set to None, or one without a spec
        found = False
    if not found:
        raise KimiQuantError(f"{what} runs the model in PyTorch, which is not installed: {TORCH_INSTALL}")
