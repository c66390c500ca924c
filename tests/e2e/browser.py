"""Headless Chromium driven through Selenium, for the tests of the browser pages.

Debian's `chromium` and its matching `chromium-driver` (scripts/install.sh installs them for the tests when they are
missing). Both paths are given to Selenium, so it never runs its own driver download. The flags keep Chromium off
the network: this machine reaches nothing but the server under test, and Chromium's background services would
otherwise try Google's hosts at every start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parents[2]
# Screenshots the tests take, kept for a person to look at (build/ is ignored by git).
ARTIFACTS = Path(os.environ.get("KETTLE_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))

FLAGS = (
    "--headless=new",
    "--no-sandbox",  # the tests run as root in CI, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--force-color-profile=srgb",
)


def find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) on this machine, or None when either is missing."""
    browser = os.environ.get("KETTLE_CHROMIUM") or find("chromium", "chromium-browser", "google-chrome")
    driver = os.environ.get("KETTLE_CHROMEDRIVER") or find("chromedriver")
    return (browser, driver) if browser and driver else None


def start_chromium(width: int = 1280, height: int = 800) -> webdriver.Chrome:
    paths = chromium_paths()
    if paths is None:
        raise RuntimeError(
            "Chromium and chromedriver are needed for the browser tests: `make test` installs them "
            "(apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='kettle-chromium-')}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    viewport(driver, width, height)
    return driver


def viewport(driver: webdriver.Chrome, width: int = 1280, height: int = 800, mobile: bool = False) -> None:
    """Sets the page's viewport exactly (--window-size counts the window's frame), for comparable screenshots;
    `mobile` makes it a phone's."""
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path
