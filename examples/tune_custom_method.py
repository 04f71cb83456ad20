"""A Ray Tune sweep over the hyperparameter of a method defined in your own code (FedAvgM's momentum,
from ``custom_method.py`` next to this script).

    python examples/tune_custom_method.py [key.sub=value ...]

Every trial is a whole simulation; ``tune.space`` names the method's hyperparameter by its place in
``methods``. The sweep writes its table, plot and the best trial's config under runs/<name>/tune.
"""

from __future__ import annotations

import sys

from custom_method import CONFIG as METHOD_CONFIG  # registers "fedavgm"

from rayfed.tune import tune

CONFIG = {
    **METHOD_CONFIG,
    "name": "tune_custom_method",
    "methods": [{"name": "fedavgm", "momentum": 0.5}],
    "tune": {"metric": "fedavgm/local_acc", "mode": "max", "search": "grid",
             "space": {"methods.0.momentum": {"grid": [0.0, 0.5, 0.9]}}},
}

if __name__ == "__main__":
    result = tune(CONFIG, overrides=sys.argv[1:], verbose=0)
    for trial in result.trials:
        print(f"momentum = {trial.params['methods.0.momentum']}: local_acc = {trial.metric:.4f} ({trial.status})")
    print(f"best: {result.best.params} -> {result.best_config}")
