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

from tests.browser import headless_chromium
from tests.endpoint_stack import (  # noqa: F401  (fixtures)
    CANARY,
    PRIVATE_CONTEXT,
    QUESTION,
    Cloud,
    Endpoint,
    cloud,
    generate_as_the_endpoint,
    endpoint,
    server_logs,
    start_endpoint,
)

pytestmark = pytest.mark.model

TOKENS = 8


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
    entries = expected.ledger.entries

    spans = browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")
    assert "".join(span.get_attribute("textContent") for span in spans) == shown
    assert [int(span.get_attribute("data-step")) for span in spans] == list(range(len(entries)))
    # cloud-side fusion: a step the cloud saw uploaded values is orange, one with an empty upload green
    colours = [span.get_attribute("class").split()[-1] for span in spans]
    assert colours == ["saw-full" if e.full_requested else "saw-upload" if e.values_uploaded else "saw-nothing"
                       for e in entries]
    assert {span.value_of_css_property("background-color") for span in spans if "saw-upload" in
            span.get_attribute("class")} <= {"rgba(253, 227, 191, 1)"}  # the legend's upload colour

    rows = browser.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")
    assert len(rows) == len(entries)
    assert [int(row.find_elements(By.TAG_NAME, "td")[3].text) for row in rows] == [e.values_uploaded for e in entries]
    summary = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#ledger tfoot td")]
    assert summary[0] == f"{len(entries)} steps" and summary[1] in ("finish: length", "finish: stop")
    assert int(summary[3]) == expected.ledger.values_uploaded
    assert int(summary[4]) == expected.ledger.bytes_up
    # bytes down: each Distribution carries the cloud's forward time as a varint (forward_ns), 3 or 4 bytes for
    # a forward of 16 us to 268 ms, so two runs of the same generation differ by up to a byte a step; the
    # footer is the per-step rows summed
    assert abs(int(summary[5]) - expected.ledger.bytes_down) <= len(entries)
    assert int(summary[5]) == sum(int(row.find_elements(By.TAG_NAME, "td")[5].text) for row in rows)
    meter = browser.find_element(By.ID, "meter-value").text
    assert meter == summary[6] == f"{100 * expected.ledger.leak_share:.1f}%"
    # the line under the meter: CoVeil is a heuristic, its generation has no epsilon
    assert browser.find_element(By.ID, "epsilon-line").text.startswith("ε: non-private (coveil is a heuristic")
    assert CANARY not in browser.find_element(By.ID, "answer").get_attribute("textContent")


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
