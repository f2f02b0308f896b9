"""The plan: every source tensor -> (scheme, output tensors, output shard). Pure and cheap.

A plan is built from headers only (no tensor data is read), is a plain JSON value, and is what
the journal, the executors and ``kimi-quant plan`` all work from. Its fingerprint identifies a
conversion: a resumed run must have the same one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from functools import cached_property

from . import __version__
from .dtypes import nbytes
from .errors import BadCheckpoint, RecipeError
from .model.spec import ModelSpec
from .mxfp4_a3 import INT4_CALIBRATED, INT4_GROUP32, INT4_PER_CHANNEL, INT8_POW2, experts_line
from .quant import REGISTRY, get_codec
from .recipe.recipe import FLOAT, Recipe
from .source.base import Source
from .source.safetensors import TensorInfo
from .source.compressed import MXFP4, MXFP4_FORMAT, find_packed, mxfp4_nbytes
from .targets import Target

FLOAT_DTYPES = ("BF16", "F16", "F32")
OUTPUT_STEM = "quant_model_weights"
DEFAULT_MAX_SHARD_SIZE = 4 * 1024**3

#: W4A8_MXFP: vLLM-Ascend reshapes the E8M0 scales in pairs of 32-blocks, (..., K/64, 2), unpadded
MXFP4_LOADER_K_MULTIPLE = 64
_EXPERT_WEIGHT = re.compile(r"(?P<moe>.+\.experts)\.\d+\.[^.]+\.weight")

def model_quant_type_meaning(value: str, present: set[str] | frozenset = frozenset()) -> str:
    """One line saying what a description's ``model_quant_type`` means, given the types ``present``.

    msModelSlim's convention: the highest type present in FLOAT < W8A8_DYNAMIC < W8A8 < W8A8_MXFP8 <
    W4A8_MXFP, W4A8_DYNAMIC never counting, so an a3 output says W8A8_DYNAMIC although its routed
    experts are int4."""
    if "W4A8_DYNAMIC" in present:
        return (f"model_quant_type {value}: msModelSlim's convention (W4A8_DYNAMIC never counts); the routed "
                "experts are W4A8_DYNAMIC (int4), the other quantized Linears W8A8_DYNAMIC (per-tensor types decide)")
    if value == FLOAT:
        return "model_quant_type FLOAT: no tensor is quantized"
    return (f"model_quant_type {value}: the highest type present (msModelSlim's convention); "
            "the per-tensor types decide each Linear")


def moe_layer_types(types: dict[str, str]) -> dict[str, str]:
    """``"<layer prefix>.block_sparse_moe.experts.weight": type`` per MoE layer, from per-tensor types.

    vLLM-Ascend looks the routed experts' type up under this key (one per fused-MoE layer) when its
    table keyed by ``model_type`` does not know the model; the per-expert keys alone give a KeyError.
    """
    out: dict[str, str] = {}
    for name, scheme in types.items():
        m = _EXPERT_WEIGHT.fullmatch(name)
        if m:
            out.setdefault(m["moe"] + ".weight", scheme)
    return out


#: The serving loaders whose own code the conformance tests run on our outputs (tests/consumer_sources.py
#: pins them; a test keeps this line equal to those pins).
CHECKED_LOADERS = "vLLM-Ascend 0.23.0.post1 and 0.30.0rc2, SGLang 0.5.23"
#: What SGLang (0.5.23) gets wrong when one expert's matrices are split across devices (moe-tp > 1, i.e.
#: --ep-size below --tp-size), run in tests/test_consumer_sglang.py: ModelSlimW4A8Int8MoE is built
#: without tp_size, so every rank loads the whole int4 down_proj scale_bias and adds it to its partial sum.
SGLANG_MOE_TP = ("with --ep-size below --tp-size SGLang 0.5.23 adds the whole int4 down_proj bias on every "
                 "device, so a3 experts come out wrong; with --ep-size equal to --tp-size they load as written.")
#: Who loads per-group W4A8_DYNAMIC experts (the description's group_size > 0), read in their code and run
#: in tests/test_consumer_*.py: vLLM-Ascend 0.23.x (the stable line) does; from 0.27.1rc1 on its
#: AscendW4A8DynamicFusedMoEMethod raises "Per-Group quantization ... no longer supported" at init;
#: SGLang 0.5.23 builds its W4A8 MoE scheme with group_size=0 and its K3 load_weights skips the
#: *_second tensors it has no parameter for.
PER_GROUP_LOADERS = ("vLLM-Ascend 0.23.x loads per-group int4 experts (with --enable-expert-parallel; without "
                     "it, at tp > 1, its loader fails on them); from 0.27.1rc1 on it refuses them "
                     "(per channel only); SGLang (0.5.23) loads them without a word but drops the group scales, "
                     "so its experts come out wrong")


def loader_refusal(scheme: str, role, shape) -> str | None:
    """Why the consumers (vLLM-Ascend / SGLang ModelSlim loaders) could not load ``scheme`` here, or None.

    These are rules of the loaders, not of the numerics, so they live here and not in the codecs."""
    if scheme == "W4A8_DYNAMIC" and not role.role.startswith("routed_expert."):
        return ("W4A8_DYNAMIC is a fused-MoE (routed expert) scheme only: vLLM-Ascend's W4A8 Linear path is "
                "per-group and cannot load it (use W8A8_DYNAMIC)")
    if scheme == "W4A8_MXFP" and len(shape) == 2 and shape[1] % MXFP4_LOADER_K_MULTIPLE:
        return (f"vLLM-Ascend needs K divisible by {MXFP4_LOADER_K_MULTIPLE} for W4A8_MXFP (it pairs the 32-blocks' "
                f"scales without padding); got K={shape[1]} (use W8A8_MXFP8 or FLOAT for it)")
    return None


@dataclass
class TensorPlan:
    name: str  # source tensor
    file: str  # source shard holding it
    dtype: str
    shape: list[int]
    scheme: str
    matmul: str | None
    outputs: list[list]  # [output name, dtype, shape] in write order (lists: JSON round-trips)
    group_size: int = 0  # W4A8_DYNAMIC per group (--group-size); 0: per channel, and every other scheme
    #: a packed source pair (dtype MXFP4): [[codes tensor, its shard], [scales tensor, its shard]]
    packed: list | None = None
    pow2_scale: bool = False  # W8A8_DYNAMIC with power-of-two row scales (MXFP4 experts on a3)

    @property
    def codec(self):
        codec = get_codec(self.scheme, self.group_size)
        return codec.with_pow2_scale() if self.pow2_scale else codec

    @property
    def files(self) -> list[str]:
        """The source shards this tensor is read from (a packed pair may straddle two)."""
        return sorted({self.file, *(f for _, f in self.packed)}) if self.packed else [self.file]

    @property
    def repack(self) -> bool:
        """Whether the output is the packed source's own codes and scales (no requantization)."""
        return bool(self.packed) and get_codec(self.scheme).takes_mxfp4

    # cached: the full K3.1 plan asks for these millions of times (packing, summaries); plans are not mutated
    @cached_property
    def in_bytes(self) -> int:
        return mxfp4_nbytes(self.shape) if self.dtype == MXFP4 else nbytes(self.dtype, self.shape)

    @cached_property
    def out_bytes(self) -> int:
        return sum(nbytes(d, s) for _, d, s in self.outputs)

    def to_json(self) -> dict:  # by hand: dataclasses.asdict deep-copies, ~10x slower on 250k tensors
        d = {"name": self.name, "file": self.file, "dtype": self.dtype, "shape": list(self.shape),
             "scheme": self.scheme, "matmul": self.matmul,
             "outputs": [[name, dtype, list(shape)] for name, dtype, shape in self.outputs]}
        if self.group_size:  # only then: per-channel plans keep the fingerprints they always had
            d["group_size"] = self.group_size
        if self.packed:
            d["packed"] = [list(p) for p in self.packed]
        if self.pow2_scale:
            d["pow2_scale"] = True
        return d


