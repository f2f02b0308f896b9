"""``BackgroundSha256``: the sha256 of bytes given in order, hashed on a thread of its own."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest

from kimi_quant.hashing import BackgroundSha256


def test_the_digest_is_hashlib_s_over_the_same_bytes_in_order():
    rng = np.random.default_rng(0)
    pieces = [b"", b"x", os.urandom(2047), rng.integers(0, 255, 5 << 20, dtype=np.uint8),
              memoryview(os.urandom(40 << 20))[3:], rng.standard_normal((64, 33)).astype(np.float32)]
    h = BackgroundSha256(b"header", backlog=1 << 20)
    ref = hashlib.sha256(b"header")
    for p in pieces:
        h.update(p)
        ref.update(memoryview(np.ascontiguousarray(p)).cast("B") if isinstance(p, np.ndarray) else p)
    assert h.hexdigest() == ref.hexdigest()
    assert h.hexdigest() == ref.hexdigest()  # taken again: the same


class _Gate:
    """A hash object whose ``update`` waits for ``open`` (to hold the hash thread where a test wants it)."""

    def __init__(self):
        self.open, self.seen = threading.Event(), []

    def update(self, buf):
        self.open.wait(10)
        self.seen.append(bytes(buf))

    def hexdigest(self):
        return "gate"


def _returns_within(fn, seconds: float) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_update_waits_while_the_backlog_is_full_and_after_runs_once_the_bytes_before_it_are_hashed():
    h = BackgroundSha256(backlog=8)
    gate = h._sha = _Gate()
    calls = []
    h.update(b"0123456789")  # 10 bytes: the backlog (8) is full until they are hashed
    h.after(lambda: calls.append(list(gate.seen)))
    assert not _returns_within(lambda: h.update(b"more"), 0.2)  # waits for the hash thread
    assert calls == []  # the bytes before it are not hashed yet
    gate.open.set()
    deadline = time.monotonic() + 10
    while len(gate.seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.hexdigest() == "gate"
    assert gate.seen == [b"0123456789", b"more"]
    assert calls == [[b"0123456789"]]  # called after the first bytes were hashed, before the next


def test_stop_drops_what_waits_and_later_calls_run_at_once():
    calls: list[str] = []
    h = BackgroundSha256(backlog=4)
    gate = h._sha = _Gate()
    h.update(b"abcdef")
    h.after(lambda: calls.append("dropped"))
    threading.Timer(0.1, gate.open.set).start()
    h.stop()  # an error elsewhere: no digest is wanted, the thread ends
    assert calls == []
    h.after(lambda: calls.append("now"))
    assert calls == ["now"]


def test_a_failure_on_the_hash_thread_is_raised_never_a_digest_of_missing_bytes():
    h = BackgroundSha256()
    h.update(b"abc")
    h.after(lambda: 1 / 0)
    deadline = time.monotonic() + 10
    while h._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        h.update(b"more")
    with pytest.raises(RuntimeError, match="sha256 thread failed"):
        h.hexdigest()
