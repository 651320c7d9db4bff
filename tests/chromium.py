"""Headless Debian Chromium for the browser tests (the attention viewer, the docs site).

Chromium comes from Debian (``scripts/install_browser.sh``, which `.ci/run` calls); a test that
needs it runs that script itself if the browser is missing and skips only if it cannot install
it. Selenium Manager never downloads anything (``SE_OFFLINE``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def have_browser() -> bool:
    """Chromium and its driver are installed."""
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


def driver(profile_prefix: str, window: tuple[int, int] = (1400, 1000)) -> Iterator[object]:
    """A headless Chromium WebDriver that logs the browser console, for a fixture to
    ``yield from``; quits when the fixture ends. Installs the browser if it is missing and skips
    the test if that fails."""
    pytest.importorskip("selenium", reason="selenium is part of the dev extra")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not have_browser():
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "install_browser.sh")],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        if not have_browser():
            pytest.skip(
                "Chromium could not be installed (scripts/install_browser.sh exited "
                f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]})"
            )
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix=profile_prefix)
    for flag in [*FLAGS, f"--window-size={window[0]},{window[1]}", f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield d
    finally:
        d.quit()
