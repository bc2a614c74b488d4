"""The operator's pages in a real browser, served as deployed: headless Chromium (Debian's
``chromium``, driven by Selenium through Debian's ``chromedriver``) against gunicorn on the
production settings (``core.settings``, DEBUG off) with the static files the Docker image's
build collects (tests/helpers/web.py), not Django's development server. An operator (a staff
user in the "operators" group, not a superuser) logs in through the login form, corrects the refused
recipient of an invoice, replays its dead letter and sees the outcome; the email goes out to
the corrected address, and both actions are recorded.

Each page screenshotted is checked for its stylesheet: the computed style of an element the
stylesheet colours, and the same colour in the screenshot's pixels; the admin's pages name the
stylesheet by its hashed name. Screenshots go under the test's tmp_path; with
``UPDATE_SCREENSHOTS=1`` the pages in ``DOCS_PAGES`` are also written to docs/screenshots/
(commit them), so a plain test run leaves the tree as it was.

Chromium is a requirement of the suite, not an option: without it this test fails (CI installs
it, see ``.ci/run``)."""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import global_settings
from django.test import Client
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.periodic import jobs
from asyncwork.contrib.periodic.beat import active_beat
from asyncwork.models import DeadLetter, ScheduledJob
from core.celery import app
from invoicing.models import Invoice
from stack import launch, stripe_events
from stack.net import free_port, wait_until
from stack.process import ROOT, Process
from stack.smtp import SmtpServer
from tests.helpers.deadletters import refused_invoice_dead_letter
from tests.helpers.factories import paid_invoice, staff_user
from tests.helpers.processes import worker_env, worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import WEBHOOK_URL, paid_event, post_signed
from tests.helpers.web import hashed_name

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # Chromium

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a container's small /dev/shm crashes tabs
    "--no-first-run",
    "--disable-background-networking",  # no network here, and nothing to fetch
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1600,900",  # wide enough for every column of the change lists
    "--hide-scrollbars",
    "--force-color-profile=srgb",  # the screenshot's pixels are the stylesheet's colours
    "--force-device-scale-factor=1",
)
PASSWORD = "pw-browser-12345"
SCREENSHOTS = ROOT / "docs" / "screenshots"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_HEIGHT = 2400  # pixels of a page a screenshot shows at most

# What each stylesheet colours, as the browser computes it; unstyled, both are transparent.
# The admin's header: --header-bg, which is --secondary (#417690) in admin/css/base.css.
ADMIN_HEADER = ("#header", "rgb(65, 118, 144)")
# The browsable API's top bar: #2C2C2C in DRF's rest_framework/css/bootstrap-tweaks.css.
API_NAVBAR = (".navbar", "rgb(44, 44, 44)")


@dataclass(frozen=True)
class Page:
    """An operator's page: its name (the screenshot's file name), its path (``{invoice}`` and
    ``{letter}`` are the scenario's invoice and dead letter), and an element that shows its
    content was rendered."""

    name: str
    path: str
    content: str


# The pages docs/screenshots/ shows. Adding one is a line here, then `UPDATE_SCREENSHOTS=1
# .venv/bin/pytest tests/test_browser.py` and a commit of its PNG.
DOCS_PAGES = (
    Page("admin-index", "/admin/", "#content-main .app-asyncwork"),
    Page("dashboard", "/admin/dashboard/", "#dashboard"),
    Page("dead-letters", "/admin/asyncwork/deadletter/", "#result_list"),
    Page("dead-letter", "/admin/asyncwork/deadletter/{letter}/change/", "#replay-form"),
    Page("invoice", "/admin/invoicing/invoice/{invoice}/change/", ".object-tools"),
)


