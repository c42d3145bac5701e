"""The endpoint takes a request's run-ahead depth (``coveil.lookahead``, over the server's ``--lookahead``), on the
fakes: read off the open the edge sends; a bad one is a 400 naming it and sends nothing."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.support.fake_endpoint import fake_endpoint


def test_a_request_s_lookahead_wins_over_the_server_s() -> None:
    app, cloud = fake_endpoint(lookahead=4, max_lookahead=8)
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
