"""Where a run's ClientActors and DriverActor live (``placement.executor``).

``ray``: each is a Ray actor in a process of its own, on a local Ray started for the run or on the cluster
it attaches to. ``local``: the same classes as plain objects in the run's own process, called one after
another; nothing starts, so a small run or a test begins training at once. Both run the same actor code
with the same clients per actor, so they give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray


class RayExecutor:
    """Actors are Ray actors; calls return ObjectRefs."""

    local = False

    def actor(self, cls: type, options: dict[str, Any], *args: Any) -> Any:
        return ray.remote(cls).options(**options).remote(*args)

    def put(self, value: Any) -> Any:
        return ray.put(value)

    def get(self, refs: Any) -> Any:
        return ray.get(refs)

    def kill(self, handle: Any) -> None:
        ray.kill(handle)


class _Done:
    """The result of a call already made (the local stand-in of an ObjectRef)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _resolved(value: Any) -> Any:
    return value.value if isinstance(value, _Done) else value


class _LocalMethod:
    def __init__(self, bound: Callable[..., Any]):
        self.bound = bound

    def remote(self, *args: Any, **kwargs: Any) -> _Done:
        return _Done(self.bound(*map(_resolved, args), **{k: _resolved(v) for k, v in kwargs.items()}))


class _LocalActor:
    """A plain object whose methods are called as Ray actor methods are (``handle.method.remote(...)``)."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._obj, name))


class LocalExecutor:
    """Actors are objects of this process; a call runs at once and returns its result, wrapped."""

    local = True

    def actor(self, cls: type, options: dict[str, Any], *args: Any) -> _LocalActor:
        return _LocalActor(cls(*map(_resolved, args)))

    def put(self, value: Any) -> _Done:
        return _Done(value)

    def get(self, refs: Any) -> Any:
        return [_resolved(ref) for ref in refs] if isinstance(refs, list) else _resolved(refs)

    def kill(self, handle: Any) -> None:
        """Nothing to stop: the object goes when the run drops it."""
