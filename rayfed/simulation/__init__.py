"""The driver process's side of a run, one job per module:

- :mod:`~rayfed.simulation.run`: :class:`Simulation`, set up fresh or resumed, every method in turn, started again
  after an actor died;
- :mod:`~rayfed.simulation.method_run`: one method's run: restored from its checkpoint, its rounds with their
  evaluations and checkpoints, its final stages and results file;
- :mod:`~rayfed.simulation.rounds`: one round (plan, assign, dispatch, aggregate);
- :mod:`~rayfed.simulation.actors`: the run's ClientActors and DriverActor, started and called together;
- :mod:`~rayfed.simulation.placement`: the actors' slots fitted to the cluster, and which actor trains whom;
- :mod:`~rayfed.simulation.ray_setup`: Ray's start-up, the plug-ins shipped to the actors, actors' errors;
- :mod:`~rayfed.simulation.preflight`: every method's model run on two samples before any actor starts;
- :mod:`~rayfed.simulation.nonfinite`: what a NaN or an infinity does to the run;
- :mod:`~rayfed.simulation.results`: ``metrics.jsonl``, results files, the summary and its means.
"""

from rayfed.simulation.placement import balanced_assignment
from rayfed.simulation.preflight import check_model, sample_batches
from rayfed.simulation.ray_setup import (import_plugin_modules, init_local_ray, init_ray, is_actor_failure,
                                         keep_loopback, ship_by_value, unwrap_actor_error)
from rayfed.simulation.results import (MetricsLog, kind_means, mean_std, rounds_to_target, stream_summary,
                                       task_means)
from rayfed.simulation.run import RoundCallback, Simulation

__all__ = ["MetricsLog", "RoundCallback", "Simulation", "balanced_assignment", "check_model", "import_plugin_modules",
           "init_local_ray", "init_ray", "is_actor_failure", "keep_loopback", "kind_means", "mean_std",
           "rounds_to_target", "sample_batches", "ship_by_value", "stream_summary", "task_means",
           "unwrap_actor_error"]
