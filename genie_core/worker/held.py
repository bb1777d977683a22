"""The tensors a session holds on the worker, by id: with the bytes of their distinct storages
counted where the server limits them (--max-session-bytes)."""

from __future__ import annotations

from typing import Any

import torch


class HeldTensors(dict[int, Any]):
    """id -> tensor, counting the bytes of the distinct storages held (views share their base's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_held = 0
        self._storages: dict[tuple[bool, int], list[int]] = {}  # (on a GPU, address) -> [bytes, users]

    @staticmethod
    def _key(value: Any) -> tuple[tuple[bool, int], int] | None:
        if not isinstance(value, torch.Tensor):
            return None
        storage = value.untyped_storage()
        address = storage.data_ptr()  # 0 for meta tensors and empty storages
        return ((value.is_cuda, address), storage.nbytes()) if address else None

    def __setitem__(self, rid: int, value: Any) -> None:
        if rid in self:
            self.pop(rid, None)
        super().__setitem__(rid, value)
        found = self._key(value)
        if found is not None:
            entry = self._storages.setdefault(found[0], [found[1], 0])
            if entry[1] == 0:
                self.bytes_held += entry[0]
            entry[1] += 1

    def pop(self, rid: int, default: Any = None) -> Any:
        value = super().pop(rid, default)
        found = self._key(value)
        if found is not None and found[0] in self._storages:
            entry = self._storages[found[0]]
            entry[1] -= 1
            if entry[1] <= 0:
                del self._storages[found[0]]
                self.bytes_held -= entry[0]
        return value

    def storage_bytes(self) -> int:
        """Bytes of the distinct storages held (counted as they come and go)."""
        return self.bytes_held


class UncountedTensors(dict[int, Any]):
    """id -> tensor, when no byte limit needs the count (it costs a storage lookup per tensor)."""

    bytes_held = 0

    def storage_bytes(self) -> int:
        """Bytes of the distinct storages held, counted now."""
        storages = {}
        for value in self.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        storages.pop(0, None)
        return sum(storages.values())
