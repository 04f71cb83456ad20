"""The round loop: sample clients, send work to the actors hosting them, aggregate, evaluate,
log, checkpoint. Runs in the user's process (driver script or CLI).

Only ObjectRefs of payloads and uploads pass through this process; client data is loaded by
the actors that host the clients.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import ray
import torch
from ray import cloudpickle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm.auto import tqdm

from rayfed import registry
from rayfed.actors.client import ClientActor, run_methods
from rayfed.actors.driver import DriverActor
from rayfed.checkpoint import load_checkpoint, save_checkpoint
from rayfed.compute import matched_steps
from rayfed.architectures import ActorSlot, actor_slots, architecture_names, architecture_of
from rayfed.config import (RunConfig, architecture_model_config, dump_config, load_config, method_model_config,
                           with_full_params)
from rayfed.data.clients import Federation, build_federation
from rayfed.errors import ConfigError
from rayfed.executors import LocalExecutor, RayExecutor
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.method import NonFiniteError
from rayfed.metrics import with_derived
from rayfed.models import build_backbone
from rayfed.modules import select_task
from rayfed.streams import area_under_curve
from rayfed.system import plan_round
from rayfed.tasks import Task, client_tasks, sample_round
from rayfed.version import __version__

RoundCallback = Callable[["Simulation", str, int], None]
"""Called as ``callback(simulation, method_label, rounds_done)`` after every round."""

COUNT_KEYS = ("num_train", "num_test")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per event; rewritten atomically when a restart drops events."""

    def __init__(self, path: Path, events: list[dict[str, Any]] | None = None):
        self.path = path
        self.events = events or []
        if events is not None:
            self._rewrite()

    @classmethod
    def read(cls, path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def append(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        with self.path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")

    def restart_method(self, label: str, from_round: int) -> None:
        """Forget ``label``'s events after ``from_round`` (they will be produced again)."""
        self.events = [
            e for e in self.events
            if e["method"] != label or (e["round"] <= from_round and not e.get("final"))
        ]
        self._rewrite()

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(e) + "\n" for e in self.events))