@dataclass
class Operator:
    """Chromium logged in as an operator on the production web app."""

    driver: webdriver.Chrome
    base_url: str
    screenshots: Path  # this test's own directory
    wait: WebDriverWait[webdriver.Chrome]

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def computed(self, selector: str, prop: str) -> str:
        """``getComputedStyle(element)[prop]`` of the first element matching ``selector``."""
        value = self.driver.execute_script(
            "const e = document.querySelector(arguments[0]);"
            "return e && getComputedStyle(e)[arguments[1]];",
            selector,
            prop,
        )
        assert value is not None, f"no {selector} on {self.driver.current_url}"
        return str(value)

    def screenshot(self, name: str, *, docs: bool = False) -> Path:
        """A PNG of the whole page (up to MAX_HEIGHT pixels down) under the test's directory;
        also docs/screenshots/<name>.png when ``docs`` and UPDATE_SCREENSHOTS=1."""
        width, height = self.driver.execute_script(
            "const d = document.documentElement; return [d.clientWidth, d.scrollHeight];"
        )
        # The viewport made as tall as the page for the capture (Chrome's own), so what is
        # below the fold is in the picture and laid out as on a tall screen.
        metrics = {"width": width, "height": min(height, MAX_HEIGHT)}
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {**metrics, "deviceScaleFactor": 1, "mobile": False},
        )
        try:
            shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
        finally:
            self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        path = self.screenshots / f"{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        if docs and os.environ.get("UPDATE_SCREENSHOTS") == "1":
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, SCREENSHOTS / path.name)
        return path

    def assert_styled(self, name: str, selector: str, colour: str, *, docs: bool = False) -> Path:
        """The element ``selector`` has the background ``colour`` its stylesheet gives it, and
        the screenshot (returned) shows that colour where the element is."""
        assert self.computed(selector, "backgroundColor") == colour, self.driver.current_url
        box = self.driver.execute_script(
            "const r = document.querySelector(arguments[0]).getBoundingClientRect();"
            "return [r.left + scrollX, r.top + scrollY, r.width, r.height];",
            selector,
        )
        left, top, width, height = (int(v) for v in box)
        assert width > 100
        assert height > 10
        path = self.screenshot(name, docs=docs)
        with Image.open(path) as image:
            # Inside the element's left edge, half-way down: clear of its text and borders.
            pixel = image.convert("RGB").getpixel((left + 3, top + height // 2))
        assert f"rgb{pixel}".replace(" ", "") == colour.replace(" ", ""), (name, pixel)
        return path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    assert CHROMIUM, "chromium is not installed: apt-get install chromium chromium-driver"
    assert CHROMEDRIVER, "chromedriver is not installed: apt-get install chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    # Both paths given: Selenium Manager (which would download a driver) is never consulted.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    # The light theme whatever the machine prefers: the colours checked are the light theme's.
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "light"}]},
    )
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def operator(
    transactional_db: None,
    browser: webdriver.Chrome,
    production_web: Process,
    tmp_path: Path,
    settings: Any,
) -> Operator:
    """Chromium logged in through the admin's login form as "ops", an operator, on gunicorn as
    deployed."""
    # The password hashed as production hashes it: gunicorn on core.settings checks it, and
    # knows nothing of the tests' own hasher (tests/settings.py).
    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS
    staff_user("ops", groups=["operators"], password=PASSWORD)
    signed_in = Operator(
        driver=browser,
        base_url=f"http://127.0.0.1:{production_web.port}",
        screenshots=tmp_path,
        wait=WebDriverWait(browser, 20),
    )
    signed_in.open("/admin/")  # not logged in: the login form
    browser.find_element(By.NAME, "username").send_keys("ops")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    signed_in.wait.until(expected_conditions.title_contains("Site administration"))
    return signed_in


