"""The conversion kernels compiled ahead of time, so that workers start without numba.

A worker that imports numba and loads its cached kernels spends ~0.7 s of a core first (numba's
import ~0.3 s, the set-up of its JIT ~0.4 s): on a short conversion a fifth of the wall time, paid
before the first byte. ``numba.pycc`` compiles the same functions of ``kernels.py`` (unchanged: the
same numba front end and LLVM, so the same machine code and bytes; ``tests/test_kernels_exhaustive.py``
runs on both) into a small extension module that imports in a millisecond, with no numba in the process.

The module is built once per *key*: the kernels' sources, numba and llvmlite, the Python ABI and the
CPU (it is compiled for this CPU, as numba's JIT is). It is kept beside numba's own cache:
NUMBA_CACHE_DIR when set, else ``quant/__pycache__`` when writable, else ``<cache>/numba``; each
must be a private directory (``cache.private_dir``: a shared or re-pointable one would let another
local user plant the module, or numba's pickled index, that this process then runs), and
``numba_cache_dir`` points numba at the same checked place. The module is loaded only when its
sha256 matches the one recorded beside it at build time (a damaged or foreign file is rebuilt, with
one warning: a truncated ``.so`` would otherwise crash the process with SIGBUS). The
first conversion after an install or upgrade builds it (~20 s, where it used to JIT-compile ~10 s).
A build needs ``numba.pycc`` (deprecated by numba) and a C compiler; without either the kernels stay
numba's JIT kernels, as before, and a ``.failed`` file beside it says why (no later run retries that
key; delete the file to retry).

pycc's entry points check nothing about their arguments: not the dtype, the layout, not even that
an argument is an array. So every call goes through ``CompiledKernels._checked``, which passes only
what the signature was compiled for and raises TypeError for anything else.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import numpy as np

import logging

from ..cache import cpu_id, file_digest, private_dir, read_private, write_private
from .numba_cache import numba_cache_dir, warn_once

log = logging.getLogger(__name__)

#: The exported kernels: name -> the argument kinds of its one signature. "w": the weights' bf16 bits,
#: uint16 [N, K] (typed read-only: pycc accepts a writable array there too, and the kernels never write
#: it); "r_uint8": a uint8 [.., ..] input (typed read-only likewise); "i64"/"f32": scalars; other entries: a
#: writable C-contiguous 2-D output of that dtype.
EXPORTS = {
    "int8_kernel": ("w", "int8", "float32"),
    "int8_pow2_kernel": ("w", "int8", "float32"),
    "int4_kernel": ("w", "int8", "float32", "float32"),
    "int4_group_kernel": ("w", "i64", "i64", "int8", "float32", "float32"),
    "mxfp4_kernel": ("w", "uint8", "uint8", "f32"),
    "mxfp8_kernel": ("w", "uint8", "uint8", "f32"),
    "mxfp4_decode_kernel": ("r_uint8", "r_uint8", "uint16"),
}
#: What the key covers besides the versions: the sources the compiled code comes from.
_SOURCES = ("kernels.py", "numerics.py", "aot.py")
_HERE = Path(__file__).resolve().parent


def _package_version(name: str) -> bytes:
    """``<name>/_version.py`` (numba's and llvmlite's version, with the git revision of a development
    build), found without importing the package or reading every distribution's metadata."""
    spec = importlib.util.find_spec(name)
    try:
        return (Path(spec.origin).parent / "_version.py").read_bytes()
    except (AttributeError, TypeError, OSError):
        return b"-"


@functools.cache
def key() -> str:
    """Names the compiled module of this process's kernels: their sources, numba and llvmlite, the
    Python ABI and the CPU. Computed once per process (its code was read at import), not per call."""
    h = hashlib.blake2b(digest_size=10)
    for name in _SOURCES:
        h.update((_HERE / name).read_bytes())
    for part in (_package_version("numba"), _package_version("llvmlite"), sys.implementation.cache_tag.encode(),
                 (sysconfig.get_config_var("EXT_SUFFIX") or "").encode(), cpu_id().encode()):
        h.update(b"\0" + part)
    return h.hexdigest()


