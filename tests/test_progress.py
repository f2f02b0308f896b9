"""Progress in a log: plain lines, one per interval, never a carriage-return stream (``kimi_quant.progress``)."""

from __future__ import annotations

import io

from conftest import kq, target_args
from kimi_quant import progress
from kimi_quant.progress import LogBar, NoBar, fmt_bytes, fmt_duration, progress_bar


def _lines(fp: io.StringIO) -> list[str]:
    text = fp.getvalue()
    assert "\r" not in text and (not text or text.endswith("\n")), repr(text)
    return text.splitlines()


def test_a_log_gets_a_line_when_the_work_is_named_each_interval_and_at_the_end(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    fp = io.StringIO()
    bar = LogBar(4_000_000_000, "convert a3", fp=fp, interval=30)
    bar.set_postfix_str("loading kernels")
    clock[0] += 20  # the wait before the first bytes: not part of the rate
    bar.set_postfix_str("", refresh=False)  # as the converter does at the first progress
    bar.update(1_000_000_000)
    clock[0] += 10
    bar.update(1_000_000_000)  # 30 s since the last line, 10 s since the first progress
    clock[0] += 5
    bar.update(1_000_000_000)  # within the interval: no line
    clock[0] += 10
    bar.update(1_000_000_000)
    bar.close()
    bar.close()  # nothing new: no second last line
    assert _lines(fp) == [
        "convert a3:   0% 0 B / 4.0 GB (loading kernels)",
        "convert a3:  50% 2.0 GB / 4.0 GB, 100.0 MB/s, ETA 20 s",
        "convert a3: 100% 4.0 GB / 4.0 GB, 120.0 MB/s, in 45 s",
    ]


def test_progress_bar_is_a_log_bar_off_a_terminal(monkeypatch):
    fp = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", fp)
    bar = progress_bar(10, "verify")
    assert isinstance(bar, LogBar) and bar.fp is fp
    bar.update(10)
    bar.close()
    assert _lines(fp) == ["verify: 100% 10 B / 10 B, in < 0.1 s"]
    quiet = NoBar(10)
    quiet.set_postfix_str("x")
    quiet.update(10)
    quiet.close()
    assert quiet.n == 10 and quiet.disable


def test_formats():
    assert [fmt_bytes(n) for n in (17, 1_500, 2_000_000_000, 5.6e12, 3e15)] == [
        "17 B", "1.5 KB", "2.0 GB", "5.6 TB", "3000.0 TB"]
    assert [fmt_duration(s) for s in (0.05, 3.2, 42, 240, 7500, 3 * 86400 + 4 * 3600)] == [
        "< 0.1 s", "3.2 s", "42 s", "4 min", "2 h 05 min", "3 d 04 h"]


def test_a_convert_logged_to_a_file_writes_lines_not_frames(tiny_source, tmp_path):
    r = kq("convert", tiny_source, *target_args("a3"), "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr, repr(r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("convert a3:")]
    assert lines[0].endswith("kernels)") and lines[-1].startswith("convert a3: 100% "), lines
