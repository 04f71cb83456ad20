"""The `rayfed` command: run a config, resume a run, summarize a config's client data, prepare a benchmark's data from
its public files, list what is registered."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rayfed.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

# `rayfed bench --workload`: benchmarks/overhead.py's WORKLOADS (named here so that the parser imports no benchmark)
GENERIC_WORKLOADS = ("cpu", "gpu", "llm", "llm-cpu")


class _Workloads(Sequence[str]):
    """``--workload``'s choices: :data:`GENERIC_WORKLOADS`, then the seed methods' workloads that
    benchmarks/method_bench.py holds, looked up when the option is given or its help shown (hence the option's
    metavar: argparse formats the choices of one without a metavar as it adds it)."""

    def _names(self) -> list[str]:
        from rayfed.benchmarks.method_bench import METHOD_WORKLOADS

        return [*GENERIC_WORKLOADS, *METHOD_WORKLOADS]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())


def _run(args: argparse.Namespace) -> int:
    from rayfed.simulation import Simulation

    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume continues a run with its own config.yaml; give no CONFIG or key=value with it.")
    elif not args.config:
        raise ConfigError("rayfed run needs a CONFIG file (or --resume RUN_DIR).")
    sim = None
    try:
        if args.resume:
            sim = Simulation.resume(args.resume, progress=not args.quiet)
        else:
            overrides = list(args.overrides)
            if args.seed is not None:
                overrides.append(f"seed={args.seed}")
            if args.address:
                overrides.append(f"ray.address={args.address}")
            sim = Simulation(args.config, overrides=overrides, out_dir=args.out, progress=not args.quiet)
        summary = sim.run()
    except BaseException as err:
        if not _interrupted(err):
            raise
        _close_progress_bars()
        print(interrupted_message(None if sim is None else sim.run_dir, args.quiet), file=sys.stderr)
        return INTERRUPTED
    print(f"results: {sim.run_dir}")
    for label, result in summary["methods"].items():
        means = ", ".join(f"{k}={v:.4f}" for k, v in result["mean"].items())
        print(f"  {label}: {means}")
    return 0


INTERRUPTED = 130  # a shell's exit status for a command stopped by Ctrl-C (128 + SIGINT)


def _interrupted(err: BaseException | None) -> bool:
    """Whether Ctrl-C stopped the run: a KeyboardInterrupt, or an error raised while the run was stopping on one
    (Ray's processes get the terminal's SIGINT too)."""
    while err is not None:
        if isinstance(err, KeyboardInterrupt):
            return True
        err = err.__context__
    return False


def _close_progress_bars() -> None:
    """Close the bars a stopped run left open: they would print again over the last lines when the process ends."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def interrupted_message(run_dir: Path | None, quiet: bool = False) -> str:
    """What ``rayfed run`` prints when Ctrl-C stops it: one sentence saying what ``run_dir`` keeps of each method
    (its results, or the round of its last checkpoint), then the command that resumes the run from there."""
    import shlex

    import yaml

    from rayfed.results.checkpoint import latest_round

    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return "rayfed: interrupted before the run wrote anything to resume from; run the same command again."
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    federation, kept, restarted = config["federation"], [], []
    for entry in config["methods"]:
        label = entry["label"]
        done = latest_round(run_dir / "checkpoints", label)
        if (run_dir / "results" / f"{label}.json").is_file():
            kept.append(f"{label}'s results")
        elif done is not None:
            kept.append(f"{label}'s checkpoint of round {done} of {federation['rounds']}")
        else:
            restarted.append(label)
    saved = ", ".join(kept) if kept else "no results or checkpoints"
    if restarted:
        unsaved = f"{', '.join(restarted)} restart{'s' if len(restarted) == 1 else ''} at round 1"
        if not federation["checkpoint_every"]:
            unsaved += " (federation.checkpoint_every = 0 writes no checkpoints)"
        saved += f"; {unsaved}"
    command = f"rayfed run --resume {shlex.quote(str(run_dir))}" + (" --quiet" if quiet else "")
    return f"rayfed: interrupted; {run_dir} keeps {saved}. Resume it with:\n  {command}"


