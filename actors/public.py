"""A method's stages on ``data.public`` on one ClientActor's architecture: the stage before round 1
(``Method.pre_federation``) and the passes after aggregations (``Method.public_passes``)."""

from __future__ import annotations

import torch

from rayfed.config import RunConfig, model_configs
from rayfed.data.batches import Columns
from rayfed.data.clients import encode_public
from rayfed.errors import raised_in
from rayfed.method import Method, TensorDict
from rayfed.models import Backbone
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
    return {name: value.detach().cpu() for name, value in method.pre_federation(stage).items()}


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
