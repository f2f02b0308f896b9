"""Compressed-tensors sources: packed tensor pairs read as the logical tensors the model has.

Moonshot publishes Kimi K3 with its routed experts in compressed-tensors' ``mxfp4-pack-quantized``
format (weight-only MXFP4, trained that way): each Linear weight ``X.weight`` [N, K] is stored as

* ``X.weight_packed``: U8 [N, K/2], two E2M1 codes a byte, the even element in the low nibble;
* ``X.weight_scale``: U8 [N, K/32], E8M0 exponents: the block of 32 elements along K is scaled by
  2^(byte - 127).

The rest of the checkpoint is BF16. Which tensors are packed is read from the index (the pairs
present), never from the config's ``ignore`` list, which the release leaves incomplete; the config
only says that the checkpoint is compressed and in which format.

A packed pair is one logical tensor of dtype ``MXFP4`` in a plan. A codec may take it as it is (the
W4A8_MXFP output is the same codes and scales: a repack) or decoded (the W4A8_MXFP codec's
``dequantize``: the exact values, which every other scheme quantizes like a BF16 weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BadCheckpoint
from .safetensors import TensorInfo

#: the logical dtype of a packed MXFP4 pair in a plan
MXFP4 = "MXFP4"
#: compressed-tensors' name of the format Kimi K3 is published in
MXFP4_FORMAT = "mxfp4-pack-quantized"
MX_BLOCK = 32
CODES_SUFFIX = ".weight_packed"
SCALES_SUFFIX = ".weight_scale"
E8M0_NAN = 0xFF

_WHAT_WE_READ = (f"kimi-quant reads BF16 checkpoints and compressed-tensors '{MXFP4_FORMAT}' ones (MXFP4 "
                 "experts, as Kimi K3 is published)")


def mxfp4_quantization_config(targets: list[str]) -> dict:
    """The ``quantization_config`` of a checkpoint whose Linears matching ``targets`` (compressed-
    tensors target strings, ``re:`` for a regex) are packed MXFP4, as compressed-tensors writes it."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": MX_BLOCK, "strategy": "group",
               "dynamic": False, "observer": "minmax", "scale_dtype": "torch.uint8", "zp_dtype": None,
               "actorder": None, "block_structure": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": targets, "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": MXFP4_FORMAT}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def mxfp4_nbytes(shape) -> int:
    """Bytes of a packed MXFP4 pair of logical shape [N, K]: codes N*K/2 plus scales N*K/32."""
    n, k = (int(s) for s in shape)
    return n * k // 2 + n * k // MX_BLOCK


@dataclass(frozen=True)
class PackedTensor:
    """One logical ``X.weight`` [N, K] stored as a codes tensor and a scales tensor (maybe in two shards)."""

    name: str
    shape: tuple[int, int]
    codes: str
    codes_file: str
    scales: str
    scales_file: str


def quantization_config(config: dict) -> dict | None:
    """The ``quantization_config`` of a config.json, at the top level or in ``text_config``."""
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and where.get("quantization_config") is not None:
            return where["quantization_config"]
    return None


def _formats(qc: dict) -> set[str]:
    """Every compressed-tensors format the config names: the top-level one and each group's own."""
    found = {qc.get("format")}
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        found.update(g.get("format") for g in groups.values() if isinstance(g, dict))
    return {f for f in found if f is not None}


