"""kimi-quant: stream a BF16 Kimi K3/K3.1 checkpoint into Ascend ascendV1 quantized checkpoints."""

__version__ = "0.1.0"
