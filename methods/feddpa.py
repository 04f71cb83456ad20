"""FedDPA (Yang et al., NeurIPS 2024, dual-personalizing adapter): a global LoRA adapter trained by FedAvg and a
local one trained with the global frozen, mixed at inference with instance-wise weights.

A baseline of FedMosaic's paper, *Not All Clients Are Equal: Collaborative Model Personalization on Heterogeneous
Multi-Modal Clients* (docs/fedmosaic.md#ablations-baselines; the paper gives no details, this is our reading). Each
round a client (1) trains the received global adapter alone (``W x + s B_g A_g x``) and uploads it (averaged within an
architecture, sample-weighted), then (2) trains its local adapter with that global one frozen, on ``W x + s ((1 - w) B_g
A_g x + w B_l A_l x)`` with ``w = local_weight``. At inference ``w`` is per instance: the cosine similarity (clipped to
[0, 1]) between the instance's representation (its first decoder layer's input, averaged over tokens) and the mean
representation of the client's training samples, kept in its state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import ClientState, LocalResult, Method, TensorDict
from rayfed.models import Backbone, build_lora_set
from rayfed.models.peft import named_adapters
from rayfed.models.peft.modules import select_task
from rayfed.param_names import adapter_of
from rayfed.params import AtLeastOne, UnitInterval, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import ClientContext, Phase, Step, stacked_forward_batch
from rayfed.types import Slot

GLOBAL, LOCAL = "global", "local"


@hyperparameters
class FedDPAParams:
    local_weight: UnitInterval = 0.5  # w while the local adapter trains
    dynamic: bool = True  # instance-wise w at inference (else local_weight)
    local_steps: AtLeastOne | None = None  # steps of the local stage (default: the config's)


class _Recorded(Exception):
    """Ends a forward once its first decoder layer's input is recorded."""


class InstanceWeights:
    """A pre-hook on the first decoder layer that sets every adapted layer's mix from the batch's pooled input:
    ``w(x) = clip(cos(mean_t h_0(x), profile), 0, 1)`` for the local adapter, 1 - w for the global. Decoding
    steps (one new token) keep the weights of their prompt. The profile's data, the pooled inputs of the batches
    the local adapter trains on, are recorded by :meth:`observe` after each step, not inside it: a captured step
    (``train.cuda_graphs``) replays no Python, so a hook recording in the step would record only its capture."""

    def __init__(self, model: nn.Module, scope: str | None):
        self.model = model
        self.profile: torch.Tensor | None = None
        self.record: list[torch.Tensor] = []  # each observed forward's pooled input sum and row count
        self.recording = False
        _, layers = named_adapters.decoder_layers(model.encoder, scope)
        layers[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.recording:
            self.record.append(hidden.detach().float().mean(dim=1).sum(0))
            self.record.append(torch.tensor(float(len(hidden))))
            raise _Recorded
        if self.profile is None or hidden.shape[1] == 1:
            return None
        pooled = hidden.detach().float().mean(dim=1)
        weight = nn.functional.cosine_similarity(pooled, self.profile.to(pooled.device).unsqueeze(0), dim=1)
        weight = weight.clamp(0.0, 1.0).to(hidden.dtype).view(-1, 1, 1)
        named_adapters.set_mix(self.model, {GLOBAL: 1 - weight, LOCAL: weight})
        return None

    def observe(self, step: Step) -> None:
        """Record the pooled first-layer inputs of a micro-batch just trained on, as its step's forward had them (in
        one forward where the step stacks its tasks' parts), by a forward that ends there: the adapters come later."""
        stacked = stacked_forward_batch(step.model, step.parts)
        forwards = [(step.parts[0][0], stacked)] if stacked is not None else step.parts
        self.recording = True
        try:
            with torch.no_grad():
                for task, batch in forwards:
                    select_task(step.model, task.index)
                    with contextlib.suppress(_Recorded):
                        step.model(batch)
        finally:
            self.recording = False

    def recorded_profile(self) -> torch.Tensor | None:
        """The mean pooled input over the rows recorded (None: none), the record emptied."""
        sums, counts = self.record[0::2], self.record[1::2]
        self.record = []
        return (torch.stack(sums).sum(0) / torch.stack(counts).sum()).cpu() if sums else None


@register_method("feddpa")
class FedDPA(Method):
    Params = FedDPAParams
    _profile: torch.Tensor | None = None  # the evaluated client's profile, from eval_views to activate_view

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = build_lora_set(backbone, config, tasks, seed, (GLOBAL, LOCAL), stream="feddpa",
                               owner="methods (feddpa)")
        if self.params.dynamic:
            model.attachments.put(InstanceWeights(model, backbone.lora_scope))
        return model

    def is_shared(self, name: str) -> bool:
        return adapter_of(name) == GLOBAL

    def init_client(self, initial: TensorDict) -> ClientState:
        _, personal = self.split(initial)
        return {Slot.PERSONAL: personal, "profile": {}}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        model, received = client.model, payload or {}
        weights = model.attachments.get(InstanceWeights)
        if weights is not None:
            weights.profile = None
        named_adapters.set_mix(model, {GLOBAL: 1.0})
        global_update = client.train({**state[Slot.PERSONAL], **received}, phases=[Phase(trains=self.is_shared)])
        trained_global = {n: v for n, v in global_update.params.items() if self.is_shared(n)}
        named_adapters.set_mix(model, {GLOBAL: 1 - self.params.local_weight, LOCAL: self.params.local_weight})
        local_update = client.train({**state[Slot.PERSONAL], **trained_global}, steps=self.params.local_steps,
                                    purpose="local", phases=[Phase(trains=lambda n: not self.is_shared(n))],
                                    observe=None if weights is None else weights.observe)
        new_state = {**state, Slot.PERSONAL: {n: v for n, v in local_update.params.items() if not self.is_shared(n)}}
        profile = None if weights is None else weights.recorded_profile()
        if profile is not None:
            new_state["profile"] = {"mean": profile}
        named_adapters.set_mix(model, None)
        return LocalResult(new_state, {Slot.SHARED: trained_global}, global_update.loss)

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return {**state[Slot.PERSONAL], **(payload or {})}

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        self._profile = state.get("profile", {}).get("mean")
        return {"": self.eval_params(state, payload)}

    def activate_view(self, model: nn.Module, view: str) -> None:
        weights = model.attachments.get(InstanceWeights)
        if weights is not None and self._profile is not None:
            weights.profile = self._profile
        else:
            named_adapters.set_mix(model, {GLOBAL: 1 - self.params.local_weight, LOCAL: self.params.local_weight})
