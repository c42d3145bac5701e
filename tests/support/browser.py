"""A real headless Chromium for the page tests (Selenium with the system's chromium and chromedriver).

Without a browser a test is skipped with its reason, unless ``COVEIL_REQUIRE_BROWSER`` is set (``.ci/run``
installs chromium and chromium-driver and sets it): then it fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@contextmanager
def headless_chromium(profile: Path, window: str = "1200,1500", arguments: tuple[str, ...] = ()) -> Iterator[object]:
    """A Selenium Chrome driver over the system's Chromium, its profile in ``profile``, with ``arguments``
    added to its command line, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = next((path for path in map(shutil.which, BROWSERS) if path), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        reason = "needs chromium and chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run does)"
        if os.environ.get("COVEIL_REQUIRE_BROWSER"):
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={window}", f"--user-data-dir={profile}", *arguments):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
