"""The live page in a real headless Chromium (Selenium with the system's chromium and chromedriver), in front of
the endpoint and a real cloud adapter: ask a question with a private context, wait for the stream to end, and
check the coloured tokens, the meter and the ledger against the same generation through the SDK.

Without a browser the test is skipped with its reason, unless ``COVEIL_REQUIRE_BROWSER`` is set (``.ci/run``
installs chromium and chromium-driver and sets it): then it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_sdk.policies import CoVeil
from edge_sdk.prompts import chat_prompts

from tests.support.browser import headless_chromium
from tests.support.endpoint_stack import (
    CANARY,
    PRIVATE_CONTEXT,
    QUESTION,
    Cloud,
    Endpoint,
    generate_as_the_endpoint,
    start_endpoint,
)

pytestmark = pytest.mark.model

By_TAG = "tag name"  # selenium's By.TAG_NAME (selenium is imported inside the tests: it may be missing)

TOKENS = 8


def band_of(element) -> str:
    return next(name for name in element.get_attribute("class").split() if name.startswith("left-"))


def expected_band(values_left: int) -> str:
    """Worked by hand from the legend: nothing, 1 value, 2-100, 101-10,000, more."""
    for band, most in enumerate((0, 1, 100, 10_000)):
        if values_left <= most:
            return f"left-{band}"
    return "left-4"


def exact(row, column: int) -> int:
    return int(row.find_elements(By_TAG, "td")[column].get_attribute("data-value"))


def readable_bytes(n: int) -> str:
    """1 KB = 1,024 B, one decimal, no trailing zero: 950 -> '950 B', 12,800 -> '12.5 KB', 2,048 -> '2 KB'."""
    if n < 1024:
        return f"{n:,} B"
    value, unit = (n / 1024, "KB") if n < 1024**2 else (n / 1024**2, "MB")
    return f"{round(value, 1):,g} {unit}"


@pytest.fixture(scope="module")
def endpoint(cloud: Cloud, slm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """The endpoint in lockstep: the page's byte counts are checked against the same generation through the SDK,
    and under run-ahead how many drafted rows arrive before a generation ends depends on timing."""
    with start_endpoint(cloud.address, slm, tmp_path_factory.mktemp("endpoint"), lookahead=0) as started:
        yield started


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    with headless_chromium(tmp_path / "profile") as driver:
        yield driver


def test_the_page_colours_each_token_by_what_the_cloud_saw(endpoint: Endpoint, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(endpoint.base_url + "/")
    wait = WebDriverWait(browser, 300)
    wait.until(lambda b: len(Select(b.find_element(By.ID, "policy")).options) > 1)  # /coveil/info answered
    browser.find_element(By.ID, "question").send_keys(QUESTION)
    browser.find_element(By.ID, "private-context").send_keys(PRIVATE_CONTEXT)
    Select(browser.find_element(By.ID, "mode")).select_by_value("cloud")
    Select(browser.find_element(By.ID, "policy")).select_by_value("coveil")
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(TOKENS))
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda b: b.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
    status = browser.find_element(By.ID, "status")
    assert status.get_attribute("data-state") == "done", status.text
    screenshot = tmp_path / "live_page.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000

    # the same generation through the SDK
    prompts = chat_prompts(endpoint.template, [{"role": "user", "content": QUESTION}], PRIVATE_CONTEXT)
    expected, shown = generate_as_the_endpoint(endpoint, prompts, mode="cloud", policy=CoVeil(lam=1.0),
                                               max_new_tokens=TOKENS)
    # a token whose text a stop string cut (it starts at or past the end of the text shown) has no row: the
    # page shows the reply's tokens; the summary still counts every step (the cloud saw them all)
    every_entry = expected.ledger.entries
    tokens = expected.token_ids
    entries = [entry for k, entry in enumerate(every_entry)
               if len(endpoint.client.slm.detokenize(tokens[:k])) < len(shown)]

    spans = browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")
    assert "".join(span.get_attribute("textContent") for span in spans) == shown
    assert [int(span.get_attribute("data-step")) for span in spans] == list(range(len(entries)))
    # cloud-side fusion: the colour says how many values left at the step (0, 1, 2-100, ...), the outline a
    # full-distribution request
    kinds = [span.get_attribute("data-saw") for span in spans]
    assert kinds == ["full" if e.full_requested else "upload" if e.values_uploaded else "nothing" for e in entries]
    assert [band_of(span) for span in spans] == [expected_band(e.values_uploaded) for e in entries]
    legend = {band_of(span): span.value_of_css_property("background-color")
              for span in browser.find_elements(By.CSS_SELECTOR, "#legend-left span.tok")}
    assert len(set(legend.values())) == 5  # five colours, one per band
    assert all(span.value_of_css_property("background-color") == legend[band_of(span)] for span in spans)

    rows = browser.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")
    assert len(rows) == len(entries)
    assert [exact(row, 3) for row in rows] == [e.values_uploaded for e in entries]
    summary = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#ledger tfoot td")]
    footer = browser.find_element(By.CSS_SELECTOR, "#ledger tfoot tr")
    assert summary[0] == f"{len(every_entry)} steps" and summary[1] in ("finish: length", "finish: stop")
    assert exact(footer, 3) == expected.ledger.values_uploaded
    assert exact(footer, 4) == expected.ledger.bytes_up
    assert summary[3] == f"{expected.ledger.values_uploaded:,}" and summary[4] == readable_bytes(exact(footer, 4))
    # bytes down: each Distribution carries the cloud's forward time as a varint (forward_ns), 3 or 4 bytes for
    # a forward of 16 us to 268 ms, so two runs of the same generation differ by up to a byte a step; the
    # footer is the per-step rows summed
    assert abs(exact(footer, 5) - expected.ledger.bytes_down) <= len(every_entry)
    cut = every_entry[len(rows):]  # their bytes, from the SDK's run of the same generation (a byte a step apart)
    assert abs(exact(footer, 5) - sum(exact(row, 5) for row in rows) - sum(e.bytes_down for e in cut)) <= len(cut)
    meter = browser.find_element(By.ID, "meter-value").text
    assert meter == summary[6] == f"{100 * expected.ledger.leak_share:.1f}%"
    # the meter says why it rose, at the first step that raised it
    why = browser.find_element(By.ID, "meter-why").text
    risen = [e.step for e in entries if e.leak_share > 0]
    assert (f"step {risen[0]}" in why and "counts as exposed whenever the private context holds it" in why) \
        if risen else why == ""
    # the line under the meter: CoVeil is a heuristic, its generation has no epsilon
    assert browser.find_element(By.ID, "epsilon-line").text.startswith("ε: non-private (coveil is a heuristic")
    assert CANARY not in browser.find_element(By.ID, "answer").get_attribute("textContent")


def ask_two_tokens(browser, endpoint: Endpoint, policy: str, *, max_epsilon: str = "", mode: str = "cloud",
                              params: str = "") -> None:
    """Ask the page the test question in ``mode``-side fusion (cloud-side unless told) with ``policy`` and
    ``params`` for 2 tokens; wait until it is done."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(endpoint.base_url + "/")
    wait = WebDriverWait(browser, 300)
    wait.until(lambda b: len(Select(b.find_element(By.ID, "policy")).options) > 1)
    browser.find_element(By.ID, "question").send_keys(QUESTION)
    browser.find_element(By.ID, "private-context").send_keys(PRIVATE_CONTEXT)
    Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
    Select(browser.find_element(By.ID, "policy")).select_by_value(policy)
    browser.find_element(By.ID, "params").send_keys(params)
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("2")
    browser.find_element(By.ID, "max-epsilon").send_keys(max_epsilon)
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda b: b.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "done"


