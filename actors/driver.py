"""DriverActor: holds the server state and runs the method's aggregation.

Uploads arrive as ObjectRefs resolved by Ray, so client updates never pass through the
process running the round loop.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Mapping, Sequence

import torch

from rayfed import registry
from rayfed.actors.client import RoundUploads, run_methods
from rayfed.actors.contract import ServerWatch, check_global, check_slots_read, watched
from rayfed.actors.uploads import fetch_sent_slots
from rayfed.aggregation import MixedRows, MixedServer, Mixture
from rayfed.architectures import architecture_of, prefixed, unprefixed
from rayfed.config import RunConfig, build_config, model_configs
from rayfed.data.clients import build_federation
from rayfed.errors import raised_in
from rayfed.method import (Method, MethodOutputError, ServerState, TensorDict, TensorSpecs, check_tensors,
                           largest_magnitudes, nonfinite_names, tensor_bytes, tensor_params, tensor_specs)
from rayfed.tasks import client_tasks, task_view
from rayfed.state_tree import flatten_tree, map_levels, tree_leaves
from rayfed.transport import use_raw_tensor_transport
from rayfed.types import ReadOnlyTensors, Slot


class DriverActor:
    def __init__(
        self, config: RunConfig | dict, methods: Sequence[Method] | None = None, plugins: Sequence[registry.Entry] = (),
    ):
        """``methods``: the run's methods as the driver built them (default: built here from the config);
        ``plugins``: what the driver script registered."""
        registry.install(plugins)
        use_raw_tensor_transport()
        self.config = config if isinstance(config, RunConfig) else build_config(config)
        if methods is None:
            federation = build_federation(self.config.data, self.config.seed, model_configs(self.config))
            methods = run_methods(self.config, federation)
        self.methods = list(methods)
        self.tasks_of = client_tasks(self.config.data)
        self.architecture_of = architecture_of(self.config)
        self.down_bytes = self.down_params = 0
        self.store_bytes = 0  # what a round's payloads put into Ray's object store (each distinct tensor once a call)
        self.known_finite = KnownFinite()
        self.call_times: list[dict[str, float]] = []  # see get_call_times
        self.mixed_rows: MixedRows | None = None  # a Mixture method's rows index (start_method)
        self._server: ServerState = {}

    def start_method(self, method_index: int, architectures: list[str], *initial_and_tags: dict) -> None:
        """The method's initial server state, from each architecture's initial shared parameters and task tags
        (``ClientActor.start_method`` and ``task_tags`` of one of its actors, in the order of
        ``architectures``): the server names every parameter by its architecture."""
        count = len(architectures)
        initial, tags = initial_and_tags[:count], initial_and_tags[count:]
        self.method = self.methods[method_index]
        self.label = self.config.methods[method_index].label
        self.tags = {name: arch_tags for name, arch_tags in zip(architectures, tags)}
        shared = {key: value for name, values in zip(architectures, initial)
                  for key, value in prefixed(values, name).items()}
        self.server_specs: TensorSpecs = {}
        # The server side of the method's aggregation kind: a Mixture's rows and their index are the engine's.
        self.mixed_rows = None
        if isinstance(self.method.aggregation, Mixture):
            self.mixed_rows = MixedRows(self.method.aggregation, self.method.architecture_of, shared,
                                        type(self.method).__name__)
        server = self.method.init_server(shared)
        self._check_server(server, "init_server")
        if self.mixed_rows is not None:
            server = {Slot.ROWS: self.mixed_rows.initial_rows(shared), **server}
        self.server = server
        # A later server state's tensor of a (slot, name) init_server gave keeps its shape and dtype.
        self.server_specs = tensor_specs(flatten_tree(self.server))
        self.down_bytes = self.down_params = self.store_bytes = 0
        self.server_watch = ServerWatch()

    @property
    def server(self) -> ServerState:
        """The server state as the method's hooks get it: with a Mixture, a :class:`MixedServer` (its rows' index)."""
        return self._server

    @server.setter
    def server(self, server: ServerState) -> None:
        self._server = server if self.mixed_rows is None else MixedServer(server, self.mixed_rows)

    def before_federation(self, architectures: list[str], *prepared: TensorDict) -> None:
        """The method's server-side stage before round 1, given what its pre-federation stage returned on
        each architecture's actors (``ClientActor.pre_federation``, in the order of ``architectures``)."""
        self.server = self.method.before_federation(self.server, dict(zip(architectures, prepared)))
        self._check_server(self.server, "before_federation")

    def public_request(self, index: int, architecture: str) -> TensorDict:
        """What the method's public pass ``index`` sends to ``architecture``'s actor (``rayfed.PublicPassStage``)."""
        with raised_in(f"{type(self.method).__name__}.public_request"):
            return self.method.public_request(self.server, index, architecture)

    def after_public_pass(self, index: int, architectures: list[str], *results: TensorDict) -> None:
        """The server state after the method's public pass ``index``, given each architecture's result (in the
        order of ``architectures``)."""
        with raised_in(f"{type(self.method).__name__}.after_public_pass"):
            server = self.method.after_public_pass(self.server, index, dict(zip(architectures, results)))
        self._check_server(server, f"after_public_pass {index}")
        self.server = server

    def payloads(self, client_ids: list[int], count_bytes: bool = True) -> dict[int, TensorDict | None]:
        """What each client receives: the method's payload, restricted to the client's architecture and its
        tasks' view, under the client's own parameter names (read-only: the actor copies it to where it trains)."""
        started, payloads = time.time(), ReadOnlyTensors()
        self.server_watch.after_first_round(self.server, self.label, self.method)
        for cid in client_ids:
            architecture = self.architecture_of[cid]
            with raised_in(f"{type(self.method).__name__}.payload for client {cid}"):
                payload = self.method.payload(self.server, cid)
            # each level of a tree under the client's names, restricted to its tasks' view
            payloads[cid] = None if payload is None else map_levels(
                payload, lambda level: task_view(unprefixed(level, architecture), self.tasks_of[cid],
                                                 self.tags[architecture]))
        if count_bytes:
            self.down_bytes += sum(tensor_bytes(p) for p in payloads.values())
            self.down_params += sum(tensor_params(p) for p in payloads.values())
            distinct = {id(value): value for p in payloads.values() if p for _, value in tree_leaves(p)}
            self.store_bytes += sum(tensor_bytes(value) for value in distinct.values())
        self.call_times.append({"call": "payloads", "start": started, "end": time.time()})
        return payloads

    def aggregate(self, *parts: RoundUploads) -> dict[str, float | None]:
        """Aggregate one round's uploads (in client-id order); return the round's statistics, with ``nonfinite``
        (what was NaN or infinite -> its clients) when something was.

        With ``federation.on_nonfinite: stop`` and a non-finite upload or loss, the method does not aggregate (the
        run stops), and a non-finite new server state is not kept."""
        times = {"call": "aggregate", "start": time.time()}
        fetch_sent_slots([upload for part in parts for upload in part.uploads])
        times["fetch_s"] = time.time() - times["start"]
        store_bytes = self.store_bytes + sum(tensor_bytes(upload.tensors) for part in parts for upload in part.uploads)
        uploads = sorted(
            (u.under_server_names(self.architecture_of[u.client_id]) for part in parts for u in part.uploads),
            key=lambda u: u.client_id)
        nonfinite: dict[str, list[int]] = {}
        for part in parts:
            for what, clients in part.nonfinite.items():
                nonfinite[what] = sorted(nonfinite.get(what, []) + clients)
        stop = self.config.federation.on_nonfinite == "stop"
        if not (nonfinite and stop):
            self.server_watch.before_first_round(self.server, uploads)
            reads = watched(uploads)  # which upload slots the engine and the method read
            if self.mixed_rows is not None:  # each upload into its client's rows, then the weights
                storing = time.time()
                rows_finite = self.known_finite.all(self.server[Slot.ROWS])
                self.mixed_rows.store(self.server, uploads)
                if rows_finite and not nonfinite:  # finite rows, and uploads the actors found finite
                    self.known_finite.add(self.server[Slot.ROWS])
                times["store_s"] = time.time() - storing
            aggregating = time.time()
            with raised_in(f"{type(self.method).__name__}.aggregate"):
                server = self.method.aggregate(self.server, uploads)
            times["aggregate_s"] = time.time() - aggregating
            check_slots_read(reads, self.method, self.label, parts)
            done = {part.round_idx + 1 for part in parts if part.round_idx is not None}
            hook = "aggregate" + "".join(f", round {r}" for r in done)
            self._check_server(server, hook)
            check_global(server, self.method, self.label, hook, self.tags, self.server_specs)
            clients = sorted(cid for part in parts for cid in part.train_losses)
            for name in self.known_finite.nonfinite_names(server):
                nonfinite[f"server tensor {name!r}"] = clients
            if not (nonfinite and stop):
                self.server = server
        losses = [loss for part in parts for loss in part.train_losses.values() if math.isfinite(loss)]
        stats = {
            "up_bytes": sum(part.up_bytes for part in parts),
            "down_bytes": self.down_bytes,
            "up_params": sum(part.up_params for part in parts),
            "down_params": self.down_params,
            "train_loss": sum(losses) / len(losses) if losses else None,
            "actor_busy_s": [round(part.busy_s, 4) for part in parts],
            "store_bytes": store_bytes,  # the payloads and uploads as they crossed Ray's object store
        }
        if any(part.gpu_peak_bytes for part in parts):  # on GPUs: the busiest actor's peak so far (trackers plot it)
            stats["gpu_peak_bytes"] = max(part.gpu_peak_bytes for part in parts)
        client_stats: dict[str, float] = {}
        for part in parts:
            for name, value in part.stats.items():
                client_stats[name] = client_stats.get(name, 0.0) + value
        if client_stats:
            stats["client_stats"] = dict(sorted(client_stats.items()))
        if nonfinite:
            stats["nonfinite"] = nonfinite
        self.down_bytes = self.down_params = self.store_bytes = 0
        self.call_times.append({**times, "end": time.time()})
        return stats

    def get_call_times(self) -> list[dict[str, float]]:
        """Per payloads and aggregate call: its wall-clock start and end (time.time()); an aggregation's also the
        seconds of fetching the upload slots sent on ahead (``fetch_s``), storing a mixture's rows (``store_s``) and
        the method's aggregate (``aggregate_s``). Ray serializes a call's result after its end, so a benchmark can
        place the server's work and the transfers around it in a round."""
        return self.call_times

    def _check_server(self, server: ServerState, hook: str) -> None:
        """One sentence if ``server`` (what ``hook`` returned) holds something other than tensors, or a tensor whose
        shape or dtype differ from init_server's of its slot and name."""
        source = f"method {self.label!r}, hook {hook}"
        for slot, values in server.items():
            if not isinstance(values, Mapping):
                raise MethodOutputError(f"{source}: server slot {str(slot)!r} is a {type(values).__name__}, not a "
                                        "dict of named tensors.")
        try:
            flat = flatten_tree(server)
        except ValueError as err:  # two paths of a slot's tree flatten to one name
            raise MethodOutputError(f"{source}: {err}.") from None
        check_tensors(flat, self.server_specs, source, "init_server's tensor")

    def get_state(self) -> ServerState:
        return self.server

    def set_state(self, server: ServerState) -> None:
        self.server = server


