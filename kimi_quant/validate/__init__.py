"""Validation: perplexity of a quantized ascendV1 checkpoint against its BF16 source.

* ``forward``: plain-torch fp32 reference forward of the K3 / K3.1 family, layer-streamed
  (state between layers = (x, blocks)); KDA recurrent + chunked, gated NoPE MLA + DSA indexer,
  sigmoid router, latent MoE with SiTU, block attention residuals; device activation fake-quant.
* ``weights``: ``SourceLoader`` (BF16 source) and ``QuantizedLoader`` (ascendV1, dequantized by codecs).
* ``tokenizer``: the checkpoint's own ``tiktoken.model`` with Kimi's pre-tokenizer and 256 specials.
* ``calibration``: shipped text (calibration/) or the user's jsonl / txt / parquet / hub dataset.
* ``run``: ``run_validation(source_dir, quant_dir, ...) -> report``; ``command``: ``kimi-quant validate``.

Imports are lazy so that the CLI does not pay for torch until validation runs.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("run_validation", "format_table", "perplexity_of_source"):
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
