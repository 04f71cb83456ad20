"""TAP (docs/tap.md): the modular MoTE/MoME model and what each client holds, the two stages (replacement,
distillation), what is sent, the aggregation, the baselines (Local, Per-FedAvg, DisentAFL, FedDAT in TAP's model)
and the configs."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfed.tasks import text_metrics
from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import Upload, build_method
from rayfed.methods.tap import MoMEModel, MoMEOptions, task_key
from rayfed.methods.tap.encoders import attention_bias
from rayfed.methods.tap.layers import Expert
from rayfed.tasks.kinds import causal_from_target_logits
from rayfed.models.client import channel_values
from rayfed.models.peft.modules import AdaptedMLP, set_adapter_mix
from rayfed.tasks import sample_round, task_view
from rayfed.state_tree import flatten_tree
from rayfed.training import ClientContext

from conftest import CountedOps, compiled_update_gap, made_instances, method_class

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Four clients on the tiny pretrained FLAVA: 0 image classification, 1 text classification + image generation,
# 2 VQA as text generation (image + text), 3 text classification.
RUN = {
    "name": "tap-tiny",
    "seed": 2,
    "data": {"tasks": [
        {"name": "digits", "source": "sklearn:digits", "max_samples": 48, "clients": [0]},
        {"name": "topics", "source": "multimodal:topics", "options": {"num_samples": 64}, "clients": [1, 3]},
        {"name": "recon", "source": "sklearn:digits", "kind": "reconstruction", "max_samples": 32, "clients": [1]},
        {"name": "vqa", "source": "multimodal:vqa", "kind": "text_generation",
         "options": {"num_samples": 32, "image_size": 16}, "clients": [2]},
    ]},
    "model": {"backbone": "tiny-pretrained:flava", "client": "mome",
              "client_options": {"text_positions": 8, "adapter_dim": 4}},  # b: FedDAT's expert adapters
    "federation": {"rounds": 3, "clients_per_round": 2},
    "train": {"local_steps": 2, "batch_size": 8, "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01,
              "grad_clip": 1.0, "schedule": "round_warmup", "warmup_rounds": 2, "warmup_start_lr": 0.001},
    "methods": [{"name": "tap", "post_fl_microbatches": 2, "post_lr": 0.001}],
    "placement": {"clients_per_actor": 4, "cpus_per_actor": 1},
}
CLIENTS = [0, 1, 2, 3]


def _run(**params) -> dict:
    run = copy.deepcopy(RUN)
    run["methods"][0].update(params)
    return run


@pytest.fixture(scope="module")
def actor() -> ClientActor:
    """One in-process actor hosting every client (the federation and backbone are built once)."""
    torch.set_num_threads(1)
    return ClientActor(load_config(_run()).to_dict(), CLIENTS)


def _start(actor: ClientActor, **params) -> tuple[object, DriverActor]:
    """``actor`` running TAP with ``params`` (a fresh method, model and client states), and its driver."""
    config = load_config(_run(**params))
    return _start_method(actor, "tap", config.methods[0].params, config)


def _start_method(actor: ClientActor, name: str, params: dict, config=None) -> tuple[object, DriverActor]:
    """``actor`` running method ``name`` with ``params`` (a fresh method, model and client states), and its driver."""
    method = method_class(name)(method_class(name).Params(**params))
    method.num_clients, method.tasks, method.rounds = 4, tuple(actor.tasks), 3
    actor.methods = [method]
    driver = DriverActor((config or load_config(_run())).to_dict(), [method])
    driver.start_method(0, [""], actor.start_method(0), actor.task_tags())
    return method, driver


def _rounds(actor: ClientActor, driver: DriverActor, rounds: int, sampled=None) -> list[dict]:
    stats = []
    for round_idx in range(rounds):
        clients = sampled[round_idx] if sampled else CLIENTS
        part = actor.train_round(round_idx, clients, driver.payloads(clients), {c: 1.0 for c in clients})
        stats.append(driver.aggregate(part).get("client_stats", {}))
    return stats


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


# The modular model ------------------------------------------------------------------------------------------
def test_each_client_holds_exactly_the_blocks_of_its_modalities_tasks_and_domains(actor):
    _start(actor)
    model, tasks = actor.model, actor.tasks
    assert isinstance(model, MoMEModel) and model.num_layers == 1  # tiny FLAVA: 2 multimodal layers, L = 1
    assert [task_key(t) for t in tasks] == ["image_classification", "text_classification", "image_generation",
                                            "text_generation"]
    held = {cid: set(actor.initial[cid]) for cid in CLIENTS}
    blocks = {cid: {".".join(n.split(".")[:2]) for n in names} for cid, names in held.items()}
    assert {"encoders.image", "mote.image"} <= blocks[0] and not {"encoders.text", "mote.text"} & blocks[0]
    assert {"encoders.text", "mote.text"} <= blocks[3] and not {"encoders.image", "mote.image"} & blocks[3]
    assert {"encoders.image", "encoders.text"} <= blocks[2]  # VQA reads both
    assert {"mome.text_classification", "mome.image_generation"} <= blocks[1] and "mome.text_generation" not in blocks[1]
    for cid in CLIENTS:
        assert {"shared_proj.weight", "shared_proj.bias"} <= held[cid]
        assert any(n.startswith("mote.shared.") for n in held[cid]) and any(n.startswith("mome.shared.") for n in held[cid])
    # Expert cells: a client holds the ones of its (modality, key) pairs only.
    assert any(n.startswith("mote_experts.0.image.image_classification.") for n in held[0])
    assert not any(n.startswith("mote_experts.0.text.") for n in held[0])
    assert not any(n.startswith("mote_experts.0.image.text_classification.") for n in held[1])
    # Decoders: a classifier per classification task, one head per generation kind.
    assert {n.split(".")[1] for n in held[1] if n.startswith("heads.")} == {"task_1", "image_generation"}
    assert {n.split(".")[1] for n in held[2] if n.startswith("heads.")} == {"text_generation"}
    # MoDE: each domain's q/v experts are held by that domain's clients only (one domain per task by default).
    assert any("mode_q.digits." in n for n in held[0]) and not any("mode_q.topics." in n for n in held[0])
    # Frozen pretrained weights are never trainable; every expert starts from its layer's FFN.
    trainable = set(model.trainable_params())
    assert all("lora_" in n or n.split(".")[0] in ("shared_proj", "heads") or ".proj." in n or ".layer_norm." in n
               or ".input_adaptor." in n for n in trainable)
    layer = actor.backbone.encoder.multimodal_model.encoder.layer[0]
    expert = model.mote_experts["0"]["shared"]["shared"].ffn
    assert torch.equal(expert[0].base_layer.weight, layer.intermediate.dense.weight)


def test_the_shared_decoders_serve_every_task_of_their_kind_and_paths_follow_the_spec(actor):
    _start(actor)
    model = actor.model
    paths = {t.name: model.path_prefixes(t.index) for t in actor.tasks}
    assert "encoders.text." in paths["vqa"] and "encoders.image." in paths["vqa"]
    assert len([p for p in paths["vqa"] if "_experts." in p]) == 12  # 8 cells per modality, 4 of them shared
    assert "heads.task_0." in paths["digits"] and "mome.image_classification." in paths["digits"]
    assert not any(p.startswith(("encoders.text", "mote.text", "mome.text")) for p in paths["digits"])
    assert "heads.image_generation." in paths["recon"] and "heads.text_generation." in paths["vqa"]
    batch = {k: v[:3] for k, v in actor.data[2].parts[0].train.items()}
    model.select_task(3)
    raw = model(batch, raw=True)
    assert raw.shape == (3, 8, len(model.tokenizer))  # parallel decoder: text_positions logits at once
    generated = model.generate_text(batch, 5)
    assert generated.shape == (3, 5)


def test_text_generation_is_scored_from_one_forward_of_the_parallel_decoder(actor):
    _start(actor)
    model = actor.model
    model.eval()
    model.select_task(3)
    batch = {k: v[:5] for k, v in actor.data[2].parts[0].test.items()}
    kind = actor.tasks[3].kind
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    with torch.no_grad():
        rows = kind.score_rows(model, batch)
        assert len(forwards) == 1
        logits = model(batch).float()
        generated = model.generate_text(batch, batch["target_ids"].shape[1])
    hook.remove()
    model.train()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100,
                                            reduction="none").sum(dim=1)
    predictions = model.tokenizer.batch_decode(generated.tolist(), skip_special_tokens=True)
    references = model.tokenizer.batch_decode(batch["target_ids"], skip_special_tokens=True)
    assert torch.equal(rows["nll"], nll.double())
    assert rows["token_f1"].tolist() == [text_metrics.token_f1(p, r) for p, r in zip(predictions, references)]


def test_text_alignment_reads_nothing_back_while_target_ids_bound_every_target(actor):
    _start(actor)
    model = actor.model
    model.select_task(3)
    batch = {k: v[:5] for k, v in actor.data[2].parts[0].train.items()}
    with torch.no_grad():
        raw = model(batch, raw=True)
    assert batch["target_ids"].shape[1] <= raw.shape[1]
    with CountedOps() as reads:
        aligned = model.aligned(raw, batch)
    assert reads.count == 0 and torch.equal(aligned, causal_from_target_logits(raw, batch))
    longest = int((batch["labels"] != -100).sum(dim=1).max())
    with pytest.raises(ConfigError, match=f"a target of {longest} tokens .*text_positions = {longest - 1};"):
        model.aligned(raw[:, :longest - 1], batch)  # a decoder too short: still refused


def test_the_text_encoder_reads_nothing_back_and_gives_transformers_numbers_with_its_own_attention_bias(actor):
    _start(actor)
    encoder = actor.model.encoders["text"]
    batch = actor.data[1].parts[0].train
    ids, mask = batch["input_ids"][:4], batch["attention_mask"][:4]
    assert ids.shape[1] <= encoder.window
    with torch.no_grad(), CountedOps() as reads:
        tokens, out_mask = encoder(ids, mask)
    assert reads.count == 0 and tokens.shape[1] == encoder.window  # transformers' own mask check reads the mask
    padded = torch.nn.functional.pad(ids, (0, encoder.window - ids.shape[1]))
    assert (out_mask == 0).any()
    for attention in (out_mask, torch.ones_like(out_mask)):  # padding, and none (transformers then skips its mask)
        outputs = []
        for given in (attention_bias(attention), attention):
            torch.manual_seed(0)  # the same dropout draws
            with torch.no_grad():
                outputs.append(encoder.backbone(input_ids=padded, attention_mask=given).last_hidden_state)
        assert torch.equal(*outputs)


def test_a_long_texts_windows_are_a_host_choice_that_a_captured_forward_takes_without_reading(actor):
    # train.cuda_graphs: a part's graph is kept per choice (GraphedParts.key) and captured under making_choices
    _start(actor)
    model = actor.model
    encoder = model.encoders["text"]
    part = actor.data[3].parts[0]  # client 3: text classification
    task, batch = part.task, {k: v[:4] for k, v in part.train.items()}
    window, short = encoder.window, batch["input_ids"].shape[1]
    ids = batch["input_ids"].repeat(1, math.ceil(2.5 * window / short))[:, : int(2.5 * window)]
    mask = torch.zeros_like(ids)
    mask[:, : window + 3] = 1  # the longest text: two windows of the three the columns could hold
    long = {**batch, "input_ids": ids, "attention_mask": mask}
    assert model.host_choices(task, long) == 2 and model.host_choices(task, batch) == 1
    assert model.host_choices(0, {"pixel_values": torch.zeros(1, 3, 8, 8)}) is None  # no text, no choice
    model.select_task(task)
    outputs = []
    for chosen in (False, True):
        torch.manual_seed(0)  # the same dropout draws
        with torch.no_grad(), model.making_choices(2 if chosen else None), CountedOps() as reads:
            outputs.append(model(long))
        assert (reads.count == 0) == chosen
    assert torch.equal(*outputs) and encoder.fixed_windows is None
    with model.making_choices(3):  # a choice is taken as made: all three windows
        assert encoder(ids, mask)[0].shape[1] == 3 * window


def test_image_normalization_makes_its_mean_and_std_once_per_device_and_dtype(actor):
    _start(actor)
    image_encoder = actor.model.encoders["image"]
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    mean = torch.as_tensor(image_encoder.mean, dtype=images.dtype).view(1, -1, 1, 1)
    std = torch.as_tensor(image_encoder.std, dtype=images.dtype).view(1, -1, 1, 1)
    assert torch.equal(image_encoder._normalized(images), (images - mean) / std)
    made = channel_values(image_encoder.mean, images.device, images.dtype)
    assert channel_values(image_encoder.mean, images.device, images.dtype) is made  # not a new copy each forward


# Stage 1 ----------------------------------------------------------------------------------------------------
def _recorded_update(actor, method, client_id, state, payload, round_idx=0):
    """One local update of ``client_id``, recording the parameters each of its two trainings starts from."""
    starts, results = [], []
    original = method._train

    def recording(client, params, groups, **kwargs):
        starts.append({n: v.clone() for n, v in params.items()})
        outcome = original(client, params, groups, **kwargs)
        results.append(outcome)
        return outcome

    method._train = recording
    try:
        result = method.local_update(actor._context(client_id, round_idx), state, payload)
    finally:
        del method._train
    return result, starts, results


def test_a_first_participation_replaces_every_seen_task(actor):
    method, driver = _start(actor)
    payload = driver.payloads([1])[1]
    result, starts, results = _recorded_update(actor, method, 1, actor.states[1], payload)
    assert result.stats == {"seen/topics": 1.0, "replaced/topics": 1.0, "seen/recon": 1.0, "replaced/recon": 1.0}
    # Both tasks replaced: X trains from the locally trained W on every block of both paths, i.e. all of them.
    assert _equal(starts[1], results[0][0].params)
    assert {model: set(losses) for model, losses in result.state["history"].items()} == {
        "w": {"text_classification", "image_generation"}, "x": {"text_classification", "image_generation"}}


def test_a_replacement_copies_exactly_the_task_path_from_the_pre_aggregation_w(actor):
    method, driver = _start(actor)
    payload = driver.payloads([1])[1]
    state = copy.deepcopy(actor.states[1])
    state["x"] = {n: v + 1.0 for n, v in state["x"].items()}  # an X unlike W everywhere
    # Image generation is never replaced (its X loss beats anything); text classification's X loss is +inf.
    state["history"] = {"x": {"image_generation": torch.tensor(-math.inf, dtype=torch.float64)}}
    result, starts, results = _recorded_update(actor, method, 1, state, payload)
    assert result.stats["replaced/topics"] == 1.0 and result.stats["replaced/recon"] == 0.0
    trained_w, x_start = results[0][0].params, starts[1]
    path = actor.model.path_prefixes(1)
    on_path = {n for n in x_start if n.startswith(path)}
    assert on_path and len(on_path) < len(x_start)
    for name, value in x_start.items():
        expected = trained_w[name] if name in on_path else state["x"][name]
        assert torch.equal(value, expected), name
    # The upload is W as trained this round (pre-aggregation), never X.
    assert _equal(result.upload["shared"], trained_w)
    assert not any(torch.equal(result.upload["shared"][n], result.state["x"][n]) for n in on_path if "lora_A" in n)


def test_replacement_rule_and_larger_margins_never_give_more_replacements(actor):
    """Eq. 3 on a fixed trajectory: W's trajectory does not depend on the margins, so on the same rounds every
    margin sees the same W losses; a larger margin can only replace less. The first participation always replaces."""
    sampled = [sample_round(load_config(_run()), r) for r in range(3)]
    counts = {}
    for scale in (0.0, 1.0, 1e9):
        _, driver = _start(actor, margins=[0.01 * scale, 0.005 * scale, 0.005 * scale, 0.01 * scale])
        stats = _rounds(actor, driver, 3, sampled)
        counts[scale] = sum(v for s in stats for k, v in s.items() if k.startswith("replaced/"))
        first = sum(1 for cid in {c for clients in sampled for c in clients} for _ in actor.data[cid].parts)
        if scale == 1e9:
            assert counts[scale] == first  # with a huge margin only first participations replace
    assert counts[0.0] >= counts[1.0] >= counts[1e9]


def test_the_w_trajectory_is_bitwise_identical_with_tap_on_or_off(actor):
    states = {}
    for personalize in (True, False):
        method, driver = _start(actor, personalize=personalize)
        _rounds(actor, driver, 2)
        payloads = driver.payloads([1, 2], False)
        metrics = {cid: actor._metrics(actor._context(cid, 2), actor.states[cid], payloads[cid]) for cid in (1, 2)}
        states[personalize] = driver.get_state()["global"], metrics
    (on, metrics_on), (off, metrics_off) = states[True], states[False]
    assert _equal(on, off)
    for cid in (1, 2):  # FedAvg's numbers are TAP's @fedavg view
        plain = {k: v for k, v in metrics_off[cid].items() if "@" not in k}
        assert plain == {k.removesuffix("@fedavg"): v for k, v in metrics_on[cid].items() if k.endswith("@fedavg")}
        assert any(metrics_on[cid][k] != v for k, v in plain.items() if k in metrics_on[cid])


def test_aggregation_averages_each_block_over_the_owners_that_sent_it_weighted_by_their_samples():
    method = method_class("tap")()
    server = method.init_server({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.full((2,), 7.0)})
    uploads = [Upload(0, 30, {"shared": {"a": torch.full((2,), 1.0), "b": torch.full((2,), 4.0)}}, 0.0),
               Upload(1, 10, {"shared": {"a": torch.full((2,), 5.0)}}, 0.0),
               Upload(2, 20, {"shared": {"b": torch.full((2,), 1.0)}}, 0.0)]
    merged = method.aggregate(server, uploads)["global"]
    assert torch.equal(merged["a"], torch.full((2,), (30 * 1 + 10 * 5) / 40))
    assert torch.equal(merged["b"], torch.full((2,), (30 * 4 + 20 * 1) / 50))
    assert torch.equal(merged["c"], torch.full((2,), 7.0))  # nobody sent it: kept


def test_a_round_changes_only_the_blocks_its_clients_hold(actor):
    _, driver = _start(actor)
    before = {n: v.clone() for n, v in driver.get_state()["global"].items()}
    _rounds(actor, driver, 1, [[0, 3]])  # image classification and text classification clients
    after = driver.get_state()["global"]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    sent = set(actor.initial[0]) | set(actor.initial[3])
    assert changed and changed <= sent
    assert not any(n.startswith(("heads.text_generation", "heads.image_generation", "mome.text_generation"))
                   for n in changed)


def test_packing_clients_into_actors_does_not_change_tap(actor):
    """The server's W and every client's X and histories after two rounds, whatever the packing."""
    _start(actor)  # the shared actor runs the config's TAP
    config = load_config(_run())
    results = []
    for packing in ([CLIENTS], [[0, 2], [1, 3]]):
        actors = [actor if clients == CLIENTS else ClientActor(config.to_dict(), clients) for clients in packing]
        driver = DriverActor(config.to_dict())
        initial = [a.start_method(0) for a in actors]
        driver.start_method(0, [""], initial[0], actors[0].task_tags())
        for round_idx in range(2):
            sampled = sample_round(config, round_idx)
            parts = [a.train_round(round_idx, [c for c in clients if c in sampled], driver.payloads(sampled),
                                   {c: 1.0 for c in sampled}) for a, clients in zip(actors, packing)]
            driver.aggregate(*parts)
        states = {cid: a.states[cid] for a in actors for cid in a.client_ids}
        results.append((driver.get_state()["global"], states))
    (together, states_together), (apart, states_apart) = results
    assert _equal(together, apart)
    for cid in CLIENTS:
        assert _equal(states_together[cid]["x"], states_apart[cid]["x"])
        assert _equal(flatten_tree(states_together[cid]["history"]), flatten_tree(states_apart[cid]["history"]))


def test_the_vilt_model_trains_its_patch_projection_and_keeps_word_embeddings_frozen():
    from rayfed.models import build_backbone
    from rayfed.methods.tap import build_mome_model

    run = _run()
    run["model"]["backbone"] = "tiny-pretrained:vilt"
    config = load_config(run)
    from rayfed.data.clients import build_federation

    federation = build_federation(config.data, 0)
    backbone = build_backbone(config.model, 0)
    model = build_mome_model(backbone, federation.tasks, {"text_positions": 8}, 0)
    trainable = model.trainable_params()
    assert model.family == "vilt" and model.num_layers == 1
    assert any(n.startswith("encoders.image.backbone.projection.lora_A") for n in trainable)
    assert not any(n.startswith("encoders.text.backbone.") for n in trainable)
    ranks = {n: v.shape[0] for n, v in trainable.items() if n.endswith("lora_A.default.weight")}
    assert ranks["encoders.image.backbone.projection.lora_A.default.weight"] == 4
    assert ranks["mote.shared.layers.0.attention.query.lora_A.default.weight"] == 8  # ViLT: attention r 8
    assert ranks["mote_experts.0.shared.shared.ffn.0.lora_A.default.weight"] == 8  # experts r 8
    holding = federation.holdings[3]  # VQA: image and text
    batch = federation._encode(holding, holding.splits[0][0][:2], backbone)
    model.select_task(3)
    assert model(batch, raw=True).shape == (2, 8, len(model.tokenizer))


# Stage 2 ----------------------------------------------------------------------------------------------------
def test_stage_two_reports_every_view_and_beta_zero_is_exactly_the_no_kd_run(actor):
    method, driver = _start(actor, kd_weights=[0.0, 0.0, 0.0, 0.0], alt_kd_weights=[1.0, 1.0, 1.0, 1.0])
    _rounds(actor, driver, 1, [[1, 2]])
    metrics = {}
    for cid in (1, 2):
        payload = driver.payloads([cid], False)[cid]
        client = actor._context(cid, 1)
        state = method.after_federation(client, actor.states[cid], payload)
        if cid == 2:
            metrics[cid] = actor._metrics(client, state, payload)
        assert _equal(state["x"], state["view:nokd"])  # beta = 0 for every task: the task loss alone
        assert not _equal(state["x"], state["view:kdalt"])
        assert not _equal(state["view:pt"], state["view:pt2"])
    assert {"local_token_f1", "local_token_f1@fedavg", "local_token_f1@pt", "local_token_f1@pt2",
            "local_token_f1@stage1", "local_token_f1@nokd", "local_token_f1@kdalt", "local_meteor"} <= set(metrics[2])
    assert {"view:pt", "view:pt2", "view:stage1", "view:nokd", "view:kdalt"} <= set(state)


@pytest.mark.parametrize("params, expected", [({}, (2e-3, 2e-3, 2e-3, 1.0)), ({"kd_weights": "code"}, (2e-3, 2e-3, 1.0, 2e-3))],
                         ids=["default-table-21", "code"])
def test_stage_two_weighs_each_task_keys_kd_term_by_table_21_by_default_or_by_the_codes_vector(actor, monkeypatch,
                                                                                               params, expected):
    """The weight stage 2's loss puts on each task key's KD term: its gradient with respect to the term."""
    tap = __import__("rayfed.methods.tap", fromlist=["Distillation"])
    method, driver = _start(actor, post_fl_microbatches=1, two_p=False, no_kd=False, **params)
    terms = []

    def unit_term(self, key, student, teacher):
        leaf = torch.ones((), requires_grad=True)
        terms.append((key, leaf))
        return leaf

    monkeypatch.setattr(tap.Distillation, "term", unit_term)
    for cid in (0, 1, 2):  # image classification; text classification + image generation; text generation
        method.after_federation(actor._context(cid, 0), actor.states[cid], driver.payloads([cid], False)[cid])
    applied: dict[str, list[float]] = {}
    for key, leaf in terms:
        applied.setdefault(key, []).append(leaf.grad.item())
    assert set(applied) == {"image_classification", "image_generation", "text_classification", "text_generation"}
    for key, beta in zip(("image_classification", "image_generation", "text_classification", "text_generation"),
                         expected):
        assert applied[key] == pytest.approx([beta] * len(applied[key])), key


def test_the_two_distillations_of_stage_two_run_the_teachers_forward_once_and_train_as_each_alone(actor):
    method, driver = _start(actor, post_fl_microbatches=2, two_p=False, no_kd=False, alt_kd_weights="code")
    _rounds(actor, driver, 1, [[1]])
    payload = driver.payloads([1], False)[1]
    model = actor.model
    teacher_forwards = []
    hook = model.register_forward_hook(lambda module, *_: teacher_forwards.append(1) if not module.training else None)
    state = method.after_federation(actor._context(1, 1), actor.states[1], payload)
    hook.remove()
    assert len(teacher_forwards) == 2 * 2  # two steps of two tasks (text classification, image generation)
    for view, weights in (("kdalt", "code"), ("", None)):
        alone = actor._context(1, 1).train(state["view:stage1"], steps=2, lr=method.params.post_lr, purpose="post_train",
                                           loss=method.distillation(state["view:pt"], weights)).params
        assert _equal(alone, state[f"view:{view}"] if view else state["x"]), view


def test_a_lone_distillation_keeps_one_micro_batchs_teacher_outputs_and_trains_as_a_sharing_one(actor, monkeypatch):
    tap = __import__("rayfed.methods.tap.method", fromlist=["Distillation"])
    method, driver = _start(actor, post_fl_microbatches=3, two_p=False, no_kd=False)  # no kdalt: nothing shares
    _rounds(actor, driver, 1, [[1]])
    payload = driver.payloads([1], False)[1]
    made = made_instances(monkeypatch, tap, "Distillation")
    state = method.after_federation(actor._context(1, 1), actor.states[1], payload)
    (distillation,) = made
    assert distillation.calls == 3 and sorted(distillation.targets) == [(2, 0), (2, 1)]  # the last call's two tasks
    shared = actor._context(1, 1).train(state["view:stage1"], steps=3, lr=method.params.post_lr, purpose="post_train",
                                        loss=method.distillation(state["view:pt"], targets={})).params
    assert _equal(shared, state["x"])


def test_distillation_is_tau_squared_kl_and_the_teacher_draws_no_dropout(actor):
    method, _ = _start(actor)
    tap = __import__("rayfed.methods.tap", fromlist=["Distillation"])
    student, teacher = torch.randn(4, 6), torch.randn(4, 6)
    kd = tap.Distillation(None, [1.0] * 4, 2.0, "softmax")
    p_t, log_p_s = torch.softmax(teacher / 2, -1), torch.log_softmax(student / 2, -1)
    expected = 4.0 * (p_t * (p_t.log() - log_p_s)).sum() / 4
    assert torch.allclose(kd.term("image_classification", student, teacher), expected, atol=1e-6)
    images = torch.rand(2, 3, 4, 4)
    assert torch.equal(tap.Distillation(None, [1.0] * 4, 1.0, "mse").term("image_generation", images, images),
                       torch.zeros(()))


def test_loss_histories_are_the_codes_lambda_weighted_mean_or_the_plain_one():
    tap = __import__("rayfed.methods.tap", fromlist=["LossHistory"])
    from rayfed.tasks import Task

    a, b = Task(0, "a"), Task(1, "b")

    class FakeStep:
        def __init__(self, rows):
            self.parts = [(task, {"x": torch.zeros(n)}) for task, n in rows]

    groups = {"k_a": [0], "k_b": [1]}
    weighted, plain = tap.LossHistory(groups, "weighted"), tap.LossHistory(groups, "plain")
    for history in (weighted, plain):
        history.record(FakeStep([(a, 3), (b, 1)]), [torch.tensor(2.0), torch.tensor(4.0)])
        history.record(FakeStep([(a, 4)]), [torch.tensor(1.0)])
    assert weighted.values() == pytest.approx({"k_a": (0.75 * 2 + 1 * 1) / 2, "k_b": (0.25 * 4) / 2})
    assert plain.values() == pytest.approx({"k_a": 1.5, "k_b": 4.0})


# Baselines --------------------------------------------------------------------------------------------------
def test_local_sends_nothing_and_trains_its_own_w(actor):
    _, driver = _start(actor, federated=False, personalize=False)
    before = {n: v.clone() for n, v in actor.states[0]["personal"].items()}
    part = actor.train_round(0, [0], driver.payloads([0]), {0: 1.0})
    assert part.uploads == [] and part.up_bytes == 0
    assert not _equal(before, actor.states[0]["personal"]) and "x" not in actor.states[0]


def test_disentafl_orthogonality_loss_is_zero_for_orthogonal_groups_and_absent_for_one():
    from rayfed.methods.disentafl import orthogonality_loss

    e = torch.eye(4)
    assert orthogonality_loss([(("image", "a"), e[:2])]) is None
    assert orthogonality_loss([(("image", "a"), e[:2]), (("text", "b"), e[2:])]) == 0
    same = orthogonality_loss([(("image", "a"), e[:1] * 3), (("text", "b"), e[:1])])
    assert same == pytest.approx(1.0)
    three = orthogonality_loss([(("i", "a"), e[:1]), (("t", "b"), e[:1]), (("t", "c"), e[1:2])])
    assert three == pytest.approx(1 / 3)  # pairs (a,b)=1, (a,c)=0, (b,c)=0


def test_disentafl_trains_with_the_mt_latents_of_a_multi_task_client(actor):
    cls = method_class("disentafl")
    method = cls()
    method.num_clients, method.tasks, method.rounds = 4, tuple(actor.tasks), 3
    actor.methods = [method]
    actor.start_method(0)
    seen = []
    original = method.loss

    def spy(step):
        value = original(step)
        seen.append(len(step.parts))
        return value

    method.loss = spy
    result = method.local_update(actor._context(1, 0), actor.states[1], actor.initial[1])
    assert seen and math.isfinite(result.train_loss) and actor.model.collected_latents is None
    assert set(result.upload["shared"]) == set(actor.initial[1])


def test_perfedavg_inner_step_is_first_order_maml():
    from rayfed.methods.perfedavg import inner_step
    from rayfed.models import TrainableModule
    from rayfed.tasks import Task

    class Linear(TrainableModule):  # a client model: the engine selects its task
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))

        def forward(self, batch):
            return batch["x"] @ self.w

    class Kind:
        def loss(self, outputs, batch):
            return ((outputs - batch["y"]) ** 2).mean()

    model = Linear()
    task = Task(0, "t", kind=Kind())
    batch = {"x": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "y": torch.tensor([0.0, 0.0])}
    step = type("S", (), {"params": dict(model.named_parameters()), "model": model})()
    adapted = inner_step(step, [(task, batch)], alpha=0.5)
    # grad of mean((x w)^2) = w here: w' = w - 0.5 w = w / 2, and d w' / d w is the identity (first order).
    assert torch.allclose(adapted["w"], torch.tensor([0.5, -1.0]))
    adapted["w"].sum().backward()
    assert torch.equal(model.w.grad, torch.ones(2))


def test_perfedavg_runs_on_the_modular_model_and_personalizes_after_the_last_round(actor):
    method, driver = _start_method(actor, "perfedavg", {"post_fl_microbatches": 1})
    _rounds(actor, driver, 1, [[0, 2]])
    payload = driver.payloads([0], False)[0]
    client = actor._context(0, 1)
    state = method.after_federation(client, actor.states[0], payload)
    metrics = actor._metrics(client, state, payload)
    assert {"local_acc", "local_acc@global", "local_acc@pt", "local_acc@pt2"} <= set(metrics)
    assert set(state["view:adapted"]) == set(payload) and not _equal(state["view:adapted"], payload)


# The model by config (model.client) ------------------------------------------------------------------------
def test_a_method_that_builds_no_model_of_its_own_trains_in_taps_model_by_config(actor):
    """FedAvg has no build_model and no option for it: ``model.client: mome`` alone puts it in TAP's model."""
    method, driver = _start_method(actor, "fedavg", {})
    assert isinstance(actor.model, MoMEModel) and actor.model.options.text_positions == 8
    part = actor.train_round(0, [1], driver.payloads([1]), {1: 1.0})
    [upload] = part.uploads  # client 1's, or the actor's partial sum of it: the same names
    assert set(upload.tensors["shared"]) == set(actor.initial[1])  # its blocks of the modular model
    assert any(n.startswith("mome.text_classification.") for n in upload.tensors["shared"])


