"""The `rayfed` command: run a config, resume a run, list what is registered."""

from __future__ import annotations

import argparse
import sys

from rayfed.errors import ConfigError


def _run(args: argparse.Namespace) -> int:
    from rayfed.simulation import Simulation

    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume continues a run with its own config.yaml; give no CONFIG or key=value with it.")
        sim = Simulation.resume(args.resume, progress=not args.quiet)
    else:
        if not args.config:
            raise ConfigError("rayfed run needs a CONFIG file (or --resume RUN_DIR).")
        overrides = list(args.overrides)
        if args.seed is not None:
            overrides.append(f"seed={args.seed}")
        if args.address:
            overrides.append(f"ray.address={args.address}")
        sim = Simulation(args.config, overrides=overrides, out_dir=args.out, progress=not args.quiet)
    summary = sim.run()
    print(f"results: {sim.run_dir}")
    for label, result in summary["methods"].items():
        means = ", ".join(f"{k}={v:.4f}" for k, v in result["mean"].items())
        print(f"  {label}: {means}")
    return 0


def _list(_: argparse.Namespace) -> int:
    from rayfed.data import PARTITIONERS, SOURCES
    from rayfed.methods import METHODS
    from rayfed.models import BACKBONES

    for name, cls in METHODS.items():
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"method       {name:<12} {doc}")
    for name in BACKBONES:
        print(f"backbone     {name}")
    for name in SOURCES:
        print(f"dataset      {name}")
    for name in PARTITIONERS:
        print(f"partitioner  {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayfed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run every method of a config on the same clients")
    run.add_argument("config", nargs="?", help="YAML config file")
    run.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    run.add_argument("--seed", type=int, help="shorthand for seed=N")
    run.add_argument("--out", help="run directory (default: runs/<name>)")
    run.add_argument("--address", help="attach to a Ray cluster (default: $RAY_ADDRESS, else local Ray)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its checkpoints")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.set_defaults(handler=_run)

    listing = commands.add_parser("list", help="registered methods, backbones, datasets and partitioners")
    listing.set_defaults(handler=_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as err:  # bad config, data or checkpoint: one sentence, no traceback
        print(f"rayfed: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
