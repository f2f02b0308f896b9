"""The output directory's journal: which output shards are complete, with size and sha256.

An append-only JSON-lines file, one fsync'd line per event. A torn last line (power loss) is
ignored. Resume = plan minus journal: completed shards are re-hashed and kept, everything else
is redone. The first line records the plan fingerprint: another conversion into the same
directory is refused unless the user asks to overwrite.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

from .errors import KimiQuantError
from .hashing import sha256_file, sha256_files
from .untrusted import unsafe_name
from .write.atomic import disk_full

log = logging.getLogger(__name__)

JOURNAL = "kimi_quant_journal.jsonl"


class Journal:
    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / JOURNAL
        self.start: dict | None = None
        self.units: dict[str, dict] = {}  # file -> {"size", "sha256"}
        self.inputs: dict[str, str] = {}  # source file -> sha256
        self.input_stamps: dict[str, str | None] = {}  # source file -> FileEntry.stamp (size:mtime:ctime) when it was hashed
        self.complete = False
        self.metadata: dict[str, str] = {}  # metadata file -> sha256, recorded at completion
        self.written: set[str] = set()  # every file the driver wrote (or was about to) besides shards: --overwrite's to delete
        self.skipped = 0  # malformed lines ignored
        self._torn_tail = False  # the file ends in half a line: the next append starts a new one
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        if self.path.is_symlink():  # appends would land wherever it points
            raise KimiQuantError(f"{self.path} is a symlink; a kimi-quant journal never is: remove it (or choose "
                                 "another --output)")
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        self._torn_tail = bool(text) and not text.endswith("\n")
        for n, line in enumerate(text.splitlines(), 1):
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash (the next append starts a new line after it)
            except RecursionError:
                self._skip(n, "nested too deeply")
                continue
            why = _malformed(ev)
            if why:
                self._skip(n, why)
                continue
            kind = ev.get("kind")
            if kind == "start":
                self.start = ev
            elif kind == "unit":
                self.units[ev["file"]] = {"size": ev["size"], "sha256": ev["sha256"], "inputs": ev.get("inputs")}
            elif kind == "input":
                self.inputs[ev["file"]] = ev["sha256"]
                self.input_stamps[ev["file"]] = ev.get("stamp")
            elif kind == "writing":
                self.written.update(ev["files"])
            elif kind == "complete":
                self.complete = True
                self.metadata = ev["files"]
                self.written.update(ev["files"])
            elif kind == "reopen":
                self.complete = False
                self.metadata = {}

    def _skip(self, n: int, why: str) -> None:
        self.skipped += 1
        log.warning("kimi-quant: warning: %s line %d ignored (%s); what it recorded will be redone", self.path, n, why)

    def _append(self, ev: dict) -> None:
        line = json.dumps(ev, sort_keys=True) + "\n"
        if self._torn_tail:  # never glue an event onto a line torn by a crash: it would be lost
            line = "\n" + line
        try:
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(self.path, e) from None
            raise
        self._torn_tail = False

    def begin(self, fingerprint: str, summary: dict) -> None:
        self.start = {"kind": "start", "fingerprint": fingerprint, **summary}
        self._append(self.start)

    def record_unit(self, file: str, size: int, sha256: str, inputs: dict[str, str]) -> None:
        """A complete output shard, with the identity (``FileEntry.identity``) of each source shard it
        was made from: a resumed run keeps it only while those are unchanged."""
        self.units[file] = {"size": size, "sha256": sha256, "inputs": inputs}
        self._append({"kind": "unit", "file": file, "size": size, "sha256": sha256, "inputs": inputs})

    def record_input(self, file: str, sha256: str, stamp: str | None = None) -> None:
        """Record a source file's sha256 (``stamp``: its size, mtime and ctime then, to notice a later change)."""
        if self.inputs.get(file) != sha256 or self.input_stamps.get(file) != stamp:
            self.inputs[file] = sha256
            self.input_stamps[file] = stamp
            self._append({"kind": "input", "file": file, "sha256": sha256, "stamp": stamp})

    def record_writing(self, names: list[str]) -> None:
        """Files about to be written next to the shards (config, copies, index, ...): recorded first, so an
        --overwrite after a crash part-way through still knows they are kimi-quant's to delete."""
        new = sorted(set(names) - self.written)
        if new:
            self.written.update(new)
            self._append({"kind": "writing", "files": new})

    def mark_complete(self, names: list[str]) -> None:
        """Record completion with the sha256 of the files around the shards (index, description,
        config.json, copied tokenizer files, ...) so ``verify`` notices later edits; again whenever a
        re-run rewrote them differently (a changed source config.json). Provenance is left out:
        --validate amends it."""
        out_dir = self.path.parent
        files = {name: sha256_file(out_dir / name) for name in sorted(names) if (out_dir / name).exists()}
        if self.complete and files == self.metadata:
            return
        self.complete = True
        self.metadata = files
        self.written.update(files)
        self._append({"kind": "complete", "files": files})

    def reopen(self) -> None:
        """A complete output is about to have shards rewritten: it is not complete until the run ends."""
        if self.complete:
            self.complete = False
            self.metadata = {}
            self._append({"kind": "reopen"})

    def verified_units(self, out_dir: Path, expected: dict[str, dict[str, str]], quiet: bool = True) -> dict[str, dict]:
        """Journal entries still good: made from the same source shards (``expected``: output shard ->
        {source shard: identity} now), and whose file exists with the recorded size and sha256.
        The rest is redone."""
        sized = [(f, rec) for f, rec in sorted(self.units.items())
                 if f in expected and rec.get("inputs") == expected[f]
                 and (out_dir / f).is_file() and not (out_dir / f).is_symlink()
                 and (out_dir / f).stat().st_size == rec["size"]]
        shas = sha256_files([out_dir / f for f, _ in sized], desc="check kept shards", quiet=quiet)
        return {f: rec for (f, rec), sha in zip(sized, shas) if sha == rec["sha256"]}