class Simulation:
    """One run: every configured method on the same clients, partitions and seed.

    >>> summary = rayfed.Simulation("configs/quickstart.yaml").run()
    """

    def __init__(
        self,
        config: RunConfig | dict | str | os.PathLike,
        *,
        overrides: list[str] | None = None,
        out_dir: str | os.PathLike | None = None,
        callbacks: list[RoundCallback] | None = None,
        progress: bool = True,
        check_model: bool = True,
    ):
        """``check_model=False`` skips building and running every method's model in this process before the
        actors start (:meth:`_check_model`), for a caller that has just done so (``rayfed bench``)."""
        self.config = load_config(config, overrides)
        import_plugin_modules(self.config)
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.check_model = check_model
        self.run_dir = _fresh_run_dir(self.config.name, out_dir)
        self._resuming = False
        self.actors: list[Any] = []
        self.driver: Any = None

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, **kwargs: Any) -> Simulation:
        """Continue the run in ``run_dir`` from its checkpoints; ends with the uninterrupted run's numbers."""
        run_dir = Path(run_dir)
        config_path = run_dir / "config.yaml"
        if not config_path.is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: no config.yaml there, so it is not a rayfed run directory.")
        sim = cls.__new__(cls)
        sim.config = load_config(config_path)
        import_plugin_modules(sim.config)
        sim.callbacks = list(kwargs.get("callbacks") or [])
        sim.progress = kwargs.get("progress", True)
        sim.check_model = kwargs.get("check_model", True)
        sim.run_dir = run_dir
        sim._resuming = True
        sim.actors, sim.driver = [], None
        return sim

    # Public API ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run every method, write the results contract into ``run_dir``, return the summary."""
        started = time.perf_counter()
        self._build_run()
        if self.check_model:
            self._check_model()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(self.config, self.run_dir / "config.yaml")
        previous = MetricsLog.read(self.run_dir / "metrics.jsonl") if self._resuming else []
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", previous)
        self._warned_nonfinite: set[str] = set()
        owns_ray = self._start_executor()
        try:
            self.compute_match = self._match_compute()
            for index, entry in enumerate(self.config.methods):
                if self._resuming and (self._results_dir / f"{entry.label}.json").is_file():
                    continue
                self._run_method(index)
        finally:
            self._stop_actors()
            if owns_ray:
                ray.shutdown()
        summary = self._summary(time.perf_counter() - started)
        atomic_write_json(self.run_dir / "summary.json", summary)
        from rayfed.report import write_report

        write_report(self.run_dir, summary, self.log.events)
        return summary

    def compute_costs(self) -> dict[str, dict[str, float]]:
        """``train.compute_match``'s measurement alone (nothing is trained past it, nothing written): per method
        label its local update's ``flops``, ``cost_ratio`` to the reference and ``local_steps``."""
        if self.config.train.compute_match is None:
            raise ConfigError("train.compute_match is not set, so there is no reference to measure costs against; "
                              "set train.compute_match.reference to a method label.")
        self._build_run()
        owns_ray = self._start_executor()
        try:
            return self._match_compute()
        finally:
            if owns_ray:
                ray.shutdown()

    def data_summary(self, png: str | os.PathLike | None = None) -> dict[str, Any]:
        """Each client's train / test sample counts and histogram over labels (or tasks), from the data config
        alone (no Ray, no model); with ``png``, also a stacked bar per client saved there."""
        from rayfed.data.summary import data_summary, plot_summary

        summary = data_summary(build_federation(self.config.data, self.config.seed))
        if png is not None:
            plot_summary(summary, png)
        return summary

    # Setup ------------------------------------------------------------------------------
    @property
    def _results_dir(self) -> Path:
        return self.run_dir / "results"

    @property
    def _checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def _build_run(self) -> None:
        """The clients' data and the methods, built once here; the config records every hyperparameter."""
        self.federation = build_federation(self.config.data, self.config.seed)
        self._federation_ref = None
        self.num_train = {cid: self.federation.sizes(cid)["num_train"] for cid in range(self.federation.num_clients)}
        self.methods = run_methods(self.config, self.federation)
        self.config = with_full_params(self.config, [method.params for method in self.methods])

    def _start_executor(self) -> bool:
        """The executor and the actor slots (fitted to the Ray cluster); whether this run started Ray."""
        local = self.config.placement.executor == "local"
        self.executor = LocalExecutor() if local else RayExecutor()
        owns_ray = not local and init_ray(self.config)
        self.slots = actor_slots(self.config)
        if not local:
            try:
                self._check_resources()
            except Exception:
                if owns_ray:
                    ray.shutdown()
                raise
        return owns_ray

    def _check_model(self) -> None:
        """Fail here, with one sentence, rather than inside an actor: build every architecture's backbone and
        every method's model once and run it, and its task's loss, on two samples of every task it holds."""
        held = {holding.task for holding in self.federation.holdings}
        unheld = sorted({e.task for e in self.federation.shared} - held)
        of = architecture_of(self.config)
        for name in architecture_names(self.config):
            model_config = architecture_model_config(self.config, name)
            backbone = build_backbone(model_config, 0)
            if name:
                backbone.config_field = f"architectures.{name}.backbone"
            clients = {c for c in range(self.federation.num_clients) if of[c] == name}
            federation = self.federation.restricted_to(clients)
            federation.check(backbone)
            samples = sample_batches(federation, backbone)
            for index, (entry, method) in enumerate(zip(self.config.methods, self.methods)):
                model = method.build_model(
                    backbone, method_model_config(model_config, entry, index), self.federation.tasks, 0
                )
                if unheld and not getattr(model, "scores_unseen_tasks", False):
                    raise ConfigError(
                        f"methods[{index}] ({entry.label}) scores a task with heads trained on clients' data and "
                        f"cannot score task(s) {unheld} that no client holds (data.base_novel's novel classes); use "
                        "a method that classifies by text, such as clip_zeroshot, promptfl or pfedmma."
                    )
                for holding in federation.holdings:
                    self.federation.tasks[holding.task].kind.check_model(model, backbone, holding.where)
                # bf16 weights (a backbone built where a GPU is seen) run here on the CPU, under autocast as on the GPU
                low_precision = any(p.dtype == torch.bfloat16 for p in model.parameters())
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
                    for task, batch in samples:
                        select_task(model, task.index)
                        task.kind.loss(model(batch), batch)

    def _check_resources(self) -> None:
        """Whether the ClientActors fit the Ray cluster (or the Tune trial's placement group); outside a trial,
        ``self.slots`` become the actors as fitted to the cluster (see :func:`actor_slots`)."""
        placement = self.config.placement
        slots = actor_slots(self.config)
        group = ray.util.get_current_placement_group()
        if group is not None:  # a Ray Tune trial: the actors must fit the bundles _placed puts them in
            bundles = group.bundle_specs
            needs = [{"CPU": placement.driver_cpus}] + [{"CPU": slot.cpus, "GPU": slot.gpus} for slot in slots]
            if len(bundles) < len(needs):
                raise ConfigError(
                    f"placement: the DriverActor and {len(slots)} ClientActors need {len(needs)} bundles but the "
                    f"trial's placement group has {len(bundles)}; size it with rayfed.tune.trial_resources(config)."
                )
            for index, (need, have) in enumerate(zip(needs, bundles)):
                if any(amount > have.get(resource, 0.0) + 1e-9 for resource, amount in need.items()):
                    actor = "the DriverActor" if index == 0 else f"ClientActor {index - 1}"
                    raise ConfigError(
                        f"placement: {actor} needs {need} but bundle {index} of the trial's placement group holds "
                        f"{have}; size the group with rayfed.tune.trial_resources(config)."
                    )
            return
        available = ray.cluster_resources()
        self.slots = slots = actor_slots(self.config, available.get("CPU", 0.0) - placement.driver_cpus)
        for resource, extra in (("CPU", placement.driver_cpus), ("GPU", 0.0)):
            per_actor = [slot.cpus if resource == "CPU" else slot.gpus for slot in slots]
            needed = sum(per_actor) + extra
            if needed > available.get(resource, 0.0) + 1e-9:
                each = f"{per_actor[0]:g}" if len(set(per_actor)) == 1 else "their"
                raise ConfigError(
                    f"placement: {len(slots)} ClientActors x {each} {resource} (+ {extra:g} for the driver) "
                    f"need {needed:g} {resource} but the Ray cluster has {available.get(resource, 0.0):g}; "
                    "raise placement.clients_per_actor or lower placement."
                    f"{'cpus' if resource == 'CPU' else 'gpus'}_per_actor."
                )

    def _start_actors(self) -> None:
        """One actor per ``clients_per_actor`` clients of one architecture, in client-id order; each builds its
        architecture's backbone once.

        Every actor gets the run as the driver resolved it: the config, the methods and the federation (the
        clients' data) built once here, and the plug-ins this process registered (shipped by value when they are
        the user's own code)."""
        placement, executor = self.config.placement, self.executor
        plugins = registry.user_entries()
        if not executor.local:
            ship_by_value([self.config, *self.methods, *(entry.obj for entry in plugins)])
        config, methods = executor.put(self.config), executor.put(self.methods)
        if self._federation_ref is None:  # once per run: actors started again after a failure share it
            self._federation_ref = executor.put(self.federation)
            self.federation = executor.get(self._federation_ref)  # on Ray: views of the object store's copy
        federation = self._federation_ref
        self.actors, self.host_of = [], {}
        for actor_index, slot in enumerate(self.slots):
            options = _placed({"num_cpus": slot.cpus, "num_gpus": slot.gpus, "scheduling_strategy": placement.strategy},
                              bundle_index=actor_index + 1)
            self.actors.append(executor.actor(ClientActor, options, config, slot.client_ids, methods, plugins,
                                              slot.architecture, federation))
            self.host_of.update({cid: actor_index for cid in slot.client_ids})
        options = _placed({"num_cpus": placement.driver_cpus}, bundle_index=0)
        self.driver = executor.actor(DriverActor, options, config, methods, plugins)

    def _start_method(self, method_index: int, local_steps: int | None = None) -> None:
        """Fresh client state on every actor and the method's initial server state on the DriverActor: one
        initial state per architecture, from its first actor. ``local_steps``: the method's (compute matching)."""
        if not self.actors:
            self._start_actors()
        initial = [actor.start_method.remote(method_index, local_steps) for actor in self.actors]
        first = {}
        for actor_index, slot in enumerate(self.slots):
            first.setdefault(slot.architecture, actor_index)
        names = list(first)
        tags = [self.actors[first[name]].task_tags.remote() for name in names]
        start = self.driver.start_method.remote(method_index, names, *(initial[first[n]] for n in names), *tags)
        self.executor.get([*initial, start])

    def _match_compute(self) -> dict[str, dict[str, float]]:
        """``train.compute_match``: per method label its local update's FLOPs, cost ratio to the reference and local
        steps (:mod:`rayfed.compute`), from each method's round-1 update of the measured client with
        ``train.local_steps`` steps, on actors started for the measurement alone; ``{}`` without the option."""
        match, train = self.config.train.compute_match, self.config.train
        if match is None:
            return {}
        flops = {}
        try:
            for index, entry in enumerate(self.config.methods):
                self._start_method(index)
                self._before_federation(index)
                payloads = self.driver.payloads.remote([match.client])
                flops[entry.label] = self.executor.get(
                    self.actors[self.host_of[match.client]].local_update_flops.remote(match.client, payloads))
        finally:
            self._stop_actors()
        return matched_steps(flops, match.reference, train.local_steps)

    def _stop_actors(self) -> None:
        for actor in [*self.actors, self.driver]:
            if actor is not None:
                self.executor.kill(actor)
        self.actors, self.driver = [], None

    # The round loop ---------------------------------------------------------------------
    def _run_method(self, method_index: int) -> None:
        entry = self.config.methods[method_index]
        local_steps = self.compute_match[entry.label]["local_steps"] if self.compute_match else None
        failures = 0
        while True:
            try:
                self._start_method(method_index, local_steps)
                start_round, counters = self._restore(method_index)
                self._rounds(method_index, start_round, counters)
                return
            except Exception as err:  # noqa: BLE001 - only actor/node deaths are retried
                if not _is_actor_failure(err):
                    raise _unwrap(err) from None
                failures += 1
                self._stop_actors()
                if failures > self.config.federation.max_failures:
                    raise RuntimeError(
                        f"method {entry.label!r}: {failures} actor failures, more than "
                        f"federation.max_failures = {self.config.federation.max_failures}; last: {err}"
                    ) from err
                tqdm.write(f"[rayfed] {entry.label}: an actor died ({type(err).__name__}); restoring from the last checkpoint")

    def _restore(self, method_index: int) -> tuple[int, dict[str, float]]:
        """Every state from the method's last checkpoint; without one, a fresh start through the method's
        stages before round 1 (a checkpoint at round 0 keeps a resumed run from running them again)."""
        label = self.config.methods[method_index].label
        checkpoint = load_checkpoint(self._checkpoint_dir, label, self.config.to_dict())
        if checkpoint is None:
            self.log.restart_method(label, 0)
            counters = {"up_bytes": 0, "down_bytes": 0, "up_params": 0, "down_params": 0, "wall_time_s": 0.0}
            self._before_federation(method_index)
            if self.methods[method_index].pre_federation_stage and self.config.federation.checkpoint_every:
                self._checkpoint(label, 0, counters)
            return 0, counters
        self.executor.get([actor.set_states.remote(checkpoint.clients) for actor in self.actors]
                          + [self.driver.set_state.remote(checkpoint.server)])
        self.log.restart_method(label, checkpoint.round)
        return checkpoint.round, dict(checkpoint.meta["counters"])

    def _before_federation(self, method_index: int) -> None:
        """The method's pre-federation stage, if it declares one: once per architecture, on that architecture's
        first actor (its model, the public data, the round-0 parameters); then the server-side stage."""
        method = self.methods[method_index]
        first: dict[str, Any] = {}
        if method.pre_federation_stage:
            for actor, slot in zip(self.actors, self.slots):
                first.setdefault(slot.architecture, actor)
        names = list(first)
        prepared = [first[name].pre_federation.remote(method_index) for name in names]
        self.executor.get(self.driver.before_federation.remote(names, *prepared))

    def _rounds(self, method_index: int, start_round: int, counters: dict[str, float]) -> None:
        config, entry = self.config, self.config.methods[method_index]
        federation = config.federation
        bar = tqdm(total=federation.rounds, initial=start_round, desc=entry.label, unit="round",
                   disable=not self.progress, dynamic_ncols=True)
        method = self.methods[method_index]
        if start_round == 0 and federation.eval_round_zero:
            self._evaluate(entry.label, 0)
        for round_idx in range(start_round, federation.rounds):
            started = time.perf_counter()
            sampled = method.participants(round_idx, sample_round(config, round_idx), config.data.num_clients)
            plan = plan_round(config, round_idx, sampled, self.num_train)
            assignment = self._assign(plan.participants)
            guests = {actor: [cid for cid in cids if self.host_of[cid] != actor] for actor, cids in assignment.items()}
            # Calls on one actor run in the order they are made. Every guest's state is asked for before any
            # actor trains, and the guests' new states are handed back only after every actor's round is queued:
            # otherwise one actor's round would queue behind another's.
            states = {cid: self.actors[self.host_of[cid]].client_state.remote(cid)
                      for actor in assignment for cid in guests[actor]}
            upload_refs = []
            for actor_index, client_ids in assignment.items():
                payload_ref = self.driver.payloads.remote(client_ids)
                weight_scale = {cid: plan.weight_scale[cid] for cid in client_ids}
                upload_refs.append(self.actors[actor_index].train_round.remote(
                    round_idx, client_ids, payload_ref, weight_scale, guests[actor_index],
                    *(states[cid] for cid in guests[actor_index])))
            hosts_to_update = []
            for actor_index in assignment:
                if guests[actor_index]:
                    moved = self.actors[actor_index].take_guest_states.remote()
                    hosts_to_update += [self.actors[host].put_states.remote(moved)
                                        for host in sorted({self.host_of[cid] for cid in guests[actor_index]})]
            stats = self.executor.get(self.driver.aggregate.remote(*upload_refs))
            self.executor.get(hosts_to_update)
            if "nonfinite" not in stats:
                self._public_passes(method_index, round_idx)
            rounds_done = round_idx + 1
            if "nonfinite" in stats:
                self._nonfinite(entry.label, f"in round {rounds_done}", stats["nonfinite"])
            wall = time.perf_counter() - started
            counters["up_bytes"] += stats["up_bytes"]
            counters["down_bytes"] += stats["down_bytes"]
            for key in ("up_params", "down_params"):  # absent from checkpoints of older versions
                counters[key] = counters.get(key, 0) + stats[key]
            counters["wall_time_s"] += wall
            self.log.append({"event": "round", "method": entry.label, "round": rounds_done, "clients": sampled,
                             "participants": plan.participants, "dropped": plan.dropped, "late": plan.late,
                             "sim_time": plan.sim_time, **stats, "wall_s": round(wall, 4)})
            postfix = {"loss": "-" if stats["train_loss"] is None else f"{stats['train_loss']:.3f}"}
            if rounds_done % federation.eval_every == 0 and rounds_done < federation.rounds:
                means = self._evaluate(entry.label, rounds_done)
                postfix.update({k: f"{v:.3f}" for k, v in means.items() if k.endswith("acc")})
            if federation.checkpoint_every and rounds_done % federation.checkpoint_every == 0:
                self._checkpoint(entry.label, rounds_done, counters)
            bar.set_postfix(postfix)
            bar.update(1)
            for callback in self.callbacks:
                callback(self, entry.label, rounds_done)
        final = self._finish(method_index, counters)
        bar.set_postfix({k: f"{v:.3f}" for k, v in final.items() if k.endswith("acc")})
        bar.close()

    def _public_passes(self, method_index: int, round_idx: int) -> None:
        """The method's server-side passes on public data after a round's aggregation (``Method.public_passes``):
        each on the first actor of every architecture, with the driver's request for it."""
        first: dict[str, Any] = {}
        for actor, slot in zip(self.actors, self.slots):
            first.setdefault(slot.architecture, actor)
        names = list(first)
        for index in range(self.methods[method_index].public_passes):
            results = [first[name].public_pass.remote(method_index, round_idx, index,
                                                      self.driver.public_request.remote(index, name)) for name in names]
            self.executor.get(self.driver.after_public_pass.remote(index, names, *results))

    def _assign(self, client_ids: list[int]) -> dict[int, list[int]]:
        """Which actor trains which of the round's clients: their hosts, or (``placement.balance_rounds``) the
        actors of each architecture in even shares."""
        if self.config.placement.balance_rounds:
            return balanced_assignment(client_ids, self.slots, self.host_of)
        groups: dict[int, list[int]] = {}
        for cid in client_ids:
            groups.setdefault(self.host_of[cid], []).append(cid)
        return groups

    def _all_client_metrics(self, method: str, round_idx: int, post_train_steps: int | None) -> dict[int, dict]:
        refs = []
        for actor_index, actor in enumerate(self.actors):
            client_ids = [cid for cid, host in self.host_of.items() if host == actor_index]
            payload_ref = self.driver.payloads.remote(client_ids, False)
            if post_train_steps is None:
                refs.append(actor.evaluate.remote(round_idx, payload_ref))
            else:
                refs.append(actor.finish.remote(round_idx, payload_ref, post_train_steps))
        merged: dict[int, dict] = {}
        for part in self.executor.get(refs):
            merged.update(part)
        return {cid: {**merged[cid], **self.federation.sizes(cid)} for cid in sorted(merged)}

    def _evaluate(self, label: str, rounds_done: int) -> dict[str, float]:
        clients = self._all_client_metrics(label, rounds_done, None)
        nonfinite = self._nonfinite_metrics(label, f"at the evaluation after round {rounds_done}", clients)
        means, _ = _mean_std(clients)
        self.log.append({"event": "eval", "method": label, "round": rounds_done, **means, **nonfinite,
                         "clients": {str(c): m for c, m in clients.items()}})
        return means

    def _nonfinite_metrics(self, label: str, when: str, clients: Mapping[int, dict[str, float]]) -> dict[str, Any]:
        """``{"nonfinite": {metric: [clients]}}`` for the metrics some clients report as NaN or infinite (the means
        leave them out), after :meth:`_nonfinite`; ``{}`` when every value is finite."""
        found: dict[str, list[int]] = {}
        for cid in sorted(clients):
            for name, value in clients[cid].items():
                if name not in COUNT_KEYS and not math.isfinite(value):
                    found.setdefault(name, []).append(cid)
        if not found:
            return {}
        self._nonfinite(label, when, {f"metric {name!r}": cids for name, cids in found.items()})
        return {"nonfinite": found}

    def _nonfinite(self, label: str, when: str, found: Mapping[str, list[int]]) -> None:
        """Stop the run with one sentence naming what went NaN or infinite, or (``federation.on_nonfinite: warn``)
        warn once per method and go on. Stopping comes before the round's checkpoint: the last one written stays."""
        shown = [f"{what} (client{'s' if len(cids) > 1 else ''} {', '.join(map(str, cids))})"
                 for what, cids in list(found.items())[:2]]
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        message = f"method {label!r} went non-finite {when}: {'; '.join(shown)}{more}"
        if self.config.federation.on_nonfinite == "stop":
            raise NonFiniteError(f"{message}; the run stops, keeping the last checkpoint written before it "
                                 "(federation.on_nonfinite: warn goes on instead).")
        if label not in self._warned_nonfinite:
            self._warned_nonfinite.add(label)
            warnings.warn(f"{message}; going on (federation.on_nonfinite: warn), and the means leave non-finite "
                          "values out.", RuntimeWarning, stacklevel=2)

    def _finish(self, method_index: int, counters: dict[str, float]) -> dict[str, float]:
        entry = self.config.methods[method_index]
        rounds = self.config.federation.rounds
        clients = self._all_client_metrics(entry.label, rounds, entry.post_train_steps)
        nonfinite = self._nonfinite_metrics(entry.label, f"at the final evaluation after round {rounds}", clients)
        means, stds = _mean_std(clients)
        self.log.append({"event": "eval", "method": entry.label, "round": rounds, "final": True, **means, **nonfinite,
                         "clients": {str(c): m for c, m in clients.items()}})
        grouped = {}
        if len(self.federation.holdings) > 1:
            tasks_of = client_tasks(self.config.data)
            grouped = {"tasks": task_means(clients, tasks_of, self.federation.tasks),
                       "kinds": kind_means(clients, tasks_of, self.federation.tasks)}
        if self.config.data.stream is not None:
            grouped["stream"] = stream_summary(self.log.events, entry.label)
        if self.config.architectures:
            of = architecture_of(self.config)
            grouped["architectures"] = {name: _mean_std({c: m for c, m in clients.items() if of[c] == name})[0]
                                        for name in architecture_names(self.config)}
        atomic_write_json(self._results_dir / f"{entry.label}.json", {
            "clients": {str(c): m for c, m in clients.items()}, "mean": means, "std": stds, **nonfinite, **grouped,
            "comm_bytes": {"up": int(counters["up_bytes"]), "down": int(counters["down_bytes"])},
            "comm_params": {"up": int(counters.get("up_params", 0)), "down": int(counters.get("down_params", 0))},
            "wall_time_s": counters["wall_time_s"],
        })
        return means

    def _checkpoint(self, label: str, rounds_done: int, counters: dict[str, float]) -> None:
        state_refs = [actor.get_states.remote() for actor in self.actors]
        clients: dict = {}
        for part in self.executor.get(state_refs):
            clients.update(part)
        server = self.executor.get(self.driver.get_state.remote())
        save_checkpoint(self._checkpoint_dir, label, rounds_done, server, clients,
                        {"counters": counters, "config": self.config.to_dict(), "method": label})

    # Results -----------------------------------------------------------------------------
    def _summary(self, wall_time_s: float) -> dict[str, Any]:
        methods, comm, comm_params = {}, {}, {}
        for entry in self.config.methods:
            result = json.loads((self._results_dir / f"{entry.label}.json").read_text())
            methods[entry.label] = {"clients": result["clients"], "mean": result["mean"], "std": result["std"]}
            for group in ("nonfinite", "tasks", "kinds", "architectures", "stream"):  # per task, kind (the papers' Avg.), ...
                if group in result:
                    methods[entry.label][group] = result[group]
            comm[entry.label] = result["comm_bytes"]
            comm_params[entry.label] = result.get("comm_params", {"up": 0, "down": 0})
        post_trained = {entry.label for entry in self.config.methods if entry.post_train_steps}
        target, rounds = rounds_to_target(self.log.events, self.config.federation.target_acc, post_trained)
        return {
            "rayfed_version": __version__,
            "config": self.config.to_dict(),
            "methods": methods,
            "wall_time_s": round(wall_time_s, 3),
            "comm_bytes": comm,
            "comm_params": comm_params,  # "up" is the paper's T x M x P cost in parameters
            "target_acc": target,
            "rounds_to_target": rounds,
            **({"compute_match": self.compute_match} if self.compute_match else {}),
        }


