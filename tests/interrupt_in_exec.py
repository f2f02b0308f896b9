"""``python -m interrupt_in_exec ARGS...`` runs ``python -m kimi_quant.cli ARGS...`` with a Ctrl-C injected
at an exact point: while Python runs code that ``dataclasses`` built as a string and ``exec``-ed, which is
where any import of a module defining a dataclass spends part of its time.

A KeyboardInterrupt leaving code that ``exec``/``eval`` ran from a string sets CPython's "unhandled
KeyboardInterrupt" flag (``_Py_UnhandledKeyboardInterrupt``, set in ``run_eval_code_obj``) even when the
program catches it further up; under ``python -m`` (``pymain_run_module``), after the program's own
``sys.exit(130)`` and the interpreter's finalization, Python then kills itself with SIGINT (returncode -2).
A test has to run through ``-m`` to see that, hence this module (a test helper, not a test).

KQ_INTERRUPT_AT says where to fire, once: at the first dataclass that module defines (a module name such
as ``kimi_quant.targets``), or at the first one any ``kimi_quant`` module defines once the workers exist,
or the fork server they come from (``workers``). The SIGINT goes to
the whole process group, as a terminal's Ctrl-C does (start this in a session of its own). When it
fires, the name of the module being imported is written to KQ_INTERRUPT_MARK.
"""

from __future__ import annotations

import builtins
import dataclasses
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

#: prepended to the source dataclasses exec's: the signal, then a loop whose backward jumps check for it,
#: so that the KeyboardInterrupt is raised inside the exec'd code whichever thread the kernel hands it to
_CTRL_C = "__import__('os').killpg(0, __import__('signal').SIGINT)\nfor _ in range(10 ** 8): pass\n"
_fired = False


def _due(namespace) -> bool:
    if _fired or not isinstance(namespace, dict):
        return False
    module, at = str(namespace.get("__name__", "")), os.environ.get("KQ_INTERRUPT_AT", "")
    if at == "workers":
        fork_server = sys.modules.get("kimi_quant.executor.fork_server")
        return (module.startswith("kimi_quant.") and fork_server is not None
                and (fork_server.fork_server_pid() is not None or bool(multiprocessing.active_children())))
    return module == at


def _exec(source, globals=None, locals=None, /):
    global _fired
    if isinstance(source, str) and _due(globals):
        _fired = True
        mark = os.environ.get("KQ_INTERRUPT_MARK")
        if mark:
            with open(mark, "w") as f:
                f.write(str(globals["__name__"]))
        source = _CTRL_C + source
    return builtins.exec(source, globals, locals)


def run(args, at: str, mark: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m interrupt_in_exec ARGS`` (text, captured), in a session of its own with SIGINT at its
    default, as under a terminal; ``mark`` says whether (and where) the Ctrl-C was fired."""
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KQ_INTERRUPT_AT": at, "KQ_INTERRUPT_MARK": str(mark),
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), here) if p)}
    env.pop("KIMI_QUANT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "interrupt_in_exec", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


if __name__ == "__main__":
    dataclasses.exec = _exec  # the module's own global shadows the builtin it calls
    runpy.run_module("kimi_quant.cli", run_name="__main__", alter_sys=True)
