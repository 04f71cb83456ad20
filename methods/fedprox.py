"""FedProx (Li et al., 2020): FedAvg with a proximal term mu/2 ||w - w_global||^2 in local training."""

from __future__ import annotations

from rayfed.method import Method, TensorDict
from rayfed.params import NonNegative, hyperparameters
from rayfed.registry import register_method
from rayfed.training import Penalty, proximal_penalty


@hyperparameters
class FedProxParams:
    mu: NonNegative = 0.01


@register_method("fedprox")
class FedProx(Method):
    Params = FedProxParams

    def local_penalty(self, payload: TensorDict | None) -> Penalty | None:
        return proximal_penalty(payload, self.params.mu)