@pytest.mark.parametrize("name", ["tap", "disentafl"])
def test_a_method_that_needs_taps_model_says_to_choose_it_when_the_config_does_not(name):
    run = _run()
    run["model"] = {"backbone": "tiny-pretrained:flava"}
    run["methods"] = [{"name": name}]
    with pytest.raises(ConfigError, match=rf"methods \({name}\) .*; set model.client: mome"):
        ClientActor(load_config(run).to_dict(), [0]).start_method(0)


@pytest.mark.parametrize("name", ["tap", "feddat", "perfedavg", "disentafl"])
def test_the_removed_mome_hyperparameter_says_what_to_set_instead(name):
    entry = load_config({**_run(), "methods": [{"name": name, "mome": {"text_positions": 8}}]}).methods[0]
    with pytest.raises(ConfigError, match=rf"^methods\[0\] \({name}\) has no hyperparameter 'mome'; it was removed: "
                                          r"set model.client: mome (and move these|with these) options .*"
                                          r"model.client_options[^.]*\.$"):
        build_method(entry, 0)


# FedDAT in TAP's model (docs/tap.md#baselines) -------------------------------------------------------------
FEDDAT = {"alpha": 2e-3, "beta": 2e-3, "tau": 1.0, "kd_schedule": "constant", "objective_scale": 1.0,
          "aggregation": "samples", "evaluate": "dat", "post_fl_microbatches": 2, "post_lr": 1e-3,
          "uploads": "all_but_local"}
