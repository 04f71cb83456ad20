"""TensorBoard: event files written with tensorboardX (which Ray Tune writes its own with).

A run writes ``<log_dir>/<group>/<label>/`` per method (its hyperparameters in the HParams tab, its values as
scalars) and ``<log_dir>/<group>/`` for the config's run (the config as text; at the end the report's figures as
images, report.md and summary.json as text), so ``tensorboard --logdir <log_dir>`` shows the methods side by side
and the runs of several days apart. A sweep's trials are Ray Tune's own event files (``TBXLoggerCallback``: the
sampled values as hyperparameters), in each trial's folder of ``tune/experiment/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import tensorboardX
import yaml
from PIL import Image
from tensorboardX.summary import hparams

from rayfed.config import TensorBoardTracking
from rayfed.tracking.protocol import RUN, Site


class TensorBoardRun:
    name: ClassVar[str] = "tensorboard"
    follows_sweeps: ClassVar[bool] = False

    def __init__(self, options: TensorBoardTracking, site: Site):
        log_dir = Path(options.log_dir).expanduser() if options.log_dir else site.folder / "tensorboard"
        self.root = log_dir / site.group
        self.writers: dict[str, tensorboardX.SummaryWriter] = {}

    def open(self, key: str, title: str, hyperparameters: dict[str, Any], kept: str | None) -> str:
        folder = self.root / key if key != RUN else self.root
        writer = self.writers[key] = tensorboardX.SummaryWriter(str(folder))
        if kept is None and key == RUN:
            writer.add_text("config", "```yaml\n" + yaml.safe_dump(hyperparameters, sort_keys=False) + "```")
        elif kept is None:
            _, session_start, _ = hparams({name: _hparam(value) for name, value in hyperparameters.items()}, {})
            writer.file_writer.add_summary(session_start)
        writer.flush()
        return str(folder)

    def log(self, key: str, step: int, values: dict[str, float]) -> None:
        writer = self.writers[key]
        for name, value in values.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def attach(self, key: str, files: list[Path]) -> None:
        writer = self.writers[key]
        for file in files:
            if file.suffix == ".png":
                writer.add_image(f"report/{file.stem}", np.asarray(Image.open(file).convert("RGB")), dataformats="HWC")
            else:
                fence = "json" if file.suffix == ".json" else ""
                text = file.read_text() if file.suffix == ".md" else f"```{fence}\n{file.read_text()}```"
                writer.add_text(file.name, text)
        writer.flush()

    def close(self, key: str, failed: bool) -> None:
        self.writers.pop(key).close()

    def tune_callback(self) -> Any:
        from ray.tune.logger import TBXLoggerCallback

        return TBXLoggerCallback()


def _hparam(value: Any) -> bool | int | float | str:
    """A value TensorBoard's HParams tab shows: a number, a bool or a string (anything else as its JSON)."""
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
