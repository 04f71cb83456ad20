"""ClientActor: hosts one or more clients over one frozen backbone built once.

For every hosted client it keeps that client's state (personal parameters, method state) and
its data, loaded here rather than pushed through the driver. Per round it swaps each sampled
client's parameters into the one resident model, runs the method's local update, and returns
the uploads. The class is plain Python; the simulation wraps it with ``ray.remote``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import psutil
import torch

from rayfed import registry
from rayfed.aggregation import presums
from rayfed.architectures import architecture_of
from rayfed.config import RunConfig, architecture_model_config, build_config, method_model_config
from rayfed.data.clients import Federation, build_federation, encode_public
from rayfed.errors import raised_in
from rayfed.batching import Lockstep
from rayfed.compute import counted_flops
from rayfed.method import (ClientState, LocalResult, Method, PartialSum, TensorDict, TensorSpecs, Upload, build_method,
                           check_tensors, largest_magnitudes, nonfinite_names, tensor_bytes, tensor_specs)
from rayfed.models import build_backbone
from rayfed.modules import feature_shift, head_features, select_task
from rayfed.seeding import SERVER, torch_seed
from rayfed.data.batches import to_device
from rayfed.tasks import param_tasks, task_view
from rayfed.training import ClientContext, OtherTask, PreFederation, PublicPass
from rayfed.transport import use_raw_tensor_transport
from rayfed.types import ReadOnlyTensors, states_to

Payloads = dict[int, TensorDict | None]


@dataclass
class RoundUploads:
    """One actor's part of a round: what goes to the server, and what its clients sent and lost."""

    uploads: list[Upload]
    up_bytes: int  # what the clients uploaded (a partial sum's own size is a simulator detail)
    up_params: int
    train_losses: dict[int, float]
    stats: dict[str, float] = field(default_factory=dict)  # the methods' per-client statistics, summed
    busy_s: float = 0.0  # seconds from the actor's first local update to the end of its last one on the device
    nonfinite: dict[str, list[int]] = field(default_factory=dict)  # what was NaN or infinite -> the clients it came from
    round_idx: int | None = None


def run_methods(config: RunConfig, federation) -> list[Method]:
    """Every method of the run, built once from its config entry (for in-process use: tests, benchmarks)."""
    return [build_method(entry, index, num_clients=federation.num_clients, tasks=federation.tasks,
                         rounds=config.federation.rounds, architecture_of=architecture_of(config))
            for index, entry in enumerate(config.methods)]


