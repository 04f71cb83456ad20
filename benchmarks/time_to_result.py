"""Time to result: from a bench's measured rounds, the wall time of a paper's full schedule on one GPU and the trials
per GPU-hour of its named sweep (`rayfed bench --workload <paper>`'s ``time_to_result``).

The bench times a few rounds, often at fewer local steps than the paper's (a device call is short). A round's local
updates are taken to scale with the steps and the clients a round (a step's work does not change from step to
step: the bench's FLOP count makes the same assumption), the rest of the round (the server's hooks, rayfed's time
around its actors) not. The schedule: the paper config's rounds and its evaluations (every ``eval_every`` rounds and
once at the end), each at the measured evaluation's cost when the bench measured one (not with ``--ideal-only``).
A method's stage after the rounds (TAP's post-FL views) and a first round that trains more clients (pFedMMA's) are
not in the estimate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from rayfed.config import RunConfig

SPACE_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")


@dataclass(frozen=True)
class PaperSchedule:
    """A paper config's schedule: its rounds, clients a round, evaluations, and local steps (None: the steps follow
    each client's data, ``local_epochs``)."""

    rounds: int
    clients_per_round: int
    evaluations: int
    local_steps: int | None


def paper_schedule(config: RunConfig) -> PaperSchedule:
    """The schedule of ``config`` (the paper config, or its offline twin, without the bench's overrides)."""
    federation, train = config.federation, config.train
    return PaperSchedule(rounds=federation.rounds, clients_per_round=federation.clients_per_round,
                         evaluations=(federation.rounds - 1) // federation.eval_every + 1,
                         local_steps=None if train.local_epochs is not None else train.local_steps)


def _leaves(space: dict[str, Any]) -> list[tuple[str, Any]]:
    leaves = []
    for path, spec in space.items():
        if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in SPACE_KINDS:
            leaves.append(next(iter(spec.items())))
        elif isinstance(spec, dict):
            leaves.extend(_leaves(spec))
    return leaves


def sweep_size(tune: dict[str, Any]) -> dict[str, Any]:
    """A tune section's trials (grid search: ``num_samples`` repeats of the grids' crossing; random and optuna:
    ``num_samples``) and distinct settings (the product of its grid and choice values' counts; None where a range
    makes them endless); its scheduler, which may stop trials early (ASHA), so that the trials' full schedules
    bound the sweep's cost from above."""
    leaves = _leaves(tune.get("space", {}))
    samples = int(tune.get("num_samples", 1))
    search = tune.get("search", "random")
    grids = math.prod(len(values) for kind, values in leaves
                      if kind == "grid" or (search == "grid" and kind == "choice"))
    finite = all(kind in ("grid", "choice") for kind, _ in leaves)
    scheduler = tune.get("scheduler", "fifo")
    return {"search": search, "trials": samples * grids,
            "settings": math.prod(len(values) for _, values in leaves) if finite else None,
            "scheduler": scheduler if isinstance(scheduler, str) else scheduler.get("name", "fifo"),
            "parameters": list(tune.get("space", {}))}


