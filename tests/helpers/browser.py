"""Headless Chromium driven by selenium, for the playground's browser tests: the system's
browser and driver (Debian's chromium + chromium-driver, installed by `make browser`), never
one a tool downloads."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def skip_reason() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if CHROMIUM is None or DRIVER is None:
        return "no chromium / chromedriver on PATH (`make browser` installs Debian's as root)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (`make install`: the dev extras)"
    return None


@contextmanager
def chromium(width: int = 1600, height: int = 1000) -> Iterator:
    """A headless Chromium session (selenium WebDriver) that keeps the page's console log."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium's manager must fetch nothing
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--hide-scrollbars",
                f"--window-size={width},{height}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(driver, predicate, timeout_s: float = 60.0, what: str = "the page") -> None:
    """Poll `predicate(driver)` until it holds; fail naming `what` and the page's status."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate(driver):
            return
        time.sleep(0.05)
    status = driver.execute_script("return document.getElementById('status').textContent")
    raise AssertionError(f"timed out waiting for {what} (status: {status!r})")


def js(driver, code: str, *args):
    return driver.execute_script(code, *args)


def severe_console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def send_prompt(driver, text: str) -> int:
    """Type `text` and send it; returns how many assistant messages there were before."""
    from selenium.webdriver.common.by import By

    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    return before


def wait_answered(driver, before: int, runs: int = 1, timeout_s: float = 90.0) -> None:
    """Until message number `before` is done (the page idle again), with `runs` finished
    runs; fails with the page's status otherwise."""
    def idle(d) -> bool:
        return js(d, "return document.querySelectorAll('.msg.assistant').length > arguments[0]"
                     " && document.getElementById('stop-btn').disabled", before)

    wait_until(driver, idle, timeout_s, "the answer")
    metas = js(driver, "return [...document.querySelectorAll('.msg.assistant')[arguments[0]]"
                       ".querySelectorAll('.run .meta')].map(m => m.textContent)", before)
    status = js(driver, "return document.getElementById('status').textContent")
    assert len(metas) == runs and all(metas), f"the answer failed: {status!r}"
