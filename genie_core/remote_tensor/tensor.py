"""`RemoteTensor`: a tensor on `remote_accelerator:N` that holds only an id. Every aten op on it
is recorded (its output shape worked out locally on `meta` tensors, cached), and runs on the
server when a value is needed."""

from __future__ import annotations

import math
import pickle
import warnings
from collections import OrderedDict
from typing import Any, SupportsIndex

import torch
from torch.utils._mode_utils import no_dispatch

from ..protocol.op_records import written_values
from ..protocol.tensor_ops import HostTensor, RemoteDevice, StorageOf, TensorRef, encode_value, ref
from . import custom_ops, device_model, overlaps, refusals, scalars, serialization, storages
from .output_specs import CONJUGATE, NEGATIVE, Layout, OutputSpec, aliases, expectations, layout_of
from .stream import OpStream, _ids, new_id, new_ids

aten = torch.ops.aten
DEVICE_TYPE = "remote_accelerator"

# Ops that need a value: answered by one round trip.
_LOCAL_SCALAR = aten._local_scalar_dense.default
_TO_COPY = aten._to_copy.default
_COPY = aten.copy_.default
_RECORD_STREAM = aten.record_stream.default
_SET_STORAGE = (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset)
_SET_TENSOR = aten.set_.source_Tensor


class _Handle:
    """Frees the server's tensor when the last local reference goes. It lives in the tensor's
    __dict__ (no weakref on the tensor), so `torch.utils.swap_tensors` carries it along."""

    __slots__ = ("__weakref__", "rid", "stream")

    def __init__(self, stream: OpStream, rid: int) -> None:
        self.rid, self.stream = rid, stream

    def __del__(self) -> None:
        self.stream.free(self.rid)


class RemoteTensor(torch.Tensor):
    _rid: int
    _ref: TensorRef
    _stream: OpStream
    _handle: _Handle
    _layout: Layout

    @staticmethod
    def __new__(
        cls, shape, stride, offset, dtype, stream: OpStream, rid: int | None = None, requires_grad: bool = False
    ):
        return _remote(
            stream, (shape, stride, offset, dtype, layout_of(dtype, shape, stride, offset)), cls, rid, requires_grad
        )

    @property
    def data(self) -> Any:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: Any) -> None:
        """`x.data = y`: x now names y's values on the server (as on CUDA, where it shares y's
        storage), with y's shape; its own server tensor is freed."""
        if type(value) is not RemoteTensor:
            raise RuntimeError(
                f"x.data = value: value must be a {DEVICE_TYPE} tensor of x's session (it is on {value.device}); "
                f"use x.data = value.to(x.device)"
            )
        if value._stream is not self._stream:
            _streams_of([self, value])  # raises, saying which devices or sessions
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]  # the shape, strides and offset
        rid = new_id()
        self._stream.record(("op", "aten.alias.default", (value._ref,), None, (rid,), None))
        self._rid, self._ref, self._handle = rid, ref(rid), _Handle(self._stream, rid)
        self._layout = value._layout
        storages.share(self, value)

    # PyTorch's own idiom for a subclass without __torch_function__ (typed unlike Tensor's classmethod)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # A "traceable wrapper subclass" (with no inner tensors): nn.Module.to() then swaps each
    # parameter's contents in place (torch.utils.swap_tensors) instead of making new Parameter
    # objects, so tied weights stay tied and optimizers made before .to() keep working, as on CUDA.
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], (self.dtype, self.device)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        """torch.compile's view of a remote tensor: a fake tensor of the device (compiler.py)."""
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode()
        if mode is None:
            raise RuntimeError(f"a {DEVICE_TYPE} tensor can be rebuilt from its parts only as a fake tensor")
        dtype, device = ctx
        with mode:
            fake = torch.empty_strided(outer_size, outer_stride, dtype=dtype, device=device)
        # Fake-ifying a view asks the rebuilt base for its (no) inner tensors; the fake itself stays
        # a plain tensor to Dynamo (no __tensor_unflatten__, so not a wrapper subclass)
        fake.__tensor_flatten__ = _no_inner_tensors  # type: ignore[attr-defined]
        return fake

    # Tensor.__repr__'s own signature (mypy's override check is off for this package: pyproject.toml)
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        text = repr(self.detach().cpu())
        suffix = f", device='{self.device}'"
        if self.grad_fn is not None:
            suffix += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            suffix += ", requires_grad=True"
        return text[:-1] + suffix + ")" if text.endswith(")") else text

    def __format__(self, format_spec: str) -> str:
        """`f"{loss:.4f}"`: a 0-dim tensor formats as its value, as torch.Tensor's does (which
        leaves subclasses to object.__format__, refusing any format spec)."""
        if self.dim() == 0 and not isinstance(self, torch.nn.Parameter):
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def numpy(self, *, force: bool = False) -> Any:
        return self.detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.detach().cpu().tolist()

    def untyped_storage(self) -> Any:
        """The server storage this tensor shares with its views (storages.py); this tensor is
        remembered as one that names it, so that `t.set_(x.untyped_storage(), ...)` names x's, and
        holds it, so that it stays one object (fake tensors of views tell aliases apart by it)."""
        storage = self._storage_object = storages.of(self).storage_on(self.device, self.__dict__.get("_handle"))
        return storage

    def data_ptr(self) -> int:
        """An address in its storage's own range (storages.py), as CUDA's are in its storage; 0 for
        a tensor with no elements, as PyTorch's."""
        if not self.numel():
            return 0
        return int(self.untyped_storage().data_ptr()) + int(self.storage_offset()) * self.element_size()

    def register_hook(self, hook: Any) -> Any:
        """As torch.Tensor's; a hook that raises during backward has its error raised at the next
        value needed (see _failed_in_backward: raising there would end the process)."""
        stream = self._stream

        def guarded(grad: Any) -> Any:
            try:
                return hook(grad)
            except Exception as exc:
                if torch._C._current_graph_task_id() < 0:
                    raise
                stream.defer(f"the hook {getattr(hook, '__name__', hook)!s}", exc)
                return None

        return super().register_hook(guarded)

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """`torch.save`d by its storage, as a CUDA tensor is: views saved together load sharing
        one storage, on the device or where `map_location` says (a conjugated or negated view
        with its bit: `lazy_bits`). Pickled elsewhere as its values on the CPU and its device, as
        PyTorch pickles tensors of devices without host-visible storage."""
        by_storage = serialization.saved_by_torch_save()
        if getattr(self, "_is_param", False):
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, OrderedDict()))
        if by_storage:
            laid_out: tuple = (
                self.storage_offset(),
                tuple(self.size()),
                self.stride(),
                self.requires_grad,
                OrderedDict(),
            )
            metadata = torch._utils.get_tensor_metadata(self)  # (its conjugate and negative bits)
            if self.dtype in torch.storage._new_dtypes():  # (PyTorch's format for dtypes a TypedStorage lacks)
                return (torch._utils._rebuild_tensor_v3, (self.untyped_storage(), *laid_out, self.dtype, metadata))
            storage = torch.storage.TypedStorage(wrap_storage=self.untyped_storage(), dtype=self.dtype, _internal=True)
            return (torch._utils._rebuild_tensor_v2, (storage, *laid_out, metadata))
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """Refused in words (DLPack's `BufferError`): its memory is on the server, not in this process."""
        raise BufferError(
            f"a {DEVICE_TYPE} tensor cannot be shared by DLPack: its memory is on the server; use .cpu() or .numpy()"
        )

    def record_stream(self, stream: Any) -> None:
        """Nothing to do: the server runs a device's work in one order, and frees a tensor after
        every op that uses it, whichever stream the notebook named (`torch.cuda`'s use: keeping
        memory from reuse while another stream reads it)."""
        if getattr(stream, "device", None) != self.device and getattr(stream, "device_type", None) != self.device.type:
            raise RuntimeError(f"record_stream: {stream} is not a stream of {self.device}")

    def __copy__(self) -> Any:
        """`copy.copy`: a tensor over the same storage (a leaf, as the CPU's is), not a copy of the
        values (`__reduce_ex__`'s, which `copy.copy` would take)."""
        with torch.no_grad():
            same = torch.empty(0, dtype=self.dtype, device=self.device)
            same.set_(self.untyped_storage(), self.storage_offset(), self.shape, self.stride())
        if getattr(self, "_is_param", False):
            return torch.nn.Parameter(same, self.requires_grad)
        return same.requires_grad_(self.requires_grad)

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy on the same device (recorded, no round trip); Parameters stay Parameters."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the moment"
            )
        with torch.no_grad():
            copy = self.clone(memory_format=torch.preserve_format)
        if getattr(self, "_is_param", False):
            copy = torch.nn.Parameter(copy, self.requires_grad)
        else:
            copy.requires_grad_(self.requires_grad)
        memo[id(self)] = copy
        return copy

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return dispatch(func, args, kwargs if kwargs is not None else {})
        except Exception as exc:
            if torch._C._current_graph_task_id() < 0:
                raise
            return _failed_in_backward(func, args, kwargs or {}, exc)  # inside backward: see there


