"""One command for a GPU lease: each seed method at paper size through `rayfed bench --ideal-only --profile`, within
a time budget.

    python -m rayfed.benchmarks.gpu_profile OUT_DIR [--budget-s 540] [--bundle DIR] [--workloads feddat tap ...]

For each workload in turn (its paper-size overrides: :data:`PAPER_SIZE`), a bench of the method's ideal rounds with
MFU, time to result and a profiled steady local update runs in a process of its own (its output in
``OUT_DIR/<workload>/log.txt``), stopped when its share of the budget is over: the budget left, split by the
workloads' :data:`WEIGHTS` among those still to run, so that time one leaves goes to the next. A workload that
would start with less than ``--min-s`` left is skipped with a note. After each workload ``OUT_DIR/summary.{json,md}``
say what ran; ``--bundle DIR`` also puts them and ``results.tar.gz`` (everything in ``OUT_DIR``) into DIR, three files
(a device lease's ``$OUT`` returns a few files, not a tree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import yaml

from rayfed.benchmarks.method_bench import METHOD_WORKLOADS, REPO
from rayfed.errors import ConfigError, choice_error
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table


def _fedmosaic_overrides() -> tuple[str, ...]:
    """The LLaVA mix at a size one device call holds (benchmarks/README.md): 5 local steps, 40 samples a task,
    256 public rows, evaluation on the clients' own tasks."""
    tasks = yaml.safe_load((REPO / METHOD_WORKLOADS["fedmosaic"].config).read_text())["data"]["tasks"]
    return ("train.local_steps=5", "data.public.options.num_samples=256", "data.stream.evaluate_others=false",
            *(f"data.tasks.{i}.options.num_samples=40" for i in range(len(tasks))))


# The overrides of the paper-size calls benchmarks/README.md records (issue 58's table among them).
PAPER_SIZE: dict[str, tuple[str, ...]] = {
    "feddat": ("train.local_epochs=null", "train.local_steps=20"),
    "pfedmma": ("train.local_epochs=null", "train.local_steps=5"),
    "fedyolo": (),
    "tap": ("train.local_steps=5",),
    "fedmosaic": (),  # filled by _fedmosaic_overrides: it reads the config
}
# Each workload's expected seconds on one H200 (start-up, build, FLOP count, 2 rounds, 2 profiled updates), from
# the rounds benchmarks/README.md records; the budget is shared in these proportions.
WEIGHTS = {"feddat": 130.0, "fedyolo": 45.0, "pfedmma": 80.0, "fedmosaic": 120.0, "tap": 200.0}
ORDER = ("feddat", "fedyolo", "pfedmma", "fedmosaic", "tap")


def workload_overrides(name: str) -> tuple[str, ...]:
    return _fedmosaic_overrides() if name == "fedmosaic" else PAPER_SIZE[name]


def share_s(left_s: float, name: str, still: list[str]) -> float:
    """The seconds workload ``name`` may take: ``left_s`` split by :data:`WEIGHTS` among ``still`` (``name``
    first among them)."""
    return left_s * WEIGHTS[name] / sum(WEIGHTS[other] for other in still)


def bench_command(name: str, out_dir: Path, rounds: int, extra: tuple[str, ...], trace: bool) -> list[str]:
    return [sys.executable, "-m", "rayfed", "bench", "--workload", name, "--ideal-only", "--no-reference",
            "--rounds", str(rounds), "--profile-trace" if trace else "--profile", "--out", str(out_dir),
            "--set", *workload_overrides(name), *extra]


def run_limited(command: list[str], log: Path, limit_s: float) -> tuple[int | None, float]:
    """``command`` in a process session of its own, its output into ``log``; stopped (the whole session: SIGTERM,
    then SIGKILL) after ``limit_s``. Its exit code (None: stopped) and seconds."""
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return process.wait(timeout=limit_s), time.perf_counter() - started
        except subprocess.TimeoutExpired:
            for stop, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, stop)
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            return None, time.perf_counter() - started


def workload_summary(name: str, out_dir: Path, status: str, seconds: float) -> dict[str, Any]:
    """What summary.json keeps of a workload's bench.json and profile.json (those that were written)."""
    row: dict[str, Any] = {"workload": name, "status": status, "seconds": round(seconds, 1)}
    bench_file, profile_file = out_dir / "bench.json", out_dir / "profile" / "profile.json"
    if bench_file.is_file():
        bench = json.loads(bench_file.read_text())
        method = bench.get("method", {})
        row.update(gpu=bench["machine"].get("gpu"), tflops_per_s=method.get("tflops_per_s"), mfu=method.get("mfu"),
                   peak_note=bench["machine"].get("peak_note"), time_to_result=bench.get("time_to_result"),
                   first_round_setup=method.get("first_round_setup"))
    if profile_file.is_file():
        profile = json.loads(profile_file.read_text())
        cuda = profile.get("cuda")
        families = cuda["families"] if cuda else profile.get("cpu_families", {})
        row.update(update_wall_s=profile["wall_s"], gpu_idle_fraction=cuda and cuda["idle_fraction"],
                   family_shares={family: v["share"] for family, v in families.items()})
    return row


def _number(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, spec)


