"""FedMosaic (*Not All Clients Are Equal: Collaborative Model Personalization on Heterogeneous Multi-Modal Clients*;
docs/fedmosaic.md): the method, RELA, PQ-LoRA with its gate, the ``task-groups:`` data source of the offline
benchmark, the preparers of DRAKE and HFLB, and the scripts that write its configs and tables. Importing the package
registers ``fedmosaic``, ``task-groups:`` and the benchmarks ``drake`` and ``hflb`` (``rayfed prepare``)."""

from rayfed.methods.fedmosaic import prepare, task_groups
from rayfed.methods.fedmosaic.method import FedMosaic, FedMosaicParams
from rayfed.methods.fedmosaic.rela import linear_weight_gradient, relevance_weights

__all__ = ["FedMosaic", "FedMosaicParams", "linear_weight_gradient", "prepare", "relevance_weights", "task_groups"]