def _no_inner_tensors() -> tuple[list[str], None]:
    return [], None


def _failed_in_backward(func, args: tuple, kwargs: dict, exc: Exception) -> Any:
    """An op that failed while autograd ran backward. A Python exception leaving an op there ends
    the process (PyTorch's Python device guard is called while the error is still set, in a
    noexcept destructor), so the error is kept on the stream and raised at the next value needed,
    naming the op, like a failure the server reports; the op's outputs are placeholders."""
    remote = [a for a in _leaves(args, kwargs) if type(a) is RemoteTensor]
    if not remote:
        raise exc
    remote[0]._stream.defer(str(func), exc)
    try:
        margs, mkwargs = _map(_to_meta, args, kwargs)
        out = func(*margs, **mkwargs)
    except Exception:  # shapes unknown: autograd then refuses the gradient (a C++ error, safe to raise)
        out = tuple(torch.empty(0, device="meta") for _ in func._schema.returns)
        out = out[0] if len(out) == 1 else out
    stream = remote[0]._stream

    failed: list[int] = []

    def placeholder(m: Any) -> Any:
        if not isinstance(m, torch.Tensor):
            return m
        r = RemoteTensor(m.shape, m.stride(), m.storage_offset(), m.dtype, stream)
        failed.append(r._rid)
        return r

    result = type(out)(placeholder(m) for m in out) if type(out) in (tuple, list) else placeholder(out)
    stream.record(("fail", failed, str(func), f"{type(exc).__name__}: {exc}"))  # later uses name this failure
    return result


def _streams_of(flat: list[Any]) -> OpStream:
    stream = None
    for a in flat:
        if isinstance(a, RemoteTensor):
            if stream is None:
                stream = a._stream
            elif a._stream is not stream:
                if a._stream.client is not stream.client:
                    raise RuntimeError(
                        "these remote tensors belong to two different Genie sessions "
                        f"({DEVICE_TYPE}:{stream.index} of one and {DEVICE_TYPE}:{a._stream.index} of another): "
                        "bring one to the CPU first (.cpu()), then .to() the other device"
                    )
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"{DEVICE_TYPE}:{stream.index} and {DEVICE_TYPE}:{a._stream.index}!"
                )
    if stream is None:
        raise RuntimeError("no remote tensor among the arguments")
    return stream


def _is_remote_device(value: Any) -> bool:
    return isinstance(value, torch.device) and value.type == DEVICE_TYPE


