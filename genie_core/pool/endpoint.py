"""`genie pool up`: the notebook-facing endpoint of a pool of GPU machines run by Ray.

A user's `%genie_init pool-host:5555` asks here for a session; the pool queues the request
(FIFO, quotas), asks Ray for a session actor with the GPUs (Ray picks the node), and answers with
the address of the session's own genie server and its token, sealed for that user. Cells and
tensors then go straight to that server. The endpoint watches Ray's node table and each session
actor: a node that dies has its sessions reported lost to their clients. A warm session per node
(warm.py) lets a one-GPU session skip the seconds Ray takes to start an actor.

Its parts: intake.py (requests in, answers out), placement.py (where an ask fits), actors.py (each
session's actor, from creation to end; live.py is the session), nodes.py (the node table and
readings), audit.py (who ran what), status.py, recovery.py (after a restart).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from typing import Any

import zmq

from ..sandbox import Protection, refuse_unisolated
from . import placement
from .actors import SessionActors
from .audit import Audit
from .intake import Incoming, Intake
from .live import LiveSession
from .monitor_actor import PREFIX as MONITOR_PREFIX
from .monitor_actor import NodeMonitor
from .nodes import Nodes, host_addresses
from .queue import Ask, Queue, QuotaExceeded, check_quota
from .recovery import recover
from .registry import Registry
from .session_actor import NAMESPACE, PREFIX, SessionActor
from .status import pool_status
from .warm import WarmSession, WarmSessions

log = logging.getLogger("genie.pool")

DAY = 86400.0
HISTORY_KEPT = 7 * DAY  # readings older than this leave the registry


class Pool:
    """`Pool(...).start()` connects to Ray and binds; `serve_forever()` or `start_in_thread()` runs it."""

    def __init__(
        self,
        ray_address: str | None = None,
        db: str | None = None,
        ip: str = "127.0.0.1",
        port: int = 5555,
        simulate_gpus: bool = False,
        idle_timeout: float = 0.0,
        session_lease: float | None = None,
        queue_timeout: float = 600.0,
        node_poll: float = 0.5,
        history_every: float = 30.0,
        warm_sessions: bool = True,
        isolation: dict[str, Any] | None = None,
    ) -> None:
        self.ray_address = ray_address
        # the sessions' sandbox: ClusterConfig's sandbox settings (sandbox, session_network, ...)
        self.isolation = {"sandbox": True, **(isolation or {})}
        self.protections: list[Protection] = []  # the sandbox's, as probed at start
        self.registry = Registry(db)
        self.ip, self.port = ip, port
        self.simulate_gpus = simulate_gpus
        self.idle_timeout = idle_timeout  # a session with no client and nothing running ends after this
        self.session_lease = session_lease  # how long a session's server waits for a silent client
        self.queue_timeout = queue_timeout
        self.node_poll = node_poll
        self.history_every = history_every  # seconds between a node's readings kept in the registry
        self.queue = Queue()
        self.nodes = Nodes(history_every)
        self.intake = Intake(self.registry)
        self.audit = Audit(self.registry, self.nodes.name)
        self.actors = SessionActors(
            registry=self.registry,
            intake=self.intake,
            queue=self.queue,
            audit=self.audit,
            nodes=self.nodes,
            free=self._free,
            read_nodes=self._read_nodes,
        )
        self.sessions = self.actors.sessions  # session id -> LiveSession
        self._history_written = self._history_trimmed = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._actor_class: Any = None
        self._monitor_class: Any = None
        self._nodes_read = 0.0
        self.warm = WarmSessions(self._start_warm, enabled=warm_sessions)  # one a node, for the next user

    # -- life --------------------------------------------------------------------------
    def start(self) -> Pool:
        import ray

        self.protections = refuse_unisolated(self.isolation)  # each one on or off, said at start
        if not ray.is_initialized():
            ray.init(address=self.ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
        # max_concurrency: info() answers while wait_ended() blocks
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 4}
        self._actor_class = ray.remote(**options)(SessionActor)
        self._monitor_class = ray.remote(num_cpus=0, max_restarts=-1)(NodeMonitor)
        self._ctx = zmq.Context()
        self.port = self.intake.bind(self._ctx, self.ip, self.port)
        self.readings_sock = self._ctx.socket(zmq.PULL)
        self.readings_sock.linger = 0
        self.readings_sock.maxmsgsize = 1 << 20
        readings_port = self.readings_sock.bind_to_random_port(f"tcp://{self.ip}")
        reachable = ray.util.get_node_ip_address() if self.ip in ("0.0.0.0", "*", "::") else self.ip
        self.sink = f"tcp://{reachable}:{readings_port}"  # where the node monitors send
        self._read_nodes()
        for placed in recover(self.registry):
            self.actors.running(placed)
        return self

    def start_in_thread(self) -> Pool:
        self._thread = threading.Thread(target=self.serve_forever, name="genie-pool", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the endpoint; running sessions go on (their actors are detached)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def serve_forever(self) -> None:
        self.thread_id = threading.get_native_id()  # the benchmark measures this thread's CPU
        router = self.intake.router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self.readings_sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self.readings_sock in ready:
                    try:
                        self.nodes.drain(self.readings_sock)
                    except Exception:  # a reading of another shape (an older monitor) must not end the pool
                        log.exception("a node reading could not be taken")
                if router in ready:
                    for _ in range(100):
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        try:
                            incoming = self.intake.receive(frames)
                            if incoming is not None:
                                self._on_request(incoming)
                        except Exception:  # one bad request, or Ray failing it, must not end the pool
                            log.exception("a request failed")
                try:
                    self._tick()
                except Exception:  # Ray's control store unreachable for a moment: try again next tick
                    log.exception("watching Ray failed")
                    time.sleep(0.5)
        finally:
            with contextlib.suppress(Exception):  # each holds a GPU: they must not outlive us
                self.warm.end_all()
            router.close()
            self.readings_sock.close()
            self._ctx.term()
            self.registry.close()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._nodes_read >= self.node_poll:
            self._read_nodes()
            self.actors.recheck_unreachable()
        if now - self._history_written >= self.history_every:
            self._history_written = now
            self.registry.add_readings(self.nodes.flush_history())
            if now - self._history_trimmed >= 3600:
                self._history_trimmed = now
                self.registry.forget_readings(time.time() - HISTORY_KEPT)
        if self.audit.due():
            self.audit.ask(self.sessions, skip=self.actors.unreachable)
        self.actors.collect()
        self.actors.expire(time.time())
        for ask in self.queue.expired(time.time()):
            self.registry.session_ended(ask.session_id, "queue timeout")
            waited = time.time() - ask.asked
            self.intake.answer(
                ask,
                {
                    "kind": "error",
                    "error": f"no {ask.gpus} GPU(s) came free within {waited:.0f} s; try again, or ask for fewer GPUs",
                },
            )
        self._place()
        self.warm.collect()
        if self.queue.head() is None and all(p.node_id for p in self.sessions.values()):
            self.warm.warm(self._free_by_node())  # only while no session waits for Ray's GPUs

    # -- requests ----------------------------------------------------------------------
    def _on_request(self, incoming: Incoming) -> None:
        request, user = incoming.request, incoming.user
        op, args = str(request.get("op")), dict(request.get("args") or {})
        reply: dict[str, Any] | None
        try:
            if op == "place":
                reply = self._on_place(incoming, args)
            elif op == "watch":
                reply = self._on_watch(incoming, [str(s) for s in args.get("sessions", [])])
            elif op == "end":
                reply = self._on_end(user.name, str(args.get("session", "")))
            elif op == "status":
                reply = {"kind": "status", **self.status(viewer=user.name)}
            else:
                reply = {"kind": "error", "error": f"unknown request {op!r}"}
        except QuotaExceeded as exc:
            reply = {"kind": "error", "error": str(exc)}
        except (ValueError, TypeError) as exc:  # arguments of the wrong kind: say which, keep serving
            reply = {"kind": "error", "error": f"a malformed {op!r} request: {exc}"[:300]}
        if reply is not None:
            self.intake.send(incoming.identity, incoming.key, {"re": request["id"], **reply})

    def _on_place(self, incoming: Incoming, args: dict[str, Any]) -> dict[str, Any] | None:
        user = incoming.user
        gpus = int(args.get("gpus", 1))
        accelerator = str(args.get("accelerator") or "")[:64]
        why_not = placement.never_fits(self.nodes.table, gpus, accelerator)
        if why_not:
            return {"kind": "error", "error": why_not}
        live = self.registry.sessions(user=user.name)
        check_quota(user, gpus, live, self.registry.gpu_hours(user.name, time.time() - DAY))
        session_id = secrets.token_hex(8)
        name = str(args.get("name") or "")[:64]
        wait = min(float(args.get("wait", self.queue_timeout)), self.queue_timeout)
        ask = Ask(
            session_id,
            user.name,
            name,
            gpus,
            time.time() + wait,
            incoming.identity,
            incoming.request["id"],
            incoming.key,
            accelerator=accelerator,
        )
        self.registry.session_asked(session_id, user.name, name, gpus)
        self.registry.event("asked", user.name, session_id, {"gpus": gpus})
        self.queue.add(ask)
        self._place()
        ahead = self.queue.positions().get(session_id)
        if ahead is None:  # being placed: "placed" follows when its actor is up
            return {"kind": "asked", "session": session_id, **self._free()}
        return {"kind": "queued", "session": session_id, "ahead": ahead, **self._free()}

    def _on_watch(self, incoming: Incoming, session_ids: list[str]) -> dict[str, Any]:
        """A client's keep-alive: notices about its sessions go to this connection."""
        known = []
        for session_id in session_ids:
            placed = self.sessions.get(session_id)
            if placed is not None and placed.user == incoming.user.name:
                placed.watcher, placed.key = incoming.identity, incoming.key
                known.append(session_id)
        return {"kind": "watching", "sessions": known}

    def _on_end(self, user: str, session_id: str) -> dict[str, Any]:
        placed = self.sessions.get(session_id)
        if placed is not None and placed.user == user:
            placed.ask = None  # nobody waits for its answer any more
            placed.actor.stop.remote()
            return {"kind": "ended", "session": session_id}
        if any(a.session_id == session_id and a.user == user for a in self.queue):
            self.queue.remove(session_id)
            self.registry.session_ended(session_id, "cancelled while waiting")
            return {"kind": "ended", "session": session_id}
        return {"kind": "error", "error": f"no session {session_id!r} of {user}"}

    # -- placement ---------------------------------------------------------------------
    def _free(self) -> dict[str, int]:
        return placement.free_and_total(self.nodes.table, self.sessions.values())

    def _free_by_node(self) -> dict[str, int]:
        return placement.free_by_node(self.nodes.table, self.sessions.values())

    def _place(self) -> None:
        while (ask := self.queue.head()) is not None:
            free = self._free_by_node()
            fits = placement.fits(ask, free, self.nodes.table)
            if not fits:
                return
            self.queue.pop_head()
            warm = self.warm.take(fits) if ask.gpus == 1 else None
            if warm is not None:
                self._claim(ask, warm)
            else:
                self.warm.make_room(fits, free, ask.gpus)
                self._create(ask)
            positions = self.queue.positions()
            for waiting in self.queue:
                reply = {"kind": "queued", "session": waiting.session_id, "ahead": positions[waiting.session_id]}
                self.intake.answer(waiting, {**reply, **self._free()})

    def _spec(self, token: str, session_id: str) -> dict[str, Any]:
        """What a session actor is made with (a warm one's session id is "" until it is claimed)."""
        # cells may not reach the cluster's machines (Ray's services, other sessions' servers), nor the registry's
        blocked = sorted(self.nodes.addresses() | host_addresses(self.registry.url))
        return {
            "token": token,
            "session": session_id,
            "host": self.ip if self.ip in ("127.0.0.1", "localhost") else "",
            "idle_timeout": self.idle_timeout,
            "session_lease": self.session_lease,
            "simulate_gpus": self.simulate_gpus,
            "isolation": {**self.isolation, "session_blocked": ",".join(blocked)},
        }

    def _start_warm(self, node_id: str, name: str, token: str) -> Any:
        """A warm session actor pinned to `node_id`, holding one GPU, nobody's yet."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return self._actor_class.options(
            name=PREFIX + name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_gpus=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(self._spec(token, ""))

    def _claim(self, ask: Ask, warm: WarmSession) -> None:
        """The session takes the warm one: its actor is up (or nearly), on its node, with its GPU."""
        placed = LiveSession.asked(ask, warm.actor, warm.token, node_id=warm.node_id, warm=True)
        self.actors.placing_on(placed, warm.actor.claim.remote(ask.session_id, self._spec(warm.token, ask.session_id)))

    def _create(self, ask: Ask) -> None:
        """Ask Ray for a session actor with the GPUs: Ray picks the node."""
        token = secrets.token_hex(24)
        options: dict[str, Any] = {"accelerator_type": ask.accelerator} if ask.accelerator else {}
        actor = self._actor_class.options(
            name=PREFIX + ask.session_id, namespace=NAMESPACE, lifetime="detached", num_gpus=ask.gpus, **options
        ).remote(self._spec(token, ask.session_id))
        self.actors.placing_on(LiveSession.asked(ask, actor, token), actor.info.remote())

    # -- Ray's view of the nodes -------------------------------------------------------
    def _read_nodes(self) -> None:
        import ray

        self._nodes_read = time.monotonic()
        self.nodes.update(ray.nodes(), on_death=self._node_died)
        for node_id, node in self.nodes.unwatched():
            self._watch_node(node_id, node)

    def _watch_node(self, node_id: str, node: dict[str, Any]) -> None:
        """A monitor actor pinned to the node (one that outlived a restarted pool is told where we are)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        key = self.nodes.key.hex()
        monitor = self._monitor_class.options(
            name=MONITOR_PREFIX + node_id,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(self.sink, key, node["gpus"] if self.simulate_gpus else 0)
        monitor.set_sink.remote(self.sink, key)
        self.nodes.monitors[node_id] = monitor

    def _node_died(self, node_id: str, node: dict[str, Any]) -> None:
        log.warning("node %s left the pool: %s", node["name"], node["death"])
        self.registry.event("node_lost", None, None, {"node": node["name"], "reason": node["death"]})
        self.warm.end(node_id)
        self.nodes.forget(node_id)
        self.actors.node_died(node_id, node["name"])

    # -- watching ----------------------------------------------------------------------
    def all_nodes_warm(self) -> bool:
        """Every live GPU node has a ready warm session, as on a pool at rest with GPUs free."""
        return set(self.warm.ready_gpus()) == self.nodes.gpu_nodes()

    def status(self, viewer: str | None = None) -> dict[str, Any]:
        """Nodes, their GPUs and who holds them, and the queue. Session names are their owner's to see."""
        return pool_status(self.sessions.values(), self.nodes, self.warm.ready_gpus(), self.queue, self._free(), viewer)
