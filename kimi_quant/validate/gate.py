"""The perplexity gate: one behaviour for ``convert --validate`` and ``kimi-quant validate``.

A validation of a kimi-quant output is recorded in the output itself: the full report as
``kimi_quant_validation.json``, its summary and verdict under ``validation`` in the provenance
(``verify`` fails on a failed one, ``publish`` refuses it unless ``--force``), and the numbers on
the model card, whether they passed or not. Re-converting any shard deletes the report, and the
summary is then dropped from the provenance (``convert._carry_validation``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ValidationFailed
from ..journal import JOURNAL
from ..layout.ascend_v1 import PROVENANCE, VALIDATION


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


def record(out_dir: str | Path, report: dict, max_ppl_increase: float | None) -> dict:
    """Store ``report`` and its verdict in ``out_dir`` (a kimi-quant output: report, provenance,
    model card; another tool's directory is left alone) and raise ValidationFailed (exit 3) if it
    failed. Returns the verdict."""
    from ..layout.model_card import CARD, model_card
    from ..write import write_atomic, write_json_atomic

    out_dir = Path(out_dir)
    verdict = gate(report, max_ppl_increase)
    if (out_dir / JOURNAL).exists() and (out_dir / PROVENANCE).exists():
        write_json_atomic(out_dir / VALIDATION, {**report, "max_ppl_increase_pct": max_ppl_increase,
                                                 "passed": verdict["passed"]})
        prov = json.loads((out_dir / PROVENANCE).read_text())
        prov["validation"] = verdict
        write_json_atomic(out_dir / PROVENANCE, prov)
        write_atomic(out_dir / CARD, model_card(out_dir).encode())
        where = f"; the output stays in {out_dir}, marked as failing (verify fails, publish refuses it)"
    else:
        where = ""
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
