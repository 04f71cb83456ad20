"""The registered PFL methods, by config name. One module per method."""

from rayfed.method import Method
from rayfed.methods.clip_zeroshot import ClipZeroShot
from rayfed.methods.ditto import Ditto
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.feddyn import FedDyn
from rayfed.methods.fedprox import FedProx
from rayfed.methods.fedyolo import FedYolo
from rayfed.methods.local import Local
from rayfed.methods.pfedmma import PFedMMA
from rayfed.methods.promptfl import PromptFL

METHODS: dict[str, type[Method]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "ditto": Ditto,
    "clip_zeroshot": ClipZeroShot,
    "promptfl": PromptFL,
    "pfedmma": PFedMMA,
    "feddyn": FedDyn,
    "fedyolo": FedYolo,
}

__all__ = [
    "METHODS", "ClipZeroShot", "Ditto", "FedAvg", "FedDyn", "FedProx", "FedYolo", "Local", "PFedMMA", "PromptFL",
]
