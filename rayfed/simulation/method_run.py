"""One method of a run on actors that have started it: its states from its last checkpoint (or its stages before
round 1), then its rounds, each logged, evaluated and checkpointed as the config asks, then its final stages and
evaluation, written to its results file. :class:`~rayfed.simulation.run.Simulation` runs one for each method (again
from the last checkpoint after an actor died).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rayfed.config import RunConfig
from rayfed.data.clients import Federation
from rayfed.io import atomic_write_json
from rayfed.method import Method
from rayfed.results.checkpoint import load_checkpoint, save_checkpoint
from rayfed.simulation.actors import RunActors
from rayfed.simulation.nonfinite import NonfiniteCheck
from rayfed.simulation.ray_setup import ObjectStoreCheck
from rayfed.simulation.results import MetricsLog, mean_std, method_results
from rayfed.simulation.rounds import run_round
from rayfed.stages import PreFederationStage, declared


@dataclass
class MethodRun:
    """The method ``config.methods[method_index]`` on ``run_actors``, logged to ``log``; ``after_round`` is called
    with its label and the rounds done after every round."""

    config: RunConfig
    method_index: int
    method: Method
    run_actors: RunActors
    federation: Federation
    num_train: dict[int, int]
    log: MetricsLog
    nonfinite: NonfiniteCheck
    object_store_check: ObjectStoreCheck
    results_dir: Path
    checkpoint_dir: Path
    after_round: Callable[[str, int], None]
    progress: bool = True

    def run(self) -> None:
        """The method from its last checkpoint (or its start) to its results file."""
        start_round, counters = self.restore()
        self.rounds(start_round, counters)

    def restore(self) -> tuple[int, dict[str, float]]:
        """Every state from the method's last checkpoint; without one, a fresh start through the method's
        stages before round 1 (a checkpoint at round 0 keeps a resumed run from running them again)."""
        label = self.config.methods[self.method_index].label
        checkpoint = load_checkpoint(self.checkpoint_dir, label, self.config.to_dict())
        if checkpoint is None:
            self.log.restart_method(label, 0)
            counters = {"up_bytes": 0, "down_bytes": 0, "up_params": 0, "down_params": 0, "wall_time_s": 0.0}
            self.run_actors.before_federation(self.method_index)
            if declared(self.method, PreFederationStage) and self.config.federation.checkpoint_every:
                self.checkpoint(label, 0, counters)
            return 0, counters
        self.run_actors.set_states(checkpoint)
        self.log.restart_method(label, checkpoint.round)
        return checkpoint.round, dict(checkpoint.meta["counters"])

    def rounds(self, start_round: int, counters: dict[str, float]) -> None:
        """The method's rounds from ``start_round``: each logged, evaluated and checkpointed as the config asks."""
        federation, entry = self.config.federation, self.config.methods[self.method_index]
        bar = tqdm(total=federation.rounds, initial=start_round, desc=entry.label, unit="round",
                   disable=not self.progress, dynamic_ncols=True)
        if start_round == 0 and federation.eval_round_zero:
            self.evaluate(entry.label, 0)
        for round_idx in range(start_round, federation.rounds):
            started = time.perf_counter()
            done = run_round(self.run_actors, self.method_index, round_idx, self.num_train)
            stats, rounds_done = done.stats, round_idx + 1
            if "nonfinite" in stats:
                self.nonfinite(entry.label, f"in round {rounds_done}", stats["nonfinite"])
            wall = time.perf_counter() - started
            self.object_store_check(entry.label, rounds_done, stats["store_bytes"], self.run_actors.object_store)
            done.count(counters, wall)
            self.log.append(done.event(entry.label, rounds_done, wall))
            postfix = {"loss": "-" if stats["train_loss"] is None else f"{stats['train_loss']:.3f}"}
            if rounds_done % federation.eval_every == 0 and rounds_done < federation.rounds:
                _, _, means = self.evaluate(entry.label, rounds_done)
                postfix.update({k: f"{v:.3f}" for k, v in means.items() if k.endswith("acc")})
            if federation.checkpoint_every and rounds_done % federation.checkpoint_every == 0:
                self.checkpoint(entry.label, rounds_done, counters)
            bar.set_postfix(postfix)
            bar.update(1)
            self.after_round(entry.label, rounds_done)
        final = self.finish(counters)
        bar.set_postfix({k: f"{v:.3f}" for k, v in final.items() if k.endswith("acc")})
        bar.close()

    def evaluate(self, label: str, rounds_done: int, post_train_steps: int | None = None
                 ) -> tuple[dict[int, dict[str, float]], dict[str, Any], dict[str, float]]:
        """Every client's metrics after ``rounds_done`` rounds, logged (with ``post_train_steps``: the final ones,
        after the method's final stages): the clients' metrics, what of them is non-finite, and their means."""
        final = post_train_steps is not None
        clients = self.run_actors.client_metrics(rounds_done, post_train_steps)
        when = f"at the {'final ' if final else ''}evaluation after round {rounds_done}"
        nonfinite = self.nonfinite.in_metrics(label, when, clients)
        means, _ = mean_std(clients)
        self.log.append({"event": "eval", "method": label, "round": rounds_done, **({"final": True} if final else {}),
                         **means, **nonfinite, "clients": {str(c): m for c, m in clients.items()}})
        return clients, nonfinite, means

    def finish(self, counters: dict[str, float]) -> dict[str, float]:
        """The method's final stages and evaluation, logged and written to its results file; the means."""
        entry = self.config.methods[self.method_index]
        clients, nonfinite, means = self.evaluate(entry.label, self.config.federation.rounds, entry.post_train_steps)
        atomic_write_json(self.results_dir / f"{entry.label}.json", method_results(
            self.config, self.federation, entry.label, clients, nonfinite, self.log.events, counters))
        return means

    def checkpoint(self, label: str, rounds_done: int, counters: dict[str, float]) -> None:
        """Every state after ``rounds_done`` rounds, with the method's running ``counters``."""
        clients, server = self.run_actors.states()
        save_checkpoint(self.checkpoint_dir, label, rounds_done, server, clients,
                        {"counters": counters, "config": self.config.to_dict(), "method": label})