def _malformed(ev) -> str | None:
    """Why a parsed journal line cannot be used (None when it can): lines are read back by every later
    command, so a damaged or hand-edited one must not crash them, nor name a file outside the output."""
    if not isinstance(ev, dict):
        return "not an object"
    kind = ev.get("kind")
    if kind in ("unit", "input"):
        why = unsafe_name(ev.get("file"))
        if why:
            return f"'file' {str(ev.get('file'))[:60]} {why}"
        if not isinstance(ev.get("sha256"), str):
            return "'sha256' is not a string"
        if kind == "unit" and (type(ev.get("size")) is not int or ev["size"] < 0):
            return "'size' is not a byte count"
        if kind == "unit" and not isinstance(ev.get("inputs"), (dict, type(None))):
            return "'inputs' is not an object"
        if kind == "input" and not isinstance(ev.get("stamp"), (str, type(None))):
            return "'stamp' is not a string"
    elif kind in ("complete", "writing"):
        files = ev.get("files")
        if kind == "complete" and not isinstance(files, dict):
            return "'files' is not an object"
        if not isinstance(files, (dict, list)) or any(unsafe_name(f) for f in files):
            return "'files' names something that is not a file in the output"
        if kind == "complete" and not all(isinstance(v, str) for v in files.values()):
            return "'files' holds a hash that is not a string"
    elif kind == "start":
        if not isinstance(ev.get("fingerprint"), str):
            return "'fingerprint' is not a string"
    elif kind != "reopen":
        return f"unknown kind {str(kind)[:40]!r}"
    return None


#: options that change the plan, as the journal records them -> their command-line flag (None: positional)
PLAN_OPTIONS = {"source": None, "target": "--target", "recipe": "--recipe", "overrides": "--override",
                "max_shard_size": "--max-shard-size", "revision": "--revision", "group_size": "--group-size",
                "calibrate": "--calibrate"}
#: a calibrated run's settings, as the journal records them under "calibrate" -> their flag
CALIB_OPTIONS = {"calibration": "--calibration-data", "tokens": "--tokens", "act_order": "--act-order",
                 "damp": "--damp", "min_expert_tokens": "--min-expert-tokens", "expert_tokens": "--expert-tokens"}


def _calib_flags(v) -> list[str]:
    """``--calibrate`` and the settings of a recorded calibrated run (nothing for a data-free one)."""
    if not isinstance(v, dict):
        return []
    out = ["--calibrate"]
    for key, flag in CALIB_OPTIONS.items():
        item = v.get(key)
        if key == "act_order" and isinstance(item, bool):
            out.append("--act-order" if item else "--no-act-order")
        elif item is not None and not isinstance(item, (dict, list, bool)):
            out += [flag, str(item)]
    return out


def _flags(options: dict, keys) -> list[str]:
    out = []
    for k in keys:
        flag, v = PLAN_OPTIONS[k], options.get(k)
        if k == "calibrate":
            out += _calib_flags(v)
            continue
        if flag is None or v in (None, [], ()):
            continue
        out += [a for item in (v if isinstance(v, list) else [v]) for a in (flag, str(item))]
    return out


