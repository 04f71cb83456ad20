"""pFedMMA (*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for Vision-Language Models*;
docs/pfedmma.md): the method, its multi-modal adapter, and the base-to-novel split (partitioner ``base_novel``).

Importing the package registers the method ``pfedmma`` and the partitioner ``base_novel``.
"""

from rayfed.methods.pfedmma.adapter import MultiModalAdapter
from rayfed.methods.pfedmma.base_novel import BaseNovelOptions, base_novel_split
from rayfed.methods.pfedmma.method import PFedMMA, PFedMMAParams

__all__ = ["BaseNovelOptions", "MultiModalAdapter", "PFedMMA", "PFedMMAParams", "base_novel_split"]
