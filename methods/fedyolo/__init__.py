"""FedYolo and the scale & modularity study of *Augmenting Federated Learning with Pretrained Transformers*
(arXiv 2307.04905; docs/fedyolo.md): the method (:mod:`~rayfed.methods.fedyolo.method`), the part-texture data
source ``parts`` (:mod:`~rayfed.methods.fedyolo.parts`), the ViT ladder of the offline scale study
(:mod:`~rayfed.methods.fedyolo.ladder`, zoo families ``vit-ladder-<size>``). The paper's configs and tables are
written by the repository's ``benchmarks/papers/fedyolo_configs.py`` and ``fedyolo_tables.py``."""

from rayfed.methods.fedyolo import ladder, parts  # noqa: F401  (register the data source and the zoo families)
from rayfed.methods.fedyolo.method import FedYolo, FedYoloParams

__all__ = ["FedYolo", "FedYoloParams"]
