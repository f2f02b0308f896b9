"""Writing outputs: safetensors shards (streamed by one writer, or assembled from parts) and atomic small-file writes."""

from .atomic import write_atomic, write_json_atomic
from .safetensors_writer import ShardWriter
from .shard_parts import PartWriter, ShardAssembly, finish_shard, on_local_file_system, tensor_offsets

__all__ = ["PartWriter", "ShardAssembly", "ShardWriter", "finish_shard", "on_local_file_system", "tensor_offsets",
           "write_atomic", "write_json_atomic"]
