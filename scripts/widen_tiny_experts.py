"""Widen the trained tiny fixture's expert intermediate size, preserving the function exactly.

    python scripts/widen_tiny_experts.py OLD_FIXTURE_DIR [--out kimi_quant/model/fixtures/tiny]

Why: vLLM-Ascend loads W4A8_MXFP only with K % 64 == 0, and the fixture was trained with
``moe_intermediate_size`` 32 (routed experts' ``w2`` had K = 32). Retraining at 64 takes ~15 minutes
of an idle 2-core machine (``scripts/train_tiny.py``, which now trains natively at the preset's 64);
this widens the trained model instead: routed experts' ``w1``/``w3`` get zero rows and ``w2`` zero
columns up to the preset's ``moe_intermediate_size``, and the shared experts (intermediate
``moe_intermediate_size * num_shared_experts``) likewise. A zero gate and up row gives act(0) * 0 = 0
and a zero ``w2`` column adds nothing, so every output is unchanged (the script checks the held-out
perplexity before and after). The quantizers see zero rows/blocks, which they represent exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_quant.model.presets import preset_config  # noqa: E402
from kimi_quant.model.spec import spec_from_config  # noqa: E402
from kimi_quant.source.safetensors import SafetensorsReader  # noqa: E402
from kimi_quant.write.safetensors_writer import encode_header  # noqa: E402

OUT = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"
SIDE_FILES = ("tiktoken.model", "tokenizer_config.json")


def widen(old: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``old`` zero-padded at the end of each axis up to ``shape`` (never cut)."""
    assert all(o <= n for o, n in zip(old.shape, shape)), (old.shape, shape)
    new = np.zeros(shape, dtype=old.dtype)
    new[tuple(slice(0, o) for o in old.shape)] = old
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="the trained fixture directory to widen (config.json + model.safetensors)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    config = preset_config("tiny")
    expected = spec_from_config(config).expected_tensors()
    reader = SafetensorsReader(args.old / "model.safetensors")
    entries, blobs, widened = [], [], 0
    for name, (shape, dtype) in expected.items():
        arr = reader.array(name)
        if tuple(arr.shape) != tuple(shape):
            arr = widen(arr, tuple(shape))
            widened += 1
        entries.append((name, dtype, tuple(shape)))
        blobs.append(np.ascontiguousarray(arr).tobytes())
    reader.close()
    side = {n: (args.old / n).read_bytes() for n in SIDE_FILES}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.safetensors").write_bytes(encode_header(entries) + b"".join(blobs))
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for n, data in side.items():
        (args.out / n).write_bytes(data)
    print(f"widened {widened} tensors to moe_intermediate_size {config['text_config']['moe_intermediate_size']}")

    from kimi_quant.validate.run import perplexity_of_source

    for label, d in (("before", args.old), ("after", args.out)):
        res = perplexity_of_source(d, calibration="builtin:heldout", seq_len=512, max_tokens=1 << 30, progress=False)
        print(f"held-out perplexity {label}: {res['ppl']:.4f} ({res['tokens']} tokens, seq_len 512)")


if __name__ == "__main__":
    main()
