"""The activity log: one record per generation, exported as JSON from the SDK, bounded, private on disk; and the
words next to every epsilon (the odds, or a heuristic's counts)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.privacy.accountant import PrivacyAccountant, odds_factor
from edge_sdk.activity import ActivityLog
from edge_sdk.client import EdgeClient
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.policies import CoVeil, DPFusion, DPLogit
from edge_sdk.testing import ScriptedCloud, TableSLM

CANARY = "Marisol"
PIECES = ["<eos>", " the", " liver", " heart", ".", "\n\n", CANARY, " " + CANARY]


def entry(step: int, *, values: int, steered: bool, signal: str = "upload") -> LedgerEntry:
    return LedgerEntry(step=step, token_id=1, policy="p", signal=signal, values_uploaded=values, full_requested=False,
                       withheld=False, steered=steered, bytes_up=10 + values, bytes_down=40, leak_share=0.0,
                       edge_ms=1.0, wait_ms=1.0, cloud_forward_ms=0.0)


def heuristic_ledger() -> PrivacyLedger:
    """Five cloud-side steps of a heuristic, three steered (2, 0 and 3 values: an empty upload never steers)."""
    accountant = PrivacyAccountant(CoVeil().release_event("cloud"))
    ledger = PrivacyLedger(mode="cloud", policy="coveil(lam=1.0)", accountant=accountant, session_ids=["s-1", "s-2"])
    for step, values in enumerate([2, 0, 1, 0, 3]):
        ledger.entries.append(entry(step, values=values, steered=values > 0))
        accountant.record(step, steered=values > 0)
    return ledger


@pytest.mark.parametrize(("epsilon", "words"), [(0.0, "1"), (0.01, "1.01"), (0.1, "1.1"), (1.0, "2.7"),
                                                 (10.0, "22,000"), (64.0, "6.2 × 10^27")])
def test_the_odds_next_to_an_epsilon(epsilon: float, words: str) -> None:
    # by hand: e^0.01 = 1.01005, e^0.1 = 1.105, e = 2.718, e^10 = 22,026, e^64 = 6.24e27
    assert odds_factor(epsilon) == words


def test_a_heuristic_is_told_in_counts_and_a_dp_policy_in_odds() -> None:
    ledger = heuristic_ledger()
    assert ledger.revealed() == (3, 6)
    assert ledger.privacy()["in_words"] == ("no DP guarantee (a heuristic): 3 of 5 steps revealed 6 values decided "
                                            "by your private context")
    accountant = PrivacyAccountant(DPLogit(epsilon=1.0).release_event("cloud"))
    dp = PrivacyLedger(mode="cloud", policy="dp_logit", accountant=accountant)
    dp.entries.append(entry(0, values=100, steered=True))
    accountant.record(0, steered=True)
    words = dp.privacy()["in_words"]
    assert words.startswith("whoever sees what left the device is at most 2.7 times more likely to tell your "
                            "context from any other, except with probability 1e-05")
    assert dp.summary().endswith(words) and heuristic_ledger().summary().endswith("decided by your private context")


def test_a_record_holds_what_was_sent_and_spent_and_nothing_private() -> None:
    ledger = heuristic_ledger()
    record = ActivityLog().record(ledger, finish_reason="stop")
    assert (record["mode"], record["policy"], record["finish_reason"]) == ("cloud", "coveil(lam=1.0)", "stop")
    assert (record["steps"], record["steps_revealed"], record["values_revealed"]) == (5, 3, 6)
    assert (record["bytes_up"], record["bytes_down"], record["values_uploaded"]) == (56, 200, 6)
    assert record["guarantee"] == "non-private" and record["epsilon"] is None and record["relation"] is None
    assert record["session_ids"] == ["s-1", "s-2"]
    assert record["when"].endswith("+00:00")
    json.dumps(record)  # JSON-ready


def test_the_log_is_bounded_and_private_on_disk_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "made" / "activity.jsonl"
    previous = os.umask(0o022)
    try:
        log = ActivityLog(limit=3, path=path)
        for _ in range(10):
            log.record(heuristic_ledger(), finish_reason="stop")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert len(log.entries()) == 3
    lines = path.read_text().splitlines()
    assert 3 <= len(lines) < 6  # compacted to the newest 3 once it holds 6
    assert not list(tmp_path.glob("made/*.partial"))
    # read back: the newest three, a file someone widened narrowed again
    path.chmod(0o644)
    again = ActivityLog(limit=3, path=path)
    assert again.entries() == [json.loads(line) for line in lines[-3:]]
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="activity log limit"):
        ActivityLog(limit=0)


def scripted_client() -> EdgeClient:
    slm = TableSLM(PIECES, {(1,): np.log([0.05, 0.05, 0.7, 0.05, 0.05, 0.04, 0.03, 0.03])}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), [np.log([0.1, 0.45, 0.2, 0.1, 0.1, 0.03, 0.01, 0.01])] * 4, eos_ids={0})
    return EdgeClient(cloud.session, slm=slm)


def test_the_client_keeps_one_record_per_generation_and_exports_it_as_json() -> None:
    client = scripted_client()
    first = client.generate(" the", f"{CANARY} liver", mode="cloud", policy=CoVeil(lam=0.0), max_new_tokens=3)
    second = client.generate(" the", f"{CANARY} liver", mode="edge", policy=DPFusion(epsilon=1.0), max_new_tokens=2,
                             rng=np.random.default_rng(0))
    activity = client.activity()
    assert [record["mode"] for record in activity] == ["cloud", "edge"]
    assert activity[0]["steps"] == len(first.ledger.entries) and activity[0]["bytes_up"] == first.ledger.bytes_up
    assert activity[0]["session_ids"] == first.ledger.session_ids and activity[0]["session_ids"]
    dp = activity[1]
    assert dp["epsilon"] == pytest.approx(second.ledger.privacy()["epsilon_spent"])
    # hand: two tokens at eps = 1 per token, order 2: 2 + log(1/2) + log(1e5) - log 2
    assert dp["epsilon"] == pytest.approx(2 + math.log(1e5) - 2 * math.log(2))
    assert (dp["relation"], dp["delta"]) == ("any two private contexts", 1e-5)
    assert "weaker" in dp["source_relation"]["relation"] and dp["tokens_synced"] == 2
    exported = client.activity_log.export()
    assert json.loads(exported) == {"activity": activity}
    assert CANARY not in exported and "liver" not in exported  # neither the private context nor the answer


def test_the_endpoint_exports_the_activity_log_behind_its_key() -> None:
    """``GET /v1/coveil/activity``: the client's records as a JSON download, 401 without the key."""
    import urllib.error
    import urllib.request

    from edge_sdk.server.app import create_app, running
    from edge_sdk.server.settings import ServerSettings

    client = scripted_client()
    client.generate(" the", f"{CANARY} liver", mode="cloud", policy=CoVeil(lam=0.0), max_new_tokens=2)
    app = create_app(ServerSettings(cloud="c:1"), client=client, chat_template=None, n_ctx=64, api_key="activity-key")
    with running(app) as base_url:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base_url + "/v1/coveil/activity", timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(base_url + "/v1/coveil/activity",
                                         headers={"Authorization": "Bearer activity-key"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.headers["Content-Type"] == "application/json"
            assert "attachment" in response.headers["Content-Disposition"]
            body = json.loads(response.read())
    assert body == {"activity": client.activity()} and len(body["activity"]) == 1
