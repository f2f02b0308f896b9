"""Run vLLM-Ascend's real quantization code on a CPU: stand-ins for what needs an NPU, and for vLLM.

``import_vllm_ascend(src)`` puts the pinned sdist's ``vllm_ascend`` package (real code, unbuilt) on
the path and installs stand-ins for what is missing on a CPU machine:

* ``torch_npu``: the format casts are the identity (ND stays ND: the test reads weights as the
  ND-order tensors the ops receive), dtype names exist, ``Tensor.npu()`` is a no-op;
* the few ``vllm`` names the quantization path touches, with the behaviour it relies on
  (``LinearBase``/``RowParallelLinear``/``FusedMoE`` classes for its ``isinstance`` checks,
  ``set_weight_attrs``, ``QuantizationConfig``, a settable current ``VllmConfig``, ...);
* any other ``vllm.*`` name it merely imports (forward paths, distributed helpers) resolves to an
  inert placeholder class; calling into one from the code under test would fail loudly.

Both module layouts load: 0.2x (``quantization/modelslim_config.py``, ``FusedMoE``) and 0.30
(``quantization/configs/``, ``quantization/methods/<family>/``; its MoE layers are vLLM's
``RoutedExperts``/``MoERunner``, here the same ``FusedMoE`` class, and for model_type kimi_k3 it reads
the packed modules of vLLM's ``KimiLinearModel``, here a class the test sets them on). One version at
a time: importing another ``src`` removes the one imported before.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch


class _PlaceholderMeta(type):
    def __getattr__(cls, name):  # class attributes (enum members, constants) are placeholders too
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Placeholder(metaclass=_PlaceholderMeta):
    """An inert stand-in: subclassable, callable, decorates by returning what it decorates."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


class _StubModule(types.ModuleType):
    placeholder = _Placeholder  # what a missing name becomes (a subclass of it)

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []  # a package: submodules resolve too
        self.__file__ = f"<stub {name}>"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (self.placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``vllm`` / ``torch_npu`` (and anything below) to stub modules when not installed
    (it is last on ``sys.meta_path``: an installed package is always found first)."""

    # transformers: a type annotation only; compressed_tensors: imported by 0.30's sibling config module
    roots = ("vllm", "torch_npu", "triton", "transformers", "compressed_tensors")

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _module(name: str, **attrs) -> types.ModuleType:
    mod = _StubModule(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


# -- the vllm names the quantization path relies on, with the behaviour it relies on ----------------------
class LinearBase(torch.nn.Module):
    disable_tp = False  # vLLM's ``disable_tp``: True for a replicated layer

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        # vLLM's LinearBase: this rank of the tensor-parallel group (``set_current_vllm_config``)
        self.tp_rank, self.tp_size = (0, 1) if self.disable_tp else (_CURRENT.tp_rank, _CURRENT.tp_size)


class ReplicatedLinear(LinearBase):
    disable_tp = True


class ColumnParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class RowParallelLinear(LinearBase):
    pass


class FusedMoE(torch.nn.Module):
    """vLLM's fused-MoE layer (``RoutedExperts`` / ``MoERunner`` in the vLLM that 0.30 pairs with)."""

    def __init__(self, prefix: str = "", moe_config=None, activation: str = "silu"):
        super().__init__()
        self.prefix = prefix
        self.moe_config = moe_config
        self.activation = activation  # the model's hidden_act (K3: "situ"; 0.30 reads it after loading)
        # no expert parallelism: every rank holds every expert, each split along the intermediate size
        self.tp_rank, self.tp_size = _CURRENT.tp_rank, _CURRENT.tp_size

    def weight_loader(self, *args, **kwargs):  # 0.30 wraps it; the test loads as vLLM's loader does
        raise AssertionError("the test loads MoE weights itself")


class KimiLinearModel(torch.nn.Module):
    """vLLM's K3 model class: 0.30 reads its ``packed_modules_mapping`` (set by the test)."""

    packed_modules_mapping: dict[str, list[str]] = {}


class VocabParallelEmbedding(torch.nn.Module):
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class AttentionLayerBase(torch.nn.Module):
    pass


class QuantizeMethodBase:
    pass


class LinearMethodBase(QuantizeMethodBase):
    pass


class FusedMoEMethodBase(QuantizeMethodBase):
    def __init__(self, moe_config=None):
        self.moe = moe_config


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    pass


class QuantizationConfig:
    def __init__(self):
        self.packed_modules_mapping: dict[str, list[str]] = {}


class FusedMoeWeightScaleSupported(enum.Enum):
    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"


class PerTensorScaleParameter(torch.nn.Parameter):
    def __new__(cls, data, weight_loader=None):
        return super().__new__(cls, data, requires_grad=False)


def set_weight_attrs(weight, weight_attrs):
    for key, value in (weight_attrs or {}).items():
        setattr(weight, key, value)


class _OnceLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return msg, kwargs

    info_once = logging.LoggerAdapter.info
    warning_once = logging.LoggerAdapter.warning
    debug_once = logging.LoggerAdapter.debug


_CURRENT = SimpleNamespace(config=None, tp_size=1, tp_rank=0)


def set_current_vllm_config(quant_config, model_type: str, tp_size: int = 1, tp_rank: int = 0) -> None:
    """What ``get_current_vllm_config()`` returns while a layer is built: eager, no EP, rank ``tp_rank`` of
    ``tp_size`` (also what ``get_tensor_model_parallel_world_size/rank`` and the layers' ``tp_size/tp_rank``
    say)."""
    _CURRENT.tp_size, _CURRENT.tp_rank = tp_size, tp_rank
    _CURRENT.config = SimpleNamespace(
        quant_config=quant_config,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type), enforce_eager=True,
                                     dtype=torch.bfloat16, use_mla=False),
        parallel_config=SimpleNamespace(enable_expert_parallel=False, tensor_parallel_size=tp_size,
                                        enable_eplb=False),
        compilation_config=SimpleNamespace(mode=0),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        kv_transfer_config=None,
        lora_config=None,
        use_v2_model_runner=False,
        additional_config={},
    )


