"""Publish a verified ascendV1 output to a Hugging Face hub repo (``kimi-quant publish``)."""

from ..layout.model_card import model_card
from .publish import PublishError, PublishResult, check_output, publish

__all__ = ["PublishError", "PublishResult", "check_output", "model_card", "publish"]
