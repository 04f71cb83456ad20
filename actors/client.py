"""ClientActor: hosts one or more clients over one frozen backbone built once.

For every hosted client it keeps that client's state (personal parameters, method state) and
its data, loaded here rather than pushed through the driver (:class:`~rayfed.actors.hosted.HostedClients`, which
also holds the guests trained here for a round). Per round it swaps each sampled
client's parameters into the one resident model, runs the method's local update, and returns
the uploads. The class is plain Python; the simulation wraps it with ``ray.remote``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from rayfed import registry
from rayfed.config import RunConfig, architecture_model_config, build_config, method_model_config, model_configs
from rayfed.data.clients import Federation, build_federation
from rayfed.errors import raised_in
from rayfed.training.plans.stacked import Lockstep
from rayfed.compute import counted_flops
from rayfed.actors import public
from rayfed.actors.contract import ClientContract
from rayfed.actors.devices import gpu_peak_bytes, round_device
from rayfed.actors.evaluation import ClientEvaluation
from rayfed.actors.hosted import HostedClients
from rayfed.actors.uploads import RoundUploads, round_collector, slots_to, to_host
from rayfed.method import ClientState, LocalResult, Method, TensorDict, TensorSpecs, Upload, check_tensors, method_model
from rayfed.models import build_backbone
from rayfed.models.frozen_weights import FrozenWeights
from rayfed.models.peft.modules import select_task
from rayfed.run_methods import run_methods
from rayfed.seeding import SERVER, torch_seed
from rayfed.stages import AfterFederationStage, declared
from rayfed.training import ClientContext, check_precision, computes_in_bf16
from rayfed.transport import use_raw_tensor_transport
from rayfed.state_tree import flatten_tree, map_tree
from rayfed.types import moved_together

Payloads = dict[int, TensorDict | None]


def set_process_options(config: RunConfig) -> None:
    """What torch keeps per process, as the run asks: the actor's CPU threads, and whether attention may run on
    cuDNN's kernels (``train.cudnn_attention``)."""
    torch.set_num_threads(max(1, int(config.placement.cpus_per_actor or 1)))
    torch.backends.cuda.enable_cudnn_sdp(config.train.cudnn_attention)


def _hosted(name: str) -> property:
    """The hosted clients' attribute ``name`` (:class:`HostedClients`), read as the actor's own."""
    return property(lambda actor: getattr(actor.hosted, name), doc=f"``hosted.{name}``")


