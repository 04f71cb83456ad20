"""rayfed.params: typed hyperparameter fields, checked when a Params class is built in Python and from a config."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import pytest

from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import build_method
from rayfed.params import (AtLeastOne, Fraction, InvalidHyperparameter, NonNegative, NonNegativeInt, Positive,
                           UnitInterval, hyperparameters)


@hyperparameters
class Knobs:
    weight: NonNegative = 0.5
    temperature: Positive = 1.0
    share: Fraction = 0.5
    mix: UnitInterval = 0.5
    steps: AtLeastOne = 1
    extra: NonNegativeInt = 0
    cap: AtLeastOne | None = None
    mode: Literal["fast", "exact"] = "fast"
    sizes: tuple[float, ...] = (1.0,)
    calls: typing.ClassVar[list[str]] = []

    def __post_init__(self) -> None:  # a check across fields
        type(self).calls.append(self.mode)
        if self.mode == "exact" and self.cap is None:
            raise ValueError("mode = exact needs a cap")


@pytest.mark.parametrize(("field", "ok", "bad", "allowed"), [
    ("weight", [0, 0.0, 3], [-1e-9, -1], ">= 0"),
    ("temperature", [1e-12, 5], [0, -1], "> 0"),
    ("share", [1e-12, 1], [0, 1.0000001, 2], "in (0, 1]"),
    ("mix", [0, 1], [-0.1, 1.1], "in [0, 1]"),
    ("steps", [1, 7], [0, -3], ">= 1"),
    ("extra", [0, 2], [-1], ">= 0"),
    ("cap", [None, 1], [0], ">= 1 or null"),
    ("mode", ["fast", "exact"], ["quick", "FAST"], "one of 'fast', 'exact'"),
])
def test_each_constraint_keeps_its_bounds_inclusive_or_exclusive_and_says_them(field, ok, bad, allowed):
    for value in ok:
        assert getattr(Knobs(**{"cap": 1, field: value}), field) == value
    for value in bad:
        with pytest.raises(InvalidHyperparameter) as info:
            Knobs(**{"cap": 1, field: value})
        assert str(info.value) == f"{field} = {value!r} is invalid: must be {allowed}."
        assert (info.value.field, info.value.value) == (field, value)


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("weight", "heavy", "a number >= 0"), ("steps", 1.5, "an integer >= 1"), ("cap", "all", "an integer >= 1 or null"),
    ("mode", 3, "one of 'fast', 'exact'"), ("weight", math.nan, ">= 0"),
])
def test_a_value_of_the_wrong_type_is_told_the_kind_and_the_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^{field} = .* is invalid: must be {allowed}\.$".replace("(", r"\(")):
        Knobs(**{field: value})


def test_direct_construction_coerces_as_a_config_does_and_runs_the_cross_field_check_after():
    knobs = Knobs(weight=2, steps=3.0, sizes=[1, 2])
    assert knobs.weight == 2.0 and isinstance(knobs.weight, float) and knobs.steps == 3 and knobs.sizes == (1.0, 2.0)
    with pytest.raises(ValueError, match="^mode = exact needs a cap$"):
        Knobs(mode="exact")
    Knobs.calls.clear()
    with pytest.raises(InvalidHyperparameter):
        Knobs(mode="exact", steps=0)  # the typed check comes first: the cross-field check never sees a bad value
    assert Knobs.calls == []
    with pytest.raises(InvalidHyperparameter, match=r"^sizes = \['x'\] is invalid: input should be a valid number.*"
                                                    r"\(at sizes\[0\]\)\.$"):
        Knobs(sizes=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        knobs.weight = 1.0


def test_a_subclass_keeps_the_typed_check_and_its_bases_cross_field_check():
    @hyperparameters
    class More(Knobs):
        depth: AtLeastOne = 2

    @dataclasses.dataclass(frozen=True)
    class Plain(Knobs):  # a user's plain dataclass over a built-in Params
        depth: AtLeastOne = 2

    for cls in (More, Plain):
        assert cls(depth=3, weight=1).depth == 3
        with pytest.raises(InvalidHyperparameter, match=r"^depth = 0 is invalid: must be >= 1\.$"):
            cls(depth=0)
        with pytest.raises(InvalidHyperparameter, match=r"^temperature = 0 is invalid: must be > 0\.$"):
            cls(temperature=0)
        with pytest.raises(ValueError, match="^mode = exact needs a cap$"):
            cls(mode="exact")


def _built(params: dict) -> object:
    return build_method(load_config({"methods": [params]}).methods[0], 0)


@pytest.mark.parametrize(("entry", "sentence"), [
    ({"name": "fedprox", "mu": -1}, "methods[0] (fedprox).mu = -1 is invalid: must be >= 0."),
    ({"name": "feddyn", "alpha": 0}, "methods[0] (feddyn).alpha = 0 is invalid: must be > 0."),
    ({"name": "fedmosaic", "sample_ratio": 1.5}, "methods[0] (fedmosaic).sample_ratio = 1.5 is invalid: must be in "
                                                 "(0, 1]."),
    ({"name": "fedmosaic", "align_samples": 1}, "methods[0] (fedmosaic).align_samples = 1 is invalid: must be >= 2 "
                                                "or null."),
    ({"name": "feddpa", "local_weight": -0.5}, "methods[0] (feddpa).local_weight = -0.5 is invalid: must be in "
                                               "[0, 1]."),
    ({"name": "ditto", "personal_steps": "many"}, "methods[0] (ditto).personal_steps = 'many' is invalid: must be an "
                                                  "integer >= 1 or null."),
    ({"name": "fedmosaic", "relevance": "x"}, "methods[0] (fedmosaic).relevance = 'x' is invalid: must be one of "
                                              "'rela', 'equal', 'frozen_current', 'training_current'."),
    ({"name": "takfl", "lambdas": "fixed"}, "methods[0] (takfl).lambdas = 'fixed' is invalid: lambda_matrix must be "
                                            "given exactly when lambdas = fixed."),
])
def test_a_config_value_is_refused_in_one_sentence_naming_the_field_value_and_what_is_allowed(entry, sentence):
    with pytest.raises(ConfigError) as info:
        _built(entry)
    assert str(info.value) == sentence


def test_a_config_value_is_coerced_and_passed_through_to_the_method():
    method = _built({"name": "takfl", "lambdas": "fixed", "lambda_matrix": [[0.5, 0.5], [1, 0]], "kd_epochs": 2.0})
    assert method.params.lambda_matrix == ((0.5, 0.5), (1.0, 0.0)) and method.params.kd_epochs == 2
    with pytest.raises(ConfigError, match=r"^methods\[0\] \(takfl\)\.lambda_matrix = \[\[-0\.5, 1\.5\]\] is invalid: "
                                          r"input should be greater than or equal to 0 "
                                          r"\(at lambda_matrix\[0\]\[0\]\)\.$"):
        _built({"name": "takfl", "lambdas": "fixed", "lambda_matrix": [[-0.5, 1.5]]})


def test_a_plain_dataclass_params_is_checked_against_its_annotations_too():
    from rayfed.method import _validated_params

    @dataclasses.dataclass(frozen=True)
    class UserParams:
        rate: Positive = 0.1
        style: Literal["a", "b"] = "a"

    assert _validated_params(UserParams, {"rate": 1}, "methods[0] (mine)") == UserParams(rate=1.0)
    with pytest.raises(ConfigError, match=r"^methods\[0\] \(mine\)\.style = 'c' is invalid: must be one of 'a', "
                                          r"'b'\.$"):
        _validated_params(UserParams, {"style": "c"}, "methods[0] (mine)")


def _builtin_params() -> list[type]:
    import rayfed.methods
    from rayfed.methods.tap.options import MoMEOptions

    return [getattr(rayfed.methods, name) for name in sorted(dir(rayfed.methods)) if name.endswith("Params")] + [
        MoMEOptions]


@pytest.mark.parametrize("cls", _builtin_params(), ids=lambda cls: cls.__name__)
def test_every_builtin_params_class_is_typed_and_its_annotations_resolve(cls):
    hints = typing.get_type_hints(cls, include_extras=True)  # an unresolved name would leave its field unchecked
    assert cls.__post_init__.__qualname__.startswith("hyperparameters.")
    assert dataclasses.replace(cls()) == cls()
    numbers = [f.name for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]
    assert not numbers, f"{cls.__name__}: {numbers} take any number; give them a constraint type"


def test_the_choice_tables_the_code_reads_list_exactly_the_allowed_values():
    from rayfed.methods.pfedmma import method as pfedmma

    assert tuple(pfedmma.VARIANTS) == typing.get_args(pfedmma.Variant)
