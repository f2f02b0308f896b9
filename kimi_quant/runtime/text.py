"""Calibration / evaluation text: the shipped set, or a user's jsonl / txt / parquet file, or a hub dataset.

``load_texts(None)`` gives the shipped held-out split (calibration/heldout.jsonl, in the wheel as
kimi_quant/runtime/calibration_data/; licences in calibration/README.md). A path ending in ``.jsonl`` reads the ``text`` field of each line, ``.txt`` is
one document, ``.parquet`` reads the ``text`` column (needs pyarrow). Names ``builtin:train`` and
``builtin:heldout`` pick a shipped split. Anything else that is not an existing file is taken as a
Hugging Face dataset id (``org/name`` or ``org/name:split``), which needs the ``datasets`` package and
network access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KimiQuantError
from .tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

# a link to the top-level calibration/ in a checkout; in a wheel, the shipped splits themselves
CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration_data"
BUILTIN = {"builtin:train": "train.jsonl", "builtin:heldout": "heldout.jsonl"}


def _jsonl(path: Path) -> list[str]:
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise KimiQuantError(f"{path}:{lineno}: not UTF-8 text (byte {e.start}); calibration text must be "
                                     "UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise KimiQuantError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise KimiQuantError(f"{path}:{lineno}: nested too deeply to be a calibration record") from None
            text = rec.get("text") if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise KimiQuantError(f"{path}:{lineno}: a calibration jsonl record needs a string 'text' field")
            out.append(text)
    return out


def _parquet(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise KimiQuantError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                             f"or convert it to jsonl with a 'text' field") from None
    table = pq.read_table(path)
    if "text" not in table.column_names:
        raise KimiQuantError(f"{path}: parquet file has no 'text' column (columns: {', '.join(table.column_names)})")
    return [t for t in table.column("text").to_pylist() if isinstance(t, str)]


def _hub(name: str) -> list[str]:
    repo, _, split = name.partition(":")
    try:
        import datasets  # type: ignore
    except ImportError:
        raise KimiQuantError(f"calibration {name!r} is neither a file nor a shipped set, and loading a hub dataset "
                             f"needs the 'datasets' package (or pass a jsonl/txt/parquet file)") from None
    try:
        ds = datasets.load_dataset(repo, split=split or "train")
    except Exception as e:  # offline, unknown repo, ...
        raise KimiQuantError(f"calibration dataset {name!r} could not be loaded from the hub "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             f"offline machines need a local jsonl/txt/parquet file") from None
    if "text" not in ds.column_names:
        raise KimiQuantError(f"hub dataset {name!r} has no 'text' column")
    return [t for t in ds["text"] if isinstance(t, str)]


def load_texts(spec: str | Path | None = None) -> list[str]:
    """The documents of a calibration source (see module docstring)."""
    if spec is None:
        spec = "builtin:heldout"
    s = str(spec)
    if s in BUILTIN:
        path = CALIBRATION_DIR / BUILTIN[s]
        if not path.is_file():
            raise KimiQuantError(f"shipped calibration set {path} not found (a checkout without calibration/?); "
                                 f"pass a text file (--eval-data FILE, or --calibration-data FILE with --calibrate)")
        return _jsonl(path)
    path = Path(s)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            texts = _jsonl(path)
        elif suffix == ".parquet":
            texts = _parquet(path)
        elif suffix in (".txt", ".md", ".text", ""):
            try:
                texts = [path.read_text(encoding="utf-8")]
            except UnicodeDecodeError as e:
                raise KimiQuantError(f"{path}: not UTF-8 text (byte {e.start}); calibration text must be UTF-8") \
                    from None
        else:
            raise KimiQuantError(f"{path}: unknown calibration file type {suffix!r} (use .jsonl, .txt or .parquet)")
        if not any(t.strip() for t in texts):
            raise KimiQuantError(f"{path}: holds no text")
        return texts
    if path.suffix.lower() in (".jsonl", ".txt", ".parquet") or s.startswith((".", "/")):
        raise KimiQuantError(f"{path}: calibration file not found")
    return _hub(s)


def token_windows(model_dir: str | Path, calibration: str | Path | None, max_tokens: int, seq_len: int) \
        -> list[torch.Tensor]:
    """Batches of windows ([n, seq_len] for the full ones, then [1, rest] for a final short one)."""
    import torch

    if seq_len < 2:
        raise KimiQuantError(f"--seq-len must be at least 2 (got {seq_len})")
    if max_tokens < 2:
        raise KimiQuantError(f"--tokens must be at least 2 (got {max_tokens})")
    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for text in load_texts(calibration):
        ids.extend(tok.encode(text))
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    if len(ids) < 2:
        raise KimiQuantError("calibration text yields fewer than 2 tokens")
    stream = torch.tensor(ids, dtype=torch.long)
    n_full = len(ids) // seq_len
    batches = []
    if n_full:
        batches.append(stream[: n_full * seq_len].view(n_full, seq_len))
    rest = stream[n_full * seq_len:]
    if len(rest) >= 2:
        batches.append(rest.view(1, -1))
    return batches