class ClientActor:
    """The clients of one architecture that one actor hosts, over the backbone it builds once.

    Seam: the method's model (its build, precision and frozen weights, with its contract) would move out next."""
    states, data, initial, initial_params, eval_sets, state_device = map(_hosted, (
        "states", "data", "initial", "initial_params", "eval_sets", "state_device"))

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
        set_process_options(self.config)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.client_ids = list(client_ids)
        self.architecture = architecture
        self.model_config = architecture_model_config(self.config, architecture)
        if federation is None:
            federation = build_federation(self.config.data, self.config.seed, model_configs(self.config))
        self.methods = list(methods) if methods is not None else run_methods(self.config, federation)
        self.federation = federation
        self.tasks = list(federation.tasks)
        # random weights (paper-size backbones) are drawn on the actor's device, not on its one CPU thread
        self.backbone = build_backbone(self.model_config, torch_seed(self.config.seed, 0, SERVER, "backbone"),
                                       self.device)
        self.hosted = HostedClients(federation, client_ids, self.backbone, self.device, self.config.placement)
        self.frozen_weights = FrozenWeights()  # a method's, in bf16 where its forwards run under bf16 autocast
        self.stream = self.config.data.stream
        self.evaluation = ClientEvaluation(self.config, federation, self.backbone, self.device, self.hosted.data_device)
        self.others = self.evaluation.others  # in a stream: each client's other tasks, as ClientEvaluation keeps them
        self.method: Method | None = None
        self.train_config = self.config.train  # the started method's (start_method: its local steps)
        self.round_times: list[dict[str, float]] = []  # see get_round_times
        self._stats: dict[str, float] = {}
        self.public_passes = public.PublicPasses(self.config, self.backbone)

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
        self.frozen_weights.restore()
        self.model = method_model(self.method, f"methods[{method_index}] ({entry.label})", self.backbone, model_config,
                                  self.tasks, init_seed).to(self.device)
        check_precision(self.model, train, self.device, f"methods[{method_index}] ({entry.label})")
        if computes_in_bf16(self.device, train.autocast):
            self.frozen_weights.store_in_bf16(self.model, self.backbone.encoder)
        self.tags = self.model.task_tags()
        initial = {name: value.cpu() for name, value in self.model.trainable_params().items()}
        self.contract = ClientContract(self.label, initial)  # what payloads and uploads are checked against
        self.hosted.start(self.method, initial, self.tags)
        self.evaluation.start_method(self.model, self.hosted.tasks_of, self.initial_params, self.tags, self.initial)
        shared, _ = self.method.split(initial)
        return shared

    def pre_federation(self, method_index: int) -> TensorDict:
        """The method's stage before round 1 on this actor's architecture (see ``Method.pre_federation``)."""
        return public.pre_federation(self.method, self.config, self.architecture, self.model, self.initial_params,
                                     self.backbone, self.device)

    def public_pass(self, method_index: int, round_idx: int, index: int, request: TensorDict) -> TensorDict:
        """The method's public pass ``index`` after round ``round_idx`` on this actor's architecture (see
        ``rayfed.PublicPassStage``); the public data is encoded once per actor."""
        return self.public_passes.run(self.method, self.architecture, self.model, self.device, round_idx, index,
                                      request)

    def count_public_flops(self, counting: bool) -> float:
        """:meth:`PublicPasses.count <rayfed.actors.public.PublicPasses.count>` (compute matching)."""
        return self.public_passes.count(counting)

    def task_tags(self) -> dict[str, frozenset[int]]:
        """The tasks each parameter of the method's model belongs to (untagged ones are shared by all)."""
        return self.tags

    def _context(self, client_id: int, round_idx: int) -> ClientContext:
        select_task(self.model, self.hosted.tasks_of[client_id][0])
        return ClientContext(
            client_id, round_idx, self.config.seed, self.data[client_id], self.model,
            self.train_config, self.device, self.eval_sets, self.tasks, self.stream, self.others.get(client_id, ()),
        )

    def local_update_flops(self, client_id: int, payloads: Payloads) -> float:
        """The FLOPs of ``client_id``'s round-1 local update with ``payloads``; its state stays as it was."""
        state, train = self.states[client_id], self.train_config
        # Eager: the counter does not see the work of a replayed CUDA graph or of compiled code.
        self.train_config = train.model_copy(update={"cuda_graphs": False, "compile": False})
        try:
            return counted_flops(lambda: self.train(0, [client_id], payloads))
        finally:
            self.states[client_id], self.train_config = state, train

    def train(self, round_idx: int, client_ids: list[int], payloads: Payloads) -> list[Upload]:
        uploads = list(self._local_updates(round_idx, client_ids, payloads))
        to_host(uploads)
        return uploads

    def _local_updates(self, round_idx: int, client_ids: list[int], payloads: Payloads) -> Iterator[Upload]:
        """The clients' local updates in order (with ``train.batch_clients``, run in lockstep so that their plain
        steps train together); each new state is kept here, each upload is left on :func:`round_device`."""
        on = round_device(self.device, self.state_device, (self.states[cid] for cid in client_ids))
        self.hosted.move(client_ids, on)
        payloads = self._on_device(payloads, on, f"round {round_idx + 1}")
        batch = self.config.train.batch_clients
        if batch == 1 or len(client_ids) == 1:
            for cid in client_ids:
                with self._hook("local_update", cid, f"in round {round_idx + 1}"):
                    result = self.contract.local_update(self.method, self._context(cid, round_idx), self.states[cid],
                                                         payloads[cid])
                yield self._keep(cid, result, on, payloads)
        else:
            lockstep: Lockstep[LocalResult] = Lockstep(batch)

            def update(client_id: int) -> LocalResult:
                context = self._context(client_id, round_idx)
                context.lockstep = lockstep
                with self._hook("local_update", client_id, f"in round {round_idx + 1}"):
                    return self.contract.local_update(self.method, context, self.states[client_id], payloads[client_id])

            results = lockstep.run([lambda cid=cid: update(cid) for cid in client_ids])
            for cid, result in zip(client_ids, results):
                yield self._keep(cid, result, on, payloads)
        self.hosted.move(client_ids, self.state_device)

    def _hook(self, hook: str, client_id: int, when: str) -> AbstractContextManager[None]:
        """Marks an error raised within with the method's hook, the client and the round (``when``)."""
        return raised_in(f"{type(self.method).__name__}.{hook} for client {client_id} {when}")

    def _keep(self, client_id: int, result: LocalResult, device: torch.device, payloads: _OnDevice) -> Upload:
        """Keep a local update's new state here (a payload tensor in it as a copy of its own, see :class:`_OnDevice`);
        its upload (checked by :class:`ClientContract`); both on ``device``."""
        self.states[client_id] = slots_to(payloads.unshared(result.state), device)
        weight = self.data[client_id].num_train if result.weight is None else result.weight
        for name, value in result.stats.items():
            self._stats[name] = self._stats.get(name, 0.0) + value
        return Upload(client_id, weight, slots_to(result.upload, device), result.train_loss)

    def train_round(
        self, round_idx: int, client_ids: list[int], payloads: Payloads, weight_scale: dict[int, float],
        guests: Sequence[int] = (), *guest_states: ClientState, send_ahead: bool = False,
    ) -> RoundUploads:
        """:meth:`train`, with the uploads collected as :func:`round_collector` says (one partial sum when the method
        allows it; with ``send_ahead``, a mixture's slot sent on ahead) and moved to the host once per round.

        ``guests`` are clients another actor of this architecture hosts, trained here this round to balance the round
        (their states given, their new states kept for :meth:`take_guest_states`); their data is built here from the
        same federation, so they train exactly as on their host."""
        started, self._stats = time.time(), {}
        self.hosted.welcome(guests, guest_states, self.evaluation)
        collected = round_collector(self.method.aggregation, weight_scale, send_ahead)
        updating = time.perf_counter()
        for upload in self._local_updates(round_idx, sorted(client_ids), payloads):
            collected.add(upload)
        losses = collected.read_losses()
        busy_s, updated = time.perf_counter() - updating, time.time()
        nonfinite = collected.nonfinite(lambda cid: self._context(cid, round_idx).arrived_rows())
        uploads = collected.on_host()
        self.hosted.keep_guest_states(guests)
        self.round_times.append({"round": round_idx, "start": started, "updated": updated, "end": time.time(),
                                 "update_s": busy_s})
        return RoundUploads(uploads, collected.up_bytes, collected.up_params, losses, self._stats, busy_s, nonfinite,
                            round_idx, collected.slot_clients, gpu_peak_bytes(self.device))

    def client_state(self, client_id: int) -> ClientState:
        """:meth:`HostedClients.client_state`."""
        return self.hosted.client_state(client_id)

    def take_guest_states(self) -> dict[int, ClientState]:
        """:meth:`HostedClients.take_guest_states`."""
        return self.hosted.take_guest_states()

    def put_states(self, states: dict[int, ClientState]) -> None:
        """:meth:`HostedClients.put_states`."""
        self.hosted.put_states(states)

    def evaluate(self, round_idx: int, payloads: Payloads) -> dict[int, dict[str, float]]:
        payloads, metrics = self._on_device(payloads, self.state_device, f"the evaluation after round {round_idx}"), {}
        for cid in self.client_ids:
            with self._hook("evaluation", cid, f"after round {round_idx}"):
                metrics[cid] = self._metrics(self._context(cid, round_idx), self.states[cid], payloads[cid])
        return metrics

    def _metrics(self, client: ClientContext, state: ClientState, payload: TensorDict | None,
                 params: TensorDict | None = None) -> dict[str, float]:
        """Every view's metrics (``params``, if given, replace the method's own view)."""
        return self.evaluation.metrics(self.method, self.model, client, state, payload, params)

    def finish(self, round_idx: int, payloads: Payloads, post_train_steps: int) -> dict[int, dict[str, float]]:
        """The post-FL stages: the method's own, then optional fine-tuning; returns final metrics."""
        metrics, payloads = {}, self._on_device(payloads, self.state_device, f"the final stage after round {round_idx}")
        for cid in self.client_ids:
            client = self._context(cid, round_idx)
            with self._hook("after_federation", cid, f"after round {round_idx}"):
                state = self.states[cid]
                if declared(self.method, AfterFederationStage):
                    state = self.method.after_federation(client, state, payloads[cid])
                params = None
                if post_train_steps:
                    own = self.method.eval_params(state, payloads[cid])
                    params = client.train(own, steps=post_train_steps, purpose="post_train").params
            with self._hook("evaluation", cid, f"after round {round_idx}"):
                metrics[cid] = self._metrics(client, state, payloads[cid], params)
        return metrics

    def resource_usage(self) -> dict[str, int]:
        """:meth:`HostedClients.resource_usage`."""
        return self.hosted.resource_usage()

    def get_round_times(self) -> list[dict[str, float]]:
        """Per train_round call: its wall-clock start, the end of its local updates (``updated``) and its end
        (time.time()), and the seconds spent in the clients' local updates, so a benchmark can tell training from the
        rest of a round (after ``updated``: the uploads' copy to the host and their checks)."""
        return self.round_times

    def get_states(self) -> dict[int, ClientState]:
        return self.hosted.get_states()

    def set_states(self, states: dict[int, ClientState]) -> None:
        self.hosted.set_states(states)

    def _on_device(self, payloads: Payloads, device: torch.device, when: str) -> _OnDevice:
        """``payloads`` on ``device``, each tensor checked against the model's parameter of its name."""
        return _OnDevice(payloads, device, self.contract.specs, f"method {self.label!r}, hook payload, {{}}, {when}")


