"""`%genie_init`, `%%remote` (also in the background), `%genie_jobs`, `%genie_push`, `%genie_pull`,
`%genie_shutdown`."""

from __future__ import annotations

import contextlib
import io
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import clear_output, display, publish_display_data

import genie_core
from genie_core import Client, Job, Request, contents, current_client, remote_error

from . import autoremote
from .feed import ClusterFeed
from .pool_feed import PoolFeed
from .progress import TransferProgress
from .widgets import Dashboard, InitProgress, JobsView, PoolDashboard

_feeds: dict[int, ClusterFeed] = {}


def feed_for(state: genie_core.ClusterState) -> ClusterFeed:
    """One feed per connection, shared by every widget showing it."""
    feed = _feeds.get(id(state))
    if feed is None or feed.stopped:
        _feeds.clear()
        feed = _feeds[id(state)] = ClusterFeed(state)
    return feed


_pool_feeds: dict[int, PoolFeed] = {}


def pool_feed_for(state: genie_core.ClusterState) -> PoolFeed:
    """One pool feed per pool session, shared by every pool dashboard showing it."""
    feed = _pool_feeds.get(id(state))
    if feed is None or feed.stopped:
        _pool_feeds.clear()
        watcher = state.pool.copy()  # the feed's own connection, asked once a second
        watcher.timeout = 5.0
        feed = _pool_feeds[id(state)] = PoolFeed(watcher.ask_status, state.pool.address, on_stop=watcher.close)
    return feed


INTERRUPT_GRACE = 5.0  # seconds to wait for the remote side after an interrupt


def render(msg_type: str, content: Mapping[str, Any]) -> None:
    """Show one remote output in this kernel, as if the local cell had produced it."""
    if msg_type == "stream":
        text = cast(contents.Stream, content)
        stream = sys.stderr if text.get("name") == "stderr" else sys.stdout
        stream.write(text.get("text", ""))
        stream.flush()
    elif msg_type in ("display_data", "execute_result", "update_display_data"):
        shown = cast(contents.DisplayData, content)  # an execute_result is one with its execution count
        publish_display_data(
            shown.get("data", {}),
            shown.get("metadata") or {},
            transient=shown.get("transient") or None,
            **({"update": True} if msg_type == "update_display_data" else {}),
        )
    elif msg_type == "clear_output":
        clear_output(wait=bool(cast(contents.ClearOutput, content).get("wait")))


@contextlib.contextmanager
def _interrupts_held() -> Iterator[list[int]]:
    """Hold the notebook's interrupt presses for the block (the list collects them); the caller acts
    on them, so no KeyboardInterrupt escapes halfway through sending a request or taking a reply."""
    presses: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield presses
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: presses.append(signum))
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt(client: Client, request: Request) -> float:
    """Send one interrupt for `request` (presses while it is sent are part of it); when it was sent."""
    with _interrupts_held():
        client.interrupt(request)
    return time.monotonic()


def run_remote(
    client: Client, code: str, *, gpu: int | None = None, timeout: float | None = None
) -> contents.ExecuteReply:
    """Run `code` remotely, rendering its output live; the notebook's interrupt interrupts it
    (each press sends one more interrupt, for code that swallowed the first). Presses are held for
    the whole cell and acted on between replies, so none can drop a reply taken from its queue."""
    with _interrupts_held() as pressed:
        request = client.execute(code, gpu=gpu)
        error: contents.Error | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted_at = None
        while True:
            if pressed:  # checked between replies (the wait for one polls every 0.1 s)
                pressed.clear()
                interrupted_at = _interrupt(client, request)
            msg = request.next(timeout=0.1)
            if msg is None:
                now = time.monotonic()
                if interrupted_at is None and deadline is not None and now > deadline:
                    interrupted_at = _interrupt(client, request)
                elif interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE:
                    break
            elif msg.type == "error":
                error = cast(contents.Error, msg.content)
            elif msg.type == "execute_reply":
                reply = cast(contents.ExecuteReply, msg.content)
                if error is not None:
                    raise remote_error(error)
                if reply.get("status") != "ok":
                    raise remote_error(reply)
                return reply
            else:
                render(msg.type, msg.content)
    _give_up(deadline)


