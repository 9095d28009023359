"""The record of every change made to a model's modules, each with its undo: one ledger, one undo."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from torch.utils.hooks import RemovableHandle

_ABSENT = object()


class Ledger:
    """Changes to a model's modules (and configs), in the order made, under keys that name them
    (``("rotary", "model.rotary_emb")``). Each change touches its own attributes, so one can be undone out of order;
    :meth:`undo` with no key undoes all of them, last first, and leaves every object as it was."""

    def __init__(self) -> None:
        self._undos: dict[Hashable, list[Callable[[], None]]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._undos

    def keys(self) -> list[Hashable]:
        return list(self._undos)

    def set(self, key: Hashable, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``; undone by restoring the instance attribute it replaced, or by deleting it (a method,
        such as ``forward``, then falls back to the class's)."""
        previous = obj.__dict__.get(name, _ABSENT)
        setattr(obj, name, value)

        def restore() -> None:
            if previous is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)

        self.record(key, restore)

    def hooks(self, key: Hashable, module: Any, marker: str, *handles: RemovableHandle) -> None:
        """Hooks registered on ``module``, kept (and marked) as ``module.<marker>``; undone by removing them."""
        self.set(key, module, marker, handles)

        def remove() -> None:
            for handle in handles:
                handle.remove()

        self.record(key, remove)

    def record(self, key: Hashable, undo: Callable[[], None]) -> None:
        """A change made by the caller, and how to undo it."""
        self._undos.setdefault(key, []).append(undo)

    def undo(self, key: Hashable | None = None) -> None:
        """Undo the changes under ``key`` (all of them when None), last first."""
        keys = [key] if key is not None else list(reversed(self._undos))
        for k in keys:
            for undo in reversed(self._undos.pop(k, [])):
                undo()
