"""``python -m kimi_quant.cli``."""

from . import run

run()
