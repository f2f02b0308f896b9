"""The a3 rules for routed experts published as MXFP4, as measured, and the line that says which one a conversion uses.

Atlas A3 computes int weights, so MXFP4 experts must be re-encoded; how well each rule keeps the model is measured by
``scripts/bench_quality.py --mxfp4-source`` (SmolLM2-135M with every decoder Linear put on the MXFP4 grid, converted
from those exact values; perplexity relative to that model with int8 activations; table and date in
docs/quality.md).  ``plan``, ``convert`` and the model card print ``experts_line``; ``plan.py`` refuses the rule
marked broken.
"""

from __future__ import annotations

from dataclasses import dataclass

BENCH = "scripts/bench_quality.py --mxfp4-source"


@dataclass(frozen=True)
class A3Rule:
    """One way to put MXFP4 experts on a3.

    name:    what the user asks for (the default, or the options);
    scheme:  the experts' ascendV1 type;
    heldout, pydoc: perplexity ratios on the stand-in (None: not measured on perplexity);
    loaded:  whether the current stable loaders (vLLM-Ascend >= 0.27, SGLang) read the layout;
    why:     one line: why it costs what it does."""

    name: str
    scheme: str
    heldout: float | None
    pydoc: float | None
    loaded: bool
    why: str

    def cost(self) -> str:
        if self.heldout is None:
            return "not measured on perplexity"
        return f"{self.heldout:.2f}x heldout / {self.pydoc:.2f}x pydoc perplexity on the stand-in ({BENCH})"


INT8_POW2 = A3Rule("default: W8A8_DYNAMIC, power-of-two row scales", "W8A8_DYNAMIC", 1.009, 0.985, True,
                   "int8 on a power-of-two row scale holds the MXFP4 values exactly where a row's block exponents "
                   "span <= 5 (99.95% of rows); twice the bytes of int4")
INT4_CALIBRATED = A3Rule("--calibrate: W4A8_DYNAMIC per channel by GPTQ, power-of-two scale candidates",
                         "W4A8_DYNAMIC", 1.11, 1.19, True,
                         "GPTQ's error feedback in the int4 grid, each row's scale judged on the input-weighted "
                         "error among clip ratios (to 0.6) and the powers of two that hold whole 32-blocks, the "
                         "inputs' correlations shrunk toward their energies")
INT4_GROUP32 = A3Rule("--group-size 32: W4A8_DYNAMIC per group of 32, data-free", "W4A8_DYNAMIC", 1.51, 1.84, False,
                      "a scale per 32-block follows the block exponents; only vLLM-Ascend 0.23.x with expert "
                      "parallelism reads per-group int4")
INT4_PER_CHANNEL = A3Rule("W4A8_DYNAMIC per channel, data-free (refused)", "W4A8_DYNAMIC", 5.75, 5.26, True,
                          "one int4 scale per row cannot hold E2M1's uneven levels under the blocks' exponents")
RULES = (INT8_POW2, INT4_CALIBRATED, INT4_GROUP32, INT4_PER_CHANNEL)


def rule_for(scheme: str, group_size: int, pow2_scale: bool, calibrated: bool) -> A3Rule | None:
    """The measured rule a packed expert converted as (``scheme``, int4 ``group_size``, int8 ``pow2_scale``)
    follows, with or without calibration; None for one not measured (an override's other scheme)."""
    if scheme == "W8A8_DYNAMIC" and pow2_scale:
        return INT8_POW2
    if scheme == "W4A8_DYNAMIC" and group_size == 32 and not calibrated:
        return INT4_GROUP32
    if scheme == "W4A8_DYNAMIC" and not group_size:
        return INT4_CALIBRATED if calibrated else INT4_PER_CHANNEL
    return None


#: what becomes of the experts a calibrated int4 run cannot give GPTQ from their own tokens (calibrate/run.py)
UNDER_ROUTED = ("an expert the calibration text routes fewer than --min-expert-tokens tokens to gets GPTQ from every "
                "calibration token (data-free per-channel int4 is the refused rule; the fused MoE layer takes one type)")


def experts_line(scheme: str, group_size: int, pow2_scale: bool, calibrated: bool) -> str:
    """The one line ``plan``, ``convert`` and the model card print for a3 from MXFP4 experts."""
    rule = rule_for(scheme, group_size, pow2_scale, calibrated)
    if rule is None:
        how = f"{scheme}" + (f" per group of {group_size}" if group_size else "") + (", calibrated" if calibrated else "")
        return f"a3 from MXFP4 experts: {how} (not one of the rules measured in docs/quality.md)"
    under = f"; {UNDER_ROUTED}" if rule is INT4_CALIBRATED else ""
    return f"a3 from MXFP4 experts: {rule.name}: {rule.cost()}{under}"
