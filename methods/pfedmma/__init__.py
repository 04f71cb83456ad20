"""pFedMMA (*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for Vision-Language Models*;
docs/pfedmma.md): the method, its multi-modal adapter, the base-to-novel split (partitioner ``base_novel``) and the
preparers of DomainNet and Office-Caltech10 (:mod:`~rayfed.methods.pfedmma.prepare`).

Importing the package registers the method ``pfedmma``, the partitioner ``base_novel`` and the benchmarks
``domainnet`` and ``office-caltech10`` (``rayfed prepare``).
"""

from rayfed.methods.pfedmma import prepare
from rayfed.methods.pfedmma.adapter import MultiModalAdapter
from rayfed.methods.pfedmma.base_novel import BaseNovelOptions, base_novel_split
from rayfed.methods.pfedmma.method import PFedMMA, PFedMMAParams

__all__ = ["BaseNovelOptions", "MultiModalAdapter", "PFedMMA", "PFedMMAParams", "base_novel_split", "prepare"]
