"""FedProx (Li et al., 2020): FedAvg with a proximal term mu/2 ||w - w_global||^2 in local training."""

from __future__ import annotations

from dataclasses import dataclass

from rayfed.method import Method, TensorDict
from rayfed.registry import register_method
from rayfed.training import Penalty, proximal_penalty


@dataclass(frozen=True)
class FedProxParams:
    mu: float = 0.01

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ValueError("mu must be >= 0")


@register_method("fedprox")
class FedProx(Method):
    Params = FedProxParams

    def local_penalty(self, payload: TensorDict | None) -> Penalty | None:
        return proximal_penalty(payload, self.params.mu)