def rounds_to_target(
    events: list[dict[str, Any]], target: float | None, post_trained: Collection[str] = (),
) -> tuple[float | None, dict[str, int | None]]:
    """The first evaluated round whose mean local_acc reaches ``target`` for every method (None: never).

    ``target`` defaults to 95% of the best mean local_acc any method reached at any evaluation. The
    final evaluation of a ``post_trained`` method (after its fine-tuning stage) is not a round's model
    and is left out."""
    evals = [
        e for e in events
        if e.get("event") == "eval" and "local_acc" in e and not (e.get("final") and e["method"] in post_trained)
    ]
    if target is None:
        if not evals:
            return None, {}
        target = 0.95 * max(e["local_acc"] for e in evals)
    rounds: dict[str, int | None] = {}
    for event in sorted(evals, key=lambda e: e["round"]):
        rounds.setdefault(event["method"], None)
        if rounds[event["method"]] is None and event["local_acc"] >= target:
            rounds[event["method"]] = event["round"]
    return target, rounds


def _mean_std(clients: Mapping[int, dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean and std of every metric over the clients that report it as a finite number (each client counts once;
    NaN when none does): a non-finite value is left out, and the event or summary lists its clients."""
    names = list(dict.fromkeys(k for c in sorted(clients) for k in clients[c] if k not in COUNT_KEYS))
    values = {name: np.array([clients[c][name] for c in sorted(clients) if name in clients[c]], dtype=np.float64)
              for name in names}
    values = {name: v[np.isfinite(v)] for name, v in values.items()}
    means = with_derived({n: float(v.mean()) if len(v) else math.nan for n, v in values.items()})
    return means, {n: float(v.std()) if len(v) else math.nan for n, v in values.items()}


def balanced_assignment(client_ids: list[int], slots: list[ActorSlot], host_of: dict[int, int]) -> dict[int, list[int]]:
    """The round's clients spread over the actors of their architecture in shares that differ by at most one;
    each client stays on its host while the host is within its share, the rest go to the actors with room
    (in actor order). The larger shares go to the actors hosting the most of the round's clients, so that as
    few clients as possible move."""
    assignment: dict[int, list[int]] = {}
    for architecture in dict.fromkeys(slot.architecture for slot in slots):
        actors = [index for index, slot in enumerate(slots) if slot.architecture == architecture]
        clients = sorted(c for c in client_ids if slots[host_of[c]].architecture == architecture)
        if not clients:
            continue
        hosted = {actor: sum(host_of[c] == actor for c in clients) for actor in actors}
        by_load = sorted(actors, key=lambda actor: (-hosted[actor], actor))
        base, extra = divmod(len(clients), len(actors))
        share = {actor: base + (rank < extra) for rank, actor in enumerate(by_load)}
        placed: dict[int, list[int]] = {actor: [] for actor in actors}
        overflow = []
        for client in clients:
            host = host_of[client]
            (placed[host] if len(placed[host]) < share[host] else overflow).append(client)
        for client in overflow:
            placed[next(actor for actor in actors if len(placed[actor]) < share[actor])].append(client)
        assignment.update({actor: sorted(group) for actor, group in placed.items() if group})
    return assignment


def stream_summary(events: list[dict[str, Any]], label: str) -> dict[str, dict[str, float]]:
    """A_last and A_AUC of every ``self_`` / ``others_`` mean: its value at the last evaluation and its mean over
    the evaluation points after round 0."""
    evaluations = sorted((e for e in events if e.get("event") == "eval" and e["method"] == label and e["round"] > 0),
                         key=lambda e: e["round"])
    names = dict.fromkeys(k for e in evaluations for k in e if k.startswith(("self_", "others_")))
    series = {name: [e[name] for e in evaluations if name in e] for name in names}
    return {name: {"a_last": values[-1], "a_auc": area_under_curve(values)} for name, values in series.items() if values}


def _own_metrics(metrics: dict[str, float], tasks: tuple[int, ...], task: Task) -> dict[str, float]:
    """A client's metrics of one of its tasks, under plain names: all of a single-task client's, else its
    ``<task>/...`` ones."""
    if len(tasks) == 1:
        return {name: value for name, value in metrics.items() if "/" not in name}
    prefix = f"{task.name}/"
    return {name[len(prefix):]: value for name, value in metrics.items() if name.startswith(prefix)}


def task_means(clients: Mapping[int, dict[str, float]], tasks_of: list[tuple[int, ...]],
               tasks: Iterable[Task]) -> dict[str, dict[str, float]]:
    """Per task, the mean of each metric over the clients holding it."""
    return {task.name: _mean_std({c: _own_metrics(m, tasks_of[c], task) for c, m in clients.items()
                                  if task.index in tasks_of[c]})[0]
            for task in tasks if any(task.index in tasks_of[c] for c in clients)}


def kind_means(clients: Mapping[int, dict[str, float]], tasks_of: list[tuple[int, ...]],
               tasks: Iterable[Task]) -> dict[str, dict[str, float]]:
    """Per task kind, the mean of each ``local_`` metric over every (client, task) pair of that kind: the
    client-weighted "Avg." columns of the papers' tables."""
    pairs: dict[str, list[dict[str, float]]] = {}
    for task in tasks:
        for cid, metrics in clients.items():
            if task.index in tasks_of[cid]:
                own = {k: v for k, v in _own_metrics(metrics, tasks_of[cid], task).items() if k.startswith("local_")}
                pairs.setdefault(task.kind.name, []).append(own)
    return {kind: _mean_std(dict(enumerate(rows)))[0] for kind, rows in pairs.items()}


def sample_batches(federation: Federation, backbone: Any, rows: int = 2) -> list[tuple[Task, dict[str, torch.Tensor]]]:
    """A few training samples of every task (from its first client), encoded for ``backbone``."""
    samples = []
    for holding in federation.holdings:
        train, _ = holding.splits[0]
        columns = federation._encode(holding, train[:rows], backbone)
        samples.append((federation.tasks[holding.task], columns))
    return samples


def import_plugin_modules(config: RunConfig) -> None:
    """Import the config's ``imports`` (modules whose decorators register plug-ins), but not a module whose plug-ins
    came registered with the run: a Tune trial or an actor gets the driver's by value, and its process may not be
    able to import the driver script's folder by name."""
    shipped = {getattr(entry.obj, "__module__", None) for entry in registry.user_entries()}
    for module in config.imports:
        if module in shipped:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"imports: module {module!r} cannot be imported ({err}).") from None


def ship_by_value(objects: Iterable[Any]) -> None:
    """Have Ray send the user's own code by value: the modules of plug-ins defined outside rayfed and
    outside installed packages (a driver script, a test module, a project folder next to the script),
    which the actors' processes could not import by name."""
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}
    for obj in objects:
        for value in _plugin_values(obj):
            module = sys.modules.get(getattr(value, "__module__", None) or "")
            path = getattr(module, "__file__", None)
            if (module is None or module.__name__ == "__main__" or module.__name__.split(".")[0] == "rayfed"
                    or path is None or any(path.startswith(root) for root in installed)):
                continue
            cloudpickle.register_pickle_by_value(module)


