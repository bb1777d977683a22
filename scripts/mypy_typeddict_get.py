"""A mypy plugin (pyproject.toml's [tool.mypy] plugins): `d.get("key")` on a TypedDict that has no
such key is an error, as `d["key"]` already is. PEP 589 lets a type checker take any key in `.get`;
mypy does, which would hide a field renamed on one side of the wire from the readers of
genie_core/protocol/contents.py, who read with `.get` and a default (received content is checked
for its signature, not its shape)."""

from __future__ import annotations

from collections.abc import Callable

from mypy.errorcodes import TYPEDDICT_ITEM
from mypy.plugin import MethodContext, Plugin
from mypy.plugins.common import try_getting_str_literals
from mypy.plugins.default import typed_dict_get_callback
from mypy.types import Type, TypedDictType, get_proper_type


def _get(ctx: MethodContext) -> Type:
    receiver = get_proper_type(ctx.type)
    if isinstance(receiver, TypedDictType) and ctx.args and len(ctx.args[0]) == 1:
        for key in try_getting_str_literals(ctx.args[0][0], ctx.arg_types[0][0]) or []:
            if key not in receiver.items:
                name = receiver.fallback.type.name
                ctx.api.fail(f'TypedDict "{name}" has no key "{key}"', ctx.context, code=TYPEDDICT_ITEM)
    return typed_dict_get_callback(ctx)  # what mypy infers otherwise


class TypedDictGet(Plugin):
    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        return _get if fullname == "typing.Mapping.get" else None


def plugin(version: str) -> type[Plugin]:
    return TypedDictGet