def test_an_undefended_step_is_coloured_apart_from_a_coveil_one_of_the_same_kind(endpoint: Endpoint, browser,
                                                                                 tmp_path: Path) -> None:
    """Both upload cloud-side ("the cloud saw an upload"); the undefended one sends its 1,000 largest values at every
    step (a full upload is cut to that public size, issue 19's N18), shown in the 101-10,000 band with kilobytes,
    CoVeil's few values in a light one."""
    from selenium.webdriver.common.by import By

    ask_two_tokens(browser, endpoint, "undefended")
    browser.save_screenshot(str(tmp_path / "undefended.png"))
    spans = browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")
    assert [span.get_attribute("data-saw") for span in spans] == ["upload", "upload"]
    assert [int(span.get_attribute("data-values-left")) for span in spans] == [1000, 1000]
    assert {band_of(span) for span in spans} == {"left-3"}
    band = browser.find_element(By.CSS_SELECTOR, "#legend-left span.left-3").value_of_css_property(
        "background-color")
    assert {span.value_of_css_property("background-color") for span in spans} == {band}
    row = browser.find_element(By.CSS_SELECTOR, "#ledger tbody tr")
    assert row.find_elements(By.TAG_NAME, "td")[3].text == "1,000"
    assert row.find_elements(By.TAG_NAME, "td")[4].text.endswith(" KB")  # 1,000 float32 values and their ids