DAT_MIX = {"frozen": 0.5, "local": 0.5}


def _start_feddat(actor: ClientActor, **params) -> tuple[object, DriverActor]:
    return _start_method(actor, "feddat", {**FEDDAT, **params})


def _adapters(names, which: str) -> set[str]:
    """The names of ``which`` adapters (shared = A_g, frozen = A_g0, local = A_l) among ``names``."""
    return {n for n in names if f".adapters.{which}." in n}


def _as(name: str, which: str) -> str:
    """The name of A_g's tensor ``name`` in adapter ``which``."""
    return name.replace(".adapters.shared.", f".adapters.{which}.")


def test_feddat_puts_its_three_adapters_after_every_expert_ffn_and_no_lora_in_the_backbone(actor):
    _start_feddat(actor)
    model = actor.model
    params = dict(model.named_parameters())
    experts = {name: module for name, module in model.named_modules() if isinstance(module, Expert)}
    assert any(".mode_q." in n for n in experts) and any(n.startswith("mome_experts.") for n in experts)
    for name, expert in experts.items():
        width = expert.ffn.mlp[2].out_features  # D
        assert width == 64
        for which, trainable in (("shared", True), ("frozen", False), ("local", True)):
            adapter = [p for n, p in params.items() if n.startswith(f"{name}.ffn.adapters.{which}.")]
            assert sum(p.numel() for p in adapter) == 2 * width * 4 + 4 + width  # Linear D->b, Linear b->D
            assert all(p.requires_grad == trainable for p in adapter)
    assert not any("lora_" in n for n in params if n.startswith(("mote", "mome")))  # attention and experts
    assert any("lora_" in n and p.requires_grad for n, p in params.items() if n.startswith("encoders."))
    assert all(not p.requires_grad for n, p in params.items() if ".ffn.mlp." in n)  # the pretrained FFNs
    # b defaults to the paper's value of the family: 32 on FLAVA (16 on ViLT).
    config = actor.model_config.model_copy(update={"client_options": {"text_positions": 8}})
    default = method_class("feddat")().build_model(actor.backbone, config, actor.tasks, 0)
    assert default.mote_experts["0"]["shared"]["shared"].ffn.adapters["local"].down.out_features == 32


