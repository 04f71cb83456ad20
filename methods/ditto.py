"""Ditto (Li et al., ICML 2021): a global FedAvg model plus a personal model per client.

Each sampled client (1) trains the global model from the received weights and uploads it, and
(2) trains its personal model v with the loss + lam/2 ||v - w_global||^2, toward the global
weights it received this round. Clients are evaluated with their personal model. Both models
are LoRA + head over the same frozen backbone.
"""

from __future__ import annotations

from rayfed.method import ClientState, LocalResult, Method, TensorDict
from rayfed.params import AtLeastOne, NonNegative, hyperparameters
from rayfed.registry import register_method
from rayfed.training import ClientContext, proximal_penalty
from rayfed.types import Slot


@hyperparameters
class DittoParams:
    lam: NonNegative = 0.1
    personal_steps: AtLeastOne | None = None  # default: the same budget as the global update


@register_method("ditto")
class Ditto(Method):
    Params = DittoParams

    def init_client(self, initial: TensorDict) -> ClientState:
        return {Slot.PERSONAL: {}, "personal_model": dict(initial)}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        global_update = client.train(payload)
        personal_update = client.train(
            state["personal_model"], steps=self.params.personal_steps, purpose="personal",
            extra_loss=proximal_penalty(payload, self.params.lam),
        )
        new_state = {**state, "personal_model": personal_update.params}
        return LocalResult(new_state, {Slot.SHARED: global_update.params}, global_update.loss)

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return state["personal_model"]
