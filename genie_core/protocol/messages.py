"""Every message type, who may send it, and what it means for a request: one table that the
client, the server and the worker all read, as ipykernel's `msg_types` list is the only source
of its handlers. A type a peer may not send is refused and logged, never looked up by name."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Peer(enum.Enum):
    """Who is on the other end of a connection."""

    CLIENT = "client"  # a client's control connection (the one its hello came on)
    HEARTBEAT = "heartbeat"  # a client's heartbeat connection (named in its hello)
    SERVER = "server"
    WORKER = "worker"  # a session's worker process, on the server's private socket


class MessageType(str, enum.Enum):
    # client -> server
    HELLO = "hello"
    PING = "ping"
    EXECUTE = "execute"
    PUSH = "push"
    PULL = "pull"
    TENSOR_OPS = "tensor_ops"
    INTERRUPT = "interrupt"
    OUTCOME = "outcome"
    INFO = "info"
    DATA_PROBE = "data_probe"
    SET_BACKEND = "set_backend"
    CLOSE = "close"
    JOBS = "jobs"
    SYNC = "sync"
    FILE_STAT = "file_stat"
    FILE_PUT = "file_put"
    FILE_GET = "file_get"
    # server -> client: replies that end a request
    WELCOME = "welcome"
    AUTH_FAILED = "auth_failed"
    PONG = "pong"
    EXECUTE_REPLY = "execute_reply"
    PUSH_REPLY = "push_reply"
    PULL_REPLY = "pull_reply"
    TENSOR_REPLY = "tensor_reply"
    INTERRUPT_REPLY = "interrupt_reply"
    OUTCOME_REPLY = "outcome_reply"
    INFO_REPLY = "info_reply"
    DATA_PROBE_REPLY = "data_probe_reply"
    SET_BACKEND_REPLY = "set_backend_reply"
    CLOSE_REPLY = "close_reply"
    JOBS_REPLY = "jobs_reply"
    SYNC_REPLY = "sync_reply"
    FILE_REPLY = "file_reply"
    ERROR_REPLY = "error_reply"
    # outputs of a running cell (worker -> server -> client)
    STREAM = "stream"
    DISPLAY_DATA = "display_data"
    UPDATE_DISPLAY_DATA = "update_display_data"
    CLEAR_OUTPUT = "clear_output"
    EXECUTE_RESULT = "execute_result"
    ERROR = "error"
    # sent on the server's own initiative
    EVENT = "event"
    METRICS = "metrics"
    # worker <-> server only
    READY = "ready"
    STAGING = "staging"  # how far the worker has filled a segment its reply named (DataRef.filling)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Kind:
    senders: frozenset[Peer]
    terminal: bool = False  # the last reply to a request
    runs: bool = False  # acts on the session's worker: runs at most once, and "did it run?" can be asked
    to_worker: bool = False  # the server hands it to the session's worker


_C, _H, _S, _W = Peer.CLIENT, Peer.HEARTBEAT, Peer.SERVER, Peer.WORKER
T = MessageType


def _kind(*senders: Peer, **flags: bool) -> Kind:
    return Kind(frozenset(senders), **flags)


TABLE: dict[MessageType, Kind] = {
    T.HELLO: _kind(_C),
    T.PING: _kind(_C, _H),
    T.EXECUTE: _kind(_C, runs=True, to_worker=True),
    T.PUSH: _kind(_C, runs=True, to_worker=True),
    T.PULL: _kind(_C, runs=True, to_worker=True),
    T.TENSOR_OPS: _kind(_C, runs=True, to_worker=True),
    T.INTERRUPT: _kind(_C, _S),  # the server passes it on to the worker
    T.OUTCOME: _kind(_C),
    T.INFO: _kind(_C),
    T.DATA_PROBE: _kind(_C),
    T.SET_BACKEND: _kind(_C),
    T.CLOSE: _kind(_C),
    T.JOBS: _kind(_C),
    T.SYNC: _kind(_C),
    T.FILE_STAT: _kind(_C, to_worker=True),
    T.FILE_PUT: _kind(_C, to_worker=True),
    T.FILE_GET: _kind(_C, to_worker=True),
    T.WELCOME: _kind(_S, terminal=True),
    T.AUTH_FAILED: _kind(_S, terminal=True),
    T.PONG: _kind(_S, terminal=True),
    T.EXECUTE_REPLY: _kind(_S, _W, terminal=True),
    T.PUSH_REPLY: _kind(_S, _W, terminal=True),
    T.PULL_REPLY: _kind(_S, _W, terminal=True),
    T.TENSOR_REPLY: _kind(_S, _W, terminal=True),
    T.INTERRUPT_REPLY: _kind(_S, terminal=True),
    T.OUTCOME_REPLY: _kind(_S, terminal=True),
    T.INFO_REPLY: _kind(_S, terminal=True),
    T.DATA_PROBE_REPLY: _kind(_S, terminal=True),
    T.SET_BACKEND_REPLY: _kind(_S, terminal=True),
    T.CLOSE_REPLY: _kind(_S, terminal=True),
    T.JOBS_REPLY: _kind(_S, terminal=True),
    T.SYNC_REPLY: _kind(_S, terminal=True),
    T.FILE_REPLY: _kind(_S, _W, terminal=True),
    T.ERROR_REPLY: _kind(_S, _W, terminal=True),
    T.STREAM: _kind(_S, _W),
    T.DISPLAY_DATA: _kind(_S, _W),
    T.UPDATE_DISPLAY_DATA: _kind(_S, _W),
    T.CLEAR_OUTPUT: _kind(_S, _W),
    T.EXECUTE_RESULT: _kind(_S, _W),
    T.ERROR: _kind(_S, _W),
    T.EVENT: _kind(_S),
    T.METRICS: _kind(_S),
    T.READY: _kind(_W),
    T.STAGING: _kind(_W),
}

TERMINAL = frozenset(t for t, k in TABLE.items() if k.terminal)
RUNS = frozenset(t for t, k in TABLE.items() if k.runs)


def accepted_from(peer: Peer) -> frozenset[MessageType]:
    """The types `peer` may send; anything else from it is refused."""
    return frozenset(t for t, k in TABLE.items() if peer in k.senders)


def for_worker(type_name: str) -> MessageType | None:
    """The type of a message from the server to a worker, if it is one the server hands on."""
    try:
        kind = MessageType(type_name)
    except ValueError:
        return None
    return kind if TABLE[kind].to_worker or kind is MessageType.INTERRUPT else None


def parse(type_name: str, peer: Peer) -> MessageType | None:
    """The type named on the wire, if `peer` may send it; else None (refuse it)."""
    try:
        kind = MessageType(type_name)
    except ValueError:
        return None
    return kind if peer in TABLE[kind].senders else None