def _leaves(args: tuple, kwargs: dict) -> list[Any]:
    """Aten arguments are shallow: values, or one level of lists (cat, foreach, index)."""
    flat: list[Any] = []
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def _map(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def one(a: Any) -> Any:
        if type(a) is list or type(a) is tuple:
            return type(a)(fn(x) for x in a)
        return fn(a)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def set_metadata(t: torch.Tensor, size: Any, stride: Any, offset: int) -> None:
    """Change a wrapper's shape, strides and offset in place (the local half of `resize_`, `t_`,
    `set_`...): PyTorch's meta kernel of `set_` applied to the wrapper itself, which holds no data."""
    with no_dispatch():
        was = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            aten.set_.source_Storage_storage_offset(
                t, torch.Tensor.untyped_storage(t), offset, list(size), list(stride)
            )
        finally:
            torch._C._set_meta_in_tls_dispatch_include(was)
    if isinstance(t, RemoteTensor):
        t._layout = layout_of(t.dtype, size, stride, offset, t._layout.bits)
        storages.grown(t)


class _OpInfo:
    """What dispatch needs to know of an op, worked out once."""

    __slots__ = ("aliases", "foreign", "learn", "name", "special", "view_of", "writes")

    def __init__(self, func) -> None:
        self.name = str(func)
        self.learn = func in _DEVICE_DEPENDENT
        self.aliases = aliases(func)
        self.view_of = storages.view_of(func)  # the argument its output shares a storage with
        self.special = func in (_LOCAL_SCALAR, _TO_COPY, _COPY, _RECORD_STREAM)
        self.foreign = func.namespace not in ("aten", "prims")
        self.writes = overlaps.written(func)  # the arguments it writes, or None


def _sig(a: Any) -> Any:
    """One argument in the meta-cache key (tensors by dtype, shape, strides, offset, conjugate and
    negative bits, and whether remote)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), _bits(a), type(a) is RemoteTensor)
    if isinstance(a, torch.UntypedStorage):
        return ("storage", a.nbytes())
    return typed_key(a)


def typed_key(value: Any) -> Any:
    """A non-tensor argument in a cache key: 1, 1.0 and True are equal keys, and give outputs of
    different dtypes, so numbers other than ints are keyed with their type (in lists too)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return tuple(map(typed_key, value))
    return (kind, value) if kind in _TYPED else value


# Arguments that are their own meta-cache key and their own encoding. (Not float or bool: 1, 1.0
# and True are equal keys, and give outputs of different dtypes.)
_PLAIN = frozenset({int, str, type(None), torch.dtype, torch.layout})
_TYPED = frozenset({float, bool, complex})  # keyed with their type


def _scan(args: tuple, kwargs: dict) -> tuple[OpStream | None, list[Any], bool, list[Any]]:
    """One pass over the arguments: their stream, their meta-cache signature, whether any is a
    local tensor or storage (to be uploaded, or refused), and, when none is, the arguments as the
    worker reads them (remote tensors by reference), args then kwargs' values."""
    stream = None
    sig: list[Any] = []
    enc: list[Any] = []
    local = False
    for a in (*args, *kwargs.values()) if kwargs else args:
        kind = type(a)
        if kind is RemoteTensor:
            if stream is None:
                stream = a._stream
            elif a._stream is not stream:
                _streams_of(_leaves(args, kwargs))  # raises, saying which devices or sessions
            sig.append(a._layout)
            enc.append(a._ref)
        elif kind in _PLAIN:
            sig.append(a)
            enc.append(a)
        elif kind in _TYPED:
            sig.append((kind, a))
            enc.append(a)
        elif kind is list or kind is tuple:
            inner, inner_enc = [], []
            for x in a:
                if type(x) is RemoteTensor:
                    if stream is None:
                        stream = x._stream
                    elif x._stream is not stream:
                        _streams_of(_leaves(args, kwargs))
                    inner.append(x._layout)
                    inner_enc.append(x._ref)
                    continue
                if isinstance(x, torch.Tensor):
                    local = True
                inner.append(_sig(x))
                if not local:
                    inner_enc.append(x if type(x) in _PLAIN else _encode_other(x))
            sig.append((kind, *inner))
            enc.append(tuple(inner_enc))  # (a list would keep its record tracked by the collector)
        else:
            if isinstance(a, (torch.Tensor, torch.UntypedStorage)):
                local = True
            sig.append(_sig(a))
            if not local:
                enc.append(_encode_other(a))
    return stream, sig, local, enc


_Uninitialized = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
uninitialized_copy: Any = None  # lazy.py's, set when the device is registered (lazy.register)


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    info = func.__dict__.get("_genie")  # (not a dict keyed by the op: its __hash__ is Python code)
    if info is None:
        info = func._genie = _OpInfo(func)
    if info.special:
        if func is _COPY and isinstance(args[1], _Uninitialized) and uninitialized_copy is not None:
            return uninitialized_copy(args[0], args[1])  # `.to()` of a lazy module's parameter: no values yet
        if func is _RECORD_STREAM:  # (`Tensor.record_stream(t, s)`: see RemoteTensor.record_stream)
            return None
    stream, sig, local, enc = _scan(args, kwargs)
    if stream is None:
        raise RuntimeError("no remote tensor among the arguments")
    if torch.get_default_dtype() is not stream.default_dtype:  # (Python floats' dtype, factories')
        stream.follow_default_dtype(torch.get_default_dtype())

    if info.special:
        if func is _LOCAL_SCALAR:
            return stream.fetch(args[0]._rid).item()
        if func is _TO_COPY:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                return func(_to_meta(args[0]), **kwargs)  # (no values: none fetched)
            if device is not None and not _is_remote_device(device):
                local_copy = _laid_out_as(stream.fetch(args[0]._rid), args[0], kwargs)
                if _already_as_asked(local_copy, args[0], kwargs):
                    return local_copy  # fetched into memory of its own: the user's now (no second copy)
                return func(local_copy, **kwargs)
        if func is _COPY:
            dst, src = args[0], args[1]
            if type(dst) is not RemoteTensor:  # remote -> local
                return dst.copy_(stream.fetch(src._rid))
            if local and _takes_storage(dst, src, stream):  # `.to()`, `torch.tensor(data, device=...)`
                return dispatch(_SET_TENSOR, (dst, _from_its_first_element(src)), {})

    if local:
        _refuse_local_targets(func, args, kwargs, stream)
    if info.foreign:
        custom_ops.make_known(func, stream)
    outputs = None
    if not info.learn:
        try:
            outputs = stream.meta_cache.get((info, *sig, *kwargs) if kwargs else (info, *sig))
        except TypeError:  # something unhashable in the arguments (_output_specs: no caching)
            pass
        if outputs is not None and outputs.made is not None and not local:  # one fresh tensor out: the common case
            r = _remote(stream, outputs.made)
            if info.view_of is not None:
                storages.share(r, args[info.view_of])
            expect = None if outputs.verified == stream.trusted else stream.checks(outputs)
            stream.record(("op", info.name, *_split(enc, args, kwargs), (r._rid,), expect))
            return r
    if outputs is None:
        outputs = _output_specs(func, sig, args, kwargs, stream, info)
    uploads: list[int] = []
    if outputs is None or type(outputs) is _Learn or type(outputs) is _Ask:
        return _run_eagerly(func, stream, args, kwargs, _encoder(stream, uploads), uploads, outputs)
    writes = info.writes
    if writes is not None and overlaps.may_overlap(writes, args, kwargs, RemoteTensor):
        judged = _judged_overlap(func, info, writes, sig, args, kwargs, stream)
        if judged is not False:
            made = _run_eagerly(func, stream, args, kwargs, _encoder(stream, uploads), uploads)
            if type(judged) is tuple:
                stream.meta_cache[judged] = True  # (taken by the server: recorded from then on)
            return made
    out_meta = outputs.metas
    out_ids: list[int | None]
    if outputs.plain:  # fresh outputs only, no conjugate or negative views
        if outputs.made is not None:  # one tensor out
            r = _remote(stream, outputs.made)
            results, out_ids = [r], [r._rid]
        elif type(out_meta) in (tuple, list):
            results = [
                RemoteTensor(m.shape, m.stride(), m.storage_offset(), m.dtype, stream)
                if isinstance(m, torch.Tensor)
                else m
                for m in out_meta
            ]
            out_ids = [r._rid if type(r) is RemoteTensor else None for r in results]
        else:  # no tensor out (a check, like _linalg_check_errors)
            results, out_ids = [out_meta], [None]
        reshaped: list[tuple[Any, Any]] = []
    else:
        results, out_ids, reshaped = _outputs(out_meta, outputs.aliases, args, kwargs, stream)
    if info.view_of is not None and type(args[info.view_of]) is RemoteTensor:  # (split, unbind, conj, ...)
        for view, rid in zip(results, out_ids, strict=True):
            if rid is not None and type(view) is RemoteTensor:  # (not a written argument: it is itself)
                storages.share(view, args[info.view_of])
    elif func in _SET_STORAGE or func is _SET_TENSOR:
        _storage_set(args)
    enc_args: tuple
    enc_kwargs: dict | None
    if local:
        enc_args, enc_kwargs = _map(_encoder(stream, uploads), args, kwargs)
    else:
        enc_args, enc_kwargs = _split(enc, args, kwargs)
    expect = None if outputs.verified == stream.trusted else stream.checks(outputs)
    stream.record(("op", info.name, enc_args, enc_kwargs, tuple(out_ids), expect))
    for rid in uploads:
        stream.record(("free", rid))
    stream.send_uploads()
    for target, m in reshaped:
        set_metadata(target, m.shape, m.stride(), m.storage_offset())
    if type(out_meta) not in (tuple, list):
        return results[0]
    return type(out_meta)(results)


def _judged_overlap(
    func: Any, info: _OpInfo, writes: Any, sig: list[Any], args: tuple, kwargs: dict, stream: OpStream
) -> tuple | bool:
    """An op that writes memory its arguments read (`x[1:] = x[:-1]`; overlaps.py): False to
    record it; else it runs on the server at once, its error raised at the op with its target
    kept, and, taken, is recorded from then on (the returned key: None where the arguments cannot
    be a key). It runs at once where the CPU's kernel refuses it on stand-ins that share memory as
    the arguments do, or cannot be asked."""
    pattern = overlaps.suspected(writes, args, kwargs, RemoteTensor)
    if pattern is None:
        return False
    key: tuple | None = overlaps.key(info, sig, kwargs, pattern)
    try:
        if stream.meta_cache.get(key) is not None:
            return False  # (taken before with this sharing)
    except TypeError:  # (something unhashable among the arguments)
        key = None
    if not overlaps.refused(func, args, kwargs, pattern, stream.device_kind):
        if key is not None:
            stream.meta_cache[key] = True
        return False
    return key if key is not None else True


def lazy_bits(t: RemoteTensor, metadata: dict[str, Any]) -> None:
    """torch.load's conjugate or negative bit (`metadata`) on a remote tensor it rebuilt over a
    loaded storage: the server's tensor becomes such a view of it too, as `.data =` renames one
    (the bit on this tensor alone would be a view the server never made: wrong values)."""
    bits = t._layout.bits
    for bit, op, flag in (("conj", "aten._conj.default", CONJUGATE), ("neg", "aten._neg_view.default", NEGATIVE)):
        if metadata.get(bit) and not bits & flag:
            rid = new_id()
            t._stream.record(("op", op, (t._ref,), None, (rid,), None))
            t._rid, t._ref, t._handle = rid, ref(rid), _Handle(t._stream, rid)
            bits |= flag
    torch._C._set_tensor_metadata(t, metadata)  # type: ignore[attr-defined]
    t._layout = layout_of(t.dtype, t._layout.shape, t._layout.stride, t._layout.offset, bits)


def _storage_set(args: tuple) -> None:
    """`t.set_(x)` or `t.set_(x.untyped_storage(), ...)`: t names x's storage from here."""
    if type(args[1]) is RemoteTensor or isinstance(args[1], torch.UntypedStorage):
        storages.share(args[0], args[1])


def _laid_out_as(fetched: torch.Tensor, remote: Any, kwargs: dict) -> torch.Tensor:
    """A fetched copy (its values in C order) laid out as `.to()` lays out a copy between any two
    devices, as a CUDA tensor's `.cpu()` does: a dense tensor's strides kept (transposed,
    channels_last), a gapped or overlapping one's made dense in the same order of dims."""
    if fetched.stride() == remote.stride() or kwargs.get("memory_format") not in (None, torch.preserve_format):
        return fetched
    like = torch.empty_strided(remote.shape, remote.stride(), device="meta")
    stride = torch.empty_like(like).stride()  # (PyTorch's rule, empty_like's; on meta: no memory)
    if stride == fetched.stride():
        return fetched
    return torch.empty_strided(remote.shape, stride, dtype=fetched.dtype).copy_(fetched)


def _already_as_asked(fetched: torch.Tensor, remote: Any, kwargs: dict) -> bool:
    """Whether the values fetched for `.to(cpu)`/`.cpu()` are already the copy it asks for: laid
    out as the remote tensor (`preserve_format`), in its dtype, plain CPU memory, nothing shared."""
    return (
        fetched.device.type == "cpu"
        and torch.device(kwargs["device"]).type == "cpu"
        and kwargs.get("dtype") in (None, fetched.dtype)
        and kwargs.get("memory_format") in (None, torch.preserve_format)
        and not kwargs.get("pin_memory")
        and kwargs.get("layout") in (None, torch.strided)
        and fetched.stride() == remote.stride()
        and not fetched.storage_offset()
    )


def _takes_storage(dst: RemoteTensor, src: Any, stream: OpStream) -> bool:
    """Whether a CPU tensor's copy into `dst` can instead make the uploaded values `dst`'s own
    (`set_`): `dst` was made empty by the last op recorded, so nothing has seen it (`.to()` makes
    its destination so), and the source is laid out as it is. The bytes that arrived are then the
    tensor's on a CPU server (no copy there), and a GPU server's copy to the device is the only one."""
    return (
        type(src) is torch.Tensor
        and src.device.type == "cpu"
        and (src.dtype, src.shape, src.stride()) == (dst.dtype, dst.shape, dst.stride())
        and src.is_contiguous()
        and stream.made_empty_last(dst._rid)
    )


def _from_its_first_element(src: torch.Tensor) -> torch.Tensor:
    """A CPU view (`x[1:]`) whose storage starts at its first element: the same memory. Only the
    elements go up, into a storage of their own on the server, so a tensor that takes them as its
    own must start there too (as `x[1:].to("cuda")` does), not at the view's offset."""
    if not src.storage_offset():
        return src
    start = src.storage_offset() * src.element_size()
    storage = src.untyped_storage()[start:]  # (a CPU storage's slice: the same memory, kept alive by it)
    rebased = torch.empty(0, dtype=src.dtype).set_(storage, 0, src.shape, src.stride())
    torch._C._set_conj(rebased, src.is_conj())  # (lazy conjugation and negation, kept)
    torch._C._set_neg(rebased, src.is_neg())
    return rebased


def _split(enc: list[Any], args: tuple, kwargs: dict) -> tuple[tuple, dict | None]:
    """_scan's encoded arguments as the op's args and kwargs (None: no kwargs)."""
    if not kwargs:
        return tuple(enc), None
    return tuple(enc[: len(args)]), dict(zip(kwargs, enc[len(args) :], strict=True))


def _encode_other(a: Any) -> Any:
    if _is_remote_device(a):
        return RemoteDevice()
    if isinstance(a, torch.Generator):
        raise NotImplementedError(
            "explicit torch.Generator objects are not supported on remote tensors; use torch.manual_seed"
        )
    if type(a) not in _SENDABLE:  # refused at the op: pickled with its batch, it would lose the batch
        try:
            pickle.dumps(a, protocol=5, buffer_callback=_no_copy)
        except Exception as e:
            raise TypeError(f"an argument of type {type(a).__name__} cannot be sent to the server: {e}") from None
    return encode_value(a)


_SENDABLE = frozenset({bytes, torch.device, torch.Size, torch.memory_format, torch.qscheme, HostTensor, RemoteDevice})


def _no_copy(buffer: Any) -> None:
    """(Big buffers stay out of the check: the batch sends them out of band.)"""


def _outputs(out_meta: Any, aliases: dict, args: tuple, kwargs: dict, stream: OpStream) -> tuple[list, list, list]:
    """Results of an op with in-place/out= outputs or conjugate/negative views."""
    metas = out_meta if type(out_meta) in (tuple, list) else (out_meta,)
    results: list[Any] = []
    out_ids: list[int | None] = []
    reshaped: list[tuple[Any, Any]] = []
    for position, m in enumerate(metas):
        alias = aliases.get(position)
        if alias is not None:  # an in-place or out= op: the result *is* that argument
            target = _argument(alias, args, kwargs)
            if isinstance(m, torch.Tensor) and (tuple(m.shape), tuple(m.stride()), m.storage_offset()) != (
                tuple(target.shape),
                tuple(target.stride()),
                target.storage_offset(),
            ):
                reshaped.append((target, m))  # resize_, t_, set_, out= resized: the wrapper follows
            results.append(target)
            out_ids.append(None)
        elif isinstance(m, torch.Tensor):
            r = RemoteTensor(m.shape, m.stride(), m.storage_offset(), m.dtype, stream)
            bits = _bits(m)
            if bits:  # lazy conjugation and negation, as on the server (a view of such a view keeps them)
                torch._C._set_conj(r, bool(bits & CONJUGATE))
                torch._C._set_neg(r, bool(bits & NEGATIVE))
                r._layout = layout_of(m.dtype, m.shape, m.stride(), int(m.storage_offset()), bits)
            results.append(r)
            out_ids.append(r._rid)
        else:
            results.append(m)
            out_ids.append(None)
    return results, out_ids, reshaped


def _encoder(stream: OpStream, uploads: list[int]) -> Any:
    """Arguments as the worker reads them. Local (CPU) tensors travel with the op: uploaded once,
    by value, their ids noted in `uploads` to be freed after it."""

    def encode(a: Any) -> Any:
        if isinstance(a, RemoteTensor):
            return a._ref
        if isinstance(a, torch.Tensor):
            if a.device.type == "meta":
                raise RuntimeError("meta tensors cannot be mixed with remote tensors")
            if a.device.type == DEVICE_TYPE:  # (storages.as_remote gave it back: no remote tensor's)
                raise RuntimeError(
                    f"this {a.device} tensor is not a remote tensor: it was made over raw memory (DLPack, "
                    "C++ code), which this device has not in this process; make it on the device, or from a CPU tensor"
                )
            rid = new_id()
            stream.upload(rid, a)  # a snapshot, or sent at the end of the op: later local changes must not leak in
            uploads.append(rid)
            return ref(rid)
        if isinstance(a, torch.UntypedStorage):
            return _encode_storage(a, stream)
        return a if type(a) in _PLAIN or type(a) in _TYPED else _encode_other(a)

    return encode


def record_call(
    name: str, args: tuple, kwargs: dict, expected: list[Any], *, stream: OpStream | None = None, encoded: bool = False
) -> tuple[list[Any], OpStream]:
    """Record a call of one of the server's own functions (see attention.py); its outputs are
    remote tensors laid out like `expected` (meta tensors, or None where there is no output).
    `encoded`: the arguments are already as the worker reads them (compiler.py)."""
    if stream is None:
        stream = _streams_of(_leaves(args, kwargs))
    uploads: list[int] = []
    outs: list[Any] = []
    for m in expected:
        outs.append(None if m is None else RemoteTensor(m.shape, m.stride(), m.storage_offset(), m.dtype, stream))
    enc_args, enc_kwargs = (args, kwargs) if encoded else _map(_encoder(stream, uploads), args, kwargs)
    stream.record(
        ("call", name, enc_args, enc_kwargs, tuple(None if r is None else r._rid for r in outs), expectations(expected))
    )
    for rid in uploads:
        stream.record(("free", rid))
    stream.send_uploads()
    return outs, stream


def _encode_storage(storage: Any, stream: OpStream) -> StorageOf:
    """A storage argument (`set_`): a remote tensor's, or bytes loaded for the device."""
    shared = storages.named_by(storage)
    handle = shared.owner() if shared is not None else None
    if handle is not None:
        return StorageOf(ref(handle.rid))
    loaded = serialization.loaded.get(storage.data_ptr()) if storage.device.type == DEVICE_TYPE else None
    if loaded is not None:  # torch.load onto the device: the bytes go up once per storage
        if loaded.rid is None or loaded.stream is not stream:
            rid = new_id()
            stream.upload(rid, torch.empty(0, dtype=torch.uint8).set_(loaded.cpu))
            loaded.rid, loaded.stream = rid, stream  # (once the upload is recorded: not if it was refused)
        return StorageOf(ref(loaded.rid))
    raise RuntimeError(
        f"set_: this {storage.device} storage is not the storage of a remote tensor; use a remote tensor's "
        "untyped_storage(), or copy the values to the device first"
    )


_QUANTIZED = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _refuse_quantized(func: Any, args: tuple, kwargs: dict) -> None:
    """Quantized tensors are not supported: refused at the op that would make one (PyTorch's meta
    kernel of `quantize_per_tensor` promises a float32 tensor)."""
    if any(type(a) is torch.dtype and a in _QUANTIZED for a in (*args, *kwargs.values())):
        raise NotImplementedError(f"{func}: quantized tensors are not supported on {DEVICE_TYPE}")


def _refuse_local_targets(func: Any, args: tuple, kwargs: dict, stream: OpStream) -> None:
    """An op on remote tensors that would write a CPU tensor (`cpu.add_(remote)`, `out=cpu`) is
    refused, as CUDA refuses it: the server would write its copy of the CPU tensor, not the tensor.
    (`cpu.copy_(remote)` is a fetch: dispatch takes it first.)"""
    for v in written_values(func._schema, args, kwargs):
        if isinstance(v, torch.Tensor) and type(v) is not RemoteTensor:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{stream.device} and {v.device}! ({func} would write a {v.device} tensor)"
            )