class ClientActor:
    def __init__(
        self, config: RunConfig | dict, client_ids: Sequence[int], methods: Sequence[Method] | None = None,
        plugins: Sequence[registry.Entry] = (), architecture: str = "", federation: Federation | None = None,
    ):
        """``methods``: the run's methods as the driver built them (default: built here from the config);
        ``plugins``: what the driver script registered, so that names resolve here as they do there;
        ``architecture``: the architecture of every hosted client (``""``: the run's one);
        ``federation``: the run's data as the driver built it (default: built here). Handed over through
        Ray's object store, its arrays are read-only views of one copy per node, shared by the node's actors."""
        registry.install(plugins)
        use_raw_tensor_transport()
        self.config: RunConfig = config if isinstance(config, RunConfig) else build_config(config)
        torch.set_num_threads(max(1, int(self.config.placement.cpus_per_actor or 1)))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.client_ids = list(client_ids)
        self.architecture = architecture
        self.model_config = architecture_model_config(self.config, architecture)
        if federation is None:
            federation = build_federation(self.config.data, self.config.seed)
        self.methods = list(methods) if methods is not None else run_methods(self.config, federation)
        self.federation = federation
        self.tasks = list(federation.tasks)
        self.tasks_of = {cid: federation.tasks_of(cid) for cid in self.client_ids}
        self.backbone = build_backbone(self.model_config, torch_seed(self.config.seed, 0, SERVER, "backbone"))
        data = {cid: federation.client_data(cid, self.backbone) for cid in self.client_ids}
        eval_sets = federation.eval_sets(self.backbone)
        data_device = self._resident_device(
            sum(client_data.nbytes for client_data in data.values())
            + tensor_bytes({i: e.columns for i, e in enumerate(eval_sets)})
        )
        self.data_device = data_device
        self.data = {cid: d.to(data_device) for cid, d in data.items()}
        self.eval_sets = [eval_set.to(data_device) for eval_set in eval_sets]
        self.stream = self.config.data.stream
        self.task_tests: dict[int, tuple[int, dict]] = {}  # in a stream: task -> (first round, test columns)
        if self.stream is not None and self.stream.evaluate_others:
            held = {holding.task for holding in federation.holdings}
            self.task_tests = {task: (federation.first_round(task), to_device(federation.task_test(task, self.backbone),
                                                                              data_device))
                               for task in sorted(held)}
        self.method: Method | None = None
        self.train_config = self.config.train  # the started method's (start_method: its local steps)
        self.states: dict[int, ClientState] = {}
        self.others: dict[int, list[OtherTask]] = {}
        self.guest_states: dict[int, ClientState] = {}  # guests' new states, until their hosts take them
        # Per train_round call: its wall-clock start and end (time.time()) and the seconds spent in the
        # clients' local updates, so a benchmark can tell training from the rest of a round.
        self.round_times: list[dict[str, float]] = []
        self._stats: dict[str, float] = {}
        self._public: tuple | None = None  # data.public's task and columns, encoded at the first public pass

    def start_method(self, method_index: int, local_steps: int | None = None) -> TensorDict:
        """Build the method's client model and every hosted client's initial state; return the initial shared
        parameters. ``local_steps``: the method's steps per local update (default ``train.local_steps``)."""
        entry = self.config.methods[method_index]
        self.method = self.methods[method_index]
        train = self.config.train
        self.train_config = train if local_steps is None else train.model_copy(update={"local_steps": local_steps})
        self.label = entry.label
        init_seed = torch_seed(self.config.seed, 0, SERVER, "client_model")
        model_config = method_model_config(self.model_config, entry, method_index)
        self.model = self.method.build_model(self.backbone, model_config, self.tasks, init_seed).to(self.device)
        self.tags = self.model.task_tags() if hasattr(self.model, "task_tags") else {}
        initial = {name: value.cpu() for name, value in self.model.trainable_params().items()}
        self.param_specs = tensor_specs(initial)  # what payloads and uploads are checked against
        self.state_device = self._resident_device(3 * tensor_bytes(initial) * len(self.client_ids))
        resident = {name: value.to(self.state_device) for name, value in initial.items()}  # one copy, shared
        self.initial_params = resident
        # A client holds, trains and uploads only its tasks' view (shared + its tasks' own parameters).
        self.initial = {cid: task_view(resident, self.tasks_of[cid], self.tags) for cid in self.client_ids}
        self.states = {cid: self.method.init_client(self.initial[cid]) for cid in self.client_ids}
        self.others = {cid: self._other_tasks(cid) for cid in self.client_ids}
        self.initial_features: dict[int, torch.Tensor] = {}
        shared, _ = self.method.split(initial)
        return shared

    def pre_federation(self, method_index: int) -> TensorDict:
        """The method's stage before round 1 on this actor's architecture (see ``Method.pre_federation``)."""
        public, public_task = {}, None
        if self.config.data.public is not None:
            public_task, public = encode_public(self.config.data.public, self.config.seed, self.backbone)
        stage = PreFederation(self.architecture, self.model, {n: v.to(self.device) for n, v in self.initial_params.items()},
                              public, public_task, self.config.train, self.device, self.config.seed)
        return {name: value.detach().cpu() for name, value in self.method.pre_federation(stage).items()}

    def public_pass(self, method_index: int, round_idx: int, index: int, request: TensorDict) -> TensorDict:
        """The method's public pass ``index`` after round ``round_idx`` on this actor's architecture (see
        ``Method.public_passes``); the public data is encoded once per actor."""
        if self._public is None:
            self._public = (None, {}) if self.config.data.public is None else encode_public(
                self.config.data.public, self.config.seed, self.backbone)
        public_task, public = self._public
        stage = PublicPass(self.architecture, self.model, public, public_task, self.config.train, self.device,
                           self.config.seed, round_idx)
        request = {name: value.to(self.device) for name, value in request.items()}
        with raised_in(f"{type(self.method).__name__}.public_pass {index} on {self.architecture or 'the model'} "
                       f"after round {round_idx + 1}"):
            result = self.method.public_pass(stage, index, request)
        return {name: value.detach().cpu() for name, value in result.items()}

    def task_tags(self) -> dict[str, frozenset[int]]:
        """The tasks each parameter of the method's model belongs to (untagged ones are shared by all)."""
        return self.tags

    def _other_tasks(self, client_id: int) -> list[OtherTask]:
        """In a stream, the tasks of other clients this client is also scored on."""
        own = set(self.tasks_of[client_id])
        others = []
        for task, (first_round, test) in self.task_tests.items():
            if task in own:
                continue
            missing = {name: value for name, value in self.initial_params.items()
                       if (owners := param_tasks(name, self.tags)) is not None and task in owners and not owners & own}
            others.append(OtherTask(task, test, first_round, missing))
        return others

    def _resident_device(self, nbytes: int) -> torch.device:
        """Where hosted clients' data or state (``nbytes`` in all) live between rounds: the GPU when
        ``placement.client_state`` says so, or (auto) when it takes under a quarter of the free GPU
        memory; else host memory. On the GPU no step waits for a host-to-device copy."""
        setting = self.config.placement.client_state
        if self.device.type != "cuda" or setting == "host":
            return torch.device("cpu")
        return self.device if setting == "device" or self._fits_on_gpu(nbytes) else torch.device("cpu")

    def _fits_on_gpu(self, nbytes: int) -> bool:
        """Whether ``nbytes`` take under a quarter of the GPU's free memory."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return nbytes < free / 4

    def _context(self, client_id: int, round_idx: int) -> ClientContext:
        select_task(self.model, self.tasks_of[client_id][0])
        return ClientContext(
            client_id, round_idx, self.config.seed, self.data[client_id], self.model,
            self.train_config, self.device, self.eval_sets, self.tasks, self.stream, self.others.get(client_id, ()),
        )

    def local_update_flops(self, client_id: int, payloads: Payloads) -> float:
        """The FLOPs of ``client_id``'s round-1 local update with ``payloads`` (:func:`rayfed.compute.counted_flops`);
        its state stays as it was."""
        state, train = self.states[client_id], self.train_config
        # Eager: the counter does not see the work of a replayed CUDA graph or of compiled code.
        self.train_config = train.model_copy(update={"cuda_graphs": False, "compile": False})
        try:
            return counted_flops(lambda: self.train(0, [client_id], payloads))
        finally:
            self.states[client_id], self.train_config = state, train

    def train(self, round_idx: int, client_ids: list[int], payloads: Payloads) -> list[Upload]:
        uploads = list(self._local_updates(round_idx, client_ids, payloads))
        for upload in uploads:
            upload.tensors = _to(upload.tensors, "cpu")
            upload.train_loss = float(upload.train_loss)
        return uploads

    def _local_updates(self, round_idx: int, client_ids: list[int], payloads: Payloads) -> Iterator[Upload]:
        """The clients' local updates in order (with ``train.batch_clients``, run in lockstep so that their plain
        steps train together); each new state is kept here, each upload is left on :meth:`_round_device`."""
        on = self._round_device(client_ids)
        self.states.update(states_to({cid: self.states[cid] for cid in client_ids}, on))
        payloads = self._on_device(payloads, on, f"round {round_idx + 1}")
        batch = self.config.train.batch_clients
        if batch == 1 or len(client_ids) == 1 or not self.method.batchable_updates:
            for cid in client_ids:
                with self._hook("local_update", cid, f"in round {round_idx + 1}"):
                    result = self.method.local_update(self._context(cid, round_idx), self.states[cid], payloads[cid])
                yield self._keep(cid, round_idx, result, on)
        else:
            lockstep: Lockstep[LocalResult] = Lockstep(batch)

            def update(client_id: int) -> LocalResult:
                context = self._context(client_id, round_idx)
                context.lockstep = lockstep
                with self._hook("local_update", client_id, f"in round {round_idx + 1}"):
                    return self.method.local_update(context, self.states[client_id], payloads[client_id])

            results = lockstep.run([lambda cid=cid: update(cid) for cid in client_ids])
            for cid, result in zip(client_ids, results):
                yield self._keep(cid, round_idx, result, on)
        self.states.update(states_to({cid: self.states[cid] for cid in client_ids}, self.state_device))

    def _hook(self, hook: str, client_id: int, when: str) -> AbstractContextManager[None]:
        """Marks an error raised within with the method's hook, the client and the round (``when``)."""
        return raised_in(f"{type(self.method).__name__}.{hook} for client {client_id} {when}")

    def _round_device(self, client_ids: list[int]) -> torch.device:
        """Where a round's clients' states, payloads and uploads stay while the round trains: the training device
        when they fit there, even where states are kept on the host between rounds.

        A copy to or from the host between two clients' updates would make the host wait for the GPU to finish
        one client, and the GPU then wait for the host to set up the next; this way each state crosses once each
        way a round, before the first update and after the last.
        """
        if self.state_device == self.device:
            return self.device
        round_bytes = 4 * sum(tensor_bytes(self.states[cid]) for cid in client_ids)  # old and new states, uploads
        return self.device if self._fits_on_gpu(round_bytes) else self.state_device

    def _keep(self, client_id: int, round_idx: int, result: LocalResult, device: torch.device) -> Upload:
        """Keep a local update's new state here; its upload, whose shared tensors must have the shapes and dtypes of
        the model's parameters of their names; both on ``device``."""
        source = f"method {self.label!r}, hook local_update, client {client_id}, round {round_idx + 1}"
        for slot, values in result.upload.items():
            check_tensors(values, self.param_specs if slot == "shared" else {}, source, "the client model's parameter")
        self.states[client_id] = _to(result.state, device)
        weight = self.data[client_id].num_train if result.weight is None else result.weight
        for name, value in result.stats.items():
            self._stats[name] = self._stats.get(name, 0.0) + value
        return Upload(client_id, weight, _to(result.upload, device), result.train_loss)

    def train_round(
        self, round_idx: int, client_ids: list[int], payloads: Payloads, weight_scale: dict[int, float],
        guests: Sequence[int] = (), *guest_states: ClientState,
    ) -> RoundUploads:
        """:meth:`train`, with the uploads summed into one partial sum when the method allows it.

        ``guests`` are clients another actor of this architecture hosts, trained here this round to balance
        the round (their states given, their new states kept for :meth:`take_guest_states`); their data is
        built here from the same federation, so they train exactly as on their host.

        The partial sum is made as each upload comes, on the device where the uploads were trained when they fit
        there (:meth:`_round_device`), and moved to the host once per round: then no copy to the host, and no
        float64 arithmetic on the host, per client. Clients train in client-id order, the order they are
        summed in.
        """
        started, self._stats = time.time(), {}
        for cid, state in zip(guests, guest_states):
            self._welcome(cid)
            self.states[cid] = _to(state, self.state_device)
        partial = PartialSum() if presums(self.method.aggregation) else None
        uploads, up_bytes, up_params, losses, magnitudes = [], 0, 0, {}, {}
        updating = time.perf_counter()
        for upload in self._local_updates(round_idx, sorted(client_ids), payloads):
            cid = upload.client_id
            upload.weight_scale = weight_scale[cid]
            up_bytes += upload.nbytes
            up_params += upload.nparams
            losses[cid] = upload.train_loss
            magnitudes[cid] = largest_magnitudes(upload.tensors)
            if upload.tensors and partial is not None:
                partial.add(upload)
            elif upload.tensors:
                uploads.append(upload)
        # Read once the last client's steps are queued: the first read waits for the device to finish them all.
        losses = {cid: float(loss) for cid, loss in losses.items()}
        busy_s = time.perf_counter() - updating
        nonfinite = self._nonfinite(round_idx, losses, magnitudes)
        if partial is not None and partial.client_ids:
            uploads = [partial.upload("cpu")]
        for upload in uploads:
            upload.tensors = _to(upload.tensors, "cpu")
            if upload.weight_sums is not None:  # a partial sum, which the aggregation only reads (weighted_sums)
                upload.tensors = ReadOnlyTensors(upload.tensors)
            upload.train_loss = float(upload.train_loss)
        for cid in guests:
            self.guest_states[cid] = _to(self.states.pop(cid), "cpu")
        self.round_times.append({"round": round_idx, "start": started, "end": time.time(), "update_s": busy_s})
        return RoundUploads(uploads, up_bytes, up_params, losses, self._stats, busy_s, nonfinite, round_idx)

    def _nonfinite(self, round_idx: int, losses: dict[int, float],
                   magnitudes: dict[int, tuple[list[str], torch.Tensor | None]]) -> dict[str, list[int]]:
        """What of a round's results is NaN or infinite, with the clients it came from: each upload tensor (its
        magnitudes read in one go) and the training loss of every client that trained (one whose stream has brought
        no data yet trains nothing and reports a NaN loss)."""
        found: dict[str, list[int]] = {}
        for cid, names in nonfinite_names(magnitudes).items():
            for name in names:
                found.setdefault(f"upload tensor {name!r}", []).append(cid)
        for cid, loss in losses.items():
            if not math.isfinite(loss):
                pool = self._context(cid, round_idx).arrived_rows()
                if pool is None or len(pool):
                    found.setdefault("training loss", []).append(cid)
        return found

    def _welcome(self, client_id: int) -> None:
        """What a guest client needs on this actor: its tasks, data, initial view and (a stream) other tasks."""
        if client_id in self.data:
            return
        self.tasks_of[client_id] = self.federation.tasks_of(client_id)
        self.data[client_id] = self.federation.client_data(client_id, self.backbone).to(self.data_device)
        self.initial[client_id] = task_view(self.initial_params, self.tasks_of[client_id], self.tags)
        self.others[client_id] = self._other_tasks(client_id)

    def client_state(self, client_id: int) -> ClientState:
        """A hosted client's state, to train it on another actor this round."""
        return _to(self.states[client_id], "cpu")

    def take_guest_states(self) -> dict[int, ClientState]:
        """The new states of the guests trained here, for their hosts (emptied)."""
        states, self.guest_states = self.guest_states, {}
        return states

    def put_states(self, states: dict[int, ClientState]) -> None:
        """Hosted clients' new states, trained on another actor."""
        self.states.update({cid: _to(state, self.state_device) for cid, state in states.items() if cid in self.client_ids})

    def evaluate(self, round_idx: int, payloads: Payloads) -> dict[int, dict[str, float]]:
        payloads, metrics = self._on_device(payloads, self.state_device, f"the evaluation after round {round_idx}"), {}
        for cid in self.client_ids:
            with self._hook("evaluation", cid, f"after round {round_idx}"):
                metrics[cid] = self._metrics(self._context(cid, round_idx), self.states[cid], payloads[cid])
        return metrics

    def _metrics(self, client: ClientContext, state: ClientState, payload: TensorDict | None,
                 params: TensorDict | None = None) -> dict[str, float]:
        """Every view's metrics (``params``, if given, replace the method's own view)."""
        views = self.method.eval_views(state, payload)
        if params is not None:
            views[""] = params
        metrics: dict[str, float] = {}
        for view, view_params in views.items():
            self.method.activate_view(self.model, view)
            values = client.evaluate(view_params)
            if not view and self.config.federation.representation_shift:
                values["rep_shift"] = self._representation_shift(client, view_params)
            metrics.update({f"{name}@{view}" if view else name: value for name, value in values.items()})
        self.method.activate_view(self.model, "")
        return metrics

    def _representation_shift(self, client: ClientContext, params: TensorDict) -> float:
        cid, size = client.client_id, self.config.train.eval_batch_size
        inputs = {name: column.to(self.device) for name, column in client.data.parts[0].test.items()}
        if cid not in self.initial_features:  # the initial model's features never change
            self.initial_features[cid] = head_features(self.model, self.initial[cid], inputs, size)
        return feature_shift(self.initial_features[cid], head_features(self.model, params, inputs, size))

    def finish(self, round_idx: int, payloads: Payloads, post_train_steps: int) -> dict[int, dict[str, float]]:
        """The post-FL stages: the method's own, then optional fine-tuning; returns final metrics."""
        metrics, payloads = {}, self._on_device(payloads, self.state_device, f"the final stage after round {round_idx}")
        for cid in self.client_ids:
            client = self._context(cid, round_idx)
            with self._hook("after_federation", cid, f"after round {round_idx}"):
                state = self.method.after_federation(client, self.states[cid], payloads[cid])
                params = None
                if post_train_steps:
                    own = self.method.eval_params(state, payloads[cid])
                    params = client.train(own, steps=post_train_steps, purpose="post_train").params
            with self._hook("evaluation", cid, f"after round {round_idx}"):
                metrics[cid] = self._metrics(client, state, payloads[cid], params)
        return metrics

    def resource_usage(self) -> dict[str, int]:
        """Peak GPU memory, resident host memory, and the bytes of hosted client state and data."""
        gpu_peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        return {
            "num_clients": len(self.client_ids),
            "gpu_peak_bytes": gpu_peak,
            "rss_bytes": psutil.Process().memory_info().rss,
            "state_bytes": tensor_bytes(self.states),
            "data_bytes": sum(client_data.nbytes for client_data in self.data.values()),
        }

    def get_round_times(self) -> list[dict[str, float]]:
        return self.round_times

    def get_states(self) -> dict[int, ClientState]:
        return {cid: _to(state, "cpu") for cid, state in self.states.items()}

    def set_states(self, states: dict[int, ClientState]) -> None:
        self.states = {cid: _to(states[cid], self.state_device) for cid in self.client_ids}

    def _on_device(self, payloads: Payloads, device: torch.device, when: str) -> _OnDevice:
        """``payloads`` on ``device``, each tensor checked against the model's parameter of its name."""
        return _OnDevice(payloads, device, self.param_specs, f"method {self.label!r}, hook payload, {{}}, {when}")


