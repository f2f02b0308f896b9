"""Run SGLang's real ModelSlim loading code on a CPU: stand-ins for what needs an NPU or is not installed.

``import_sglang(src)`` puts the unpacked wheel's ``sglang`` package (real code, never installed) on the
path, without running ``sglang/__init__.py`` (the front-end API), imports the quantization layers, the
``FusedMoE`` layer and the Kimi K3 model module, and stands in, for the duration:

* ``STUBBED`` packages, none of which this CPU venv installs except ``transformers`` (the [quality]
  extra, absent in CI without it): NPU/GPU or compiled packages (``torch_npu``, ``sgl_kernel*``,
  ``triton``, ``tvm_ffi``) and what only the serving front end, the tokenizers or the multimodal configs
  use. They are inert placeholder modules (``vllm_ascend_stubs``' ones, here also subclassable with class
  keywords and indexable), put first on ``sys.meta_path``, so every machine imports the same way; the
  loading path under test never calls into them (SGLang's config modules only subclass and register
  ``transformers`` classes);
* ``SGLANG_STUBBED``: parts of SGLang the loading code reaches only through imports (HTTP API, grammar
  and output parsers, CUDA JIT kernels, whose C++ sources are not unpacked);
* ``msgspec.Struct`` (compiled): a dataclass with the ``__struct_fields__`` SGLang's runtime context reads;
  ``dill`` (one config module pickles a class at import): ``pickle``;
* module-level ``@torch.compile(...)`` during the import: the identity (nothing decorated runs here, and
  compiling would import the inductor, which probes the triton stub);
* the NPU: SGLang runs its CPU branches (``is_npu()`` is False): ``npu_format_cast`` is then its own
  identity, so the processed weights are the ND tensors the NPU ops receive; ``Tensor.npu()`` is a
  no-op; ``torch.ops.npu`` ops the MoE kernel objects look up at construction exist and raise if called;
* ``logger.info_once`` / ``warning_once``, which SGLang's quantization modules call on stdlib loggers:
  a real process gets them from transformers (``transformers/utils/logging.py`` sets them on
  ``logging.Logger`` at import), which is stubbed here: bound to ``info`` / ``warning`` on those loggers.

The parallel state (one device) is the test's: SGLang's own ``get_parallel().override``.
``remove_sglang()`` takes it all out again (modules, path entry, patched torch and logger attributes),
restoring any real module imported before under a stubbed name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import logging
import pickle
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

import vllm_ascend_stubs as _vs


class _PlaceholderMeta(_vs._PlaceholderMeta):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __getitem__(cls, key):  # registries and generics: ``ALL_ATTENTION_FUNCTIONS["sglang"] = ...``
        return _Placeholder

    def __setitem__(cls, key, value):
        pass


class _Placeholder(_vs._Placeholder, metaclass=_PlaceholderMeta):
    """``vllm_ascend_stubs``' inert stand-in, also subclassable with class keywords (``total=False``)
    and indexable (registries: ``CONFIG_MAPPING._extra_content[...] = ...``)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __getitem__(self, key):
        return _Placeholder()

    def __setitem__(self, key, value):
        pass


class _StubModule(_vs._StubModule):
    placeholder = _Placeholder


#: stood in whatever is installed (first on ``sys.meta_path``)
STUBBED = ("torch_npu", "triton", "sgl_kernel", "sgl_kernel_npu", "tvm_ffi",  # NPU/GPU, compiled
           "msgspec", "dill", "orjson", "pybase64", "einops", "compressed_tensors",
           "starlette", "zmq", "aiohttp", "openai", "IPython",  # the server
           "transformers", "sentencepiece", "PIL", "torchvision")  # tokenizers, multimodal configs
#: parts of SGLang the loading code reaches only through imports
SGLANG_STUBBED = ("sglang.srt.entrypoints", "sglang.srt.constrained", "sglang.srt.parser",
                  "sglang.srt.function_call", "sglang.kernels.jit")


class _StubFinder(_vs._StubFinder):
    """``vllm_ascend_stubs``' finder, for these packages and parts of SGLang, making this file's modules."""

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in STUBBED + SGLANG_STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)


class _Struct:
    """``msgspec.Struct``: a dataclass (``frozen``/``kw_only`` as given) listing its ``__struct_fields__``."""

    def __init_subclass__(cls, frozen: bool = False, kw_only: bool = False, **kwargs):
        super().__init_subclass__()
        for name in cls.__dict__.get("__annotations__", {}):  # msgspec copies mutable defaults
            default = cls.__dict__.get(name)
            if isinstance(default, (dict, list, set)):
                setattr(cls, name, dataclasses.field(default_factory=lambda d=default: type(d)(d)))
        dataclasses.dataclass(cls, frozen=frozen, kw_only=kw_only)
        cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))