def _plugin_values(obj: Any) -> list[Any]:
    """``obj`` and the plug-in objects a config holds in its fields."""
    if isinstance(obj, RunConfig):
        data = [obj.data, *(obj.data.tasks or ())]
        return [*(d.source for d in data), *(d.kind for d in data), *(d.partition.name for d in data),
                obj.model.backbone, *(m.name for m in obj.methods)]
    return [obj if isinstance(obj, type) or callable(obj) else type(obj)]


def _placed(options: dict[str, Any], bundle_index: int) -> dict[str, Any]:
    """Inside a Ray Tune trial, put the actor in the trial's placement group (bundle 0: the driver)."""
    group = ray.util.get_current_placement_group() if ray.is_initialized() else None
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index)
    return options


def _fresh_run_dir(name: str, out_dir: str | os.PathLike | None) -> Path:
    if out_dir is not None:
        path = Path(out_dir)
        if (path / "config.yaml").exists():
            raise ConfigError(
                f"--out {str(path)!r} already holds a run; pass --resume {str(path)!r} to continue it, "
                "or choose another --out (nothing there is overwritten)."
            )
        return path
    base = Path("runs") / name
    path, suffix = base, 1
    while path.exists() and any(path.iterdir()):
        suffix += 1
        path = base.with_name(f"{base.name}-{suffix}")
    return path


