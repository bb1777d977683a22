"""The dashboard in a real browser: JupyterLab on 127.0.0.1 runs a notebook that loads the
extension, connects to a real server (simulated GPUs, labelled fake: this machine has none) and
shows the dashboard; headless Chromium (Debian's package, driven by Playwright) checks that the
gauges show numbers that change, and that the health badge and backend card are there. The
screenshot is saved under test-artifacts/."""

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
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)"),
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
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (.ci/run installs it)")
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
                ]
            )
        )
    )
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
            env=dict(os.environ),
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
            page.wait_for_timeout(3000)  # a few more readings, so the sparklines show a line
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(".genie-widget").last.screenshot(path=str(ARTIFACTS / "dashboard.png"))
            browser.close()
    finally:
        stop_process(lab, 15)
        srv.stop()
