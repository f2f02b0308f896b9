"""A small HF-hub-compatible HTTP server of the project's own, for upload (and download-fault) tests.

No installable hub accepts uploads offline, so this speaks the parts of the real hub HTTP protocol
that huggingface_hub 2.x uses with ``HF_HUB_DISABLE_XET=1``:

    POST /api/repos/create                          create (409 + url when it exists)
    GET  /api/models/{repo}[/revision/{rev}]        model info (siblings with size/blobId/lfs)
    POST /api/models/{repo}/preupload/{rev}         upload modes + remote oids
    POST /{repo}.git/info/lfs/objects/batch         LFS batch: upload + verify actions, none if present
    PUT  /_lfs/{repo}/{oid}                         object upload (sha256 and size checked)
    POST /_lfs_verify/{repo}                        verify
    POST /api/models/{repo}/commit/{rev}            NDJSON commit (file / lfsFile / deletedFile / deletedFolder)
    POST /api/models/{repo}/branch/{branch}         create a branch
    POST /api/models/{repo}/paths-info/{rev}        per-path size, blob id, lfs
    GET|HEAD /{repo}/resolve/{rev}/{path}           file bytes, honouring Range

State lives on disk under ``root`` (objects by sha256, commits as JSON). ``inject(route, kind, times)``
arms faults: ``drop`` (close the connection mid-body), ``500``, ``429`` (with Retry-After: ``retry_after``),
``corrupt`` (resolve: one byte of the file flipped, as a damaged transfer would) for routes
``create``, ``info``, ``preupload``, ``batch``, ``put``, ``verify``, ``commit``, ``paths``, ``resolve``.
``requests`` records (method, route, path) of every request for assertions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".model", ".gguf")
LFS_MIN = 10 * 1024 * 1024
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


class FakeHub:
    def __init__(self, root: str | Path, token: str | None = None, host: str = "127.0.0.1"):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self.token = token
        self.lock = threading.RLock()
        self.faults: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.ignore_range = False
        self.retry_after = "1"  # the Retry-After value a 429 fault sends
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fake-hub", daemon=True)
        self.thread.start()

    # -- test API ---------------------------------------------------------------------------
    def inject(self, route: str, kind: str, times: int = 1) -> None:
        with self.lock:
            self.faults.setdefault(route, []).extend([kind] * times)

    def take_fault(self, route: str) -> str | None:
        with self.lock:
            q = self.faults.get(route)
            return q.pop(0) if q else None

    def count(self, route: str) -> int:
        with self.lock:
            return sum(1 for _, r, _ in self.requests if r == route)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- storage -----------------------------------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        return self.root / "repos" / repo_id

    def exists(self, repo_id: str) -> bool:
        return (self.repo_dir(repo_id) / "repo.json").exists()

    def obj_path(self, oid: str) -> Path:
        return self.root / "objects" / oid

    def put_object(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        p = self.obj_path(oid)
        if not p.exists():
            tmp = p.with_name(p.name + f".tmp{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return oid

    def refs(self, repo_id: str) -> dict[str, str]:
        return json.loads((self.repo_dir(repo_id) / "refs.json").read_text())

    def commit_tree(self, repo_id: str, sha: str) -> dict:
        return json.loads((self.repo_dir(repo_id) / "commits" / f"{sha}.json").read_text())["files"]

    def resolve(self, repo_id: str, rev: str) -> str | None:
        rev = unquote(rev)
        refs = self.refs(repo_id)
        if rev in refs:
            return refs[rev]
        if re.fullmatch(r"[0-9a-f]{40}", rev) and (self.repo_dir(repo_id) / "commits" / f"{rev}.json").exists():
            return rev
        return None

    def create(self, repo_id: str, private: bool) -> None:
        d = self.repo_dir(repo_id)
        (d / "commits").mkdir(parents=True, exist_ok=True)
        (d / "repo.json").write_text(json.dumps({"private": private}))
        (d / "refs.json").write_text("{}")
        self.new_commit(repo_id, "main", None, {".gitattributes": self.file_entry(GITATTRIBUTES, False)},
                        "initial commit")

    def file_entry(self, data: bytes, lfs: bool) -> dict:
        oid = self.put_object(data)
        if lfs:
            return {"size": len(data), "sha256": oid, "lfs": True, "blob": git_blob_sha1(pointer(oid, len(data)))}
        return {"size": len(data), "sha256": oid, "lfs": False, "blob": git_blob_sha1(data)}

    def new_commit(self, repo_id: str, branch: str, parent: str | None, files: dict, message: str) -> str:
        with self.lock:
            body = json.dumps({"parent": parent, "files": files, "message": message, "t": time.time_ns()},
                              sort_keys=True)
            sha = hashlib.sha1(body.encode()).hexdigest()
            (self.repo_dir(repo_id) / "commits" / f"{sha}.json").write_text(body)
            refs = self.refs(repo_id)
            refs[branch] = sha
            (self.repo_dir(repo_id) / "refs.json").write_text(json.dumps(refs))
            return sha

    def files_at(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """Test helper: {path: content} at ``rev``."""
        sha = self.resolve(repo_id, rev)
        return {p: self.obj_path(e["sha256"]).read_bytes() for p, e in self.commit_tree(repo_id, sha).items()}


ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "yaml"),
    ("GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$"), "info"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$"), "batch"),
    ("PUT", re.compile(r"^/_lfs/(?P<repo>[^/]+/[^/]+)/(?P<oid>[0-9a-f]{64})$"), "put"),
    ("POST", re.compile(r"^/_lfs_verify/(?P<repo>[^/]+/[^/]+)$"), "verify"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)$"), "branch"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)$"), "paths"),
    ("GET", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing ------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                line = self.rfile.readline().strip()
                n = int(line.split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None,
              ctype: str = "application/json") -> None:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, msg: str, code: str | None = None) -> None:
        self._send(status, {"error": msg}, {"X-Error-Code": code, "X-Error-Message": msg} if code else
                   {"X-Error-Message": msg})

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass

    def _authorized(self, write: bool) -> bool:
        token = self.server_hub.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        if got == f"Bearer {token}":
            return True
        if not write and not got:
            return True  # anonymous reads of public repos
        self._error(401, "Invalid credentials in Authorization header")
        return False

    def _dispatch(self) -> None:
        hub = self.server_hub
        url = urlparse(self.path)
        path = unquote(url.path)
        for method, rx, route in ROUTES:
            m = rx.match(path) if method == self.command else None
            if m:
                break
        else:
            self._body()
            return self._error(404, f"no route {self.command} {path}")
        with hub.lock:
            hub.requests.append((self.command, route, path))
        if route == "resolve" and self.command == "HEAD" and (hub.faults.get(route) or [None])[0] == "corrupt":
            fault = None  # a corruption is for the bytes of the GET that follows
        else:
            fault = hub.take_fault(route)
        if fault == "429":
            self._body()
            return self._send(429, {"error": "rate limited"}, {"Retry-After": hub.retry_after})
        if fault == "500":
            self._body()
            return self._error(500, "injected server error")
        if fault == "drop" and route != "put" and route != "resolve":
            self._body()
            return self._drop()
        kw = {k: v for k, v in m.groupdict().items() if v is not None}
        repo = kw.get("repo")
        if repo and route not in ("create",) and not hub.exists(repo):
            self._body()
            return self._error(404, "Repository not found", "RepoNotFound")
        if repo and hub.exists(repo) and route != "put":  # an upload URL is its own credential (pre-signed)
            private = json.loads((hub.repo_dir(repo) / "repo.json").read_text())["private"]
            if not self._authorized(write=self.command in ("POST", "PUT") and route != "paths" or private):
                self._body()
                return
        getattr(self, f"r_{route}")(fault=fault, query=parse_qs(url.query), **kw)

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch

    # -- routes ---------------------------------------------------------------------------------
    def r_create(self, fault, query):
        hub = self.server_hub
        body = json.loads(self._body() or b"{}")
        if not self._authorized(write=True):
            return
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        url = f"{hub.endpoint}/{repo_id}"
        with hub.lock:
            if hub.exists(repo_id):
                return self._send(409, {"error": "You already created this model repo", "url": url})
            hub.create(repo_id, private=body.get("visibility") == "private" or bool(body.get("private")))
        self._send(200, {"url": url, "name": repo_id})

    def r_yaml(self, fault, query):
        self._body()
        self._send(200, {"errors": [], "warnings": []})

    def _rev(self, repo, rev) -> str | None:
        sha = self.server_hub.resolve(repo, rev or "main")
        if sha is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha

    def r_info(self, fault, query, repo, rev="main"):
        hub = self.server_hub
        sha = self._rev(repo, rev)
        if sha is None:
            return
        tree = hub.commit_tree(repo, sha)
        private = json.loads((hub.repo_dir(repo) / "repo.json").read_text())["private"]
        sibs = []
        for p, e in sorted(tree.items()):
            s = {"rfilename": p}
            if query.get("blobs", ["false"])[0].lower() == "true":
                s.update(size=e["size"], blobId=e["blob"])
                if e["lfs"]:
                    s["lfs"] = {"sha256": e["sha256"], "size": e["size"], "pointerSize": len(pointer(e["sha256"],
                                                                                                   e["size"]))}
            sibs.append(s)
        self._send(200, {"_id": sha, "id": repo, "modelId": repo, "sha": sha, "private": private,
                         "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
                         "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                         "siblings": sibs})

    def r_preupload(self, fault, query, repo, rev):
        hub = self.server_hub
        body = json.loads(self._body())
        sha = self._rev(repo, rev)
        if sha is None:
            return
        tree = hub.commit_tree(repo, sha)
        out = []
        for f in body["files"]:
            lfs = f["size"] >= LFS_MIN or f["path"].endswith(LFS_SUFFIXES)
            e = tree.get(f["path"])
            oid = None
            if e is not None:
                oid = e["sha256"] if e["lfs"] else e["blob"]
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self._send(200, {"files": out, "commitOid": sha})

    def r_batch(self, fault, query, repo):
        hub = self.server_hub
        body = json.loads(self._body())
        objs = []
        for o in body["objects"]:
            item = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            p = hub.obj_path(o["oid"])
            if not (p.exists() and p.stat().st_size == o["size"]):
                item["actions"] = {
                    "upload": {"href": f"{hub.endpoint}/_lfs/{repo}/{o['oid']}", "header": {}},
                    "verify": {"href": f"{hub.endpoint}/_lfs_verify/{repo}", "header": {}},
                }
            objs.append(item)
        self._send(200, {"transfer": "basic", "objects": objs}, ctype="application/vnd.git-lfs+json")

    def r_put(self, fault, query, repo, oid):
        hub = self.server_hub
        if fault == "drop":  # read part of the body, then hang up without answering
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(max(1, n // 2))
            return self._drop()
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, f"sha256 of the uploaded bytes is not {oid}")
        hub.put_object(data)
        self._send(200, b"", ctype="text/plain")

    def r_verify(self, fault, query, repo):
        body = json.loads(self._body())
        p = self.server_hub.obj_path(body["oid"])
        if not p.exists() or p.stat().st_size != body["size"]:
            return self._error(404, f"object {body['oid']} not uploaded")
        self._send(200, {})

    def r_branch(self, fault, query, repo, rev):
        hub = self.server_hub
        body = json.loads(self._body() or b"{}")
        with hub.lock:
            refs = hub.refs(repo)
            if rev in refs:
                return self._error(409, f"Reference already exists: refs/heads/{rev}")
            start = hub.resolve(repo, body.get("startingPoint") or "main")
            refs[rev] = start
            (hub.repo_dir(repo) / "refs.json").write_text(json.dumps(refs))
        self._send(200, {})

    def r_commit(self, fault, query, repo, rev):
        hub = self.server_hub
        lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
        if not lines or lines[0].get("key") != "header":
            return self._error(400, "first NDJSON line must be the header")
        with hub.lock:
            sha = hub.resolve(repo, rev)
            if sha is None:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            parent_expected = lines[0]["value"].get("parentCommit")
            if parent_expected and parent_expected != sha:
                return self._error(412, "A commit has happened since. Please refresh and try again.")
            files = dict(hub.commit_tree(repo, sha))
            for item in lines[1:]:
                v = item["value"]
                if item["key"] == "file":
                    data = base64.b64decode(v["content"]) if v.get("encoding") == "base64" else v["content"].encode()
                    files[v["path"]] = hub.file_entry(data, lfs=False)
                elif item["key"] == "lfsFile":
                    p = hub.obj_path(v["oid"])
                    if not p.exists():
                        return self._error(400, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                    size = p.stat().st_size
                    files[v["path"]] = {"size": size, "sha256": v["oid"], "lfs": True,
                                        "blob": git_blob_sha1(pointer(v["oid"], size))}
                elif item["key"] == "deletedFile":
                    if files.pop(v["path"], None) is None:
                        return self._error(404, "A file with this name doesn't exist", "EntryNotFound")
                elif item["key"] == "deletedFolder":  # every file under the path
                    under = [p for p in files if p.startswith(v["path"].rstrip("/") + "/")]
                    if not under:
                        return self._error(404, "A folder with this name doesn't exist", "EntryNotFound")
                    for p in under:
                        del files[p]
                else:
                    return self._error(400, f"unsupported commit operation {item['key']}")
            branch = unquote(rev) if unquote(rev) in hub.refs(repo) else "main"
            new = hub.new_commit(repo, branch, sha, files, lines[0]["value"].get("summary", ""))
        self._send(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{new}", "commitOid": new,
                         "success": True, "pullRequestUrl": None})

    def r_paths(self, fault, query, repo, rev):
        hub = self.server_hub
        raw = self._body()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            paths = json.loads(raw).get("paths", [])
        else:
            paths = parse_qs(raw.decode()).get("paths", [])
        sha = self._rev(repo, rev)
        if sha is None:
            return
        tree = hub.commit_tree(repo, sha)
        out = []
        for p in paths:
            e = tree.get(p)
            if e is None:
                continue
            item = {"type": "file", "path": p, "size": e["size"], "oid": e["blob"]}
            if e["lfs"]:
                item["lfs"] = {"oid": e["sha256"], "size": e["size"],
                               "pointerSize": len(pointer(e["sha256"], e["size"]))}
            out.append(item)
        self._send(200, out)

    def r_resolve(self, fault, query, repo, rev, path):
        hub = self.server_hub
        sha = self._rev(repo, rev)
        if sha is None:
            return
        e = hub.commit_tree(repo, sha).get(path)
        if e is None:
            return self._error(404, "Entry not found", "EntryNotFound")
        data = hub.obj_path(e["sha256"]).read_bytes()
        etag = e["sha256"] if e["lfs"] else e["blob"]
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if e["lfs"]:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(e["size"])
        status, body = 200, data
        rng = self.headers.get("Range")
        if rng and not hub.ignore_range:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m:
                start = int(m.group(1))
                end = int(m.group(2)) if m.group(2) else len(data) - 1
                if start >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                end = min(end, len(data) - 1)
                status, body = 206, data[start:end + 1]
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        if fault == "corrupt" and self.command == "GET":  # the right length, one byte flipped in transit
            body = bytes([body[0] ^ 0xFF]) + body[1:] if body else body
        if fault == "drop" and self.command == "GET":  # send the headers and half the bytes, then hang up
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            return self._drop()
        self._send(status, body, headers, ctype="application/octet-stream")
