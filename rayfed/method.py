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

from rayfed.aggregation import (Aggregation, EachUpload, MixedServer, Mixture, PartialSum, Upload, WeightedMean,
                                mean_as, presum, weighted_mean, weighted_sums)
from rayfed import compat
from rayfed.errors import ConfigError
from rayfed.stages import AfterFederationStage, PreFederationStage, PublicPassStage, Stage, check_stages
from rayfed.types import ClientState, Loss, ServerState, Slot, TensorDict, read_slot, tensor_bytes, tensor_params

if TYPE_CHECKING:
    from rayfed.config import ModelConfig
    from rayfed.models import Backbone, TrainableModule
    from rayfed.tasks import Task
    from rayfed.training import ClientContext, PreFederation, PublicPass

__all__ = ["AfterFederationStage", "ClientState", "CORE_HOOKS", "EachUpload", "LocalResult", "Method",
           "MethodOutputError", "Mixture", "NoParams", "NonFiniteError", "OPTIONAL_HOOKS", "PartialSum",
           "PreFederationStage", "PublicPassStage", "ServerState", "Slot", "TensorDict", "Upload", "WeightedMean",
           "check_tensors", "largest_magnitudes", "mean_as", "nonfinite_names", "post_fl_steps", "post_train_views",
           "presum", "stored_views", "tensor_bytes", "tensor_params", "tensor_specs", "weighted_mean", "weighted_sums"]

CORE_HOOKS = ("build_model", "is_shared", "init_client", "local_update", "eval_params", "init_server", "aggregate",
              "payload")
"""The hooks that make a method: what its clients train and keep, what they upload, and what the server makes of
it. Each has a FedAvg default; a method overrides those that differ."""
OPTIONAL_HOOKS = ("participants", "local_penalty", "eval_views", "activate_view", "pre_federation",
                  "before_federation", "public_request", "public_pass", "after_public_pass", "after_federation")
"""Hooks for what few methods need: picking a round's clients, a penalty for the default ``local_update``, several
evaluated views, and the hooks of the stages a method declares (:mod:`rayfed.stages`), which run only then."""


@dataclass(frozen=True)
class NoParams:
    """For methods without hyperparameters."""


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
                f"{source}: tensor {name!r} has shape {_described(tuple(value.shape), value.dtype)}, "
                f"but {reference} of that name has shape {_described(*spec)}."
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


