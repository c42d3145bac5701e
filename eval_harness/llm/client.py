"""An OpenAI-compatible chat client with retries and an on-disk request cache.

Any server that speaks the OpenAI chat API works: vLLM, llama.cpp's server,
a hosted model.  Every call is cached on disk under the digest of its full
request (model, messages, parameters: a ``response_format`` with its JSON
schema included), so a re-run of an audit costs no calls at all and a crash
loses only the call in flight.  Transient failures (connection errors,
time-outs, rate limits, 5xx) are retried with exponential backoff, waiting at
least as long as a ``Retry-After`` header asks; ``requests_per_minute`` keeps
under an endpoint's rate limit in the first place.

Every request carries private text (a private context to the judge, an exposure sequence to the attacker) and
the API key, so a plaintext ``http://`` endpoint on another host is refused unless asked for
(``allow_insecure_http``); ``http://`` to this machine (loopback) is fine. The cache holds the same private text:
its folders are 0700 and its files 0600, and an entry older than ``cache_max_age_s`` or beyond
``cache_max_bytes`` (oldest first) is deleted when a client opens the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edge_sdk.models import cache_root
from edge_sdk.private_files import DIR_MODE, private_dir


def default_cache_dir() -> Path:
    return cache_root() / "llm-calls"


#: how long a cached call is kept (30 days) and how much the cache may hold (1 GiB), unless a client says otherwise
CACHE_MAX_AGE_S = 30 * 24 * 3600.0
CACHE_MAX_BYTES = 1 << 30


class EndpointReplyError(ValueError):
    """The endpoint answered, but not with a chat completion (e.g. an HTTP 200 without ``choices``)."""


def check_transport(base_url: str, *, allow_insecure_http: bool = False) -> None:
    """Refuse (``ValueError``) an endpoint that would get the key and private text in plaintext: ``http://`` to a
    host other than loopback, unless ``allow_insecure_http``; any scheme but ``http`` and ``https``."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    if parts.scheme == "https":
        return
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the endpoint {base_url!r} is not an http(s) URL")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_insecure_http:
        raise ValueError(f"the endpoint {base_url} is plain http to another host: the API key and private text "
                         "would cross the network unencrypted; use https://, or pass --allow-insecure-http if the "
                         "network between is yours")


def prune_cache(directory: Path, *, max_age_s: float, max_bytes: int, now: float | None = None) -> None:
    """Delete the cached calls in ``directory`` older than ``max_age_s``, then the oldest until the rest hold at
    most ``max_bytes``."""
    now = time.time() if now is None else now
    entries = []
    for path in directory.glob("*/*.json"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # another client pruned it
            continue
        if now - stat.st_mtime > max_age_s:
            path.unlink(missing_ok=True)
        else:
            entries.append((stat.st_mtime, stat.st_size, path))
    held = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):
        if held <= max_bytes:
            break
        path.unlink(missing_ok=True)
        held -= size



