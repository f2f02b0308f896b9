"""hub_http: the one judgement of a hub failure that the hub source and publish share, on answers read by
huggingface_hub's own hf_raise_for_status (no server needed: the answers are built here)."""

from __future__ import annotations

import threading
import time

import httpx2
import pytest
from huggingface_hub import errors as hfe

from kimi_quant.hub_http import (Backoff, Closed, HubError, Transient, raise_for_status, refusal, status_of,
                                 transient)

URL = "https://hub.example/org/name/resolve/0123456789abcdef0123456789abcdef01234567/model.safetensors"


def answer(status: int, headers: dict | None = None, body: bytes = b"") -> httpx2.Response:
    return httpx2.Response(status, headers=headers or {}, content=body, request=httpx2.Request("GET", URL))


def failure(status: int, headers: dict | None = None) -> BaseException:
    with pytest.raises((hfe.HfHubHTTPError, Transient)) as ei:
        raise_for_status(answer(status, headers))
    return ei.value


@pytest.mark.parametrize("status", [408, 409, 412, 416, 429, 500, 502, 503, 504])
def test_answers_worth_another_try_are_transient(status):
    e = failure(status, {"Retry-After": "7"})
    assert isinstance(e, Transient) and e.retry_after == 7.0 and f"HTTP {status}" in str(e)


@pytest.mark.parametrize("status,headers,kind", [
    (404, {"X-Error-Code": "EntryNotFound"}, "entry"),
    (404, {"X-Error-Code": "RevisionNotFound"}, "revision"),
    (404, {"X-Error-Code": "RepoNotFound"}, "repo"),
    (403, {"X-Error-Code": "GatedRepo"}, "gated"),
    (403, {}, "denied"),
    (404, {}, "missing"),
    (400, {}, None),
    (501, {}, None),
])
def test_refusals_are_named_and_final(status, headers, kind):
    e = failure(status, headers)
    assert isinstance(e, hfe.HfHubHTTPError) and transient(e) is None
    assert refusal(e) == kind and status_of(e) == status


def test_a_success_or_redirect_is_no_failure():
    for status in (200, 206, 302):
        raise_for_status(answer(status, {"Location": URL} if status == 302 else None))


def test_a_wrapped_upload_failure_is_judged_by_its_cause():
    """huggingface_hub wraps a failed LFS upload in a RuntimeError whose cause holds the answer."""
    from huggingface_hub.utils import hf_raise_for_status

    for status, again in ((503, True), (403, False)):
        try:
            try:
                hf_raise_for_status(answer(status, {"Retry-After": "3"}))
            except hfe.HfHubHTTPError as cause:
                raise RuntimeError("Error while uploading 'x' to the Hub.") from cause
        except RuntimeError as e:
            wrapped = e
        assert status_of(wrapped) == status
        if again:
            assert transient(wrapped).retry_after == 3.0
        else:
            assert transient(wrapped) is None and refusal(wrapped) == "denied"


def test_connection_failures_are_transient():
    e = transient(httpx2.ConnectError("connection refused"))
    assert isinstance(e, Transient) and "ConnectError" in str(e) and e.retry_after is None
    assert transient(ValueError("bad answer")) is None


def test_backoff_waits_what_the_server_asked_else_doubles_within_the_cap():
    b = Backoff(tries=5, base=1.0, cap=3.0)
    assert b.delay(0, retry_after=12.5) == 12.5
    for attempt, most in ((0, 1.0), (1, 2.0), (2, 3.0), (6, 3.0)):
        assert most / 2 <= b.delay(attempt) <= most  # jittered down to half, never above the cap
    assert Backoff(tries=0, base=1.0, cap=1.0).tries == 1


def test_a_closed_backoff_ends_its_wait_at_once():
    stop = threading.Event()
    b = Backoff(tries=3, base=1.0, cap=60.0, stop=stop, closed_message="org/name: source closed")
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(Closed, match="^org/name: source closed$") as ei:
        b.wait(0, retry_after=60.0)
    assert time.monotonic() - t0 < 5 and isinstance(ei.value, HubError)
    with pytest.raises(Closed):
        b.check()


class EndlessBody(httpx2.SyncByteStream):
    """An error answer with a long body (64 MiB), counting the chunks anyone reads."""

    def __init__(self):
        self.read = 0

    def __iter__(self):
        for _ in range(1024):
            self.read += 1
            yield b"x" * 65536


def test_the_body_of_a_failed_streamed_answer_is_never_read():
    body = EndlessBody()
    r = httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"}, stream=body,
                        request=httpx2.Request("GET", URL))
    with pytest.raises(hfe.HfHubHTTPError) as ei:
        raise_for_status(r)
    assert refusal(ei.value) == "entry" and body.read == 0
    body = EndlessBody()
    r = httpx2.Response(503, headers={"Retry-After": "2"}, stream=body, request=httpx2.Request("GET", URL))
    with pytest.raises(Transient) as ei:
        raise_for_status(r)
    assert ei.value.retry_after == 2.0 and body.read == 0
