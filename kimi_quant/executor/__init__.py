"""Executors run jobs in workers; the driver in convert.py owns journal and metadata.

A job is a part of an output shard (``shards.py`` splits shards and assembles them: every core
busy at any shard size) or, for callers that want it, a whole shard (``unit.convert_unit``).
An executor has ``slots`` (jobs that run at once), ``submit(job_json, paths, out_dir)`` returning
a ``concurrent.futures.Future`` of the job's result dict (``unit.run_job``), and ``shutdown(abort)``.
Progress (bytes of input done) goes to the ``on_progress`` callback given at construction.
"""

from .local import LocalExecutor, make_executor

__all__ = ["LocalExecutor", "make_executor"]
