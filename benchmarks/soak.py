"""A soak: 4 client processes for N minutes against one server, each mixing cells, pushes and
pulls, remote-tensor work, interrupts and reconnects. The server's RSS, open file descriptors,
threads and /dev/shm use are sampled throughout; after the warm-up they must stay flat, and no
error may happen other than the KeyboardInterrupts the clients asked for.

`python -m benchmarks soak --minutes N` (default 2; `--quick`: 3 seconds, 2 clients)."""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from genie_core.dataplane import memcopy
from genie_core.dataplane.hashing import HASHERS
from genie_core.server.admission import VERIFIERS

from . import _servers

CLIENTS = 4
OPS = {"cell": 5, "push_pull": 3, "remote_tensors": 3, "interrupt": 1, "reconnect": 1}
SAMPLE_EVERY = 2.0  # seconds
WARM_UP = 0.25  # of the run: sessions, workers, allocator pools and caches settle


def _client(address: str, token: str, phases: tuple[float, float], seed: int, results: Any, go: Any) -> None:
    """One client process: a warm-up, then (once the server's baseline is read, `go`) the soak.
    Each phase opens a session, does random operations until its time is up and closes it; what
    it did and every failure go on `results`."""
    rng = random.Random(seed)
    warm_up, soak = phases
    _every_data_plane(address, token)
    results.put((seed, *_operate(address, token, warm_up, rng)))
    go.wait()
    results.put((seed, *_operate(address, token, soak, rng)))


def _every_data_plane(address: str, token: str) -> None:
    """A push and pull of 1 MiB on each data plane (discovery picks any of them under load): what
    each starts once in the server is then in the baseline (pyzmq's garbage collector, a thread and a
    zmq context of its own, starts at the first big frame the server forwards inline)."""
    import torch

    import genie_core

    t = torch.arange(1 << 20, dtype=torch.uint8)
    for backend in ("zmq", "tcp", "shm"):
        state = genie_core.init_sync(address, token=token, timeout=30, backend=backend)
        try:
            state.client.push({"t": t}, timeout=60)
            assert torch.equal(state.client.pull(["t"], timeout=60)["t"], t)
        finally:
            genie_core.shutdown_sync()


def _operate(address: str, token: str, seconds: float, rng: random.Random) -> tuple[dict[str, int], list[str]]:
    import torch

    import genie_core

    counts: dict[str, int] = {}
    errors: list[str] = []
    state = genie_core.init_sync(address, token=token, timeout=30)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
        try:
            client = state.client
            if op == "cell":
                n = rng.randrange(1000)
                out = [m for m in client.execute(f"print(sum(range({n})))").replies(60) if m.type == "stream"]
                assert "".join(m.content["text"] for m in out) == f"{sum(range(n))}\n", out
            elif op == "push_pull":
                t = torch.randint(0, 255, (rng.choice([1 << 10, 1 << 16, 1 << 20, 1 << 24]),), dtype=torch.uint8)
                client.push({"t": t}, timeout=60)
                assert torch.equal(client.pull(["t"], timeout=60)["t"], t)
            elif op == "remote_tensors":
                x = torch.randn(128, 128)
                y = x.to("remote_accelerator:0")
                for _ in range(rng.randrange(1, 200)):
                    y = y * 0.5 + 1
                    x = x * 0.5 + 1
                assert torch.equal(y.cpu(), x)
            elif op == "interrupt":
                cell = client.execute("import time\nprint('started', flush=True)\ntime.sleep(60)")
                next(m for m in cell.replies(60) if m.type == "stream")  # a fresh session's worker may be starting
                client.interrupt(cell)
                sent_at = time.time()
                try:
                    last = list(cell.replies(10))[-1]
                except TimeoutError:
                    raise AssertionError(
                        f"the interrupted cell {cell.id} did not end within 10 s (interrupt sent {sent_at:.3f})"
                    ) from None
                assert last.content.get("ename") == "KeyboardInterrupt", last.content
            else:
                genie_core.shutdown_sync()
                state = genie_core.init_sync(address, token=token, timeout=30)
            counts[op] = counts.get(op, 0) + 1
        except Exception as exc:
            errors.append(f"{op}: {type(exc).__name__}: {exc}"[:300])
    genie_core.shutdown_sync()
    return counts, errors