class Method:
    """Base class: FedAvg semantics over the parameters :meth:`is_shared` selects.

    Subclasses set ``Params`` (a frozen dataclass whose defaults are the paper's values and
    whose ``__post_init__`` validates them) and override the hooks that differ: mostly of :data:`CORE_HOOKS`, those
    of :data:`OPTIONAL_HOOKS` where needed. The server side of each aggregation kind (a mixture's rows) is the
    DriverActor's, not the method's: no hook depends on another having called ``super()``.
    """

    Params: ClassVar[type] = NoParams
    communicates: ClassVar[bool] = True
    stages: ClassVar[tuple[Stage, ...]] = ()
    """The stages besides the rounds that the engine runs (:mod:`rayfed.stages`): ``PreFederationStage()``
    (:meth:`pre_federation`, :meth:`before_federation`), ``PublicPassStage(count)`` (:meth:`public_request`,
    :meth:`public_pass`, :meth:`after_public_pass`), ``AfterFederationStage()`` (:meth:`after_federation`).
    Declared, never inferred: overriding a stage's hook without declaring it is refused."""
    aggregation: ClassVar[Aggregation] = WeightedMean()
    """How the uploads combine (:mod:`rayfed.aggregation`), which decides what the engine keeps and sends:
    :class:`WeightedMean` (:meth:`aggregate` reads only the uploads' per-tensor weighted sums, which the actors then
    pre-sum), :class:`EachUpload` (it reads every client's own upload) or :class:`Mixture` (the engine keeps every
    client's latest upload and sends each client its own mix of them, by a weight matrix that :meth:`aggregate`
    computes). Declared by each method, never inferred."""
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compat.check_method_attributes(cls)
        legacy = compat.legacy_stages(cls, Method)
        if legacy is not None:
            cls.stages = legacy
        check_stages(cls, cls.stages, Method)

    def __init__(self, params: Any = None):
        self.params = params if params is not None else self.Params()
        # Facts of the run, set once when the run builds the method: the federation's size, its tasks, the
        # number of rounds and every client's architecture (all "" in a run of one).
        self.num_clients = 0
        self.tasks: tuple[Task, ...] = ()
        self.rounds = 0
        self.architecture_of: tuple[str, ...] = ()

    # The model -------------------------------------------------------------------------
    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> TrainableModule:
        """The client model this method trains over a private copy of ``backbone``: a :class:`rayfed.TrainableModule`,
        whose capabilities (text generation, tasks no client holds, ...) the engine reads.

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
        """``params`` as the shared and the personal ones, by :meth:`is_shared` (a helper, not a hook)."""
        shared = {n: v for n, v in params.items() if self.is_shared(n)}
        personal = {n: v for n, v in params.items() if not self.is_shared(n)}
        return shared, personal

    # Client side -----------------------------------------------------------------------
    def init_client(self, initial: TensorDict) -> ClientState:
        _, personal = self.split(initial)
        return {Slot.PERSONAL: personal}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        personal = read_slot(state, Slot.PERSONAL, f"{type(self).__name__}.local_update's client state")
        result = client.train({**personal, **(payload or {})}, extra_loss=self.local_penalty(payload))
        shared, personal = self.split(result.params)
        upload = {Slot.SHARED: shared} if shared else {}
        return LocalResult({**state, Slot.PERSONAL: personal}, upload, result.loss)

    def local_penalty(self, payload: TensorDict | None):
        """An extra loss term on the trainable parameters during local training, or None."""
        return None

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        """The parameters a client is evaluated with."""
        personal = read_slot(state, Slot.PERSONAL, f"{type(self).__name__}.eval_params's client state")
        return {**personal, **(payload or {})}

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        """Every parameter view a client is evaluated with, by name; ``""`` is the method's own (its metrics
        keep their plain names), others are reported as ``<metric>@<view>``. Default: :meth:`eval_params`."""
        return {"": self.eval_params(state, payload)}

    def activate_view(self, model: nn.Module, view: str) -> None:
        """Set up ``model`` to evaluate view ``view`` (e.g. which adapters its forward uses). Default: nothing."""

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        """The client-side stage after the last round (with an :class:`AfterFederationStage`: distillation, ...)."""
        return state

    # Server side -----------------------------------------------------------------------
    def init_server(self, initial_shared: TensorDict) -> ServerState:
        """The server state before round 1. Default: ``global``, the initial shared tensors; with a
        :class:`Mixture`, nothing: the DriverActor adds the rows it keeps (``Slot.ROWS``), every client's at its
        architecture's initial values, whatever this returns."""
        if isinstance(self.aggregation, Mixture):
            return {}
        return {Slot.GLOBAL: initial_shared}

    def pre_federation(self, stage: PreFederation) -> TensorDict:
        """The client-side stage before round 1 (with a :class:`PreFederationStage`): once per architecture, on
        one of its actors, with its model, the run's public data and the round-0 parameters. What it returns
        goes to :meth:`before_federation`."""
        return {}

    def before_federation(self, server: ServerState, prepared: dict[str, TensorDict]) -> ServerState:
        """The server-side stage before round 1, given :meth:`pre_federation`'s tensors per architecture (empty
        without a pre-federation stage). Default: the server state as it is."""
        return server

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        """The new server state from the round's uploads (per actor one partial sum of them with a
        :class:`WeightedMean`, else every client's own). Default: each tensor's sample-weighted mean; with a
        :class:`Mixture`, the state as it is (the engine has written the uploads into their rows)."""
        if isinstance(self.aggregation, Mixture):
            return server
        with_shared = [u for u in uploads if u.tensors.get(Slot.SHARED)]
        if not with_shared:
            return server
        # A tensor nobody uploaded this round keeps its value.
        kept = read_slot(server, Slot.GLOBAL, f"{type(self).__name__}.aggregate's server state")
        return {**server, Slot.GLOBAL: {**kept, **weighted_mean(with_shared, Slot.SHARED)}}

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
        """What client ``client_id`` receives from the server (None = nothing). Default: ``global``; with a
        :class:`Mixture`, the client's own mix of every client's rows (``server.mixed``: the DriverActor hands the
        hooks a :class:`~rayfed.aggregation.MixedServer`)."""
        if isinstance(self.aggregation, Mixture):
            if not isinstance(server, MixedServer):
                raise ConfigError(f"{type(self).__name__}.payload mixes the rows of a server state the DriverActor "
                                  f"hands out, but got a {type(server).__name__}: pass the state as it was given.")
            return server.mixed(client_id)
        return server.get(Slot.GLOBAL) or None


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
            raise ConfigError(
                f"{field} = {resolved.name!r} is a {type(cls).__name__}, not a rayfed.Method subclass{lacks}."
            )
        params = _validated_params(cls.Params, entry.params, f"methods[{index}] ({resolved.name})")
        method = cls(params)
    method.num_clients, method.tasks, method.rounds = num_clients, tuple(tasks), rounds
    method.architecture_of = tuple(architecture_of) or ("",) * num_clients
    return method


