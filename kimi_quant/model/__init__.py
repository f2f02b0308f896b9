"""The model family: config parsing, tensor roles, expected tensors, synthetic checkpoints."""

from .spec import ModelSpec, TensorRole, TextConfig, load_model_spec

__all__ = ["ModelSpec", "TensorRole", "TextConfig", "load_model_spec"]
