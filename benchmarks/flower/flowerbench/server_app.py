"""flowerbench ServerApp: FedAvg over the trainable parameters, as Flower's examples write it.

The global model's initial arrays come from a model built here (as quickstart-pytorch's `Net()`);
only the trainable part travels, as flowertune-llm sends only its PEFT state. FedAvg samples
`clients_per_round` of the `num_clients` nodes per round (Flower's own sampler) and runs no
federated evaluation (`fraction_evaluate=0`), like `rayfed bench`. The `evaluate_fn` hook, which
Flower calls before the first round and after each round, timestamps the rounds.
"""

from __future__ import annotations

import json
import os
import time

from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from flowerbench.task import get_model, get_workload

PROGRESS_ENV = "FLOWERBENCH_PROGRESS"  # optional JSON-lines file: one line per finished round
MEMORY_KEYS = ("gpu-peak-bytes", "rss-bytes")

ROUND_MARKS: list[float] = []  # time.perf_counter() at each evaluate_fn call; [0] is before round 1
TRAIN_METRICS: dict[int, dict] = {}  # round -> aggregated train metrics


def aggregate_train_metrics(records: list[RecordDict], weighting_metric_name: str) -> MetricRecord:
    """Flower's weighted average for the loss; the largest value for the memory readings."""
    aggregated = aggregate_metricrecords(records, weighting_metric_name)
    for key in MEMORY_KEYS:
        aggregated[key] = max(int(next(iter(r.metric_records.values()))[key]) for r in records)
    return aggregated


def mark_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
    """Centralized-evaluation hook: record when the round ended (no evaluation is done)."""
    ROUND_MARKS.append(time.perf_counter())
    progress = os.environ.get(PROGRESS_ENV)
    if progress and server_round > 0:
        with open(progress, "a") as stream:
            stream.write(json.dumps({"round": server_round, "wall_s": ROUND_MARKS[-1] - ROUND_MARKS[-2]}) + "\n")
    return None


# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    workload = get_workload()

    # Initial global model (its trainable part)
    arrays = ArrayRecord(get_model().trainable_params())

    # FedAvg: `clients_per_round` nodes per round, no federated evaluation
    strategy = FedAvg(
        fraction_train=workload.clients_per_round / workload.num_clients,
        fraction_evaluate=0.0,
        min_train_nodes=workload.clients_per_round,
        min_available_nodes=workload.num_clients,
        train_metrics_aggr_fn=aggregate_train_metrics,
    )

    # Start strategy, run FedAvg for `rounds` rounds
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=workload.rounds, evaluate_fn=mark_round)
    TRAIN_METRICS.update({rnd: dict(metrics) for rnd, metrics in result.train_metrics_clientapp.items()})