def test_feddat_uploads_the_fl_model_but_never_a_l_or_a_g0_and_a_g0_stays_the_received_global(actor):
    method, driver = _start_feddat(actor)
    received = {n: v + 0.01 for n, v in driver.payloads([1])[1].items()}  # unlike the model's initial values
    result = method.local_update(actor._context(1, 0), actor.states[1], received)  # text cls + image generation
    held = set(actor.initial[1])
    uploaded = set(result.upload["shared"])
    assert uploaded == held - _adapters(held, "local") == set(received)
    assert not _adapters(uploaded, "local") and not _adapters(uploaded, "frozen")
    assert _adapters(uploaded, "shared") and any(n.startswith("heads.") for n in uploaded)
    assert set(result.state["personal"]) == _adapters(held, "local")
    assert math.isfinite(result.train_loss) and result.weight is None  # |D_i|-weighted, as TAP's FedAvg
    params = dict(actor.model.named_parameters())
    frozen = {_as(n, "frozen"): n for n in _adapters(received, "shared")}
    assert frozen and all(torch.equal(params[f], received[s]) for f, s in frozen.items())
    assert any(not torch.equal(result.upload["shared"][n], received[n]) for n in _adapters(uploaded, "shared"))


def test_feddat_keeps_a_l_across_rounds_and_sends_it_never(actor, monkeypatch):
    _, driver = _start_feddat(actor)
    _rounds(actor, driver, 1, [[1, 2]])
    kept = {n: v.clone() for n, v in actor.states[1]["personal"].items()}
    assert kept and not _equal(kept, {n: actor.initial[1][n] for n in kept})  # trained in round 0
    starts = []
    original = ClientContext.train
    monkeypatch.setattr(ClientContext, "train",
                        lambda self, params, **kw: starts.append(params) or original(self, params, **kw))
    part = actor.train_round(1, [1], driver.payloads([1]), {1: 1.0})
    [start] = starts
    assert all(torch.equal(start[n], v) for n, v in kept.items())  # A_l as round 0 left it
    assert not _adapters(start, "frozen")  # A_g0 is loaded into the model, not trained
    assert not _adapters(part.uploads[0].tensors["shared"], "local")
    assert not _equal(kept, actor.states[1]["personal"])


