"""FedMosaic (docs/fedmosaic.md): PQ-LoRA's placement, counts and exact averaging, the cross-model alignment, RELA's
shared mask, gradients and weights, per-client global adapters that never overwrite the local one, and the
offline benchmark's configs."""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from rayfed import training
from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.architectures import actor_slots
from rayfed.results.checkpoint import load_checkpoint, save_checkpoint
from rayfed.compute import counted_flops
from rayfed.config import ModelConfig, load_config
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.method import TensorDict, build_method
from rayfed.methods.fedmosaic import FedMosaic, FedMosaicParams, linear_weight_gradient, pqlora, rela, relevance_weights
from rayfed.methods.fedmosaic.task_groups import answer_maps
from rayfed.models import build_backbone
from rayfed.run_methods import run_methods
from rayfed.state_tree import flatten_tree, tree_at, tree_leaves
from rayfed.tasks import Task

from conftest import made_instances

ROOT = Path(__file__).resolve().parents[1]

# Llama-3.2's language models (config.json of meta-llama/Llama-3.2-1B and -3B), built on the meta device.
LLAMA_3_2 = {
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True),
}


def _meta_llama(size: str) -> transformers.LlamaForCausalLM:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_2[size]))


def _role_counts(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        role = "P/Q" if name.endswith(("_P", "_Q")) else "LoRA" if name.endswith(("_A", "_B")) else "basis" if (
            name.endswith((".A", ".B"))) else "gate" if name.endswith(".beta") else "frozen"
        counts[role] = counts.get(role, 0) + param.numel()
    return counts


def test_lora_counts_and_the_pq_saving_on_llama_3_2_as_the_paper_reports_them():
    small, large = _meta_llama("1B"), _meta_llama("3B")
    # the 1B model's last down_proj: the gradient RELA shares (docs/fedmosaic.md#rela), d = 8192 x 2048
    assert small.model.layers[-1].mlp.down_proj.weight.numel() == 16_777_216
    conventional = pqlora.attach(large, rank=128, adapters=("local",))
    assert conventional.pq_layers == () and _role_counts(large)["LoRA"] == 194_510_848  # r = 128, 7 linears x 28
    large = _meta_llama("3B")
    placement = pqlora.attach(large, rank=128, adapters=("local",), pq_blocks=4)
    assert placement.pq_layers == (7, 14, 21, 28)
    uploaded = _role_counts(large)["LoRA"] + _role_counts(large)["P/Q"]
    assert uploaded == 194_510_848 - 4 * 6_946_816 + 4 * 7 * (128 * 128 + 128) == 167_185_920
    saving = 1 - uploaded / 194_510_848
    assert saving == pytest.approx(0.14048, abs=1e-5) and 4 / 28 == pytest.approx(0.1429, abs=1e-4)  # paper: 14.3%
    # + the masked gradient (40% of 16.78M): FedMosaic uploads 10.6% less than FedAvg per round (paper: 10.9%)
    assert 1 - (uploaded + round(0.4 * 16_777_216)) / 194_510_848 == pytest.approx(0.10598, abs=1e-5)
    assert pqlora.attach(_meta_llama("1B"), rank=128, adapters=("local",), pq_blocks=4).pq_layers == (4, 8, 12, 16)


def test_pq_layers_follow_eq_6():
    assert pqlora.attachment_layers(16, 4) == (4, 8, 12, 16)
    assert pqlora.attachment_layers(28, 4) == (7, 14, 21, 28)
    assert pqlora.attachment_layers(18, 4) == (4, 8, 12, 18)  # the remainder goes to the last block
    for blocks in (2, 4, 8):  # the offline depths are divisible by every N_B
        for depth in (8, 16):
            layers = pqlora.attachment_layers(depth, blocks)
            assert len(layers) == blocks and all(b - a == depth // blocks for a, b in zip((0, *layers), layers))
    with pytest.raises(ValueError, match="in 1..8"):
        pqlora.attachment_layers(8, 9)


def _pq_layer(d_in=12, d_out=10, rank=4, seed=0) -> pqlora.GatedLinear:
    base = torch.nn.Linear(d_in, d_out).double()
    layer = pqlora.GatedLinear(base, rank, ("local", "global"), pq=True, scale=1.0, frozen=("global",),
                               generator=torch.Generator().manual_seed(seed)).double()
    return layer


def test_the_pq_basis_is_orthonormal_and_averaging_p_is_exact_theorem_2():
    layer = _pq_layer()
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.allclose(layer.A @ layer.A.T, eye, atol=1e-6) and torch.allclose(layer.B.T @ layer.B, eye, atol=1e-6)
    generator = torch.Generator().manual_seed(1)
    ps = [torch.randn(4, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    w = torch.softmax(torch.randn(3, generator=generator, dtype=torch.float64), 0)
    averaged = layer.B @ sum(wi * p for wi, p in zip(w, ps)) @ layer.A
    assert torch.allclose(averaged, sum(wi * layer.B @ p @ layer.A for wi, p in zip(w, ps)), atol=1e-14, rtol=0)
    # conventional LoRA: averaging A and B separately is not the average of the updates B A
    bs = [torch.randn(10, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    as_ = [torch.randn(4, 12, generator=generator, dtype=torch.float64) for _ in range(3)]
    error = sum(wi * b for wi, b in zip(w, bs)) @ sum(wi * a for wi, a in zip(w, as_)) - sum(
        wi * b @ a for wi, b, a in zip(w, bs, as_))
    assert error.abs().max() > 1e-2


def test_the_gated_pq_branch_mixes_local_and_global_and_trains_only_the_local_one():
    layer = _pq_layer()
    gate = pqlora.LayerGate().double()
    layer.set_gate(gate)
    with torch.no_grad():
        layer.local_P.normal_(), layer.global_P.normal_(), layer.local_Q.normal_(), layer.global_Q.normal_()
        gate.beta.fill_(0.3)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    g = torch.sigmoid(torch.tensor(0.3, dtype=torch.float64))
    expected = layer.base(x) + ((1 - g) * (x @ layer.A.T @ layer.local_P.T + layer.local_Q)
                                + g * (x @ layer.A.T @ layer.global_P.T + layer.global_Q)) @ layer.B.T
    out = layer(x)
    assert torch.allclose(out, expected, atol=1e-12)
    out.sum().backward()
    assert layer.local_P.grad is not None and gate.beta.grad is not None
    assert layer.global_P.grad is None and layer.A.grad is None and layer.B.grad is None  # frozen, detached


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.q_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.v_proj(torch.tanh(self.q_proj(x)))


class _Decoder(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_gated_fast_path_equals_the_mix_of_each_adapter_forward_and_gradient():
    """Layer 1 conventional LoRA, layer 2 PQ-LoRA, each gated: the fast path (the gate computed once per decoder layer,
    PQ's P and Q lerped, the conventional code's columns scaled) against the generic per-adapter mix."""
    torch.manual_seed(0)
    model = _Decoder(12, 2).double().requires_grad_(False)
    pqlora.attach(model, rank=4, adapters=("local", "global"), pq_blocks=1, scale=2.0, pq_scale=0.5,
                  frozen=("global",), gate=True, targets=("q_proj", "v_proj"))
    model.double()
    trained = {n: p for n, p in model.named_parameters() if "local_" in n or n.endswith("beta")}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_" in name.rsplit(".", 1)[-1] or name.endswith("beta"):
                param.normal_()
    x = torch.randn(3, 5, 12, dtype=torch.float64)

    def outputs_and_grads(generic: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for layer in model.layers:
            for module in (layer.q_proj, layer.v_proj):
                g = torch.sigmoid(layer.adapter_gate.beta)
                module.mix = {"local": 1 - g, "global": g} if generic else None
        for param in trained.values():
            param.requires_grad_(True)
            param.grad = None
        out = model(x)
        (out ** 2).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in trained.items()}

    fast, fast_grads = outputs_and_grads(generic=False)
    again, again_grads = outputs_and_grads(generic=False)  # a second forward and backward with the same gate values
    reference, reference_grads = outputs_and_grads(generic=True)
    assert torch.equal(fast, again) and all(torch.equal(fast_grads[n], again_grads[n]) for n in fast_grads)
    assert torch.allclose(fast, reference, rtol=1e-12, atol=1e-12)
    assert fast_grads.keys() == reference_grads.keys() and any(n.endswith("local_P") for n in fast_grads)
    for name, grad in fast_grads.items():
        assert torch.allclose(grad, reference_grads[name], rtol=1e-10, atol=1e-12), name
    assert all(layer.adapter_gate._open is None for layer in model.layers)  # nothing kept past the layer's forward


def test_alignment_makes_a_orthonormal_brings_codes_closer_and_b_matches_canonical_coordinates():
    generator = torch.Generator().manual_seed(0)
    pivot_h = torch.randn(400, 16, generator=generator)
    other_h = pivot_h @ torch.randn(16, 24, generator=generator) + 0.05 * torch.randn(400, 24, generator=generator)
    pivot_a = pqlora.random_orthonormal(4, 16, generator)
    start = pqlora.random_orthonormal(4, 24, generator)
    aligned, losses = pqlora.align_rows(other_h, pivot_h @ pivot_a.T, start, ortho_weight=0.5, epochs=4, lr=0.02,
                                        batch_size=16, generator=generator)
    assert torch.allclose(aligned @ aligned.T, torch.eye(4), atol=1e-5)
    assert losses["l2_after"] < 0.5 * losses["l2_before"]
    pivot_b, other_b = pqlora.random_orthonormal(20, 4, generator), pqlora.random_orthonormal(30, 4, generator)
    pivot_y, other_y = (pivot_h @ pivot_a.T) @ pivot_b.T, (other_h @ aligned.T) @ other_b.T
    new_b, correlations = pqlora.cca_basis(pivot_y, other_y, pivot_b)
    pi_p, pi_o, _ = pqlora.cca_projections(pivot_y, other_y, 4)
    assert torch.allclose(pi_o.T @ new_b, pi_p.T @ pivot_b, atol=1e-3)  # the same r-dim code, the same coordinates
    assert correlations.min() > 0.5
    polar = pqlora.nearest_orthonormal_columns(new_b)  # ortho_b_after_cca
    assert torch.allclose(polar.T @ polar, torch.eye(4), atol=1e-5)


# A two-architecture federation on the tiny LLaVAs: clients 0, 1 small (W_s's architecture), 2, 3 large.
def _task(name: str, group: int, client: int, question: str) -> dict:
    return {"name": name, "source": "task-groups:vqa", "kind": "text_generation", "clients": [client],
            "partition": {"name": "iid"}, "max_text_length": 26,
            "options": {"group": group, "num_samples": 24, "question_types": [question], "styles": ["noisy"]}}


HETERO = {
    "name": "mosaic", "seed": 5,
    "data": {"tasks": [_task("a", 0, 0, "color"), _task("b", 1, 1, "color"), _task("c", 0, 2, "color"),
                       _task("d", 1, 3, "shape")],
             "public": {"source": "multimodal:shapes", "kind": "text_generation", "max_text_length": 32,
                        "options": {"num_samples": 48, "styles": ["plain"]}}},
    "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 4, "alpha": 8}},
    "architectures": {"small": {"clients": [0, 1], "backbone": "tiny-pretrained:llava"},
                      "large": {"clients": [2, 3], "backbone": "tiny-pretrained:llava-large"}},
    "federation": {"rounds": 2, "clients_per_round": 4, "eval_every": 2},
    "train": {"local_steps": 2, "batch_size": 4, "lr": 0.002, "optimizer": "adamw", "eval_batch_size": 64},
    "methods": [{"name": "fedmosaic", "relevance_model": "tiny-pretrained:llava", "grad_interval": 1, "align_lr": 0.01}],
    "placement": {"executor": "local", "clients_per_actor": 2},
}


def _started(config, drivers: int = 1) -> tuple[dict[str, ClientActor], list[DriverActor]]:
    """The run's actors (one per architecture, running method 0) and ``drivers`` drivers, the k-th running method
    k on the server, after the pre-federation stage."""
    actors = {slot.architecture: ClientActor(config, slot.client_ids, architecture=slot.architecture)
              for slot in actor_slots(config)}
    first = {arch: (actor.start_method(0), actor.task_tags()) for arch, actor in actors.items()}
    names = list(first)
    prepared = [actors[n].pre_federation(0) for n in names]
    started = []
    for index in range(drivers):
        driver = DriverActor(config)
        driver.start_method(index, names, *(first[n][0] for n in names), *(first[n][1] for n in names))
        driver.before_federation(names, *prepared)
        started.append(driver)
    return actors, started


def _first_round(config):
    """The run's actors and driver after the pre-federation stage, the server state it left, and the parts of
    round 1 the actors sent."""
    actors, [driver] = _started(config)
    prepared = copy.deepcopy(driver.get_state())
    parts = {arch: actor.train_round(0, actor.client_ids, driver.payloads(actor.client_ids),
                                     dict.fromkeys(actor.client_ids, 1.0))
             for arch, actor in actors.items()}
    driver.aggregate(*parts.values())
    return actors, driver, prepared, parts


def test_the_relevance_gradient_of_a_step_holding_several_tasks_is_the_whole_batchs():
    """W_s's gradient of a step whose batch holds two tasks is the share-weighted sum of each task's own gradient
    (the hooked layer's last call alone held only the last task's rows)."""
    config = load_config({
        "name": "two-tasks", "seed": 2,
        "data": {"tasks": [_task("colors", 0, 0, "color"), _task("counts", 0, 0, "count")]},
        "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 4, "alpha": 8}},
        "federation": {"rounds": 1, "clients_per_round": 1},
        "train": {"local_steps": 1, "batch_size": 8},
        "methods": [{"name": "fedmosaic", "grad_interval": 1}],
        "placement": {"executor": "local"},
    })
    host = ClientActor(config, [0])
    start = host.start_method(0)
    client = host._context(0, 0)
    client.model.load_trainable({**start, **host.states[0]["personal"]})
    named = {name: p for name, p in client.model.named_parameters() if p.requires_grad}
    parts = client.micro_batch(next(client.batch_order(1, "train", None)))
    assert len(parts) == 2

    def gradient(step_parts) -> torch.Tensor:
        return rela.relevance_gradient(training.Step(client, step_parts, named, 0, 0, {}), host.method.params.relevance)

    rows = [len(batch["input_ids"]) for _, batch in parts]
    expected = sum(count / sum(rows) * gradient([part]) for count, part in zip(rows, parts))
    assert torch.allclose(gradient(parts), expected, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def federation():
    """The run's actors after the pre-federation stage and one round (built once for the tests below)."""
    config = load_config(HETERO)
    actors, driver, prepared, parts = _first_round(config)
    return config, actors, driver, prepared["aligned"], list(parts.values())


def test_the_aligned_basis_reaches_each_client_once_orthonormal_and_only_p_q_cross_architectures(federation):
    config, actors, driver, aligned, parts = federation
    assert aligned and all(name.startswith("large/") for name in aligned)  # the small model is the pivot
    for name, value in aligned.items():
        eye = torch.eye(4)
        assert torch.allclose(value @ value.T if name.endswith(".A") else value.T @ value, eye, atol=1e-5) or (
            name.endswith(".B"))  # CCA's basis is not orthonormal by construction: docs/fedmosaic.md#cross-model-alignment
        if name.endswith(".A"):
            assert torch.allclose(value @ value.T, eye, atol=1e-5)
    state = actors["large"].states[2]["personal"]
    for name, value in aligned.items():
        assert torch.equal(state[name.removeprefix("large/")], value)  # kept in the client's state
    small = actors["small"].states[0]["personal"]
    basis_b = [v for n, v in small.items() if n.endswith(".B")]
    assert basis_b and all(torch.allclose(b.T @ b, torch.eye(4), atol=1e-5) for b in basis_b)  # the pivot's B
    assert not any(n.endswith((".A", ".B")) and "local" not in n and "global" not in n
                   for n in driver.payloads([2], count_bytes=False)[2])  # sent once
    uploaded = {n for part in parts for u in part.uploads for n in u.tensors["shared"]}
    assert uploaded and all(".local_" in n for n in uploaded)  # never the basis, the gate or the global adapter

    server = driver.get_state()
    method = driver.method
    small_payload = method.payload(server, 0)
    before = {n: v.clone() for n, v in small_payload.items()}
    conv_key = next(n for n in server["stacks"] if n.startswith("large/") and n.endswith("local_B"))
    pq_key = next(n for n in server["stacks"] if n.startswith("pq/"))
    server["stacks"][conv_key] += 1.0  # a large client's conventional LoRA changes: no small client sees it
    after = method.payload(server, 0)
    assert all(torch.equal(after[n], before[n]) for n in before)
    server["stacks"][pq_key][2] += 1.0  # a large client's P / Q changes: the small clients' global P / Q move
    changed = [n for n, v in method.payload(server, 0).items() if not torch.equal(v, before[n])]
    assert changed and all(n.endswith(("_P", "_Q")) for n in changed)
    server["stacks"][conv_key] -= 1.0
    server["stacks"][pq_key][2] -= 1.0


def test_the_memory_probe_of_one_architecture_starts_fedmosaic_with_the_others_as_stand_ins(monkeypatch):
    """``gpus_per_actor: measured`` probes one architecture's actor; FedMosaic mixes P and Q across architectures, so
    its driver needs every architecture's tensors (an H200 run failed here before the stand-ins). On a CPU, with
    torch's CUDA memory calls stood in for."""
    from types import SimpleNamespace

    from rayfed.simulation import gpu_memory

    config = load_config({**HETERO, "placement": {**HETERO["placement"], "gpus_per_actor": "measured"}})
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *device: 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *device: SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30))
    payloads = []
    train = gpu_memory.ClientActor.train
    monkeypatch.setattr(gpu_memory.ClientActor, "train", lambda actor, round_idx, client_ids, sent: (
        payloads.append(sent), train(actor, round_idx, client_ids, sent))[1])
    measurement = gpu_memory.peak_memory(config, "large", (2, 3))
    assert measurement.clients == (2, 3) and measurement.peak_bytes == 2**30
    stand_in, tags = gpu_memory.stand_in_start(config, build_federation(config.data, config.seed),
                                               run_methods(config, build_federation(config.data, config.seed)), 0,
                                               "small")
    assert stand_in and all(not value.any() for value in stand_in.values())
    assert dict(pqlora.pq_groups(list(stand_in)))  # the P and Q FedMosaic mixes across architectures
    assert len(payloads) == 1 and set(payloads[0]) == {2, 3}


def test_rela_weights_are_the_softmax_of_cosines_and_each_client_gets_its_own_weighted_adapter(federation):
    config, actors, driver, _, parts = federation
    server, method = driver.get_state(), driver.method
    gradients = server["relevance"]["gradients"].double()
    unit = gradients / gradients.norm(dim=1, keepdim=True)
    direct = torch.softmax(unit @ unit.T / method.params.tau, dim=1)
    assert torch.allclose(server["relevance"]["weights"].double(), direct, atol=1e-6)
    assert torch.allclose(server["relevance"]["history"][-1], server["relevance"]["weights"])
    weights = server["relevance"]["weights"].double()
    uploads = {u.client_id: {f"{'small' if u.client_id < 2 else 'large'}/{n}": v for n, v in u.tensors["shared"].items()}
               for part in parts for u in part.uploads}
    for client in range(4):
        payload = method.payload(server, client)
        arch = "small" if client < 2 else "large"
        same = [0, 1] if client < 2 else [2, 3]
        for name, value in payload.items():
            if not name.endswith(("global_P", "global_Q", "global_A", "global_B")):
                continue
            local = name.replace(".global_", ".local_")
            if name.endswith(("_P", "_Q")):  # P, Q: over every client, matched by block and module
                block = int(server["pq_layout"][local])
                module = local.split(".layers.", 1)[1].split(".", 1)[1].rsplit(".local_", 1)[0]
                rows = [next(v for n, v in uploads[j].items() if n.endswith(f".{module}.local_{name[-1]}")
                             and int(server["pq_layout"][n]) == block) for j in range(4)]
                expected = sum(weights[client, j] * rows[j].double() for j in range(4))
            else:  # conventional LoRA: within the architecture, the weights renormalized
                within = weights[client, same] / weights[client, same].sum()
                expected = sum(w * uploads[j][local].double() for w, j in zip(within, same))
            assert name.startswith(f"{arch}/") and torch.allclose(value.double(), expected, atol=1e-6), name
    cosine, weights = relevance_weights(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]),
                                        torch.tensor([True, True, False]), tau=0.5)
    assert weights[0, 0] / weights[0, 1] == pytest.approx(math.exp((1 - 2 ** -0.5) / 0.5), rel=1e-5)
    assert torch.allclose(weights[2], torch.tensor([0.5, 0.5, 0.0]))  # no gradient yet: the others, equally


def test_self_weight_include_is_eq_4_with_the_diagonal_and_exclude_the_softmax_over_the_others():
    gradients = torch.tensor([[1.0, 0.0, 2.0], [1.0, 1.0, 0.0], [0.0, 3.0, 1.0], [2.0, -1.0, 1.0]])
    everyone = torch.ones(4, dtype=torch.bool)
    cosine = [[float(gi @ gj / (gi.norm() * gj.norm())) for gj in gradients] for gi in gradients]
    tau = 0.5

    def softmax(i: int, over: list[int]) -> list[float]:
        total = sum(math.exp(cosine[i][n] / tau) for n in over)
        return [math.exp(cosine[i][j] / tau) / total for j in over]

    _, include = relevance_weights(gradients, everyone, tau)
    _, exclude = relevance_weights(gradients, everyone, tau, "exclude")
    for i in range(4):
        assert include[i].tolist() == pytest.approx(softmax(i, list(range(4))), rel=1e-5)
        others = [j for j in range(4) if j != i]
        assert exclude[i, i] == 0 and float(exclude[i].sum()) == pytest.approx(1.0, rel=1e-6)
        assert exclude[i, others].tolist() == pytest.approx(softmax(i, others), rel=1e-5)
    assert float(include.diagonal().min()) > 0.25  # w_ii is each row's largest: cos(g_i, g_i) = 1
    # Client 0 alone has sent a gradient: with exclude it keeps its own adapter; the others weigh it fully.
    _, lone = relevance_weights(gradients, torch.tensor([True, False, False, False]), tau, "exclude")
    assert torch.equal(lone, torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 4))
    allowed = r"\.self_weight = 'both' is invalid: must be one of 'include', 'exclude'\.$"
    with pytest.raises(ConfigError, match=allowed):
        build_method(load_config({"methods": [{"name": "fedmosaic", "self_weight": "both"}]}).methods[0], 0)


def test_every_client_gets_a_finite_adapter_and_metrics_before_any_and_when_one_architecture_has_no_gradient():
    """Before round 1 nobody has a gradient; then client 0 alone trains, so the large architecture (clients 2, 3)
    has none: with either self_weight every payload and metric stays finite, and a client with no weight on its
    architecture keeps its own adapter in the conventional layers (with exclude, client 0, the only one with a
    gradient, too)."""
    rela = HETERO["methods"][0]
    config = load_config({**HETERO, "methods": [rela, {**rela, "self_weight": "exclude", "label": "exclude"}]})
    actors, drivers = _started(config, drivers=2)  # the client side is the same for both: one set of actors

    def evaluated(driver: DriverActor, round_idx: int) -> dict[int, TensorDict]:
        payloads = driver.payloads(list(range(4)), count_bytes=False)
        for cid, payload in payloads.items():
            assert payload and all(torch.isfinite(v).all() for v in payload.values()), (cid, driver.method.params)
        for actor in actors.values():
            for cid, metrics in actor.evaluate(round_idx, {c: payloads[c] for c in actor.client_ids}).items():
                assert metrics and all(math.isfinite(v) for v in metrics.values()), (cid, metrics)
        return payloads

    for driver in drivers:
        evaluated(driver, 0)
    part = actors["small"].train_round(0, [0], drivers[0].payloads([0]), {0: 1.0})
    for driver in drivers:
        driver.aggregate(part)
        server = driver.get_state()
        assert server["relevance"]["has_gradient"].tolist() == [1.0, 0.0, 0.0, 0.0]
        payloads = evaluated(driver, 1)
        for name in (n for n in server["stacks"] if not n.startswith("pq/")):
            arch, local = name.split("/", 1)
            own_of = {"small": {0: 0, 1: 0}, "large": {2: 0, 3: 1}}[arch]
            for cid, row in own_of.items():  # client 1 draws on client 0's adapter, the others keep their own
                received = payloads[cid][local.replace(".local_", ".global_")]
                assert torch.equal(received, server["stacks"][name][row]), (name, cid, driver.method.params)


def test_the_mask_is_one_for_all_clients_and_the_upload_is_w_s_gradient_on_the_trained_batch():
    method = FedMosaic(FedMosaicParams())
    twin = FedMosaic(FedMosaicParams())  # another actor's copy
    mask = method._mask(7, 6912)
    assert torch.equal(mask, twin._mask(7, 6912)) and len(mask) == round(0.4 * 6912) == len(set(mask.tolist()))
    assert not torch.equal(mask, method._mask(8, 6912))
    # the gradient through the frozen layer's output equals autograd's on its weight
    layer = torch.nn.Linear(6, 5)
    x = torch.randn(3, 4, 6)
    gradient = linear_weight_gradient(lambda: layer(x).pow(2).sum(), layer)
    layer.zero_grad()
    layer(x).pow(2).sum().backward()
    assert torch.allclose(gradient, layer.weight.grad, atol=1e-5)
    # and inside a model, under compute matching's FLOP counter, whose hooks see every module's inputs
    model = torch.nn.Sequential(layer, torch.nn.Linear(5, 2))
    plain = linear_weight_gradient(lambda: model(x).pow(2).sum(), layer)
    counted = []
    flops = counted_flops(lambda: counted.append(linear_weight_gradient(lambda: model(x).pow(2).sum(), layer)))
    assert flops > 0 and torch.equal(counted[0], plain)


def test_the_local_adapter_is_never_overwritten_by_an_aggregate(federation):
    config, actors, driver, _, _ = federation
    actor = actors["small"]
    before = {n: v.clone() for n, v in actor.states[0]["personal"].items()}
    payload = driver.payloads([0], count_bytes=False)[0]
    poisoned = {n: v + 0.05 for n, v in payload.items()}  # a global adapter unlike any local one
    method = actor.method
    context = actor._context(0, 1)
    context.train_config = context.train_config.model_copy(update={"lr": 1e-12})
    result = method.local_update(context, actor.states[0], poisoned)
    personal = result.state["personal"]
    assert not any(".global_" in n for n in personal)
    for name, value in before.items():
        if ".local_" in name:
            assert torch.allclose(personal[name], value, atol=1e-6)
            assert not torch.allclose(personal[name], poisoned[name.replace(".local_", ".global_")])
    assert all(torch.equal(method.eval_params(result.state, poisoned)[n], v) for n, v in poisoned.items())


# The LoRA baselines of Tab. 2: the adapter each sends, the one each keeps.
BASELINE_ADAPTERS = {"fedsim": ("shared", "personal"), "feddpa": ("global", "local"), "feddat_lora": ("shared", "local")}


@pytest.mark.parametrize("method", sorted(BASELINE_ADAPTERS))
def test_a_lora_baseline_sends_only_its_shared_adapter_averaged_within_an_architecture_and_keeps_its_own(method):
    sent, kept = BASELINE_ADAPTERS[method]
    actors, driver, _, parts = _first_round(load_config({**HETERO, "methods": [method]}))
    uploaded = {n for part in parts.values() for u in part.uploads for n in u.tensors["shared"]}
    assert uploaded and all(f".{sent}_" in n for n in uploaded)
    [small_sum] = parts["small"].uploads  # the small actor's clients 0 and 1, pre-summed
    payload = driver.payloads([0], count_bytes=False)[0]
    assert payload.keys() == small_sum.tensors["shared"].keys()  # no other adapter, no large layer
    for name, value in payload.items():  # the mean of the small clients' uploads only
        assert torch.equal(value, (small_sum.tensors["shared"][name] / small_sum.weight_sums["shared"][name]).float())

    actor = actors["small"]
    own = {n: v.clone() for n, v in actor.states[0]["personal"].items() if f".{kept}_" in n}
    initial = actor.initial[0]
    assert own and any(not torch.equal(v, initial[n]) for n, v in own.items())  # trained in round 1
    poisoned = {n: v + 0.05 for n, v in payload.items()}  # an aggregate unlike any client's adapter
    context = actor._context(0, 1)
    context.train_config = context.train_config.model_copy(update={"lr": 1e-12})
    result = actor.method.local_update(context, actor.states[0], poisoned)
    for name, value in own.items():  # kept, never replaced by what the server sends
        assert torch.allclose(result.state["personal"][name], value, atol=1e-6)
    for name, value in result.upload["shared"].items():  # the sent adapter starts from what was received
        assert torch.allclose(value, poisoned[name], atol=1e-6)


def test_a_replayed_feddpa_step_trains_each_phases_own_adapter_as_the_eager_one(replayed_on_cpu):
    # FedDPA's two updates: the global adapter's phase, then the local one's, each a phase with its own trained set
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = copy.deepcopy({**HETERO, "methods": ["feddpa"]})
    run["train"] = {**run["train"], "optimizer": "sgd", "momentum": 0.9}
    gap, moved = compiled_gap(run, [0], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 2  # one step a phase's trained set
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5


def test_a_replayed_fedmosaic_update_replays_its_step_and_uploads_the_eager_numbers(parts_replayed_on_cpu):
    # Each step's forward and backward replayed (a part a step: one task a client), the AdamW step eager from the
    # kept state at the PQ layers' own rate, W_s's gradient taken outside the step (ClientContext.train's observe);
    # a relevance gradient taken in the loss, or the wrong batch, rate or trained set, moves the uploads by their size
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    gap, moved = compiled_gap(copy.deepcopy(HETERO), [0, 1], mode="cuda_graphs")
    assert len(parts_replayed_on_cpu) == 2  # a part a task: each client holds one
    assert all(part.host_reads == [0, 0] for part in parts_replayed_on_cpu)  # LLaVA's forward, PQ-LoRA, the loss
    assert moved > 1e-4 and gap == 0.0


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedsim", "ditto", "perada"])
def test_a_replayed_baseline_step_on_llava_trains_as_the_eager_one_and_reads_nothing_back(replayed_on_cpu, method):
    # the baselines' steps on LLaVA with LoRA, captured whole under train.cuda_graphs (on by default)
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = copy.deepcopy({**HETERO, "methods": [method]})
    run["train"] = {**run["train"], "optimizer": "sgd", "momentum": 0.9}
    gap, moved = compiled_gap(run, [0], mode="cuda_graphs")
    assert replayed_on_cpu and all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)
    assert moved > 1e-4 and gap < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_captured_feddpa_update_keeps_the_eager_updates_adapters_and_profile(monkeypatch):
    # both updates captured; the kept profile (recorded after each local step) compared with the eager one's too
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training.plans import graphed_step

    captured = made_instances(monkeypatch, graphed_step, "GraphedStep")
    run = copy.deepcopy({**HETERO, "methods": ["feddpa"]})
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs", overrides=["train.autocast=off"])
    assert len(captured) == 2  # one graph an update's trained set
    assert moved > 1e-4 and gap < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_captured_fedmosaic_update_uploads_the_eager_updates_numbers(monkeypatch):
    # each step's forward and backward a CUDA graph (LLaVA's image tokens placed without a read back to the host)
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training import graph_capture

    captured = made_instances(monkeypatch, graph_capture, "_GraphedPart")
    gap, moved = compiled_gap(copy.deepcopy(HETERO), [0, 1], mode="cuda_graphs", overrides=["train.autocast=off"])
    assert len(captured) == 2
    assert moved > 1e-4 and gap < 1e-3  # float32: a wrong part, rate or trained set moves the update by its size


def test_feddpas_profile_is_the_mean_first_layer_input_of_its_local_batches_recorded_after_each_step(monkeypatch):
    # Recorded by a forward after each step (ClientContext.train's observe), not by the step's own forward, which a
    # captured step replays without its Python: once per local step, and the mean of the first decoder layer's
    # inputs, as a training forward of the local batches has them, over every local row.
    from rayfed.methods.feddpa import InstanceWeights
    from rayfed.models.peft.named_adapters import decoder_layers

    recorded = []
    original = InstanceWeights.recorded_profile
    monkeypatch.setattr(InstanceWeights, "recorded_profile",
                        lambda self: recorded.append(len(self.record)) or original(self))
    run = copy.deepcopy({**HETERO, "methods": ["feddpa"]})
    actors, _, _, _ = _first_round(load_config(run))
    actor = actors["small"]  # clients 0 and 1
    steps = run["train"]["local_steps"]
    assert recorded == [2 * steps] * len(run["data"]["tasks"])  # a sum and a row count a step, no more
    client = actor._context(0, 0)
    inputs: list[torch.Tensor] = []
    _, layers = decoder_layers(client.model.encoder, "model.language_model")
    handle = layers[0].register_forward_pre_hook(lambda module, args, kwargs: inputs.append(
        (args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True)
    try:
        for indices in client.batch_order(steps, "local", None):
            [(task, batch)] = client.micro_batch(indices)
            client.model(batch)
    finally:
        handle.remove()
    expected = torch.cat([hidden.float().mean(dim=1) for hidden in inputs]).mean(0)
    assert len(inputs) == steps and torch.allclose(actor.states[0]["profile"]["mean"], expected, atol=1e-6)


def test_the_task_groups_conflict_on_every_answer():
    maps = answer_maps(3)
    for answer in maps[0]:
        assert len({m[answer] for m in maps}) == 3 and all(m[answer] != answer for m in maps)
    with pytest.raises(ConfigError, match="data.options.groups = 4 is invalid"):
        answer_maps(4)


def test_offline_and_paper_configs_load_and_bad_hyperparameters_are_named():
    for path in sorted((ROOT / "configs" / "fedmosaic").glob("*.yaml")):
        config = load_config(path)
        assert config.architectures and len(config.data.tasks) >= 36, path.name
    offline = load_config(ROOT / "configs" / "fedmosaic" / "offline_dynamic.yaml")
    groups = {task.options["group"] for task in offline.data.tasks}
    assert groups == {0, 1, 2} and offline.architectures["small"].clients == (0, 1, 2, 3)
    tune = load_config(ROOT / "configs" / "tune" / "fedmosaic_tau_blocks.yaml")
    assert tune.methods[0].name == "fedmosaic"
    with pytest.raises(ConfigError, match=r"^methods\[0\] \(fedmosaic\)\.tau = 0 is invalid: must be > 0\.$"):
        build_method(load_config({"methods": [{"name": "fedmosaic", "tau": 0}]}).methods[0], 0)
    with pytest.raises(ConfigError, match="relevance_model must name W_s"):
        method = build_method(load_config({"methods": ["fedmosaic"]}).methods[0], 0, num_clients=2,
                              architecture_of=["small", "large"])
        method.build_model(build_backbone(ModelConfig(backbone="tiny-pretrained:llava"), 0),
                           ModelConfig(backbone="tiny-pretrained:llava", lora={"rank": 2}), [Task(0, "t", ())], 0)


def test_client_and_server_state_survive_a_checkpoint_and_replay_the_same_round(federation, tmp_path):
    """Runs last: it trains round 1 twice, from the live state and from the state written to and read back from a
    checkpoint (safetensors), and compares every upload and the server state after each."""
    config, actors, driver, _, _ = federation
    clients = {cid: copy.deepcopy(state) for actor in actors.values() for cid, state in actor.get_states().items()}
    save_checkpoint(tmp_path, "fedmosaic", 1, copy.deepcopy(driver.get_state()), clients, {"counters": {}})

    def round_one():
        parts = [actor.train_round(1, actor.client_ids, driver.payloads(actor.client_ids), dict.fromkeys(actor.client_ids, 1.0))
                 for actor in actors.values()]
        driver.aggregate(*parts)
        return [u for part in parts for u in part.uploads], copy.deepcopy(driver.get_state())

    uploads, server = round_one()
    restored = load_checkpoint(tmp_path, "fedmosaic")
    assert set(restored.server) == set(server) and restored.clients[0]["optimizer"] and restored.clients[3]["relevance"]
    driver.set_state(restored.server)
    for actor in actors.values():
        actor.set_states(restored.clients)
    replayed, replayed_server = round_one()
    for first, second in zip(uploads, replayed):
        assert first.tensors.keys() == second.tensors.keys()
        for slot in first.tensors:
            assert all(torch.equal(v, second.tensors[slot][n]) for n, v in first.tensors[slot].items())
    server_flat, replayed_flat = flatten_tree(server), flatten_tree(replayed_server)  # the alignment report is a tree
    assert server_flat.keys() == replayed_flat.keys()
    assert all(torch.equal(v, replayed_flat[n]) for n, v in server_flat.items())
    assert server["relevance"]["history"].shape == (2, 4, 4)
    path, value = next(tree_leaves(restored.server["alignment"]))  # read back as the tree it was: arch/block/module
    assert len(path) == 4 and torch.equal(value, tree_at(server["alignment"], path))


def test_the_alignment_features_are_float32_when_the_backbone_runs_in_bfloat16():
    """On a GPU the forward runs in bf16; the pooled public features must reach the alignment in float32, the
    dtype of the A and B they are multiplied with."""
    config = load_config(HETERO)
    actor = ClientActor(config, [0, 1], architecture="small")
    actor.start_method(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a GPU's steps run
        prepared = actor.pre_federation(0)
    features = [value for path, value in tree_leaves(prepared) if path[-1] in ("h", "y")]
    assert features and {value.dtype for value in features} == {torch.float32}


def test_the_alignment_forward_stops_before_the_output_head_and_pools_the_same_features(monkeypatch):
    """The public rows' forward needs the PQ layers' inputs only: it never runs the LM head (128k logits a token at
    paper size), and the pooled features are bitwise those of the whole forward."""
    config = load_config(HETERO)
    actor = ClientActor(config, [0, 1], architecture="small")
    actor.start_method(0)
    head_calls = []
    actor.model.encoder.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    prepared = actor.pre_federation(0)
    assert not head_calls
    monkeypatch.setattr(pqlora, "output_head_skipped", lambda model: contextlib.nullcontext(StopIteration))
    whole = actor.pre_federation(0)
    assert head_calls  # the whole forward ran the head
    prepared, whole = flatten_tree(prepared), flatten_tree(whole)
    assert prepared.keys() == whole.keys() and any(name.endswith("/h") for name in prepared)
    assert all(torch.equal(prepared[name], whole[name]) for name in prepared)


def test_the_cca_of_fewer_samples_than_features_is_the_covariances_cca_computed_in_the_samples_span():
    """A paper-size layer (8,192 wide) seen on a few thousand public rows: the span's CCA gives the covariances'
    correlations, and a B aligned through it is the same, without a d x d matrix."""
    generator = torch.Generator().manual_seed(3)
    pivot = torch.randn(60, 8, generator=generator) @ torch.randn(8, 80, generator=generator)
    other = torch.cat([pivot[:, :50], torch.randn(60, 70, generator=generator)], dim=1) @ torch.randn(
        120, 120, generator=generator) + 0.3 * torch.randn(60, 120, generator=generator)
    p, o = (pivot - pivot.mean(0)).double(), (other - other.mean(0)).double()
    for ridge in (1e-4, 0.5):
        full, span = pqlora._cca_of_covariances(p, o, 4, ridge), pqlora._cca_in_sample_span(p, o, 4, ridge)
        assert torch.allclose(full[2], span[2], atol=1e-8)
        signs = torch.sign((full[0] * span[0]).sum(0))  # a singular pair's sign is free, the same on both sides
        assert torch.allclose(full[0], span[0] * signs, atol=1e-6) and torch.allclose(full[1], span[1] * signs, atol=1e-6)
    pivot_b = pqlora.random_orthonormal(80, 4, generator)
    new_b, correlations = pqlora.cca_basis(pivot, other, pivot_b, ridge=0.5)  # the span's: 60 rows < 120 features
    pi_p, pi_o, expected = (t.float() for t in pqlora._cca_of_covariances(p, o, 4, 0.5))
    assert torch.allclose(correlations, expected, atol=1e-5)
    assert torch.allclose(pi_o.T @ new_b, pi_p.T @ pivot_b, atol=1e-4)


def test_a_compiled_fedmosaic_update_uploads_the_eager_updates_numbers(tmp_path, monkeypatch):
    from conftest import compiled_update_gap

    from rayfed import zoo

    # The shipped tiny LLaVA cut to its first 2 decoder layers (dynamo traces every layer's ops): one block, so a
    # conventional LoRA layer, then the block's last layer with PQ-LoRA
    shallow = zoo.load("tiny-pretrained:llava")
    decoder = shallow.model.model.language_model
    decoder.layers = decoder.layers[:2]
    shallow.model.config.text_config.num_hidden_layers = 2
    shallow.model.save_pretrained(tmp_path)
    shallow.processor.save_pretrained(tmp_path)
    # float32 sums in another order: round-off of about 1e-7 relative per operation; a wrong path, batch or lr
    # moves the update by its own size
    run = copy.deepcopy(HETERO)  # one architecture, one step: the gated PQ-LoRA step, with less to trace
    del run["architectures"]
    run["model"]["backbone"] = f"hf:{tmp_path}"
    run["methods"][0]["blocks"] = 1
    run["train"]["local_steps"] = 1
    assert compiled_update_gap(run, [0], monkeypatch) < 1e-4