class CompilationMode(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


# -- torch_npu: what the weight-processing code calls ------------------------------------------------------
def _torch_npu() -> types.ModuleType:
    return _module(
        "torch_npu",
        npu_format_cast=lambda t, fmt, *a, **k: t,  # FRACTAL_NZ etc.: kept ND here (see module docstring)
        get_npu_format=lambda t: 2,
        float4_e2m1fn_x2="float4_e2m1fn_x2",
        float8_e8m0fnu="float8_e8m0fnu",
        npu_dynamic_mx_quant=_Placeholder(),
        npu_quant_matmul=_Placeholder(),
        npu_grouped_matmul_swiglu_quant_v2=_Placeholder(),
        npu_dynamic_quant=_Placeholder(),
    )


#: what ``import_vllm_ascend`` puts in place (``remove_vllm_ascend`` takes it all out again)
_ROOTS = ("vllm", "vllm_ascend", "torch_npu", "triton")  # and any stub module (compressed_tensors, ...)
_MISSING = object()
_SAVED: dict[str, object] = {}


def import_vllm_ascend(src: Path, device_type: str = "A3") -> SimpleNamespace:
    """Import the real ``vllm_ascend.quantization`` from ``src`` (the unpacked sdist) on this CPU.

    Returns its ``AscendModelSlimConfig``, ``AscendLinearMethod`` and ``AscendFusedMoEMethod``. Another
    ``src`` than the one imported replaces it (``remove_vllm_ascend`` first): one version at a time.
    Both module layouts are handled: ``quantization/modelslim_config.py`` (up to 0.2x) and
    ``quantization/configs/modelslim_config.py`` (0.30)."""
    if _SAVED.get("src") == str(src):
        return _SAVED["consumer"]
    if "src" in _SAVED:
        remove_vllm_ascend()
    try:  # where the real compressed-tensors is installed (the test extra), 0.30 imports it: import it before
        import compressed_tensors  # noqa: F401  (torch_npu is stubbed, which its accelerate import cannot probe)
    except ImportError:
        pass  # then the stub finder stands in for it
    sys.meta_path.append(_StubFinder())
    _torch_npu()
    _SAVED.update({"Tensor.npu": getattr(torch.Tensor, "npu", _MISSING), "torch.npu": getattr(torch, "npu", _MISSING),
                   "src": str(src)})
    torch.Tensor.npu = lambda self, *a, **k: self  # host tensors stand for device tensors
    torch.npu = _StubModule("torch.npu")  # Stream, Event, ... as placeholder types
    torch.npu.is_available = lambda: False
    vllm = _module("vllm", __version__="0.23.0")
    vllm.envs = _module("vllm.envs")
    _module("vllm.logger", logger=_OnceLogger(logging.getLogger("vllm_ascend_under_test"), {}),
            init_logger=lambda name: _OnceLogger(logging.getLogger(name), {}))
    _module("vllm.config", get_current_vllm_config=lambda: _CURRENT.config,
            get_current_vllm_config_or_none=lambda: _CURRENT.config, CompilationMode=CompilationMode)
    _module("vllm.model_executor.layers.linear", LinearBase=LinearBase, LinearMethodBase=LinearMethodBase,
            RowParallelLinear=RowParallelLinear, ColumnParallelLinear=ColumnParallelLinear,
            MergedColumnParallelLinear=MergedColumnParallelLinear, ReplicatedLinear=ReplicatedLinear)
    _module("vllm.model_executor.layers.fused_moe", FusedMoE=FusedMoE, FusedMoEMethodBase=FusedMoEMethodBase,
            FusedMoeWeightScaleSupported=FusedMoeWeightScaleSupported, RoutedExperts=FusedMoE, MoERunner=FusedMoE)
    _module("vllm.models.kimi_k3.nvidia.model", KimiLinearModel=KimiLinearModel)  # 0.30: K3's packed modules
    _module("vllm.model_executor.layers.quantization", register_quantization_config=lambda name: (lambda c: c))
    _module("vllm.model_executor.layers.quantization.base_config", QuantizationConfig=QuantizationConfig,
            QuantizeMethodBase=QuantizeMethodBase)
    _module("vllm.model_executor.layers.vocab_parallel_embedding", VocabParallelEmbedding=VocabParallelEmbedding,
            ParallelLMHead=ParallelLMHead, UnquantizedEmbeddingMethod=UnquantizedEmbeddingMethod)
    _module("vllm.model_executor.layers.attention_layer_base", AttentionLayerBase=AttentionLayerBase)
    _module("vllm.model_executor.utils", set_weight_attrs=set_weight_attrs)
    _module("vllm.model_executor.parameter", PerTensorScaleParameter=PerTensorScaleParameter)
    _module("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: _CURRENT.tp_size,
            get_tensor_model_parallel_rank=lambda: _CURRENT.tp_rank, get_ep_group=lambda: _Placeholder(),
            get_tp_group=lambda: _Placeholder(), divide=lambda a, b: a // b)
    sys.path.insert(0, str(src))
    # written by the sdist's build (which we skip): the device family it was built for
    _module("vllm_ascend._build_info", __device_type__=device_type, __soc_version__="")
    from vllm_ascend import ascend_config

    # the Ascend config vLLM-Ascend reads in scheme constructors: defaults, no dynamic EPLB
    # (weight_nz_mode 1, the default: quantized weights go through npu_format_cast, the identity here)
    ascend_config._ASCEND_CONFIG = SimpleNamespace(eplb_config=SimpleNamespace(dynamic_eplb=False),
                                                   weight_nz_mode=1, enable_fused_mc2=0,
                                                   multistream_overlap_gate=False)
    ascend_config._is_ascend_config_initialized = lambda cfg: True
    from vllm_ascend.distributed import parallel_state

    parallel_state._MC2 = SimpleNamespace()  # one device: no MC2 communicator (the scheme falls back to "")
    if (src / "vllm_ascend" / "quantization" / "configs" / "modelslim_config.py").exists():
        from vllm_ascend.quantization.configs.modelslim_config import AscendModelSlimConfig
    else:
        from vllm_ascend.quantization.modelslim_config import AscendModelSlimConfig
    from vllm_ascend.quantization.method_adapters import AscendFusedMoEMethod, AscendLinearMethod

    _SAVED["consumer"] = SimpleNamespace(AscendModelSlimConfig=AscendModelSlimConfig,
                                         AscendLinearMethod=AscendLinearMethod,
                                         AscendFusedMoEMethod=AscendFusedMoEMethod)
    return _SAVED["consumer"]


def remove_vllm_ascend() -> None:
    """Undo ``import_vllm_ascend``: later tests in the same process must not see a ``torch_npu`` module
    (transformers' device checks trip on a stub without a spec) nor the patched ``torch``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StubFinder)]
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in _ROOTS or isinstance(mod, _StubModule):
            del sys.modules[name]
    for attr, owner in (("Tensor.npu", torch.Tensor), ("torch.npu", torch)):
        old = _SAVED.pop(attr, _MISSING)
        if old is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, "npu")
        else:
            setattr(owner, "npu", old)
    src = _SAVED.pop("src", None)
    _SAVED.pop("consumer", None)
    if src in sys.path:
        sys.path.remove(src)
