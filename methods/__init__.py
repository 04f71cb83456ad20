"""The built-in PFL methods, one module each; each registers itself by name (``rayfed.register_method``).

Importing this package registers them all; configs name them (``methods: [fedavg, ditto]``) and the
engine finds them through :mod:`rayfed.registry`, never by importing a method itself. A method of one's own
may start from a built-in one: ``from rayfed.methods import Ditto, DittoParams`` and subclass it.
"""

from rayfed.methods.clip_zeroshot import ClipZeroShot
from rayfed.methods.disentafl import DisentAFL, DisentAFLParams
from rayfed.methods.ditto import Ditto, DittoParams
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.feddat import FedDAT, FedDATParams
from rayfed.methods.feddat_lora import FedDATLora, FedDATLoraParams
from rayfed.methods.feddpa import FedDPA, FedDPAParams
from rayfed.methods.feddyn import FedDyn, FedDynParams
from rayfed.methods.fedmkt import FedMKT, FedMKTParams
from rayfed.methods.fedmosaic import FedMosaic, FedMosaicParams
from rayfed.methods.fedprox import FedProx, FedProxParams
from rayfed.methods.fedsim import FedSim, FedSimParams
from rayfed.methods.fedyolo import FedYolo, FedYoloParams
from rayfed.methods.local import Local
from rayfed.methods.perada import PerAda, PerAdaParams
from rayfed.methods.perfedavg import PerFedAvg, PerFedAvgParams
from rayfed.methods.pfedmma import PFedMMA, PFedMMAParams
from rayfed.methods.promptfl import PromptFL, PromptFLParams
from rayfed.methods.takfl import TAKFL, TAKFLParams
from rayfed.methods.tap import TAP, TAPParams

__all__ = [
    "ClipZeroShot", "DisentAFL", "DisentAFLParams", "Ditto", "DittoParams", "FedAvg", "FedDAT", "FedDATParams",
    "FedDATLora", "FedDATLoraParams", "FedDPA", "FedDPAParams", "FedDyn", "FedDynParams", "FedMKT", "FedMKTParams", "FedMosaic",
    "FedMosaicParams", "FedProx", "FedProxParams", "FedSim", "FedSimParams", "FedYolo", "FedYoloParams", "Local",
    "PerAda", "PerAdaParams", "PerFedAvg", "PerFedAvgParams", "PFedMMA", "PFedMMAParams", "PromptFL", "PromptFLParams", "TAKFL", "TAKFLParams", "TAP", "TAPParams",
]