def _give_up(deadline: float | None) -> NoReturn:
    """The remote cell ignored an interrupt for INTERRUPT_GRACE seconds: hand the notebook back."""
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(
            f"the remote cell ran past its --timeout and did not stop within {INTERRUPT_GRACE:g} s of an interrupt"
        )
    raise KeyboardInterrupt(
        f"the remote cell did not stop within {INTERRUPT_GRACE:g} s of an interrupt; it may still be running on "
        "the server (interrupt again, or %genie_shutdown to end the session and its worker)"
    )


@contextlib.contextmanager
def _progress(label: str) -> Iterator[TransferProgress]:
    bar = TransferProgress(label)
    try:
        yield bar
    finally:
        bar.finish()


def _client(what: str) -> Client:
    """The connected client; first, say what became of requests cut off by a lost connection."""
    client = current_client(what)
    for lost in client.take_settled():
        print(f"genie: {lost.describe()}" + (f"; its output:\n{lost.output}" if lost.output else ""), file=sys.stderr)
    return client


def _remote_client(what: str) -> Client:
    """The client, for running remote code: files under a `%genie_sync`ed directory that changed
    since are synced first (a local scan; nothing is sent when nothing changed)."""
    client = _client(what)
    report = client.sync_if_changed()
    if report is not None and (report.sent or report.removed):
        print(f"genie: {report}", file=sys.stderr)
    return client


def _size(text: str) -> int:
    return genie_core.parse_size(text)


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").replace(" ", ",").split(",") if n.strip()]