@pytest.mark.parametrize("image_kd", ["softmax", "mse"])  # mse: a KD term that does not detach its teacher itself
def test_feddat_steps_move_a_g_then_a_l_and_the_teacher_gets_no_gradient(actor, image_kd):
    method, driver = _start_feddat(actor, image_kd=image_kd)
    phase: list[int] = []
    phases = method._phases

    def tracked(round_idx):
        def marked(index, loss):
            return lambda step: phase.append(index) or loss(step)

        return [dataclasses.replace(p, loss=marked(i, p.loss)) for i, p in enumerate(phases(round_idx))]

    method._phases = tracked
    params = dict(actor.model.named_parameters())
    events: list[tuple[int, str]] = []
    handles = [p.register_hook(lambda grad, n=n: events.append((phase[-1], n))) for n, p in params.items()
               if p.requires_grad]
    try:
        method.local_update(actor._context(1, 0), actor.states[1], driver.payloads([1])[1])
    finally:
        for handle in handles:
            handle.remove()
    first, second = ({n for i, n in events if i == index} for index in (0, 1))
    assert _adapters(first, "shared") and not _adapters(first, "local")  # z_DAT without gradient
    assert _adapters(second, "local") and not _adapters(second, "shared")  # z_g detached
    assert all(not params[n].requires_grad for n in _adapters(params, "frozen"))
    assert any(n.startswith("heads.") for n in first & second)  # the heads train in both steps


