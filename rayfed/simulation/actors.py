"""The run's actors as the driver process sees them: one ClientActor per slot and the DriverActor, started with the
run as the driver resolved it (plug-ins shipped by value where the actors could not import them), and the calls that
a method's start, its stages, an evaluation and a checkpoint make on all of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayfed import registry
from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.architectures import ActorSlot
from rayfed.results.checkpoint import Checkpoint
from rayfed.config import RunConfig
from rayfed.data.clients import Federation
from rayfed.executors import LocalExecutor, RayExecutor
from rayfed.method import ClientState, Method, TensorDict
from rayfed.simulation.placement import placed
from rayfed.simulation.ray_setup import ship_by_value, smallest_object_store
from rayfed.stages import PreFederationStage, declared, public_pass_count


class RunActors:
    """The ClientActors (``clients``, in slot order) and the DriverActor (``driver``) of a run; ``host_of`` maps each
    client to the index of the actor hosting it. Started again, after an actor died, with the same data."""

    def __init__(self, config: RunConfig, methods: Sequence[Method], federation: Federation,
                 executor: LocalExecutor | RayExecutor, slots: list[ActorSlot]):
        self.config, self.methods, self.federation = config, list(methods), federation
        self.executor, self.slots = executor, slots
        self.clients: list[Any] = []
        self.driver: Any = None
        self.host_of: dict[int, int] = {}
        self.busy_s: dict[int, float] = {}  # each actor's local updates in its last round of the method (run_round)
        self.store_bytes: int | None = None  # what the method's last round put through Ray's object store
        self.object_store: float | None = None  # the bytes of the smallest node's object store (None: local)
        self._federation_ref: Any = None

    def start(self) -> None:
        """One actor per ``clients_per_actor`` clients of one architecture, in client-id order; each builds its
        architecture's backbone once.

        Every actor gets the run as the driver resolved it: the config, the methods and the federation (the
        clients' data) built once in the driver process, and the plug-ins this process registered (shipped by value
        when they are the user's own code). On Ray, ``federation`` becomes a view of the object store's copy."""
        placement, executor = self.config.placement, self.executor
        plugins = registry.user_entries()
        if not executor.local:
            ship_by_value([self.config, *self.methods, *(entry.obj for entry in plugins)])
        config, methods = executor.put(self.config), executor.put(self.methods)
        if self._federation_ref is None:  # once per run: actors started again after a failure share it
            self._federation_ref = executor.put(self.federation)
            self.federation = executor.get(self._federation_ref)
        self.clients, self.host_of = [], {}
        for actor_index, slot in enumerate(self.slots):
            options = placed({"num_cpus": slot.cpus, "num_gpus": slot.gpus, "scheduling_strategy": placement.strategy},
                             bundle_index=actor_index + 1)
            self.clients.append(executor.actor(ClientActor, options, config, slot.client_ids, methods, plugins,
                                               slot.architecture, self._federation_ref))
            self.host_of.update({cid: actor_index for cid in slot.client_ids})
        self.driver = executor.actor(DriverActor, placed({"num_cpus": placement.driver_cpus}, bundle_index=0),
                                     config, methods, plugins)
        self.object_store = None if executor.local else smallest_object_store()  # read once: a GCS call

    def sends_ahead(self) -> bool:
        """Whether the actors send a mixture's uploads on ahead this round: when the last round's payloads and uploads
        took at most half of the smallest object store. A ``ray.put`` that does not fit is spilled to disk and read
        back, slower than the upload returned with the round's call (``benchmarks/mixture_server.py``)."""
        store, used = self.object_store, self.store_bytes
        return store is not None and used is not None and 2 * used <= store

    def stop(self) -> None:
        for actor in [*self.clients, self.driver]:
            if actor is not None:
                self.executor.kill(actor)
        self.clients, self.driver = [], None

    def first_of_each_architecture(self) -> dict[str, int]:
        """The index of each architecture's first ClientActor, in slot order."""
        first: dict[str, int] = {}
        for actor_index, slot in enumerate(self.slots):
            first.setdefault(slot.architecture, actor_index)
        return first

    def start_method(self, method_index: int, local_steps: int | None = None) -> None:
        """Fresh client state on every actor (started first if need be) and the method's initial server state on
        the DriverActor: one initial state per architecture, from its first actor. ``local_steps``: the method's
        (compute matching)."""
        if not self.clients:
            self.start()
        self.busy_s, self.store_bytes = {}, None
        initial = [actor.start_method.remote(method_index, local_steps) for actor in self.clients]
        first = self.first_of_each_architecture()
        tags = [self.clients[first[name]].task_tags.remote() for name in first]
        start = self.driver.start_method.remote(method_index, list(first), *(initial[first[n]] for n in first), *tags)
        self.executor.get([*initial, start])

    def before_federation(self, method_index: int) -> None:
        """The method's pre-federation stage, if it declares one: once per architecture, on that architecture's
        first actor (its model, the public data, the round-0 parameters); then the server-side stage."""
        first = self.first_of_each_architecture() if declared(self.methods[method_index], PreFederationStage) else {}
        prepared = [self.clients[first[name]].pre_federation.remote(method_index) for name in first]
        self.executor.get(self.driver.before_federation.remote(list(first), *prepared))

    def public_passes(self, method_index: int, round_idx: int) -> None:
        """The method's server-side passes on public data after a round's aggregation (its ``PublicPassStage``):
        each on the first actor of every architecture, with the driver's request for it."""
        first = self.first_of_each_architecture()
        for index in range(public_pass_count(self.methods[method_index])):
            results = [self.clients[actor_index].public_pass.remote(method_index, round_idx, index,
                                                                    self.driver.public_request.remote(index, name))
                       for name, actor_index in first.items()]
            self.executor.get(self.driver.after_public_pass.remote(index, list(first), *results))

    def client_metrics(self, round_idx: int, post_train_steps: int | None) -> dict[int, dict[str, float]]:
        """Every client's metrics with its sample counts, in client-id order: an evaluation
        (``post_train_steps`` None) or the method's final stages and evaluation."""
        refs = []
        for actor_index, actor in enumerate(self.clients):
            client_ids = [cid for cid, host in self.host_of.items() if host == actor_index]
            payload_ref = self.driver.payloads.remote(client_ids, False)
            if post_train_steps is None:
                refs.append(actor.evaluate.remote(round_idx, payload_ref))
            else:
                refs.append(actor.finish.remote(round_idx, payload_ref, post_train_steps))
        merged: dict[int, dict] = {}
        for part in self.executor.get(refs):
            merged.update(part)
        return {cid: {**merged[cid], **self.federation.sizes(cid)} for cid in sorted(merged)}

    def local_update_flops(self, client_id: int) -> float:
        """The FLOPs of ``client_id``'s round-1 local update of the started method (its state left as it was)."""
        payloads = self.driver.payloads.remote([client_id])
        return self.executor.get(self.clients[self.host_of[client_id]].local_update_flops.remote(client_id, payloads))

    def states(self) -> tuple[dict[int, ClientState], dict[str, TensorDict]]:
        """Every client's state and the server's, for a checkpoint."""
        state_refs = [actor.get_states.remote() for actor in self.clients]
        clients: dict = {}
        for part in self.executor.get(state_refs):
            clients.update(part)
        return clients, self.executor.get(self.driver.get_state.remote())

    def set_states(self, checkpoint: Checkpoint) -> None:
        self.executor.get([actor.set_states.remote(checkpoint.clients) for actor in self.clients]
                          + [self.driver.set_state.remote(checkpoint.server)])
