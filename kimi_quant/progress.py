"""Progress of long work, for a person at a terminal and for a log.

On a terminal: tqdm's bar. Elsewhere (a batch job's log, ``nohup``, a pipe) tqdm would still redraw
its bar every 0.1 s, each frame joined to the last by a carriage return: a five-hour conversion
would leave ~18 MB on one line, and ``tail -f`` would show nothing until the end. There a
``LogBar`` writes one plain line every ``LOG_INTERVAL_S`` instead: ``convert 950dt:  37% 2.1 TB /
5.6 TB, 1.9 GB/s, ETA 31 min``.

Both answer the few calls the converter makes (``update``, ``set_postfix_str``, ``refresh``,
``close``; ``n``, ``total``, ``postfix``, ``disable``, ``fp``).
"""

from __future__ import annotations

import sys
import time

#: seconds between two lines of a LogBar
LOG_INTERVAL_S = 30.0


def fmt_bytes(n: float) -> str:
    """1.3 GB, 512 MB, 17 B (decimal units, as the hubs and disks count)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


#: the size suffixes the CLI reads (any case): decimal and binary
SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
                 "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def fmt_typed_size(n: int) -> str:
    """A byte count as a user would have typed it: 4GiB, 128MB (the largest unit that divides it)."""
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        if n > 0 and n % SIZE_SUFFIXES[unit.lower()] == 0:
            return f"{n // SIZE_SUFFIXES[unit.lower()]}{unit}"
    return str(n)


def fmt_size(n: float) -> str:
    """3.11 MB, 1517.830 GB: the precision the CLI's summaries and the model card give sizes in."""
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def fmt_duration(s: float) -> str:
    """3 s, 4 min, 2 h 05 min, 3 d 04 h: as precise as an estimate deserves."""
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s" if s >= 0.1 else "< 0.1 s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600):02d} h"


def progress_bar(total: int, desc: str, *, smoothing: float = 0.3):
    """A byte-counting bar on stderr: tqdm's on a terminal, else a ``LogBar``."""
    if not getattr(sys.stderr, "isatty", lambda: False)():
        return LogBar(total, desc)
    from tqdm import tqdm

    # no monitor thread: it can outlive the bar, and a process with a second thread forks no workers
    # for its next convert() (fork_server.fork_workers_here: they come from a fork server instead)
    tqdm.monitor_interval = 0
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, dynamic_ncols=True,
                smoothing=smoothing)


class NoBar:
    """A quiet run's bar: it counts and shows nothing, and spares importing tqdm (~30 ms of a run's
    start-up, while the driver alone works)."""

    disable = True
    postfix = ""

    def __init__(self, total: int):
        self.total, self.n = total, 0

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class LogBar:
    """One line per ``interval`` seconds, and one when the work is named (``set_postfix_str``) or ends.
    The rate counts from the first progress on, so a wait before it (kernels loading, the first
    download) does not make the first ETA absurd."""

    disable = False

    def __init__(self, total: int, desc: str, fp=None, interval: float = LOG_INTERVAL_S):
        self.total, self.desc, self.n = total, desc, 0
        self.fp = fp if fp is not None else sys.stderr
        self.interval = interval
        self.postfix = ""
        self._first: tuple[float, int] | None = None  # (time, n) at the first progress
        self._start = self._last = time.monotonic()
        self._shown: tuple[int, str] | None = None  # (n, postfix) of the last line written

    def update(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        self.n += n
        if self._first is None:  # the rate counts the bytes after these (how long they took is not known)
            self._first = (now, self.n)
        if now - self._last >= self.interval:
            self._write(now)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh and s:
            self._write()

    def refresh(self) -> None:
        self._write()

    def close(self) -> None:
        if self._shown != (self.n, self.postfix):
            self._write()

    def _write(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        pct = 100 * self.n / self.total if self.total else 100.0
        text = f"{self.desc}: {pct:3.0f}% {fmt_bytes(self.n)} / {fmt_bytes(self.total)}"
        if self._first is not None and now > self._first[0] and self.n > self._first[1]:
            rate = (self.n - self._first[1]) / (now - self._first[0])
            text += f", {fmt_bytes(rate)}/s"
            if self.n < self.total:
                text += f", ETA {fmt_duration((self.total - self.n) / rate)}"
        if self.n >= self.total:
            text += f", in {fmt_duration(now - self._start)}"
        if self.postfix:
            text += f" ({self.postfix})"
        print(text, file=self.fp, flush=True)
        self._last, self._shown = now, (self.n, self.postfix)
