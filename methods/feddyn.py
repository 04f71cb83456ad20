"""FedDyn (Acar et al., ICLR 2021): FedAvg with dynamic regularisation, a client and a server correction.

A baseline of the scale & modularity study of *Augmenting Federated Learning with Pretrained Transformers*
(arXiv 2307.04905; docs/fedyolo.md#methods).

Client m keeps a gradient state g_m (zero at first) and minimises
``F_m(w) - <g_m, w> + alpha/2 ||w - w_t||^2`` from the server's w_t, then sets
``g_m <- g_m - alpha (w_m - w_t)``. The server keeps h (zero at first):
``h <- h - alpha/N sum_m (w_m - w_t)`` over the round's uploads (N = all clients) and
``w_{t+1} = mean_m w_m - h / alpha``. Each tensor is averaged over the uploads that hold it
(per-task parameters over their task's clients), and unweighted, as in the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rayfed.method import ClientState, EachUpload, LocalResult, Method, ServerState, TensorDict, Upload
from rayfed.params import Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.training import ClientContext, TensorPenalty
from rayfed.types import Slot


@hyperparameters
class FedDynParams:
    alpha: Positive = 0.01


@register_method("feddyn")
class FedDyn(Method):
    Params = FedDynParams
    aggregation = EachUpload()  # an unweighted mean, over the number of uploads holding each tensor

    def init_client(self, initial: TensorDict) -> ClientState:
        shared, personal = self.split(initial)
        return {Slot.PERSONAL: personal, "dyn_grad": {n: torch.zeros_like(v) for n, v in shared.items()}}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        start = {**state[Slot.PERSONAL], **payload}
        result = client.train(start, extra_loss=self._dynamic_penalty(state["dyn_grad"], payload))
        shared, personal = self.split(result.params)
        alpha = self.params.alpha
        grad = {n: g - alpha * (shared[n] - payload[n].to(g.device)) for n, g in state["dyn_grad"].items()}
        return LocalResult({**state, Slot.PERSONAL: personal, "dyn_grad": grad}, {Slot.SHARED: shared}, result.loss)

    def _dynamic_penalty(self, grad: TensorDict, anchor: TensorDict) -> TensorPenalty:
        inputs = {"grad": grad, "anchor": {n: anchor[n] for n in grad}}
        return TensorPenalty(_dynamic_term, inputs, (self.params.alpha,))

    def init_server(self, initial_shared: TensorDict) -> ServerState:
        return {Slot.GLOBAL: initial_shared, "h": {n: torch.zeros_like(v) for n, v in initial_shared.items()}}

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        alpha, current = self.params.alpha, server[Slot.GLOBAL]
        sums: TensorDict = {}
        counts: dict[str, int] = {}
        for upload in sorted(uploads, key=lambda u: u.client_id):
            for name, value in upload.tensors.get(Slot.SHARED, {}).items():
                sums[name] = sums[name] + value if name in sums else value.clone()
                counts[name] = counts.get(name, 0) + 1
        h = dict(server["h"])
        new_global = dict(current)
        for name, total in sums.items():
            h[name] = h[name] - (alpha / self.num_clients) * (total - counts[name] * current[name])
            new_global[name] = total / counts[name] - h[name] / alpha
        return {**server, Slot.GLOBAL: new_global, "h": h}

    def payload(self, server: ServerState, client_id: int) -> TensorDict | None:
        return server[Slot.GLOBAL]


def _dynamic_term(params: dict[str, torch.Tensor], inputs: dict[str, TensorDict], alpha: float) -> torch.Tensor:
    """``-<g_m, w> + alpha/2 ||w - w_t||^2`` over the tensors with a gradient state."""
    return sum(-(g * params[n]).sum() + 0.5 * alpha * ((params[n] - inputs["anchor"][n]) ** 2).sum()
               for n, g in inputs["grad"].items())