def _argument(alias: Any, args: tuple, kwargs: dict) -> Any:
    if alias[0] == "pos" and alias[1] < len(args):
        return args[alias[1]]
    return kwargs[alias[-1]]


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        m = (
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta").as_strided(
                a.shape, a.stride(), a.storage_offset()
            )
            if a.storage_offset()
            else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        )
        if a.is_conj() or a.is_neg():  # (a view op's meta output keeps them, as the server's does)
            torch._C._set_conj(m, a.is_conj())
            torch._C._set_neg(m, a.is_neg())
        return m
    if _is_remote_device(a):
        return torch.device("meta")
    if isinstance(a, torch.UntypedStorage):
        return torch.UntypedStorage(a.nbytes(), device="meta")
    return a


def _bits(t: torch.Tensor) -> int:
    """Whether a tensor is a lazily conjugated or negated view (a Layout's `bits`)."""
    return (CONJUGATE if t.is_conj() else 0) | (NEGATIVE if t.is_neg() else 0)


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _remote(
    stream: OpStream, made: tuple, cls: Any = None, rid: int | None = None, requires_grad: bool = False
) -> RemoteTensor:
    """A remote tensor laid out as `made` says (shape, strides, offset, dtype, interned layout; a
    meta-cache entry has it ready): the hot path of every op, and RemoteTensor(...)'s body."""
    shape, stride, offset, dtype, layout = made
    r = _make_wrapper(
        cls or RemoteTensor,
        shape,
        strides=stride,
        storage_offset=offset,
        dtype=dtype,
        device=stream.device,
        requires_grad=requires_grad,
    )
    r._rid = rid = next(_ids) if rid is None else rid
    r._ref = ref(rid)  # how ops name it (one object, so a batch pickles it once)
    r._stream = stream
    r._handle = _Handle(stream, rid)
    r._layout = layout
    return r


