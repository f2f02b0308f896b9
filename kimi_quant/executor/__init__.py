"""Executors run jobs in workers; the driver in convert.py owns journal and metadata.

A job writes a whole output shard, or a part of one (``shards.py`` decides: shards are split only
when fewer are left than workers, so every core is busy at any shard size), into a temporary file
the driver created; ``unit.convert_unit`` (a whole shard, file and all) is there for other callers.
An executor (the ``base.Executor`` protocol) has ``slots`` (jobs that run at once),
``submit(job_json, paths, out_dir)`` returning a ``concurrent.futures.Future`` of the job's result
dict (``unit.run_job``), and ``shutdown(abort)``. Progress (bytes of input done) goes to the
``on_progress`` callback given at construction.

Imports are lazy: where workers come from a fork server (``fork_server``), ``kimi-quant convert``
starts it before the driver imports numpy.
"""

__all__ = ["LocalExecutor", "make_executor"]


def __getattr__(name: str):
    if name in __all__:
        from . import local

        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