def finish_command(options: dict, out_dir: Path) -> str:
    """The ``kimi-quant convert`` command that finishes an output made with the recorded ``options``."""
    import shlex

    args = ["kimi-quant", "convert", str(options.get("source")), *_flags(options, [k for k in PLAN_OPTIONS if k != "source"]),
            "--output", str(out_dir)]
    return shlex.join(args)


def finish_hint(journal: Journal, out_dir: Path) -> str:
    """"the command that finishes it: ..." from the recorded options, else the advice to re-run it."""
    options = journal.start.get("options") if journal.start else None
    if isinstance(options, dict) and isinstance(options.get("source"), str):
        return f"the command that finishes it: {finish_command(options, out_dir)}"
    return "re-run the same convert command to finish it"


def unfinished(journal: Journal, out_dir: Path) -> str:
    """How far an unfinished output got and the command that finishes it, for one line."""
    done = len(journal.units)
    total = journal.start.get("units") if journal.start else None
    of = f" of {total}" if isinstance(total, int) and not isinstance(total, bool) and total >= done else ""
    got = f"{done}{of} shard{'s' if (total if of else done) != 1 else ''} written"
    return f"{got}; {finish_hint(journal, out_dir)}"


def check_same_conversion(journal: Journal, fingerprint: str, summary: dict, out_dir: Path,
                          options: dict | None = None) -> None:
    """Refuse a run whose plan differs from the one ``out_dir`` was started with, naming the options
    that differ (with the values recorded) and the command that finishes the existing output."""
    if journal.start is None:
        return
    if journal.start.get("fingerprint") == fingerprint:
        return
    recorded = journal.start.get("options")
    kept = sum(1 for _ in journal.units)
    lose = f" (discarding its {kept} finished shard{'s' if kept != 1 else ''})" if kept else ""
    if isinstance(recorded, dict) and options is not None:
        changed = [k for k in PLAN_OPTIONS if recorded.get(k) != options.get(k)]
        named = []
        for k in changed:
            was, now = recorded.get(k), options.get(k)
            name = PLAN_OPTIONS[k] or "SOURCE"
            named.append(f"{name} was {_shown(was, k)}, now {_shown(now, k)}")
        what = "; ".join(named) if named else ("same options, but " + _why_same_options(journal.start, summary))
        flags = _flags(recorded, changed)
        import shlex

        # a finished output needs no finishing: the command is the one that made it (and would check it)
        verb = "keep" if journal.complete else "finish"
        finish = f"to {verb} it, pass {shlex.join(flags)}; " if flags and "source" not in changed else ""
        raise KimiQuantError(f"{out_dir} holds another conversion ({what}); {finish}use --overwrite to replace "
                             f"it{lose}, or choose another --output; the command that "
                             f"{'made' if journal.complete else 'finishes'} it: {finish_command(recorded, out_dir)}")
    diffs = [f"{k} {journal.start.get(k)!r} -> {v!r}" for k, v in summary.items() if journal.start.get(k) != v]
    what = "; ".join(diffs) if diffs else "the plan differs (source, recipe or shard size)"
    old_rev = journal.start.get("revision")
    verb = "keep" if journal.complete else "finish"
    resume = (f"to {verb} it, pass --revision {old_rev}; " if old_rev and old_rev != summary.get("revision") else "")
    raise KimiQuantError(f"{out_dir} holds another conversion ({what}); {resume}use --overwrite to replace it{lose}, "
                         "or choose another --output")


def _shown(v, key: str = "") -> str:
    if v in (None, [], ()):
        return "not given"
    if key == "max_shard_size" and isinstance(v, int):  # as it was typed: 4GiB, 128MB
        from .progress import fmt_typed_size

        return fmt_typed_size(v)
    if isinstance(v, dict):  # --calibrate's settings
        import shlex

        return shlex.join(_calib_flags(v)[1:]) or "the defaults"
    if isinstance(v, list):
        return " ".join(repr(x) for x in v)
    return str(v)


def _why_same_options(start: dict, summary: dict) -> str:
    diffs = [f"{k} was {start.get(k)!r}, now {v!r}" for k, v in summary.items() if start.get(k) != v]
    return "; ".join(diffs) if diffs else ("the source's shards, the recipe file's or the calibration text's "
                                           "contents changed")
