"""The records of a remote-tensor op stream: what the client writes down for each op and the
worker replays, in order. One definition per kind: the client builds each as a tuple literal
checked against it, the worker narrows a record by its first element (`record[0] == "op"`) and
unpacks it into these names; mypy checks both sides.

They are plain tuples, not NamedTuples: a NamedTuple costs 7x a tuple to make and 2.5x to pickle
(pickle calls back into Python for each one; `timeit` on the CI VM), and a decode step makes and
sends thousands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    from .tensor_ops import HostBytes, HostTensor

# What the worker must find in an op's output: shape, strides, storage offset, dtype (the output of
# the op's meta kernel on the client); None where the output is not a tensor, or not checked.
Expect: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], int, Any]
Expects: TypeAlias = tuple[Expect | None, ...]

# Run torch.ops.<name> (aten.add.Tensor) on these arguments (remote tensors as tensor_ops.TensorRef;
# kwargs None: none) and keep its tensor outputs under out_ids (None: not kept; a range: the block
# of ids for a list of unknown length), each checked against expect (None: not checked).
OpRecord: TypeAlias = tuple[
    Literal["op"], str, tuple[Any, ...], dict[str, Any] | None, Sequence[int | None], Expects | None
]
# One of the server's own functions (worker/server_calls.py run_call): "sdpa" and "sdpa_backward"
# (attention.py), "aten" (whole_ops.py), "graph" (a compiled graph; kwargs: key, graph, needs) and
# "aten_backward" (the backward of "aten" and "graph" calls; kwargs retain: keep the autograd graph).
CallRecord: TypeAlias = tuple[Literal["call"], str, tuple[Any, ...], dict[str, Any], Sequence[int | None], Expects]
PutRecord: TypeAlias = tuple[Literal["put"], int, "HostTensor"]  # a CPU tensor uploaded (bytes out of band)
# A part of a big upload to a GPU server (stream.py: OpStream.upload): bytes from `start` on of the
# tensor under the id; the first part (start 0) says how to make it (shape, strides, dtype).
Layout: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], Any]
PartRecord: TypeAlias = tuple[Literal["part"], int, int, "HostBytes", Layout | None]
FreeRecord: TypeAlias = tuple[Literal["free"], int]  # the client dropped its last reference
# Outputs (ids) of an op (its name) that failed on the client during backward, with the error text.
FailRecord: TypeAlias = tuple[Literal["fail"], list[int], str, str]
SeedRecord: TypeAlias = tuple[Literal["seed"], int]  # torch.manual_seed on the worker
# A graph torch.compile captured (protocol/fx_graph.py), by content hash; how: compiler, options,
# dynamic shapes, static inputs.
GraphRecord: TypeAlias = tuple[Literal["graph"], str, Any, Any]
# Records captured as a graph (torch.remote_accelerator.graph), kept under an id to replay.
CaptureRecord: TypeAlias = tuple[Literal["capture"], int, "list[Record]"]
ReplayRecord: TypeAlias = tuple[Literal["replay"], int]  # run a captured graph again
RngGetRecord: TypeAlias = tuple[Literal["rng_get"], int]  # the device generator's state, kept under an id
RngSetRecord: TypeAlias = tuple[Literal["rng_set"], "HostTensor"]  # ... and set (fork_rng, checkpointing)
ImportRecord: TypeAlias = tuple[Literal["import"], str]  # the module defining a custom op, imported first
# A custom op defined in the client's notebook (`__main__`, which the server cannot import): its
# name, its schema without the name, and its kernels by device type (None: every device), pickled
# by value (cloudpickle)
DefineRecord: TypeAlias = tuple[Literal["define"], str, str, bytes]
ClockRecord: TypeAlias = tuple[Literal["clock"], int]  # the device's clock when it gets here (Event timing)
# A question about the device (memory, properties, elapsed time): answered as the batch's
# "eager" {"value": ...} when the batch names it (OpBatch.answer).
AskRecord: TypeAlias = tuple[Literal["ask"], str, tuple[Any, ...]]
# A checkpoint on the server's disk, onto the device: its tensors under ids from first_id on;
# answered as "ask" is (its structure, each leaf described).
LoadRecord: TypeAlias = tuple[Literal["load"], int, str]
ReadRecord: TypeAlias = tuple[Literal["read"], str]  # a small text file on the server's disk, answered as "ask"

Record: TypeAlias = (
    OpRecord
    | CallRecord
    | PutRecord
    | PartRecord
    | FreeRecord
    | FailRecord
    | SeedRecord
    | GraphRecord
    | CaptureRecord
    | ReplayRecord
    | RngGetRecord
    | RngSetRecord
    | ImportRecord
    | DefineRecord
    | ClockRecord
    | AskRecord
    | LoadRecord
    | ReadRecord
)


def name_of(record: Record) -> str:
    """What a record is called in an error or a profile: an op's or call's name, else its kind."""
    if record[0] == "op" or record[0] == "call":
        return record[1]
    if record[0] == "define":
        return f"{record[1]} (its definition)"
    return "put" if record[0] == "part" else record[0]  # (a part of an upload fails as the upload)


def written_values(schema: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[Any]:
    """What an op writes in place, as its call gives it: the values of its schema's `Tensor(a!)`
    arguments, lists flattened (the client refuses a CPU tensor among them; the worker marks them
    failed when the op fails)."""
    found: list[Any] = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else (kwargs or {}).get(argument.name)
        found.extend(value if isinstance(value, (tuple, list)) else (value,))
    return found