@dataclass
class UnitPlan:
    """One output shard: the unit of work, of resume and of distribution."""

    file: str
    tensors: list[TensorPlan]

    @property
    def needs(self) -> list[str]:
        return sorted({f for t in self.tensors for f in t.files})

    @cached_property
    def in_bytes(self) -> int:
        return sum(t.in_bytes for t in self.tensors)

    @cached_property
    def out_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)

    def to_json(self) -> dict:
        return {"file": self.file, "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def from_json(cls, d: dict) -> "UnitPlan":
        return cls(d["file"], [TensorPlan(**t) for t in d["tensors"]])


@dataclass
class Plan:
    source: str
    revision: str | None
    target: str
    group_size: int
    recipe: dict
    max_shard_size: int
    inputs: dict[str, int]  # source shard -> size in bytes
    units: list[UnitPlan]
    tool_version: str = __version__
    extra: dict = field(default_factory=dict)

    # -- derived --------------------------------------------------------------------------
    @property
    def in_bytes(self) -> int:
        return sum(u.in_bytes for u in self.units)

    @property
    def out_bytes(self) -> int:
        return sum(u.out_bytes for u in self.units)

    def tensors(self):
        for u in self.units:
            yield from u.tensors

    @cached_property  # plans are not mutated (see TensorPlan)
    def int4_group_size(self) -> int:
        """G of the per-group int4 (W4A8_DYNAMIC) tensors; 0 when there are none. Not ``group_size``,
        the description's, which is 32 for the MX targets (their blocks are not int4 groups)."""
        return max((t.group_size for t in self.tensors()), default=0)

    @cached_property  # plans are not mutated (see TensorPlan); plan, convert and the provenance all ask
    def packed_summary(self) -> dict | None:
        """What became of a packed MXFP4 source's tensors (None for a BF16 source): how many were copied as
        they are (W4A8_MXFP) and how many were decoded exactly for another scheme."""
        packed = [t for t in self.tensors() if t.packed]
        if not packed:
            return None
        decoded = Counter(t.scheme + (POW2_WORDS if t.pow2_scale else "") for t in packed if not t.repack)
        return {"format": f"compressed-tensors {MXFP4_FORMAT}", "tensors": len(packed),
                "copied": len(packed) - sum(decoded.values()), "decoded": dict(sorted(decoded.items()))}

    def mxfp4_experts_line(self, calibrated: bool) -> str | None:
        """On a3 from a packed MXFP4 source: which measured rule its decoded tensors (the routed experts)
        follow and its cost (``mxfp4_a3.experts_line``); None otherwise."""
        if self.target != "a3":
            return None
        ways = Counter((t.scheme, t.group_size, t.pow2_scale) for t in self.tensors() if t.packed and not t.repack)
        if not ways:
            return None
        scheme, group, pow2 = ways.most_common(1)[0][0]
        return experts_line(scheme, group, pow2, calibrated)

    def source_order(self) -> list[str]:
        """Source shards in the order the units first need them."""
        seen: dict[str, None] = {}
        for u in self.units:
            for f in u.needs:
                seen.setdefault(f, None)
        return list(seen)

    def fingerprint(self) -> str:
        """What makes two runs the same conversion (not where the source lives)."""
        ident = {"revision": self.revision, "target": self.target, "inputs": self.inputs,
                 "max_shard_size": self.max_shard_size, "tool_version": self.tool_version,
                 "units": [u.to_json() for u in self.units]}
        if self.extra:  # e.g. a calibrated conversion's text, tokens and GPTQ settings (absent: old fingerprints stand)
            ident["extra"] = self.extra
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def description(self) -> dict:
        """quant_model_description.json: top-level keys, then one entry per saved tensor."""
        types: dict[str, str] = {}
        present = set()
        for t in self.tensors():
            present.add(t.scheme)
            for out_name, _, _ in t.outputs:
                types[out_name] = t.scheme
        ranked = [(REGISTRY[s].rank, s) for s in present if s != FLOAT and REGISTRY[s].rank is not None]
        model_quant_type = max(ranked)[1] if ranked else FLOAT
        return {"version": "1.0.0", "model_quant_type": model_quant_type, "group_size": self.group_size,
                "metadata": {}, "optional": {}, **types, **moe_layer_types(types)}

    def weight_map(self) -> dict[str, str]:
        return {name: u.file for u in self.units for t in u.tensors for name, _, _ in t.outputs}

    def scheme_counts(self) -> Counter:
        return Counter(t.scheme for t in self.tensors())

    def to_json(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "units"}
        d["units"] = [u.to_json() for u in self.units]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        d = dict(d)
        d["units"] = [UnitPlan.from_json(u) for u in d["units"]]
        return cls(**d)


def output_tensors(name: str, dtype: str, shape: list[int], scheme: str, matmul: str | None, group_size: int = 0):
    """The ascendV1 tensors source tensor ``name`` becomes: [[name, dtype, shape], ...] in write order."""
    if scheme == FLOAT:
        return [[name, dtype, list(shape)]]
    base = name.removesuffix(".weight")
    return [[f"{base}.{suffix}", dt, list(shp)]
            for suffix, (dt, shp) in get_codec(scheme, group_size).out_specs(tuple(shape), matmul).items()]


#: Per-channel data-free int4 of MXFP4 weights (the measured rules: mxfp4_a3.RULES)
MXFP4_PER_CHANNEL_INT4 = (f"the source's experts are MXFP4; per-channel data-free int4 cannot hold their values "
                          f"({INT4_PER_CHANNEL.heldout:.1f}x perplexity on a real model put on the MXFP4 grid)")
MXFP4_INT4_OPTIONS = (f"the default for such experts (W8A8_DYNAMIC, power-of-two scales: ~exact, "
                      f"{INT8_POW2.heldout:.2f}x), --calibrate (int4 by GPTQ: {INT4_CALIBRATED.heldout:.2f}x), "
                      f"or --group-size 32 ({INT4_GROUP32.heldout:.2f}x; vLLM-Ascend 0.23.x only)")
#: a3's scheme for routed experts published as MXFP4, unless a rule or an option asks for another: int8 with
#: power-of-two row scales holds a row's MXFP4 values exactly when its block exponents span <= 5 (99.95% of
#: rows on the stand-in), at twice the int4 bytes (K3: ~2.7 TB of experts; 4 x Atlas 800 A3 hold it)
MXFP4_EXPERTS_ON_A3 = "W8A8_DYNAMIC"
POW2_WORDS = " (power-of-two row scales: the MXFP4 values held exactly in int8 where a row allows)"


def packed_words(summary: dict) -> str:
    """``Plan.packed_summary`` (or a provenance's ``source_packing``) in words."""
    ways = []
    if summary.get("copied"):
        ways.append(f"{summary['copied']:,} copied as they are (W4A8_MXFP: the source's own codes and scales, exact)")
    ways += [f"{n:,} decoded exactly, then {scheme}" for scheme, n in (summary.get("decoded") or {}).items()]
    return f"MXFP4 tensors ({summary.get('format')}): {'; '.join(ways)}"


def check_mxfp4_source_rules(plan: "Plan", calibrated: bool) -> None:
    """Refuse a rule measured to break a model whose experts are published as MXFP4: W4A8_DYNAMIC per
    channel without calibration (a3's data-free default) on a packed source tensor."""
    if calibrated:
        return
    t = next((t for t in plan.tensors() if t.packed and t.scheme == "W4A8_DYNAMIC" and not t.group_size), None)
    if t is not None:
        raise RecipeError(f"tensor {t.name!r}: {MXFP4_PER_CHANNEL_INT4}; use {MXFP4_INT4_OPTIONS}")


def check_group_size(group_size: int, target: Target) -> None:
    """--group-size (or a recipe's group_size): per-group int4 is an a3 option (W4A8_DYNAMIC), in
    msModelSlim's sizes."""
    from .quant.numerics import INT4_GROUP_SIZES

    if not group_size:
        return
    if not any(REGISTRY[s].reads_group_size for s in target.schemes if s in REGISTRY):
        raise RecipeError(f"--group-size is per-group int4 (W4A8_DYNAMIC) for --target a3; target {target.name} has no "
                          f"such scheme (it runs {', '.join(target.schemes)}, whose blocks are fixed): "
                          "drop --group-size")
    if group_size not in INT4_GROUP_SIZES:
        raise RecipeError(f"--group-size {group_size}: must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (the "
                          "group sizes msModelSlim writes per-group W4A8_DYNAMIC with), or 0 for per channel")


def _check_index(source_id: str, weight_map: dict[str, str], headers: dict[str, dict]) -> None:
    """The index and the shard headers agree: every tensor the index names is in its shard, and every
    tensor of a shard is in the index, mapped to that shard (a tensor in two shards is refused)."""
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise BadCheckpoint(f"{source_id}/{file}: tensor {name!r} is named in the index but absent from this shard")
    for file, header in headers.items():
        for name in header:
            mapped = weight_map.get(name)
            if mapped is None:
                raise BadCheckpoint(f"{source_id}/{file}: tensor {name!r} is in this shard but not in the index")
            if mapped != file:
                raise BadCheckpoint(f"{source_id}/{file}: tensor {name!r} is also in this shard (the index maps it to "
                                    f"{mapped}): a tensor must be in one shard")


def make_plan(source: Source, spec: ModelSpec, recipe: Recipe, target: Target,
              max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, group_size: int | None = None,
              calibrated: bool = False) -> Plan:
    """Plan a conversion from headers only; refuses bad recipes and inconsistent inputs up front.

    group_size: 0, or G for per-group int4 (W4A8_DYNAMIC tensors get G inputs per scale, and the
    description says "group_size": G; the other a3 types are unaffected: their loaders ignore it);
    None: the recipe's (``group_size`` in its target section, default 0)."""
    if group_size is None:
        group_size = recipe.group_size
    check_group_size(group_size, target)
    weight_map = source.weight_map()
    files = sorted(set(weight_map.values()))
    sizes = {f.name: f.size for f in source.files()}
    tensors: list[TensorPlan] = []
    groups: dict[str, set[str]] = defaultdict(set)
    group_example: dict[tuple[str, str], str] = {}
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in weight_map.items():
        by_file[file].append(name)
    headers = {file: source.header(file) for file in files}
    _check_index(source.id, weight_map, headers)
    packed = find_packed(source.id, spec.config, weight_map, headers)
    packed_by_codes = {p.codes: p for p in packed.values()}
    scale_parts = {p.scales for p in packed.values()}
    # the model's tensors: a packed pair is its logical weight (exact in BF16, so the spec sees BF16)
    inventory = {n: (headers[f][n].shape, headers[f][n].dtype) for n, f in weight_map.items()
                 if n not in packed_by_codes and n not in scale_parts}
    inventory.update((p.name, (p.shape, "BF16")) for p in packed.values())
    spec.check_inventory(inventory, f"{source.id}")
    for rule in recipe.rules:  # a mistyped --override would otherwise be silently ignored
        if rule.override and not any(rule.matches(n) for n in inventory):
            raise RecipeError(f"--override '{rule.pattern}={rule.scheme}': the pattern matches no tensor "
                              f"(names look like {min(inventory, default='')!r})")
    for file in files:
        header = headers[file]
        in_index = by_file[file]
        for stored in sorted(in_index, key=lambda n: header[n].start):
            if stored in scale_parts:
                continue  # read with its codes
            pair = packed_by_codes.get(stored)
            name = pair.name if pair else stored
            info = header[stored] if pair is None else TensorInfo(name, MXFP4, pair.shape, 0, 0)
            if pair is None and stored.endswith(("weight_packed", "weight_scale", "weight_zero_point")) \
                    and info.dtype in ("U8", "I8", "I32"):
                raise BadCheckpoint(f"{source.id}/{file}: tensor {stored!r} is already quantized ({info.dtype}); "
                                    "kimi-quant needs a BF16 source (dequantize it first)")
            role = spec.role(name)
            scheme = recipe.scheme_for(name, role.role)
            group = group_size if scheme in REGISTRY and REGISTRY[scheme].reads_group_size else 0
            pow2 = False
            if pair and scheme == "W4A8_DYNAMIC" and not group and not calibrated \
                    and not any(rule.matches(name) for rule in recipe.rules):
                scheme, pow2 = MXFP4_EXPERTS_ON_A3, True  # the role table's int4 is broken on MXFP4 values
            if not target.allows(scheme):  # load_recipe refuses these; a Recipe built in code may not
                raise RecipeError(f"tensor {name!r}: scheme {scheme} is not for target {target.name} "
                                  f"(it takes {target.scheme_names()})")
            if scheme != FLOAT:
                why = get_codec(scheme, group).check(info.shape, role.matmul)
                if why is None and info.dtype not in (*FLOAT_DTYPES, MXFP4):
                    why = f"source dtype {info.dtype} is not a float type"
                if why is None and not name.endswith(".weight"):
                    why = "only '.weight' tensors of Linear layers can be quantized"
                if why is None and spec.family != "generic" and not role.linear:
                    why = f"it is not a Linear layer's weight (role {role.role}); only Linear weights can be quantized"
                if why is None:
                    why = loader_refusal(scheme, role, info.shape)
                if why:
                    raise RecipeError(f"tensor {name!r} {info.dtype}{list(info.shape)} cannot be {scheme}: {why}")
            if role.fuse_group:
                groups[role.fuse_group].add(scheme)
                group_example.setdefault((role.fuse_group, scheme), name)
            out_dtype = "BF16" if pair else info.dtype  # a packed tensor kept FLOAT is written decoded
            tensors.append(TensorPlan(name, file, info.dtype, list(info.shape), scheme, role.matmul,
                                      output_tensors(name, out_dtype, list(info.shape), scheme, role.matmul, group), group,
                                      [[pair.codes, pair.codes_file], [pair.scales, pair.scales_file]] if pair else None,
                                      pow2))
    for group, schemes in sorted(groups.items()):
        if len(schemes) > 1:
            examples = ", ".join(f"{group_example[(group, s)]} -> {s}" for s in sorted(schemes))
            raise RecipeError(f"tensors of one fused group ({group}) must share one scheme (the serving stacks load "
                              f"them as one Linear and refuse mixed parts), got: {examples}")

    # Greedy packing in source order keeps each output shard's inputs few and contiguous.
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.out_bytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out_bytes
    n = len(shards)
    units = [UnitPlan(f"{OUTPUT_STEM}-{i + 1:05d}-of-{n:05d}.safetensors", ts) for i, ts in enumerate(shards)]
    return Plan(source=source.id, revision=source.revision, target=target.name,
                group_size=group_size or target.group_size,
                recipe=recipe.describe(), max_shard_size=int(max_shard_size),
                inputs={f: int(sizes.get(f, 0)) for f in files}, units=units)
