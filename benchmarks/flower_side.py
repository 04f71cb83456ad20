"""Side by side with Flower: rayfed and Flower on the same FL workload, in one command.

    python benchmarks/flower_side.py --workload cpu|gpu|llm|llm-cpu --out DIR

Runs, one after another and each in its own process (so each gets a fresh Ray):

1. rayfed: `python -m rayfed.cli bench --workload W --actors-per-gpu 1` (benchmarks/overhead.py);
2. Flower, its ClientApp written as Flower's docs write one (model built in every handler call);
3. Flower, the same ClientApp with the model cached per actor process,

(2 and 3: benchmarks/flower/run_flower.py, in Flower's own venv when benchmarks/flower/.venv
exists, see benchmarks/flower/setup_venv.sh). All three run the workload of `rayfed bench`: same
model, data, partition, clients per round, local steps, batch size and optimizer, with one actor
per GPU (one actor on a CPU-only host). While each runs, this script samples the resident memory
of its whole process tree (driver + Ray processes) and the GPU memory in use (nvidia-smi).
Writes DIR/side_by_side.json and DIR/side_by_side.md, next to each run's own output and log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
FLOWER_VENV_PYTHON = HERE / "flower" / ".venv" / "bin" / "python"
RUNS = ("rayfed", "cached", "documented")
WORKLOADS = ("cpu", "gpu", "llm", "llm-cpu")  # `rayfed bench --workload`'s; this script runs without rayfed imported
GOAL_SPEEDUP = 5.0  # issue 8: rayfed >= 5x faster than Flower written as its docs show


class MemorySampler(threading.Thread):
    """Peak RSS summed over a process and its descendants, and peak GPU memory used (whole device)."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.stop = threading.Event()
        self.peak_rss = 0
        self.gpu_before = _gpu_used_mib()
        self.peak_gpu = self.gpu_before
        self.seen: set[psutil.Process] = set()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            self.seen.update(procs)
            rss = 0
            for proc in procs:
                try:
                    rss += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            gpu = _gpu_used_mib()
            if gpu is not None:
                self.peak_gpu = max(self.peak_gpu or 0, gpu)
            self.stop.wait(self.interval)


