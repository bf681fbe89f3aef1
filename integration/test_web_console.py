"""The web console in headless Chromium against a real feosd with --web on loopback.

Every pod here is a real pod made through the API (feosctl, or the page's own form); none needs
to boot but the one whose serial console is read, so the others are stopped or deleted at once.
Screenshots go to the test's tmp dir (kept by pytest, never committed).
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from feosd_proc import Feosd, end_microvms
from web_browser import browser, free_port, missing, viewport

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

NOWHERE = "127.0.0.1:9/nothing/here:1"  # a registry that is not there: the pods never pull


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feosd]:
    port = free_port()
    daemon = Feosd(tmp_path_factory.mktemp("web"), "--web", f"127.0.0.1:{port}")
    daemon.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop(60)
        end_microvms(daemon.state_dir)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    drv = browser(tmp_path_factory.mktemp("chromium"))
    try:
        yield drv
    finally:
        drv.quit()


def wait(driver: Any, condition: Any, timeout: float = 60) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def open_console(driver: Any, node: Feosd, where: str = "") -> None:
    driver.get(node.url + "/" + where)  # type: ignore[attr-defined]
    wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def state_of(driver: Any, pod_id: str) -> str | None:
    return driver.execute_script(
        "const s = document.querySelector(`#pod-${arguments[0]} [data-state]`);"
        "return s ? s.textContent.split(' ')[0] : null;", pod_id)


def pod(node: Feosd, pod_id: str) -> None:
    node.ctl("pod", "create", pod_id, "--no-network", "--image", NOWHERE, "--memory", "128")
    node.ctl("pod", "stop", pod_id)


def shot(driver: Any, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / f"{name}.png"))


def test_a_pod_made_through_the_api_is_in_the_list(node: Feosd, driver: Any,
                                                    tmp_path: Path) -> None:
    pod(node, "wa00000001a")
    open_console(driver, node)
    card = driver.find_element("id", "pod-wa00000001a").text
    assert "stopped" in card and "main" in card and NOWHERE in card
    shot(driver, tmp_path, "list")


def test_events_appear_without_a_reload(node: Feosd, driver: Any, tmp_path: Path) -> None:
    open_console(driver, node)
    driver.execute_script("window.notReloaded = true")
    node.ctl("pod", "create", "wb00000001a", "--no-network", "--image", NOWHERE, "--memory", "128")
    wait(driver, lambda d: state_of(d, "wb00000001a") is not None)
    node.ctl("pod", "stop", "wb00000001a")
    wait(driver, lambda d: state_of(d, "wb00000001a") == "stopped")
    assert driver.execute_script("return window.notReloaded") is True
    events = driver.find_element("css selector", "#pod-wb00000001a [data-events]").text
    assert "stopped" in events and "pending" in events
    node.ctl("pod", "delete", "wb00000001a")
    wait(driver, lambda d: state_of(d, "wb00000001a") is None)
    assert driver.execute_script("return window.notReloaded") is True
    shot(driver, tmp_path, "events")


def fill(driver: Any, **fields: str) -> None:
    form = driver.find_element("id", "create-form")
    driver.execute_script("document.getElementById('create').open = true")
    for name, value in fields.items():
        element = form.find_element("name", name)
        if element.get_attribute("type") == "checkbox":
            if element.is_selected() != (value == "on"):
                element.click()
        else:
            element.clear()
            element.send_keys(value)
    form.find_element("css selector", "button[type=submit]").click()


def test_a_pod_created_and_deleted_from_the_page(node: Feosd, driver: Any,
                                                 tmp_path: Path) -> None:
    open_console(driver, node)
    fill(driver, id="wc00000001a", image=NOWHERE, memory="128", nonet="on")
    wait(driver, lambda d: state_of(d, "wc00000001a") is not None)
    assert node.ctl_json("pod", "get", "wc00000001a")["spec"]["containers"][0]["image"] == NOWHERE
    shot(driver, tmp_path, "created")
    driver.find_element("css selector", "#pod-wc00000001a button[data-act=delete]").click()
    driver.switch_to.alert.accept()
    wait(driver, lambda d: state_of(d, "wc00000001a") is None)
    assert node.ctl("pod", "get", "wc00000001a", check=False).returncode != 0


def test_a_bad_form_is_refused_with_the_apis_message(node: Feosd, driver: Any,
                                                     tmp_path: Path) -> None:
    open_console(driver, node)
    fill(driver, id="wd00000001a", image="Not An Image!", memory="128", nonet="on")
    image = driver.find_element("css selector", "#create-form input[name=image]")
    wait(driver, lambda d: "invalid" in image.get_attribute("class"))
    message = image.find_element("xpath", "following-sibling::p[@class='error']").text
    assert message.startswith("spec.containers[0].image: must be an OCI reference")
    refused = node.ctl("pod", "get", "wd00000001a", check=False)
    assert refused.returncode != 0
    # What the page checks itself never reaches the API: named by its field too.
    fill(driver, id="Bad-Id", image=NOWHERE, memory="129")
    memory = driver.find_element("css selector", "#create-form input[name=memory]")
    assert "invalid" in memory.get_attribute("class")
    shot(driver, tmp_path, "bad-form")


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[str]:
    """Another origin on loopback: a plain static server on another port (no console)."""
    (tmp_path / "index.html").write_text("<!doctype html><title>elsewhere</title><p>elsewhere")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    finally:
        server.shutdown()
        server.server_close()


SEND = ("const done = arguments[arguments.length - 1];"
        " fetch(arguments[0], {method: 'POST', body: arguments[1], mode: arguments[2],"
        " headers: {'content-type': 'text/plain'}}).then(r => done(r.type === 'opaque' ? 0 : r.status),"
        " e => done(String(e)))")


def test_a_change_without_the_token_or_from_elsewhere_is_refused(node: Feosd, driver: Any,
                                                                 elsewhere: str) -> None:
    body = json.dumps({"id": "we00000001a", "spec": {"memoryMib": 128, "network": {"none": None}}})
    url = node.url + "/api/pods/createPod"  # type: ignore[attr-defined]
    open_console(driver, node)
    # The console's own page, without the CSRF token: refused.
    assert driver.execute_async_script(SEND, url, body, "same-origin") == 403
    # Another origin's page (a cross-site form post would do the same): refused by its origin.
    driver.get(elsewhere)
    assert driver.execute_async_script(SEND, url, body, "no-cors") == 0  # opaque: sent
    assert f"refused POST /api/pods/createPod from {elsewhere.rsplit('/', 1)[0]}: a change must " \
        "come from the console's own page" in node.log_text()
    assert node.ctl("pod", "get", "we00000001a", check=False).returncode != 0


@pytest.mark.parametrize(("width", "height"), [(390, 844), (1440, 900)])
@pytest.mark.parametrize("tab", ["pods", "volumes", "groups", "names"])
def test_the_pages_fit_phone_and_desktop(node: Feosd, driver: Any, tmp_path: Path, tab: str,
                                         width: int, height: int) -> None:
    pod(node, "wf00000001a")
    viewport(driver, width, height, mobile=width < 500)
    try:
        open_console(driver, node, f"#{tab}")
        driver.execute_script("document.getElementById('create').open = true")
        wait(driver, lambda d: d.execute_script(
            f"return document.getElementById('{tab}').children.length > 0"))
        overflow = driver.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth]")
        shot(driver, tmp_path, f"{tab}-{width}x{height}")
        assert overflow[0] <= overflow[1], overflow
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_the_serial_console_of_a_booting_pod(node: Feosd, driver: Any, tmp_path: Path) -> None:
    """The one booting pod: no containers, no network; its console log followed on the page."""
    node.ctl("pod", "create", "wg00000001a", "-f", "-", "--wait",
             input=json.dumps({"network": {"none": None}, "memoryMib": 256}), timeout=240)
    try:
        open_console(driver, node, "#log/console/wg00000001a")
        log = driver.find_element("id", "log")
        wait(driver, lambda d: "Linux version" in log.text, timeout=60)
        shot(driver, tmp_path, "console-log")
    finally:
        node.ctl("pod", "delete", "wg00000001a", timeout=120)