@magics_class
class GenieMagics(Magics):
    @magic_arguments()
    @argument(
        "address",
        nargs="?",
        default=None,
        help="host, host:port or genie://host:port; none (or `local`) starts an embedded local server",
    )
    @argument(
        "--token",
        default=None,
        help="the server's token (else $GENIE_TOKEN, the connection file, or a local server's connection file)",
    )
    @argument("--connection-file", default=None, help="connection file written by `genie serve`")
    @argument("--timeout", type=float, default=None, help="seconds to wait for the server (default 30)")
    @argument(
        "--gpus",
        default=None,
        help="a pool: how many GPUs to ask for (default 1); an embedded server: GPU indices, e.g. 0,1",
    )
    @argument(
        "--accelerator",
        default=None,
        metavar="TYPE",
        help="a pool: the GPU type, as its nodes declare it to Ray (e.g. A100)",
    )
    @argument(
        "--session",
        default=None,
        metavar="NAME",
        help="a named session: it outlives this kernel, and the same name attaches to it again "
        "(namespace, GPU memory and background jobs intact)",
    )
    @line_magic
    def genie_init(self, line: str) -> None:
        """Connect this notebook to a genie server (replacing any earlier connection)."""
        args = parse_argstring(self.genie_init, line)
        local = args.address in (None, "", "local")
        where = "an embedded local server" if local and not args.connection_file else (args.address or "")
        progress = InitProgress(target=where or "the server in the connection file")
        shown = display(progress, display_id=True)

        def on_phase(name: str, seconds: float) -> None:
            progress.phases = [*progress.phases, {"name": name, "seconds": seconds}]

        def on_wait(text: str) -> None:  # a full pool: the queue, live
            progress.summary = text

        try:
            state = genie_core.init_sync(
                master_addr=args.address,
                token=args.token,
                connection_file=args.connection_file,
                timeout=args.timeout,
                gpus=args.gpus if local else None,
                pool_gpus=_gpu_count(args.gpus) if not local and args.gpus is not None else None,
                pool_accelerator=args.accelerator,
                session_name=args.session,
                on_phase=on_phase,
                on_wait=on_wait,
            )
        except BaseException:
            progress.summary = f"✗ not connected to {progress.target} (why: below)"
            if shown is not None:
                shown.update(progress)
            raise
        progress.summary = summary(state)
        # Shown once: the widget draws it, and the text snapshot (front ends without widgets) is refreshed.
        if shown is not None:
            shown.update(progress)

    @magic_arguments()
    @argument("--text", action="store_true", help="a plain-text report instead of the live dashboard")
    @line_magic
    def genie_status(self, line: str) -> None:
        """The live dashboard of the connected server (GPU gauges, health, backend, events)."""
        args = parse_argstring(self.genie_status, line)
        state = genie_core.get_cluster_state()
        if args.text or state.client is None:
            from rich.console import Console

            text = io.StringIO()
            # Plain text, never rich's Jupyter display (which wraps at 115 columns); lines are not
            # wrapped here: the notebook wraps them at the window's width, whatever that is.
            console = Console(file=text, width=200, color_system=None, force_jupyter=False, soft_wrap=True)
            console.print(genie_core.render_status(_client("%genie_status").info()))
            print(text.getvalue())
            _print_pool(state)
            return
        display(feed_for(state).attach(Dashboard()))
        if state.pool is not None:  # a pool's session: the pool too, live
            display(pool_feed_for(state).attach(PoolDashboard()))

    @magic_arguments()
    @argument("--gpu", type=int, default=None, help="run on the worker of this GPU (default: the session's GPU)")
    @argument("--push", default=None, help="local variables to send first, e.g. a,b")
    @argument("--pull", default=None, help="remote variables to bring back after, e.g. c,d")
    @argument(
        "--to", default=None, help="put pushed tensors on this remote device, e.g. cuda (default: the remote CPU)"
    )
    @argument("--timeout", type=float, default=None, help="interrupt the cell after this many seconds")
    @argument(
        "--bg",
        action="store_true",
        help="run in the background: return at once with a Job (also in `_`); later remote work queues behind it",
    )
    @argument("--name", default=None, help="a name for the background job (default job-1, job-2, ...)")
    @line_cell_magic
    def remote(self, line: str, cell: str | None = None) -> Job | None:
        """Run the cell (or, as `%remote STATEMENT`, one line) on the genie server."""
        if cell is None:
            client = _remote_client("using %remote")
            _say_queued(client)
            run_remote(client, line)
            return None
        args = parse_argstring(self.remote, line)
        if args.bg and (args.pull or args.timeout is not None):
            raise UsageError("%%remote --bg returns at once: use job.wait() or job.cancel(), then %genie_pull")
        if args.name is not None and not args.bg:
            raise UsageError("%%remote --name names a background job: add --bg")
        client = _remote_client("running a %%remote cell")
        push = _names(args.push)
        if push:
            with _progress("push") as bar:
                client.push(self._local_values(push, "--push"), gpu=args.gpu, device=args.to, progress=bar)
        if args.bg:
            job = client.start_job(cell, name=args.name, gpu=args.gpu)
            print(f"started background job {job.name!r}: %genie_jobs lists it; job.output(), job.wait(), job.cancel()")
            return job
        _say_queued(client)
        run_remote(client, cell, gpu=args.gpu, timeout=args.timeout)
        pull = _names(args.pull)
        if pull:
            with _progress("pull") as bar:
                self._user_ns.update(client.pull(pull, gpu=args.gpu, progress=bar))
        return None

    @magic_arguments()
    @argument("name", nargs="?", default=None, help="one job: return it (its output and result)")
    @argument("--text", action="store_true", help="a plain-text table instead of the live widget")
    @line_magic
    def genie_jobs(self, line: str) -> Job | None:
        """The session's background jobs: state, elapsed time, the last lines of output."""
        args = parse_argstring(self.genie_jobs, line)
        jobs = _client("%genie_jobs").jobs()
        if args.name is not None:
            found = [j for j in jobs if j.name == args.name]
            if not found:
                names = ", ".join(j.name for j in jobs) or "none yet"
                raise UsageError(f"%genie_jobs: no job named {args.name!r} in this session (jobs: {names})")
            return found[-1]
        if args.text or not jobs:
            print(jobs_table(jobs))
            return None
        display(JobsView(jobs))
        return None

    @line_magic
    def genie_push(self, line: str) -> None:
        """`%genie_push a b [--to cuda]`: send local variables to the session's worker."""
        words = shlex.split(line)
        device = None
        if "--to" in words:
            at = words.index("--to")
            if at + 1 >= len(words):
                raise UsageError("%genie_push: --to needs a device, e.g. --to cuda")
            device = words[at + 1]
            del words[at : at + 2]
        if not words:
            raise UsageError("%genie_push needs variable names, e.g. %genie_push x y")
        client = _client("%genie_push")
        _say_queued(client)
        with _progress("push") as bar:
            client.push(self._local_values(words, "%genie_push"), device=device, progress=bar)

    @line_magic
    def genie_pull(self, line: str) -> None:
        """`%genie_pull a b`: bring variables back from the session's worker."""
        names = shlex.split(line)
        if not names:
            raise UsageError("%genie_pull needs variable names, e.g. %genie_pull x y")
        client = _client("%genie_pull")
        _say_queued(client)
        with _progress("pull") as bar:
            self._user_ns.update(client.pull(names, progress=bar))

    @magic_arguments()
    @argument("path", nargs="?", default=".", help="the directory to sync (default: the notebook's)")
    @argument("--off", action="store_true", help="stop syncing before each remote cell")
    @argument("--max-file", type=_size, default=None, help="largest data file sent, e.g. 4MiB (default 1 MiB)")
    @argument("--max-total", type=_size, default=None, help="largest sync, e.g. 200MiB (default 50 MiB)")
    @line_magic
    def genie_sync(self, line: str) -> None:
        """Send this directory's Python files and small data files to the session (content-hashed;
        .gitignore honoured); from then on, changed files are sent before each remote cell and
        their modules re-imported there."""
        args = parse_argstring(self.genie_sync, line)
        client = _client("%genie_sync")
        if args.off:
            client.code_sync = None
            print("genie: files are no longer synced before remote cells (those on the server stay).")
            return
        print(client.sync(args.path, max_file=args.max_file, max_total=args.max_total))

    @line_magic
    def autoremote(self, line: str) -> None:
        """`%autoremote on|off`: until turned off, every cell runs on the server (as with %%remote)."""
        word = line.strip().lower() or ("off" if autoremote.is_on(self.shell) else "on")
        if word not in ("on", "off"):
            raise UsageError(f"%autoremote takes on or off, not {line.strip()!r}")
        if word == "off":
            autoremote.turn_off(self.shell)
            print("autoremote off: cells run in this kernel again.")
            return
        client = _client("%autoremote on")
        autoremote.turn_on(self.shell)
        print(
            f"autoremote on: every cell now runs on genie://{client.address} (session {client.session[:8]}); "
            "%autoremote off to stop (%genie_ magics and %% cells stay local)."
        )

    @magic_arguments()
    @argument("local", help="the file here")
    @argument(
        "remote", nargs="?", default=None, help="where on the server (default: its name, in the session directory)"
    )
    @line_magic
    def genie_upload(self, line: str) -> None:
        """Copy a file to the server over the data plane, with a progress bar; checksummed, and
        continued where it stopped if the connection drops (or when run again)."""
        args = parse_argstring(self.genie_upload, line)
        client = _client("%genie_upload")
        _say_queued(client)
        with _progress("upload") as bar:
            print(f"uploaded {client.upload(args.local, args.remote, progress=bar)}")

    @magic_arguments()
    @argument("remote", help="the file on the server (relative: in the session directory)")
    @argument("local", nargs="?", default=None, help="where here (default: its name, in this directory)")
    @line_magic
    def genie_download(self, line: str) -> None:
        """Copy a file from the server here, as %genie_upload does the other way."""
        args = parse_argstring(self.genie_download, line)
        client = _client("%genie_download")
        _say_queued(client)
        with _progress("download") as bar:
            print(f"downloaded {client.download(args.remote, args.local, progress=bar)}")

    @line_magic
    def genie_shutdown(self, line: str) -> None:
        """End the session (its worker and GPU memory) and any embedded server."""
        if autoremote.is_on(self.shell):
            autoremote.turn_off(self.shell)
            print("autoremote off.")
        was = genie_core.is_initialized()
        for feed in _pool_feeds.values():  # the pool session is over: its dashboard stops asking
            feed.stop()
        _pool_feeds.clear()
        genie_core.shutdown_sync()
        print("Genie session closed." if was else "Genie was not connected.")

    def _local_values(self, names: list[str], what: str) -> dict[str, Any]:
        user_ns = self._user_ns
        missing = [n for n in names if n not in user_ns]
        if missing:
            raise UsageError(f"{what}: not defined in this notebook: {', '.join(missing)}")
        return {n: user_ns[n] for n in names}

    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None  # magics run in the shell that registered them
        namespace: dict[str, Any] = self.shell.user_ns
        return namespace