class _Learn(tuple):
    """The meta-cache key of an op whose outputs' metadata must come from the device (one round trip
    per new signature; see _DEVICE_DEPENDENT)."""


class _Ask(tuple):
    """The meta-cache key of an op the CPU's kernel refused on stand-ins where its meta kernel took
    it (refusals.py): run on the server at once, its outputs, if it makes them, cached under the key."""


# Ops whose outputs' metadata, or whether they run at all, differs between devices, and that the
# device model (device_model.py) does not get right on every device: the CPU kernels give
# reduced-precision statistics the input's dtype (but float32 beside float32 weights), empty
# statistics or offset2bag in some modes, and a float32 grouped_mm that CUDA refuses. The first
# call with a signature runs eagerly and its outputs' shapes and dtypes, as the server's device
# made them, are cached for later calls.
_DEVICE_DEPENDENT = {
    aten.native_layer_norm.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
    aten._batch_norm_with_update.default,
    aten._batch_norm_no_update.default,
    aten._embedding_bag.default,
    aten._embedding_bag_forward_only.default,
    aten._grouped_mm.default,
    aten.addbmm_.default,  # the CPU and CUDA kernels resize a (1,) self; the meta kernel refuses
}


def _padded_from_mask(t: Any, mask: Any, mask_check: bool = True) -> Any:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _padded_output(t: Any, padding: float, output_size: Any = None) -> Any:
    if output_size is None:
        raise NotImplementedError("the padded size depends on the nested tensor's lengths")
    return torch.empty(output_size, dtype=t.dtype, device="meta")