def time_to_result(schedule: PaperSchedule, round_s: float, update_s: float, bench_steps: int,
                   paper_steps: int | None, bench_clients: float, evaluation_s: float | None = None,
                   sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    """The paper schedule's wall time on one GPU from a measured round (``round_s``, of which ``update_s`` the
    local updates of ``bench_clients`` clients at ``bench_steps`` steps each), the paper's ``paper_steps`` a
    client (None: unknown, no estimate) and ``evaluation_s`` an evaluation of every client (None: not measured,
    left out); with ``sweep`` (:func:`sweep_size`), the sweep's trials per GPU-hour and GPU-hours."""
    result: dict[str, Any] = {"schedule": asdict(schedule), "measured_round_s": round_s, "measured_update_s": update_s,
                              "bench_steps": bench_steps, "paper_steps": paper_steps, "bench_clients": bench_clients,
                              "evaluation_s": evaluation_s, "evaluations_included": evaluation_s is not None}
    if paper_steps is None:
        return {**result, "paper_round_s": None, "schedule_s": None, "note": "the paper's steps an update are unknown"}
    scale = paper_steps / bench_steps * schedule.clients_per_round / bench_clients
    paper_round_s = round_s + update_s * (scale - 1)
    schedule_s = schedule.rounds * paper_round_s + schedule.evaluations * (evaluation_s or 0.0)
    result.update(paper_round_s=paper_round_s, schedule_s=schedule_s, schedule_gpu_hours=schedule_s / 3600,
                  trials_per_gpu_hour=3600 / schedule_s)
    if sweep is not None:
        settings = sweep["settings"]
        result["sweep"] = {**sweep, "gpu_hours": sweep["trials"] * schedule_s / 3600,
                           "gpu_hours_every_setting": None if settings is None else settings * schedule_s / 3600}
    return result


def first_round_setup(ideal_rounds: list[dict[str, Any]], run_rounds: int = 20) -> dict[str, Any] | None:
    """What the first of the ideal's measured rounds spends on setting up (compiling, capturing graphs, warm-ups):
    its local updates' seconds beyond the later rounds' mean update time a client, for its clients; and that as a
    share of a ``run_rounds``-round run whose other rounds take the later rounds' mean. None from one round. A
    capture made after the first round (a new batch shape) is not in it."""
    if len(ideal_rounds) < 2:
        return None
    first, later = ideal_rounds[0], ideal_rounds[1:]
    per_client = sum(r["update_s"] for r in later) / sum(len(r["clients"]) for r in later)
    setup_s = first["update_s"] - per_client * len(first["clients"])
    round_s = sum(r["round_s"] for r in later) / len(later)
    return {"setup_s": setup_s, "run_rounds": run_rounds,
            "share_of_run": setup_s / (setup_s + run_rounds * round_s)}


def first_round_setup_markdown(setup: dict[str, Any] | None) -> str:
    """bench.md's line on :func:`first_round_setup`."""
    if setup is None:
        return ""
    return (f"\nFirst round's setup (compilation, graph captures, warm-ups; the ideal's updates beyond the later "
            f"rounds' rate): {setup['setup_s']:.1f} s, {100 * setup['share_of_run']:.1f}% of a "
            f"{setup['run_rounds']}-round run.\n")


def time_to_result_markdown(estimate: dict[str, Any]) -> str:
    """bench.md's lines on the estimate."""
    if estimate.get("schedule_s") is None:
        return f"\nTime to result: no estimate ({estimate.get('note', 'nothing measured')}).\n"
    schedule = estimate["schedule"]
    evaluations = (f"{schedule['evaluations']} evaluations at {estimate['evaluation_s']:.1f} s"
                   if estimate["evaluations_included"] else "evaluations not measured, left out")
    text = (f"\nTime to result (on one device like this one): the paper's {schedule['rounds']} rounds of "
            f"{schedule['clients_per_round']} clients x {estimate['paper_steps']} steps at "
            f"{estimate['paper_round_s']:.2f} s a round (measured {estimate['measured_round_s']:.2f} s at "
            f"{estimate['bench_steps']} steps, updates scaled), {evaluations}: "
            f"**{estimate['schedule_gpu_hours']:.2f} GPU-hours**, {estimate['trials_per_gpu_hour']:.2f} trials per "
            "GPU-hour.\n")
    sweep = estimate.get("sweep")
    if sweep:
        every = sweep["gpu_hours_every_setting"]
        text += (f"Its sweep `{sweep['config']}` ({', '.join(sweep['parameters'])}; {sweep['search']} search, "
                 f"{sweep['scheduler']}): {sweep['trials']} trials, {sweep['gpu_hours']:.1f} GPU-hours"
                 + ("" if every is None else f"; all {sweep['settings']} settings {every:.1f} GPU-hours")
                 + (" (an upper bound: ASHA stops trials early)" if sweep["scheduler"] == "asha" else "") + ".\n")
    return text
