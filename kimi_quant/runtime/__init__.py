"""The K3-family model run on CPU in plain torch: what validation and calibration both execute.

* ``forward``: fp32 reference forward, layer-streamed (state between layers = (x, blocks)); KDA
  recurrent + chunked, gated NoPE MLA + DSA indexer, sigmoid router, latent MoE with SiTU, block
  attention residuals; the device's activation fake-quant.
* ``weights``: ``SourceLoader`` (the source: BF16, MXFP4 experts decoded) and ``QuantizedLoader``
  (an ascendV1 output, dequantized by the codecs).
* ``tokenizer``: the checkpoint's own ``tiktoken.model`` with Kimi's pre-tokenizer and 256 specials.
* ``text``: the shipped text (calibration/) or a user's jsonl / txt / parquet / hub dataset, and the
  token windows cut from it.

Nothing here imports torch at package import; the CLI pays for it only when the model runs.
"""
