"""What a PFL method is to the engine: hyperparameters and a handful of hooks.

Client-side hooks run inside a ClientActor with a :class:`~rayfed.training.ClientContext`;
server-side hooks run inside the DriverActor. A method never touches Ray, and the engine never
branches on a method's name.

State is plain tensors so that it can be checkpointed as safetensors:
- ``ClientState``: named slots of tensors kept for one client between rounds (e.g. "personal");
- ``ServerState``: named slots kept by the server (e.g. "global");
- an upload: named slots a client sends to the server in one round (e.g. "shared").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from rayfed.config import ModelConfig
    from rayfed.models import Backbone
    from rayfed.tasks import Task
    from rayfed.training import ClientContext

TensorDict = dict[str, torch.Tensor]
ClientState = dict[str, TensorDict]
ServerState = dict[str, TensorDict]


@dataclass(frozen=True)
class NoParams:
    """For methods without hyperparameters."""


@dataclass
class Upload:
    """What one client sends to the server in one round."""

    client_id: int
    num_samples: int
    tensors: dict[str, TensorDict]
    train_loss: float
    weight_scale: float = 1.0  # < 1 for a late upload that the system config down-weights

    @property
    def weight(self) -> float:
        return self.num_samples * self.weight_scale

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    @property
    def nparams(self) -> int:
        return tensor_params(self.tensors)


@dataclass
class LocalResult:
    """The result of a client's local update: its new state and what it uploads."""

    state: ClientState
    upload: dict[str, TensorDict]
    train_loss: float


def tensor_params(tree: Any) -> int:
    """The number of parameters (elements) in a tensor or a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.numel()
    if isinstance(tree, dict):
        return sum(tensor_params(value) for value in tree.values())
    return 0


def tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(value) for value in tree.values())
    return 0


def weighted_mean(uploads: Sequence[Upload], slot: str) -> TensorDict:
    """Sample-count weighted mean of one upload slot, summed in client-id order (order-independent).

    Each tensor is averaged over the uploads that contain it, so a per-task head is averaged over
    that task's clients only.
    """
    ordered = sorted(uploads, key=lambda u: u.client_id)
    totals: dict[str, float] = {}
    for upload in ordered:
        for name in upload.tensors.get(slot, {}):
            totals[name] = totals.get(name, 0.0) + upload.weight
    mean: TensorDict = {}
    for upload in ordered:
        for name, value in upload.tensors.get(slot, {}).items():
            weighted = (upload.weight / totals[name]) * value
            mean[name] = mean[name] + weighted if name in mean else weighted
    return mean


class Method:
    """Base class: FedAvg semantics over the parameters :meth:`is_shared` selects.

    Subclasses set ``Params`` (a frozen dataclass whose defaults are the paper's values and
    whose ``__post_init__`` validates them) and override the hooks that differ.
    """

    Params: ClassVar[type] = NoParams
    communicates: ClassVar[bool] = True
    num_clients: int = 0  # the federation's size; the DriverActor sets it before init_server

    def __init__(self, params: Any = None):
        self.params = params if params is not None else self.Params()

    # The model -------------------------------------------------------------------------
    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        """The client model this method trains over a private copy of ``backbone``.

        Default: the config's module (LoRA, adapter, prompts, full or none) shared by all tasks, and
        a linear head per task (one ``head`` when there is one task). Initial values must depend on
        ``seed`` only, so every actor builds the same model.
        """
        from rayfed.models import build_task_model

        return build_task_model(backbone, config, tasks, seed)

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

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        """A client-side stage after the last round (distillation, ...). Default: nothing."""
        return state

    # Server side -----------------------------------------------------------------------
    def init_server(self, initial_shared: TensorDict) -> ServerState:
        return {"global": initial_shared}

    def before_federation(self, server: ServerState) -> ServerState:
        """A server-side stage before the first round (alignment, ...). Default: nothing."""
        return server

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        with_shared = [u for u in uploads if u.tensors.get("shared")]
        if not with_shared:
            return server
        # A tensor nobody uploaded this round keeps its value.
        return {**server, "global": {**server["global"], **weighted_mean(with_shared, "shared")}}

    def payload(self, server: ServerState, client_id: int) -> TensorDict | None:
        """What client ``client_id`` receives from the server (None = nothing)."""
        return server.get("global") or None
