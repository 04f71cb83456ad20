"""benchmarks/offline_runs.py: every plan's job is one existing method of a valid config."""

from __future__ import annotations

import pytest

from rayfed.benchmarks.offline_runs import PLANS, job_config
from rayfed.config import build_config


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_plan_entry_builds_one_method_of_a_valid_config(plan: str) -> None:
    for stem, label, overrides in PLANS[plan]:
        config = build_config(job_config(stem, label, overrides, seed=3, extra={}))
        assert [entry.label for entry in config.methods] == [label]
        assert config.seed == 3 and config.placement.executor == "local"


def test_a_label_the_config_lacks_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="no method labelled 'nope'"):
        job_config("feddat/offline_domain", "nope", {}, seed=0, extra={})


def test_overrides_reach_nested_method_fields() -> None:
    config = job_config("fedmosaic/offline_dynamic", "fedmosaic", {"methods.0.tau": 2.0}, seed=0,
                        extra={"federation.rounds": 2})
    assert config["methods"][0]["tau"] == 2.0 and config["federation"]["rounds"] == 2
