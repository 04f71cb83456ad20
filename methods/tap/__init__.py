"""TAP (*TAP: Two-Stage Adaptive Personalization of Multi-Task and Multi-Modal Foundation Models in Federated
Learning*, arXiv 2509.26524; docs/tap.md): the method ``tap``, its modular MoTE/MoME client model ``mome``, the
data source ``tap:`` (the paper's tables: the repository's ``benchmarks/papers/tap_tables.py``). Importing the package
registers all three plug-ins."""

from rayfed.methods.tap.data import TAP_DATASETS, tap_columns, tap_dataset
from rayfed.methods.tap.method import TAP, Distillation, LossHistory, TAPParams, kd_weight_vector
from rayfed.methods.tap.model import MoMEModel, build_mome_model, mome_client_model, task_outputs
from rayfed.methods.tap.options import MOVED_TO_CLIENT_MODEL, TASK_KEYS, MoMEOptions, task_key

__all__ = ["MOVED_TO_CLIENT_MODEL", "TAP", "TAPParams", "TAP_DATASETS", "TASK_KEYS", "Distillation", "LossHistory",
           "MoMEModel", "MoMEOptions", "build_mome_model", "kd_weight_vector", "mome_client_model", "tap_columns",
           "tap_dataset", "task_key", "task_outputs"]