def test_the_operator_pages_are_styled_as_deployed(
    operator: Operator, smtp: SmtpServer, collected_static: Path
) -> None:
    """Each page in DOCS_PAGES, on a day with one invoice emailed and one dead letter: styled
    by the hashed stylesheet gunicorn serves, and screenshotted for docs/screenshots/."""
    smtp.handler.faults.refuse = {"typo@exmaple.com"}
    url = operator.base_url + WEBHOOK_URL
    with worker_thread():
        # Through gunicorn, as Stripe delivers them.
        for event in (
            paid_event(customer_email="ada@example.com", customer_name="Ada Lovelace", amount=4200),
            paid_event(customer_email="typo@exmaple.com"),  # refused by the mail server
        ):
            assert post_signed(url, stripe_events.encode(event)).status_code == 200
        assert wait_until(lambda: DeadLetter.objects.count() == 1, timeout=30)
        smtp.handler.wait_for(1, timeout=20)
        sent = smtp.messages
        assert [m["To"] for m in sent] == ["Ada Lovelace <ada@example.com>"]
        # A day as in production: every scheduled job has run, a beat leads and the worker is
        # up while the pages are taken (the dashboard the docs show is a working one).
        declared = [job.name for job in jobs.jobs_declared()]
        for name in declared:
            app.send_task(name)
        assert wait_until(
            lambda: (
                ScheduledJob.objects.filter(name__in=declared, runs__gte=1).count() == len(declared)
            ),
            timeout=60,
        )
        beat = launch.celery_beat(worker_env(free_port()), name="browser-beat")
        try:
            assert wait_until(lambda: active_beat() is not None, timeout=30), beat.log_tail()
            ids = {
                "invoice": Invoice.objects.get(customer_email="typo@exmaple.com").pk,
                "letter": DeadLetter.objects.get().pk,
            }
            pages_styled(operator, ids, collected_static)
        finally:
            beat.stop()


def pages_styled(operator: Operator, ids: dict[str, int], collected_static: Path) -> None:
    """Each page in DOCS_PAGES, styled as deployed and screenshotted; the dashboard shows every
    job run and a beat leading."""
    stylesheet = "/static/" + hashed_name(collected_static, "admin/css/base.css")
    for page in DOCS_PAGES:
        operator.open(page.path.format(**ids))
        operator.wait.until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, page.content))
        )
        if page.name == "dashboard":
            text = operator.driver.find_element(By.CSS_SELECTOR, page.content).text
            assert "never ran" not in text, text
            assert "none: scheduled jobs are not dispatched" not in text, text
        # The page names the stylesheet by its hashed name, and the browser applied it.
        linked = operator.driver.execute_script(
            "return [...document.querySelectorAll('link[rel=stylesheet]')]"
            ".map(l => l.getAttribute('href'));"
        )
        assert stylesheet in linked, (page.name, linked)
        operator.assert_styled(page.name, *ADMIN_HEADER, docs=True)


def test_docs_show_every_page_and_only_those() -> None:
    """docs/screenshots/ holds one committed PNG per page in DOCS_PAGES: a page added without
    its screenshot, or a screenshot left behind by a page removed, fails here."""
    committed = {path.stem: path for path in SCREENSHOTS.glob("*.png")}
    assert set(committed) == {page.name for page in DOCS_PAGES}
    for path in committed.values():
        with Image.open(path) as image:
            assert image.format == "PNG"
            assert image.width >= 1200


def test_the_browsable_api_is_styled_as_deployed(operator: Operator) -> None:
    operator.open("/api/invoices/")
    operator.wait.until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, ".response-info"))
    )
    assert "Invoice" in operator.driver.title
    operator.assert_styled("api-invoices", *API_NAVBAR)


