"""A method with per-client state: SCAFFOLD (Karimireddy et al., 2020), with option II's control variates, run next
to FedAvg on the same clients.

    python examples/scaffold.py [key.sub=value ...]      # e.g. federation.rounds=30

Client i keeps its control variate c_i (zero at first) in its client state, across rounds; the server keeps x and the
server control c, and sends both. Locally, K plain SGD steps at rate eta_l on the corrected gradient
``g_i(y) - c_i + c`` from y = x; then ``c_i+ = c_i - c + (x - y) / (K eta_l)`` (option II). The client uploads y and
``c_i+ - c_i``; the server takes ``x <- x + eta_g mean_i (y_i - x)`` and ``c <- c + (1/N) sum_i (c_i+ - c_i)`` over
the round's S clients (N: all clients). Both are sums over the uploads, so the actors may pre-sum them.

Runs of one task: c's update divides by all N clients, which a per-task head (held by some clients only) would need
to replace by its task's clients.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import rayfed
from rayfed.errors import ConfigError
from rayfed.method import weighted_mean, weighted_sums

CONTROL = "control"  # the client-state, server-state and upload slot of the control variates, and c's payload entry


@dataclass(frozen=True)
class ScaffoldParams:
    server_lr: float = 1.0  # eta_g

    def __post_init__(self) -> None:
        if not self.server_lr > 0:
            raise ValueError("server_lr must be > 0")


def controls_of(payload: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A payload's parameters x and server control c (its ``control`` tree), each by parameter name."""
    params = {n: v for n, v in payload.items() if n != CONTROL}
    return params, payload.get(CONTROL, {})


def gradient_correction(correction: dict[str, torch.Tensor]):
    """``sum_n <correction_n, w_n>`` as an extra loss term: its gradient adds ``correction`` to each step's."""

    def term(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((value * params[name]).sum() for name, value in correction.items())

    return term


def require_plain_sgd(train) -> None:
    """Option II reads (x - y) / (K eta_l) as the mean corrected gradient: true of K plain SGD steps at rate eta_l."""
    for field, value, allowed in (("optimizer", train.optimizer, "sgd"), ("momentum", train.momentum, 0.0),
                                  ("schedule", train.schedule, "constant"), ("grad_clip", train.grad_clip, None)):
        if value != allowed:
            raise ConfigError(f"train.{field} = {value!r} is not allowed with scaffold, whose option-II control "
                              f"variates assume plain SGD steps at a constant rate; allowed: {allowed!r}.")


@rayfed.register_method("scaffold")
class Scaffold(rayfed.Method):
    """SCAFFOLD with option II control variates: each client's c_i is kept in its client state."""

    Params = ScaffoldParams
    aggregation = rayfed.WeightedMean()  # aggregate reads the sums of y_i and of c_i+ - c_i, nothing per client

    def init_client(self, initial):
        shared, personal = self.split(initial)
        return {"personal": personal, CONTROL: {n: torch.zeros_like(v) for n, v in shared.items()}}

    def local_update(self, client, state, payload):
        require_plain_sgd(client.train_config)
        x, c = controls_of(payload)
        c_i = state[CONTROL]
        steps = client.default_steps()
        result = client.train({**state["personal"], **x}, steps=steps,
                              extra_loss=gradient_correction({n: c[n] - c_i[n] for n in c_i}))
        y, personal = self.split(result.params)
        rate = 1.0 / (steps * client.train_config.lr)
        new_c_i = {n: c_i[n] - c[n] + (x[n] - y[n]) * rate for n in c_i}
        upload = {"shared": y, CONTROL: {n: new_c_i[n] - c_i[n] for n in c_i}}
        # weight 1: the paper's plain means over the round's clients (not weighted by sample counts)
        return rayfed.LocalResult({**state, "personal": personal, CONTROL: new_c_i}, upload, result.loss, weight=1.0)

    def eval_params(self, state, payload):
        return {**state["personal"], **controls_of(payload or {})[0]}

    def init_server(self, initial_shared):
        return {"global": initial_shared, CONTROL: {n: torch.zeros_like(v) for n, v in initial_shared.items()}}

    def payload(self, server, client_id):
        # x as every payload holds parameters, and c as a tree of its own: the engine moves trees whole
        return {**server["global"], CONTROL: server[CONTROL]}

    def aggregate(self, server, uploads):
        uploaded = [u for u in uploads if u.tensors.get("shared")]
        if not uploaded:
            return server
        eta_g, x, c = self.params.server_lr, dict(server["global"]), dict(server[CONTROL])
        for name, mean_y in weighted_mean(uploaded, "shared").items():
            x[name] = x[name] + eta_g * (mean_y - x[name])
        delta_c_sums, _ = weighted_sums(uploaded, CONTROL)  # with weight 1 a plain sum over the round's clients
        for name, total in delta_c_sums.items():
            c[name] = (c[name] + total / self.num_clients).to(c[name].dtype)
        return {"global": x, CONTROL: c}


CONFIG = {
    "name": "scaffold",
    "data": {"source": "sklearn:digits", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.3, "min_samples": 20}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 10, "batch_size": 16, "lr": 0.05, "optimizer": "sgd"},
    "methods": ["fedavg", "scaffold"],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
