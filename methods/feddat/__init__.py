"""FedDAT, *FedDAT: An Approach for Foundation Model Finetuning in Multi-Modal Heterogeneous Federated Learning*
(arXiv 2308.12305; docs/feddat.md): the method (:mod:`~rayfed.methods.feddat.method`) and the preparers of its
data (:mod:`~rayfed.methods.feddat.prepare`: ``rayfed prepare feddat-domain``, ``clove``); its tables are the
repository's ``benchmarks/papers/feddat_tables.py``."""

from rayfed.methods.feddat import prepare
from rayfed.methods.feddat.method import FedDAT, FedDATParams

__all__ = ["FedDAT", "FedDATParams", "prepare"]