def test_an_operator_corrects_the_recipient_replays_the_dead_letter_and_sees_the_outcome(
    operator: Operator, client: Client, smtp: SmtpServer
) -> None:
    browser, wait = operator.driver, operator.wait
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)

        operator.open(f"/admin/invoicing/invoice/{invoice.pk}/change/")
        browser.find_element(By.CSS_SELECTOR, ".object-tools a.correct-recipient").click()
        browser.find_element(By.NAME, "email").send_keys("fixed@example.com")
        browser.find_element(By.NAME, "reason").send_keys("typo in the domain, ticket 7")
        browser.find_element(By.NAME, "_correct").click()
        corrected = wait.until(
            expected_conditions.visibility_of_element_located(
                (By.CSS_SELECTOR, ".messagelist .success")
            )
        )
        assert "emails now go to fixed@example.com" in corrected.text
        assert "typo in the domain, ticket 7" in browser.page_source  # its record, on the page

        operator.open("/admin/")
        browser.find_element(By.LINK_TEXT, "Dead letters").click()
        wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))
        browser.find_element(By.CSS_SELECTOR, f"input.action-select[value='{letter.pk}']").click()
        Select(browser.find_element(By.NAME, "action")).select_by_visible_text(
            "Replay selected dead letters…"
        )
        browser.find_element(By.CSS_SELECTOR, "button[name='index']").click()
        # The page asking first, with the count.
        count = wait.until(
            expected_conditions.visibility_of_element_located((By.ID, "confirmation-count"))
        )
        assert count.text.startswith("Replay 1 dead letter:")
        browser.find_element(By.CSS_SELECTOR, "#confirmation-form input[name='confirm']").click()

        success = wait.until(
            expected_conditions.visibility_of_element_located(
                (By.CSS_SELECTOR, ".messagelist .success")
            )
        )
        assert success.text == "Replayed 1 dead letter(s)."
        row = browser.find_element(
            By.CSS_SELECTOR, f"input.action-select[value='{letter.pk}']"
        ).find_element(By.XPATH, "./ancestor::tr")
        replayed_at = row.find_element(By.CSS_SELECTOR, "td.field-replayed_at").text
        assert replayed_at not in {"", "-"}
        operator.assert_styled("replayed", *ADMIN_HEADER)

        smtp.handler.wait_for(1, timeout=20)
        sent = smtp.messages

    assert [m["To"] for m in sent] == ["Jenny Rosen <fixed@example.com>"]
    letter = DeadLetter.objects.get(pk=letter.pk)
    assert letter.replayed_at is not None
    assert letter.replayed_by == "admin:ops"
    invoice = Invoice.objects.get(pk=invoice.pk)
    assert (invoice.customer_email, invoice.recipient_override) == (
        "typo@exmaple.com",  # the provider's, as it gave it
        "fixed@example.com",
    )
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.action, a.actor, a.target) for a in recorded] == [
        ("invoice.recipient_correct", "admin:ops", invoice),
        ("dead_letter.replay", "admin:ops", letter),
    ]


def test_an_operator_confirms_a_bulk_resend_that_states_its_count(
    operator: Operator, smtp: SmtpServer
) -> None:
    """The action asks first, in the admin's own look: how many emails, to whom; confirmed, each
    is sent once."""
    browser, wait = operator.driver, operator.wait
    chosen = [paid_invoice(customer_name="Ada Lovelace") for _ in range(2)]
    paid_invoice()  # listed, not chosen
    operator.open("/admin/invoicing/invoice/")
    wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))
    for invoice in chosen:
        browser.find_element(By.CSS_SELECTOR, f"input.action-select[value='{invoice.pk}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_visible_text("Resend invoice email")
    browser.find_element(By.CSS_SELECTOR, "button[name='index']").click()

    wait.until(expected_conditions.presence_of_element_located((By.ID, "resend-email-form")))
    assert browser.find_element(By.ID, "resend-count").text.startswith(
        "Resend the invoice email of 2 invoices?"
    )
    listed = browser.find_elements(By.CSS_SELECTOR, "#resend-invoices li")
    assert [item.text for item in listed] == [f"{i} to {i.customer_email}" for i in chosen]
    assert "Resend invoice emails" in browser.find_element(By.CSS_SELECTOR, ".breadcrumbs").text
    operator.assert_styled("resend-confirmation", *ADMIN_HEADER)
    # The confirm button is the admin's default (primary) button: --default-button-bg.
    confirm = browser.find_element(By.CSS_SELECTOR, "#resend-email-form input[type=submit]")
    assert confirm.get_attribute("value") == "Yes, resend 2 emails"
    assert operator.computed("#resend-email-form input.default", "backgroundColor") == (
        "rgb(32, 80, 103)"
    )

    with worker_thread():
        confirm.click()
        success = wait.until(
            expected_conditions.visibility_of_element_located(
                (By.CSS_SELECTOR, ".messagelist .success")
            )
        )
        assert success.text == "Requested 2 invoice email resend(s)."
        smtp.handler.wait_for(2, timeout=20)
        pipeline_quiet()
    assert sorted(m["To"] for m in smtp.messages) == sorted(
        f"Ada Lovelace <{i.customer_email}>" for i in chosen
    )
