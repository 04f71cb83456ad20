"""TAKFL (Morafah et al., NeurIPS 2024): task-arithmetic knowledge integration across architectures.

*Towards Diverse Device Heterogeneous Federated Learning via Task Arithmetic Knowledge Integration* (arXiv 2409.18461);
docs/fedmosaic.md#the-distillation-baselines-takfl-perada-fedmkt describes this implementation. Clients train the
received adapter of their architecture and upload it; the server averages the uploads within each architecture
(theta_k). After the round, for every student architecture k and every teacher architecture t (k included) it distils,
from theta_k each time, the mean logits of t's uploads on the first ``public_samples`` public rows (``T^2 KL_T``, answer
positions, teacher-forced, teachers in eval mode) plus ``self_weight`` times a ``T_s^2 KL_{T_s}`` pull toward theta_k's
own outputs; each run gives a task vector tau_kt = phi_kt - theta_k, and every client of k receives theta_k + sum_t
lambda_kt tau_kt (uniform lambda = 1/K, as FedMosaic ran it, or a fixed matrix, rows and columns in the config's order
of architectures). ``compat_zero_tau`` skips the distillation (FedMosaic's code, whose task vectors are all zero: FedAvg
within an architecture).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from rayfed.architectures import prefixed, unprefixed
from rayfed.errors import ConfigError
from rayfed.method import (ClientState, EachUpload, LocalResult, Method, PublicPassStage, ServerState, TensorDict,
                           Upload)
from rayfed.param_names import prefix_of
from rayfed.params import AtLeastOne, NonNegative, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.training import ClientContext, PublicPass, distillation_loss, same_answers
from rayfed.types import Slot

AVERAGE, TEACHER, SELF, TASK_VECTOR = "average", "teacher", "self", "task_vector"


@hyperparameters
class TAKFLParams:
    temperature: Positive = 3.0  # T of the teacher term (x T^2)
    self_temperature: Positive = 20.0  # T_s of the self-regulariser (x T_s^2)
    self_weight: NonNegative = 0.01  # gamma, for every architecture
    lambdas: Literal["uniform", "fixed"] = "uniform"  # uniform: 1/K (FedMosaic); fixed: lambda_matrix
    lambda_matrix: tuple[tuple[NonNegative, ...], ...] | None = None  # K x K, row = student, in config order
    public_samples: AtLeastOne = 80  # the first P public rows, reshuffled every round
    kd_epochs: AtLeastOne = 1
    kd_batch_size: AtLeastOne = 4
    kd_lr: Positive | None = None  # default: train.lr (FedMosaic's server uses the local optimizer's)
    weight_by_samples: bool = False  # the within-architecture mean weighted by samples (TAKFL's code), not uniform
    compat_zero_tau: bool = False  # FedMosaic's code: no distillation, FedAvg within an architecture
    evaluate: Literal["trained", "payload"] = "trained"  # trained: a client's adapter after local training (FedMosaic)

    def __post_init__(self) -> None:
        if (self.lambdas == "fixed") != (self.lambda_matrix is not None):
            raise ValueError("lambda_matrix must be given exactly when lambdas = fixed")
        if self.lambda_matrix is not None and any(abs(sum(row) - 1) > 1e-6 for row in self.lambda_matrix):
            raise ValueError("lambda_matrix's rows must sum to 1")


def merged(average: TensorDict, task_vectors: Sequence[TensorDict], weights: Sequence[float]) -> TensorDict:
    """``average + sum_t weights_t * task_vectors_t`` per tensor (float64 sums, in the average's dtype)."""
    out = {}
    for name, value in average.items():
        total = value.double() + sum(w * tau[name].double() for w, tau in zip(weights, task_vectors))
        out[name] = total.to(value.dtype)
    return out


@register_method("takfl")
class TAKFL(Method):
    Params = TAKFLParams
    aggregation = EachUpload()  # every client's own adapter is a teacher
    stages = (PublicPassStage(2),)  # teachers' and self outputs per architecture; then K distillations per student

    def __init__(self, params: TAKFLParams | None = None):
        super().__init__(params)
        if self.params.compat_zero_tau:
            self.stages = ()
        self._uploads: dict[int, TensorDict] = {}  # the round's uploads, server-named, until the passes are done
        self._outputs: dict[str, TensorDict] = {}

    def init_client(self, initial: TensorDict) -> ClientState:
        return {Slot.PERSONAL: {}, "trained": {}}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        result = client.train(payload)
        weight = None if self.params.weight_by_samples else 1.0
        return LocalResult({**state, "trained": result.params}, {Slot.SHARED: result.params}, result.loss,
                           weight=weight)

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        if self.params.evaluate == "trained" and state["trained"]:
            return state["trained"]
        return payload or {}

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        self._uploads = {u.client_id: u.tensors[Slot.SHARED] for u in uploads if u.tensors.get(Slot.SHARED)}
        return super().aggregate(server, uploads)

    def _clients(self, architecture: str) -> list[int]:
        return [cid for cid in sorted(self._uploads) if self.architecture_of[cid] == architecture]

    def public_request(self, server: ServerState, index: int, architecture: str) -> TensorDict:
        request = prefixed(unprefixed(server[Slot.GLOBAL], architecture), AVERAGE)
        if index == 0:
            if not self._clients(architecture):
                raise ConfigError(f"methods (takfl) distils every architecture's mean logits, but no client of "
                                  f"{architecture!r} trained this round; sample all clients every round "
                                  "(federation.clients_per_round = data.num_clients), as FedMosaic does.")
            for cid in self._clients(architecture):
                request.update(prefixed(unprefixed(self._uploads[cid], architecture), f"client:{cid}"))
            return request
        for teacher, outputs in self._outputs.items():
            request[f"{TEACHER}:{teacher}"] = outputs[TEACHER]
        request[SELF] = self._outputs[architecture][SELF]
        return request

    def public_pass(self, stage: PublicPass, index: int, request: TensorDict) -> TensorDict:
        rows = stage.rows(self.params.public_samples)
        average = unprefixed(request, AVERAGE)
        if index == 0:
            clients = sorted({prefix_of(name) for name in request if name.startswith("client:")})
            teacher = torch.stack([stage.answer_logits(unprefixed(request, c), rows) for c in clients]).mean(0)
            answers, _ = stage.answers(rows)
            return {TEACHER: teacher, SELF: stage.answer_logits(average, rows), "answers": answers,
                    "vocabulary": torch.tensor(teacher.shape[-1])}
        p = self.params
        own = request[SELF]
        gamma, t, ts = p.self_weight, p.temperature, p.self_temperature
        result: TensorDict = {}
        for name in sorted(n for n in request if n.startswith(f"{TEACHER}:")):
            teacher = name.split(":", 1)[1]
            targets = torch.cat([request[name], own], dim=-1)
            vocabulary = own.shape[-1]

            def loss(student, target, _answers):
                return (distillation_loss(student, target[:, :vocabulary], t)
                        + gamma * distillation_loss(student, target[:, vocabulary:], ts))

            # From theta_k for every teacher, seeded by (student, teacher): the order of the teachers changes nothing.
            distilled = stage.train(average, loss, rows, targets, epochs=p.kd_epochs, batch_size=p.kd_batch_size,
                                    lr=p.kd_lr or stage.train_config.lr, purpose=f"takfl:{teacher}")
            result.update(prefixed({n: distilled[n] - average[n] for n in average}, f"{TASK_VECTOR}:{teacher}"))
        return result

    def after_public_pass(self, server: ServerState, index: int, results: dict[str, TensorDict]) -> ServerState:
        if index == 0:
            same_answers(results, "takfl")
            self._outputs = results
            return server
        names = list(results)
        new_global = dict(server[Slot.GLOBAL])
        for k, student in enumerate(names):
            average = unprefixed(server[Slot.GLOBAL], student)
            vectors = [unprefixed(results[student], f"{TASK_VECTOR}:{teacher}") for teacher in names]
            weights = self.params.lambda_matrix[k] if self.params.lambda_matrix else [1 / len(names)] * len(names)
            if len(weights) != len(names):
                raise ConfigError(f"methods (takfl).lambda_matrix has rows of {len(weights)} weights, but the run has "
                                 f"{len(names)} architectures ({', '.join(names)}).")
            new_global.update(prefixed(merged(average, vectors, weights), student))
        self._uploads, self._outputs = {}, {}
        return {**server, Slot.GLOBAL: new_global}