#: ``torch.ops.npu`` ops the code under test looks up before any forward (called, they raise)
NPU_FORWARD_OPS = ("npu_dynamic_quant", "npu_dynamic_mx_quant")


def _forward_only(op: str):
    def call(*args, **kwargs):
        raise AssertionError(f"torch.ops.npu.{op} is a forward op: the loading test never runs it")

    return call


_MISSING = object()
_SAVED: dict[str, object] = {}


def _roots() -> tuple[str, ...]:
    return ("sglang",) + STUBBED


def import_sglang(src: Path) -> SimpleNamespace:
    """Import SGLang's ModelSlim quantization path from ``src`` (the unpacked wheel) on this CPU."""
    if _SAVED.get("src") == str(src):
        return _SAVED["consumer"]
    if "src" in _SAVED:
        remove_sglang()
    try:
        return _import(src)
    except BaseException:
        remove_sglang()  # a half-done import leaves nothing behind either
        raise


def _import(src: Path) -> SimpleNamespace:
    # modules already imported under a stubbed name (a real transformers): set aside, put back after
    _SAVED["modules"] = {n: m for n, m in sys.modules.items() if n.split(".")[0] in _roots()}
    for n in _SAVED["modules"]:
        del sys.modules[n]
    sys.meta_path.insert(0, _StubFinder())
    msgspec = _StubModule("msgspec")
    msgspec.Struct, msgspec.field = _Struct, dataclasses.field
    sys.modules["msgspec"] = msgspec
    dill = _StubModule("dill")  # a config module serializes a class at import: by reference does
    dill.dumps, dill.loads = pickle.dumps, pickle.loads
    sys.modules["dill"] = dill
    # the package without its __init__ (the front-end API); its subpackages import normally
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(src / "sglang")]
    pkg.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__
    sys.modules["sglang"] = pkg
    sys.path.insert(0, str(src))
    _SAVED.update({"Tensor.npu": getattr(torch.Tensor, "npu", _MISSING), "src": str(src)})
    torch.Tensor.npu = lambda self, *a, **k: self  # host tensors stand for device tensors
    _SAVED["ops"] = [op for op in NPU_FORWARD_OPS if not hasattr(torch.ops.npu, op)]
    for op in _SAVED["ops"]:  # looked up when a MoE kernel object is built, called only in forward
        setattr(torch.ops.npu, op, _forward_only(op))

    # module-level ``@torch.compile(...)`` decorators would import the inductor, which probes triton (a
    # stub here): not compiled, as nothing decorated runs
    compile_, torch.compile = torch.compile, lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    try:
        from sglang.srt.layers import linear
        from sglang.srt.layers.moe import fused_moe_triton
        from sglang.srt.layers.quantization.modelslim import modelslim
        from sglang.srt.models import kimi_k3
    finally:
        torch.compile = compile_

    # SGLang's quantization modules call ``logger.info_once`` / ``warning_once`` on stdlib loggers; in a real
    # process the (here stubbed) transformers import sets them on logging.Logger: bound here on those module
    # loggers, as plain info / warning
    patched = []
    for name, mod in list(sys.modules.items()):
        logger = getattr(mod, "logger", None) if name.startswith("sglang.") else None
        if isinstance(logger, logging.Logger) and not hasattr(logger, "info_once"):
            logger.info_once, logger.warning_once = logger.info, logger.warning
            patched.append(logger)
    _SAVED["loggers"] = patched
    _SAVED["consumer"] = SimpleNamespace(modelslim=modelslim, ModelSlimConfig=modelslim.ModelSlimConfig,
                                         linear=linear, FusedMoE=fused_moe_triton.FusedMoE,
                                         kimi_k3=kimi_k3)
    return _SAVED["consumer"]


def remove_sglang() -> None:
    """Undo ``import_sglang``: later tests must see neither the stubs nor the patched ``torch``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StubFinder)]
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in _roots() or isinstance(mod, _StubModule):
            del sys.modules[name]
    sys.modules.update(_SAVED.pop("modules", {}))
    if "Tensor.npu" in _SAVED:
        old = _SAVED.pop("Tensor.npu")
        if old is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(torch.Tensor, "npu")
        else:
            torch.Tensor.npu = old
    for op in _SAVED.pop("ops", ()):
        with contextlib.suppress(AttributeError):
            delattr(torch.ops.npu, op)
    for logger in _SAVED.pop("loggers", ()):
        logger.__dict__.pop("info_once", None)
        logger.__dict__.pop("warning_once", None)
    src = _SAVED.pop("src", None)
    _SAVED.pop("consumer", None)
    if src in sys.path:
        sys.path.remove(src)
