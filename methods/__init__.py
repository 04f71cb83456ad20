"""The registered PFL methods, by config name. One module per method."""

from rayfed.method import Method
from rayfed.methods.ditto import Ditto
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.fedprox import FedProx
from rayfed.methods.local import Local

METHODS: dict[str, type[Method]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "ditto": Ditto,
}

__all__ = ["METHODS", "Ditto", "FedAvg", "FedProx", "Local"]
