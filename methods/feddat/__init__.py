"""FedDAT, *FedDAT: An Approach for Foundation Model Finetuning in Multi-Modal Heterogeneous Federated Learning*
(arXiv 2308.12305; docs/feddat.md): the method (:mod:`~rayfed.methods.feddat.method`), its tables
(:mod:`~rayfed.methods.feddat.tables`) and the preparers of its data (:mod:`~rayfed.methods.feddat.prepare`:
``rayfed prepare feddat-domain``, ``clove``)."""

from rayfed.methods.feddat import prepare
from rayfed.methods.feddat.method import FedDAT, FedDATParams

__all__ = ["FedDAT", "FedDATParams", "prepare"]