def _shm_bytes(owners: set[int]) -> int:
    """Bytes in the segments these processes made (a segment's name carries its creator's pid);
    other tests may run beside the soak."""
    total = 0
    for p in Path("/dev/shm").glob("genie-*") if Path("/dev/shm").is_dir() else ():
        parts = p.name.split("-")
        if len(parts) >= 4 and parts[2].isdigit() and int(parts[2]) in owners:
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # unlinked between the listing and the stat: a segment's normal end
                continue
    return total


def _sample(server: psutil.Process, owners: set[int]) -> dict[str, float]:
    """One reading of the server; its workers join `owners`, whose segments are counted."""
    children = server.children()
    owners.update(child.pid for child in children)
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{server.pid}/status").read_text().splitlines() if ":" in line
    )
    kib = {k: int(status[k].split()[0]) for k in ("RssAnon", "RssShmem") if k in status}
    return {
        "rss_mib": server.memory_info().rss / 2**20,
        "anon_mib": kib.get("RssAnon", 0) / 1024,
        "shmem_mib": kib.get("RssShmem", 0) / 1024,
        "fds": server.num_fds(),
        "threads": server.num_threads(),
        "shm_mib": _shm_bytes(owners) / 2**20,
        "workers": len(children),
    }


def _clients(ctx: Any, info: Any, n: int, phases: tuple[float, float]) -> tuple[list[Any], Any, Any]:
    """Start n client processes (a warm-up and a soak each, see `_client`); they report on the
    returned queue and start the soak when the returned event is set."""
    results, go = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_client, args=(f"{info.ip}:{info.port}", info.token, phases, seed, results, go))
        for seed in range(n)
    ]
    for p in procs:
        p.start()
    return procs, results, go


def _thread_names(pid: int) -> dict[str, int]:
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


# Thread pools the server grows on first use, up to a fixed size (genie_core.threads names them):
# threads in them are not a leak while each pool stays within its size.
POOLS = {"genie-verify": VERIFIERS, "genie-hash": HASHERS, "genie-copy": memcopy.THREADS - 1}


def _pooled(names: dict[str, int]) -> dict[str, int]:
    return {pool: sum(n for name, n in names.items() if name.startswith(pool + "_")) for pool in POOLS}


