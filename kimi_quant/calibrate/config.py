"""The settings of a calibrated conversion (what ``convert --calibrate`` options fill in)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_TEXT = "builtin:train"
DEFAULT_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
#: a routed expert that saw fewer tokens than this keeps the data-free rule: a Hessian from a handful
#: of tokens has rank < K and GPTQ would fit those tokens instead of the expert's real inputs
DEFAULT_MIN_EXPERT_TOKENS = 32
#: routed experts handed out as one stage of jobs (each forms its own Hessians where it runs): a stage keeps at most
#: that many workers busy, and the driver holds that many experts' jobs (their weights as stored, K3.1 Pro released
#: MXFP4 ~17 MB each, BF16 66 MB, and results) while they run. By default as many as the run's workers, within
#: these bounds: plan on K3.1 Pro, Ray x1024, says ~13.5 h at 32, ~3.0 h at 256 (driver 26 GB released, 39 GB BF16)
MIN_EXPERT_BATCH = 32
MAX_EXPERT_BATCH = 256
#: the driver's forward runs at most this many tokens (whole windows) in one pass: its transients (the residual
#: mix's stacked blocks, the attention scores, a dense MLP's outputs) are bounded by that, not by --tokens; more
#: tokens are more passes (the default --tokens is one)
PASS_TOKENS = 8192
#: fewer calibration tokens than this cannot calibrate anything: refused
MIN_TOKENS = 64
#: GPTQConfig's defaults, for --help without importing torch (tests/test_cli_options.py checks they agree)
GPTQ_DEFAULTS = {"act_order": True, "damp": 0.01}
PROPAGATE = ("quantized", "bf16")
#: which tokens a routed expert's Hessian sees: those the router sends it, or every token of the layer's input
#: (its output still follows the router): more statistics for cold experts, at the cost of running every expert
#: of a batch on every token once more
EXPERT_TOKENS = ("routed", "all")


@dataclass(frozen=True)
class CalibConfig:
    """``calibration``: a file or shipped set (see :func:`kimi_quant.runtime.text.load_texts`);
    ``tokens``: how many tokens of it; ``act_order`` / ``damp`` / ``device``: GPTQ settings (None:
    the GPTQ defaults); ``propagate``: the state carried to the next layer comes from the layer as
    quantized (``quantized``, GPTQ's sequential rule) or from the BF16 layer (``bf16``); ``expert_tokens``:
    one of ``EXPERT_TOKENS``; ``expert_batch``: routed experts per stage of jobs (None: :meth:`experts_per_stage`)."""

    calibration: str = DEFAULT_TEXT
    tokens: int = DEFAULT_TOKENS
    seq_len: int = DEFAULT_SEQ_LEN
    act_order: bool | None = None
    damp: float | None = None
    device: str = "cpu"
    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS
    expert_batch: int | None = None
    propagate: str = "quantized"
    expert_tokens: str = "routed"

    def describe(self) -> dict:
        """What identifies the calibration (in the plan fingerprint and the provenance); ``device``
        and ``expert_batch`` are left out: they change where and how fast, not the bytes; ``expert_tokens`` only
        when it is ``all`` (outputs calibrated on routed tokens keep their fingerprint)."""
        d = asdict(self)
        d.pop("device")
        d.pop("expert_batch")
        if d["expert_tokens"] == "routed":
            d.pop("expert_tokens")
        return d

    def experts_per_stage(self, workers: int) -> int:
        """Routed experts handed out at once to ``workers`` workers: ``expert_batch`` if given, else one per
        worker within [MIN_EXPERT_BATCH, MAX_EXPERT_BATCH]."""
        if self.expert_batch:
            return self.expert_batch
        return min(MAX_EXPERT_BATCH, max(MIN_EXPERT_BATCH, int(workers)))


def windows_per_pass(seq_len: int) -> int:
    """Calibration windows of ``seq_len`` tokens the forward runs at once (``PASS_TOKENS``; at least one)."""
    return max(1, PASS_TOKENS // max(1, seq_len))


def passes(cfg: CalibConfig) -> int:
    """The forward's passes over the calibration tokens (``PASS_TOKENS`` each, in whole windows)."""
    return -(-max(1, cfg.tokens // cfg.seq_len) // windows_per_pass(cfg.seq_len))


def partitions(cfg: CalibConfig, executor: str) -> int:
    """The Ray actors the calibrated forward runs in (``ray_forward``): one per pass with Ray on the CPU (the
    quantized state propagated), else 1: the driver."""
    n = passes(cfg)
    return n if executor == "ray" and cfg.device == "cpu" and cfg.propagate == "quantized" and n > 1 else 1
