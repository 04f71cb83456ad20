"""Run a paper's offline experiments as parallel single-method jobs and collect one compact line per (method,
overrides, seed) in ``<out>/results.jsonl``; ``benchmarks/papers/<paper>_tables.py`` make the tables from it. From
the repository's root (else ``--repo PATH``):

    python benchmarks/papers/offline_runs.py --plan fedmosaic --seeds 0 1 2 --jobs 12 --out runs/fedmosaic
    python benchmarks/papers/offline_runs.py --plan feddat-domain feddat-scene --seeds 0 1 2 3 4 --jobs 60 \
        --out runs/feddat
    python benchmarks/papers/offline_runs.py --plan tap-flava-quick --labels TAP --seeds 3 4 5 --out runs/tap
    python benchmarks/papers/offline_runs.py --plan fedmosaic-competitors \
        --configs fedmosaic/offline_competitors_static --labels fedmkt --out runs/fm
    python benchmarks/papers/offline_runs.py --plan fedmosaic fedmosaic-baselines --compute-match local --out runs/fm-cm

Every job is one method of one ``configs/<paper>/`` file at one seed, run in-process (``placement.executor:
local``: the same numbers as on Ray actors, and as the method run beside the config's others, since every random
stream derives from the seed, round, client and purpose alone) with ``--threads`` CPU threads (default 1);
``--device auto`` puts them on the GPU when there is one. A plan names (config, method label, overrides) entries;
see :func:`plans`. ``--compute-match LABEL``: each job first measures its method's local update against method
``LABEL``'s (``train.compute_match``, :mod:`rayfed.compute`; ``LABEL``'s entry from the job's config, else from the
first planned config holding it) and trains ``round(train.local_steps / C)`` steps; its line records the
measurement under ``compute_match``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import yaml
from repo_argument import add_repo_argument, configs_of

Entry = tuple[str, str, dict[str, Any]]  # config path under configs/ without .yaml, method label, dotted overrides


def _sweep(label: str, key: str, values: list[Any]) -> list[Entry]:
    return [("fedmosaic/offline_dynamic", label, {f"methods.0.{key}": value}) for value in values]


def _all_methods(configs: Path, stem: str) -> list[Entry]:
    methods = yaml.safe_load((configs / f"{stem}.yaml").read_text())["methods"]
    return [(stem, _label(method), {}) for method in methods]


def _label(method: str | dict[str, Any]) -> str:
    return method if isinstance(method, str) else method.get("label", method["name"])


def plans(configs: Path) -> dict[str, list[Entry]]:
    """The plans, by name, over the configs in ``configs`` (a repository's ``configs/``)."""
    return {
        "fedmosaic": [("fedmosaic/offline_dynamic", label, {})
                      for label in ("local", "fedavg", "vanilla", "pq_lora", "fedmosaic")],
        "fedmosaic-baselines": [("fedmosaic/offline_baselines", label, {})
                                for label in ("ditto", "fedsim", "feddpa", "feddat_lora")],
        "fedmosaic-competitors": [(f"fedmosaic/offline_{setting}", label, {})
                                  for setting in ("competitors", "competitors_static")
                                  for label in ("takfl", "perada", "fedmkt")],
        "fedmosaic-rela": [("fedmosaic/offline_rela_variants", label, {})
                           for label in ("training_current", "frozen_current")],
        "fedmosaic-tau": _sweep("fedmosaic", "tau", [0.02, 0.1, 2.0, 10.0]),
        "fedmosaic-blocks": _sweep("fedmosaic", "blocks", [2, 8]),
        "fedmosaic-alignment": [("fedmosaic/offline_alignment", "random_basis", {})],
        "fedmosaic-static": [("fedmosaic/offline_static", label, {}) for label in ("local", "fedmosaic")],
        "fedmosaic-async": [("fedmosaic/offline_async", label, {}) for label in ("local", "fedmosaic")],
        **{f"feddat-{benchmark}": _all_methods(configs, f"feddat/offline_{benchmark}")
           for benchmark in ("domain", "function", "scene")},
        **{f"tap-{setting.replace('_', '-')}": _all_methods(configs, f"tap/offline_{setting}")
           for setting in ("flava_quick", "vilt_quick", "flava", "vilt")},
    }


def job_config(configs: Path, stem: str, label: str, overrides: dict[str, Any], seed: int,
               extra: dict[str, Any]) -> dict[str, Any]:
    config = yaml.safe_load((configs / f"{stem}.yaml").read_text())
    config["methods"] = [m for m in config["methods"] if _label(m) == label]
    if not config["methods"]:
        raise ValueError(f"{stem}.yaml has no method labelled {label!r}")
    config["seed"] = seed
    config["placement"] = {"executor": "local", "clients_per_actor": 10, "cpus_per_actor": 1}
    for path, value in {**overrides, **extra}.items():
        node = config
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(keys[-1])] = value
        else:
            node[keys[-1]] = value
    return config


