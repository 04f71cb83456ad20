"""What a PFL method is to the engine: hyperparameters and a handful of hooks.

Client-side hooks run inside a ClientActor with a :class:`~rayfed.training.ClientContext`;
server-side hooks run inside the DriverActor. A method never touches Ray, and the engine never
branches on a method's name. A method is a plug-in (:mod:`rayfed.registry`): built once per run in
the driver, its hyperparameters validated there, and the same object handed to every actor.

State is plain tensors (:mod:`rayfed.types`) so that it can be checkpointed as safetensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from rayfed.errors import ConfigError
from rayfed.types import ClientState, Loss, ServerState, TensorDict, tensor_bytes, tensor_params, tensors_to

if TYPE_CHECKING:
    from rayfed.config import ModelConfig
    from rayfed.models import Backbone
    from rayfed.tasks import Task
    from rayfed.training import ClientContext, PreFederation, PublicPass

__all__ = ["ClientState", "LocalResult", "Method", "MethodOutputError", "NoParams", "NonFiniteError", "PartialSum",
           "ServerState", "TensorDict", "Upload", "check_tensors", "largest_magnitudes", "nonfinite_names",
           "post_fl_steps", "post_train_views", "presum", "stored_views", "tensor_bytes", "tensor_params",
           "tensor_specs", "weighted_mean", "weighted_sums"]


@dataclass(frozen=True)
class NoParams:
    """For methods without hyperparameters."""


@dataclass
class Upload:
    """What one client sends to the server in one round."""

    client_id: int
    num_samples: int
    tensors: dict[str, TensorDict]
    train_loss: Loss
    weight_scale: float = 1.0  # < 1 for a late upload that the system config down-weights
    # Set on a partial sum made on an actor (see presum): ``tensors`` then hold, per tensor, the float64
    # sum of weight * value over the actor's clients, and ``weight_sums`` the sum of their weights.
    weight_sums: dict[str, dict[str, float]] | None = None
    dtypes: dict[str, dict[str, torch.dtype]] | None = None

    @property
    def weight(self) -> float:
        return self.num_samples * self.weight_scale

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    def under_server_names(self, architecture: str) -> Upload:
        """This upload with its tensors named as the server names them (``<architecture>/<name>``;
        unchanged in a run of one architecture)."""
        if not architecture:
            return self
        name = f"{architecture}/{{}}".format
        return dataclasses.replace(
            self,
            tensors={slot: {name(n): v for n, v in values.items()} for slot, values in self.tensors.items()},
            weight_sums=None if self.weight_sums is None else
            {slot: {name(n): w for n, w in values.items()} for slot, values in self.weight_sums.items()},
            dtypes=None if self.dtypes is None else
            {slot: {name(n): d for n, d in values.items()} for slot, values in self.dtypes.items()},
        )

    @property
    def nparams(self) -> int:
        return tensor_params(self.tensors)


@dataclass
class LocalResult:
    """The result of a client's local update: its new state, what it uploads, and (optionally) the weight its
    upload gets in the aggregate instead of its number of training samples (e.g. 1: a uniform mean)."""

    state: ClientState
    upload: dict[str, TensorDict]
    train_loss: Loss  # e.g. a TrainResult's loss, left on the device: the actor reads a round's losses together
    weight: float | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # summed over a round's clients into its event


class MethodOutputError(ConfigError):
    """A tensor a method's hook returned is not a tensor, or has not the shape and dtype of the tensor it replaces."""


class NonFiniteError(ConfigError):
    """A training loss, upload, server tensor or evaluation metric is NaN or infinite (``federation.on_nonfinite``)."""


TensorSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> TensorSpecs:
    """Each tensor's shape and dtype, by name: what :func:`check_tensors` compares with."""
    return {name: (tuple(value.shape), value.dtype) for name, value in tensors.items()}


def check_tensors(tensors: Mapping[str, object], specs: TensorSpecs, source: str, reference: str) -> None:
    """One sentence (:class:`MethodOutputError`) for the first of ``tensors`` that is not a tensor or differs in shape
    or dtype from ``specs``' entry of its name (a name without one is not checked).

    ``source`` says who returned them (the method, its hook, the round and client), ``reference`` what ``specs``
    describe. Metadata only: nothing here reads a tensor's values.
    """
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise MethodOutputError(f"{source}: {name!r} is a {type(value).__name__}, not a torch.Tensor.")
        spec = specs.get(name)
        if spec is not None and (tuple(value.shape), value.dtype) != spec:
            raise MethodOutputError(
                f"{source}: tensor {name!r} has shape {_described(tuple(value.shape), value.dtype)}, but {reference} of "
                f"that name has shape {_described(*spec)}."
            )


