"""A real browser on `quota dashboard`: Debian's headless Chromium driven by Selenium.

It uses /usr/bin/chromium and /usr/bin/chromedriver (the ``chromium`` and
``chromium-driver`` packages, which .ci/run installs) and never downloads one:
both paths are given, so Selenium Manager is not consulted. Skipped without
them, unless QUOTA_TEST_REQUIRE_BROWSER=1, when it fails instead.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import quota
from quota.admin import Admin
from tests.dashboard.conftest import HOT_KEY, HTML_KEY, SUBJECT, TOKEN, Seeded, free_port, served

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: Where the overview's screenshot goes for the docs (docs/dashboard.md), when asked.
SCREENSHOT_ENV = "QUOTA_DASHBOARD_SCREENSHOT"

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver")


@pytest.fixture
def browser() -> Iterator[object]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        reason = f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)"
        if os.environ.get("QUOTA_TEST_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _login(driver: object, base: str) -> None:
    from selenium.webdriver.common.by import By

    d: object = driver
    d.get(f"{base}/")  # type: ignore[attr-defined]
    assert "/login" in d.current_url  # type: ignore[attr-defined]
    d.find_element(By.ID, "token").send_keys(TOKEN)  # type: ignore[attr-defined]
    d.find_element(By.CSS_SELECTOR, "#login button").click()  # type: ignore[attr-defined]
    _after_click(d, "top")


def _after_click(driver: object, element_id: str) -> str:
    """The text of the element `element_id` once the page a click loads shows it."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def text(drv: object) -> str | bool:
        try:
            return str(drv.find_element(By.ID, element_id).text)  # type: ignore[attr-defined]
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    return str(WebDriverWait(driver, 15).until(text))


def test_the_dashboard_in_a_browser(browser: object, seeded: Seeded) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    d: object = browser
    with served(seeded.url) as base:
        _login(d, base)
        # The overview, with the seeded hot key first.
        assert d.find_element(By.TAG_NAME, "h1").text == "Overview"  # type: ignore[attr-defined]
        assert d.find_element(By.ID, "h-state").text == "up"  # type: ignore[attr-defined]
        first = d.find_element(By.CSS_SELECTOR, "#top tbody tr td a")  # type: ignore[attr-defined]
        assert first.text == HOT_KEY
        shot = os.environ.get(SCREENSHOT_ENV)
        if shot:
            d.save_screenshot(shot)  # type: ignore[attr-defined]
        # The key holding HTML is text: no script ran, no alert is open.
        assert HTML_KEY in d.find_element(By.ID, "top").text  # type: ignore[attr-defined]
        hint = d.find_element(By.ID, "rates-hint").text  # type: ignore[attr-defined]
        assert "metrics=quota.Metrics()" in hint
        d.get(f"{base}/keys?q=script")  # type: ignore[attr-defined]
        assert d.find_element(By.CSS_SELECTOR, "#keys a.key").text == HTML_KEY  # type: ignore[attr-defined]
        assert d.execute_script("return window.pwned === undefined")  # type: ignore[attr-defined]
        with pytest.raises(NoAlertPresentException):
            d.switch_to.alert.text  # type: ignore[attr-defined]  # noqa: B018
        # The overview's poll keeps the key as text too.
        d.get(f"{base}/")  # type: ignore[attr-defined]
        d.execute_script("window.pwned = undefined")  # type: ignore[attr-defined]
        # A subject's ledger.
        d.get(f"{base}/quotas?subject={SUBJECT}")  # type: ignore[attr-defined]
        ledger = d.find_element(By.ID, "ledger").text  # type: ignore[attr-defined]
        assert "job-1" in ledger and "job-2" in ledger
        assert "api-calls" in d.find_element(By.ID, "usage").text  # type: ignore[attr-defined]
        # A policy set through the form.
        d.get(f"{base}/policies")  # type: ignore[attr-defined]
        form = d.find_element(By.ID, "policy-set")  # type: ignore[attr-defined]
        form.find_element(By.NAME, "route").send_keys("search")
        form.find_element(By.NAME, "tier").send_keys("anon")
        form.find_element(By.NAME, "rates").send_keys("10/minute")
        Select(form.find_element(By.NAME, "algorithm")).select_by_visible_text("gcra")
        form.find_element(By.NAME, "note").send_keys("from the browser")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        assert "set policy" in _after_click(d, "done")
        assert "tier:anon" in d.find_element(By.ID, "policies").text  # type: ignore[attr-defined]
        # A reset, confirmed on its own page.
        d.get(f"{base}/keys?key={HOT_KEY}")  # type: ignore[attr-defined]
        d.find_element(By.LINK_TEXT, "Reset every window of this key").click()  # type: ignore[attr-defined]
        d.find_element(By.CSS_SELECTOR, "#reset button").click()  # type: ignore[attr-defined]
        assert "rows deleted" in _after_click(d, "done")
    rows = Admin(seeded.limiter).policies()
    assert [(r.route, r.subject, r.rates, r.algorithm, r.note) for r in rows] == [
        ("search", "tier:anon", "10/minute", "gcra", "from the browser")
    ]
    assert Admin(seeded.limiter).windows(HOT_KEY) == []
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from quota._cli import main; main()",
            "policy",
            "list",
            "--url",
            seeded.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "from the browser" in listed.stdout


