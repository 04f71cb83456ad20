"""Whole commands for the small run, alternating: rayfed on Ray, rayfed in one process, the plain loop.

    python benchmarks/small/compare.py --repeats 2 --out runs/small_compare

Each command is timed from start to exit (imports included); rayfed's rounds come from its metrics.jsonl.
Writes compare.json and prints one line per command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMANDS = {
    "rayfed (Ray actors)": ["-m", "rayfed.cli", "run", str(HERE / "workload.yaml"), "--quiet"],
    "rayfed (executor: local)": ["-m", "rayfed.cli", "run", str(HERE / "workload.yaml"), "--quiet",
                                 "placement.executor=local"],
    "plain loop": [str(HERE / "plain_loop.py")],
}


def run_once(label: str, args: list[str], out_dir: Path) -> dict:
    extra = ["--out", str(out_dir)] if "rayfed.cli" in args else []
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, *args, *extra], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"{label} failed:\n{completed.stderr[-3000:]}")
    result = {"command": label, "process_s": seconds}
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        result["round_s"] = [e["wall_s"] for e in events if e["event"] == "round"]
    else:
        result["stdout"] = completed.stdout.strip()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/small_compare")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(args.repeats):
        for index, (label, command) in enumerate(COMMANDS.items()):
            result = run_once(label, command, out / f"run-{repeat}-{index}")
            results.append(result)
            rounds = result.get("round_s")
            detail = (f"rounds {min(rounds):.3f}-{max(rounds):.3f} s (median {statistics.median(rounds):.3f})"
                      if rounds else result.get("stdout", ""))
            print(f"{label}: {result['process_s']:.1f} s; {detail}", flush=True)
    (out / "compare.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
