"""``coveil edge serve``: the flags (from :class:`~edge_sdk.server.settings.ServerSettings`) and the command.

The ``coveil`` command line mounts this under ``edge``; building the parser
imports neither FastAPI nor the model.
"""

from __future__ import annotations

import argparse
import textwrap

from edge_sdk.server.dialects import SERVED_DIALECTS
from edge_sdk.server.settings import add_settings_flags, settings_from_args

DESCRIPTION = (
    f"Serve on this device {', '.join(dialect.serves for dialect in SERVED_DIALECTS)}, and a live page at GET /. "
    "Embeddings never reach the cloud. The edge SLM reads the private context, the cloud adapter "
    "(--cloud) only the public messages; apps pass the private part as extra_body={'coveil': {'private_context': "
    "..., 'mode': 'edge'|'cloud', 'policy': ..., 'params': {...}, 'exposure_budget': ..., 'max_epsilon': ..., 'never_upload': [...]}} "
    "or mark a message or a text part with 'coveil_private': true (an unknown field is a 400, never ignored). "
    "Listens on loopback unless --host is given, and then only with an API key, which then guards every path "
    "(open the page as /?key=KEY). Unmarked requests: see 'defaults for requests' below."
)

EPILOG = """example:
  coveil edge serve --cloud cloud.example:50051 --token-file token.txt --tls-ca ca.pem
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
    print(c.chat.completions.create(model='coveil', messages=[{'role': 'user', 'content': 'Which diagnosis?'}],
          extra_body={'coveil': {'private_context': 'notes ...'}}).choices[0].message.content)"
"""


def add_serve_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to a sub-command group (``coveil edge``)."""
    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible private endpoint on this device, with a live page of what leaves it",
        description=textwrap.fill(DESCRIPTION, 100),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(serve)
    return serve


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (a bad setting raises ``ValueError`` with one line naming the flag)."""
    from edge_sdk.server.app import serve

    serve(settings_from_args(args))
    return 0
