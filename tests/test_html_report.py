"""The HTML report: self-contained, error-free in a real browser, and showing the same
numbers as ``--json``. The browser test runs Debian's Chromium through Playwright
(``.ci/run`` installs both, so CI always runs it)."""

from __future__ import annotations

import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from vramplan.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.embedded = ""
        self._in_json = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.elements.append((tag, attributes))
        self._in_json = tag == "script" and attributes.get("id") == "estimate-json"

    def handle_data(self, data):
        if self._in_json:
            self.embedded += data

    def handle_endtag(self, tag):
        self._in_json = False


@pytest.fixture(scope="module")
def report(tmp_path_factory, gpt2_config):
    folder = tmp_path_factory.mktemp("report")
    config = gpt2_config()
    html, png = folder / "report.html", folder / "report.png"
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = main(
            [
                "estimate",
                f"hf:{config}",
                "--seq-len",
                "32",
                "--batch-size",
                "4",
                "--gpu-memory",
                "2GiB",
                "--html",
                str(html),
                "--plot",
                str(png),
                "--json",
            ]
        )
    assert code == 0
    return folder, html, json.loads(buffer.getvalue()), png


def test_report_is_self_contained(report):
    _, html, _, _ = report
    text = html.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<script src" not in text and "@import" not in text and "url(" not in text


def test_report_numbers_equal_the_json(report):
    _, html, data, _ = report
    parsed = _Collector()
    parsed.feed(html.read_text())
    embedded = json.loads(parsed.embedded.replace("<\\/", "</"))
    assert embedded["peak"] == data["peak"] and embedded["components"] == data["components"]
    segments = {
        a["data-component"]: int(a["data-bytes"])
        for t, a in parsed.elements
        if a.get("class") == "segment"
    }
    assert segments == {k: v for k, v in data["components"].items() if v > 0}
    marks = {
        a["data-mark"]: int(a["data-bytes"]) for t, a in parsed.elements if a.get("class") == "mark"
    }
    assert marks["reserved"] == data["peak"]["reserved_bytes"]
    assert marks["device total"] == data["peak"]["device_total_bytes"]
    assert marks["capacity"] == data["verdict"]["capacity_bytes"]
    points = {int(a["data-batch"]) for t, a in parsed.elements if a.get("class") == "curve-point"}
    assert points == {2, 4, 8}
    text = html.read_text()
    assert f"{data['peak']['allocated_bytes']:,}" in text
    assert data["verdict"]["status"].upper() in text


def test_plot_is_a_png(report):
    pytest.importorskip("matplotlib")
    _, _, _, png = report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_in_headless_chromium(report):
    if CHROMIUM is None:
        if os.environ.get("VRAMPLAN_NO_BROWSER"):
            pytest.skip(os.environ["VRAMPLAN_NO_BROWSER"])
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: .ci/run installs chromium")
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    folder, html, data, _ = report
    errors, requests = [], []
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(html.as_uri())
        counts = {
            selector: page.locator(selector).count()
            for selector in (
                "#peak-bar .segment",
                "#timeline .area",
                "#timeline .phase",
                "#peak-marker",
                "#batch-curve .curve-point",
                "#batch-curve .gpu-line",
                "#modules tbody tr",
                "#verdict",
                "#inputs",
            )
        }
        width = page.evaluate("document.documentElement.scrollWidth")
        shot = folder / "screenshot.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert errors == []
    assert requests == [html.as_uri()]
    assert all(count > 0 for count in counts.values()), counts
    assert counts["#timeline .phase"] >= 6  # setup + forward/backward/optimizer x 2
    assert width <= 1280  # readable at a laptop width without horizontal scrolling
    assert shot.stat().st_size > 20_000
    assert Path(shot).read_bytes()[:4] == b"\x89PNG"
