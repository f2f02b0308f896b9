"""Executors run plan units (output shards); the driver in convert.py owns journal and metadata.

An executor has ``slots`` (units worth keeping in flight), ``submit(unit_json, paths, out_dir)``
returning a ``concurrent.futures.Future`` of ``{file, size, sha256}``, and ``shutdown(abort)``.
Progress (bytes of input done) goes to the ``on_progress`` callback given at construction.
"""

from .local import LocalExecutor, make_executor

__all__ = ["LocalExecutor", "make_executor"]
