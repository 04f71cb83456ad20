"""What a ClientActor adds to a method's evaluation, kept in one :class:`ClientEvaluation`: the other clients' tasks a
client of a stream is also scored on, and evaluation hooks, extra metrics of the method's own view
(``federation.representation_shift``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from rayfed.config import RunConfig, StreamConfig
from rayfed.data.batches import to_device
from rayfed.data.clients import Federation
from rayfed.method import ClientState, Method, TensorDict
from rayfed.models import Backbone
from rayfed.models.peft.modules import feature_shift, head_features
from rayfed.tasks import param_tasks
from rayfed.training import ClientContext, OtherTask, mixed_precision


class StreamTests:
    """In a stream with ``data.stream.evaluate_others``: every held task's first round and test columns (on
    ``device``), from which each client gets the other clients' tasks it is also scored on."""

    def __init__(self, federation: Federation, backbone: Backbone, stream: StreamConfig | None, device: torch.device):
        self.tests: dict[int, tuple[int, dict]] = {}  # task -> (first round, test columns)
        if stream is not None and stream.evaluate_others:
            held = {holding.task for holding in federation.holdings}
            self.tests = {task: (federation.first_round(task), to_device(federation.task_test(task, backbone), device))
                          for task in sorted(held)}

    def others(self, own_tasks: tuple[int, ...], initial: TensorDict,
               tags: dict[str, frozenset[int]]) -> list[OtherTask]:
        """The tasks a client of ``own_tasks`` is scored on besides its own, each with the round-0 values of that
        task's own parameters the client lacks (from the model's ``initial`` parameters)."""
        own = set(own_tasks)
        others = []
        for task, (first_round, test) in self.tests.items():
            if task in own:
                continue
            missing = {name: value for name, value in initial.items()
                       if (owners := param_tasks(name, tags)) is not None and task in owners and not owners & own}
            others.append(OtherTask(task, test, first_round, missing))
        return others


class EvaluationHook(Protocol):
    """An extra metric of a client's evaluation, of the method's own view's parameters (``params``)."""

    def __call__(self, client: ClientContext, params: TensorDict) -> dict[str, float]: ...


class RepresentationShift:
    """``rep_shift``: how far the head's input features on a client's test inputs moved from those of the
    initial model (``initial``: each client's initial parameters), ``1 - mean cosine similarity``; the features
    computed as an evaluation computes (``train.autocast`` ``autocast``)."""

    def __init__(self, model: torch.nn.Module, initial: dict[int, TensorDict], batch_size: int, device: torch.device,
                 autocast: str):
        self.model, self.initial, self.batch_size, self.device = model, initial, batch_size, device
        self.autocast = autocast
        self.initial_features: dict[int, torch.Tensor] = {}  # the initial model's features never change

    def __call__(self, client: ClientContext, params: TensorDict) -> dict[str, float]:
        cid = client.client_id
        inputs = {name: column.to(self.device) for name, column in client.data.parts[0].test.items()}
        with mixed_precision(self.device, self.autocast):
            if cid not in self.initial_features:
                self.initial_features[cid] = head_features(self.model, self.initial[cid], inputs, self.batch_size)
            features = head_features(self.model, params, inputs, self.batch_size)
        return {"rep_shift": feature_shift(self.initial_features[cid], features)}


def evaluation_hooks(config: RunConfig, model: torch.nn.Module, initial: dict[int, TensorDict],
                     device: torch.device) -> list[EvaluationHook]:
    """The evaluation hooks the config asks for, on a method's freshly built ``model``."""
    if not config.federation.representation_shift:
        return []
    return [RepresentationShift(model, initial, config.train.eval_batch_size, device, config.train.autocast)]


def view_metrics(method: Method, model: torch.nn.Module, client: ClientContext, state: ClientState,
                 payload: TensorDict | None, hooks: Sequence[EvaluationHook] = (),
                 params: TensorDict | None = None) -> dict[str, float]:
    """Every view's metrics of a client (``params``, if given, replace the method's own view), under ``<metric>@<view>``
    but the own view's under plain names, with the hooks' extra metrics of the own view."""
    views = method.eval_views(state, payload)
    if params is not None:
        views[""] = params
    metrics: dict[str, float] = {}
    for view, view_params in views.items():
        method.activate_view(model, view)
        values = client.evaluate(view_params)
        for hook in hooks if not view else ():
            values.update(hook(client, view_params))
        metrics.update({f"{name}@{view}" if view else name: value for name, value in values.items()})
    method.activate_view(model, "")
    return metrics


class ClientEvaluation:
    """A ClientActor's evaluation extras: in a stream, each hosted client's other tasks (:class:`StreamTests`),
    which its :class:`rayfed.training.ClientContext` scores with its own in one pass, and the evaluation hooks the
    config asks for (:func:`evaluation_hooks`), made again for each method's model."""

    def __init__(self, config: RunConfig, federation: Federation, backbone: Backbone, device: torch.device,
                 data_device: torch.device):
        self.config, self.device = config, device
        self.stream_tests = StreamTests(federation, backbone, config.data.stream, data_device)
        self.others: dict[int, list[OtherTask]] = {}
        self.hooks: list[EvaluationHook] = []

    def start_method(self, model: torch.nn.Module, tasks_of: Mapping[int, tuple[int, ...]], initial_params: TensorDict,
                     tags: dict[str, frozenset[int]], initial: dict[int, TensorDict]) -> None:
        """A method's start: its ``model``, the round-0 values of its parameters (``initial_params``, and each
        client's view of them, ``initial``, which guests join) and the tasks each of them belongs to (``tags``)."""
        self.others.clear()  # in place: the actor reads this dict
        self.others.update({cid: self.stream_tests.others(tasks, initial_params, tags)
                            for cid, tasks in tasks_of.items()})
        self.hooks = evaluation_hooks(self.config, model, initial, self.device)

    def add_client(self, client_id: int, tasks: tuple[int, ...], initial_params: TensorDict,
                   tags: dict[str, frozenset[int]]) -> None:
        """A guest client, evaluated here too (its initial view is in the ``initial`` given to start_method)."""
        self.others[client_id] = self.stream_tests.others(tasks, initial_params, tags)

    def metrics(self, method: Method, model: torch.nn.Module, client: ClientContext, state: ClientState,
                payload: TensorDict | None, params: TensorDict | None = None) -> dict[str, float]:
        """Every view's metrics of a client, with the hooks' of its own view (:func:`view_metrics`)."""
        return view_metrics(method, model, client, state, payload, self.hooks, params)