class _OnDevice:
    """``payloads``, each client's copied to ``device`` when asked for, after checking that each tensor has the
    shape and dtype of the model's parameter of its name (``specs``; ``source``: who sent it, ``{}`` the client).

    A client's tensors cross in one copy per dtype (:func:`rayfed.types.moved_together`), views of one buffer on
    ``device``. A tensor the previous client received too is not copied again: a round's clients often receive the
    same tensors (FedAvg's global model), which then reach the GPU once, not once a client. The copy is this actor's
    own: through Ray the payloads are views of the object store's copy, and in one process the server's tensors.
    """

    def __init__(self, payloads: Payloads, device: torch.device, specs: TensorSpecs | None = None,
                 source: str = "the payload of {}") -> None:
        self.payloads, self.device = payloads, device
        self.specs, self.source = specs or {}, source
        self.previous: dict[int, torch.Tensor] = {}  # by id() of the source, alive in ``payloads`` meanwhile
        self.buffers: set[int] = set()  # the copies' storages (data_ptr), see unshared

    def __getitem__(self, client_id: int) -> TensorDict | None:
        payload = self.payloads[client_id]
        if payload is None:
            return None
        previous, flat = self.previous, flatten_tree(payload)  # a payload may hold trees (rayfed.state_tree)
        new = {name: value for name, value in flat.items() if id(value) not in previous}
        check_tensors(new, self.specs, self.source.format(f"client {client_id}"), "the client model's parameter")
        copies = moved_together(new.values(), self.device, copy=True)
        self.buffers.update(copy.untyped_storage().data_ptr() for copy in copies.values())
        moved = {id(value): previous[id(value)] if id(value) in previous else copies[id(value)]
                 for value in flat.values()}
        self.previous = moved
        return map_tree(payload, lambda value: moved[id(value)])

    def unshared(self, state: ClientState) -> ClientState:
        """``state`` with each tensor that views a payload's buffer copied into storage of its own: kept between
        rounds, a view would keep the whole buffer (every payload tensor of its client) alive."""
        return map_tree(state, lambda value: value.clone() if value.untyped_storage().data_ptr() in self.buffers
                        else value)