def init_ray(config: RunConfig) -> bool:
    """Start local Ray (loopback only, no dashboard) or attach to ``ray.address``; True if we started it."""
    if ray.is_initialized():
        return False
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    init_local_ray(num_cpus=config.ray.num_cpus, num_gpus=config.ray.num_gpus,
                   object_store_memory=config.ray.object_store_memory)
    return True


def keep_loopback() -> Any:
    """A context in which Ray nodes started with node address 127.0.0.1 keep it.

    Ray 2.60 rewrites a loopback node address to the machine's routable IP (services.resolve_ip_for_localhost),
    after which its servers listen on every interface."""
    return mock.patch.object(ray._private.services, "resolve_ip_for_localhost", lambda host: host)


def init_local_ray(**kwargs: Any) -> None:
    """A new private Ray instance on this machine, reachable on 127.0.0.1 only, without a dashboard."""
    with keep_loopback():
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", **kwargs)


def _is_actor_failure(err: BaseException) -> bool:
    """Whether an actor or node died (the run restores and goes on), rather than an actor raising an error; an
    error raised while an actor started (its ``__init__``) would raise again."""
    if isinstance(err, ray.exceptions.ObjectLostError):
        return True
    if isinstance(err, ray.exceptions.RayTaskError):
        err = err.cause
    if isinstance(err, ray.exceptions.RayActorError):
        return not err.actor_init_failed
    return isinstance(err, ray.exceptions.NodeDiedError)


def _unwrap(err: BaseException) -> BaseException:
    """An error raised inside an actor, as the user should see it: a :class:`ConfigError` without Ray's wrapping
    (its one sentence says it all); any other error with Ray's wrapping, whose message holds the actor's
    traceback (the user's file and line, and where :func:`rayfed.errors.raised_in` noted it ran), but without
    the frames of Ray's own code in this process."""
    if not isinstance(err, ray.exceptions.RayTaskError):
        return err
    if isinstance(err.cause, ConfigError):
        return err.cause
    err.__notes__ = []  # the error's own notes, already in the message, would be shown a second time
    return err.with_traceback(None)
