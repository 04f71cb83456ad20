"""PerAda (Xie et al., CVPR 2024): personalized adapters with a proximal pull, and a global adapter refined on the
server by ensemble distillation.

*PerAda: Parameter-Efficient Federated Learning Personalization with Generalization Guarantees* (arXiv 2302.06637);
docs/fedmosaic.md#the-distillation-baselines-takfl-perada-fedmkt describes this implementation. A client trains the
global adapter w_i it receives (cross-entropy) and uploads it, then trains its personal adapter v_i with
cross-entropy + ``mu * ||v_i - w||^2`` toward the received w (squared, not halved, as FedMosaic's code) on the same
batches; v_i never leaves the client and is what it is evaluated with. The server averages the w_i within each
architecture, then distils each architecture's average toward the mean logits of *all* the round's clients'
w_j, of every architecture (1/N each), on the first ``public_samples`` public rows (``KL_T``, no T^2, answer
positions, teacher-forced, teachers in eval mode); every client of that architecture receives the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rayfed.architectures import prefixed, unprefixed
from rayfed.method import (ClientState, EachUpload, LocalResult, Method, PublicPassStage, ServerState, TensorDict,
                           Upload)
from rayfed.param_names import prefix_of
from rayfed.params import AtLeastOne, NonNegative, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.training import ClientContext, PublicPass, distillation_loss, proximal_penalty, same_answers
from rayfed.types import Slot

AVERAGE, TEACHER = "average", "teacher"


@hyperparameters
class PerAdaParams:
    mu: NonNegative = 1e-3  # the proximal weight (FedMosaic's run; PerAda's paper: 0.1 to 1, see P-e on its scale)
    temperature: Positive = 2.0  # T of the server's KL (no T^2 factor)
    public_samples: AtLeastOne = 80
    kd_epochs: AtLeastOne = 1
    kd_batch_size: AtLeastOne = 4
    kd_lr: Positive | None = None  # default: train.lr


def personal_penalty(centre: TensorDict | None, mu: float):
    """``mu * ||v - centre||^2`` (squared, not halved, as FedMosaic's code), or None."""
    return proximal_penalty(centre, 2 * mu)


@register_method("perada")
class PerAda(Method):
    Params = PerAdaParams
    aggregation = EachUpload()  # every client's own adapter is a teacher
    stages = (PublicPassStage(2),)  # the teachers' logits per architecture; then each architecture's distillation

    def __init__(self, params: PerAdaParams | None = None):
        super().__init__(params)
        self._uploads: dict[int, TensorDict] = {}
        self._teacher: torch.Tensor | None = None

    def init_client(self, initial: TensorDict) -> ClientState:
        return {Slot.PERSONAL: {}, "personal_adapter": dict(initial)}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        shared = client.train(payload)
        # The same batches as the global update.
        personal = client.train(state["personal_adapter"], extra_loss=personal_penalty(payload, self.params.mu))
        return LocalResult({**state, "personal_adapter": personal.params}, {Slot.SHARED: shared.params}, shared.loss,
                           weight=1.0)

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return state["personal_adapter"]

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        self._uploads = {u.client_id: u.tensors[Slot.SHARED] for u in uploads if u.tensors.get(Slot.SHARED)}
        return super().aggregate(server, uploads)

    def public_request(self, server: ServerState, index: int, architecture: str) -> TensorDict:
        if index == 0:
            request: TensorDict = {}
            for cid in sorted(self._uploads):
                if self.architecture_of[cid] == architecture:
                    request.update(prefixed(unprefixed(self._uploads[cid], architecture), f"client:{cid}"))
            return request
        return {**prefixed(unprefixed(server[Slot.GLOBAL], architecture), AVERAGE), TEACHER: self._teacher}

    def public_pass(self, stage: PublicPass, index: int, request: TensorDict) -> TensorDict:
        rows = stage.rows(self.params.public_samples)
        if index == 0:
            clients = sorted({prefix_of(name) for name in request})
            logits = [stage.answer_logits(unprefixed(request, c), rows).double() for c in clients]
            total = torch.stack(logits).sum(0) if logits else torch.zeros(())
            answers, _ = stage.answers(rows)
            return {"teacher_sum": total, "answers": answers,
                    "vocabulary": torch.tensor(total.shape[-1] if logits else 0)}
        t = self.params.temperature

        def loss(student, target, _answers):
            return distillation_loss(student, target, t) / t**2

        distilled = stage.train(unprefixed(request, AVERAGE), loss, rows, request[TEACHER],
                                epochs=self.params.kd_epochs, batch_size=self.params.kd_batch_size,
                                lr=self.params.kd_lr or stage.train_config.lr, purpose="perada")
        return prefixed(distilled, "distilled")

    def after_public_pass(self, server: ServerState, index: int, results: dict[str, TensorDict]) -> ServerState:
        if index == 0:
            same_answers({arch: r for arch, r in results.items() if int(r["vocabulary"])}, "perada")
            # The teacher: the mean of all the round's clients' logits, 1/N each, whatever their architecture.
            self._teacher = (sum(r["teacher_sum"] for r in results.values()) / len(self._uploads)).float()
            return server
        new_global = dict(server[Slot.GLOBAL])
        for arch, result in results.items():
            new_global.update(prefixed(unprefixed(result, "distilled"), arch))
        self._uploads, self._teacher = {}, None
        return {**server, Slot.GLOBAL: new_global}