def _say_queued(client: Client) -> None:
    """Remote work sent while a background job runs waits behind it on the worker: say so."""
    running = client.running_jobs()
    if running:
        job = running[0]
        print(
            f"genie: this waits behind background job {job.name!r} (running {job.elapsed:.0f} s); "
            "interrupting it cancels this, not the job (job.cancel() does that)",
            file=sys.stderr,
        )


def jobs_table(jobs: list[Job]) -> str:
    if not jobs:
        return "No background jobs in this session (start one with %%remote --bg)."
    rows = [f"{'name':<16} {'state':<8} {'elapsed':>9}  last output"]
    for job in jobs:
        last = job.tail(1).replace("\t", " ")
        rows.append(f"{job.name[:16]:<16} {job.state:<8} {job.elapsed:>8.1f}s  {last[-80:]}")
    return "\n".join(rows)


def _print_pool(state: genie_core.ClusterState) -> None:
    """A session a pool placed: the pool too (nodes, who holds which GPU, the queue)."""
    if state.pool is None:
        return
    print(f"the pool at {state.pool.address}:\n{genie_core.render_pool(state.pool.status())}")


def _gpu_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise genie_core.ConfigError(f"--gpus {text!r}: a pool takes a number of GPUs, e.g. --gpus 2") from None
    if count < 0:
        raise genie_core.ConfigError(f"--gpus {count}: expected 0 or more")
    return count


