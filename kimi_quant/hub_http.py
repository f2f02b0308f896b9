"""Talking to a Hugging Face hub (or any server speaking its API: HF_ENDPOINT), for the source and publish.

Requests go through huggingface_hub: its ``HfApi``, its shared session (``get_session``), its headers
(``build_hf_headers``) and its reading of a failed answer (``hf_raise_for_status``: gated, repo,
revision or entry not found). What is kimi-quant's is one judgement of a failure, used by both sides:
``transient`` (worth another try, and after how long) or ``refusal`` (what the hub said no to), and
the wait between tries (``Backoff``). huggingface_hub's ``http_backoff`` does not do for the wait:
a download also retries a body cut off mid-stream (resuming it), a server's Retry-After must be
capped (a hostile or broken server could otherwise stall a run for days) and read as an HTTP date
too, and a wait must end at once when the run closes the source.

Imported only where a hub is used: the CLI starts without huggingface_hub.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from email.utils import parsedate_to_datetime

import httpx2
from huggingface_hub import errors as hfe
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from .errors import KimiQuantError

log = logging.getLogger(__name__)

#: answers worth another try: those huggingface_hub's own backoff retries (timeout, rate limit, a server
#: error that may pass), 409 and 412 (a commit whose parent moved meanwhile: publish plans it again) and
#: 416 (a range the server could not serve just then)
RETRY_STATUS = frozenset({408, 409, 412, 416, 429, 500, 502, 503, 504})
#: failures of the connection itself, always worth another try
NETWORK_ERRORS = (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)
#: longest wait a server's Retry-After can impose before a retry (a longer ask is capped, with a message)
MAX_RETRY_AFTER = 300.0

__all__ = ["MAX_RETRY_AFTER", "NETWORK_ERRORS", "RETRY_STATUS", "Backoff", "Closed", "HubError", "Transient", "first_line",
           "get_session", "hub_headers", "raise_for_status", "refusal", "response_of", "retry_after", "status_of",
           "transient"]


class Transient(Exception):
    """A failure worth another try, after ``retry_after`` seconds when the server said how long."""

    def __init__(self, msg: str, retry_after: float | None = None):
        super().__init__(msg)
        self.retry_after = retry_after


class HubError(KimiQuantError):
    """A hub access failure explained in one line (auth, not found, network, disk)."""


class Closed(HubError):
    """The run closed the client while it waited or transferred."""


def response_of(e: BaseException | None):
    """The server's answer behind a failed hub call, also where huggingface_hub wraps it (a failed LFS
    upload is a RuntimeError whose cause holds the answer); None when there was none."""
    for x in (e, getattr(e, "__cause__", None)):
        response = getattr(x, "response", None)
        if getattr(response, "status_code", None) is not None:
            return response
    return None


def status_of(e: BaseException | None) -> int | None:
    """The HTTP status of a failed hub call (``response_of``), or None."""
    response = response_of(e)
    return response.status_code if response is not None else None


def transient(e: BaseException) -> Transient | None:
    """``e`` as a failure worth another try, or None when trying again cannot help."""
    if isinstance(e, Transient):
        return e
    if isinstance(e, NETWORK_ERRORS):
        return Transient(f"{type(e).__name__}: {e}")
    status = status_of(e)
    if status in RETRY_STATUS:
        return Transient(f"HTTP {status}: {first_line(e)}", retry_after(response_of(e)))
    return None


def refusal(e: BaseException) -> str | None:
    """What the hub refused, most specific first: ``gated`` (terms not accepted), ``revision``,
    ``entry`` (a file), ``repo`` (missing, or private without a token), ``denied`` (HTTP 401/403),
    ``missing`` (another 404); None for anything else."""
    if isinstance(e, hfe.GatedRepoError):
        return "gated"
    if isinstance(e, hfe.RevisionNotFoundError):
        return "revision"
    if isinstance(e, hfe.EntryNotFoundError):
        return "entry"
    if isinstance(e, hfe.RepositoryNotFoundError):
        return "repo"
    status = status_of(e)
    if status in (401, 403):
        return "denied"
    if status == 404:
        return "missing"
    return None


def raise_for_status(response) -> None:
    """huggingface_hub's reading of a failed answer (an ``HfHubHTTPError`` subclass), or a ``Transient``
    when another try may succeed. A redirect is no failure (the session follows it).

    The body of a failed streamed answer is never read (a broken or hostile server may send gigabytes):
    the verdict rests on the status and huggingface_hub's X-Error-Code header."""
    if response.status_code >= 400:
        response.close()  # huggingface_hub then finds the body closed and builds its message without it
    try:
        hf_raise_for_status(response)
    except hfe.HfHubHTTPError as e:
        again = transient(e)
        if again is not None:
            raise again from None
        raise


def hub_headers(token: str | None) -> dict[str, str]:
    """huggingface_hub's request headers; bytes as stored (a compressed body would not match its size or hash)."""
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"
    return headers


def first_line(e: BaseException | None) -> str:
    """The first line of ``e`` (and of its cause, where huggingface_hub wrapped one)."""
    if e is None:
        return ""
    cause = e.__cause__ if isinstance(e, RuntimeError) and e.__cause__ is not None else e
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if cause is not e:
        text += f" ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
    return text


def retry_after(response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), when a server sent one;
    at most MAX_RETRY_AFTER (an absurd ask such as ``inf`` or ``1e11`` is capped, with a warning)."""
    try:
        v = response.headers.get("Retry-After")
    except AttributeError:
        return None
    if v is None:
        return None
    try:
        secs = float(v)
    except ValueError:
        try:
            secs = parsedate_to_datetime(v).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    if secs != secs:  # NaN
        return None
    if secs > MAX_RETRY_AFTER:
        log.warning("kimi-quant: the server asked to wait %s s before retrying (Retry-After: %s); waiting %.0f s",
                    f"{secs:.3g}", str(v)[:40], MAX_RETRY_AFTER)
        return MAX_RETRY_AFTER
    return max(0.0, secs)


class Backoff:
    """The wait before try ``attempt + 1``: what the server asked (``Transient.retry_after``), else
    ``base * 2**attempt`` up to ``cap``, jittered so that parallel clients spread out. A ``stop`` event
    that is set ends the wait at once with ``Closed``."""

    def __init__(self, tries: int, base: float, cap: float, stop: threading.Event | None = None,
                 closed_message: str = "closed"):
        self.tries = max(1, int(tries))
        self.base = base
        self.cap = cap
        self.stop = stop if stop is not None else threading.Event()
        self.closed_message = closed_message

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return max(0.0, retry_after)
        return min(self.cap, self.base * 2 ** attempt) * (0.5 + random.random() / 2)

    def wait(self, attempt: int, retry_after: float | None = None) -> float:
        """Sleep before the next try; the seconds waited."""
        delay = self.delay(attempt, retry_after)
        if self.stop.wait(delay):
            raise Closed(self.closed_message)
        return delay

    def check(self) -> None:
        if self.stop.is_set():
            raise Closed(self.closed_message)