def _gpu_used_mib() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
        return sum(float(line) for line in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _gpu_names() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
        return ", ".join(out.split("\n")[:-1]) or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_sampled(name: str, cmd: list[str], log_path: Path, timeout: float, cwd: str) -> dict[str, Any]:
    """Run ``cmd``, echo and log its output, sample its memory; kill it (and its Ray) past ``timeout``."""
    print(f"[side] {name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                env=env, start_new_session=True)
        sampler = MemorySampler(proc.pid)
        sampler.start()

        def pump() -> None:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if not line.startswith(("WARNING:root:No pretrained", "\x1b")):
                    print(f"  {name}| {line}", end="", flush=True)

        pumper = threading.Thread(target=pump, daemon=True)
        pumper.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"[side] {name}: past {timeout:.0f} s, stopping it", flush=True)
            _kill(proc, sampler.seen)
            rc = None
        sampler.stop.set()
        sampler.join()
        pumper.join(timeout=10)
    wall = time.perf_counter() - started
    return {
        "rc": rc, "command_wall_s": wall, "log": log_path.name,
        "peak_tree_rss_mib": sampler.peak_rss / 2**20,
        "gpu_used_before_mib": sampler.gpu_before,
        "peak_gpu_used_mib": sampler.peak_gpu,
    }


def _kill(proc: subprocess.Popen, seen: set[psutil.Process]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    time.sleep(5)
    for p in [proc, *seen]:  # what is left, Ray processes that left the group included
        try:
            p.kill()
        except (psutil.Error, ProcessLookupError):
            pass
    proc.wait()


def versions(python: str) -> dict[str, str]:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for name in ('ray', 'torch', 'flwr', 'transformers', 'peft', 'open_clip_torch', 'rayfed'):\n"
            "    try: out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                                         check=False).stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="cpu")
    parser.add_argument("--out", default="runs/flower_side")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="what to run, in this order")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the whole sequence this many times, alternating (hosts drift within minutes)")
    parser.add_argument("--documented-rounds", type=int, default=None,
                        help="rounds for the documented Flower client (default: the workload's; it is the slow one)")
    parser.add_argument("--rayfed-python", default=sys.executable)
    parser.add_argument("--flower-python", default=str(FLOWER_VENV_PYTHON) if FLOWER_VENV_PYTHON.exists()
                        else sys.executable, help="default: benchmarks/flower/.venv if present, else this Python")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is stopped")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from now by which every run must end (a later run gets what is left; "
                             "a stopped Flower run keeps the rounds it finished)")
    args = parser.parse_args(argv)
    deadline = None if args.deadline is None else time.monotonic() + args.deadline

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="flower-side-")  # not the repo root: its rayfed/ must not shadow the package
    results: dict[str, Any] = {
        "workload": args.workload,
        "host": {"gpu": _gpu_names(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"rayfed_env": versions(args.rayfed_python), "flower_env": versions(args.flower_python)},
        "runs": [],
    }
    for repeat in range(args.repeat):
        for run in args.runs:
            run_out = out / f"pass{repeat + 1}"
            run_out.mkdir(exist_ok=True)
            if run == "rayfed":
                cmd = [args.rayfed_python, "-m", "rayfed.cli", "bench", "--workload", args.workload,
                       "--actors-per-gpu", "1", "--out", str(run_out / "rayfed")]
            else:
                cmd = [args.flower_python, str(HERE / "flower" / "run_flower.py"), "--variant", run,
                       "--workload", args.workload, "--out", str(run_out)]
                if run == "documented" and args.documented_rounds:
                    cmd += ["--rounds", str(args.documented_rounds)]
            timeout = args.timeout if deadline is None else min(args.timeout, deadline - time.monotonic())
            if timeout < 30:
                print(f"[side] {run}: skipped, {timeout:.0f} s left before the deadline", flush=True)
                continue
            entry = {"run": run, "pass": repeat + 1, **run_sampled(run, cmd, run_out / f"{run}.log", timeout, cwd)}
            entry.update(_read_result(run, run_out))
            results["runs"].append(entry)
            _write(out, results)
    _write(out, results)
    shutil.rmtree(cwd, ignore_errors=True)
    print((out / "side_by_side.md").read_text(), flush=True)
    return 0 if all(r["rc"] == 0 for r in results["runs"]) else 1


def _read_result(run: str, out: Path) -> dict[str, Any]:
    """The run's own numbers, or the rounds it finished before it stopped."""
    if run == "rayfed":
        path = out / "rayfed" / "bench.json"
        if not path.exists():
            return {}
        bench = json.loads(path.read_text())
        if not bench.get("runs"):
            return {"machine": bench.get("machine")}
        r = bench["runs"][0]
        return {
            "machine": bench["machine"], "workload_fields": bench["workload"], "step_work": bench["step_work"],
            "round_s": r["round_s"],
            "num_actors": r["num_actors"],
            "client_updates_per_s": r["client_updates_per_s"], "samples_per_s": r["samples_per_s"],
            "peak_gpu_mib_per_actor": r["peak_gpu_mib_per_actor"],
            "peak_host_mib_per_actor": r["peak_host_mib_per_actor"],
            "overhead_ratio": r["overhead_ratio"], "local_metrics": r["local_metrics"],
            "rounds": bench["workload"]["rounds"],
            **{key: r[key] for key in r if key.startswith("mean_")},  # s/round, the ideal's, where rounds went
        }
    path = out / f"flower_{run}.json"
    if path.exists():
        r = json.loads(path.read_text())
        return {key: r[key] for key in (
            "machine", "round_s", "warmup_round_s", "mean_round_s", "num_actors", "client_resources",
            "client_updates_per_s", "samples_per_s", "peak_gpu_mib_per_actor", "peak_host_mib_per_actor",
            "train_loss", "versions")} | {"rounds": r["workload"]["rounds"], "workload_fields": r["workload"]}
    progress = out / f"flower_{run}.rounds.jsonl"
    if progress.exists():  # stopped early: keep the rounds it timed (first is the warm-up)
        rounds = [json.loads(line)["wall_s"] for line in progress.read_text().splitlines()]
        if len(rounds) > 1:
            return {"round_s": rounds[1:], "warmup_round_s": rounds[0],
                    "mean_round_s": sum(rounds[1:]) / len(rounds[1:]), "partial": True}
        if rounds:
            return {"warmup_round_s": rounds[0], "partial": True}
    return {}


LABELS = {
    "rayfed": ("rayfed", "ClientActor: backbone built once per actor"),
    "documented": ("Flower", "ClientApp as documented: model built per message"),
    "cached": ("Flower", "ClientApp, model cached per actor process"),
}


def _mean_round(runs: list[dict[str, Any]], name: str) -> float | None:
    """Mean s/round of every run of one kind, weighted by its timed rounds."""
    rounds = [t for r in runs if r["run"] == name for t in r.get("round_s", [])]
    return sum(rounds) / len(rounds) if rounds else None


def markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    base = _mean_round(runs, "rayfed")
    machine = next((r["machine"] for r in runs if r.get("machine")), results["host"])
    # every run does the same work per round; rayfed's bench counted it (FLOPs and tokens of one client step)
    work = next((r["step_work"] for r in runs if r.get("step_work")), None)

    def fmt(value, spec=".0f"):
        return "-" if value is None else format(value, spec)

    def per_second(amount: float | None, mean: float | None, spec: str) -> str:
        return fmt(amount * work["steps_per_round"] / mean if amount is not None and work and mean else None, spec)

    rows = []
    for r in runs:
        framework, client = LABELS[r["run"]]
        mean = r.get("mean_round_s")
        rounds = r.get("round_s", [])
        rows.append("| " + " | ".join([
            str(r["pass"]), framework, client,
            f"{len(rounds)}{' (stopped)' if r.get('partial') else ''}",
            fmt(mean, ".2f"),
            f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-",
            fmt(r.get("warmup_round_s"), ".2f"),
            fmt(mean / base, ".2f") if mean and base else "-",
            fmt(r.get("client_updates_per_s"), ".2f"),
            per_second(work and work["tokens"], mean, ".0f"), per_second(work and work["flops"] / 1e12, mean, ".3g"),
            fmt(r.get("peak_gpu_mib_per_actor")), fmt(r.get("peak_host_mib_per_actor")),
            fmt(r.get("peak_gpu_used_mib")), fmt(r.get("peak_tree_rss_mib")), fmt(r.get("command_wall_s")),
        ]) + " |")
    header = ("| pass | framework | client code | timed rounds | s/round | min-max | warm-up round s "
              "| x rayfed's mean s/round | client updates/s | tokens/s | TFLOP/s | peak GPU MiB / actor (torch) "
              "| host MiB / actor (RSS) | peak GPU MiB used (device) | peak RSS MiB (process tree) | command s |\n|"
              + "---|" * 16)
    versions = results["versions"]
    lines = [
        f"Workload: `{results['workload']}` "
        f"({json.dumps(next((r['workload_fields'] for r in runs if r.get('workload_fields')), {}))})",
        "",
        (f"Machine: {machine.get('gpu') or 'CPU only'}, {machine.get('cpus')} CPUs, Python {machine.get('python')}; "
        f"rayfed env: {_fmt_versions(versions['rayfed_env'])}; Flower env: {_fmt_versions(versions['flower_env'])}"),
        "",
        header, *rows, "",
        ("s/round: mean over the timed rounds (the first round of each run is a warm-up and left out); the "
        "ratio column divides by rayfed's mean over all its passes. Tokens/s and TFLOP/s: the work of a round "
        "(rayfed bench's count: client steps x FLOPs and tokens of one step, forward + backward) over each run's "
        "s/round. "
        "Per-actor memory: PyTorch's peak allocated GPU memory and the actor's RSS, read inside the actor. "
        "Device and process-tree peaks: sampled every 0.5 s from outside over the whole command (for rayfed "
        "that includes `rayfed bench`'s ideal loop and host-memory probe in the driver)."),
    ]
    doc = _mean_round(runs, "documented")
    if base and doc:
        speedup = doc / base
        verdict = "met" if speedup >= GOAL_SPEEDUP else "not met"
        lines += ["", (f"Goal (issue 8): rayfed >= {GOAL_SPEEDUP:.0f}x faster than Flower as documented: "
                      f"{speedup:.2f}x (means over all passes), {verdict}.")]
    elif base:
        warmups = [r["warmup_round_s"] for r in runs if r["run"] == "documented" and r.get("warmup_round_s")]
        if warmups:
            lines += ["", (f"Flower as documented was stopped before it timed a round after its warm-up; its warm-up "
                          f"round ({min(warmups):.1f} s) is {min(warmups) / base:.1f}x rayfed's mean s/round.")]
    cached = _mean_round(runs, "cached")
    if base and cached:
        lines += [f"Against Flower with the model cached per actor: {cached / base:.2f}x."]
    return "\n".join(lines) + "\n"


def _fmt_versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {val}" for k, val in v.items()) or "?"


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "side_by_side.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "side_by_side.md").write_text(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