def _check_config(where: str, qc, packed_names: list[str]) -> bool:
    """Whether the config says the checkpoint is ``mxfp4-pack-quantized``; refuses any other
    quantization in one line (what it is, and what kimi-quant reads)."""
    if qc is None:
        if packed_names:
            raise BadCheckpoint(f"{where}: tensor {packed_names[0]!r} is packed but config.json has no "
                                f"quantization_config saying how; {_WHAT_WE_READ}")
        return False
    if not isinstance(qc, dict):
        raise BadCheckpoint(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        if packed_names:
            raise BadCheckpoint(f"{where}: tensor {packed_names[0]!r} is packed by quant_method {method!r}; "
                                f"{_WHAT_WE_READ}")
        return False  # its tensors decide: a float checkpoint converts, a quantized one is refused by dtype
    other = sorted(str(f) for f in _formats(qc) - {MXFP4_FORMAT, "dense"})
    if other:
        raise BadCheckpoint(f"{where}: compressed-tensors format {other[0]!r} is not supported; {_WHAT_WE_READ}")
    if MXFP4_FORMAT not in _formats(qc):
        if packed_names:
            raise BadCheckpoint(f"{where}: tensor {packed_names[0]!r} is packed but the quantization_config names "
                                f"no '{MXFP4_FORMAT}' format")
        return False
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            continue
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", MX_BLOCK) \
                or w.get("symmetric", True) is not True:
            raise BadCheckpoint(f"{where}: config group {name!r} is not MXFP4 (num_bits {w.get('num_bits')}, type "
                                f"{w.get('type')!r}, group_size {w.get('group_size')}, symmetric "
                                f"{w.get('symmetric', True)}; MXFP4 is 4-bit float, symmetric, in groups of 32)")
    if not packed_names:
        raise BadCheckpoint(f"{where}: config.json says the checkpoint is '{MXFP4_FORMAT}' but the index holds no "
                            f"'{CODES_SUFFIX}' tensor")
    return True


def packing_declared(where: str, config: dict, packed_names: list[str]) -> bool:
    """Whether ``config`` declares MXFP4 packing (the names of the index's packed tensors given);
    refuses every other quantization, and packing the config does not declare, in one line."""
    return _check_config(where, quantization_config(config), packed_names)


def find_packed(source_id: str, config: dict, weight_map: dict[str, str],
                headers: dict[str, dict[str, TensorInfo]]) -> dict[str, PackedTensor]:
    """The packed pairs of a checkpoint, by logical name; {} for a plain float checkpoint.

    Refuses in one line: another quantization format, a config that names packing the index does not
    have (or the reverse), a codes tensor without its scales (or scales without codes), and shapes or
    dtypes that are not MXFP4's."""
    where = f"{source_id}/config.json"
    packed_names = sorted(n for n in weight_map if n.endswith(CODES_SUFFIX))
    if not packing_declared(where, config, packed_names):
        return {}
    out: dict[str, PackedTensor] = {}
    for codes in packed_names:
        base = codes[: -len(CODES_SUFFIX)]
        scales, logical = base + SCALES_SUFFIX, base + ".weight"
        if scales not in weight_map:
            raise BadCheckpoint(f"{source_id}: tensor {codes!r} has no {scales!r} (a packed MXFP4 tensor needs "
                                "its E8M0 scales)")
        if logical in weight_map:
            raise BadCheckpoint(f"{source_id}: tensor {logical!r} is stored both packed and unpacked")
        if base + ".weight_zero_point" in weight_map:
            raise BadCheckpoint(f"{source_id}: tensor {base + '.weight_zero_point'!r}: MXFP4 is symmetric, a zero "
                                "point is not part of the format")
        c, s = headers[weight_map[codes]][codes], headers[weight_map[scales]][scales]
        if c.dtype != "U8" or len(c.shape) != 2:
            raise BadCheckpoint(f"{source_id}: tensor {codes!r} is {c.dtype}{list(c.shape)}; MXFP4 codes are U8 "
                                "[N, K/2]")
        n, k = c.shape[0], 2 * c.shape[1]
        if k % MX_BLOCK or s.dtype != "U8" or tuple(s.shape) != (n, k // MX_BLOCK):
            raise BadCheckpoint(f"{source_id}: tensor {scales!r} is {s.dtype}{list(s.shape)}; with codes "
                                f"{list(c.shape)} (K = {k}) MXFP4 scales are U8 [{n}, K/{MX_BLOCK}]"
                                + ("" if k % MX_BLOCK == 0 else f", and K must be a multiple of {MX_BLOCK}"))
        out[logical] = PackedTensor(logical, (n, k), codes, weight_map[codes], scales, weight_map[scales])
    strays = sorted(n for n in weight_map if n.endswith(SCALES_SUFFIX)
                    and n[: -len(SCALES_SUFFIX)] + ".weight" not in out
                    and headers[weight_map[n]][n].dtype == "U8")
    if strays:
        raise BadCheckpoint(f"{source_id}: tensor {strays[0]!r} holds scales but there is no "
                            f"{strays[0][: -len(SCALES_SUFFIX)] + CODES_SUFFIX!r} they belong to")
    return out


def check_mxfp4_scales(scales: np.ndarray, where: str) -> None:
    """No scale of a packed pair is E8M0's NaN (0xFF)."""
    if scales.size and int(scales.max()) == E8M0_NAN:
        raise BadCheckpoint(f"{where}: an MXFP4 scale is 0xFF, E8M0's NaN")
