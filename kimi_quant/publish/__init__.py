"""Publish a verified ascendV1 output to a Hugging Face hub repo (``kimi-quant publish``).

Imports are lazy: the CLI registers ``publish`` without importing numpy or the hub client.
"""

import importlib

__all__ = ["PublishError", "PublishResult", "check_output", "model_card", "publish"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Importing the submodule binds `publish` here to it: bind every public name, the function last.
    module = importlib.import_module(f"{__name__}.publish")
    from ..layout.model_card import model_card

    globals().update({n: getattr(module, n) for n in __all__ if n != "model_card"}, model_card=model_card)
    return globals()[name]
