"""Figures that fault and fuzz tests measure, gathered into docs/RELIABILITY.md at the end of
the run, so the document is written by the tests, not by hand (see `measured_doc`)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a run writes (another folder for each run of scripts/test-torch-range)
ARTIFACTS = ROOT / os.environ.get("GENIE_ARTIFACTS", "test-artifacts")
STORE = ARTIFACTS / "reliability.json"


def measured_doc(name: str) -> Path:
    """Where a test writes a document of measured figures: docs/NAME when GENIE_WRITE_DOCS=1 (the run
    whose figures are committed: `GENIE_WRITE_DOCS=1 scripts/test`), else test-artifacts/NAME (GENIE_ARTIFACTS),
    begun from the committed one, so that an ordinary test run leaves tracked files as they are."""
    committed = ROOT / "docs" / name
    if os.environ.get("GENIE_WRITE_DOCS") == "1":
        return committed
    scratch = ARTIFACTS / name
    scratch.parent.mkdir(parents=True, exist_ok=True)
    if not scratch.exists() and committed.exists():
        shutil.copyfile(committed, scratch)
    return scratch


# Runs too long for every CI run (the 30-minute soak, mutation testing) are written up by hand
# below this line of docs/RELIABILITY.md; the test run keeps that part as it is.
BY_HAND = "<!-- Below: measured outside the test run, by the commands given; kept when the tests rewrite the rest. -->"


@contextmanager
def _locked():
    """Test processes (pytest-xdist workers) record into one store: one at a time."""
    STORE.parent.mkdir(parents=True, exist_ok=True)
    with open(STORE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def record(section: str, key: str, value: object) -> None:
    with _locked():
        data = json.loads(STORE.read_text()) if STORE.exists() else {}
        data.setdefault(section, {})[key] = value
        STORE.write_text(json.dumps(data, indent=1, sort_keys=True))


def reset() -> None:
    STORE.unlink(missing_ok=True)


SECTIONS = (
    "Fuzzing (tests/test_fuzz.py)",
    "Interrupts",
    "Server killed (SIGKILL) during a 256 MiB transfer",
    "Worker crashes",
    "Who gets in",
    "Session limits",
    "Client vanishes",
    "No orphans",
    "Connect failures (50 in a row each)",
    "Repeated fault-path tests (flaky is failing)",
    "Soak (benchmarks/soak.py)",
)


def write_document() -> None:
    """Only a run that measured every section rewrites the document (a `-k` run leaves it alone)."""
    if not STORE.exists():
        return
    data = json.loads(STORE.read_text())
    if not all(section in data for section in SECTIONS):
        return
    lines = [
        "# Reliability",
        "",
        f"Written by the test suite (`tests/reliability.py`) on {time.strftime('%Y-%m-%d')}: every figure below was",
        "measured by a test in that run against a real server process (on 127.0.0.1, or in a network namespace).",
        "Re-run `python -m pytest` to regenerate it.",
        "",
    ]
    for section in sorted(data):
        lines += [f"## {section}", "", "| what | measured |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in sorted(data[section].items())]
        lines.append("")
    doc = measured_doc("RELIABILITY.md")
    kept = doc.read_text().partition(BY_HAND)[2] if doc.exists() else ""
    doc.write_text("\n".join(lines) + ("\n" + BY_HAND + kept if kept.strip() else "\n"))
