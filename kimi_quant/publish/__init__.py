"""Publish a verified ascendV1 output to a Hugging Face hub repo (``kimi-quant publish``)."""

from .publish import PublishError, PublishResult, check_output, model_card, publish

__all__ = ["PublishError", "PublishResult", "check_output", "model_card", "publish"]
