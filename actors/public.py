"""A method's stages on ``data.public`` on one ClientActor's architecture: the stage before round 1
(``Method.pre_federation``, a ``PreFederationStage``) and the passes after aggregations (a ``PublicPassStage``)."""

from __future__ import annotations

import torch

from rayfed.compute import counted
from rayfed.config import RunConfig, model_configs
from rayfed.data.batches import Columns
from rayfed.data.clients import encode_public
from rayfed.errors import raised_in
from rayfed.method import Method, TensorDict
from rayfed.models import Backbone
from rayfed.state_tree import map_tree
from rayfed.tasks import Task
from rayfed.training import PreFederation, PublicPass


def public_data(config: RunConfig, backbone: Backbone) -> tuple[Task | None, Columns]:
    """``data.public``'s task and columns, encoded for ``backbone``; ``(None, {})`` without it."""
    if config.data.public is None:
        return None, {}
    return encode_public(config.data.public, config.seed, backbone, model_configs(config))


def pre_federation(method: Method, config: RunConfig, architecture: str, model: torch.nn.Module,
                   initial_params: TensorDict, backbone: Backbone, device: torch.device) -> TensorDict:
    """The method's stage before round 1 with the model's ``initial_params``, on the public data encoded afresh."""
    public_task, public = public_data(config, backbone)
    stage = PreFederation(architecture, model, {n: v.to(device) for n, v in initial_params.items()},
                          public, public_task, config.train, device, config.seed)
    return map_tree(method.pre_federation(stage), lambda value: value.detach().cpu())  # a tree (rayfed.state_tree)


def public_pass(method: Method, config: RunConfig, architecture: str, model: torch.nn.Module,
                public: tuple[Task | None, Columns], device: torch.device, round_idx: int, index: int,
                request: TensorDict) -> TensorDict:
    """The method's public pass ``index`` after round ``round_idx`` on the encoded ``public`` data, given the server's
    ``request``."""
    public_task, columns = public
    stage = PublicPass(architecture, model, columns, public_task, config.train, device, config.seed, round_idx)
    request = {name: value.to(device) for name, value in request.items()}
    with raised_in(f"{type(method).__name__}.public_pass {index} on {architecture or 'the model'} "
                   f"after round {round_idx + 1}"):
        result = method.public_pass(stage, index, request)
    return {name: value.detach().cpu() for name, value in result.items()}


class PublicPasses:
    """A ClientActor's public passes: ``data.public`` encoded for its ``backbone`` at the first pass (``data``: the
    task and the columns), and the FLOPs of the passes while counting is on (compute matching)."""

    def __init__(self, config: RunConfig, backbone: Backbone):
        self.config, self.backbone = config, backbone
        self.data: tuple[Task | None, Columns] | None = None
        self.flops: float | None = None  # None: not counting

    def run(self, method: Method, architecture: str, model: torch.nn.Module, device: torch.device, round_idx: int,
            index: int, request: TensorDict) -> TensorDict:
        """:func:`public_pass` on the encoded public data."""
        if self.data is None:
            self.data = public_data(self.config, self.backbone)
        if self.flops is None:
            return public_pass(method, self.config, architecture, model, self.data, device, round_idx, index, request)
        result, flops = counted(lambda: public_pass(method, self.config, architecture, model, self.data, device,
                                                    round_idx, index, request))
        self.flops += flops
        return result

    def count(self, counting: bool) -> float:
        """The FLOPs counted since counting was last turned on (0 if it was off); counting from now on iff
        ``counting``."""
        so_far, self.flops = self.flops or 0.0, 0.0 if counting else None
        return so_far
