"""Serve hand-made git repos through a real olah mirror, offline, for the hub client tests.

Each repo is a git repo at ``<mirrors>/models/<org>/<name>`` whose large files are committed
as hand-written LFS pointer files, with the objects under ``.git/lfs/objects/aa/bb/<oid>``:
olah then answers paths-info with the LFS sha256 and size, and serves the object bytes.

olah pulls its own huggingface_hub, so it lives in its own virtualenv (see
scripts/install_olah.sh) and runs as a separate process. ``find_olah()`` looks for
``olah-cli`` in $KIMI_QUANT_OLAH_CLI, ``~/.cache/kimi-quant/olah-venv/bin`` (the install script's
default), ``<repo>/.olah-venv/bin``, ``/tmp/olah-venv/bin``, then PATH;
tests skip with that reason when it is absent.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GIT_ENV = {
    "GIT_AUTHOR_NAME": "kimi-quant tests", "GIT_AUTHOR_EMAIL": "tests@example.invalid",
    "GIT_COMMITTER_NAME": "kimi-quant tests", "GIT_COMMITTER_EMAIL": "tests@example.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


def find_olah() -> str | None:
    cands = [os.environ.get("KIMI_QUANT_OLAH_CLI", ""),
             os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                          "kimi-quant", "olah-venv", "bin", "olah-cli"),
             str(REPO_ROOT / ".olah-venv" / "bin" / "olah-cli"),
             "/tmp/olah-venv/bin/olah-cli",
             shutil.which("olah-cli") or ""]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, **GIT_ENV)
    out = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


class MirrorRepo:
    """A git repo olah serves as ``org/name``; ``commit`` adds a revision."""

    def __init__(self, mirrors: Path, repo_id: str):
        self.repo_id = repo_id
        self.path = mirrors / "models" / repo_id
        self.path.mkdir(parents=True, exist_ok=True)
        _git(self.path, "init", "-q", "-b", "main")
        self.oids: dict[str, str] = {}  # path -> LFS oid at the latest commit

    def object_path(self, oid: str) -> Path:
        return self.path / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid

    def commit(self, files: dict[str, bytes | Path], message: str = "update", lfs_suffixes=(".safetensors",),
               branch: str = "main", tag: str | None = None) -> str:
        """Write ``files`` (bytes, or a Path to copy for big ones), commit on ``branch``; returns the sha."""
        cur = _git(self.path, "branch", "--show-current") if (self.path / ".git" / "HEAD").exists() else "main"
        if branch != cur:
            has_commits = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=self.path,
                                         capture_output=True).returncode == 0
            if has_commits:
                exists = subprocess.run(["git", "rev-parse", "--verify", "-q", branch], cwd=self.path,
                                        capture_output=True).returncode == 0
                _git(self.path, "checkout", "-q", *([] if exists else ["-b"]), branch)
        for name, data in files.items():
            dst = self.path / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(tuple(lfs_suffixes)):
                h = hashlib.sha256()
                size = 0
                if isinstance(data, Path):
                    with open(data, "rb") as f:
                        while chunk := f.read(1 << 22):
                            h.update(chunk)
                            size += len(chunk)
                else:
                    h.update(data)
                    size = len(data)
                oid = h.hexdigest()
                obj = self.object_path(oid)
                obj.parent.mkdir(parents=True, exist_ok=True)
                if not obj.exists():
                    if isinstance(data, Path):
                        shutil.copyfile(data, obj)
                    else:
                        obj.write_bytes(data)
                dst.write_bytes(lfs_pointer(oid, size))
                self.oids[name] = oid
            else:
                dst.write_bytes(data.read_bytes() if isinstance(data, Path) else data)
        _git(self.path, "add", "-A")
        _git(self.path, "commit", "-q", "--allow-empty", "-m", message)
        if tag:
            _git(self.path, "tag", tag)
        return _git(self.path, "rev-parse", "HEAD")

    def corrupt(self, name: str, offset: int = -1) -> None:
        """Flip one byte of the stored LFS object of ``name`` (same size, wrong sha256)."""
        p = self.object_path(self.oids[name])
        data = bytearray(p.read_bytes())
        data[offset] ^= 0xFF
        p.write_bytes(bytes(data))

    def restore(self, name: str, offset: int = -1) -> None:
        self.corrupt(name, offset)


class OlahServer:
    def __init__(self, root: Path, cli: str):
        self.root = Path(root)
        self.mirrors = self.root / "mirrors"
        self.mirrors.mkdir(parents=True, exist_ok=True)
        (self.root / "repos").mkdir(exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.config = self.root / "olah.toml"
        self.config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {self.port}\n"
            f'repos-path = "{self.root / "repos"}"\n'
            'mirror-scheme = "http"\n'
            f'mirror-netloc = "127.0.0.1:{self.port}"\n'
            f'mirror-lfs-netloc = "127.0.0.1:{self.port}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            "metadata-cache-ttl = 0\n"
            "\n[accessibility]\noffline = true\n")
        self.log = open(self.root / "olah.log", "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "VIRTUAL_ENV", "PYTHON"))}
        self.proc = subprocess.Popen([cli, "-c", str(self.config)], cwd=self.root, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()
        self._count = 0
        self._lock = threading.Lock()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited with {self.proc.returncode}: "
                                   f"{(self.root / 'olah.log').read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.endpoint + "/api/models/none/none", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers: up
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"olah did not come up on {self.endpoint} within {timeout}s")

    def new_repo(self, name: str = "ckpt") -> MirrorRepo:
        with self._lock:
            self._count += 1
            n = self._count
        return MirrorRepo(self.mirrors, f"kq-test/{name}-{n}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_SERVER: OlahServer | None = None
_TMP: str | None = None


def shared_olah() -> OlahServer:
    """One olah per test session (started on first use, stopped at exit); repos are added live."""
    global _SERVER, _TMP
    if _SERVER is None:
        cli = find_olah()
        if cli is None:
            raise LookupError("olah is not installed (run scripts/install_olah.sh, or set KIMI_QUANT_OLAH_CLI)")
        _TMP = tempfile.mkdtemp(prefix="kq-olah-")
        _SERVER = OlahServer(Path(_TMP), cli)
        atexit.register(_shutdown)
    return _SERVER


def _shutdown() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None
    if _TMP:
        shutil.rmtree(_TMP, ignore_errors=True)