def test_feddat_dat_is_a_g_alone_when_the_three_adapters_are_equal(actor):
    _start_feddat(actor)
    model = actor.model
    shared = _adapters(model.trainable_params(), "shared")
    values = model.trainable_params()
    model.load_trainable({_as(n, which): values[n] for n in shared for which in ("frozen", "local")})
    model.eval()
    for client, task in ((0, 0), (2, 3)):  # image classification, VQA (both encoders, text generation)
        batch = {k: v[:3] for k, v in actor.data[client].parts[0].train.items()}
        model.select_task(task)
        outputs = {}
        for view, mix in (("shared", None), ("dat", DAT_MIX), ("local", {"local": 1.0})):
            set_adapter_mix(model, mix)
            with torch.no_grad():
                outputs[view] = model(batch, raw=True)
        assert torch.equal(outputs["dat"], outputs["shared"]) and torch.equal(outputs["local"], outputs["shared"])
    model.load_trainable({_as(n, "local"): values[n] + 0.1 for n in shared})
    set_adapter_mix(model, DAT_MIX)
    with torch.no_grad():
        moved = model(batch, raw=True)
    assert not torch.allclose(moved, outputs["shared"])  # the DAT does read A_l
    set_adapter_mix(model, None)


def test_feddat_evaluates_the_dat_and_reports_the_post_trained_views(actor):
    method, driver = _start_feddat(actor)
    _rounds(actor, driver, 1, [[0, 2]])
    payload = driver.payloads([2], False)[2]
    client = actor._context(2, 1)
    state = method.after_federation(client, actor.states[2], payload)
    views = method.eval_views(state, payload)
    assert list(views) == ["", "shared", "local", "pt", "pt2"]
    for view in ("pt", "pt2"):  # post-trained: A_g, A_l and the heads move; A_g0 stays the last global A_g
        assert all(torch.equal(views[view][_as(n, "frozen")], payload[n])
                   for n in _adapters(payload, "shared"))
        assert not _equal({n: views[view][n] for n in payload}, payload)
        assert not _equal({n: views[view][n] for n in state["personal"]}, state["personal"])
    assert not _equal(state["view:pt"], state["view:pt2"])
    sites = [m for m in actor.model.modules() if isinstance(m, AdaptedMLP)]
    for view, mix in (("", DAT_MIX), ("pt", DAT_MIX), ("shared", None), ("local", {"local": 1.0})):
        method.activate_view(actor.model, view)
        assert all(site.mix == mix for site in sites)
    metrics = actor._metrics(client, state, payload)
    assert {"local_token_f1", "local_token_f1@shared", "local_token_f1@local", "local_token_f1@pt",
            "local_token_f1@pt2"} <= set(metrics)


