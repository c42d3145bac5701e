"""The endpoint on the fakes, for tests of request handling and HTTP shapes (no model, no server): ``create_app``
over an ``EdgeClient`` whose SLM is a :class:`~edge_sdk.testing.TableSLM` and whose cloud is a
:class:`~edge_sdk.testing.ScriptedCloud` (held to the real adapter's session byte for byte by
``tests/cloud_adapter/test_cloud_contract.py``), with a chat template that joins the messages' text.

Serve it with ``fastapi.testclient.TestClient(app, base_url="http://127.0.0.1")``; ``cloud.edge_messages()`` is
what the edge sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from edge_sdk.client import EdgeClient
from edge_sdk.server.app import create_app
from edge_sdk.server.settings import ServerSettings
from edge_sdk.testing import ScriptedCloud, TableSLM

#: the vocabulary: an end id, three words, and the pieces a question ("q"), private notes ("n") and the
#: template's separators are written in
PIECES = ["<eos>", " a", " b", " c", "q", "n", "\n", " "]
#: the row both fakes give at every step unless told otherwise (" a" first)
ROW = np.log([0.05, 0.5, 0.2, 0.1, 0.1, 0.03, 0.01, 0.01])


class Concatenated:
    """A chat template for the table's pieces: the messages' text, one after the other."""

    stops = ()

    def __init__(self, slm: TableSLM) -> None:
        self.slm = slm

    def render(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.slm.tokenize("".join(m["content"] for m in messages), add_bos=False)


def fake_endpoint(*, lookahead: int = 0, max_lookahead: int = 0, n_ctx: int = 64,
                  **settings: Any) -> tuple[Any, ScriptedCloud]:
    """The app and its cloud; ``lookahead``: the server's (and its client's) run-ahead depth, ``max_lookahead`` the
    cloud's cap, ``settings`` further :class:`~edge_sdk.server.settings.ServerSettings` fields."""
    slm = TableSLM(PIECES, {(): ROW}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), default=ROW, eos_ids={0}, max_lookahead=max_lookahead)
    app = create_app(ServerSettings(cloud="in-process", lookahead=lookahead, **settings),
                     client=EdgeClient(cloud.session, slm=slm, lookahead=lookahead),
                     chat_template=Concatenated(slm), n_ctx=n_ctx)
    return app, cloud
