"""The ``kimi-quant`` command line: one module per command family, registered on the group in ``app``.

Every user-caused failure is one line on stderr and a non-zero exit; ``--debug`` (or
KIMI_QUANT_DEBUG=1) shows the traceback as well.
"""

from __future__ import annotations

from . import convert_cmd, plan_cmd, tools  # noqa: F401 - each registers its commands on ``main``
from .app import main, run
from .params import parse_size

__all__ = ["main", "parse_size", "run"]


def _register_optional_commands() -> None:
    """Commands whose modules live with their feature (validation, publishing)."""
    for module, name in (("kimi_quant.validate.command", "validate"), ("kimi_quant.publish.command", "publish")):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        main.add_command(getattr(mod, name), name)


_register_optional_commands()
