"""The documents the test run measures (docs/RELIABILITY.md, docs/CONFORMANCE.md): written where
asked, and a skipped repeated test said as a skip, not as runs that failed."""

from __future__ import annotations

import reliability
from conftest import _runs_text


def test_a_skipped_repeated_test_is_said_as_a_skip():
    assert _runs_text(["passed"] * 5) == "5 of 5 runs passed"
    assert _runs_text(["passed", "failed"]) == "1 of 2 runs passed"
    skipped = ["nftables is not installed"] * 5
    assert _runs_text(skipped) == "skipped (5 runs): nftables is not installed"


def test_an_ordinary_run_leaves_the_committed_documents_alone(monkeypatch):
    monkeypatch.delenv("GENIE_WRITE_DOCS", raising=False)
    doc = reliability.measured_doc("CONFORMANCE.md")
    assert doc.parent.name == "test-artifacts" and doc.exists()  # begun from the committed one
    monkeypatch.setenv("GENIE_WRITE_DOCS", "1")
    assert reliability.measured_doc("CONFORMANCE.md") == reliability.ROOT / "docs" / "CONFORMANCE.md"