def test_the_overview_updates_itself(browser: object, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d: object = browser
    with served(seeded.url) as base:
        _login(d, base)
        before = d.find_element(By.ID, "updated").text  # type: ignore[attr-defined]
        for _ in range(3):
            seeded.limiter.hit("user:new", "1000/hour")
        WebDriverWait(d, 15).until(lambda drv: "user:new" in drv.find_element(By.ID, "top").text)
        assert d.find_element(By.ID, "updated").text != before  # type: ignore[attr-defined]
        assert d.execute_script("return window.pwned === undefined")  # type: ignore[attr-defined]
        assert HTML_KEY in d.find_element(By.ID, "top").text  # type: ignore[attr-defined]
        hint = d.find_element(By.ID, "rates-hint").text  # type: ignore[attr-defined]
        assert "metrics=quota.Metrics()" in hint


@contextlib.contextmanager
def _serving(app: object) -> Iterator[str]:
    """`app` under uvicorn on a thread of this process (so that it shares its Metrics)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off", log_level="warning")  # type: ignore[arg-type]
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_overview_shows_the_rates_of_its_metrics(browser: object, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from quota.dashboard import create_app

    metrics = quota.Metrics()
    app = create_app(seeded.url, token=TOKEN, metrics=metrics)
    d: object = browser
    try:
        with _serving(app) as base:
            _login(d, base)
            assert "no decision counted yet" in d.find_element(By.ID, "rates").text  # type: ignore[attr-defined]
            metrics.record_decision(False, route=HTML_KEY, tier="anon")
            metrics.record_shed("/upload")
            WebDriverWait(d, 15).until(
                lambda drv: HTML_KEY in drv.find_element(By.ID, "rates-decisions").text
            )
            assert "/upload" in d.find_element(By.ID, "rates-shed").text  # type: ignore[attr-defined]
            assert "the last" in d.find_element(By.ID, "rates-interval").text  # type: ignore[attr-defined]
            # The plot is redrawn from the server's SVG: a sample per poll with an interval.
            points = (
                "var p = document.querySelector('#rates-plot svg polyline.decisions');"
                " return p && p.getAttribute('points');"
            )
            WebDriverWait(d, 15).until(lambda drv: drv.execute_script(points))
            plot = d.find_element(By.CSS_SELECTOR, "#rates-plot svg")  # type: ignore[attr-defined]
            assert plot.get_attribute("namespaceURI") == "http://www.w3.org/2000/svg"
            assert "latest:" in plot.text and "decisions/s" in plot.text
            assert d.execute_script("return window.pwned === undefined")  # type: ignore[attr-defined]
    finally:
        app.state.dashboard.admin.close()