def summary_markdown(rows: list[dict[str, Any]], budget_s: float) -> str:
    families = ("gemm", "attention", "elementwise", "normalization", "copy", "optimizer", "other")
    table = []
    for row in rows:
        shares = row.get("family_shares", {})
        estimate = row.get("time_to_result") or {}
        setup = row.get("first_round_setup") or {}
        table.append([row["workload"], row["status"], f"{row['seconds']:.0f}", _number(row.get("tflops_per_s"), ".1f"),
                      _number(row.get("mfu"), ".1f", 100), _number(row.get("gpu_idle_fraction"), ".0f", 100),
                      *(_number(shares.get(family), ".0f", 100) for family in families),
                      _number(estimate.get("schedule_gpu_hours"), ".2f"),
                      _number(estimate.get("trials_per_gpu_hour"), ".2f"), _number(setup.get("setup_s"), ".1f"),
                      _number(setup.get("share_of_run"), ".1f", 100)])
    gpus = sorted({row["gpu"] for row in rows if row.get("gpu")}) or ["no GPU"]
    notes = sorted({row["peak_note"] for row in rows if row.get("peak_note")})
    return (f"Seed methods at paper size (`python -m rayfed.benchmarks.gpu_profile`, budget {budget_s:.0f} s) on "
            f"{', '.join(gpus)}; peaks: {'; '.join(notes) or '-'}.\n\n"
            + format_table(table, ["workload", "status", "s", "TFLOP/s", "MFU %", "GPU idle %",
                                   *(f"{family} %" for family in families), "paper schedule GPU-h", "trials/GPU-h",
                                   "first round's setup s", "of 20 rounds %"])
            + "\nFamilies: shares of a profiled update's CUDA time (CPU ops' self time without a GPU); each "
              "workload's bench.md and profile/profile.md have the rest.\n")


def bundle(out_dir: Path, bundle_dir: Path) -> None:
    """summary.json, summary.md and results.tar.gz (all of ``out_dir``) into ``bundle_dir``."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "summary.md"):
        shutil.copyfile(out_dir / name, bundle_dir / name)
    partial = bundle_dir / "results.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(out_dir, arcname=out_dir.name)
    partial.replace(bundle_dir / "results.tar.gz")


def run_all(out_dir: Path, budget_s: float, workloads: list[str], rounds: int = 2, extra: tuple[str, ...] = (),
            bundle_dir: Path | None = None, min_s: float = 45.0, trace: bool = False) -> list[dict[str, Any]]:
    """Each of ``workloads`` (:func:`bench_command`) within ``budget_s`` seconds in all; the summary after each."""
    for name in workloads:
        if name not in METHOD_WORKLOADS:
            raise choice_error("--workloads", name, METHOD_WORKLOADS)
    if budget_s <= 0:
        raise ConfigError(f"--budget-s {budget_s} is invalid: it must be > 0 (seconds for all the workloads).")
    out_dir.mkdir(parents=True, exist_ok=True)
    started, rows = time.perf_counter(), []
    for index, name in enumerate(workloads):
        left_s = budget_s - (time.perf_counter() - started)
        workload_dir = out_dir / name
        if left_s < min_s:
            rows.append({"workload": name, "status": f"skipped: {left_s:.0f} s of the budget left", "seconds": 0.0})
        else:
            limit_s = share_s(left_s, name, workloads[index:])
            workload_dir.mkdir(parents=True, exist_ok=True)
            print(f"[gpu_profile] {name}: up to {limit_s:.0f} s ({left_s:.0f} s of the budget left)", flush=True)
            code, seconds = run_limited(bench_command(name, workload_dir, rounds, extra, trace),
                                        workload_dir / "log.txt", limit_s)
            status = ("done" if code == 0 else f"stopped at its {limit_s:.0f} s share" if code is None
                      else f"failed (exit {code}; see {name}/log.txt)")
            rows.append(workload_summary(name, workload_dir, status, seconds))
            print(f"[gpu_profile] {name}: {status} in {seconds:.0f} s", flush=True)
        atomic_write_json(out_dir / "summary.json", {"budget_s": budget_s, "rounds": rounds, "extra": list(extra),
                                                     "workloads": rows})
        atomic_write_text(out_dir / "summary.md", summary_markdown(rows, budget_s))
        if bundle_dir is not None:
            bundle(out_dir, bundle_dir)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for each workload's bench, profile and log, and the summary")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds for all the workloads together")
    parser.add_argument("--workloads", nargs="+", default=list(ORDER), help="the seed methods' workloads, in order")
    parser.add_argument("--rounds", type=int, default=2, help="the ideal's rounds of each (the first a warm-up)")
    parser.add_argument("--set", dest="extra", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for every workload, after its paper-size ones (e.g. train.cuda_graphs=true)")
    parser.add_argument("--bundle", type=Path, help="also put summary.{json,md} and results.tar.gz here")
    parser.add_argument("--min-s", type=float, default=45.0, help="skip a workload with less than this left")
    parser.add_argument("--trace", action="store_true", help="also each profile's chrome trace (large)")
    args = parser.parse_args(argv)
    rows = run_all(args.out, args.budget_s, args.workloads, args.rounds, tuple(args.extra), args.bundle, args.min_s,
                   args.trace)
    print((args.out / "summary.md").read_text())
    return 0 if all(row["status"] == "done" for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