def _like_source(src: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.empty_like(src)


def _not_pinned(t: Any, *args: Any, **kwargs: Any) -> Any:
    """`pin_memory()` of a remote tensor, refused at the op in PyTorch's words for a CUDA tensor."""
    raise RuntimeError(f"cannot pin a {DEVICE_TYPE} tensor: only dense CPU tensors can be pinned")


def _indexed(t: Any, indices: list[Any]) -> Any:
    """`x[indices]` as the CPU and CUDA check it: a uint8 mask taken as a bool mask (with their
    warning; PyTorch's meta kernel refuses it, taking int8 where it means uint8), and a bad index
    an `IndexError` (the meta kernel's is a `RuntimeError`), in the CPU's words where they differ."""
    if any(i is not None and i.dtype == torch.uint8 for i in indices):
        warnings.warn(  # (the warning's place: the op, a few frames up, as PyTorch's C++ gives no frame)
            "indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.", stacklevel=2
        )
        indices = [i.bool() if i is not None and i.dtype == torch.uint8 else i for i in indices]
    try:
        return aten.index.Tensor(t, indices)
    except RuntimeError as e:
        if type(e) is not RuntimeError:  # (a bool mask's: its output depends on the data)
            raise
        if "broadcast" in str(e):
            shapes = ", ".join(str(list(i.shape)) for i in indices if i is not None)
            raise IndexError(
                f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}"
            ) from None
        raise IndexError(str(e)) from None


