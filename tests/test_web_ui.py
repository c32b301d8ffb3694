"""The web page at ``GET /``, driven in headless Chromium (Debian's package, through Selenium and
Debian's chromedriver): the key prompt, an uploaded scene, three questions sent at once, answers
equal to the API's, the image encoded once and reused by the other two questions."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, bundled_engine, scenes_and_reports, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
QUESTIONS = ["how many shapes are there?", "what is at the centre?", "describe the scene."]


@pytest.fixture
def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no chromium and chromedriver on this machine (the Makefile installs Debian's "
                    "where apt-get is available)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(condition, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("the page did not get there in time")


def test_the_page_asks_three_questions_about_an_uploaded_scene(browser, tmp_path):
    from selenium.webdriver.common.by import By

    running = start_server(bundled_engine(), api_key="sesame")
    try:
        browser.get(f"{running.url}/")
        by_id = lambda name: browser.find_element(By.ID, name)  # noqa: E731
        wait_for(lambda: by_id("keybox").is_displayed())  # no key yet: it asks for one
        by_id("key").send_keys("wrong")
        by_id("keyform").submit()
        wait_for(lambda: by_id("keybox").is_displayed() and "not accepted" in by_id("keyerror").text)
        by_id("key").clear()
        by_id("key").send_keys("sesame")
        by_id("keyform").submit()
        wait_for(lambda: MODEL_NAME in by_id("model").text)

        scene = scenes_and_reports(21, 1, 0)[0][0]
        path = tmp_path / "scene.png"
        scene.render().save(path)
        browser.execute_script("document.getElementById('file').hidden = false")
        by_id("file").send_keys(str(path))
        wait_for(lambda: browser.find_elements(By.ID, "preview"))
        by_id("questions").clear()
        by_id("questions").send_keys("\n".join(QUESTIONS))
        by_id("send").click()
        answers = wait_for(lambda: (views := browser.find_elements(By.CSS_SELECTOR, ".answer")) and len(views) == 3
                           and all(v.get_attribute("data-done") == "ok" for v in views) and views)
        image = browser.execute_script("return image")
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="sesame", max_retries=0)
        want = [api.chat.completions.create(model=MODEL_NAME, max_tokens=64, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": q}]}]).choices[0].message.content
                for q in QUESTIONS]
        assert [v.find_element(By.CSS_SELECTOR, ".text").text.strip() for v in answers] == [w.strip() for w in want]
        encoded = sorted(v.get_attribute("data-encoded") for v in answers)
        assert encoded == ["0", "0", "1"]  # sent at once: one encodes the image, the others reuse it
        assert sum("image reused" in v.find_element(By.CSS_SELECTOR, ".meta").text for v in answers) == 2
        wait_for(lambda: by_id("encoder").text.startswith("1 / "))
        if os.environ.get("MMKV_UI_SCREENSHOT"):
            browser.save_screenshot(os.environ["MMKV_UI_SCREENSHOT"])
        assert httpx.get(f"{running.url}/v1/stats").status_code == 401  # the page's key is its own
    finally:
        running.stop()


def test_the_page_needs_no_key_and_no_ui_serves_none():
    """With a key, the page itself is served without one (it asks for the key); ``--no-ui``
    serves nothing at ``/``, and the key is then needed there as everywhere."""
    running = start_server(bundled_engine(kv_cache_memory="4MiB"), api_key="sesame")
    try:
        page = httpx.get(f"{running.url}/")
        assert page.status_code == 200 and "<title>mmkv</title>" in page.text
        assert "\"maxImageBytes\": 10485760" in page.text  # the default --max-image-bytes
    finally:
        running.stop()
    running = start_server(bundled_engine(kv_cache_memory="4MiB"), ui=False)
    try:
        assert httpx.get(f"{running.url}/").status_code == 404
    finally:
        running.stop()
