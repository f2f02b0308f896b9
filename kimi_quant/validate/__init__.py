"""Validation: perplexity of a quantized ascendV1 checkpoint against its source.

* ``run``: ``run_validation(source_dir, quant_dir, ...) -> report``, both models run side by side
  by ``kimi_quant.runtime``; ``command``: ``kimi-quant validate``. The report's record in an output
  (verdict, card numbers) is ``kimi_quant.layout.validation``.

Imports are lazy so that the CLI does not pay for torch until validation runs.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("run_validation", "format_table", "perplexity_of_source"):
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