def test_feddat_in_taps_model_validates_its_hyperparameters(actor):
    cls = method_class("feddat")

    def build(**options):
        config = actor.model_config.model_copy(update={"client_options": {"text_positions": 8, **options}})
        return cls().build_model(actor.backbone, config, actor.tasks, 0)

    with pytest.raises(ConfigError, match=r"model.client_options.backbone_module must be adapter for methods \(feddat\)"):
        build(backbone_module="lora")
    with pytest.raises(ConfigError, match=r"^model.client_options.adapter_dim = 0 is invalid: must be >= 1 or null\.$"):
        build(adapter_dim=0)
    params = cls.Params
    with pytest.raises(ValueError, match="evaluate = dat needs a variant with a dual-adapter teacher"):
        params(evaluate="dat", variant="no_local")
    with pytest.raises(ValueError, match=r"^uploads = 'all' is invalid: must be one of 'shared_adapters', "
                                         r"'all_but_local'\.$"):
        params(uploads="all")
    with pytest.raises(ValueError, match="^image_kd = 'l1' is invalid: must be one of 'softmax', 'mse'.$"):
        params(image_kd="l1")


# Configs and data -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((CONFIGS / "tap").glob("*.yaml")), ids=lambda p: p.name)
def test_tap_configs_are_valid(path):
    config = load_config(path)
    labels = [m.label for m in config.methods]
    assert "TAP" in labels and config.data.num_clients in (10, 30)
    tap = config.methods[labels.index("TAP")]
    method_class("tap").Params(**tap.params)  # the hyperparameters validate
    paper = "paper" in path.name and not path.stem.endswith("_offline")  # twins: tests/test_offline_twins.py
    if paper:
        assert config.federation.rounds == 200 and config.federation.clients_per_round == 2
        assert str(config.model.backbone).startswith("hf:")
    feddat = config.methods[labels.index("FedDAT")].params
    method_class("feddat").Params(**feddat)
    assert feddat["alpha"] == feddat["beta"] == 2e-3 and feddat["evaluate"] == "dat"  # w (Table 21), DAT evaluated
    assert feddat["aggregation"] == "samples" and feddat["uploads"] == "all_but_local"
    # every method in TAP's model, with the same options (the domains included)
    assert config.model.client == "mome" and "domains" in config.model.client_options
    assert all(not entry.model for entry in config.methods)
    if paper:
        assert config.model.client_options["adapter_dim"] == (32 if "flava" in path.name else 16)  # b (Table 21)


def test_the_margin_sweep_is_a_valid_asha_sweep():
    from rayfed.tune import SearchSpace
    from rayfed.tune.spec import _parse_spec
    from rayfed.tune.sweep import _checked_configs

    raw = load_config(CONFIGS / "tune" / "tap_margins.yaml").to_dict()
    spec = _parse_spec(raw["tune"])
    assert spec.scheduler.name == "asha" and spec.metric == "TAP/local_acc"
    configs = _checked_configs({k: v for k, v in raw.items() if k != "tune"}, SearchSpace(raw["tune"]["space"], "random"))
    assert {tuple(c.methods[0].params["margins"]) for c in configs} >= {(0.005, 0.0025, 0.0025, 0.005)}


def test_the_paper_text_datasets_get_the_papers_templates(tmp_path):
    import datasets

    from rayfed.methods.tap import tap_columns

    mmlu = datasets.Dataset.from_dict({"question": ["Is it?"], "subject": ["professional_law"],
                                       "choices": [["yes", "no", "maybe", "never"]], "answer": [2]})
    columns = tap_columns("mmlu", mmlu[:])
    # the authors' code's subject words (law, medicine, ethics) and lettered options and concepts
    assert columns["text"][0] == ("The following is a multiple-choice question about law. Choose the "
                                  "correct answer from the options below. Question: Is it? Options: A. yes B. no "
                                  "C. maybe D. never")
    assert columns["target"][0] == "Correct answer on law: C. maybe"
    moral = tap_columns("mmlu", {**mmlu[:], "subject": ["moral_scenarios"]})
    assert moral["target"][0] == "Correct answer on ethics: C. maybe"
    other = tap_columns("mmlu", {**mmlu[:], "subject": ["high_school_physics"]})
    assert other["target"][0] == "Correct answer on high school physics: C. maybe"
    gen = tap_columns("common_gen", {"concepts": [["dog", "run"]], "target": ["A dog runs."]})
    assert gen["text"][0].endswith("Concepts: A. dog B. run") and gen["target"][0] == "Description: A dog runs."
    news = tap_columns("ag_news", {"title": ["T"], "description": ["D"], "label": [3]})
    assert news["text"][0] == "T\nD" and news["label"].tolist() == [2]
    image = np.zeros((8, 8, 3), np.uint8)
    vqa = datasets.Dataset.from_dict({"image": [image], "question": ["what?"], "multiple_choice_answer": ["red"]})
    vqa.save_to_disk(tmp_path / "vqa")
    config = load_config({"imports": ["rayfed.methods.tap"], "federation": {"clients_per_round": 1},
                          "data": {"source": "tap:vqav2", "path": str(tmp_path / "vqa"), "num_clients": 1,
                                   "options": {"image_size": 4}}})
    from rayfed.data import load_source

    loaded = load_source(config.data)
    assert loaded.images.shape == (1, 4, 4, 3) and loaded.target[0] == "Answer: red"
    assert loaded.text[0] == "Answer the question based on the image. Question: what?"
    with pytest.raises(ConfigError, match="names no TAP dataset"):
        load_source(load_config({"data": {"source": "tap:squad", "num_clients": 1},
                                 "federation": {"clients_per_round": 1}}).data)


def test_a_backbone_that_is_not_flava_or_vilt_is_refused():
    run = _run()
    run["model"]["backbone"] = "tiny:vit"
    run["data"]["tasks"] = [run["data"]["tasks"][0]]
    run["data"]["tasks"][0]["clients"] = [0, 1]
    with pytest.raises(ConfigError, match="built from FLAVA or ViLT"):
        ClientActor(load_config(run).to_dict(), [0]).start_method(0)