class ChatClient:
    """Chat completions from one model behind an OpenAI-compatible endpoint (thread-safe).

    Args:
        base_url: the endpoint, e.g. ``http://127.0.0.1:8080/v1``.
        model: the model name the endpoint serves.
        api_key_env: the environment variable holding the key (local servers accept any key; unset means
            ``"not-needed"``).
        cache_dir: where calls are cached (default ``$COVEIL_CACHE_DIR/llm-calls``); ``None`` disables it.
        max_retries: attempts after the first for a transient failure.
        backoff_s: the first retry's wait, doubled at each further one.
        timeout_s: one request's time limit.
        requests_per_minute: the most requests sent in any minute, retries included, over all threads (``None``:
            no limit); they start at least ``60 / requests_per_minute`` seconds apart.
        allow_insecure_http: allow ``http://`` to a host other than loopback (:func:`check_transport`).
        cache_max_age_s, cache_max_bytes: the cache's bounds (:func:`prune_cache`, applied when the client opens it).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        cache_dir: str | Path | None = "default",
        max_retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 120.0,
        requests_per_minute: float | None = None,
        allow_insecure_http: bool = False,
        cache_max_age_s: float = CACHE_MAX_AGE_S,
        cache_max_bytes: int = CACHE_MAX_BYTES,
    ) -> None:
        import openai

        if requests_per_minute is not None and requests_per_minute <= 0:
            raise ValueError(f"requests_per_minute must be positive, got {requests_per_minute}")
        check_transport(base_url, allow_insecure_http=allow_insecure_http)
        self.model = model
        self.base_url = base_url
        self.cache_dir = default_cache_dir() if cache_dir == "default" else (Path(cache_dir) if cache_dir else None)
        self.cache_max_age_s = cache_max_age_s
        if self.cache_dir is not None:
            private_dir(self.cache_dir).chmod(DIR_MODE)  # the cache is ours: one an older version made is narrowed
            for folder in self.cache_dir.iterdir():
                if folder.is_dir():
                    folder.chmod(DIR_MODE)
            prune_cache(self.cache_dir, max_age_s=cache_max_age_s, max_bytes=cache_max_bytes)
        self.max_retries, self.backoff_s, self.timeout_s = max_retries, backoff_s, timeout_s
        self.calls = 0  # requests that reached the endpoint (cache hits do not count)
        self._calls_lock = threading.Lock()  # complete() may run in several threads at once
        self._interval_s = 60.0 / requests_per_minute if requests_per_minute else 0.0
        self._next_start = 0.0  # time.monotonic() before which no request may start (under _calls_lock)
        self._openai = openai
        self._client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "not-needed",
                                     timeout=timeout_s, max_retries=0)

    def request_key(self, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any]) -> str:
        """The digest a call is cached under: model, messages and parameters, canonical JSON."""
        body = {"model": self.model, "messages": list(messages), "params": dict(params)}
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def complete(self, messages: Sequence[Mapping[str, str]], **params: Any) -> str:
        """The assistant's reply to ``messages`` (from the cache when this exact request was made before)."""
        key = self.request_key(messages, params)
        cached = self._cache_path(key)
        if cached is not None and cached.is_file() and time.time() - cached.stat().st_mtime <= self.cache_max_age_s:
            return json.loads(cached.read_text(encoding="utf-8"))["reply"]
        reply = self._call_with_retries(messages, params)
        if cached is not None:
            private_dir(cached.parent).chmod(DIR_MODE)
            fd, staging = tempfile.mkstemp(prefix=cached.name + ".", dir=cached.parent)  # 0600
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump({"model": self.model, "messages": list(messages), "params": params, "reply": reply}, out,
                          ensure_ascii=False)
            os.replace(staging, cached)
        return reply

    def _cache_path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / key[:2] / f"{key}.json"

    def _call_with_retries(self, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any]) -> str:
        transient = (self._openai.APIConnectionError, self._openai.APITimeoutError, self._openai.RateLimitError,
                     self._openai.InternalServerError)
        for attempt in range(self.max_retries + 1):
            try:
                self._wait_for_turn()
                with self._calls_lock:
                    self.calls += 1
                response = self._client.chat.completions.create(model=self.model, messages=list(messages), **params)
                return _content(response)
            except transient as exc:
                if attempt == self.max_retries:
                    raise
                time.sleep(max(self.backoff_s * 2**attempt, retry_after_s(exc)))
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait_for_turn(self) -> None:
        """Sleep until this request may start: each start is ``60 / requests_per_minute`` s after the one before."""
        if not self._interval_s:
            return
        with self._calls_lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + self._interval_s
        time.sleep(start - now)


def _content(response: Any) -> str:
    """The first choice's text (``""`` for none); ``EndpointReplyError`` for a reply that is not a completion."""
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list) or not choices or getattr(choices[0], "message", None) is None:
        raise EndpointReplyError("the endpoint answered without a chat completion (no choices[0].message); is "
                                 "--endpoint an OpenAI-compatible /v1 URL?")
    return choices[0].message.content or ""


#: the longest ``Retry-After`` honoured (a server asking for more is waited on this long, then asked again)
MAX_RETRY_AFTER_S = 120.0


def retry_after_s(exc: Exception) -> float:
    """The wait a rate-limited (or busy) endpoint asked for in its ``Retry-After`` header, in seconds (0 if none).

    Only the delay-seconds form is read (what OpenAI, vLLM and most gateways send); an HTTP date counts as none.
    """
    response = getattr(exc, "response", None)
    value = None if response is None else response.headers.get("retry-after")
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S) if value is not None else 0.0
    except ValueError:
        return 0.0
