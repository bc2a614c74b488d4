"""The admin in a real browser: headless Chromium (Debian's ``chromium``, driven by Selenium
through Debian's ``chromedriver``) logs in through the login form as an operator (a staff user
in the "operators" group, not a superuser), corrects the refused recipient of an invoice with
the "Correct recipient" form, opens the dead letters, replays a real one and sees the outcome,
and the email goes out to the corrected address; both actions are recorded.

Chromium is a requirement of the suite, not an option: without it this test fails (CI installs
it, see ``.ci/run``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from core.models import DeadLetter, OperatorAction
from invoicing.models import Invoice
from tests.core.test_deadletters import refused_invoice_dead_letter
from tests.factories import staff_user
from tests.smtp import SmtpServer
from tests.workers import worker_thread

pytestmark = pytest.mark.django_db(transaction=True)

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
    "--window-size=1920,1080",  # wide enough for every column of the change list
)
PASSWORD = "pw-browser-12345"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
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
    try:
        yield driver
    finally:
        driver.quit()


def test_an_operator_corrects_the_recipient_replays_the_dead_letter_and_sees_the_outcome(
    browser: WebDriver, live_server: Any, client: Client, smtp: SmtpServer, tmp_path: Path
) -> None:
    staff_user("ops", groups=["operators"], password=PASSWORD)
    wait = WebDriverWait(browser, 20)
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)

        browser.get(f"{live_server.url}/admin/")  # not logged in: the login form
        browser.find_element(By.NAME, "username").send_keys("ops")
        browser.find_element(By.NAME, "password").send_keys(PASSWORD)
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        wait.until(expected_conditions.title_contains("Site administration"))

        browser.get(f"{live_server.url}/admin/invoicing/invoice/{invoice.pk}/change/")
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

        browser.get(f"{live_server.url}/admin/")
        browser.find_element(By.LINK_TEXT, "Dead letters").click()
        wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))
        browser.find_element(By.CSS_SELECTOR, f"input.action-select[value='{letter.pk}']").click()
        Select(browser.find_element(By.NAME, "action")).select_by_visible_text(
            "Replay selected dead letters"
        )
        browser.find_element(By.CSS_SELECTOR, "button[name='index']").click()

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
        screenshot = tmp_path / "replayed.png"
        assert browser.save_screenshot(str(screenshot))

        sent = smtp.handler.wait_for(1, timeout=20)

    image = screenshot.read_bytes()
    assert image.startswith(PNG_SIGNATURE)
    assert len(image) > 1000
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