def test_tap_hyperparameters_are_validated():
    params = method_class("tap").Params
    with pytest.raises(ValueError, match="margins needs 4 values"):
        params(margins=(0.1,))
    with pytest.raises(ValueError, match="kd_weights must be paper or code .* or 4 numbers"):
        params(kd_weights="table21")
    with pytest.raises(ConfigError, match=r"methods\[0\] \(tap\)\.alt_kd_weights = 'cod' is invalid: alt_kd_weights must be "
                       "paper or code"):
        build_method(load_config(_run(alt_kd_weights="cod")).methods[0], 0)
    with pytest.raises(ConfigError, match="model.client_options has no option 'rank'; allowed: layers, "):
        MoMEOptions.parse({"rank": 4})
    assert task_view({"heads.task_0.w": 1, "shared_proj.w": 2}, [1], {"heads.task_0.w": frozenset({0})}) == \
        {"shared_proj.w": 2}


def test_the_tables_average_over_clients_as_the_paper_does(tmp_path):
    """Avg. columns are client-weighted: FLAVA's Avg.Gen = (3 FMNIST + 6 Caltech) / 9 in the paper."""
    import json

    from tap_tables import replacements, rows

    config = {"data": {"tasks": [{"name": "fmnist", "clients": [0]}, {"name": "caltech", "clients": [1, 2]},
                                 {"name": "mmlu_colors", "clients": [3]}, {"name": "mmlu_shapes", "clients": [3]}]}}
    clients = {"0": {"local_mse": 0.4}, "1": {"local_mse": 0.1}, "2": {"local_mse": 0.1, "local_mse@pt": 0.3},
               "3": {"mmlu_colors/local_token_f1": 0.2, "mmlu_shapes/local_token_f1": 0.4}}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config, "methods": {"TAP": {"clients": clients}}}))
    events = [{"event": "round", "method": "TAP", "round": r, "client_stats": {"replaced/fmnist": float(r < 3)}}
              for r in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    table = rows([tmp_path])
    assert table["TAP"]["Avg.Gen"][0] == pytest.approx((0.4 + 0.1 + 0.1) / 3)
    assert table["TAP"]["MMLU F1"][0] == pytest.approx(0.3)  # one client: the mean of its subjects
    assert table["TAP@pt"]["Caltech MSE"][0] == pytest.approx(0.3)
    assert replacements([tmp_path]) == {"fmnist": (2.0, 0.0)}


def test_a_compiled_tap_update_uploads_the_eager_updates_numbers(monkeypatch):
    # client 0: image classification, W's update and X's
    # float32 sums in another order: round-off of about 1e-7 relative per operation; a wrong path, batch or lr
    # moves the update by its own size
    assert compiled_update_gap(_run(), [0], monkeypatch) < 1e-4


# The replayed TAP updates below are checked in float32, where an H100 gave bitwise the eager uploads (gap 0). Under
# bf16 autocast they are 0.02-0.36 of the update apart (with cuDNN's attention 0.07 and less; eager runs repeat
# bitwise): the kernels a capture picks round differently, and AdamW turns the round-off of a near-zero gradient
# into a step of the learning rate's size.
FLOAT32 = ["train.autocast=off"]


def test_a_replayed_tap_step_records_its_loss_history_and_trains_as_the_eager_one(replayed_on_cpu):
    # clients 0, 2, 3: one task each, W's update and X's at their own rates through one step a task
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _run()
    run["train"].update(optimizer="sgd", momentum=0.9)  # a CPU optimizer reads a rate held in a tensor as SGD only
    gap, moved = compiled_gap(run, [0, 2, 3], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 3  # one step a task, shared by W's and X's updates
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5  # a wrong rate, clip, batch or loss history moves the update by its size


def test_a_multi_task_clients_replayed_parts_train_as_the_eager_update_without_reading_back(parts_replayed_on_cpu):
    # client 1: text classification + image generation, each step's batch split between them in changing shares; the
    # window count of a long text is read before a part's replay (host_choices), never inside it
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    gap, moved = compiled_gap(_run(), [1], mode="cuda_graphs")
    assert len(parts_replayed_on_cpu) >= 2  # a part per (task, rows): at least one for each task
    assert all(reads == 0 for part in parts_replayed_on_cpu for reads in part.host_reads)
    assert moved > 1e-4 and gap < 1e-6  # a wrong share, batch or gradient moves the update by its size


@pytest.mark.parametrize("entry", [{"name": "disentafl", "ortho_weight": 0.5}, {"name": "perfedavg", "inner_lr": 0.01}])
def test_a_replayed_baseline_step_with_its_own_loss_trains_as_the_eager_one(replayed_on_cpu, entry):
    # clients 0, 2, 3: one task each; DisentAFL's orthogonality term of the step's latents, Per-FedAvg's first-order
    # MAML step (inner gradient on one half of the batch, outer loss on the other), each captured with its step
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _run()
    run["methods"] = [entry]
    run["train"].update(optimizer="sgd", momentum=0.9)
    gap, moved = compiled_gap(run, [0, 2, 3], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 3  # a step a task
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_captured_tap_update_uploads_the_eager_updates_numbers(monkeypatch):
    # clients 0, 2, 3: one task each (image classification, VQA, text classification), W's update and X's
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training.plans import graphed_step

    captured = made_instances(monkeypatch, graphed_step, "GraphedStep")
    gap, moved = compiled_gap(_run(), [0, 2, 3], mode="cuda_graphs", overrides=FLOAT32)
    assert len(captured) == 3  # one graph a task, shared by W's and X's steps at their own learning rates
    # a wrong lr, clip, batch or loss history moves the update by its own size
    assert moved > 1e-4 and gap < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_multi_task_clients_tap_update_replays_its_parts_and_uploads_the_eager_numbers(monkeypatch):
    # client 1: text classification + image generation, each step's batch split between them in changing shares
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training import graph_capture

    captured = made_instances(monkeypatch, graph_capture, "_GraphedPart")
    gap, moved = compiled_gap(_run(), [1], mode="cuda_graphs", overrides=FLOAT32)
    assert len(captured) >= 2  # a graph per (task, rows): at least one for each task
    assert moved > 1e-4 and gap < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_client_of_long_texts_replays_a_part_per_window_count_and_uploads_the_eager_numbers(monkeypatch):
    # client 4: two multiple-choice subjects as text generation, 40-token prompts: one to three of FLAVA's 16-position
    # windows, chosen per batch from its longest prompt (MoMEModel.host_choices), outside the graphs
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training.plans import graphed_parts

    run = _run()
    run["data"]["tasks"] += [{"name": subject, "source": "multimodal:multiple-choice", "kind": "text_generation",
                              "options": {"num_samples": 32, "subjects": [subject]}, "max_text_length": 40,
                              "clients": [4]} for subject in ("colors", "shapes")]
    run["model"]["client_options"]["text_positions"] = 16
    families = made_instances(monkeypatch, graphed_parts, "GraphedParts")
    gap, moved = compiled_gap(run, [4], mode="cuda_graphs", overrides=FLOAT32)
    windows = [key[-1] for family in families for key in family.parts]
    assert len(windows) >= 2 and all(count in (1, 2, 3) for count in windows)  # each part's own window count
    assert moved > 1e-4 and gap < 1e-3