def _described(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{shape} ({str(dtype).removeprefix('torch.')})"


def largest_magnitudes(slots: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor | None]:
    """The ``slot/name`` of every non-empty floating tensor of ``slots`` and a vector of their largest magnitudes
    (NaN where a tensor holds a NaN), in one fused pass over them (an infinity norm each); the vector is left on
    the tensors' device, to be read together with a round's other results (:func:`nonfinite_names`)."""
    named = [(f"{slot}/{name}", value) for slot, values in slots.items() for name, value in values.items()
             if value.is_floating_point() and value.numel()]
    if not named:
        return [], None
    return [name for name, _ in named], torch.stack(torch._foreach_norm([value for _, value in named], math.inf))


def nonfinite_names(magnitudes: Mapping[int, tuple[list[str], torch.Tensor | None]]) -> dict[int, list[str]]:
    """Per key of ``magnitudes`` (:func:`largest_magnitudes` of each), the names of its non-finite tensors (keys
    with none left out): the vectors are read in one go."""
    measured = {key: (names, vector) for key, (names, vector) in magnitudes.items() if vector is not None}
    if not measured:
        return {}
    finite = iter(torch.cat([vector for _, vector in measured.values()]).isfinite().tolist())
    found = {key: [name for name in names if not next(finite)] for key, (names, _) in measured.items()}
    return {key: names for key, names in found.items() if names}


def weighted_sums(uploads: Sequence[Upload], slot: str) -> tuple[TensorDict, dict[str, float]]:
    """Per tensor of one slot: the float64 sum of weight * value and the sum of weights, in client-id order.

    Each tensor is summed over the uploads that contain it (a per-task head over that task's clients
    only). Products of float32 values and sample counts are exact in float64, and grouping the sums
    differently (pre-summed per actor, see :func:`presum`) moves them only far below float32
    precision: the packing tests check that the float32 means come out bitwise equal. A sum may be a
    pre-summed upload's own tensor (one actor's round): read it, never write to it.
    """
    sums: TensorDict = {}
    totals: dict[str, float] = {}
    borrowed: set[str] = set()
    for upload in sorted(uploads, key=lambda u: u.client_id):
        _add_weighted(sums, totals, borrowed, upload, slot)
    return sums, totals


def _add_weighted(sums: TensorDict, totals: dict[str, float], borrowed: set[str], upload: Upload, slot: str) -> None:
    """Add one upload's weight * value (or a partial sum's sums) of ``slot`` into ``sums``, its weights into ``totals``.

    A partial sum's tensor that starts a sum is taken as it is, its name put in ``borrowed``, and the next term
    is added into a new tensor: with one actor a round, a copy of its whole sum (90 MB for an LLM's LoRA) is saved.
    """
    for name, value in upload.tensors.get(slot, {}).items():
        if upload.weight_sums is None:
            # Multiply, then add, as separate operations: the same float64 roundings on every device.
            term, weight = value.to(torch.float64, copy=True).mul_(upload.weight), upload.weight
        else:
            term, weight = value, upload.weight_sums[slot][name]
        if name not in sums:
            sums[name] = term
            if upload.weight_sums is not None:
                borrowed.add(name)
        elif name in borrowed:
            sums[name] = sums[name] + term
            borrowed.discard(name)
        else:
            sums[name].add_(term)  # in place: this runs once per client and tensor every round
        totals[name] = totals.get(name, 0.0) + weight


def weighted_mean(uploads: Sequence[Upload], slot: str) -> TensorDict:
    """Sample-count weighted mean of one upload slot, each tensor over the uploads that contain it."""
    sums, totals = weighted_sums(uploads, slot)
    dtypes: dict[str, torch.dtype] = {}
    for upload in uploads:
        dtypes.update(_dtypes(upload, slot))
    return {name: mean_as(total, totals[name], dtypes[name]) for name, total in sums.items()}


def mean_as(total: torch.Tensor, weight: float, dtype: torch.dtype) -> torch.Tensor:
    """``(total / weight).to(dtype)``, the same values, in one pass over the tensor for a floating ``dtype``
    (computed at ``total``'s precision and rounded once, as the two steps do)."""
    if not dtype.is_floating_point:
        return (total / weight).to(dtype)
    return torch.div(total, weight, out=torch.empty(total.shape, dtype=dtype, device=total.device))


def _dtypes(upload: Upload, slot: str) -> dict[str, torch.dtype]:
    """The dtypes the clients' tensors of ``slot`` had (a partial sum holds float64 sums of them)."""
    if upload.dtypes:
        return upload.dtypes.get(slot, {})
    return {name: value.dtype for name, value in upload.tensors.get(slot, {}).items()}


class PartialSum:
    """One actor's uploads of a round summed as they come (see :func:`presum`), in client-id order.

    Adding each upload as soon as it is made keeps one float64 sum rather than every upload, on the
    device where the uploads were trained; :meth:`upload` then moves it to the host in one go.
    """

    def __init__(self) -> None:
        self.sums: dict[str, TensorDict] = {}
        self.borrowed: dict[str, set[str]] = {}  # see _add_weighted
        self.weights: dict[str, dict[str, float]] = {}
        self.dtypes: dict[str, dict[str, torch.dtype]] = {}
        self.client_ids: list[int] = []
        self.num_samples = 0

    def add(self, upload: Upload) -> None:
        if self.client_ids and upload.client_id <= self.client_ids[-1]:
            raise ValueError(
                f"PartialSum.add: client {upload.client_id} after client {self.client_ids[-1]}; uploads are "
                "summed in increasing client-id order, the order weighted_sums adds them in."
            )
        for slot in upload.tensors:
            _add_weighted(self.sums.setdefault(slot, {}), self.weights.setdefault(slot, {}),
                          self.borrowed.setdefault(slot, set()), upload, slot)
            self.dtypes.setdefault(slot, {}).update(_dtypes(upload, slot))
        self.client_ids.append(upload.client_id)
        self.num_samples += upload.num_samples

    def upload(self, device: torch.device | str | None = None) -> Upload:
        """The partial sum as one upload, its tensors moved to ``device`` (None: where they are)."""
        return Upload(
            client_id=self.client_ids[0], num_samples=self.num_samples,
            tensors={slot: self.sums[slot] if device is None else tensors_to(self.sums[slot], device)
                     for slot in sorted(self.sums)},
            train_loss=float("nan"), weight_sums=self.weights, dtypes=self.dtypes,
        )


def presum(uploads: Sequence[Upload]) -> Upload:
    """One actor's uploads of a round as one partial sum, for methods whose aggregate is a weighted mean."""
    partial = PartialSum()
    for upload in sorted(uploads, key=lambda u: u.client_id):
        partial.add(upload)
    return partial.upload()


class Method:
    """Base class: FedAvg semantics over the parameters :meth:`is_shared` selects.

    Subclasses set ``Params`` (a frozen dataclass whose defaults are the paper's values and
    whose ``__post_init__`` validates them) and override the hooks that differ.
    """

    Params: ClassVar[type] = NoParams
    communicates: ClassVar[bool] = True
    pre_federation_stage: ClassVar[bool] = False
    """Whether :meth:`pre_federation` runs before round 1, once per architecture, on an actor holding that
    architecture's model (e.g. aligning adapters on public data); declared, never inferred."""
    presums_uploads: ClassVar[bool] = True
    """Whether :meth:`aggregate` is a function of the uploads' per-tensor weighted sums (``weighted_sums`` /
    ``weighted_mean``), which actors may then pre-sum as uploads come (:func:`presum`); a method that needs
    every client's own upload (per-client weights, counts of uploads, relevance between clients) sets False.
    Declared by each method, never inferred."""
    public_passes: ClassVar[int] = 0
    """How many server-side passes on public data follow each round's :meth:`aggregate` (e.g. distillation
    between architectures): pass p asks :meth:`public_request` for each architecture's request, runs
    :meth:`public_pass` on one actor of that architecture (its model, the public data), and hands what every
    architecture returned to :meth:`after_public_pass`. Declared, never inferred."""
    batchable_updates: ClassVar[bool] = True
    """Whether, with ``train.batch_clients``, the plain training calls of :meth:`local_update` may run together
    with other clients' (:mod:`rayfed.batching`): a hook that changes the model's own settings (an adapter mix, an
    active view) before such a call sets False, as those settings would not be its own while the batch trains."""

    def __init__(self, params: Any = None):
        self.params = params if params is not None else self.Params()
        # Facts of the run, set once when the run builds the method: the federation's size, its tasks, the
        # number of rounds and every client's architecture (all "" in a run of one).
        self.num_clients = 0
        self.tasks: tuple[Task, ...] = ()
        self.rounds = 0
        self.architecture_of: tuple[str, ...] = ()

    # The model -------------------------------------------------------------------------
    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        """The client model this method trains over a private copy of ``backbone``.

        Default: the one ``model.client`` chooses (:mod:`rayfed.models.client_plugin`; unset: ``model.module`` and
        a head per task). Initial values must depend on ``seed`` only, so every actor builds the same model.
        """
        from rayfed.models import client_model

        return client_model(backbone, config, tasks, seed)

    def participants(self, round_idx: int, sampled: list[int], num_clients: int) -> list[int]:
        """The clients that train in round ``round_idx``, given the engine's seeded sample. Default: the sample."""
        return sampled

    # Parameter roles -------------------------------------------------------------------
    def is_shared(self, name: str) -> bool:
        """Whether trainable parameter ``name`` is communicated (else it stays personal)."""
        return self.communicates

    def split(self, params: TensorDict) -> tuple[TensorDict, TensorDict]:
        shared = {n: v for n, v in params.items() if self.is_shared(n)}
        personal = {n: v for n, v in params.items() if not self.is_shared(n)}
        return shared, personal

    # Client side -----------------------------------------------------------------------
    def init_client(self, initial: TensorDict) -> ClientState:
        _, personal = self.split(initial)
        return {"personal": personal}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        start = {**state["personal"], **(payload or {})}
        result = client.train(start, extra_loss=self.local_penalty(payload))
        shared, personal = self.split(result.params)
        upload = {"shared": shared} if shared else {}
        return LocalResult({**state, "personal": personal}, upload, result.loss)

    def local_penalty(self, payload: TensorDict | None):
        """An extra loss term on the trainable parameters during local training, or None."""
        return None

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        """The parameters a client is evaluated with."""
        return {**state["personal"], **(payload or {})}

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        """Every parameter view a client is evaluated with, by name; ``""`` is the method's own (its metrics
        keep their plain names), others are reported as ``<metric>@<view>``. Default: :meth:`eval_params`."""
        return {"": self.eval_params(state, payload)}

    def activate_view(self, model: nn.Module, view: str) -> None:
        """Set up ``model`` to evaluate view ``view`` (e.g. which adapters its forward uses). Default: nothing."""

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        """A client-side stage after the last round (distillation, ...). Default: nothing."""
        return state

    # Server side -----------------------------------------------------------------------
    def init_server(self, initial_shared: TensorDict) -> ServerState:
        return {"global": initial_shared}

    def pre_federation(self, stage: PreFederation) -> TensorDict:
        """The client-side stage before round 1 (with :attr:`pre_federation_stage`): once per architecture, on
        one of its actors, with its model, the run's public data and the round-0 parameters. What it returns
        goes to :meth:`before_federation`."""
        return {}

    def before_federation(self, server: ServerState, prepared: dict[str, TensorDict]) -> ServerState:
        """The server-side stage before round 1, given :meth:`pre_federation`'s tensors per architecture (empty
        without a pre-federation stage). Default: the server state as it is."""
        return server

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        """The new server state from the round's uploads (per actor one partial sum of them when
        :attr:`presums_uploads`, else every client's own). Default: each tensor's sample-weighted mean."""
        with_shared = [u for u in uploads if u.tensors.get("shared")]
        if not with_shared:
            return server
        # A tensor nobody uploaded this round keeps its value.
        return {**server, "global": {**server["global"], **weighted_mean(with_shared, "shared")}}

    def public_request(self, server: ServerState, index: int, architecture: str) -> TensorDict:
        """What public pass ``index`` of a round sends to ``architecture``'s actor (server names). Default: nothing."""
        return {}

    def public_pass(self, stage: PublicPass, index: int, request: TensorDict) -> TensorDict:
        """Public pass ``index`` on an actor of ``stage.architecture``, given :meth:`public_request`'s tensors;
        what it returns goes to :meth:`after_public_pass`. Default: nothing."""
        return {}

    def after_public_pass(self, server: ServerState, index: int, results: dict[str, TensorDict]) -> ServerState:
        """The server state after public pass ``index``, given each architecture's :meth:`public_pass` result."""
        return server

    def payload(self, server: ServerState, client_id: int) -> TensorDict | None:
        """What client ``client_id`` receives from the server (None = nothing)."""
        return server.get("global") or None


def build_method(entry: Any, index: int, *, num_clients: int = 0, tasks: Sequence[Task] = (), rounds: int = 0,
                 architecture_of: Sequence[str] = ()) -> Method:
    """The method a ``methods[index]`` config entry names, with its hyperparameters validated against its
    ``Params`` dataclass; one sentence naming the field when something is wrong."""
    from rayfed.errors import ConfigError
    from rayfed.registry import resolve

    field = f"methods[{index}].name"
    resolved = resolve("method", entry.name, field)
    if isinstance(resolved.obj, Method):  # an instance passed from Python: used as it is
        if entry.params:
            raise ConfigError(f"{field} = {resolved.name!r} is a built method; give its hyperparameters to it, not in "
                              f"methods[{index}] ({', '.join(entry.params)}).")
        method = resolved.obj
    else:
        cls = resolved.obj
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            missing = [hook for hook in ("local_update", "aggregate", "payload") if not hasattr(cls, hook)]
            lacks = f" (it lacks {', '.join(missing)})" if missing else ""
            raise ConfigError(f"{field} = {resolved.name!r} is a {type(cls).__name__}, not a rayfed.Method subclass{lacks}.")
        params = _validated_params(cls.Params, entry.params, f"methods[{index}] ({resolved.name})")
        method = cls(params)
    method.num_clients, method.tasks, method.rounds = num_clients, tuple(tasks), rounds
    method.architecture_of = tuple(architecture_of) or ("",) * num_clients
    return method


def _validated_params(params_cls: type, values: dict[str, Any], label: str) -> Any:
    """``params_cls(**values)``, each value checked against (and coerced to) its field's annotation first.

    The check runs on a pydantic model made of the dataclass's field names, types and defaults rather than
    on the dataclass itself: a class Ray sent by value (a user's own method) keeps its fields but not
    ``dataclasses.MISSING``'s identity, which pydantic's dataclass support relies on.
    """
    import dataclasses
    import typing

    import pydantic

    from rayfed.errors import ConfigError, suggest

    fields = dataclasses.fields(params_cls)
    allowed = [f.name for f in fields]
    for key in values:
        if key not in allowed:  # a Params class's removed_hyperparameters: {name: what to set instead}
            removed = getattr(params_cls, "removed_hyperparameters", {}).get(key)
            hint = f"it was removed: {removed}" if removed else f"allowed: {', '.join(allowed)}" if allowed else \
                "it takes no hyperparameters"
            raise ConfigError(f"{label} has no hyperparameter {key!r}{suggest(key, allowed)}; {hint}.")
    try:
        hints = typing.get_type_hints(params_cls)
    except (NameError, TypeError):  # annotations naming what this process cannot import: checked by __post_init__
        hints = {}
    missing = type(dataclasses.MISSING)
    spec: dict[str, Any] = {}
    for f in fields:
        if not isinstance(f.default, missing):
            default = f.default
        elif not isinstance(f.default_factory, missing):
            default = pydantic.Field(default_factory=f.default_factory)
        else:
            default = ...
        spec[f.name] = (hints.get(f.name, Any), default)
    model = pydantic.create_model(f"{params_cls.__name__}Check", __config__=pydantic.ConfigDict(arbitrary_types_allowed=True), **spec)
    try:
        checked = model(**values)
        return params_cls(**{f.name: getattr(checked, f.name) for f in fields if f.init})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        name = ".".join(str(p) for p in first["loc"]) or "params"
        message, value = first["msg"], values.get(name, first.get("input"))
    except (TypeError, ValueError) as err:  # the dataclass's own __post_init__ checks
        name = next((f for f in values if f in str(err)), "params")
        message, value = str(err), values.get(name, values)
    message = message.removeprefix("Value error, ").rstrip(".")
    raise ConfigError(f"{label}.{name} = {value!r} is invalid: {message}.") from None


def post_fl_steps(microbatches: int, grad_accum: int) -> int:
    """Optimizer steps of P micro-batches (the code steps every grad_accum micro-batches and after the last)."""
    return math.ceil(microbatches / grad_accum)


def post_train_views(client: ClientContext, start: TensorDict, microbatches: int, lr: float,
                     multiples: Sequence[int] = (1, 2), **train: Any) -> dict[str, TensorDict]:
    """The "+ Post-train" views (spec §6) as client-state slots: ``view:pt`` (``start`` trained P micro-batches
    at ``lr``) and ``view:pt2`` (2P), ``view:pt<k>`` for each of ``multiples``, every one on the same batches in
    the same order; ``train``: :meth:`ClientContext.train`'s ``loss`` or ``phases`` (the method's own
    objective)."""
    steps = post_fl_steps(microbatches, client.train_config.grad_accum)
    # One call for every view: the longest holds the shorter ones (ClientContext.train's snapshot_steps).
    trained = client.train(start, steps=max(multiples) * steps, lr=lr, purpose="post_train",
                           snapshot_steps=[k * steps for k in multiples], **train)
    return {f"view:pt{'' if k == 1 else k}": trained.snapshots[k * steps] for k in multiples}


def stored_views(state: ClientState) -> dict[str, TensorDict]:
    """The views a client state holds in its ``view:<name>`` slots, by name."""
    return {slot.removeprefix("view:"): values for slot, values in state.items() if slot.startswith("view:")}
