"""FedDAT, *FedDAT: An Approach for Foundation Model Finetuning in Multi-Modal Heterogeneous Federated Learning*
(arXiv 2308.12305; docs/feddat.md): the method (:mod:`~rayfed.methods.feddat.method`) and its tables
(:mod:`~rayfed.methods.feddat.tables`)."""

from rayfed.methods.feddat.method import FedDAT, FedDATParams

__all__ = ["FedDAT", "FedDATParams"]
