"""`python -m benchmarks [--quick] [NAME ...]`: run, print, and write results (JSON and Markdown)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import genie_core

from . import _ipyparallel

ALL = [
    "monitor_overhead",
    "remote_tensors",
    "bulk_transfer",
    "tensor_bytes",
    "across_hosts",
    "host_copies",
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


# Seconds each takes in a quick run, two at a time on the 2-core VM (2026-11-25; 2.5 if not named),
# to balance lanes by; those that use the ipyparallel cluster (one per process) share a lane.
QUICK_SECONDS = {
    "pool": 22,
    "bulk_transfer": 13,
    "soak": 12,
    "llm": 10,
    "failure_detection": 6,
    "sandbox": 6,
    "monitor_overhead": 5,
    "remote_tensors": 5,
    "tensor_bytes": 8,
    "across_hosts": 14,
    "host_copies": 1,
    "message_signing": 5,
}
IPYPARALLEL_USERS = {"bulk_transfer", "cell_roundtrip", "connect_time"}


def lanes(names: list[str], jobs: int) -> list[list[str]]:
    """`names` dealt to `jobs` lanes, longest first to the least loaded, each lane in run order."""
    sharing = [n for n in names if n in IPYPARALLEL_USERS]
    units = [sharing] * bool(sharing) + [[n] for n in names if n not in IPYPARALLEL_USERS]
    load, dealt = [0.0] * jobs, [[] for _ in range(jobs)]  # type: list[float], list[list[str]]
    for unit in sorted(units, key=lambda u: -sum(QUICK_SECONDS.get(n, 2.5) for n in u)):
        lane = load.index(min(load))
        dealt[lane] += unit
        load[lane] += sum(QUICK_SECONDS.get(n, 2.5) for n in unit)
    return [sorted(lane, key=names.index) for lane in dealt if lane]


def run_all(names: list[str], quick: bool, minutes: float | None) -> list[dict]:
    """Each benchmark in turn, in this process. Quick: the shared ipyparallel cluster is launched
    first, so that its engine starts while the benchmarks before those that use it run."""
    if quick and IPYPARALLEL_USERS.intersection(names):
        _ipyparallel.launch()
    out = []
    last_user = max((i for i, name in enumerate(names) if name in IPYPARALLEL_USERS), default=-1)
    for i, name in enumerate(names):
        extra = {"minutes": minutes} if name == "soak" and minutes else {}
        start = time.perf_counter()
        result = importlib.import_module(f"benchmarks.{name}").run(quick=quick, **extra)
        result["benchmark_seconds"] = round(time.perf_counter() - start, 1)
        out.append(result)
        print(json.dumps(result, indent=1), file=sys.stderr)
        if i == last_user:
            _ipyparallel.stop()  # not idle beside the benchmarks after it
    return out


def run_lanes(names: list[str], jobs: int, quick: bool, minutes: float | None) -> list[dict]:
    """The benchmarks in `jobs` processes at once, each running its lane in turn (they compete for
    the machine: figures for checking that the benchmarks run, not for comparing)."""
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="genie-bench-lanes-") as folder:
        procs = []
        for i, lane in enumerate(lanes(names, jobs)):
            written = Path(folder) / f"{i}.json"
            argv = [sys.executable, "-m", "benchmarks", "--lane", str(written), *lane]
            argv += ["--quick"] * quick + (["--minutes", str(minutes)] if minutes else [])
            procs.append((subprocess.Popen(argv), written, lane))
        failed = [" ".join(lane) for proc, _, lane in procs if proc.wait() != 0]
        if failed:
            raise SystemExit(f"benchmarks failed: {'; '.join(failed)} (their output is above)")
        for _, written, _ in procs:
            results += json.loads(written.read_text())
    return sorted(results, key=lambda r: names.index(r["name"]))


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
        "--jobs", type=int, default=None, help="how many run at once, in separate processes (default 1; 2 with --quick)"
    )
    parser.add_argument("--lane", help=argparse.SUPPRESS)  # run_lanes: write the results to this file
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results"), help="folder for results.json and results.md"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in ALL]
    if unknown:
        parser.error(f"no benchmark named {', '.join(unknown)} (there are {', '.join(ALL)})")
    if args.lane:
        Path(args.lane).write_text(json.dumps(run_all(args.names, args.quick, args.minutes)))
        return 0
    jobs = args.jobs or (2 if args.quick else 1)
    results = {"machine": machine(), "quick": args.quick, "jobs": jobs, "benchmarks": []}
    began = time.perf_counter()
    if jobs > 1:
        results["benchmarks"] = run_lanes(args.names, jobs, args.quick, args.minutes)
    else:
        results["benchmarks"] = run_all(args.names, args.quick, args.minutes)
    took = ", ".join(f"{r['name']} {r['benchmark_seconds']:g} s" for r in results["benchmarks"])
    at_once = f", {jobs} at a time" if jobs > 1 else ""
    print(f"{len(args.names)} benchmark(s) in {time.perf_counter() - began:.0f} s{at_once} ({took})", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Benchmark results ({results['machine']['date']}{', quick mode' if args.quick else ''}{at_once})",
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