def _index_filling(op: Any) -> Any:
    """`index_fill` checked as the CPU and CUDA check it: a complex value (a number or a tensor,
    whatever its value) into a real tensor is refused at the op (the meta kernel lets it pass)."""

    def rule(t: Any, dim: Any, index: Any, value: Any) -> Any:
        if not t.is_complex() and (type(value) is complex or (isinstance(value, torch.Tensor) and value.is_complex())):
            raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")
        return op(t, dim, index, value)

    return rule


def _index_putting(op: Any) -> Any:
    """`index_put` checked as the CPU and CUDA check it: values of another dtype are refused at
    the op (the meta kernel casts them), but where PyTorch makes it a `masked_fill` (one bool
    mask, one value), which converts the value."""

    def rule(t: Any, indices: Any, values: Any, *rest: Any) -> Any:
        one_mask = len(indices) == 1 and indices[0] is not None and indices[0].dtype in (torch.bool, torch.uint8)
        if values.dtype != t.dtype and not (one_mask and values.numel() == 1):  # (the CPU's words, from one element)
            torch.empty(1, dtype=t.dtype).index_put_((torch.tensor([0]),), torch.empty(1, dtype=values.dtype))
        return op(t, indices, values, *rest)

    return rule


def _filling_out(op: Any) -> Any:
    """`arange`, `linspace` and `logspace` into an `out=` with as many elements as they make keep
    its shape and strides, as the CPU's and CUDA's kernels do (their meta kernels resize it
    whenever the shape differs: the notebook's tensor took a shape the server's did not)."""

    def rule(*args: Any, out: Any, **kwargs: Any) -> Any:
        shape, stride, offset = out.shape, out.stride(), out.storage_offset()
        made = op(*args, out=out, **kwargs)
        if made.numel() != math.prod(shape):
            return made
        return torch.empty_strided(shape, stride, dtype=made.dtype, device="meta").as_strided(shape, stride, offset)

    return rule


# Ops whose outputs here are not their meta kernel's. The nested tensors of nn.TransformerEncoder's
# inference fast path (`enable_nested_tensor`): the server holds the nested tensor, and here it has
# its padded shape (the source's), the shape that each encoder layer (a meta kernel of its own from
# torch 2.13) and `to_padded_tensor` work with. `pin_memory()`: none, refused at the op. Indexing
# and `index_fill`: as the CPU checks them.
_SHAPE_RULES = {
    aten.index.Tensor: _indexed,
    aten._nested_tensor_from_mask.default: _padded_from_mask,
    aten.to_padded_tensor.default: _padded_output,
    aten._transformer_encoder_layer_fwd.default: _like_source,
    aten._pin_memory.default: _not_pinned,
    **{
        op: _index_filling(op)
        for op in (
            aten.index_fill.int_Scalar,
            aten.index_fill_.int_Scalar,
            aten.index_fill.int_Tensor,
            aten.index_fill_.int_Tensor,
        )
    },
    **{op: _index_putting(op) for op in (aten.index_put.default, aten.index_put_.default)},
    **{
        getattr(getattr(aten, name), overload): _filling_out(getattr(getattr(aten, name), overload))
        for name in ("arange", "linspace", "logspace")
        for overload in getattr(aten, name).overloads()
        if overload.endswith("out")
    },
}