def cache_root() -> Path:
    """Where the module is kept: beside numba's cache of the same kernels (see the module docstring)."""
    d = numba_cache_dir()
    if d is None:
        return _HERE / "__pycache__"
    return private_dir(d / "kimi_quant_aot", "compiled kernels")


def _module_name(k: str) -> str:
    return f"kq_kernels_{k}"


def module_path(k: str | None = None) -> Path:
    k = k or key()
    return cache_root() / (_module_name(k) + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def failed_path(k: str | None = None) -> Path:
    return cache_root() / (_module_name(k or key()) + ".failed")


def digest_path(k: str | None = None) -> Path:
    """The module's sha256, recorded when it was built."""
    return cache_root() / (_module_name(k or key()) + ".sha256")


def state() -> str:
    """"built", "missing" (the next conversion builds it: also when the file does not match the
    digest recorded at its build), or where numba's JIT kernels are used: "failed" (the build did)
    or "untrusted" (the module file is writable by others or a link, see ``_trusted``)."""
    k = key()
    path = module_path(k)
    if os.path.lexists(path):
        if not _trusted(path):
            return "untrusted"
        return "built" if _matches_digest(k, path) else "missing"
    return "failed" if failed_path(k).is_file() else "missing"


def _trusted(path: Path) -> bool:
    """Loading a module runs its code: only a plain file of ours (not a link) that no one else can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _matches_digest(k: str, path: Path) -> bool:
    recorded = read_private(digest_path(k), 128)
    try:
        return recorded is not None and recorded.decode().strip() == file_digest(path)
    except (OSError, UnicodeDecodeError):
        return False


def load(build: bool = True):
    """The compiled kernels (an object with ``EXPORTS``' names), or None: then use numba's JIT kernels.
    Builds the module when missing (``build``) and no earlier build of the same key failed; one that
    does not match its recorded digest (damaged, or not built here) is removed and rebuilt."""
    k = key()
    path = module_path(k)
    if os.path.lexists(path) and _trusted(path) and not _matches_digest(k, path):
        warn_once(f"compiled kernels {path} do not match the digest recorded when they were built (damaged, "
                   "or not built by kimi-quant): rebuilding them")
        for stale in (path, digest_path(k)):
            with contextlib.suppress(OSError):
                stale.unlink()
    if not os.path.lexists(path):
        if not build or failed_path(k).is_file():
            return None
        try:
            _build_once(k, path)
        except Exception as e:  # noqa: BLE001 - any failure leaves the JIT kernels, said once in the .failed file
            _record_failure(k, e)
            return None
        if not path.is_file():  # another process's build of this key failed meanwhile
            return None
    if not _trusted(path) or not _matches_digest(k, path):
        return None
    name = _module_name(k)
    mod = sys.modules.get(name)
    if mod is None:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        sys.modules[name] = mod
    return CompiledKernels(mod)


def _build_once(k: str, path: Path) -> None:
    """Build unless another process (a Ray worker, a second run starting at the same time) holds the
    key's lock: then wait for it and use what it built (or its .failed file)."""
    import fcntl

    fd = os.open(path.with_name(_module_name(k) + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not os.path.lexists(path) and not failed_path(k).is_file():
            _build(k, path)
    finally:
        os.close(fd)  # releases the lock (so does the kernel if this process is killed)


def _record_failure(k: str, e: BaseException) -> None:
    line = " ".join(f"{type(e).__name__}: {e}".split())[:500]
    with contextlib.suppress(OSError):
        write_private(failed_path(k), (line + "\n").encode())  # why the build failed; numba's JIT kernels are used


def _numba_type(kind: str):
    from numba import types

    if kind == "w":
        return types.Array(types.uint16, 2, "C", readonly=True)
    if kind == "r_uint8":
        return types.Array(types.uint8, 2, "C", readonly=True)
    if kind == "i64":
        return types.int64
    if kind == "f32":
        return types.float32
    return types.Array(getattr(types, kind), 2, "C")


def _build(k: str, path: Path) -> None:
    """Compile ``EXPORTS`` with numba.pycc in a scratch folder, then move the module into place by a
    rename: a build killed part-way leaves no module that looks whole."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba.pycc's pending-deprecation warning
        from numba import types
        from numba.pycc import CC

    from . import kernels

    scratch = Path(tempfile.mkdtemp(prefix="kq-aot-"))  # pycc's intermediate files, removed after
    try:
        cc = CC(_module_name(k))
        cc.output_dir = str(scratch)
        cc.target_cpu = "host"  # as numba's JIT compiles; the key holds the CPU
        cc.verbose = False
        for name, kinds in EXPORTS.items():
            sig = types.int64(*map(_numba_type, kinds))
            cc.export(name, sig)(getattr(kernels, name).py_func)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cc.compile()  # verbose off: distutils echoes no command lines
        built = next(scratch.glob(_module_name(k) + "*"), None)
        if built is None:
            raise RuntimeError(f"numba.pycc reported success but wrote no module into {scratch}")
        data = built.read_bytes()
        # the digest first: a module without its digest is never loaded, one with it is whole
        write_private(digest_path(k), (hashlib.sha256(data).hexdigest() + "\n").encode())
        write_private(path, data, mode=0o755)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fits(kind: str, a) -> bool:
    if kind == "w":
        return isinstance(a, np.ndarray) and a.dtype == np.uint16 and a.ndim == 2 and a.flags.c_contiguous
    if kind == "r_uint8":
        return isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.ndim == 2 and a.flags.c_contiguous
    if kind == "i64":
        return isinstance(a, (int, np.integer)) and not isinstance(a, bool) and -2**63 <= a < 2**63
    if kind == "f32":
        return isinstance(a, (float, np.floating))
    return (isinstance(a, np.ndarray) and a.dtype == np.dtype(kind) and a.ndim == 2 and a.flags.c_contiguous
            and a.flags.writeable)


def _describe(kinds: tuple[str, ...]) -> str:
    words = {"w": "uint16 bf16 bits [N, K]", "r_uint8": "uint8 [.., ..]", "i64": "an int", "f32": "a float"}
    return ", ".join(words.get(k, f"writable {k} [.., ..]") for k in kinds)


class CompiledKernels:
    """The compiled module's kernels under the names (and default arguments) of ``kernels``. Every
    call is checked first (C-contiguous 2-D arrays of the compiled dtypes, outputs writable): the
    entry points themselves would read or write any other array as if it were one. The codecs only
    ever pass such arrays (``Codec.alloc``); anything else is a TypeError, never memory overwritten."""

    def __init__(self, module):
        self.module = module
        from .numerics import MX_SCREEN_MARGIN

        self._defaults = {"mxfp4_kernel": (MX_SCREEN_MARGIN,), "mxfp8_kernel": (MX_SCREEN_MARGIN,)}
        for name, kinds in EXPORTS.items():
            setattr(self, name, self._checked(name, kinds, getattr(module, name)))

    def _checked(self, name: str, kinds: tuple[str, ...], fast):
        defaults = self._defaults.get(name, ())

        def call(*args):
            if len(args) < len(kinds):
                args = args + defaults[len(args) - len(kinds):]
            if len(args) != len(kinds) or not all(map(_fits, kinds, args)):
                got = ", ".join(f"{a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' strided'}"
                                if isinstance(a, np.ndarray) else type(a).__name__ for a in args)
                raise TypeError(f"{name} takes C-contiguous arrays: ({_describe(kinds)}); got ({got})")
            return fast(*args)

        call.__name__ = name
        return call

    def warmup(self, writable: bool = True) -> None:
        """Nothing to compile: the module is loaded."""

    def __getattr__(self, name: str):  # the rest: numba's JIT kernels
        return getattr(_jit(), name)


def _jit():
    from . import kernels

    return kernels
