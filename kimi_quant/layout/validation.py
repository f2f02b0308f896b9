"""The perplexity gate: one behaviour for ``convert --validate`` and ``kimi-quant validate``.

A validation of a kimi-quant output is recorded in the output itself: the full report as
``kimi_quant_validation.json``, its summary and verdict under ``validation`` in the provenance
(``verify`` fails on a failed one, ``publish`` refuses it unless ``--force``), and the numbers on
the model card, whether they passed or not. Re-converting any shard deletes the report, and the
summary is then dropped from the provenance (``output_run.carry_validation``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ..errors import KimiQuantError, ValidationFailed
from ..journal import JOURNAL, Journal
from ..layout.ascend_v1 import LOCAL_SOURCE, PROVENANCE, VALIDATION
from ..layout.model_card import CARD
from .records import read_provenance, read_record

log = logging.getLogger(__name__)


def gate(report: dict, max_ppl_increase: float | None) -> dict:
    """The verdict: perplexity increase in percent against the bound (no bound: passed)."""
    increase = (report["ratio"] - 1) * 100
    return {"ppl_bf16": report["ppl_bf16"], "ppl_quant": report["ppl_quant"], "ratio": report["ratio"],
            "increase_pct": increase, "max_ppl_increase_pct": max_ppl_increase,
            "passed": max_ppl_increase is None or increase <= max_ppl_increase}


def failed_message(verdict: dict) -> str:
    return (f"validation failed: perplexity rose {verdict['increase_pct']:.2f}% over BF16 "
            f"({verdict['ppl_bf16']:.4f} -> {verdict['ppl_quant']:.4f}), above the bound of "
            f"{verdict['max_ppl_increase_pct']}%")


#: the lowest cosine between the BF16 and the quantized hidden state after the first layer that a
#: conversion of that very source gives (a faithful one is > 0.9; another checkpoint of the same shapes ~0)
MIN_FIRST_LAYER_COSINE = 0.5


def source_identity(source_dir: str | Path) -> dict[str, str]:
    """What the BF16 source a validation measured is, file by file: the identity of each shard and
    config file (size, mtime and ctime: any rewrite changes the ctime)."""
    from ..source.local import LocalSource

    return {f.name: f.identity for f in LocalSource(source_dir).files()
            if f.name.endswith((".safetensors", ".json", ".model"))}


def output_digest(journal: Journal) -> str:
    """What the output a validation measured is: its shards' and metadata files' sha256, as the
    journal records them (the provenance, report and card are about it, not part of it)."""
    files = {n: sha for n, sha in journal.metadata.items() if n not in (PROVENANCE, VALIDATION, CARD)}
    ident = {"units": {f: rec["sha256"] for f, rec in sorted(journal.units.items())}, "files": dict(sorted(files.items()))}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def not_its_source(report: dict) -> str | None:
    """Why ``report`` cannot be of the output against the checkpoint it was converted from, or None:
    the first layer's hidden states disagree as another checkpoint's would."""
    layers = report.get("layers") or []
    first = layers[0] if layers and isinstance(layers[0], dict) else {}
    cos = first.get("cosine")
    if isinstance(cos, (int, float)) and cos < MIN_FIRST_LAYER_COSINE:
        return (f"after the first layer the quantized model agrees with the BF16 one only to cosine {cos:.4f} "
                f"(a conversion of that checkpoint gives > 0.9; ratio {report.get('ratio', float('nan')):.4f}): "
                "the source given is not the checkpoint the output was converted from")
    return None


def validation_void(out_dir: Path, journal: Journal, prov: dict) -> str | None:
    """Why the validation recorded in ``prov`` no longer describes this output, or None: it must be
    covered by the journal's digest of the provenance, its report must name this output's digest, and
    the source it measured (when the journal's recorded source directory is still there) unchanged."""
    if not isinstance(prov.get("validation"), dict):
        return None
    if PROVENANCE not in journal.metadata:
        return "its verdict is not covered by the journal (recorded by an older kimi-quant, or edited)"
    report = read_record(out_dir / VALIDATION)
    inputs = report.get("inputs") if isinstance(report, dict) else None
    if not isinstance(inputs, dict) or inputs.get("output_sha256") != output_digest(journal):
        return "the output changed since it was validated"
    if prov["validation"].get("inputs_sha256") != _digest(inputs):
        return "the verdict does not belong to the report"
    options = journal.start.get("options") if journal.start else None
    src = options.get("source") if isinstance(options, dict) else None
    recorded = inputs.get("source")
    if isinstance(src, str) and isinstance(recorded, dict) and Path(src).is_dir():
        try:
            now = source_identity(src)
        except KimiQuantError:
            now = {}
        if any(now.get(name) != ident for name, ident in recorded.items()):
            return "the source changed since it was validated"
    return None


def rebind_validation(out_dir: Path, journal: Journal) -> None:
    """After convert rewrote the files around the shards: a carried validation stays (covered again by
    the journal) only while its report names this very output; otherwise it is dropped, with one line."""
    from ..layout.model_card import model_card
    from ..write import write_atomic, write_json_atomic

    prov = read_record(out_dir / PROVENANCE)
    if not isinstance(prov, dict) or "validation" not in prov:
        return
    report = read_record(out_dir / VALIDATION)
    inputs = report.get("inputs") if isinstance(report, dict) else None
    if (isinstance(inputs, dict) and inputs.get("output_sha256") == output_digest(journal)
            and isinstance(prov["validation"], dict) and prov["validation"].get("inputs_sha256") == _digest(inputs)):
        journal.mark_complete(sorted(set(journal.metadata) | {PROVENANCE, VALIDATION}))
        return
    prov.pop("validation")
    write_json_atomic(out_dir / PROVENANCE, prov)
    (out_dir / VALIDATION).unlink(missing_ok=True)
    write_atomic(out_dir / CARD, model_card(out_dir).encode())
    log.warning("kimi-quant: warning: %s: its validation was of other files (config or shards rewritten): dropped; "
                "`kimi-quant validate` measures this output", out_dir)


def record(out_dir: str | Path, report: dict, max_ppl_increase: float | None, source: str | Path | None = None,
           force: bool = False, mismatch: str | None = None) -> dict:
    """Store ``report`` and its verdict in ``out_dir`` (a kimi-quant output: report, provenance,
    model card; another tool's directory is left alone) and raise ValidationFailed (exit 3) if it
    failed. Returns the verdict. The report is bound to what it measured: the digest of the output
    and the identity of ``source`` (the BF16 directory), and the journal covers the verdict. A report
    that cannot be of the output's own source (``not_its_source``) is refused, with ``force`` shown
    but never recorded (nor is one whose source a caller found to differ: ``mismatch``).
    The verdict says whether it was recorded (``recorded``)."""
    from ..layout.model_card import model_card
    from ..write import write_atomic, write_json_atomic

    out_dir = Path(out_dir)
    verdict = gate(report, max_ppl_increase)
    ours = (out_dir / JOURNAL).exists() and (out_dir / PROVENANCE).exists()
    wrong = mismatch or not_its_source(report)
    if wrong and not force:
        raise KimiQuantError(f"{wrong}; nothing recorded in {out_dir} (--force shows the numbers without recording "
                             "them)")
    if wrong:
        log.warning("kimi-quant: warning: %s; --force: the numbers are shown, not recorded as a validation", wrong)
        ours = False
    if ours:
        journal = Journal(out_dir)
        inputs = {"output_sha256": output_digest(journal),
                  "source": source_identity(source) if source is not None else None}
        shown = {**report, "source": LOCAL_SOURCE, "quantized": "this output"}  # no local paths published
        write_json_atomic(out_dir / VALIDATION, {**shown, "max_ppl_increase_pct": max_ppl_increase,
                                                 "passed": verdict["passed"], "inputs": inputs})
        prov = read_provenance(out_dir)
        prov["validation"] = {**verdict, "inputs_sha256": _digest(inputs)}
        write_json_atomic(out_dir / PROVENANCE, prov)
        journal.mark_complete(sorted(set(journal.metadata) | {PROVENANCE, VALIDATION}))  # the verdict, covered
        write_atomic(out_dir / CARD, model_card(out_dir).encode())
        where = f"; the output stays in {out_dir}, marked as failing (verify fails, publish refuses it)"
    else:
        where = ""
    verdict = {**verdict, "recorded": ours}
    if not verdict["passed"]:
        raise ValidationFailed(failed_message(verdict) + where)
    return verdict


def failed_validation(verdict: dict | None) -> str | None:
    """The one-line reason when ``verdict`` (the provenance's ``validation``) failed, else None."""
    if isinstance(verdict, dict) and verdict.get("passed") is False:
        v = dict(verdict)
        if "increase_pct" not in v and isinstance(v.get("ratio"), (int, float)):
            v["increase_pct"] = (v["ratio"] - 1) * 100  # recorded by an earlier kimi-quant
        try:
            return failed_message(v)
        except (KeyError, TypeError, ValueError):
            return "validation failed (see kimi_quant_provenance.json)"
    return None
