"""The widgets in a real browser: JupyterLab on 127.0.0.1 runs a notebook that loads the
extension, connects to a real server (simulated GPUs, labelled fake: this machine has none), shows
the dashboard and a background job; headless Chromium (Debian's package, driven by Playwright)
checks that the gauges show numbers that change, that the history chart has axes with units, that
no event-log row is clipped, that the init summary is said once, that the jobs widget follows its
job, and that text is readable in both JupyterLab themes. Screenshots go under test-artifacts/."""

from __future__ import annotations

import json

import pytest
from conftest import start_server
from lab import ARTIFACTS, CHROMIUM, lab_page, switch_theme

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test installs it)"),
    pytest.mark.timeout(300),
]


def test_dashboard_renders_live_in_jupyterlab(tmp_path):
    srv = start_server(tmp_path, "--simulate-gpus", "2", "--poll-interval", "0.5")
    cells = [
        "%load_ext genie_jupyter",
        f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token}",
        "%genie_dashboard",
        "%%remote --bg --name demo\nimport time\nfor i in range(600):\n"
        "    print('step', i, flush=True)\n    time.sleep(0.2)",
        "%genie_jobs",
    ]
    try:
        with lab_page(tmp_path, cells) as page:
            selector = '.genie-gauge[data-gpu="0"] .genie-value[data-metric="utilization"]'
            util = page.locator(selector).first
            util.wait_for(timeout=90_000)
            text = f"document.querySelector('{selector}').textContent"
            page.wait_for_function(f"{text}.endsWith('%')", timeout=30_000)
            first = util.text_content()
            page.wait_for_function(f"{text} !== {json.dumps(first)}", timeout=20_000)
            second = util.text_content()
            assert first.endswith("%") and second.endswith("%") and first != second
            assert page.locator(".genie-gauge").count() == 2
            assert page.locator(".genie-badge").first.text_content() in ("HEALTHY", "DEGRADED", "UNHEALTHY", "CRITICAL")
            assert page.locator(".genie-backend-chosen").first.text_content().startswith("backend: ")
            assert page.locator('[role="meter"]').count() >= 8  # accessible labels on every bar
            check_the_rest(page)
    finally:
        srv.stop()


def luminance(css_color: str) -> float:
    """Relative luminance (0 black .. 1 white) of an `rgb(...)`/`rgba(...)` colour."""
    r, g, b = (int(float(v)) / 255 for v in css_color[css_color.index("(") + 1 : -1].split(",")[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def check_the_rest(page) -> None:
    """Chart, event log, init summary and jobs widget; then both themes, with screenshots."""
    page.wait_for_function("document.querySelectorAll('.genie-chart polyline').length >= 4", timeout=30_000)
    page.wait_for_timeout(3000)  # a few more readings, so the chart shows lines
    labels = page.locator(".genie-chart").first.locator("text").all_text_contents()
    assert "100%" in labels and "0%" in labels and "now" in labels, labels
    assert any(t.endswith(" min") or t.endswith(" s") for t in labels), labels
    assert page.locator(".genie-chart polyline.genie-series-utilization").first.get_attribute("points")
    # Every event row starts inside the log: its time is whole, not clipped at the left edge. Measured in one
    # evaluate: the widget redraws its rows at each update, so a row found by one call may be gone at the next.
    rows = page.evaluate(
        """() => {
            const log = document.querySelector('.genie-event-list');
            const left = log.getBoundingClientRect().left;
            return [...log.querySelectorAll('.genie-event-time')].slice(0, 5)
                .map(t => [t.getBoundingClientRect().left - left, t.textContent]);
        }"""
    )
    assert len(rows) >= 2, rows
    for offset, when in rows:
        assert offset >= 0 and when[:1].isdigit(), rows
    # The init summary is said once (in its widget), not also printed beside it.
    summaries = page.locator(".jp-OutputArea-output:has-text('Connected to genie server')")
    assert summaries.count() == 1, summaries.count()
    # The jobs widget follows the background job's output.
    job = page.locator(".genie-jobs .genie-job-name:has-text('demo')")
    job.wait_for(timeout=60_000)
    page.wait_for_function(
        "[...document.querySelectorAll('.genie-job-tail')].some(e => /step [1-9]/.test(e.textContent))",
        timeout=30_000,
    )
    ARTIFACTS.mkdir(exist_ok=True)
    for theme, light in (("JupyterLab Light", True), ("JupyterLab Dark", False)):
        switch_theme(page, light)
        color = page.evaluate("getComputedStyle(document.querySelector('.genie-widget')).color")
        assert (luminance(color) < 0.4) if light else (luminance(color) > 0.6), (theme, color)
        axis = page.evaluate("getComputedStyle(document.querySelector('.genie-chart .genie-axis')).fill")
        assert (luminance(axis) < 0.6) if light else (luminance(axis) > 0.4), (theme, axis)
        name = "light" if light else "dark"
        # The output areas, not the widgets' own roots: a widget redraws its root at each update.
        for what, section in (("dashboard", "genie-gauges"), ("jobs", "genie-jobs"), ("init", "genie-init")):
            area = page.locator(f".jp-OutputArea-output:has(.{section})").last
            area.screenshot(path=str(ARTIFACTS / f"{what}-{name}.png"))
