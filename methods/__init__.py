"""The registered PFL methods, by config name. One module per method."""

from rayfed.method import Method
from rayfed.methods.ditto import Ditto
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.feddyn import FedDyn
from rayfed.methods.fedprox import FedProx
from rayfed.methods.fedyolo import FedYolo
from rayfed.methods.local import Local

METHODS: dict[str, type[Method]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "ditto": Ditto,
    "feddyn": FedDyn,
    "fedyolo": FedYolo,
}

__all__ = ["METHODS", "Ditto", "FedAvg", "FedDyn", "FedProx", "FedYolo", "Local"]
