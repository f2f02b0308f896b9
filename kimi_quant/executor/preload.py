"""Imported once by the local executor's fork server, before any worker exists.

Workers are forked from that server, so each starts with the unit code imported and the kernels
already loaded (built once when missing, rather than once per worker).
"""

import gc

from ..quant import warmup
from . import unit  # noqa: F401  (imported here so that no worker imports it again)

warmup(writable=False)  # workers read read-only mmap views
# What is loaded now lives as long as the workers: out of the collector's sight, a worker's full
# collections no longer walk every module object (~1% of a conversion's CPU otherwise).
gc.freeze()
