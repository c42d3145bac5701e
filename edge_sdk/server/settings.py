"""Every option of the endpoint, with its default, written once: ``coveil edge serve`` builds its flags from here.

Each field's ``metadata`` holds its ``--help`` text (and the flag's ``metavar``
or ``choices`` where it has them); :func:`add_settings_flags` turns the fields
into flags and :func:`settings_from_args` reads them back.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk.cli_flags import add_dataclass_flags, dataclass_from_args, flag_name, positive_float, positive_float_or_auto
from edge_sdk.client import Credentials
from edge_sdk.protocol.channels import is_loopback
from edge_sdk.decode_settings import AUTO, DecodeSettings
from edge_sdk.protocol.signals import FUSION_MODES
from edge_sdk.protocol.wire import MAX_LOOKAHEAD

#: the longest public clock (pace, prefill budget) the endpoint takes, in ms: its one worker sleeps on it
MAX_CLOCK_MS = 60_000.0

#: the environment variable an API key may come from instead of ``--api-key-file``
API_KEY_ENV = "COVEIL_API_KEY"

#: what a request that marks nothing gets (stated in ``--help`` and the README)
UNMARKED_REQUESTS = (
    "A request without a 'coveil' field is a public query like any to an OpenAI endpoint (every message goes to "
    "the cloud) and is decoded with the defaults below: CoVeil (lam=1.0) in cloud-side fusion, the lowest "
    "leakage of the defences measured here, so the same app turns private as soon as it passes "
    "extra_body={'coveil': {'private_context': ...}}, or as soon as the server is started with "
    "--private-context-file (then every request of the run is conditioned on that file, a request's own "
    "private context replacing it). The undefended baseline runs only when named."
)


def _option(default: Any, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ServerSettings:
    """The endpoint's options (every field is a ``coveil edge serve`` flag: ``--cloud``, ``--max-queue`` ...)."""

    # -- the cloud adapter
    cloud: str = _option("", "the cloud adapter's HOST:PORT (several replicas: comma-separated ip:port)",
                         metavar="HOST:PORT", required=True)
    token_file: Path | None = _option(None, "file holding the bearer token the cloud adapter expects",
                                      metavar="FILE", type=Path)
    tls_ca: Path | None = _option(None, "CA certificate (PEM) of the adapter's TLS (default: the system's roots)",
                                  metavar="PEM", type=Path)
    plaintext: bool = _option(False, "talk to the adapter without TLS (accepted for a loopback --cloud only)")
    lookahead: int = _option(
        MAX_LOOKAHEAD, "deepest run-ahead accepted: rows the adapter drafts past the last confirmed token so a "
        "token does not wait a round trip (the adapter adapts the depth to the link); 0 = lockstep. What the edge "
        "sends is the same either way; a request's coveil.lookahead wins for that request", metavar="N", type=int)
    # -- the edge model
    model: str | None = _option(None, "the edge SLM: a .gguf path (default: the embedded Gemma-3 270M)",
                                metavar="GGUF")
    chat_template: str | None = _option(
        None, "chat template: a Jinja file or a llama.cpp built-in name (default: the GGUF's own, else llama.cpp's "
        "built-in one for its architecture)", metavar="FILE|NAME")
    n_ctx: int = _option(4096, "the SLM's context window in tokens (private context + conversation + reply)",
                         metavar="N", type=int)
    threads: int | None = _option(None, "llama.cpp threads (default: every core, at most 8)", metavar="N", type=int)
    # -- the HTTP side
    host: str = _option("127.0.0.1", "interface to listen on; anything but loopback needs an API key",
                        metavar="HOST")
    port: int = _option(8000, "TCP port (0 picks a free one)", metavar="PORT", type=int)
    api_key_file: Path | None = _option(
        None, f"file holding the API key apps must send (Authorization: Bearer KEY); default: ${API_KEY_ENV}",
        metavar="FILE", type=Path)
    ssl_certfile: Path | None = _option(None, "serve HTTPS with this certificate chain (PEM)", metavar="PEM",
                                        type=Path)
    ssl_keyfile: Path | None = _option(None, "the private key of --ssl-certfile (PEM)", metavar="PEM", type=Path)
    activity_log: Path | None = _option(
        None, "keep the activity log (GET /v1/coveil/activity, the page's Export) in this private file across "
        "restarts, the newest 1,000 requests (default: in memory only)", metavar="FILE", type=Path)
    max_request_bytes: int = _option(
        256 * 1024, "largest request body read, in bytes (413 beyond; a context window's text is far smaller, and "
        "a body is refused before it is parsed or tokenised)", metavar="BYTES", type=int)
    served_model_name: str = _option("coveil", "the model id apps name in requests and /v1/models lists",
                                     metavar="NAME")
    # -- what a request gets unless it says otherwise
    default_mode: str = _option(DecodeSettings.mode, "fusion mode of a request that names none",
                                choices=list(FUSION_MODES))
    default_policy: str = _option("coveil", "policy of a request that names none (its parameters: the policy's "
                                  "defaults, CoVeil lam=1.0)", metavar="NAME")
    default_max_tokens: int = _option(DecodeSettings.max_new_tokens, "reply length of a request that sets no max_tokens (never beyond the "
                                      "context window)", metavar="N", type=int)
    pace_ms: float | str | None = _option(
        None, "pace of a request that sets no coveil.pace_ms: each step's signal leaves on a public grid of this many "
        "ms ('auto': measured once on a public prompt at start)", metavar="MS|auto", type=positive_float_or_auto)
    prefill_budget_ms: float | None = _option(
        None, "prefill budget of a request that sets no coveil.prefill_budget_ms: each session opens on a public "
        "grid of this many ms, and a scored prompt (echo with logprobs) is answered on it; set it above the longest "
        "prefill, and for lm-eval, whose requests cannot carry coveil", metavar="MS", type=positive_float)
    private_context_file: Path | None = _option(
        None, "a private context for the whole run: every request that brings no coveil.private_context of its own "
        "is conditioned on this file's text (for apps that cannot send the coveil field, such as lm-eval); read once "
        "at start, on the device only, never logged nor quoted in an error", metavar="FILE", type=Path)
    max_queue: int = _option(16, "requests that may wait for the one SLM; beyond that the answer is 429",
                             metavar="N", type=int)
    log_level: str = _option("INFO", "least severe level logged (no log line ever carries text or token ids)",
                             choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def __post_init__(self) -> None:
        if not self.cloud:
            raise ValueError("give the cloud adapter's address (--cloud HOST:PORT)")
        for name in ("n_ctx", "default_max_tokens", "max_queue", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port}")
        if self.plaintext and not all(is_loopback(address) for address in self.cloud_addresses):
            raise ValueError(f"--plaintext is accepted for a loopback --cloud only, got {self.cloud}: give the "
                             "adapter's CA (--tls-ca) or rely on the system's trust roots")
        if self.lookahead < 0:
            raise ValueError(f"--lookahead must be 0 (lockstep) or more, got {self.lookahead}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag_name(name)}: no such file: {path}")
        if self.private_context_file is not None and not Path(self.private_context_file).is_file():
            raise ValueError(f"--private-context-file: no such file: {self.private_context_file}")
        for name in ("pace_ms", "prefill_budget_ms"):
            value = getattr(self, name)
            if value is not None and value != AUTO and not 0 < value <= MAX_CLOCK_MS:
                raise ValueError(f"{flag_name(name)} must be in (0, {MAX_CLOCK_MS:g}] ms, got {value}")
        if self.default_mode not in FUSION_MODES:
            raise ValueError(f"--default-mode is 'cloud' or 'edge', got {self.default_mode!r}")

    @property
    def cloud_addresses(self) -> list[str]:
        return [part.strip() for part in self.cloud.split(",") if part.strip()]

    def credentials(self) -> Credentials:
        """How to reach the cloud adapter (TLS unless ``plaintext``, which only a loopback address accepts)."""
        return Credentials.from_files(token_file=self.token_file, root_cert=self.tls_ca, plaintext=self.plaintext)

    def api_key(self) -> str | None:
        """The key apps must present: ``api_key_file``'s content, else ``$COVEIL_API_KEY``, else none."""
        if self.api_key_file is not None:
            key = self.api_key_file.read_text().strip()
            if not key:
                raise ValueError(f"API key file {self.api_key_file} is empty")
            return key
        return os.environ.get(API_KEY_ENV, "").strip() or None

    def run_private_context(self) -> str:
        """The run's private context: ``private_context_file``'s text (stripped), or ``""`` without one.  An error
        names the file and the flag, never the text."""
        if self.private_context_file is None:
            return ""
        try:
            text = Path(self.private_context_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--private-context-file: cannot read {self.private_context_file}: {exc.strerror}") \
                from None
        except UnicodeDecodeError:
            raise ValueError(f"--private-context-file: {self.private_context_file} is not UTF-8 text") from None
        if not text:
            raise ValueError(f"--private-context-file: {self.private_context_file} is empty")
        return text

    def check_exposure(self, api_key: str | None) -> None:
        """Refuse to listen beyond loopback without an API key of the endpoint's own."""
        if not is_loopback(self.host) and api_key is None:
            raise ValueError(
                f"refusing to listen on {self.host} without an API key: every app on the network could decode with "
                f"this device's private context; pass --api-key-file (or set ${API_KEY_ENV}), or keep the default "
                "--host 127.0.0.1"
            )

    def cleartext_warning(self) -> str | None:
        """Beyond loopback without HTTPS, requests cross the network readable: say so (a TLS proxy in front may
        be why; then the warning is moot)."""
        if is_loopback(self.host) or self.ssl_certfile is not None:
            return None
        return (f"listening on {self.host} over plain HTTP: requests carry their private contexts and the API key "
                "in clear across the network; give --ssl-certfile/--ssl-keyfile unless a TLS proxy fronts this")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`ServerSettings` field, its default and help taken from the field."""
    groups = {
        "cloud": parser.add_argument_group("the cloud adapter"),
        "model": parser.add_argument_group("the edge model"),
        "host": parser.add_argument_group("the HTTP endpoint"),
        "default_mode": parser.add_argument_group("defaults for requests",
                                                  description=textwrap.fill(UNMARKED_REQUESTS, 78)),
    }
    add_dataclass_flags(parser, ServerSettings, groups=groups)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return dataclass_from_args(ServerSettings, args)
