"""How a graph captured by `torch.compile` travels from the client that traced it to the worker that
runs it: its nodes in order, each with its op, target and arguments, in plain picklable values.

Targets are named, not pickled, where pickling would copy them (aten ops, higher-order ops);
the remote device becomes the worker's own; constants (a remote tensor by id, a CPU tensor by
value, a nested graph by its nodes) are encoded by the client's callback and decoded by the
worker's. The worker rebuilds a `torch.fx.GraphModule` that runs the same calls."""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Callable
from typing import Any

from .tensor_ops import MemoryFormat, RemoteDevice

DEVICE_TYPE = "remote_accelerator"
# One node: (op, name, target, args, kwargs), as torch.fx names them; for `get_attr`, args holds
# the attribute's value (encoded) and kwargs is None.
Node = tuple[str, str, Any, Any, Any]


class _ByName:
    """Something in a graph's encoding that travels as a name alone."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name,))


class Arg(_ByName):
    """A node's output used as an argument of a later node."""

    __slots__ = ()


class Op(_ByName):
    """An op of `torch.ops` by its qualified name (`aten.add.Tensor`, `higher_order.wrap`)."""

    __slots__ = ()

    def resolve(self) -> Any:
        import torch

        found: Any = torch.ops
        for part in self.name.split("."):
            found = getattr(found, part)
        return found


class Named(_ByName):
    """A function by its qualified name (`torch.nn.functional.max_pool2d`), found again by importing
    its module: some of PyTorch's (boolean_dispatch's) cannot be pickled by reference."""

    __slots__ = ()

    def resolve(self) -> Any:
        import importlib

        parts = self.name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                found: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:]:
                found = getattr(found, part)
            return found
        import builtins

        return getattr(builtins, self.name)


class DeviceType:
    """The string `"remote_accelerator"` (autocast's device type): the worker's device type."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (DeviceType, ())


class Nested:
    """A graph that is an attribute of another (the body of a higher-order op)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    def __reduce__(self) -> tuple[Any, ...]:
        return (Nested, (self.nodes,))


def _target(target: Any) -> Any:
    import torch

    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return Op(str(target))
    if isinstance(target, torch._ops.HigherOrderOperator):
        return Op(f"higher_order.{target.name()}")  # type: ignore[no-untyped-call]  # (untyped in torch)
    from torch.fx.node import _get_qualified_name

    try:
        named = Named(_get_qualified_name(target))
        if named.resolve() is target:
            return named
    except (AttributeError, ImportError, RuntimeError):
        pass
    return target  # pickled as it is (by reference, for what pickle can find)


def _value(value: Any, constant: Callable[[Any], Any]) -> Any:
    import torch

    kind = type(value)
    if isinstance(value, torch.fx.Node):
        return Arg(value.name)
    if isinstance(value, list):  # (fx's immutable_list among them)
        return [_value(v, constant) for v in value]
    if isinstance(value, tuple):
        items = [_value(v, constant) for v in value]
        return torch.Size(items) if kind is torch.Size else tuple(items)
    if isinstance(value, dict):  # (fx's immutable_dict among them)
        return {k: _value(v, constant) for k, v in value.items()}
    if kind is slice:
        return slice(_value(value.start, constant), _value(value.stop, constant), _value(value.step, constant))
    if isinstance(value, torch.device):
        return RemoteDevice() if value.type == DEVICE_TYPE else value
    if isinstance(value, str):
        if value == DEVICE_TYPE:
            return DeviceType()
        if value.startswith(DEVICE_TYPE + ":"):
            return RemoteDevice()
        return value
    if isinstance(value, torch.memory_format):
        return MemoryFormat(str(value).removeprefix("torch."))
    if isinstance(value, (bytes, bytearray)):  # (bytes in a record name a remote tensor: tensor_ops.TensorRef)
        raise NotImplementedError(f"a compiled graph with a bytes constant ({bytes(value[:16])!r}) cannot run remotely")
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return constant(value)
    return value


def encode(gm: Any, constant: Callable[[Any], Any]) -> list[Node]:
    """The nodes of `gm` as (op, name, target, args, kwargs); `constant` encodes the tensors and
    submodules that `get_attr` nodes name (it is given the value)."""
    import torch

    nodes: list[Node] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.fx.GraphModule):
                attr: Any = Nested(encode(value, constant))
            else:
                attr = _value(value, constant)
            nodes.append(("get_attr", node.name, node.target, attr, None))
            continue
        if node.op == "call_module":  # (Dynamo inlines modules; a backend given another graph may not)
            raise NotImplementedError(
                f"the graph calls the module {node.target!r}, which cannot go to the server: trace it inlined"
            )
        target = _target(node.target) if node.op == "call_function" else node.target
        nodes.append((node.op, node.name, target, _value(node.args, constant), _value(node.kwargs, constant)))
    return nodes


def digest(nodes: list[Node], *extra: Any) -> str:
    """A content hash of a graph (and whatever else decides how it is compiled): the worker caches by it."""
    return hashlib.sha256(pickle.dumps((nodes, extra), protocol=5)).hexdigest()[:32]


def decode(nodes: list[Node], device: Any, constant: Callable[[Any], Any]) -> Any:
    """A GraphModule running `nodes` on `device`; `constant` decodes what the client's encoded."""
    import torch

    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[str, Any] = {}

    def value(v: Any) -> Any:
        kind = type(v)
        if kind is Arg:
            return env[v.name]
        if kind is tuple or kind is list:
            return kind(value(x) for x in v)
        if kind is dict:
            return {k: value(x) for k, x in v.items()}
        if kind is slice:
            return slice(value(v.start), value(v.stop), value(v.step))
        if kind is RemoteDevice:
            return device
        if kind is DeviceType:
            return device.type
        if kind is MemoryFormat:
            return getattr(torch, v.name)
        return constant(v)

    for op, name, target, args, kwargs in nodes:
        if op == "placeholder":
            made = graph.placeholder(name)
        elif op == "get_attr":
            attr = decode(args.nodes, device, constant) if type(args) is Nested else value(args)
            _set_attr(root, target, attr)
            made = graph.get_attr(target)
        elif op == "output":
            made = graph.output(value(args[0]))
        else:
            resolved = target.resolve() if type(target) in (Op, Named) else target
            made = graph.create_node(op, resolved, value(args), value(kwargs), name=name)
        env[name] = made
    graph.lint()
    return torch.fx.GraphModule(root, graph)


def _set_attr(root: Any, dotted: str, value: Any) -> None:
    import torch

    *path, last = dotted.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, torch.nn.Module):
        owner.add_module(last, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(last, value, persistent=False)
    else:
        setattr(owner, last, value)