def _tune(args: argparse.Namespace) -> int:
    from rayfed.tune import resume, tune

    if args.resume:
        if args.config or args.overrides or args.out or args.address:
            raise ConfigError(
                "--resume continues a sweep with its own sweep.yaml; give no CONFIG, key=value, --out or --address "
                "with it (RAY_ADDRESS attaches it to a cluster)."
            )
        result = resume(args.resume)
    else:
        if not args.config:
            raise ConfigError("rayfed tune needs a CONFIG file with a tune: section (or --resume RUN_DIR).")
        overrides = list(args.overrides)
        if args.address:
            overrides.append(f"ray.address={args.address}")
        result = tune(args.config, overrides=overrides, out_dir=args.out, verbose=0 if args.quiet else 1)
    print(f"results: {result.tune_dir}")
    statuses = [trial.status for trial in result.trials]
    count = {status: statuses.count(status) for status in ("completed", "stopped early", "error")}
    print(f"  trials: {count['completed']} completed, {count['stopped early']} stopped early, "
          f"{count['error']} errored")
    values = ", ".join(f"{path}={value}" for path, value in result.best.params.items())
    print(f"  best: {result.metric}={result.best.metric:.4f} ({values})")
    print(f"  best config: {result.best_config}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from rayfed.benchmarks.method_bench import METHOD_WORKLOADS, run_method_bench
    from rayfed.benchmarks.overhead import run_bench, workload_named

    if (args.profile or args.profile_trace) and (args.workload not in METHOD_WORKLOADS or args.gpu_counts is not None):
        raise ConfigError(f"--profile profiles a seed method's local update ({', '.join(METHOD_WORKLOADS)}), without "
                          f"--gpu-counts; got --workload {args.workload}"
                          f"{' with --gpu-counts' if args.gpu_counts is not None else ''}.")
    if args.gpu_counts is not None:
        if args.workload not in METHOD_WORKLOADS:
            raise ConfigError(f"--gpu-counts is for a seed method's workload ({', '.join(METHOD_WORKLOADS)}); "
                              f"--workload {args.workload} sweeps the GPU counts itself.")
        if args.ideal_apart or args.ideal_only:
            raise ConfigError("--gpu-counts runs no ideal; give it without --ideal-apart and --ideal-only.")
        from rayfed.benchmarks.gpu_scaling import run_gpu_scaling

        run_gpu_scaling(args.workload, Path(args.out), args.gpu_counts, rounds=args.rounds, smoke=args.smoke,
                        overrides=tuple(args.overrides))
    elif args.workload in METHOD_WORKLOADS:
        run_method_bench(args.workload, Path(args.out), rounds=args.rounds, smoke=args.smoke,
                         overrides=tuple(args.overrides), reference=not args.no_reference,
                         ideal_apart=args.ideal_apart, ideal_only=args.ideal_only,
                         profile=args.profile or args.profile_trace, profile_trace=args.profile_trace)
    if args.workload in METHOD_WORKLOADS:
        print((Path(args.out) / "bench.md").read_text())
        print(f"results: {args.out}/bench.json, {args.out}/bench.md")
        return 0
    workload = workload_named(args.workload)
    workload = dataclasses.replace(workload, compile=args.compile or workload.compile, batch_clients=args.batch_clients,
                                   rounds=args.rounds or workload.rounds)
    results = run_bench(workload, tuple(args.actors_per_gpu), Path(args.out), repeats=args.repeats)
    print((Path(args.out) / "bench.md").read_text())
    print(f"results: {args.out}/bench.json, {args.out}/bench.md ({len(results['runs'])} runs)")
    return 0


def _data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rayfed.data.summary import format_summary
    from rayfed.simulation import Simulation

    if not args.config:
        raise ConfigError("rayfed data needs a CONFIG file.")
    if args.rows < 1:
        raise ConfigError(f"--rows = {args.rows} is invalid: it must be >= 1 (clients shown in the table).")
    sim = Simulation(args.config, overrides=list(args.overrides), progress=False)
    # Beside runs/<name>/ rather than in it: a run then still starts in runs/<name>/, not runs/<name>-2/.
    png = Path(args.out) / "data.png" if args.out else Path("runs") / f"{sim.config.name}-data.png"
    summary = sim.data_summary(png)
    print(format_summary(summary, max_rows=args.rows))
    print(f"plot: {png}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from rayfed.data.prepare import describe, prepare

    if args.list:
        for name, text in describe():
            print(f"{name:<20} {text}")
        return 0
    if not args.benchmark:
        raise ConfigError("rayfed prepare needs a BENCHMARK (rayfed prepare --list shows them).")
    prepare(args.benchmark, args.out, args.source)
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from rayfed import zoo
    from rayfed.errors import choice_error

    if args.family != "all" and args.family not in zoo.FAMILIES:
        raise choice_error("family", args.family, [*zoo.FAMILIES, "all"])
    for name, folder in zoo.build_all(None if args.family == "all" else [args.family], args.jobs):
        manifest = zoo.read_manifest(folder)
        before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
        changes = ", ".join(f"{metric} {before[metric]:.3f} -> {after[metric]:.3f}" for metric in after)
        print(f"{name}: {folder} ({manifest['params']:,} params, built in {manifest['build_seconds']} s); {changes}")
    return 0


def _list(args: argparse.Namespace) -> int:
    import importlib

    from rayfed import registry

    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"--import {module!r}: the module cannot be imported ({err}).") from None
    shown = {"method": "method", "source": "dataset", "partitioner": "partitioner", "backbone": "backbone",
             "client_model": "client_model", "task_kind": "task_kind", "preparer": "preparer"}
    for kind, title in shown.items():
        for entry in registry.entries(kind):
            name = entry.name + ("<...>" if entry.prefix else "")
            origin = "" if entry.builtin else f"  [{getattr(entry.obj, '__module__', '?')}]"
            print(f"{title:<12} {name:<32} {entry.help}{origin}")
    return 0


def _add_config_file_arguments(parser: argparse.ArgumentParser, out_help: str) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    parser.add_argument("--out", help=out_help)


def _add_config_arguments(parser: argparse.ArgumentParser, out_help: str, resume_help: str, quiet_help: str) -> None:
    _add_config_file_arguments(parser, out_help)
    parser.add_argument("--address", help="attach to a Ray cluster (default: $RAY_ADDRESS, else local Ray)")
    parser.add_argument("--resume", metavar="RUN_DIR", help=resume_help)
    parser.add_argument("--quiet", action="store_true", help=quiet_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayfed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run every method of a config on the same clients")
    _add_config_arguments(run, out_help="run directory (default: runs/<name>)",
                          resume_help="continue an interrupted run from its checkpoints", quiet_help="no progress bars")
    run.add_argument("--seed", type=int, help="shorthand for seed=N")
    run.set_defaults(handler=_run)

    sweep = commands.add_parser("tune", help="sweep hyperparameters with Ray Tune (the config's tune: section)")
    _add_config_arguments(sweep, out_help="results go to OUT/tune (default: runs/<name>/tune)",
                          resume_help="continue an interrupted sweep (RUN_DIR or RUN_DIR/tune)",
                          quiet_help="no Ray Tune status output")
    sweep.set_defaults(handler=_tune)

    bench = commands.add_parser("bench", help="time a fixed FL workload against a plain PyTorch loop")
    bench.add_argument("--workload", choices=_Workloads(), default="cpu", metavar="WORKLOAD",
                       help="one of %(choices)s. cpu: a tiny ViT smoke size; gpu: open_clip ViT-B/16 + LoRA, "
                       "100 clients, 16 per round; "
                       "llm: a Llama-3.2-1B-shaped model + LoRA r16, text generation on 512-token sequences, "
                       "20 clients, 4 per round; llm-cpu: the same on a tiny Llama; "
                       "the others: a seed paper's method at its paper's model size (its paper config's offline "
                       "twin) against the same method's code in one plain process (benchmarks/method_bench.py)")
    bench.add_argument("--actors-per-gpu", type=int, nargs="+", default=[1, 2, 4], help="packings to sweep")
    bench.add_argument("--repeats", type=int, default=1,
                       help="run the sweep this many times; each packing's median overhead ratio is reported")
    bench.add_argument("--compile", action="store_true",
                       help="train.compile on (rayfed's clients and the ideal loop alike)")
    bench.add_argument("--batch-clients", type=int, default=1,
                       help="train.batch_clients for rayfed's actors (the ideal loop trains one client at a time)")
    bench.add_argument("--rounds", type=int, choices=range(2, 1001), metavar="{2..1000}",
                       help="rounds a run, the first a warm-up (default: the workload's)")
    bench.add_argument("--smoke", action="store_true",
                       help="a seed method's workload on its tiny offline config instead of the paper-size twin")
    bench.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                       help="a seed method's workload: config overrides, as rayfed run --set")
    bench.add_argument("--no-reference", action="store_true",
                       help="a seed method's workload: skip the plain LoRA FedAvg run its TFLOP/s is compared with")
    bench.add_argument("--ideal-apart", action="store_true",
                       help="a seed method's workload: run the ideal's rounds all first and release it (its models "
                       "and GPU memory) before rayfed's run, for a GPU that cannot hold both; the rounds are not "
                       "interleaved")
    bench.add_argument("--ideal-only", action="store_true",
                       help="a seed method's workload: run only the ideal's rounds (no rayfed run, no evaluation), "
                       "for the TFLOP/s of its local updates against the LoRA FedAvg reference's")
    bench.add_argument("--gpu-counts", type=int, nargs="+", metavar="N",
                       help="a seed method's workload: rayfed's run alone on each of these GPU counts of this host "
                       "(a fresh Ray instance each), the speed-up over the first count; no ideal "
                       "(benchmarks/gpu_scaling.py)")
    bench.add_argument("--profile", action="store_true",
                       help="a seed method's workload: after the method's rounds, profile one steady local update "
                       "with torch.profiler into OUT/profile/{profile.json,profile.md} (benchmarks/update_profile.py)")
    bench.add_argument("--profile-trace", action="store_true",
                       help="--profile, and write its chrome trace too (OUT/profile/trace.json, large)")
    bench.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.md")
    bench.set_defaults(handler=_bench)

    data = commands.add_parser("data", help="each client's train / test counts and label (or task) histogram, "
                               "before a run: a table and a PNG")
    _add_config_file_arguments(data, out_help="folder for data.png (default: the file runs/<name>-data.png)")
    data.add_argument("--rows", type=int, default=40, help="clients shown in the table (all are in the PNG)")
    data.set_defaults(handler=_data)

    preparing = commands.add_parser(
        "prepare", help="build a benchmark's folders, which its paper configs read, from its public files")
    preparing.add_argument("benchmark", nargs="?", help="a benchmark (--list shows them)")
    preparing.add_argument("--out", help="folder to write (default: the one the benchmark's configs read)")
    preparing.add_argument("--source", action="append", default=[], metavar="DIR_OR_ARCHIVE",
                           help="a folder or archive (zip, tar) holding files already downloaded; repeatable. What is "
                           "not found there is downloaded where it is public; the rest is named, with where to get it")
    preparing.add_argument("--list", action="store_true", help="the benchmarks and what each builds")
    preparing.set_defaults(handler=_prepare)

    pretrain = commands.add_parser("pretrain", help="build a family's tiny pretrained model, cached in $RAYFED_CACHE")
    pretrain.add_argument("family", help="a model family (docs/offline_models.md lists them) or 'all' (every family "
                          "but GPU-scale ones rayfed does not ship)")
    pretrain.add_argument("--jobs", type=int, default=1, help="families built at once, one process and core each")
    pretrain.set_defaults(handler=_pretrain)

    listing = commands.add_parser(
        "list", help="registered methods, datasets, partitioners, backbones, client models, task kinds and preparers")
    listing.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                         help="import MODULE first (its @rayfed.register_* plug-ins are listed, marked with it)")
    listing.set_defaults(handler=_list)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, but ``key=value`` overrides may also follow options (``run C --quiet seed=1``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


class _DataLines(logging.Handler):
    """The data loader's lines (each hf dataset's host memory and disk, stated before its images are decoded), on
    the stderr of the moment."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"rayfed: {record.getMessage()}", file=sys.stderr)


def _show_data_lines() -> None:
    log = logging.getLogger("rayfed.data")
    if not any(isinstance(handler, _DataLines) for handler in log.handlers):
        log.addHandler(_DataLines())
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    # As under `python -m`: modules in the working folder import (plug-ins named in `imports:` or as
    # "module:Name"); Ray's workers find them there too, or get them by value (simulation.ship_by_value).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = parse_args(argv)
    _show_data_lines()
    try:
        return args.handler(args)
    except ConfigError as err:  # bad config, data or checkpoint: one sentence, no traceback
        print(f"rayfed: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
