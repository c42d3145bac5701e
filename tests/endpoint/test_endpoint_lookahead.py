"""The endpoint takes a request's run-ahead depth (``coveil.lookahead``, over the server's ``--lookahead``), on the
fakes: read off the open the edge sends; a bad one is a 400 naming it and sends nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from fastapi.testclient import TestClient

from edge_sdk.client import EdgeClient
from edge_sdk.server.app import create_app
from edge_sdk.server.settings import ServerSettings
from edge_sdk.testing import ScriptedCloud, TableSLM

PIECES = ["<eos>", " a", " b", " c", "q", "n", "\n", " "]
ROW = np.log([0.05, 0.5, 0.2, 0.1, 0.1, 0.03, 0.01, 0.01])


class Concatenated:
    """A chat template for the table's pieces: the messages' text, one after the other."""

    stops = ()

    def __init__(self, slm: TableSLM) -> None:
        self.slm = slm

    def render(self, messages: Sequence[dict]) -> list[int]:
        return self.slm.tokenize("".join(m["content"] for m in messages), add_bos=False)


def test_a_request_s_lookahead_wins_over_the_server_s() -> None:
    slm = TableSLM(PIECES, {(): ROW}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), [ROW] * 4, eos_ids={0}, max_lookahead=8)
    app = create_app(ServerSettings(cloud="in-process", lookahead=4), client=EdgeClient(cloud.session, slm=slm,
                                                                                         lookahead=4),
                     chat_template=Concatenated(slm), n_ctx=64)
    chat = {"model": "coveil", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
    with TestClient(app, base_url="http://127.0.0.1") as http:
        default = http.post("/v1/chat/completions", json=chat)
        lockstep = http.post("/v1/chat/completions", json={**chat, "coveil": {"lookahead": 0}})
        two = http.post("/v1/chat/completions", json={**chat, "coveil": {"lookahead": 2}})
        opens = [m.open.lookahead for m in cloud.edge_messages() if m.WhichOneof("kind") == "open"]
        negative = http.post("/v1/chat/completions", json={**chat, "coveil": {"lookahead": -1}})
        fraction = http.post("/v1/chat/completions", json={**chat, "coveil": {"lookahead": 1.5}})
    assert [r.status_code for r in (default, lockstep, two)] == [200, 200, 200], default.text
    assert opens == [4, 0, 2]
    for refused in (negative, fraction):
        assert refused.status_code == 400 and "lookahead" in refused.json()["error"]["param"], refused.text
    assert len(cloud.edge_messages()) == len(opens) + 3 * 2  # each served request: its open and 2 signals, no more
