"""`python -m benchmarks [--quick] [NAME ...]`: run, print, and write results (JSON and Markdown)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import genie_core

ALL = [
    "monitor_overhead",
    "remote_tensors",
    "bulk_transfer",
    "cell_roundtrip",
    "connect_time",
    "failure_detection",
    "concurrency",
    "message_signing",
    "llm",
    "pool",
    "sandbox",
    "soak",
]


def machine() -> dict:
    import os

    import psutil
    import torch
    import zmq

    return {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "genie": genie_core.__version__,
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", default=ALL, help=f"which ({', '.join(ALL)})")
    parser.add_argument("--quick", action="store_true", help="seconds, not minutes: checks the benchmarks still run")
    parser.add_argument("--minutes", type=float, default=None, help="how long the soak runs (default 2)")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results"), help="folder for results.json and results.md"
    )
    args = parser.parse_args(argv)
    results = {"machine": machine(), "quick": args.quick, "benchmarks": []}
    began = time.perf_counter()
    for name in args.names:
        extra = {"minutes": args.minutes} if name == "soak" and args.minutes else {}
        start = time.perf_counter()
        result = importlib.import_module(f"benchmarks.{name}").run(quick=args.quick, **extra)
        result["benchmark_seconds"] = round(time.perf_counter() - start, 1)
        results["benchmarks"].append(result)
        print(json.dumps(result, indent=1), file=sys.stderr)
    took = ", ".join(f"{r['name']} {r['benchmark_seconds']:g} s" for r in results["benchmarks"])
    print(f"{len(args.names)} benchmark(s) in {time.perf_counter() - began:.0f} s ({took})", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Benchmark results ({results['machine']['date']}{', quick mode' if args.quick else ''})",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items() if k != "date"),
        "",
    ]
    for r in results["benchmarks"]:
        lines += [f"## {r['name']}", "", "| measure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in r.items() if k != "name"]
        lines.append("")
    (out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {out / 'results.json'}, {out / 'results.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
