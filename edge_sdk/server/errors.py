"""Errors as the OpenAI API gives them: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``.

The cloud's gRPC statuses map to what an app can act on:

=====================================================  ======  ========================  ========================
cloud status                                           HTTP    type                      code
=====================================================  ======  ========================  ========================
UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED              503     service_unavailable       cloud_unavailable
RESOURCE_EXHAUSTED (the adapter's session quota)       429     insufficient_quota        cloud_quota_exhausted
INVALID_ARGUMENT, OUT_OF_RANGE (a limit of the cloud)  400     invalid_request_error     cloud_rejected_request
UNAUTHENTICATED, PERMISSION_DENIED                     502     api_error                 cloud_auth_failed
FAILED_PRECONDITION (the two models do not fit)        502     api_error                 model_mismatch
anything else (INTERNAL, DATA_LOSS, ABORTED, ...)      502     api_error                 cloud_error
the edge's check of the cloud's reply failed           502     api_error                 cloud_reply_rejected
=====================================================  ======  ========================  ========================

The endpoint's own: bad parameters 400 (``invalid_request_error``), a prompt
longer than the context window 400 (``context_length_exceeded``), an unknown
model 404 (``model_not_found``), a missing or wrong API key 401
(``invalid_api_key``), a full queue 429 (``rate_limit_exceeded``).  Error
messages name what is wrong, never the request's text; a 429 carries
``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from edge_sdk.server.openai.protocol import ErrorDetail, ErrorResponse
from edge_sdk.protocol.status import CloudError, CloudReplyRejected


class EndpointError(Exception):
    """A request the endpoint answers with an OpenAI-style error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        """``Retry-After`` where the request may be retried as it is (a 429)."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def renamed(error: EndpointError, names: Mapping[str, str]) -> EndpointError:
    """``error`` with the parameter it names spelt as another API spells it (``names``: the OpenAI chat request's
    name -> the dialect's), in ``param`` and at the head of the message."""
    name = names.get(error.param or "")
    if name is None:
        return error
    message = name + error.message[len(error.param):] if error.message.startswith(error.param) else error.message
    return EndpointError(error.status, message, type=error.type, param=name, code=error.code,
                         retry_after_s=error.retry_after_s)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> EndpointError:
    return EndpointError(400, message, param=param, code=code)


#: gRPC status name -> (HTTP status, error type, error code)
_CLOUD_STATUSES: dict[str, tuple[int, str, str]] = {
    "UNAVAILABLE": (503, "service_unavailable", "cloud_unavailable"),
    "DEADLINE_EXCEEDED": (503, "service_unavailable", "cloud_unavailable"),
    "CANCELLED": (503, "service_unavailable", "cloud_unavailable"),
    "RESOURCE_EXHAUSTED": (429, "insufficient_quota", "cloud_quota_exhausted"),
    "INVALID_ARGUMENT": (400, "invalid_request_error", "cloud_rejected_request"),
    "OUT_OF_RANGE": (400, "invalid_request_error", "cloud_rejected_request"),
    "UNAUTHENTICATED": (502, "api_error", "cloud_auth_failed"),
    "PERMISSION_DENIED": (502, "api_error", "cloud_auth_failed"),
    "FAILED_PRECONDITION": (502, "api_error", "model_mismatch"),
}

_CLOUD_HINTS = {
    "cloud_unavailable": "the cloud adapter cannot be reached; retry later",
    "cloud_quota_exhausted": "the cloud adapter is at its session limit for this device; retry later",
    "cloud_rejected_request": "the cloud adapter refused the request",
    "cloud_auth_failed": "the cloud adapter refused this endpoint's credentials (check --token-file, --tls-ca)",
    "model_mismatch": "the edge and cloud models do not fit together",
    "cloud_error": "the cloud adapter ended the session",
}


#: a 429's ``Retry-After``: the queue frees a place when a generation ends, the adapter a session when one closes
#: (seconds, not minutes); the openai client waits this long before its retry
RETRY_AFTER_S = 1


def from_cloud_error(exc: CloudError) -> EndpointError:
    """The OpenAI-style error for a failed cloud session: a fixed message per status.  The adapter's own text
    is not passed on: the cloud chooses it, and an app would show it to its user as the endpoint's word.  Where
    the edge's own check of the cloud's reply failed (:class:`CloudReplyRejected`), the error says the edge
    ended the session, and why (the edge's message: a public token id, never text)."""
    if isinstance(exc, CloudReplyRejected):
        return EndpointError(502, f"the edge ended the session: its check of the cloud's reply failed: "
                             f"{exc.message} ({exc.code})", type="api_error", code="cloud_reply_rejected")
    status, kind, code = _CLOUD_STATUSES.get(exc.code, (502, "api_error", "cloud_error"))
    return EndpointError(status, f"{_CLOUD_HINTS[code]} ({exc.code})", type=kind, code=code,
                         retry_after_s=RETRY_AFTER_S if status == 429 else None)


#: why a field the endpoint does not know is refused (the allowlist of :mod:`edge_sdk.server.openai.protocol`)
UNKNOWN_FIELD = ("unknown field, refused rather than ignored (an ignored privacy marker would send text to the "
                 "cloud): the private part goes in 'coveil', a private message or text part is marked "
                 "'coveil_private': true")


def validation_message(errors: Iterable[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A request's schema errors (pydantic's ``errors()``) as one line, ``where: what`` per problem, and the first
    problem's place; never the offending value (it may be private text)."""
    problems, first = [], None
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        first = first or where or None
        what = UNKNOWN_FIELD if error.get("type") == "extra_forbidden" else error.get("msg", "invalid")
        problems.append(f"{where or 'body'}: {what}")
    return "; ".join(problems) or "invalid request", first
