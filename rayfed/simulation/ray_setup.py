"""Ray in the driver process: starting it (a private local instance on loopback, or a cluster's address), importing
and shipping the user's plug-ins to the actors, and telling an actor's death from an error it raised."""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any
from unittest import mock

import ray
from ray import cloudpickle
from tqdm.auto import tqdm

from rayfed import registry
from rayfed.config import RunConfig
from rayfed.errors import ConfigError


def init_ray(config: RunConfig) -> bool:
    """Start local Ray (loopback only, no dashboard) or attach to ``ray.address``; True if we started it."""
    if ray.is_initialized():
        return False
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    init_local_ray(num_cpus=config.ray.num_cpus, num_gpus=config.ray.num_gpus,
                   object_store_memory=config.ray.object_store_memory)
    return True


def smallest_object_store() -> float | None:
    """The bytes of the smallest object store among the Ray cluster's alive nodes (None outside Ray)."""
    if not ray.is_initialized():
        return None
    stores = [node["Resources"].get("object_store_memory", 0) for node in ray.nodes() if node.get("Alive")]
    return min((store for store in stores if store), default=None)


class ObjectStoreCheck:
    """Says once a method when a round's payloads and uploads outgrew Ray's object store: Ray then spills them to
    disk and reads them back, seconds a round at paper size, and nothing else tells why the rounds are slow."""

    def __init__(self) -> None:
        self.said: set[str] = set()  # the methods already told

    def __call__(self, label: str, rounds_done: int, store_bytes: int, store: float | None) -> None:
        """``store``: the bytes of the smallest node's object store (:func:`smallest_object_store`; None: no Ray)."""
        if store and store_bytes > store and label not in self.said:
            self.said.add(label)
            tqdm.write(f"[rayfed] {label}: round {rounds_done}'s payloads and uploads took {store_bytes / 1e9:.2f} GB "
                       f"of Ray's object store, which holds {store / 1e9:.2f} GB (on its smallest node); Ray spills "
                       "what does not fit to disk and reads it back, seconds a round; raise ray.object_store_memory "
                       f"(a local Ray's) or the nodes' object store above {store_bytes / 1e9:.2f} GB.")


def keep_loopback() -> Any:
    """A context in which Ray nodes started with node address 127.0.0.1 keep it.

    Ray 2.60 rewrites a loopback node address to the machine's routable IP (services.resolve_ip_for_localhost),
    after which its servers listen on every interface."""
    return mock.patch.object(ray._private.services, "resolve_ip_for_localhost", lambda host: host)


def init_local_ray(**kwargs: Any) -> None:
    """A new private Ray instance on this machine, reachable on 127.0.0.1 only, without a dashboard."""
    with keep_loopback():
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", **kwargs)


def import_plugin_modules(config: RunConfig) -> None:
    """Import the config's ``imports`` (modules whose decorators register plug-ins), but not a module whose plug-ins
    came registered with the run: a Tune trial or an actor gets the driver's by value, and its process may not be
    able to import the driver script's folder by name."""
    shipped = {getattr(entry.obj, "__module__", None) for entry in registry.user_entries()}
    for module in config.imports:
        if module in shipped:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"imports: module {module!r} cannot be imported ({err}).") from None


def ship_by_value(objects: Iterable[Any]) -> None:
    """Have Ray send the user's own code by value: the modules of plug-ins defined outside rayfed and
    outside installed packages (a driver script, a test module, a project folder next to the script),
    which the actors' processes could not import by name."""
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}
    for obj in objects:
        for value in _plugin_values(obj):
            module = sys.modules.get(getattr(value, "__module__", None) or "")
            path = getattr(module, "__file__", None)
            if (module is None or module.__name__ == "__main__" or module.__name__.split(".")[0] == "rayfed"
                    or path is None or any(path.startswith(root) for root in installed)):
                continue
            cloudpickle.register_pickle_by_value(module)


def _plugin_values(obj: Any) -> list[Any]:
    """``obj`` and the plug-in objects a config holds in its fields."""
    if isinstance(obj, RunConfig):
        data = [obj.data, *(obj.data.tasks or ())]
        return [*(d.source for d in data), *(d.kind for d in data), *(d.partition.name for d in data),
                obj.model.backbone, *(m.name for m in obj.methods)]
    return [obj if isinstance(obj, type) or callable(obj) else type(obj)]


def is_actor_failure(err: BaseException) -> bool:
    """Whether an actor or node died (the run restores and goes on), rather than an actor raising an error; an
    error raised while an actor started (its ``__init__``) would raise again."""
    if isinstance(err, ray.exceptions.ObjectLostError):
        return True
    if isinstance(err, ray.exceptions.RayTaskError):
        err = err.cause
    if isinstance(err, ray.exceptions.RayActorError):
        return not err.actor_init_failed
    return isinstance(err, ray.exceptions.NodeDiedError)


def unwrap_actor_error(err: BaseException) -> BaseException:
    """An error raised inside an actor, as the user should see it: a :class:`ConfigError` without Ray's wrapping
    (its one sentence says it all); any other error with Ray's wrapping, whose message holds the actor's
    traceback (the user's file and line, and where :func:`rayfed.errors.raised_in` noted it ran), but without
    the frames of Ray's own code in this process."""
    if not isinstance(err, ray.exceptions.RayTaskError):
        return err
    if isinstance(err.cause, ConfigError):
        return err.cause
    err.__notes__ = []  # the error's own notes, already in the message, would be shown a second time
    return err.with_traceback(None)