def _output_specs(func, sig: list[Any], args: tuple, kwargs: dict, stream: OpStream, info: Any = None) -> Any:
    """Output shapes as the server's device type makes them (device_model.py; cached per stream),
    None when they depend on data, or a _Learn key when the device must say (see _DEVICE_DEPENDENT)."""
    meta_cache = stream.meta_cache
    try:
        key = (info if info is not None else func, *sig, *kwargs)
        if info.learn if info is not None else func in _DEVICE_DEPENDENT:
            key = _Learn(key)
        cached = meta_cache.get(key)
    except TypeError:  # something unhashable in the arguments: no caching
        key, cached = None, None
    if cached is None and isinstance(key, _Learn):
        return key
    if cached is None:
        margs, mkwargs = _map(_to_meta, args, kwargs)
        _refuse_quantized(func, args, kwargs)
        rule: Any = _SHAPE_RULES.get(func)
        try:
            if rule is not None:
                out = rule(*margs, **mkwargs)
            else:
                out = device_model.outputs(func, margs, mkwargs, stream.device_kind)
        except NotImplementedError:
            if func._schema.returns:
                return None  # no meta kernel: run it on the server now
            out = None  # one that makes nothing, only writes its arguments (`_fused_sgd_`): recorded
        except device_model.NOT_KNOWN_HERE:
            return None  # a data-dependent output shape: run it on the server now
        except Exception as exc:  # (a meta kernel raises RuntimeError, ValueError, AssertionError, IndexError...)
            text = str(exc).lower()
            if "meta" in text and ("cannot" in text or "not implemented" in text):
                return None
            verdict = refusals.cpu_verdict(func, args, kwargs) if rule is None else None
            verdict = refusals.as_the_server_would(verdict, stream.device_kind)
            if verdict is refusals.TAKEN:
                return _Ask(key) if key is not None else None  # a meta kernel stricter than the kernels
            raise (verdict or exc) from None  # a real error (shapes, dtypes): here, at the op, in the CPU's words
        if not scalars.fit(func, args, kwargs, out):  # (a number that overflows its dtype)
            verdict = refusals.cpu_verdict(func, args, kwargs, refusals.SMALL_BYTES) if not stream.versions else None
            verdict = refusals.as_the_server_would(verdict, stream.device_kind)
            if isinstance(verdict, Exception):
                raise verdict from None  # (the CPU's words: here, at the op)
            if verdict is None:
                return None  # (not asked: the server's kernel says, at the op)
        if refusals.narrowing(func, margs, mkwargs, out):
            verdict = refusals.cpu_verdict(func, args, kwargs, tiny=True)  # (a verdict on dtypes: any size)
            verdict = refusals.as_the_server_would(verdict, stream.device_kind)
            if isinstance(verdict, Exception):
                raise verdict from None  # (the CPU's words: here, at the op)
        # the CPU's refusal sends the op at once, on any server: the server's kernel answers at the
        # op (refusals.py); a GPU's kernels, or another torch's, that take it cost one round trip
        if rule is None and key is not None and refusals.refused_on_the_cpu(func, args, kwargs, out):
            return _Ask(key)
        if any(
            isinstance(m, torch.Tensor) and m.layout != torch.strided
            for m in (out if type(out) in (tuple, list) else (out,))
        ):
            raise NotImplementedError(
                f"{func}: sparse and other non-strided layouts are not supported on remote_accelerator"
            )
        cached = OutputSpec(out, func)
        if key is not None:
            if len(meta_cache) > 50_000:
                meta_cache.clear()
            meta_cache[key] = cached
    return cached


def described_tensor(item: dict[str, Any], stream: OpStream) -> RemoteTensor:
    """The remote tensor the worker described (its id and layout: worker/tensors.py `_described`)."""
    return RemoteTensor(
        item["shape"], item["stride"], item["offset"], getattr(torch, item["dtype"]), stream, rid=item["id"]
    )


def _run_eagerly(
    func, stream: OpStream, args: tuple, kwargs: dict, encode, uploads: list[int], learn: Any = None
) -> Any:
    """Ops whose output shape depends on the data (nonzero, masked_select, unique, ...), or on the
    device (`learn`, a meta-cache key to fill): one round trip."""
    returns = func._schema.returns
    is_list = any(isinstance(r.type, torch.ListType) for r in returns)
    out_ids: Any = new_ids() if is_list else [new_id() for _ in returns]
    enc_args, enc_kwargs = _map(encode, args, kwargs)
    described = stream.answer(("op", str(func), enc_args, enc_kwargs, out_ids, None))
    for rid in uploads:
        stream.record(("free", rid))
    results = []
    written = aliases(func)
    for position, item in enumerate(described["outputs"]):
        if "value" in item:
            results.append(item["value"])
        elif position in written:  # in place: the result is the argument (its shape may have changed)
            target = _argument(written[position], args, kwargs)
            set_metadata(target, item["shape"], item["stride"], item["offset"])
            stream.record(("free", item["id"]))
            results.append(target)
        else:
            results.append(described_tensor(item, stream))
    if learn is not None:
        metas = [
            torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta").as_strided(
                r.shape, r.stride(), r.storage_offset()
            )
            if isinstance(r, torch.Tensor)
            else r
            for r in results
        ]
        out = (metas if is_list else tuple(metas)) if described["tuple"] else (metas[0] if metas else None)
        stream.meta_cache[learn] = OutputSpec(out, func)  # (an _Ask key equals its plain tuple: dispatch finds it)
    if described["tuple"]:
        return results if is_list else tuple(results)
    return results[0] if returns else None  # (an op that returns nothing: `_fused_sgd_`)
