"""Device families users pass to ``--target`` and what each needs."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UnsupportedTarget


@dataclass(frozen=True)
class Target:
    name: str
    hardware: str
    scheme: str  # human summary of the weight/activation scheme
    supported: bool
    group_size: int = 0  # written to quant_model_description.json
    # the quantized schemes its kernels run (FLOAT runs everywhere); the description's group_size
    # fits only one family, so an a3 output with an MX tensor (or the reverse) is not loadable
    schemes: tuple[str, ...] = ()

    def allows(self, scheme: str) -> bool:
        return scheme == "FLOAT" or scheme in self.schemes

    def scheme_names(self) -> str:
        return ", ".join(("FLOAT", *self.schemes))


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("a3", "Atlas 800I A3 server, Atlas 900 A3 SuperPoD",
               "W4A8 integer: int4 weights, int8 per-token dynamic activations", True, 0,
               ("W4A8_DYNAMIC", "W8A8_DYNAMIC")),
        Target("950dt", "Ascend 950DT (Ascend 950 SuperPoD series)",
               "W4A8 MXFP: MXFP4 (E2M1 + E8M0, block 32) weights, MXFP8 (E4M3) dynamic activations", True, 32,
               ("W4A8_MXFP", "W8A8_MXFP8")),
        Target("a2", "Atlas 800I A2", "-", False),
        Target("950pr", "Ascend 950PR", "-", False),
    )
}


def _canonical(text: str) -> str:
    key = re.sub(r"[\s_\-]", "", text.lower())
    for prefix in ("ascend", "atlas"):
        if key.startswith(prefix) and key != prefix:
            key = key[len(prefix):]
    key = key.removeprefix("800i").removeprefix("900")
    return key


def resolve_target(text: str) -> Target:
    """Resolve a user spelling (``A3``, ``atlas-a3``, ``800i-a3``, ``950DT``, ``ascend-950dt``) to a Target.

    Raises UnsupportedTarget for known-but-unsupported devices and for unknown names.
    """
    key = _canonical(text)
    target = TARGETS.get(key)
    if target is None:
        known = ", ".join(n for n, t in TARGETS.items() if t.supported)
        raise UnsupportedTarget(f"unknown target {text!r}; supported targets: {known}")
    if not target.supported:
        known = ", ".join(n for n, t in TARGETS.items() if t.supported)
        raise UnsupportedTarget(
            f"target {target.name} ({target.hardware}) is not yet supported; supported targets: {known}")
    return target
