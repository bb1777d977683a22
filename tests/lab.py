"""JupyterLab on 127.0.0.1 and headless Chromium (Debian's package, driven by Playwright): a
notebook of the given cells, run in a real kernel and shown in a real browser, for the widget tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genie_core.local_server import stop_process

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


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


@contextlib.contextmanager
def lab_page(tmp_path: Path, cells: list[str], viewport: dict[str, int] | None = None) -> Iterator[Any]:
    """A Playwright page of JupyterLab with a notebook of `cells`, every cell started running."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (scripts/test installs it)")
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (scripts/test installs it)"
    )
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (scripts/test installs it)")
    root = tmp_path / "lab"
    root.mkdir()
    (root / "genie.ipynb").write_text(json.dumps(notebook(cells)))
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
            page = browser.new_page(viewport=viewport or {"width": 1400, "height": 1000})
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
            yield page
            browser.close()
    finally:
        stop_process(lab, 15)


def switch_theme(page: Any, light: bool) -> None:
    theme = "JupyterLab Light" if light else "JupyterLab Dark"
    page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: {json.dumps(theme)}}})")
    page.wait_for_function(f"document.body.dataset.jpThemeLight === {json.dumps(str(light).lower())}", timeout=30_000)
    page.wait_for_timeout(1000)
