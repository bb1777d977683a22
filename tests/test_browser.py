"""The widgets in a real browser: JupyterLab on 127.0.0.1 runs a notebook that loads the
extension, connects to a real server (simulated GPUs, labelled fake: this machine has none), shows
the dashboard and a background job; headless Chromium (Debian's package, driven by Playwright)
checks that the gauges show numbers that change, that the history chart has axes with units, that
no event-log row is clipped, that the init summary is said once, that the jobs widget follows its
job, and that text is readable in both JupyterLab themes. Screenshots go under test-artifacts/."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import start_server

from genie_core.local_server import stop_process

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test installs it)"),
    pytest.mark.timeout(300),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook(cells: list[str]) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None} for c in cells
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def test_dashboard_renders_live_in_jupyterlab(tmp_path):
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (scripts/test installs it)"
    )
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (scripts/test installs it)")
    srv = start_server(tmp_path, "--simulate-gpus", "2", "--poll-interval", "0.5")
    root = tmp_path / "lab"
    root.mkdir()
    (root / "genie.ipynb").write_text(
        json.dumps(
            notebook(
                [
                    "%load_ext genie_jupyter",
                    f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token}",
                    "%genie_dashboard",
                    "%%remote --bg --name demo\nimport time\nfor i in range(600):\n"
                    "    print('step', i, flush=True)\n    time.sleep(0.2)",
                    "%genie_jobs",
                ]
            )
        )
    )
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')  # no news toast
    port, token = free_port(), os.urandom(12).hex()
    with open(tmp_path / "lab.log", "w") as log:  # the child holds its own descriptor
        lab = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter",
                "lab",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                f"--ServerApp.token={token}",
                f"--ServerApp.root_dir={root}",
                "--LabApp.expose_app_in_browser=True",
                "--allow-root",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings")),
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and lab.poll() is None, (tmp_path / "lab.log").read_text()[-2000:]
                time.sleep(0.3)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/lab/tree/genie.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=90_000)
            page.wait_for_function(
                "window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                "window.jupyterapp.shell.currentWidget.sessionContext.session",
                timeout=90_000,
            )
            page.wait_for_function(
                "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'", timeout=90_000
            )
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
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
            browser.close()
    finally:
        stop_process(lab, 15)
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
        page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: {json.dumps(theme)}}})")
        page.wait_for_function(
            f"document.body.dataset.jpThemeLight === {json.dumps(str(light).lower())}", timeout=30_000
        )
        page.wait_for_timeout(1000)
        color = page.evaluate("getComputedStyle(document.querySelector('.genie-widget')).color")
        assert (luminance(color) < 0.4) if light else (luminance(color) > 0.6), (theme, color)
        axis = page.evaluate("getComputedStyle(document.querySelector('.genie-chart .genie-axis')).fill")
        assert (luminance(axis) < 0.6) if light else (luminance(axis) > 0.4), (theme, axis)
        name = "light" if light else "dark"
        # The output areas, not the widgets' own roots: a widget redraws its root at each update.
        for what, section in (("dashboard", "genie-gauges"), ("jobs", "genie-jobs"), ("init", "genie-init")):
            area = page.locator(f".jp-OutputArea-output:has(.{section})").last
            area.screenshot(path=str(ARTIFACTS / f"{what}-{name}.png"))
