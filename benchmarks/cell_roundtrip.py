"""Remote cell round trip: a trivial cell through the whole stack (magic, client, server,
worker, back), `%%remote` beside ipyparallel's `%%px` on a one-engine local cluster, both
driven through the same IPython shell, interleaved. Target (issue 7): Genie at most 0.2x."""

from __future__ import annotations

import statistics
import time

import genie_core

from . import _ipyparallel, _servers


def _p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def run(quick: bool = False) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "genie_jupyter")
    proc, info = _servers.start()
    n = 30 if quick else 400
    genie_cell, px_cell = "%%remote\nx = 1", "%%px\nx = 1"
    samples: dict[str, list[float]] = {"genie": [], "ipyparallel": []}
    try:
        genie_core.init_sync(f"{info.ip}:{info.port}", token=info.token, timeout=30)
        rc = _ipyparallel.client()
        if rc is not None:
            rc.activate()  # registers %%px in this shell
        else:
            samples.pop("ipyparallel")
        cells = {"genie": genie_cell, "ipyparallel": px_cell}
        for name in samples:  # warm both
            for _ in range(20):
                assert shell.run_cell(cells[name]).success
        for _ in range(n):  # interleaved: A B A B
            for name in samples:
                start = time.perf_counter()
                result = shell.run_cell(cells[name])
                samples[name].append(time.perf_counter() - start)
                assert result.success
    finally:
        genie_core.shutdown_sync()
        _servers.stop(proc)
    out: dict = {"name": "cell_roundtrip", "cells": n}
    for name, s in samples.items():
        out[f"{name}_ms_p50"] = round(1000 * statistics.median(s), 3)
        out[f"{name}_ms_p99"] = round(1000 * _p(s, 0.99), 3)
    if "ipyparallel" in samples:
        ratio = statistics.median(samples["genie"]) / statistics.median(samples["ipyparallel"])
        out["genie_vs_ipyparallel_p50"] = round(ratio, 3)
        out["target"] = "genie <= 0.2 x ipyparallel"
        out["met"] = ratio <= 0.2
    else:
        out["met"] = "ipyparallel not installed"
    return out