class KnownFinite:
    """The server tensors found finite, each until it is replaced or changed in place (its version): the check of
    a new server state reads only the others, for a mixture what the round changed and not every client's rows
    (gigabytes for large adapters). It finds exactly what a check of every tensor finds."""

    def __init__(self) -> None:
        self.found: dict[str, tuple[weakref.ref, int]] = {}  # slot/name -> the tensor, its version when found finite

    def _known(self, path: str, value: torch.Tensor) -> bool:
        seen = self.found.get(path)
        return seen is not None and seen[0]() is value and seen[1] == value._version

    def all(self, values: TensorDict, slot: str = Slot.ROWS) -> bool:
        """Whether every tensor of server slot ``slot`` (``values``) is known finite."""
        return all(self._known(f"{slot}/{name}", value) for name, value in values.items())

    def add(self, values: TensorDict, slot: str = Slot.ROWS) -> None:
        """Take every tensor of server slot ``slot`` (``values``) as finite as it is now."""
        self.found.update({f"{slot}/{name}": (weakref.ref(value), value._version) for name, value in values.items()
                           if not value.is_inference()})  # an inference tensor has no version: read at each check

    def nonfinite_names(self, server: ServerState) -> list[str]:
        """The ``slot/name`` of every non-finite tensor of ``server`` (a tree's name its path joined by ``/``),
        reading only the tensors not known finite."""
        unknown = {slot: {name: value for name, value in flatten_tree(values).items()
                          if not self._known(f"{slot}/{name}", value)} for slot, values in server.items()}
        names = nonfinite_names({0: largest_magnitudes(unknown)}).get(0, [])
        for slot, values in unknown.items():
            self.add({name: value for name, value in values.items() if f"{slot}/{name}" not in names}, slot)
        return names
