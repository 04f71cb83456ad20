"""The method contract's shape: the DriverActor owns a mixture's rows (a method need not call super()), named slots,
stages declared as values (the old flags through one compatibility shim), the core and optional hooks, and the one
module a method author imports from."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch

import rayfed
from rayfed.aggregation import MixedServer, Mixture
from rayfed.errors import ConfigError
from rayfed.method import CORE_HOOKS, OPTIONAL_HOOKS, Method
from rayfed.stages import AfterFederationStage, PreFederationStage, PublicPassStage, declared, public_pass_count
from rayfed.types import Slot

from test_aggregation import W, _driver, _round

ROOT = Path(__file__).resolve().parents[1]


class WithoutSuper(Method):
    """A mixture whose init_server builds its server state alone, never calling ``super()``."""

    aggregation = Mixture(weights="mix/w")

    def init_server(self, initial_shared):
        return {"mix": {"w": W.clone()}}


def test_a_mixture_whose_init_server_skips_super_still_gets_its_rows_and_payloads(tiny_run):
    driver = _driver(tiny_run, {"": {"w": torch.zeros(2)}}, method=WithoutSuper)
    assert not hasattr(driver.method, "mixed_rows")  # the rows' index is the driver's, not the method's
    assert torch.equal(driver.get_state()[Slot.ROWS]["w"], torch.zeros(3, 2))
    x = {0: torch.tensor([4.0, -8.0]), 1: torch.tensor([2.0, 6.0]), 2: torch.tensor([16.0, 0.5])}
    _round(driver, {c: {"w": x[c]} for c in range(3)})
    payloads = driver.payloads([0, 1, 2], count_bytes=False)
    for i in range(3):
        assert torch.equal(payloads[i]["w"], sum(W[i, j] * x[j] for j in range(3))), i


def test_the_state_a_mixture_hook_gets_pickles_as_a_plain_dict_and_a_bare_dict_is_refused_in_one_sentence(tiny_run):
    driver = _driver(tiny_run, {"": {"w": torch.zeros(2)}}, method=WithoutSuper)
    server = driver.get_state()
    assert isinstance(server, MixedServer)
    copied = pickle.loads(pickle.dumps(server))
    assert type(copied) is dict and set(copied) == set(server)  # a checkpoint or Ray gets the slots alone
    with pytest.raises(ConfigError, match=r"^WithoutSuper\.payload mixes the rows of a server state the DriverActor "
                                          r"hands out, but got a dict: pass the state as it was given\.$"):
        driver.method.payload(copied, 0)


def test_slots_equal_their_bare_strings_and_an_unknown_one_is_refused_naming_the_allowed():
    assert Slot.SHARED == "shared" and {"shared": 1}[Slot.SHARED] == 1 and f"{Slot.ROWS}/w" == "stacks/w"
    assert Slot("global") is Slot.GLOBAL
    with pytest.raises(ConfigError, match=r"^'body' is not a rayfed slot; the slots are 'shared', 'global', "
                                          r"'personal', 'stacks'\.$"):
        Slot("body")


def test_a_default_hook_reading_a_slot_the_state_lacks_says_which_and_names_the_slots():
    with pytest.raises(ConfigError, match=r"^Method\.eval_params's client state has no slot 'personal' \(its slots: "
                                          r"'own'\); the default hooks read the slots 'shared', 'global', 'personal', "
                                          r"'stacks': override"):
        Method().eval_params({"own": {}}, None)


def test_stages_are_values_the_engine_reads_and_a_hook_without_its_stage_is_refused():
    class Distils(Method):
        stages = (PreFederationStage(), PublicPassStage(3))

        def pre_federation(self, stage):
            return {}

    assert declared(Distils(), PreFederationStage) == PreFederationStage() and public_pass_count(Distils()) == 3
    assert declared(Method(), AfterFederationStage) is None and public_pass_count(Method()) == 0
    with pytest.raises(TypeError, match=r"^Forgets overrides public_request, after_public_pass but its stages do not "
                                        r"declare PublicPassStage, so the engine would never run it: add "
                                        r"rayfed\.PublicPassStage\(count\) to Forgets\.stages\.$"):
        type("Forgets", (Method,), {"stages": (AfterFederationStage(),), "public_request": lambda *a: {},
                                    "after_public_pass": lambda *a: {}})
    with pytest.raises(ValueError, match=r"PublicPassStage\.count = 0 must be an integer >= 1"):
        PublicPassStage(0)
    with pytest.raises(TypeError, match=r"^Twice\.stages declares PreFederationStage twice"):
        type("Twice", (Method,), {"stages": (PreFederationStage(), PreFederationStage())})


def test_the_old_stage_flags_still_work_through_the_shim_with_one_deprecation_sentence():
    with pytest.warns(FutureWarning, match=r"^Old: pre_federation_stage = True, public_passes = 2, an "
                                           r"after_federation is deprecated; declare stages = "
                                           r"\(rayfed\.PreFederationStage\(\), rayfed\.PublicPassStage\(2\), "
                                           r"rayfed\.AfterFederationStage\(\)\) instead\.$"):
        old = type("Old", (Method,), {"pre_federation_stage": True, "public_passes": 2,
                                      "after_federation": lambda self, client, state, payload: state})
    assert old.stages == (PreFederationStage(), PublicPassStage(2), AfterFederationStage())
    with pytest.warns(FutureWarning, match=r"^Off: public_passes = 0 is deprecated; declare stages = "
                                           r"\(rayfed\.PreFederationStage\(\), rayfed\.AfterFederationStage\(\)\)"):
        off = type("Off", (old,), {"public_passes": 0})
    assert off.stages == (PreFederationStage(), AfterFederationStage())
    with pytest.raises(TypeError, match=r"^Both sets both stages and public_passes; declare its stages in stages"):
        type("Both", (Method,), {"stages": (), "public_passes": 1})


def test_every_public_method_of_method_is_a_core_or_optional_hook_or_the_split_helper_and_the_docs_list_them():
    public = {name for name, value in vars(Method).items()
              if callable(value) and not isinstance(value, type) and not name.startswith("_")}
    assert public == {*CORE_HOOKS, *OPTIONAL_HOOKS, "split"} and not set(CORE_HOOKS) & set(OPTIONAL_HOOKS)
    text = (ROOT / "docs" / "extending.md").read_text()
    table = text[text.index("| hook | core or optional |"):]
    table = table[:table.index("\n\n")]
    rows = dict(re.findall(r"^\| `(\w+)\([^|]*\| (core|optional) \|", table, re.M))
    assert rows == {**dict.fromkeys(CORE_HOOKS, "core"), **dict.fromkeys(OPTIONAL_HOOKS, "optional")}


def test_the_rayfed_module_exports_what_the_built_in_methods_import_from_the_engine():
    """A method author imports from ``rayfed`` alone: every engine name the built-in methods take from
    rayfed.aggregation is there, with the types, slots and stages a method declares."""
    wanted = set()
    for path in (ROOT / "methods").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "rayfed.aggregation":
                wanted |= {alias.name for alias in node.names}
    wanted |= {"Method", "LocalResult", "Upload", "NoParams", "Slot", "ClientState", "ServerState", "TensorDict",
               "PreFederationStage", "PublicPassStage", "AfterFederationStage", "weighted_mean", "weighted_sums"}
    missing = sorted(name for name in wanted if name not in rayfed.__all__)
    assert not missing
    assert all(getattr(rayfed, name) is not None for name in wanted)
