"""The methods of a run, built once from its config (the method API's side of a run's set-up)."""

from __future__ import annotations

from rayfed.architectures import architecture_of
from rayfed.config import RunConfig
from rayfed.data.clients import Federation
from rayfed.method import Method, build_method


def run_methods(config: RunConfig, federation: Federation) -> list[Method]:
    """Every method of the run, built once from its config entry: in the driver process, on an actor not handed the
    driver's, and in process (tests, benchmarks)."""
    return [build_method(entry, index, num_clients=federation.num_clients, tasks=federation.tasks,
                         rounds=config.federation.rounds, architecture_of=architecture_of(config))
            for index, entry in enumerate(config.methods)]