def _method_entry(configs: Path, stems: list[str], label: str) -> str | dict[str, Any]:
    """The entry of the method labelled ``label`` in the first of ``stems``' configs holding one."""
    for stem in stems:
        for method in yaml.safe_load((configs / f"{stem}.yaml").read_text())["methods"]:
            if _label(method) == label:
                return method
    raise ValueError(f"--compute-match {label}: no config of the plans ({', '.join(stems)}) has a method labelled "
                     f"{label!r}")


def compute_matched(config: dict[str, Any], reference: str, stems: list[str],
                    configs: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config`` (one method) with the local steps that compute matching to method ``reference`` gives it, and
    what was measured: ``{"reference", "flops", "server_flops", "cost_ratio", "local_steps"}``."""
    from rayfed.simulation import Simulation

    label, train = _label(config["methods"][0]), config.get("train", {})
    measured = {**config, "train": {**train, "compute_match": {"reference": reference}}}
    if label != reference:
        measured["methods"] = [*config["methods"], _method_entry(configs, stems, reference)]
    costs = Simulation(measured, progress=False).compute_costs()[label]
    return {**config, "train": {**train, "local_steps": costs["local_steps"]}}, {"reference": reference, **costs}


def _relevance(run_dir: Path, label: str) -> dict[str, Any]:
    from rayfed.results.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(run_dir / "checkpoints", label)
    if checkpoint is None or "relevance" not in checkpoint.server:
        return {}
    relevance = checkpoint.server["relevance"]
    found = {"history": relevance["history"].tolist()} if "history" in relevance else {}
    if "cosine" in relevance:
        found["cosine"] = relevance["cosine"].tolist()
    alignment = checkpoint.server.get("alignment", {})
    if alignment:
        found["alignment"] = {name: float(value) for name, value in alignment.items()}
    return found


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if job["device"] == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.set_num_threads(job["threads"])
    from rayfed.simulation import Simulation

    started = time.time()
    label = job["label"]
    configs = Path(job["configs"])
    config = job_config(configs, job["config"], label, job["overrides"], job["seed"], job["extra"])
    run_dir = Path(job["run_dir"])
    matched = {}
    try:
        if job["resume"] and any((run_dir / "checkpoints").glob("*")):
            summary = Simulation.resume(run_dir, progress=False).run()
        else:
            if job["resume"] and run_dir.exists():  # a job stopped before its first checkpoint starts afresh
                shutil.rmtree(run_dir)
            if job["compute_match"] is not None:
                config, matched = compute_matched(config, job["compute_match"], [job["config"], *job["stems"]],
                                                  configs)
            if job["checkpoint_every"] is not None:  # how often a job keeps its state: not part of its numbers
                config.setdefault("federation", {})["checkpoint_every"] = job["checkpoint_every"]
            summary = Simulation(config, out_dir=run_dir, progress=False).run()
    except Exception:  # noqa: BLE001 - one failed job must not stop the others
        return {**_key(job), "error": traceback.format_exc()[-2000:]}
    method = summary["methods"][label]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curves = [{k: v for k, v in e.items() if k not in ("event", "method")} for e in events
              if e.get("event") == "eval" and e.get("method") == label]
    return {**_key(job), "stream": method.get("stream", {}), "mean": method["mean"], "clients": method["clients"],
            "curves": curves, "comm_bytes": summary["comm_bytes"][label],
            "comm_params": summary["comm_params"][label], "wall_s": round(time.time() - started, 1),
            "device": "cuda" if torch.cuda.is_available() else "cpu", **_relevance(run_dir, label),
            **({"compute_match": matched} if matched else {})}


def _key(job: dict[str, Any]) -> dict[str, Any]:
    """What tells a job's line apart: plan, config, method, the plan's overrides, ``--set``'s, the seed and the
    compute matching reference (when set)."""
    matching = {"compute_match_reference": job["compute_match"]} if job.get("compute_match") is not None else {}
    return {"plan": job["plan"], "config": job["config"], "label": job["label"], "overrides": job["overrides"],
            "set": job["extra"], "seed": job["seed"], **matching}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_repo_argument(parser)
    parser.add_argument("--plan", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time")
    parser.add_argument("--device", choices=("cpu", "auto"), default="cpu",
                        help="auto: the GPU when there is one (tiny models in many processes sharing one GPU ran "
                             "about 100x slower than on a CPU core each)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per job")
    parser.add_argument("--labels", nargs="*", default=None, help="only these method labels of the plans")
    parser.add_argument("--configs", nargs="*", default=None, metavar="CONFIG",
                        help="only these configs of the plans (paths under configs/ without .yaml)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default=None, help="where the jobs' run folders go (default: <out>/runs)")
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides for every job (key=YAML value)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="ROUNDS",
                        help="keep each job's state every ROUNDS rounds, so that --resume can continue it")
    parser.add_argument("--resume", action="store_true",
                        help="continue each job from its run folder's last checkpoint (a job without one starts "
                             "afresh); with the same --plan, --seeds, --set and --runs as the first call")
    parser.add_argument("--compute-match", default=None, metavar="LABEL",
                        help="local steps per method matched to method LABEL's compute (train.compute_match)")
    args = parser.parse_args(argv)
    configs = configs_of(args.repo).resolve()
    planned = plans(configs)
    unplanned = sorted(set(args.plan) - set(planned))
    if unplanned:
        parser.error(f"--plan {' '.join(unplanned)}: not a plan; choose from {', '.join(sorted(planned))}")
    stems = list(dict.fromkeys(stem for plan in args.plan for stem, _, _ in planned[plan]))
    unknown = sorted(set(args.configs or ()) - set(stems))
    if unknown:
        parser.error(f"--configs {' '.join(unknown)}: not a config of the plans; choose from {', '.join(stems)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) if args.runs else out / "runs"
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    jobs = []
    for plan in args.plan:
        for seed in args.seeds:
            for index, (stem, label, overrides) in enumerate(planned[plan]):
                if (args.labels is not None and label not in args.labels) or \
                        (args.configs is not None and stem not in args.configs):
                    continue
                name = f"{plan}-{index}-{label}-s{seed}"
                jobs.append({"plan": plan, "configs": str(configs), "config": stem, "label": label,
                             "overrides": overrides, "seed": seed, "extra": extra, "device": args.device,
                             "threads": args.threads, "run_dir": str(runs / name),
                             "compute_match": args.compute_match, "stems": stems,
                             "checkpoint_every": args.checkpoint_every, "resume": args.resume})
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool, \
            (out / "results.jsonl").open("a") as results:
        for result in pool.imap_unordered(run_job, jobs):
            results.write(json.dumps(result) + "\n")
            results.flush()
            status = "FAILED" if "error" in result else f"{result['wall_s']} s"
            print(f"[{time.strftime('%H:%M:%S')}] {result['plan']} {result['label']} {result['overrides']} "
                  f"seed {result['seed']}: {status}", flush=True)


if __name__ == "__main__":
    main()
