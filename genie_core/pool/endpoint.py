"""`genie pool up`: the notebook-facing endpoint of a pool of GPU machines run by Ray.

A user's `%genie_init pool-host:5555` asks here for a session; the pool queues the request
(FIFO, quotas), asks Ray for a session actor with the GPUs (Ray picks the node), and answers with
the address of the session's own genie server and its token, sealed for that user. Cells and
tensors then go straight to that server. The endpoint watches Ray's node table and each session
actor: a node that dies has its sessions reported lost to their clients. A warm session per node
(warm.py) lets a one-GPU session skip the seconds Ray takes to start an actor.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..protocol import VERSIONS_TAG
from ..protocol import pool as wire
from ..sandbox import Protection, refuse_unisolated
from ..version import __version__
from .monitor_actor import PREFIX as MONITOR_PREFIX
from .monitor_actor import NodeMonitor, sign
from .queue import Ask, Queue, QuotaExceeded, check_quota
from .registry import Registry
from .session_actor import NAMESPACE, PREFIX, SessionActor, end_actor
from .warm import WarmSession, WarmSessions

log = logging.getLogger("genie.pool")

DAY = 86400.0
HISTORY_KEPT = 7 * DAY  # readings older than this leave the registry
AUDIT_EVERY = 1.0  # seconds between collections of the cells sessions ran (the audit log)
DEATH_GRACE = 6.0  # seconds a dead session actor waits for Ray to say whether its node died too
UNREACHABLE_GRACE = 15.0  # seconds a session actor may be unreachable on a live node before we ask again


@dataclass
class LiveSession:
    """A session whose actor exists (pending in Ray, or running)."""

    session_id: str
    user: str
    name: str
    gpus: int
    actor: Any
    node_id: str = ""
    host: str = ""
    port: int = 0
    gpu_ids: list[str] = field(default_factory=list)
    watcher: bytes | None = None  # the client connection that hears about this session
    key: bytes = b""
    ask: Ask | None = None  # until its client has been answered
    token: str = ""  # its server's token
    warm: bool = False  # it took a warm session (warm.py), and is placed anew should that fail


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
        self.sessions: dict[str, LiveSession] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  # Ray's node table, by node id
        self._placing: dict[Any, str] = {}  # info() refs of actors being created -> session id
        self._ending: dict[Any, str] = {}  # wait_ended() refs -> session id
        self._unreachable: dict[str, tuple[float, bool]] = {}  # session id -> (since when, dead?)
        self._auditing: dict[Any, LiveSession] = {}  # take_cells() refs -> whose cells they are
        self._audited = 0.0
        self._monitor_class: Any = None
        self.monitors: dict[str, Any] = {}  # node id -> its NodeMonitor actor
        self.readings: dict[str, dict[str, Any]] = {}  # node id -> its newest reading
        self._readings_key = secrets.token_bytes(32)
        self._history: list[tuple[float, str, int, float | None, float | None, float | None]] = []
        self._history_written = self._history_trimmed = time.monotonic()
        self.readings_taken = 0
        self._replays = wire.Replays()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._actor_class: Any = None
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
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.maxmsgsize = wire.MAX_REQUEST_BYTES * 4
        if self.port == 0:
            self.port = self.router.bind_to_random_port(f"tcp://{self.ip}")
        else:
            self.router.bind(f"tcp://{self.ip}:{self.port}")
        self.readings_sock = self._ctx.socket(zmq.PULL)
        self.readings_sock.linger = 0
        self.readings_sock.maxmsgsize = 1 << 20
        readings_port = self.readings_sock.bind_to_random_port(f"tcp://{self.ip}")
        reachable = ray.util.get_node_ip_address() if self.ip in ("0.0.0.0", "*", "::") else self.ip
        self.sink = f"tcp://{reachable}:{readings_port}"  # where the node monitors send
        self._read_nodes()
        self._recover()
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
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.readings_sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self.readings_sock in ready:
                    try:
                        self._drain_readings()
                    except Exception:  # a reading of another shape (an older monitor) must not end the pool
                        log.exception("a node reading could not be taken")
                if self.router in ready:
                    for _ in range(100):
                        try:
                            frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        try:
                            self._on_frames(frames)
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
            self.router.close()
            self.readings_sock.close()
            self._ctx.term()
            self.registry.close()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._nodes_read >= self.node_poll:
            self._read_nodes()
            self._recheck_unreachable()
        if now - self._history_written >= self.history_every:
            self._history_written = now
            rows, self._history = self._history, []
            self.registry.add_readings(rows)
            if now - self._history_trimmed >= 3600:
                self._history_trimmed = now
                self.registry.forget_readings(time.time() - HISTORY_KEPT)
        if now - self._audited >= AUDIT_EVERY:
            self._audited = now
            self._ask_for_cells()
        self._collect()
        for placed in [p for p in list(self.sessions.values()) if p.ask is not None and p.ask.deadline <= time.time()]:
            self._forget(placed, "Ray did not place it in time (other work holds the GPUs it needs)")
        for ask in self.queue.expired(time.time()):
            self.registry.session_ended(ask.session_id, "queue timeout")
            self._answer(ask, {"kind": "error", "error": self._timeout_text(ask)})
        self._place()
        self.warm.collect()
        if self.queue.head() is None and all(p.node_id for p in self.sessions.values()):
            self.warm.warm(self._free_by_node())  # only while no session waits for Ray's GPUs

    # -- requests ----------------------------------------------------------------------
    def _on_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) >= 2 and frames[1].startswith(b"genie/") and len(frames[1]) <= 16:
            # A genie client's hello: this is a pool, not a server. Say so in the version-neutral frame.
            answer = {"protocol": wire.PROTOCOL, "genie": __version__, "pool": "true"}
            self.router.send_multipart([identity, VERSIONS_TAG, json.dumps(answer).encode()])
            return
        if len(frames) != 2 or len(frames[1]) > wire.MAX_REQUEST_BYTES:
            return
        try:
            request = json.loads(frames[1])
            user = self.registry.user(str(request["user"]))
        except (ValueError, KeyError, TypeError):
            return
        key = wire.verify_request(request, user.stored_key) if user is not None else None
        if user is None or key is None:
            log.warning("refused a request signed with no user's token (user %r)", str(request.get("user"))[:40])
            self.router.send_multipart(
                [
                    identity,
                    json.dumps(
                        {"re": request.get("id"), "kind": "refused", "error": "unknown user or wrong token"}
                    ).encode(),
                ]
            )
            return
        why = self._replays.fresh(request)
        if why:
            log.warning("refused %s from %s", why, user.name)
            if "replayed" not in why:  # a replay's original was answered; a stale request is told why
                self._send(identity, key, {"re": request.get("id"), "kind": "error", "error": f"refused {why}"})
            return
        op, args = str(request.get("op")), dict(request.get("args") or {})
        reply: dict[str, Any] | None
        try:
            if op == "place":
                reply = self._on_place(identity, request["id"], key, user, args)
            elif op == "watch":
                reply = self._on_watch(identity, key, user.name, [str(s) for s in args.get("sessions", [])])
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
            self._send(identity, key, {"re": request["id"], **reply})

    def _on_place(
        self, identity: bytes, request_id: str, key: bytes, user: Any, args: dict[str, Any]
    ) -> dict[str, Any] | None:
        gpus = int(args.get("gpus", 1))
        largest = max((n["gpus"] for n in self.nodes.values() if n["alive"]), default=0)
        if gpus < 1:
            return {"kind": "error", "error": f"a pool session holds 1 GPU or more (asked {gpus})"}
        accelerator = str(args.get("accelerator") or "")[:64]
        if accelerator:
            kinds = sorted({a for n in self.nodes.values() if n["alive"] for a in n.get("accelerators", [])})
            if accelerator not in kinds:
                return {
                    "kind": "error",
                    "error": f"no node of this pool has {accelerator} GPUs "
                    f"(it has: {', '.join(kinds) or 'no GPUs of a declared type'})",
                }
            largest = max(
                n["gpus"] for n in self.nodes.values() if n["alive"] and accelerator in n.get("accelerators", [])
            )
        if gpus > largest:
            return {"kind": "error", "error": f"no node of this pool has {gpus} GPUs (the largest has {largest})"}
        live = self.registry.sessions(user=user.name)
        check_quota(user, gpus, live, self.registry.gpu_hours(user.name, time.time() - DAY))
        session_id = secrets.token_hex(8)
        name = str(args.get("name") or "")[:64]
        wait = min(float(args.get("wait", self.queue_timeout)), self.queue_timeout)
        ask = Ask(
            session_id, user.name, name, gpus, time.time() + wait, identity, request_id, key, accelerator=accelerator
        )
        self.registry.session_asked(session_id, user.name, name, gpus)
        self.registry.event("asked", user.name, session_id, {"gpus": gpus})
        self.queue.add(ask)
        self._place()
        ahead = self.queue.positions().get(session_id)
        if ahead is None:  # being placed: "placed" follows when its actor is up
            return {"kind": "asked", "session": session_id, **self._free()}
        return {"kind": "queued", "session": session_id, "ahead": ahead, **self._free()}

    def _on_watch(self, identity: bytes, key: bytes, user: str, session_ids: list[str]) -> dict[str, Any]:
        """A client's keep-alive: notices about its sessions go to this connection."""
        known = []
        for session_id in session_ids:
            placed = self.sessions.get(session_id)
            if placed is not None and placed.user == user:
                placed.watcher, placed.key = identity, key
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
        free = self._free_by_node()
        total = sum(n["gpus"] for n in list(self.nodes.values()) if n["alive"] and not n.get("simulated"))
        return {"free": max(0, sum(free.values())), "total": total}

    def _free_by_node(self) -> dict[str, int]:
        # (a simulated node, the benchmark's, only reports readings: nothing is placed on it)
        free = {nid: n["gpus"] for nid, n in list(self.nodes.items()) if n["alive"] and not n.get("simulated")}
        for placed in list(self.sessions.values()):
            if placed.node_id in free:
                free[placed.node_id] -= placed.gpus
            elif free:  # not placed yet: count it against the node with the most room
                most = max(free, key=lambda nid: free[nid])
                free[most] -= placed.gpus
        return free

    def _place(self) -> None:
        while (ask := self.queue.head()) is not None:
            free = self._free_by_node()
            fits = [nid for nid, n in free.items() if n >= ask.gpus]
            if ask.accelerator:
                fits = [nid for nid in fits if ask.accelerator in self.nodes[nid].get("accelerators", [])]
            if not fits:
                return
            self.queue.pop_head()
            warm = self.warm.take(fits) if ask.gpus == 1 else None
            if warm is not None:
                self._claim(ask, warm)
            else:
                self.warm.make_room(fits, free, ask.gpus)
                self._create(ask)
            for waiting in self.queue:
                self._answer(
                    waiting,
                    {
                        "kind": "queued",
                        "session": waiting.session_id,
                        "ahead": self.queue.positions()[waiting.session_id],
                        **self._free(),
                    },
                )

    def _spec(self, token: str, session_id: str) -> dict[str, Any]:
        """What a session actor is made with (a warm one's session id is "" until it is claimed)."""
        return {
            "token": token,
            "session": session_id,
            "host": self.ip if self.ip in ("127.0.0.1", "localhost") else "",
            "idle_timeout": self.idle_timeout,
            "session_lease": self.session_lease,
            "simulate_gpus": self.simulate_gpus,
            # cells may not reach the cluster's machines (Ray's services, other sessions' servers)
            "isolation": {**self.isolation, "session_blocked": ",".join(self._node_addresses())},
        }

    def _node_addresses(self) -> list[str]:
        """The cluster's machines (as Ray has them now) and the registry's database server."""
        found = {str(n["NodeManagerAddress"]) for n in self.nodes.values() if n.get("NodeManagerAddress")}
        host = urllib.parse.urlsplit(self.registry.url).hostname if "://" in self.registry.url else None
        if host and not self.registry.url.startswith("sqlite"):
            with contextlib.suppress(OSError):
                found |= {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None)}
        return sorted(found)

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
        placed = self._session(ask, warm.actor, warm.token, node_id=warm.node_id, warm=True)
        claimed = warm.actor.claim.remote(ask.session_id, self._spec(warm.token, ask.session_id))
        self._placing[claimed] = ask.session_id
        self.sessions[ask.session_id] = placed

    def _create(self, ask: Ask) -> None:
        """Ask Ray for a session actor with the GPUs: Ray picks the node."""
        token = secrets.token_hex(24)
        options: dict[str, Any] = {"accelerator_type": ask.accelerator} if ask.accelerator else {}
        actor = self._actor_class.options(
            name=PREFIX + ask.session_id, namespace=NAMESPACE, lifetime="detached", num_gpus=ask.gpus, **options
        ).remote(self._spec(token, ask.session_id))
        self.sessions[ask.session_id] = self._session(ask, actor, token)
        self._placing[actor.info.remote()] = ask.session_id

    def _session(self, ask: Ask, actor: Any, token: str, node_id: str = "", warm: bool = False) -> LiveSession:
        return LiveSession(
            ask.session_id,
            ask.user,
            ask.name,
            ask.gpus,
            actor,
            node_id=node_id,
            watcher=ask.reply_to,
            key=ask.key,
            ask=ask,
            token=token,
            warm=warm,
        )

    def _collect(self) -> None:
        """Actors that came up (answer their users) and sessions that ended (free their GPUs)."""
        import ray

        refs = list(self._placing) + list(self._ending) + list(self._auditing)
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:  # a session's end takes its audit refs too: one later in `ready` is gone
            if ref in self._placing:
                self._on_up(self._placing.pop(ref), ref)
            elif ref in self._auditing:
                self._on_cells(self._auditing.pop(ref), ref)
            elif ref in self._ending:
                self._on_ended(self._ending.pop(ref), ref)

    def _ask_for_cells(self) -> None:
        busy = {placed.session_id for placed in self._auditing.values()}
        for session_id, placed in self.sessions.items():
            if placed.port and session_id not in busy and session_id not in self._unreachable:
                self._auditing[placed.actor.take_cells.remote()] = placed

    def _on_cells(self, placed: LiveSession, ref: Any, timeout: float | None = None) -> None:
        """The audit log: who ran what (a hash of the code, its size), when, on which node and GPU."""
        import ray

        try:
            cells = ray.get(ref, timeout=timeout)
        except Exception:  # its actor is going; its end is handled by wait_ended
            return
        node = self.nodes.get(placed.node_id, {}).get("name", "")
        for cell in cells:
            self.registry.event("cell", placed.user, placed.session_id, {**cell, "node": node}, at=cell["time"])

    def _on_up(self, session_id: str, ref: Any) -> None:
        import ray

        placed = self.sessions.get(session_id)
        if placed is None:
            return
        try:
            info = ray.get(ref)
        except Exception as exc:
            if placed.warm and placed.ask is not None:
                self._place_anew(placed, f"{type(exc).__name__}: {exc}"[:200])
                return
            self._forget(placed, f"its actor failed to start: {type(exc).__name__}: {exc}"[:500])
            return
        placed.node_id, placed.host, placed.port = info["node_id"], info["host"], info["port"]
        placed.gpu_ids = list(info["gpu_ids"])
        self.registry.session_placed(session_id, placed.node_id, placed.host, placed.gpu_ids)
        node = self.nodes.get(placed.node_id, {})
        self.registry.event(
            "placed", placed.user, session_id, {"node": node.get("name", placed.node_id), "gpu_ids": placed.gpu_ids}
        )
        self._ending[placed.actor.wait_ended.remote()] = session_id
        if placed.ask is not None:
            ask, placed.ask = placed.ask, None
            self._answer(
                ask,
                {
                    "kind": "placed",
                    "session": session_id,
                    "host": placed.host,
                    "port": placed.port,
                    "token": wire.seal(placed.token, ask.key, ask.request_id),
                    "node": node.get("name", placed.node_id[:12]),
                    "node_id": placed.node_id,
                    "gpu_ids": placed.gpu_ids,
                    "gpu_names": info.get("gpus", []),
                    "waited": round(time.time() - ask.asked, 3),
                    **self._free(),
                },
            )

    def _on_ended(self, session_id: str, ref: Any) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError

        placed = self.sessions.get(session_id)
        if placed is None:
            return
        try:
            reason = str(ray.get(ref))
        except Exception as exc:
            # Unreachable, or dead: its process, or its whole node. Ray's node table tells which
            # within seconds (see head.HEALTH_CHECKS); until it does, the session is only suspect.
            self._unreachable[session_id] = (time.monotonic(), not isinstance(exc, ActorUnavailableError))
            self._read_nodes()
            return
        try:  # the last cells, before the actor goes: those a collection in flight took, then the rest
            for audit in [r for r, p in self._auditing.items() if p is placed]:
                self._on_cells(self._auditing.pop(audit), audit, timeout=2.0)
            self._on_cells(placed, placed.actor.take_cells.remote(), timeout=2.0)
        finally:
            self._forget(placed, reason)

    def _recheck_unreachable(self) -> None:
        """Suspect sessions on nodes Ray still calls alive: past a grace, a dead actor is a dead
        process, and an unreachable one is asked again."""
        for session_id, (since, dead) in list(self._unreachable.items()):
            placed = self.sessions.get(session_id)
            waited = time.monotonic() - since
            if placed is None:
                self._unreachable.pop(session_id)
            elif dead and waited > DEATH_GRACE:
                self._unreachable.pop(session_id)
                self._lost(placed, "its process died (its node is alive)")
            elif not dead and waited > UNREACHABLE_GRACE:
                self._unreachable.pop(session_id)
                self._ending[placed.actor.wait_ended.remote()] = session_id

    def _lost(self, placed: LiveSession, reason: str) -> None:
        if placed.watcher is not None:
            self._send(
                placed.watcher, placed.key, {"kind": "session_lost", "session": placed.session_id, "reason": reason}
            )
        self._forget(placed, reason, lost=True)

    def _place_anew(self, placed: LiveSession, why: str) -> None:
        """A warm session failed before its user was answered (its process or node died unseen):
        the ask goes back to the head of the queue, to a warm session elsewhere or a new actor."""
        log.warning("a warm session could not be taken (%s); placing session %s anew", why, placed.session_id)
        self.sessions.pop(placed.session_id, None)
        self._drop_refs(placed.session_id)
        end_actor(placed.actor)
        assert placed.ask is not None
        self.queue.put_back(placed.ask)

    def _drop_refs(self, session_id: str) -> None:
        """Nobody waits any more for the session's actor to come up or to end."""
        for refs in (self._placing, self._ending):
            for ref in [r for r, s in refs.items() if s == session_id]:
                refs.pop(ref)

    def _forget(self, placed: LiveSession, reason: str, lost: bool = False) -> None:
        """The session is over: its actor goes (Ray frees its GPUs), and the queue may move."""
        end_actor(placed.actor)
        self._drop_refs(placed.session_id)
        try:  # recorded before its GPUs show free: whoever sees them free also finds why they freed
            self.registry.session_ended(placed.session_id, reason)
            self.registry.event("lost" if lost else "ended", placed.user, placed.session_id, {"reason": reason})
        finally:
            self.sessions.pop(placed.session_id, None)
        if placed.ask is not None:
            self._answer(placed.ask, {"kind": "error", "error": f"the session could not start: {reason}"})

    # -- Ray's view of the nodes -------------------------------------------------------
    def _read_nodes(self) -> None:
        import ray

        self._nodes_read = time.monotonic()
        seen = {}
        for entry in ray.nodes():
            node_id = str(entry["NodeID"])
            seen[node_id] = {
                "alive": bool(entry.get("Alive")),
                "gpus": int(entry.get("Resources", {}).get("GPU", 0)),
                "name": f"{entry.get('NodeManagerHostname', '?')}/{node_id[:6]}",
                "ip": entry.get("NodeManagerAddress", ""),
                "death": entry.get("DeathReasonMessage", ""),
                "accelerators": sorted(
                    k.split(":", 1)[1] for k in entry.get("Resources", {}) if k.startswith("accelerator_type:")
                ),
            }
            if not seen[node_id]["alive"] and node_id in self.nodes:
                seen[node_id]["gpus"] = self.nodes[node_id]["gpus"]
        for node_id, node in seen.items():
            before = self.nodes.get(node_id)
            if before is not None and before["alive"] and not node["alive"]:
                self._node_died(node_id, node)
        self.nodes = seen
        for node_id, node in seen.items():
            if node["alive"] and node["gpus"] and node_id not in self.monitors:
                self._watch_node(node_id, node)

    def _watch_node(self, node_id: str, node: dict[str, Any]) -> None:
        """A monitor actor pinned to the node (one that outlived a restarted pool is told where we are)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        monitor = self._monitor_class.options(
            name=MONITOR_PREFIX + node_id,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(self.sink, self._readings_key.hex(), node["gpus"] if self.simulate_gpus else 0)
        monitor.set_sink.remote(self.sink, self._readings_key.hex())
        self.monitors[node_id] = monitor

    def _drain_readings(self) -> None:
        """Signed readings from the node monitors: the newest kept per node, a sample for history."""
        for _ in range(1000):
            try:
                body, mac = self.readings_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            if not hmac.compare_digest(mac, sign(body, self._readings_key)):
                continue
            try:
                reading = json.loads(body)
                node_id = str(reading["node_id"])
            except (ValueError, KeyError, TypeError):
                continue
            if node_id not in self.nodes:
                continue
            self.readings_taken += 1
            before = self.readings.get(node_id)
            self.readings[node_id] = reading
            if before is None or reading.get("time", 0) - before.get("_kept", 0) >= self.history_every:
                reading["_kept"] = reading.get("time", 0)
                for g in reading.get("gpus", []):
                    self._history.append(
                        (reading["time"], node_id, g["index"], g["utilization"], g["memory_used"], g["temperature"])
                    )
            else:
                reading["_kept"] = before.get("_kept", 0)

    def _node_died(self, node_id: str, node: dict[str, Any]) -> None:
        log.warning("node %s left the pool: %s", node["name"], node["death"])
        self.registry.event("node_lost", None, None, {"node": node["name"], "reason": node["death"]})
        self.nodes[node_id] = node
        self.warm.end(node_id)
        self.monitors.pop(node_id, None)
        self.readings.pop(node_id, None)
        for placed in [p for p in self.sessions.values() if p.node_id == node_id]:
            if placed.warm and placed.ask is not None:  # its user was not answered yet
                self._place_anew(placed, f"node {node['name']} left the pool")
            else:
                self._lost(placed, f"node {node['name']} left the pool (Ray reports it dead)")

    def _recover(self) -> None:
        """After a restart: the session actors that outlived the last endpoint are still sessions."""
        import ray

        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") != NAMESPACE or not str(entry.get("name", "")).startswith(PREFIX):
                continue
            try:
                actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
                info: dict[str, Any] = dict(ray.get(actor.info.remote(), timeout=10))
            except Exception as exc:
                log.warning("session actor %s did not answer: %s; ending it", entry["name"], exc)
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                continue
            if info.get("session") == "":  # the last endpoint's warm session, nobody's: warmed afresh
                end_actor(actor)
                continue
            session_id = str(info.get("session") or entry["name"][len(PREFIX) :])  # an older actor's: its name
            known = [s for s in self.registry.sessions() if s["id"] == session_id]
            row: dict[str, Any] = known[0] if known else {"user": "?", "name": "", "gpus": len(info["gpu_ids"])}
            placed = LiveSession(
                session_id,
                row["user"],
                row["name"],
                int(row["gpus"]),
                actor,
                info["node_id"],
                info["host"],
                info["port"],
                list(info["gpu_ids"]),
            )
            self.sessions[session_id] = placed
            self._ending[actor.wait_ended.remote()] = session_id
            log.info("recovered session %s of %s", session_id, placed.user)
        for row in self.registry.sessions():  # what the last endpoint left: no actor, no session
            if row["id"] not in self.sessions:
                self.registry.session_ended(row["id"], "the pool endpoint restarted and it had no actor")

    # -- replies -----------------------------------------------------------------------
    def _send(self, identity: bytes, key: bytes, reply: dict[str, Any]) -> None:
        try:
            self.router.send_multipart([identity, json.dumps(wire.sign_reply(reply, key)).encode()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not answer a client: %s", exc)

    def _answer(self, ask: Ask, reply: dict[str, Any]) -> None:
        self._send(ask.reply_to, ask.key, {"re": ask.request_id, **reply})

    def _timeout_text(self, ask: Ask) -> str:
        waited = time.time() - ask.asked
        return f"no {ask.gpus} GPU(s) came free within {waited:.0f} s; try again, or ask for fewer GPUs"

    # -- watching ----------------------------------------------------------------------
    def all_nodes_warm(self) -> bool:
        """Every live GPU node has a ready warm session, as on a pool at rest with GPUs free."""
        nodes = {nid for nid, n in list(self.nodes.items()) if n["alive"] and n["gpus"]}
        return set(self.warm.ready_gpus()) == nodes

    def status(self, viewer: str | None = None) -> dict[str, Any]:
        """Nodes, their GPUs and who holds them, and the queue. Session names are their owner's to see."""
        holders: dict[str, list[dict[str, Any]]] = {}
        for placed in list(self.sessions.values()):  # a copy: status() may be asked from other threads
            holders.setdefault(placed.node_id, []).append(
                {
                    "user": placed.user,
                    "gpu_ids": placed.gpu_ids,
                    **({"session": placed.session_id, "name": placed.name} if viewer in (None, placed.user) else {}),
                }
            )
        now = time.time()
        warm = self.warm.ready_gpus()
        nodes = []
        for nid, node in sorted(self.nodes.items(), key=lambda kv: kv[1]["name"]):  # sorted() copies first
            reading = self.readings.get(nid) or {}
            nodes.append(
                {
                    "id": nid,
                    **node,
                    "sessions": holders.get(nid, []),
                    "warm": warm.get(nid, []),  # a free GPU a warm session holds for the next user
                    "health": reading.get("health"),
                    "gpu_readings": reading.get("gpus", []),
                    "simulated": reading.get("simulated", False),
                    "reading_age_s": round(now - reading["time"], 1) if reading else None,
                }
            )
        queue = [
            {
                "user": a.user,
                "gpus": a.gpus,
                "waiting_s": round(time.time() - a.asked, 1),
                **({"session": a.session_id} if viewer in (None, a.user) else {}),
            }
            for a in list(self.queue)
        ]
        return {"nodes": nodes, "queue": queue, **self._free()}