def method_model(method: Method, where: str, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task],
                 seed: int) -> TrainableModule:
    """``method.build_model``'s model, where the engine first meets it; one that is not a
    :class:`rayfed.TrainableModule` (whose capabilities and trainable parameters the engine reads) is refused in one
    sentence. ``where``: the method's config entry, ``methods[<i>] (<label>)``."""
    from rayfed.models import TrainableModule

    model = method.build_model(backbone, config, tasks, seed)
    if not isinstance(model, TrainableModule):
        raise ConfigError(f"{where}: {type(method).__name__}.build_model built a {type(model).__name__}, not a "
                          "rayfed.TrainableModule; subclass rayfed.TrainableModule instead of torch.nn.Module (it "
                          "declares the capabilities the engine reads, with defaults).")
    return model


def _validated_params(params_cls: type, values: dict[str, Any], label: str) -> Any:
    """``params_cls(**values)``, each value (the defaults' too) checked against and coerced to its field's
    annotation first (:func:`rayfed.params.checked_values`, for a plain dataclass as for a
    :func:`rayfed.params.hyperparameters` one); one sentence naming the field, the value and what is allowed.

    Defaults are read from the dataclass's fields rather than left to pydantic's dataclass support: a class Ray
    sent by value (a user's own method) keeps its fields but not ``dataclasses.MISSING``'s identity.
    """
    from rayfed.errors import suggest
    from rayfed.params import InvalidHyperparameter, checked_values

    fields = [f for f in dataclasses.fields(params_cls) if f.init]
    allowed = [f.name for f in fields]
    for key in values:
        if key not in allowed:
            removed = compat.removed_hyperparameter(params_cls, key)
            hint = f"it was removed: {removed}" if removed else f"allowed: {', '.join(allowed)}" if allowed else \
                "it takes no hyperparameters"
            raise ConfigError(f"{label} has no hyperparameter {key!r}{suggest(key, allowed)}; {hint}.")
    missing = type(dataclasses.MISSING)
    full = dict(values)
    for f in fields:
        if f.name in full:
            continue
        if not isinstance(f.default, missing):
            full[f.name] = f.default
        elif not isinstance(f.default_factory, missing):
            full[f.name] = f.default_factory()
        else:
            raise ConfigError(f"{label} needs the hyperparameter {f.name!r}, which has no default.")
    try:
        return params_cls(**checked_values(params_cls, full))
    except InvalidHyperparameter as err:
        name, value, message = err.field, err.value, err.reason
    except (TypeError, ValueError) as err:  # the dataclass's own __post_init__ checks (across fields)
        name = next((f for f in values if f in str(err)), "params")
        message, value = str(err), values.get(name, values)
    raise ConfigError(f"{label}.{name} = {value!r} is invalid: {message.rstrip('.')}.") from None


def post_fl_steps(microbatches: int, grad_accum: int) -> int:
    """Optimizer steps of P micro-batches: one every ``grad_accum`` micro-batches, and one after the last."""
    return math.ceil(microbatches / grad_accum)


def post_train_views(client: ClientContext, start: TensorDict, microbatches: int, lr: float,
                     multiples: Sequence[int] = (1, 2), **train: Any) -> dict[str, TensorDict]:
    """Post-training views as client-state slots: the federated model ``start`` trained further on the client's
    data, P micro-batches at ``lr`` (``view:pt``) and 2P (``view:pt2``), ``view:pt<k>`` for each of ``multiples``,
    every one on the same batches in the same order; ``train``: :meth:`ClientContext.train`'s ``loss`` or ``phases``
    (the method's own objective). :func:`stored_views` reads them back for evaluation (``@pt``, ``@pt2``)."""
    steps = post_fl_steps(microbatches, client.train_config.grad_accum)
    # One call for every view: the longest holds the shorter ones (ClientContext.train's snapshot_steps).
    trained = client.train(start, steps=max(multiples) * steps, lr=lr, purpose="post_train",
                           snapshot_steps=[k * steps for k in multiples], **train)
    return {f"view:pt{'' if k == 1 else k}": trained.snapshots[k * steps] for k in multiples}


def stored_views(state: ClientState) -> dict[str, TensorDict]:
    """The views a client state holds in its ``view:<name>`` slots, by name."""
    return {slot.removeprefix("view:"): values for slot, values in state.items() if slot.startswith("view:")}