def test_the_page_sends_its_max_epsilon_and_says_when_the_budget_withheld(endpoint: Endpoint, browser) -> None:
    """A heuristic (cloud-side CoVeil) has no finite epsilon: under the page's Max ε of 1 it releases nothing, every
    step uploads 0 values, and the line under the meter says so from step 0 (before, the page had no budget)."""
    from selenium.webdriver.common.by import By

    ask_two_tokens(browser, endpoint, "coveil", max_epsilon="1")
    line = browser.find_element(By.ID, "epsilon-line").text
    assert line.startswith("ε: non-private (coveil is a heuristic")
    assert "from step 0 only cloud-only signals were sent" in line and "> max_epsilon 1 " in line
    rows = browser.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")
    assert rows and all(row.find_elements(By.TAG_NAME, "td")[3].text == "0" for row in rows)


def test_on_a_keyed_endpoint_the_page_opens_with_the_key_in_its_address(cloud: Cloud, slm, browser,
                                                                        tmp_path: Path) -> None:
    """A keyed endpoint refuses the page itself without the key; opened as /?key=KEY, the page reads the model
    name and the policies with it and drops the key from the address bar."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with start_endpoint(cloud.address, slm, tmp_path, api_key="page-key", served_model_name="edge-gemma") as keyed:
        browser.get(keyed.base_url + "/")
        assert "invalid_api_key" in browser.page_source and not browser.find_elements(By.ID, "question")
        browser.get(keyed.base_url + "/?key=page-key")
        wait = WebDriverWait(browser, 120)
        wait.until(lambda b: len(Select(b.find_element(By.ID, "policy")).options) > 1)
        assert 'model "edge-gemma"' in browser.find_element(By.ID, "model-info").text
        assert browser.current_url == keyed.base_url + "/"
        browser.find_element(By.ID, "question").send_keys(QUESTION)
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("2")
        browser.find_element(By.ID, "submit").click()
        wait.until(lambda b: b.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
        status = browser.find_element(By.ID, "status")
        assert status.get_attribute("data-state") == "done", status.text
        assert len(browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")) == 2


def test_the_export_button_downloads_the_activity_log_with_the_odds_next_to_epsilon(endpoint: Endpoint, browser,
                                                                                  tmp_path: Path) -> None:
    """An edge-side DP generation from the page: the line under the meter gives epsilon for its relation and, next
    to it, the odds in words (and the source's weaker figure second, labelled); the Export button downloads
    coveil-activity.json, the endpoint's activity log, whose last record is that generation's."""
    import json
    import time

    from selenium.webdriver.common.by import By

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    ask_two_tokens(browser, endpoint, "dp_fusion", mode="edge", params="epsilon=1")
    line = browser.find_element(By.ID, "epsilon-line").text
    # hand: 2 tokens at eps = 1, order 2, delta 1e-5: 2 + log(1e5) - 2 log 2 = 12.13, e^12.13 = 184,726: 180,000
    assert line.startswith("ε spent: 12.13 at δ = 0.00001 for any two private contexts"), line
    assert "for one private context against none" in line and "weaker" in line
    # the summary row names the policy by what one release costs for that relation, as the ledger does, never
    # by its bare parameter beside the generation's epsilon
    summary = browser.find_element(By.CSS_SELECTOR, "#ledger tfoot").text
    assert "edge-side dp_fusion (each of 2 releases: renyi(order=2, epsilon=1) for any two private contexts" in summary
    assert "epsilon=1.0" not in summary
    # edge-side the meter reads the cloud's own top ids (E_t^K), so the line saying why it rose names no token
    # as a word of the private context (the one the device sent may not be one)
    why = browser.find_element(By.ID, "meter-why").text
    assert why == "" or ("the cloud's own top next tokens" in why and "read the token" not in why), why
    assert "In words: whoever sees what left the device is at most 180,000 times more likely to tell your context " \
           "from any other" in line

    browser.find_element(By.ID, "export").click()
    saved = downloads / "coveil-activity.json"
    deadline = time.monotonic() + 30
    while not saved.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    records = json.loads(saved.read_text())["activity"]
    last = records[-1]
    assert (last["mode"], last["steps"], last["relation"]) == ("edge", 2, "any two private contexts")
    assert last["epsilon"] == pytest.approx(12.1266, abs=1e-3) and last["delta"] == 1e-5
    assert last["tokens_synced"] == 2 and last["session_ids"]
    assert CANARY not in saved.read_text()
