"""The ascendV1 directory around the weight shards: index, description, config, copied files, provenance.

These are written only after every shard is complete and verified, the index and the description
last of all, so an interrupted output never looks like a loadable checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import __version__
from ..errors import KimiQuantError
from ..plan import Plan
from ..source.base import SINGLE_FILE, WEIGHT_INDEX, Source
from ..untrusted import inside
from ..write import write_atomic, write_json_atomic
from ..output_files import CALIB_STATE, CARD, DESCRIPTION, INDEX, LOCAL_SOURCE, PROVENANCE, VALIDATION  # noqa: F401
from .model_card import model_card

MAX_COPIED_FILE = 64 * 1024 * 1024  # "small files": configs, code, tokenizer, docs
OWN_FILES = (INDEX, DESCRIPTION, PROVENANCE, VALIDATION)


def clean_config(config: dict) -> dict:
    """config.json without quantization_config (top level and text_config): the loader reads the description."""
    config = json.loads(json.dumps(config))
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    return config


#: never copied from a source: native code and pickles run when loaded, and a checkpoint needs none of them
#: (tokenizers, configs and remote code are text); the output would carry them to the hub
NOT_COPIED_SUFFIXES = (".so", ".dylib", ".dll", ".exe", ".pyd", ".o", ".a", ".bin", ".pt", ".pth", ".pkl",
                       ".pickle", ".ckpt", ".npy", ".npz", ".whl", ".egg", ".jar", ".pyc")


def _native_or_pickle(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(NOT_COPIED_SUFFIXES) or ".so." in base


def files_to_copy(source: Source) -> list[str]:
    """The source's small files an output carries (tokenizer, configs, remote code, docs): not the
    weights, not kimi-quant's own names, nothing larger than ``MAX_COPIED_FILE``, no native code or pickle."""
    out = []
    for f in source.files():
        name = f.name
        if name.endswith(".safetensors") or name in (WEIGHT_INDEX, SINGLE_FILE, "config.json"):
            continue
        if name.startswith("quant_model_") or name.startswith("kimi_quant_") or f.size > MAX_COPIED_FILE:
            continue
        if _native_or_pickle(name):
            continue
        out.append(name)
    return out


def output_name(name: str) -> str:
    """Where a copied source file lands: the source's card (README.md) becomes SOURCE_README.md, the
    output's README.md is kimi-quant's own card (``model_card``)."""
    return "SOURCE_README.md" if name == "README.md" else name


def write_metadata_files(out_dir: Path, plan: Plan, source: Source, provenance: dict, copied: list[str]) -> None:
    """Everything but the weight shards, in an order that keeps a partial output unloadable.
    ``copied``: the source files to copy, as ``files_to_copy`` listed them for the journal."""

    for name in copied:
        dest = out_dir / output_name(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not inside(dest.parent, out_dir):  # a folder of the output replaced by a link out of it
            raise KimiQuantError(f"{dest.parent} links to {os.path.realpath(dest.parent)}, outside {out_dir}: "
                                 "refusing to write there (remove the link)")
        write_atomic(dest, source.read_bytes(name))
    write_json_atomic(out_dir / "config.json", clean_config(source.read_json("config.json")))
    write_json_atomic(out_dir / PROVENANCE, provenance)
    write_json_atomic(out_dir / INDEX, {"metadata": {"total_size": plan.out_bytes}, "weight_map": plan.weight_map()})
    write_json_atomic(out_dir / DESCRIPTION, plan.description())
    write_atomic(out_dir / CARD, model_card(out_dir).encode())  # regenerable: not in the journal's hashes


def provenance(plan: Plan, inputs: dict[str, dict], units: dict[str, dict]) -> dict:
    return {
        "tool": "kimi-quant",
        "tool_version": __version__,
        "format": "ascendV1",
        # a hub repo id names the source for anyone; a local path names only someone's disk (published, it
        # would show their directory layout): the journal, which stays local, keeps it for resuming
        "source": plan.source if plan.revision else LOCAL_SOURCE,
        "revision": plan.revision,
        "target": plan.target,
        "recipe": plan.recipe,
        "group_size": plan.group_size,  # as in the description: W4A8_DYNAMIC per group of G inputs when a3 and > 0
        "max_shard_size": plan.max_shard_size,
        "inputs": inputs,
        "outputs": units,
        "plan_fingerprint": plan.fingerprint(),
        **({"source_packing": plan.packed_summary} if plan.packed_summary else {}),
    }