def summary(state: genie_core.ClusterState) -> str:
    node = state.node
    gpus = node.get("gpus") or []
    where = "embedded local server" if state.embedded else "genie server"
    simulated = node.get("simulated_gpus") or 0
    if gpus:
        gpu_text = ", ".join(f"GPU {g['index']}: {g.get('name', '?')}" for g in gpus)
    elif simulated:
        gpu_text = f"{simulated} simulated GPU{'s' if simulated != 1 else ''} (fake readings, --simulate-gpus)"
    else:
        gpu_text = f"CPU only ({node.get('gpu_reason') or 'no GPU'})"
    took = sum(s for _, s in state.phases)
    client = state.client
    session = client.session[:8] if client else "-"
    text = (
        f"Connected to {where} genie://{state.address} "
        f"(node {node.get('node_id', '?')}; {gpu_text}; session {session}) in {took:.2f} s"
    )
    placed = state.placement
    if placed is not None:
        held = ", ".join(
            f"GPU {i} ({n})" for i, n in zip(placed["gpu_ids"], placed.get("gpu_names") or [], strict=False)
        )
        text += f"\nplaced on {placed['node']}, {held or 'no GPU'}; {placed['free']} of {placed['total']} GPUs free" + (
            f" (waited {placed['waited']:.0f} s)" if placed.get("waited", 0) >= 1 else ""
        )
    if client is not None and client.session_name:
        if client.attached:
            age = _age(time.time() - (client.session_created or time.time()))
            running = len(client.running_jobs())
            text += (
                f"\nreattached to session {client.session_name!r}, {age} old, "
                f"{running} job{'s' if running != 1 else ''} running"
            )
        else:
            text += f"\nnew session {client.session_name!r}: it outlives this kernel; %genie_shutdown ends it"
    return "\n".join([text, *(f"warning: {w}" for w in (client.version_warnings if client else []))])


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"
