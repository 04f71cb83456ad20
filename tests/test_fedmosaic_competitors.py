"""TAKFL, PerAda and FedMKT (docs/fedmosaic.md#the-distillation-baselines-takfl-perada-fedmkt) on two architectures
of tiny LLaVAs: each one's defining rule on a hand-made case, the server's public passes, what is communicated, and the
same numbers whatever the packing of clients into actors."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.architectures import actor_slots, unprefixed
from rayfed.config import load_config
from rayfed.method import build_method
from rayfed.training import public_pass
from rayfed.methods.fedmkt import cut_logits, full_logits, lowest_loss, soft_cross_entropy
from rayfed.methods.takfl import merged
from rayfed.simulation import Simulation
from rayfed.stages import PreFederationStage, declared, public_pass_count
from rayfed.training import PublicJob, PublicPass

from test_fedmosaic import HETERO


def _config(method: dict, clients_per_actor: int = 2) -> dict:
    config = copy.deepcopy(HETERO)
    config["methods"] = [{"public_samples": 8, **method}]
    config["placement"]["clients_per_actor"] = clients_per_actor
    config["train"]["local_steps"] = 1
    return config


def _one_round(method: dict, clients_per_actor: int = 2, run: dict | None = None):
    """Round 1 of the method as the simulation runs it (its pre-federation stage, training, aggregation, then the
    public passes), on actors of ``clients_per_actor`` clients (of ``run``: default ``_config``'s); the actors, the
    driver, what each sent and the server state after aggregation."""
    config = load_config(run or _config(method, clients_per_actor))
    slots = actor_slots(config)
    actors = [ClientActor(config, slot.client_ids, architecture=slot.architecture) for slot in slots]
    first: dict[str, ClientActor] = {}
    for actor, slot in zip(actors, slots):
        first.setdefault(slot.architecture, actor)
    initial = [actor.start_method(0) for actor in actors]
    names = list(first)
    driver = DriverActor(config)
    driver.start_method(0, names, *(initial[actors.index(first[n])] for n in names),
                        *(first[n].task_tags() for n in names))
    if declared(driver.method, PreFederationStage):
        driver.before_federation(names, *(first[n].pre_federation(0) for n in names))
    parts = [actor.train_round(0, actor.client_ids, driver.payloads(actor.client_ids), dict.fromkeys(actor.client_ids, 1.0))
             for actor in actors]
    driver.aggregate(*parts)
    aggregated = copy.deepcopy(driver.get_state())
    requests, results = [], []
    for index in range(public_pass_count(driver.method)):
        requests.append({n: driver.public_request(index, n) for n in names})
        results.append({n: first[n].public_pass(0, 0, index, copy.deepcopy(requests[-1][n])) for n in names})
        driver.after_public_pass(index, names, *results[-1].values())
    uploads = {u.client_id: u.tensors for part in parts for u in part.uploads}
    return first, driver, uploads, aggregated, requests, results


# TAKFL ---------------------------------------------------------------------------------------------------------------

def test_takfl_merges_the_average_and_the_task_vectors_with_the_lambda_weights():
    average = {"w": torch.tensor([1.0, 2.0])}
    tau_1, tau_2 = {"w": torch.tensor([4.0, 0.0])}, {"w": torch.tensor([0.0, -8.0])}
    assert torch.equal(merged(average, [tau_1, tau_2], [0.25, 0.75])["w"], torch.tensor([2.0, -4.0]))
    assert torch.equal(merged(average, [tau_1, tau_2], [0.0, 1.0])["w"], average["w"] + tau_2["w"])  # lambda = e_2: phi_2


@pytest.fixture(scope="module")
def takfl():
    return _one_round({"name": "takfl"})


def test_takfl_averages_only_within_an_architecture_and_sends_theta_plus_the_mean_task_vector(takfl):
    first, driver, uploads, aggregated, _, results = takfl
    server = driver.get_state()
    for arch, clients in (("small", [0, 1]), ("large", [2, 3])):
        mean = {n: (uploads[clients[0]]["shared"][n] + uploads[clients[1]]["shared"][n]) / 2
                for n in uploads[clients[0]]["shared"]}
        average = unprefixed(aggregated["global"], arch)
        assert all(torch.allclose(average[n], mean[n]) for n in mean)  # the mean of this architecture's uploads only
        vectors = [unprefixed(results[1][arch], f"task_vector:{t}") for t in ("small", "large")]
        assert all(v and any(x.abs().max() > 0 for x in v.values()) for v in vectors)  # T4: knowledge flows
        sent = unprefixed(server["global"], arch)
        for name in average:  # lambda = 1/K
            assert torch.allclose(sent[name], average[name] + (vectors[0][name] + vectors[1][name]) / 2, atol=1e-7)
        assert driver.payloads(clients)[clients[0]].keys() == driver.payloads(clients)[clients[1]].keys()


def test_takfl_resets_the_student_for_every_teacher(takfl):
    """Each task vector starts from the average: distilling one teacher alone gives the same vector as in the
    run over both, whichever came first (sequential distillation would carry the first into the second)."""
    first, driver, _, _, requests, results = takfl
    request = copy.deepcopy(requests[1]["small"])
    del request["teacher:small"]
    alone = first["small"].public_pass(0, 0, 1, request)
    expected = unprefixed(results[1]["small"], "task_vector:large")
    assert alone.keys() == {f"task_vector:large/{n}" for n in expected}
    assert all(torch.equal(unprefixed(alone, "task_vector:large")[n], expected[n]) for n in expected)


# PerAda --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def perada():
    return _one_round({"name": "perada", "mu": 0.5})


def test_perada_distils_each_architectures_average_toward_the_mean_logits_of_all_clients(perada):
    first, driver, uploads, aggregated, requests, results = perada
    rows = torch.arange(8)
    stage_logits = []
    for cid in range(4):  # each client's global adapter, run by its own architecture's backbone
        arch = "small" if cid < 2 else "large"
        actor = first[arch]
        task, columns = actor.public_passes.data
        stage = PublicPass(arch, actor.model, columns, task, actor.config.train, actor.device, actor.config.seed, 0)
        stage_logits.append(stage.answer_logits(uploads[cid]["shared"], rows))
    teacher = requests[1]["small"]["teacher"]
    assert torch.allclose(teacher, torch.stack(stage_logits).mean(0), atol=1e-5)  # 1/N each, not per architecture
    assert torch.equal(requests[1]["large"]["teacher"], teacher)  # one teacher for every architecture
    server = driver.get_state()
    for arch in ("small", "large"):  # the student is the server's average, the result what the clients receive
        assert torch.equal(requests[1][arch]["average/" + next(iter(unprefixed(aggregated["global"], arch)))],
                           next(iter(unprefixed(aggregated["global"], arch).values())))
        distilled = unprefixed(results[1][arch], "distilled")
        assert all(torch.equal(unprefixed(server["global"], arch)[n], v) for n, v in distilled.items())
        assert any(not torch.equal(v, unprefixed(aggregated["global"], arch)[n]) for n, v in distilled.items())


def test_perada_keeps_the_personal_adapter_on_the_client_and_evaluates_it(perada):
    first, driver, uploads, _, _, _ = perada
    actor = first["small"]
    state = actor.states[0]
    personal = state["personal_adapter"]
    assert uploads[0].keys() == {"shared"}  # w only
    assert personal is not uploads[0]["shared"]
    payload = driver.payloads([0])[0]
    assert payload.keys() == personal.keys()  # the global adapter of the same shape, never v itself
    assert not any(torch.equal(payload[n], personal[n]) for n in personal)
    assert actor.method.eval_params(state, payload) is personal  # evaluated with v, whatever the payload


def test_perada_pulls_the_personal_adapter_by_mu_times_the_squared_distance_not_halved():
    from rayfed.methods.perada import personal_penalty

    centre = {"w": torch.tensor([1.0, -1.0])}
    assert float(personal_penalty(centre, 0.5)({"w": torch.tensor([3.0, 0.0])})) == pytest.approx(0.5 * (4 + 1))
    assert personal_penalty(centre, 0.0) is None


# FedMKT --------------------------------------------------------------------------------------------------------------

def test_fedmkt_takes_the_lowest_loss_teacher_per_sample_and_only_samples_it_beats_the_student_on():
    losses = torch.tensor([[0.5, 2.0, 0.9, 3.0],   # client 0
                           [0.7, 1.0, 0.2, 3.0],   # client 1
                           [0.6, 1.5, 0.8, 3.0]])  # client 2
    own = torch.tensor([0.55, 1.2, 0.1, 3.0])      # the student (g)
    best, trains = lowest_loss(losses, own, keep_self_best=False)
    assert best.tolist() == [0, 1, 1, 0]
    assert trains.tolist() == [True, True, False, False]  # g best on 2, a tie on 3: left out
    assert lowest_loss(losses, own, keep_self_best=True)[1].all()


def test_fedmkt_soft_cross_entropy_has_no_gradient_at_its_target():
    target = torch.randn(5, 7)
    student = target.clone().requires_grad_(True)
    soft_cross_entropy(student, target, torch.zeros(5, dtype=torch.long), 0.0).backward()
    assert student.grad.abs().max() < 1e-6
    other = torch.randn(5, 7, requires_grad=True)
    soft_cross_entropy(other, target, torch.zeros(5, dtype=torch.long), 0.0).backward()
    assert other.grad.abs().max() > 1e-3


@pytest.fixture(scope="module")
def fedmkt():
    return _one_round({"name": "fedmkt"})


def test_fedmkt_transfers_between_model_sizes_both_ways_and_sends_each_client_its_own_adapter(fedmkt):
    first, driver, uploads, aggregated, requests, results = fedmkt
    outputs = results[0]
    # The teacher of each sample is the lowest-loss client over both sizes, and its logits are the target.
    losses = torch.stack([outputs["small" if c < 2 else "large"][f"loss:{c}"] for c in range(4)])
    for arch in ("small", "large"):
        best, trains = lowest_loss(losses, outputs[arch]["loss:global"], False)
        assert torch.equal(requests[1][arch]["trains"].bool(), trains)
        row_of = outputs[arch]["row_of"]
        for token in range(len(row_of)):
            teacher = int(best[row_of[token]])
            source = outputs["small" if teacher < 2 else "large"][f"logits:{teacher}"]
            assert torch.equal(requests[1][arch]["target"][token], source[token])
    payloads = driver.payloads([0, 1, 2, 3])
    for cid in range(4):
        arch = "small" if cid < 2 else "large"
        assert payloads[cid].keys() == uploads[cid]["shared"].keys()  # the adapter only: no logits travel
        assert all(torch.equal(payloads[cid][n], v) for n, v in unprefixed(results[1][arch], f"client:{cid}").items())
    assert not all(torch.equal(payloads[0][n], payloads[1][n]) for n in payloads[0])  # per client, not averaged
    # g_k is never an average of the uploads: it is the initial adapter distilled on the samples others beat it on.
    for arch in ("small", "large"):
        assert all(torch.equal(requests[0][arch][f"global/{n}"], v)
                   for n, v in unprefixed(aggregated["global"], arch).items())


def test_fedmkt_a_client_the_global_adapter_never_beats_receives_its_upload_back(fedmkt):
    first, driver, uploads, _, requests, _ = fedmkt
    request = copy.deepcopy(requests[1]["small"])
    request["loss:0"] = torch.full_like(request["loss:0"], -1.0)  # client 0 beats g_k on every sample
    result = first["small"].public_pass(0, 0, 1, request)
    sent = unprefixed(result, "client:0")
    assert all(torch.equal(sent[n], uploads[0]["shared"][n]) for n in sent)


def test_fedmkt_a_cut_keeps_each_tokens_k_largest_logits_and_the_teachers_distribution_over_them():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    cut = cut_logits(logits, 3, "t")
    assert cut["t"].shape == (6, 3) and torch.equal(cut["t"], logits.topk(3).values)
    restored = torch.softmax(full_logits(cut, "t", 11), -1)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(3).indices, True)
    assert torch.equal(restored > 0, kept)  # mass on the k largest only, renormalised among them
    teacher = torch.softmax(logits, -1)
    assert torch.allclose(restored[kept].view(6, 3), (teacher * kept).div(( teacher * kept).sum(-1, keepdim=True))[kept].view(6, 3))
    assert torch.equal(full_logits(cut_logits(logits, 11, "t"), "t", 11), logits)  # k = vocabulary: nothing lost
    assert cut_logits(logits, None, "t") == {"t": logits}


def test_fedmkt_with_top_k_sends_the_teachers_k_largest_logits_and_trains_toward_them(fedmkt):
    _, full_driver, _, _, _, full_results = fedmkt
    _, driver, _, _, requests, results = _one_round({"name": "fedmkt", "top_k": 3})
    losses = torch.stack([results[0]["small" if c < 2 else "large"][f"loss:{c}"] for c in range(4)])
    for arch in ("small", "large"):
        outputs, full = results[0][arch], full_results[0][arch]
        for name in ("global", *(str(c) for c in range(4) if (c < 2) == (arch == "small"))):
            top = full[f"logits:{name}"].topk(3)  # the same logits before the cut: same seed, same local training
            assert torch.equal(outputs[f"logits:{name}"], top.values) and torch.equal(outputs[f"logits:{name}:ids"],
                                                                                       top.indices)
            assert torch.equal(outputs[f"loss:{name}"], full[f"loss:{name}"])  # the losses of every logit
        best, _ = lowest_loss(losses, outputs["loss:global"], False)
        for token, row in enumerate(outputs["row_of"].tolist()):
            teacher = int(best[row])
            source = results[0]["small" if teacher < 2 else "large"]
            for part in ("", ":ids"):
                assert torch.equal(requests[1][arch][f"target{part}"][token], source[f"logits:{teacher}{part}"][token])
    cut_state, full_state = driver.get_state(), full_driver.get_state()
    assert not all(torch.equal(cut_state["global"][n], v) for n, v in full_state["global"].items())


def test_grouped_public_training_gives_each_adapter_its_own_update(fedmkt, monkeypatch):
    first, _, _, _, requests, _ = fedmkt
    actor = first["large"]
    task, columns = actor.public_passes.data
    stage = PublicPass(actor.architecture, actor.model, columns, task, actor.config.train,
                       actor.device, actor.config.seed, 0)
    vocabulary = int(fedmkt[5][0]["large"]["vocabulary"])
    generator = torch.Generator().manual_seed(1)
    jobs = []
    for key, rows in (("client:2", [0, 1, 2, 3, 4, 5, 6]), ("global", [1, 3, 5]), ("client:3", []),
                      ("client:3", [2, 4, 6, 7, 0])):  # batches of 4 + 3, 3, none, 4 + 1 (a padded last batch)
        rows = torch.tensor(rows, dtype=torch.long)
        targets = torch.randn(len(stage.answers(rows)[0]), vocabulary, generator=generator)
        jobs.append(PublicJob(unprefixed(requests[0]["large"], key), rows, targets, f"test:{len(jobs)}"))

    def loss(student, target, answers):
        return soft_cross_entropy(student, target, answers, 0.5)

    grouped_calls = []
    grouped_lora = public_pass.grouped_lora
    monkeypatch.setattr(public_pass, "grouped_lora", lambda model, adapters: grouped_calls.append(len(adapters)) or
                        grouped_lora(model, adapters))
    together = stage.train_each(jobs, loss, epochs=2, batch_size=4, lr=0.01)
    assert grouped_calls == [3, 3, 2, 2]  # per step, the jobs still running: one forward for all of them
    alone = [stage.train(job.params, loss, job.rows, job.targets, epochs=2, batch_size=4, lr=0.01, purpose=job.purpose)
             for job in jobs]
    for job, grouped, single in zip(jobs, together, alone):
        for name, value in single.items():
            scale = float((value - job.params[name]).norm()) or 1.0
            assert float((grouped[name] - value).norm()) < 1e-3 * scale, name  # Adam amplifies round-off
        assert all(torch.equal(grouped[n], job.params[n]) for n in grouped) == (not len(job.rows))


# All three -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["takfl", "perada", "fedmkt"])
def test_the_server_state_is_the_same_at_one_and_two_clients_per_actor(name, request):
    method = {"takfl": {"name": "takfl"}, "perada": {"name": "perada", "mu": 0.5}, "fedmkt": {"name": "fedmkt"}}[name]
    one = _one_round(method, clients_per_actor=1)[1].get_state()
    two = request.getfixturevalue(name)[1].get_state()  # the module's run, at two clients per actor
    assert one.keys() == two.keys()
    for slot in one:
        assert one[slot].keys() == two[slot].keys()
        assert all(torch.equal(one[slot][n], two[slot][n]) for n in one[slot]), slot


def test_the_three_run_end_to_end_with_finite_metrics(tmp_path):
    config = _config({"name": "takfl"})
    config["methods"] = [{"name": name, "public_samples": 8} for name in ("takfl", "perada", "fedmkt")]
    config["federation"] = {"rounds": 1, "clients_per_round": 4, "eval_every": 1}
    summary = Simulation(config, out_dir=tmp_path, progress=False).run()
    for name in ("takfl", "perada", "fedmkt"):
        means = summary["methods"][name]["mean"]
        assert means and all(math.isfinite(v) for v in means.values()), name


def test_rayfed_list_shows_the_three():
    from rayfed.registry import names

    assert {"takfl", "perada", "fedmkt"} <= set(names("method"))


def test_the_paper_configs_carry_the_papers_comparison_with_compute_matching_on(monkeypatch, tmp_path):
    """Tab. 2 / 3's methods, the three distillation baselines among them, each trained for the local steps that
    make its cost SFT's (the server's distillation counted), in every paper config and its offline twin."""
    for variable in ("DRAKE_ROOT", "HFLB_ROOT"):
        monkeypatch.setenv(variable, str(tmp_path))
    papers = sorted((Path(__file__).resolve().parents[1] / "configs" / "fedmosaic").glob("paper_*.yaml"))
    assert len(papers) == 6  # DRAKE-Dynamic, -Static, HFLB-Dynamic and their twins
    for path in papers:
        config = load_config(path)
        names = [entry.name for entry in config.methods]
        assert {"local", "fedavg", "ditto", "fedsim", "feddpa", "feddat_lora", "takfl", "perada", "fedmkt",
                "fedmosaic"} <= set(names), path.name
        assert config.train.compute_match is not None and config.train.compute_match.reference == "local"
        fedmkt = build_method(config.methods[names.index("fedmkt")], names.index("fedmkt"))
        assert fedmkt.params.top_k == 128  # a teacher's 128 largest logits travel, as the original's
