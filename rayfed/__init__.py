"""rayfed: personalized federated learning of multi-modal foundation models, simulated on Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from rayfed.config import RunConfig, load_config
    from rayfed.simulation import Simulation

__all__ = ["RunConfig", "Simulation", "__version__", "load_config"]


def __getattr__(name: str) -> Any:
    # Imported on first use so that `import rayfed.config` does not start torch and Ray.
    if name == "Simulation":
        from rayfed.simulation import Simulation

        return Simulation
    if name in ("RunConfig", "load_config"):
        from rayfed import config

        return getattr(config, name)
    raise AttributeError(f"module 'rayfed' has no attribute {name!r}")
