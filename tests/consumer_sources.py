"""Fetch the real consumer code the conformance tests run: pinned files from PyPI, sha256-checked.

    python tests/consumer_sources.py      # fetch and unpack them all into the cache (what .ci/run does)

Nothing is built or installed: the vLLM-Ascend sdist's and the SGLang wheel's Python files are unpacked
and imported from there (with their NPU-only dependencies stubbed, see ``vllm_ascend_stubs.py`` and
``sglang_stubs.py``), msModelSlim's packing module is imported straight from its wheel, and the official
Kimi K3 modeling code is unpacked from the llm-compressor wheel that ships a copy of it. The cache
is ``$KIMI_QUANT_CONSUMER_CACHE`` (default ``~/.cache/kimi-quant/consumers``); a file already there with
the right sha256 is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedFile:
    project: str  # PyPI project
    version: str
    filename: str
    sha256: str


VLLM_ASCEND = PinnedFile("vllm-ascend", "0.23.0.post1", "vllm_ascend-0.23.0.post1.tar.gz",
                         "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1")
# the newest pre-release (2026-10-13): new module layout, per-channel-only W4A8_DYNAMIC experts
VLLM_ASCEND_RC = PinnedFile("vllm-ascend", "0.30.0rc2", "vllm_ascend-0.30.0rc2.tar.gz",
                            "05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f")
#: every vLLM-Ascend the conformance test runs against: the latest stable release first
VLLM_ASCEND_PINS = (VLLM_ASCEND, VLLM_ASCEND_RC)
#: SGLang's Ascend ModelSlim loader (and its Kimi K3 model): a binary wheel, of which only the .py files are used
SGLANG = PinnedFile("sglang", "0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
                    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937")
MSMODELSLIM = PinnedFile("msmodelslim", "26.1.0", "msmodelslim-26.1.0-py3-none-any.whl",
                         "2fbcfe268f15c3ec8b58d0b3f1eb721cff9e29ab692acd5878b542895ed3304e")
#: moonshotai/Kimi-K3's remote modeling code (configuration_kimi_k3.py, modeling_kimi_linear.py, ...), as
#: llm-compressor ships it under llmcompressor/modeling/kimi_k3/ (its header lists its few changes, none to the math)
KIMI_K3_OFFICIAL = PinnedFile("llmcompressor", "0.14.0.1", "llmcompressor-0.14.0.1-py3-none-any.whl",
                              "fedc804a45bf3e353b84b8181147474c324ffba3356c9ecebceae29dfc3c5f00")


class Unavailable(Exception):
    """The pinned file cannot be had (offline, PyPI without it): the tests skip with this reason."""


def cache_dir() -> Path:
    d = Path(os.environ.get("KIMI_QUANT_CONSUMER_CACHE") or Path.home() / ".cache" / "kimi-quant" / "consumers")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(pin: PinnedFile) -> Path:
    """The pinned file in the cache, downloaded from PyPI (JSON API) if absent; sha256 always checked."""
    dest = cache_dir() / pin.filename
    if dest.exists() and _sha256(dest) == pin.sha256:
        return dest
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        index = f"https://pypi.org/pypi/{pin.project}/json"
        with urllib.request.urlopen(index, timeout=60) as r:
            release = json.load(r).get("releases", {}).get(pin.version, [])
        url = urllib.parse.urljoin(index, next(f["url"] for f in release if f["filename"] == pin.filename))
        with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as out:
            while block := r.read(1 << 20):
                out.write(block)
        got = _sha256(tmp)
        if got != pin.sha256:
            raise Unavailable(f"{pin.filename} from PyPI has sha256 {got}, expected {pin.sha256}")
        os.replace(tmp, dest)
    except (OSError, StopIteration, ValueError) as e:
        raise Unavailable(f"cannot fetch {pin.filename} from PyPI: {e or 'not in the release'}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _unpacked(pin: PinnedFile, name: str, extract) -> Path:
    """``cache_dir()/name``, where ``extract(archive, root)`` unpacked the pinned file once; a marker holding
    the pin's sha256 says it is complete (a crash midway unpacks again)."""
    root = cache_dir() / name
    marker = root / ".kimi-quant-unpacked"
    if marker.exists() and marker.read_text() == pin.sha256:
        return root
    extract(fetch(pin), root)
    marker.write_text(pin.sha256)
    return root


def vllm_ascend_source(pin: PinnedFile = VLLM_ASCEND) -> Path:
    """Directory holding the ``vllm_ascend`` package of a pinned sdist (its .py files only)."""
    def extract(archive: Path, root: Path) -> None:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.endswith(".py") and "/vllm_ascend/" in f"/{m.name}"]
            tar.extractall(cache_dir(), members=members, filter="data")  # "data": no links, no paths outside

    return _unpacked(pin, f"vllm_ascend-{pin.version}", extract)


def unzip_py(pin: PinnedFile, under: str):
    """An ``extract`` for :func:`_unpacked`: the .py members of the wheel below folder ``under``."""
    def extract(archive: Path, root: Path) -> None:
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                name = info.filename
                parts = name.split("/")
                if info.is_dir() or not name.endswith(".py") or not name.startswith(under + "/"):
                    continue
                # zip entries are plain names: refuse absolute ones, "..", backslashes and symlinks (mode in the
                # upper 16 bits of external_attr, as unix zips record it)
                is_link = (info.external_attr >> 16) & 0o170000 == 0o120000
                if name.startswith("/") or "\\" in name or ".." in parts or is_link:
                    raise Unavailable(f"{pin.filename}: unsafe member {name!r}")
                dest = root.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))

    return extract


def sglang_source(pin: PinnedFile = SGLANG) -> Path:
    """Directory holding the ``sglang`` package of the pinned wheel (its .py files only, never installed)."""
    return _unpacked(pin, f"sglang-{pin.version}", unzip_py(pin, "sglang"))


def kimi_k3_official_source(pin: PinnedFile = KIMI_K3_OFFICIAL) -> Path:
    """Directory holding the official Kimi K3 modeling code's .py files (configuration_kimi_k3.py,
    modeling_kimi_linear.py, ...): nothing else of the wheel is unpacked, nothing is installed."""
    under = "llmcompressor/modeling/kimi_k3"
    return _unpacked(pin, f"llmcompressor-{pin.version}", unzip_py(pin, under)).joinpath(*under.split("/"))


def msmodelslim_wheel() -> Path:
    return fetch(MSMODELSLIM)


def msmodelslim_file(inner: str) -> bytes:
    """One file of the pinned msModelSlim wheel, read straight from the zip."""
    with zipfile.ZipFile(msmodelslim_wheel()) as z:
        return z.read(inner)


if __name__ == "__main__":
    for va in VLLM_ASCEND_PINS:
        print(vllm_ascend_source(va))
    print(sglang_source())
    print(msmodelslim_wheel())
    print(kimi_k3_official_source())