def run(quick: bool = False, minutes: float | None = None) -> dict:
    seconds = 3.0 if quick else 60.0 * (2.0 if minutes is None else minutes)
    clients = 2 if quick else CLIENTS
    proc, info = _servers.start("--no-ucx")
    server = psutil.Process(proc.pid)
    owners = {server.pid}  # the server, its workers and the soak's clients
    shm_before = _shm_bytes(owners)
    ctx = multiprocessing.get_context("spawn")
    samples: list[tuple[float, dict[str, float]]] = []
    procs: list[Any] = []
    try:
        # Warm-up: the soak's clients do everything once or more and close their sessions; what
        # the server keeps from then on (thread pools grown to their size under concurrent load,
        # caches) is the baseline. The same processes then soak (one start of each).
        procs, results, go = _clients(ctx, info, clients, (1.0 if quick else 15.0, seconds))
        owners.update(p.pid for p in procs if p.pid)
        for _ in procs:
            results.get(timeout=120)
        time.sleep(1.0 if quick else 3.0)
        baseline = _sample(server, owners)
        threads_before = _thread_names(server.pid)
        go.set()
        start = time.monotonic()
        while any(p.is_alive() for p in procs) and time.monotonic() - start < seconds + 120:
            samples.append((time.monotonic() - start, _sample(server, owners)))
            time.sleep(SAMPLE_EVERY / 4 if quick else SAMPLE_EVERY)
        reports = [results.get(timeout=30) for _ in procs]
        # sessions closed by their clients: workers end, connections close, segments go (up to 40 s:
        # under load, a closed client's zmq context and sockets in the server went after more than 10 s)
        for _ in range(80):
            time.sleep(0.5)
            after = _sample(server, owners)
            settled = all(after[k] <= baseline[k] for k in ("fds", "threads", "workers", "shmem_mib"))
            if settled and _shm_bytes(owners) <= shm_before:
                break
        threads_after = _thread_names(server.pid)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        _servers.stop(proc)
    counts: dict[str, int] = {}
    errors = [e for _, _, errs in reports for e in errs]
    for _, c, _ in reports:
        for op, n in c.items():
            counts[op] = counts.get(op, 0) + n
    settled = [s for t, s in samples if t >= WARM_UP * seconds]
    early, late = settled[: max(1, len(settled) // 3)], settled[-max(1, len(settled) // 3) :]
    rss = [statistics.median(s["rss_mib"] for s in part) for part in (early, late)]
    # The server's own memory: RSS less the shared-memory segments it has mapped at that moment
    # (clients' segments, which /dev/shm accounts for; a probe's 16 MiB is mapped for a moment).
    anon = [statistics.median(s["anon_mib"] for s in part) for part in (early, late)]
    left = {key: after[key] - baseline[key] for key in ("fds", "threads", "workers")}
    left["mapped_shmem_mib"] = round(after["shmem_mib"] - baseline["shmem_mib"], 1)  # unlinked, still mapped
    pooled_before, pooled_after = _pooled(threads_before), _pooled(threads_after)
    left["threads"] -= sum(pooled_after.values()) - sum(pooled_before.values())
    pools_within_size = all(pooled_after[pool] <= size for pool, size in POOLS.items())
    shm_left = round((_shm_bytes(owners) - shm_before) / 2**20, 1)
    # Judged idle: before the soak's clients came and after they went. Under load the server's
    # memory also holds whatever big messages are in flight (a client whose discovery picked zmq
    # sends 16 MiB pushes and pulls through it), so medians under load are reported, not judged.
    idle = [baseline["anon_mib"], after["anon_mib"]]
    flat = (
        idle[1] - idle[0] < 10
        and left["fds"] <= 0
        and left["threads"] <= 0
        and left["workers"] <= 0
        and left["mapped_shmem_mib"] <= 0
        and shm_left <= 0
        and pools_within_size
    )
    return {
        "name": "soak",
        "seconds": round(seconds),
        "clients": clients,
        "operations": counts,
        "errors": len(errors),
        "error_examples": errors[:5],
        "samples": len(samples),
        "server_rss_mib_first_third_last_third": [round(r, 1) for r in rss],
        "server_anon_mib_first_third_last_third": [round(r, 1) for r in anon],
        "server_anon_mib_idle_before_after": [round(r, 1) for r in idle],
        "server_shmem_mib_samples_max_and_mapped_share": [
            round(max(s["shmem_mib"] for _, s in samples), 1),
            round(sum(1 for _, s in samples if s["shmem_mib"] > 0) / max(1, len(samples)), 2),
        ],
        "server_rss_mib_max": round(max(s["rss_mib"] for _, s in samples), 1),
        "server_rss_mib_by_minute_anon_shmem": [
            [round(s["anon_mib"], 1), round(s["shmem_mib"], 1)] for t, s in samples if int(t) % 60 < SAMPLE_EVERY
        ],
        "baseline_fds_threads_workers": [baseline["fds"], baseline["threads"], baseline["workers"]],
        "left_after_clients_went": left,
        "threads_by_name_baseline_end": [threads_before, threads_after],
        "pool_threads_end_and_size": {pool: [pooled_after[pool], size] for pool, size in POOLS.items()},
        "shm_mib_left_after_clients_went": shm_left,
        "target": (
            "zero errors other than the interrupts asked for; the server's own (anonymous) memory, idle, grows "
            "< 10 MiB from before the soak's clients to after; fds, threads, workers, mapped and /dev/shm shared "
            "memory back to the warm-up baseline once the clients have gone"
        ),
        "met": not errors and flat,
    }
