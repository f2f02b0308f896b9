"""Publish a verified ascendV1 output directory to a Hugging Face hub repo (or any HF_ENDPOINT).

* Refuses an output that is incomplete or fails verification (``kimi_quant.verify.verify_output``).
* Uploads what kimi-quant wrote into the output on purpose, as its journal lists it (``upload_set``);
  anything else there (a key, a core dump, notes) is named and left out unless ``include`` names it.
  A new repo is private unless ``private=False`` (``--public``).
* Uploads only what the remote branch lacks: each local file is compared with the remote one
  (LFS sha256 for weights, git blob sha1 for small files, from the branch's file list), so a re-run
  after an interruption or a completed publish uploads nothing already there. LFS objects an
  interrupted run already sent are not sent again either (the LFS batch API says they are there).
* The branch ends up holding exactly the upload set: remote files that are not in it (an earlier
  conversion's shards, its validation report, ...) are deleted. Dot-files such as ``.gitattributes``
  are kept: an output never holds them, and the hub's own ``.gitattributes`` decides what is LFS.
* The switch is one commit: weight shards are uploaded to LFS first (invisible until committed),
  then a single commit adds them with the small files and deletes the stale ones, guarded by the
  parent commit. An interruption at any point leaves the branch as it was, never a mix.
* Refuses an output whose validation failed (``--max-ppl-increase``) unless ``force``; the card
  shows the numbers either way.
* Generates the model card (README.md, ``layout.model_card``) for this repo into the upload set; the
  output directory is not modified. The source's own card travels as ``SOURCE_README.md``.
* Transient failures (``hub_http.transient``, as for a hub source: HTTP 408/429/5xx, a parent commit
  that moved, dropped connections) are retried with backoff, re-planning from what the remote holds;
  anything else is one line (KimiQuantError).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import errors as hfe

from ..errors import KimiQuantError
from ..hashing import sha256_file
from ..hub_http import NETWORK_ERRORS, Backoff, Transient, first_line, refusal, status_of, transient
from ..journal import JOURNAL, Journal
from ..layout.ascend_v1 import DESCRIPTION, INDEX, PROVENANCE, VALIDATION
from ..layout.model_card import CARD, SOURCE_README, is_ours, model_card as _card
from ..layout.records import read_provenance
from ..lock import OUTPUT_LOCK
from ..progress import fmt_bytes
from ..untrusted import inside

log = logging.getLogger(__name__)

NOT_UPLOADED = (JOURNAL,)  # besides everything kimi-quant did not write (``upload_set``)
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".gguf", ".tiktoken")
UPLOAD_CHUNK_FILES = 50  # LFS uploads go in chunks of at most this many files / bytes, one progress line each
UPLOAD_CHUNK_BYTES = 50 * 1024 ** 3
PUBLISH_WAIT_CAP = 60.0  # seconds: the longest wait between two tries publish picks itself


class PublishError(KimiQuantError):
    pass


@dataclass
class PublishResult:
    repo_id: str
    branch: str
    commit: str | None
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # remote files that were not part of this output
    uploaded_bytes: int = 0
    url: str = ""


# -- checking the output ---------------------------------------------------------------------------
def check_output(output_dir: Path, force: bool = False) -> dict | None:
    """Raise KimiQuantError unless ``output_dir`` is a complete, verified conversion whose validation,
    if any, passed (``force``: publish a failed one too)."""
    if not output_dir.is_dir():
        raise PublishError(f"{output_dir}: not a directory")
    for name in (DESCRIPTION, INDEX):
        if not (output_dir / name).is_file():
            raise PublishError(f"{output_dir}: no {name}: not a complete kimi-quant output (refusing to publish)")
    try:
        index = json.loads((output_dir / INDEX).read_text())
        shards = sorted(set((index.get("weight_map") or {}).values()))
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as e:
        raise PublishError(f"{output_dir / INDEX}: unreadable ({e}); refusing to publish") from None
    if not shards:
        raise PublishError(f"{output_dir / INDEX}: empty weight_map; refusing to publish")
    for s in shards:
        if not (output_dir / s).is_file():
            raise PublishError(f"{output_dir}: shard {s} named in the index is missing; refusing to publish")
    try:
        from ..layout.validation import failed_validation
        from ..verify import verify_output
    except ImportError:  # older trees: the structural checks above are all we have
        return None
    try:
        summary = verify_output(output_dir)
    except KimiQuantError as e:
        raise PublishError(f"refusing to publish: {e}") from None
    failed = failed_validation(summary.get("validation"))
    if failed and not force:
        raise PublishError(f"refusing to publish {output_dir}: {failed}; --force publishes it anyway (its card "
                           "shows the numbers)")
    return summary


# -- planning -----------------------------------------------------------------------------------------
def _git_blob_sha1(data: bytes) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


@dataclass
class _Item:
    path_in_repo: str
    local: Path | None  # None: generated content in ``data``
    data: bytes | None
    size: int
    lfs: bool
    sha256: str | None = None  # for LFS items (known or computed lazily)

    def digest(self) -> str:
        if not self.lfs:
            return _git_blob_sha1(self.data if self.data is not None else self.local.read_bytes())
        if self.sha256 is None:
            self.sha256 = sha256_file(self.local)
        return self.sha256


def written_by_kimi_quant(output_dir: Path) -> set[str]:
    """What the conversion (and validate) wrote into ``output_dir`` on purpose, as its journal lists it:
    the shards, the files around them (index, description, config, provenance, card, the source's small
    files it copied) and the validation report. Anything else there was put by someone else."""
    journal = Journal(output_dir)
    return set(journal.units) | set(journal.metadata) | journal.written | {PROVENANCE, CARD, VALIDATION}


def upload_set(output_dir: Path, repo_id: str, verify_summary: dict | None, card: bool = True,
               include: tuple[str, ...] = (), left_out: list[str] | None = None) -> list[_Item]:
    """The files to upload: what kimi-quant wrote (``written_by_kimi_quant``) and what matches an
    ``include`` pattern (fnmatch on the path in the output); the rest is named in ``left_out``."""
    items: list[_Item] = []
    prov = read_provenance(output_dir)
    known = {k: v.get("sha256") for k, v in (prov.get("outputs") or {}).items() if isinstance(v, dict)}
    has_source_card = (output_dir / SOURCE_README).is_file()
    ours = written_by_kimi_quant(output_dir)
    for p in sorted(output_dir.rglob("*")):
        rel = p.relative_to(output_dir).as_posix()
        if not (p.is_file() or p.is_symlink()) or p.is_dir():
            continue
        if rel in NOT_UPLOADED or rel == OUTPUT_LOCK:
            continue
        wanted = rel in ours and not any(part.startswith(".") for part in rel.split("/"))
        if rel == VALIDATION and verify_summary is not None and verify_summary.get("validation_void"):
            continue  # a report of other files (verify said why): not this output's
        if not wanted and not any(fnmatch.fnmatchcase(rel, pat) for pat in include):
            if left_out is not None:
                left_out.append(rel)
            continue
        if not p.is_file():
            continue
        if not inside(p, output_dir):  # never upload what lies outside the directory the user named
            raise PublishError(f"{p} links to {os.path.realpath(p)}, outside {output_dir}: refusing to publish it "
                               "(remove the link, or copy the file in)")
        size = p.stat().st_size
        lfs = rel.endswith(LFS_SUFFIXES) or size >= 10 * 1024 * 1024
        target = rel
        if rel == CARD and card:
            if is_ours(p) or has_source_card:
                continue  # generated below, for this repo
            target = SOURCE_README  # an output of an older kimi-quant: the source's card, copied as README.md
        # sha256 known from the provenance only after verify_output re-hashed the shards against the journal
        sha = known.get(rel) if verify_summary is not None else None
        items.append(_Item(target, p, None, size, lfs, sha))
    if card:
        text = _card(output_dir, repo_id, verify_summary).encode()
        items.append(_Item(CARD, None, text, len(text), False))
    return items


# -- the upload -----------------------------------------------------------------------------------------
def publish(output_dir, repo_id: str, private: bool = True, branch: str | None = None, token: str | None = None,
            endpoint: str | None = None, commit_message: str | None = None, card: bool = True, retries: int = 5,
            backoff: float = 2.0, verify: bool = True, echo=None, force: bool = False,
            include: tuple[str, ...] = ()) -> PublishResult:
    """Create ``repo_id`` if needed (private unless ``private`` is False) and upload what kimi-quant wrote
    into ``output_dir`` (and what an ``include`` pattern names) to ``branch`` (default main); see module doc."""

    from huggingface_hub import HfApi, constants

    output_dir = Path(output_dir).expanduser().resolve()
    say = echo or (lambda msg: log.info("%s", msg))
    summary = check_output(output_dir, force) if verify else None
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise PublishError(f"--repo-id must be ORG/NAME, got {repo_id!r}")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    branch = branch or "main"
    if summary is not None and summary.get("validation_void"):
        say(f"not publishing the recorded validation: {summary['validation_void']} (`kimi-quant validate` measures "
            "this output)")
    left_out: list[str] = []
    items = upload_set(output_dir, repo_id, summary, card=card, include=tuple(include), left_out=left_out)
    if left_out:
        shown = ", ".join(left_out[:8]) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
        say(f"leaving out {len(left_out)} file(s) kimi-quant did not write: {shown} (--include PATTERN uploads "
            "one on purpose)")
    say(f"{repo_id}: {'private' if private else 'public'} repo" +
        (" (--public makes a new repo public)" if private else " (--public)") + "; an existing repo keeps its "
        "visibility")
    result = PublishResult(repo_id, branch, None, url=f"{endpoint}/{repo_id}")
    msg = commit_message or f"Upload {output_dir.name} (kimi-quant ascendV1)"

    pace = Backoff(retries, backoff, PUBLISH_WAIT_CAP)
    _retrying(lambda: _ensure_repo(api, repo_id, private, branch), pace, repo_id, "create repo")
    failures = 0
    while True:
        plan = _retrying(lambda: _plan(api, repo_id, branch, items), pace, repo_id, "compare")
        if not plan.todo and not plan.stale:
            break
        try:
            info = _upload(api, repo_id, branch, plan, msg, say)
        except Transient as t:  # nothing is visible before the commit: compare again, then retry what is missing
            failures += 1
            if failures >= pace.tries:
                raise PublishError(f"{repo_id}: upload failed after {pace.tries} tries: {t}") from None
            _wait(pace, failures - 1, t.retry_after, "upload", str(t))
            continue
        result.commit = info.oid if info is not None else None
        result.uploaded = [i.path_in_repo for i in plan.todo]
        result.uploaded_bytes = sum(i.size for i in plan.todo)
        result.deleted = plan.stale
        break
    uploaded = set(result.uploaded)
    result.skipped = [i.path_in_repo for i in items if i.path_in_repo not in uploaded]
    if result.commit is None:
        result.commit = _retrying(lambda: api.model_info(repo_id, revision=branch).sha, pace, repo_id,
                                  "model info")
    return result


def _ensure_repo(api, repo_id: str, private: bool, branch: str) -> None:
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if branch != "main":
        api.create_branch(repo_id, branch=branch, exist_ok=True)


@dataclass
class _Plan:
    parent: str  # the branch's commit the plan was made from
    todo: list[_Item]  # absent or different on the branch
    stale: list[str]  # on the branch but not in the upload set


def _kept(path: str) -> bool:
    """Remote files publish never deletes: dot-files (.gitattributes), which an output cannot hold."""
    return any(part.startswith(".") for part in path.split("/"))


def _plan(api, repo_id: str, branch: str, items: list[_Item]) -> _Plan:
    # one listing gives the files and the commit they belong to, so the commit can be guarded by it
    info = api.model_info(repo_id, revision=branch, files_metadata=True)
    remote = {s.rfilename: s for s in info.siblings or []}
    todo = []
    for i in items:
        r = remote.get(i.path_in_repo)
        if r is None or r.size != i.size:
            todo.append(i)
        elif i.lfs:
            if r.lfs is None or r.lfs.sha256 != i.digest():
                todo.append(i)
        elif r.lfs is not None or r.blob_id != i.digest():
            todo.append(i)
    ours = {i.path_in_repo for i in items}
    return _Plan(info.sha, todo, sorted(p for p in remote if p not in ours and not _kept(p)))


def _chunks(items: list[_Item]):
    chunk, size = [], 0
    for i in items:
        if chunk and (len(chunk) >= UPLOAD_CHUNK_FILES or size + i.size > UPLOAD_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += i.size
    if chunk:
        yield chunk


def _names(names: list[str]) -> str:
    return f"{names[0]}{' ...' if len(names) > 1 else ''}"


def _add(item: _Item):
    from huggingface_hub import CommitOperationAdd

    op = CommitOperationAdd(path_in_repo=item.path_in_repo,
                            path_or_fileobj=str(item.local) if item.local is not None else item.data)
    if item.lfs and item.sha256 is not None:
        op.upload_info.sha256 = bytes.fromhex(item.sha256)  # already verified: spare the client a re-hash
    return op


def _upload(api, repo_id: str, branch: str, plan: _Plan, message: str, say):
    """LFS uploads first (not visible on the branch), then ONE commit: all additions and the deletions."""
    from huggingface_hub import CommitOperationDelete

    adds = []
    for chunk in _chunks([i for i in plan.todo if i.lfs]):
        say(f"uploading {len(chunk)} file(s), {fmt_bytes(sum(i.size for i in chunk))}: "
            f"{_names([i.path_in_repo for i in chunk])}")
        ops = [_add(i) for i in chunk]
        _attempt(lambda: api.preupload_lfs_files(repo_id, ops, revision=branch), repo_id, "upload")
        adds += ops
    adds += [_add(i) for i in plan.todo if not i.lfs]
    deletes = [CommitOperationDelete(path_in_repo=p, is_folder=False) for p in plan.stale]
    say(f"committing {len(adds)} file(s)" +
        (f", removing {len(deletes)} not in this output: {_names(plan.stale)}" if deletes else ""))
    # parent_commit: if the branch moved since the plan, the hub refuses (412) and we re-plan
    return _attempt(lambda: api.create_commit(repo_id, adds + deletes, commit_message=message, revision=branch,
                                              parent_commit=plan.parent), repo_id, "commit")


def _attempt(fn, repo_id: str, what: str):
    """Run ``fn`` once: its result, or PublishError (one line, final) or Transient (worth a retry)."""
    try:
        return fn()
    except (hfe.HfHubHTTPError, *NETWORK_ERRORS, RuntimeError, ValueError, OSError) as e:
        raise _failure(e, repo_id, what) from None


def _failure(e: BaseException, repo_id: str, what: str) -> Exception:
    """``e`` as PublishError or Transient (``hub_http`` judges which failures pass)."""
    status = status_of(e)
    if status in (401, 403):  # before the kind: huggingface_hub reads some 401s on a repo as "not found"
        return PublishError(f"{repo_id}: not allowed to {what} (HTTP {status}): set HF_TOKEN to a token with write "
                            "access to this namespace")
    kind = refusal(e)
    if kind == "revision":
        return PublishError(f"{repo_id}: branch not found while trying to {what}")
    if kind in ("repo", "gated"):
        return PublishError(f"{repo_id}: repo not found or not accessible while trying to {what}: check the "
                            "repo id and HF_TOKEN")
    again = transient(e)
    if again is not None:
        return again
    if isinstance(e, hfe.HfHubHTTPError):
        return PublishError(f"{repo_id}: {what} failed: HTTP {status}: {first_line(e)}")
    if isinstance(e, RuntimeError):  # huggingface_hub wraps a failed LFS upload: "Error while uploading 'x' ..."
        # with no answer behind it (a dropped connection) another try may pass
        return Transient(first_line(e)) if status is None else PublishError(f"{repo_id}: {first_line(e)}")
    if isinstance(e, ValueError):  # malformed server answers, LFS batch errors
        return PublishError(f"{repo_id}: {what} failed: {first_line(e)}")
    return PublishError(f"{repo_id}: {what} failed: {type(e).__name__}: {e}")


def _wait(backoff: Backoff, attempt: int, retry_after: float | None, what: str, why: str) -> None:
    delay = backoff.delay(attempt, retry_after)
    log.warning("publish: %s failed (%s); retrying in %.1fs", what, why, delay)
    backoff.wait(attempt, delay)


def _retrying(fn, backoff: Backoff, repo_id: str, what: str):
    for attempt in range(backoff.tries):
        try:
            return _attempt(fn, repo_id, what)
        except Transient as t:
            if attempt + 1 >= backoff.tries:
                raise PublishError(f"{repo_id}: {what} failed after {backoff.tries} tries: {t}") from None
            _wait(backoff, attempt, t.retry_after, what, str(t))
    raise AssertionError("unreachable")