class _OnDevice:
    """``payloads``, each client's copied to ``device`` when asked for, after checking that each tensor has the
    shape and dtype of the model's parameter of its name (``specs``; ``source``: who sent it, ``{}`` the client).

    A tensor the previous client received too is not copied again: a round's clients often receive the same
    tensors (FedAvg's global model), which then reach the GPU once, not once a client. The copy is this actor's
    own: through Ray the payloads are views of the object store's copy, and in one process the server's tensors.
    """

    def __init__(self, payloads: Payloads, device: torch.device, specs: TensorSpecs | None = None,
                 source: str = "the payload of {}") -> None:
        self.payloads, self.device = payloads, device
        self.specs, self.source = specs or {}, source
        self.previous: dict[int, torch.Tensor] = {}  # by id() of the source, alive in ``payloads`` meanwhile

    def __getitem__(self, client_id: int) -> TensorDict | None:
        payload = self.payloads[client_id]
        if payload is None:
            return None
        previous = self.previous
        check_tensors({name: value for name, value in payload.items() if id(value) not in previous}, self.specs,
                      self.source.format(f"client {client_id}"), "the client model's parameter")
        moved = {id(value): previous[id(value)] if id(value) in previous else value.to(self.device, copy=True)
                 for value in payload.values()}
        self.previous = moved
        return {name: moved[id(value)] for name, value in payload.items()}


def _to(slots: dict[str, TensorDict], device: torch.device | str) -> dict[str, TensorDict]:
    return {slot: {n: v.detach().to(device) for n, v in values.items()} for slot, values in slots.items()}
