"""Writing outputs: a streaming safetensors writer and atomic small-file writes."""

from .atomic import write_atomic, write_json_atomic
from .safetensors_writer import ShardWriter

__all__ = ["ShardWriter", "write_atomic", "write_json_atomic"]
