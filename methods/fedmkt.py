"""FedMKT (Fan et al., COLING 2025): mutual token-level knowledge transfer between a larger model and the clients'
smaller ones, as FedMosaic ported it to clients of several architectures.

*FedMKT: Federated Mutual Knowledge Transfer for Large and Small Language Models* (arXiv 2406.02224);
docs/fedmosaic.md#the-distillation-baselines-takfl-perada-fedmkt describes this implementation. Every client keeps
its own adapter theta_i across rounds, trains it, uploads it and is evaluated with it (before the server's
step, as FedMosaic evaluates). There is no server LLM: each architecture k has a server-side global adapter g_k
(the initial adapter at first, never averaged). After a round, on the first ``public_samples`` public rows (labeled:
teacher-forced on their answers, losses = mean cross-entropy over the answer tokens, teachers in eval mode):

1. g_k learns from the clients: for each row x, the client j*(x) of lowest loss among all the round's clients of
   every architecture is the teacher; g_k trains one epoch on the rows where j* beats g_k (``keep_self_best``:
   every row, g_k's own logits where it is best) with soft cross-entropy toward softmax(z_{j*}) (T = 1), plus
   ``kd_alpha`` times the answers' cross-entropy.
2. The clients learn from g_k: each client i of k trains theta_i one epoch on the rows where the new g_k beats it,
   toward softmax(z_{g_k}); the result is client i's payload, from which its next round starts. The clients of k
   take these steps together (``PublicPass.train_each``).

With ``top_k`` every teacher's logits are cut to each token's k largest (the cut travels between the actors and the
driver: values and token ids) and a student learns toward the teacher's softmax renormalised over those k tokens;
the losses that pick the teachers are always over the whole vocabulary.

Architectures whose tokenizers differ (Llama-3 and Qwen2.5 clients in one run) distil through a token alignment
(:mod:`rayfed.methods.token_alignment`, ``alignment``): before round 1 each architecture sends its vocabulary, and
the driver carries a teacher's top-k cut at its own tokens of a public answer to the student's tokens of that
answer and into the student's vocabulary. Architectures of one tokenizer share ids and positions, unaligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rayfed.architectures import prefixed, unprefixed
from rayfed.errors import ConfigError
from rayfed.method import (ClientState, EachUpload, LocalResult, Method, PreFederationStage, PublicPassStage,
                           ServerState, TensorDict, Upload)
from rayfed.methods.token_alignment import Alignment, Vocabulary, VocabularyMap, aligned_cut
from rayfed.param_names import prefix_of
from rayfed.params import AtLeastOne, Positive, UnitInterval, hyperparameters
from rayfed.registry import register_method
from rayfed.training import ClientContext, PreFederation, PublicJob, PublicPass, same_answers, token_losses
from rayfed.types import Slot

GLOBAL = "global"
IDS = ":ids"  # beside a top-k cut of logits: the token ids of its values
VOCABULARIES = "vocabularies"  # the server slot of each architecture's vocabulary, when they differ


@hyperparameters
class FedMKTParams:
    public_samples: AtLeastOne = 80
    kd_epochs: AtLeastOne = 1
    kd_batch_size: AtLeastOne = 4
    kd_lr: Positive | None = None  # default: train.lr
    kd_alpha: UnitInterval = 0.0  # weight of the answers' cross-entropy (FedMosaic 0; FATE-LLM 0.9)
    keep_self_best: bool = False  # FATE-LLM: rows where the model itself is best distil toward its own logits
    top_k: AtLeastOne | None = None  # a teacher's k largest logits per token (the original: 128); null: all of them
    alignment: Alignment = "greedy_dp"  # across tokenizers: greedy_dp (FedMosaic's) or dtw (FATE-LLM's default)


def lowest_loss(losses: torch.Tensor, own: torch.Tensor, keep_self_best: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (column of ``losses``, one row per candidate teacher): the candidate of lowest loss (the first on a
    tie) and whether the row is trained on: where that loss is below the student's ``own`` (every row with
    ``keep_self_best``, the student's own outputs then the target where it is best)."""
    best_loss, best = losses.min(dim=0)
    trains = torch.ones_like(own, dtype=torch.bool) if keep_self_best else best_loss < own
    return best, trains


def soft_cross_entropy(student: torch.Tensor, target: torch.Tensor, answers: torch.Tensor,
                       alpha: float) -> torch.Tensor:
    """``alpha * CE(answers) + (1 - alpha) * mean_tokens <softmax(target), -log softmax(student)>``."""
    soft = -(torch.softmax(target.float(), -1) * torch.log_softmax(student.float(), -1)).sum(-1).mean()
    if not alpha:
        return soft
    return alpha * nn.functional.cross_entropy(student.float(), answers) + (1 - alpha) * soft


def cut_logits(logits: torch.Tensor, top_k: int | None, name: str) -> TensorDict:
    """A teacher's answer-position logits as they travel, under ``name``: all of them (``top_k`` None), or each
    token's ``top_k`` largest and, under ``name + IDS``, their token ids."""
    if top_k is None:
        return {name: logits}
    values, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    return {name: values, name + IDS: ids}


def full_logits(entries: TensorDict, name: str, vocabulary: int) -> torch.Tensor:
    """The logits ``name`` of :func:`cut_logits` over the whole vocabulary: -inf off a top-k cut's tokens, so that
    the softmax toward which a student learns is the teacher's, renormalised over its k most likely tokens."""
    values, ids = entries[name], entries.get(name + IDS)
    if ids is None:
        return values
    full = torch.full((len(values), vocabulary), -torch.inf, dtype=values.dtype, device=values.device)
    return full.scatter_(1, ids, values)


@register_method("fedmkt")
class FedMKT(Method):
    Params = FedMKTParams
    aggregation = EachUpload()  # every client's own adapter is a candidate teacher
    # each architecture's vocabulary (for the alignment across tokenizers); after each round, two passes: every
    # adapter's losses and logits, then each architecture's two distillations
    stages = (PreFederationStage(), PublicPassStage(2))

    def __init__(self, params: FedMKTParams | None = None):
        super().__init__(params)
        self._uploads: dict[int, TensorDict] = {}
        self._outputs: dict[str, TensorDict] = {}
        self._maps: dict[tuple[str, str], VocabularyMap] = {}  # (teacher, student) architectures -> M, kept

    def init_client(self, initial: TensorDict) -> ClientState:
        return {Slot.PERSONAL: dict(initial)}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        result = client.train(payload or state[Slot.PERSONAL])
        return LocalResult({**state, Slot.PERSONAL: result.params}, {Slot.SHARED: result.params}, result.loss,
                           weight=1.0)

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return state[Slot.PERSONAL]

    def init_server(self, initial_shared: TensorDict) -> ServerState:
        return {Slot.GLOBAL: dict(initial_shared), "clients": {}}

    def pre_federation(self, stage: PreFederation) -> TensorDict:
        tokenizer = getattr(stage.model, "tokenizer", None)
        return Vocabulary.of(tokenizer).to_tensors() if tokenizer is not None else {}

    def before_federation(self, server: ServerState, prepared: dict[str, TensorDict]) -> ServerState:
        """The architectures' vocabularies into the server state when they differ (nothing when all are one)."""
        vocabularies = {arch: Vocabulary.from_tensors(tensors) for arch, tensors in prepared.items() if tensors}
        if len(set(vocabularies.values())) < 2:
            return server
        if self.params.top_k is None:
            first = next(iter(vocabularies))
            other = next(arch for arch, vocabulary in vocabularies.items() if vocabulary != vocabularies[first])
            raise ConfigError(f"methods (fedmkt).top_k = null, but architectures {first!r} and {other!r} tokenize "
                              "differently, and a teacher's logits cross tokenizers as its k largest per token: set "
                              "top_k (the original: 128).")
        return {**server, VOCABULARIES: {f"{arch}/{name}": value for arch, tensors in prepared.items()
                                         for name, value in tensors.items()}}

    def _vocabulary_map(self, server: ServerState, teacher: str, student: str) -> VocabularyMap | None:
        """M from ``teacher``'s vocabulary to ``student``'s, None when they are one (or unknown: all one)."""
        if VOCABULARIES not in server or teacher == student:
            return None
        if (teacher, student) not in self._maps:
            self._maps[(teacher, student)] = VocabularyMap(*(
                Vocabulary.from_tensors(unprefixed(server[VOCABULARIES], arch)) for arch in (teacher, student)))
        mapping = self._maps[(teacher, student)]
        return None if mapping.teacher == mapping.student else mapping

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        self._uploads = {u.client_id: u.tensors[Slot.SHARED] for u in uploads if u.tensors.get(Slot.SHARED)}
        return server

    def payload(self, server: ServerState, client_id: int) -> TensorDict | None:
        return unprefixed(server["clients"], f"client:{client_id}") or None

    def _clients(self, architecture: str) -> list[int]:
        return [cid for cid in sorted(self._uploads) if self.architecture_of[cid] == architecture]

    def public_request(self, server: ServerState, index: int, architecture: str) -> TensorDict:
        request = prefixed(unprefixed(server[Slot.GLOBAL], architecture), GLOBAL)
        for cid in self._clients(architecture):
            request.update(prefixed(unprefixed(self._uploads[cid], architecture), f"client:{cid}"))
        if index == 0:
            return request
        outputs = self._outputs
        candidates = sorted(self._uploads)
        losses = torch.stack([outputs[self.architecture_of[c]][f"loss:{c}"] for c in candidates])
        own = outputs[architecture][f"loss:{GLOBAL}"]
        best, trains = lowest_loss(losses, own, self.params.keep_self_best)
        keep_own = trains & (losses.min(dim=0).values >= own)  # with keep_self_best: g_k itself is best there
        row_of = outputs[architecture]["row_of"]
        cut = ("", IDS) if f"logits:{GLOBAL}{IDS}" in outputs[architecture] else ("",)
        target = {part: outputs[architecture][f"logits:{GLOBAL}{part}"].clone() for part in cut}
        for position, cid in enumerate(candidates):
            tokens = (best[row_of] == position) & ~keep_own[row_of]
            teacher = self.architecture_of[cid]
            mapping = self._vocabulary_map(server, teacher, architecture)
            if mapping is None:
                for part in cut:
                    target[part][tokens] = outputs[teacher][f"logits:{cid}{part}"][tokens]
            else:
                self._align(target, cid, teacher, architecture, mapping, row_of[tokens].unique())
        request.update({"trains": trains.float(), "vocabulary": outputs[architecture]["vocabulary"]})
        request.update({f"target{part}": value for part, value in target.items()})
        for cid in self._clients(architecture):
            request[f"loss:{cid}"] = outputs[architecture][f"loss:{cid}"]
            if self.params.keep_self_best:
                request.update({f"logits:{cid}{part}": outputs[architecture][f"logits:{cid}{part}"] for part in cut})
        return request

    def _align(self, target: TensorDict, cid: int, teacher: str, student: str, mapping: VocabularyMap,
               rows: torch.Tensor) -> None:
        """``target``'s cut at the student's answer tokens of ``rows`` from client ``cid``'s cut at its own
        tokenization of those answers, carried across the tokenizers."""
        source, own = self._outputs[teacher], self._outputs[student]
        for row in rows.tolist():
            at, source_at = own["row_of"] == row, source["row_of"] == row
            target[""][at], target[IDS][at] = aligned_cut(
                own["answers"][at].tolist(), source["answers"][source_at].tolist(), source[f"logits:{cid}"][source_at],
                source[f"logits:{cid}{IDS}"][source_at], mapping, self.params.alignment, target[""].shape[-1])

    def public_pass(self, stage: PublicPass, index: int, request: TensorDict) -> TensorDict:
        rows = stage.rows(self.params.public_samples)
        answers, row_of = stage.answers(rows)
        keys = [GLOBAL] + sorted({prefix_of(n) for n in request if n.startswith("client:")})
        if index == 0:
            result: TensorDict = {"answers": answers, "row_of": row_of}
            for key in keys:
                logits = stage.answer_logits(unprefixed(request, key), rows)
                name = key.removeprefix("client:")
                result.update(cut_logits(logits, self.params.top_k, f"logits:{name}"))
                result[f"loss:{name}"] = token_losses(logits, answers.to(logits.device), row_of, rows)
                result["vocabulary"] = torch.tensor(logits.shape[-1])
            return result
        p = self.params

        def loss(student, target, answer_tokens):
            return soft_cross_entropy(student, target, answer_tokens, p.kd_alpha)

        kd = {"epochs": p.kd_epochs, "batch_size": p.kd_batch_size, "lr": p.kd_lr or stage.train_config.lr}

        def job(params: TensorDict, trains: torch.Tensor, target: torch.Tensor, purpose: str) -> PublicJob:
            return PublicJob(params, rows[trains], target[trains[row_of]], purpose)

        vocabulary = int(request["vocabulary"])
        [new_global] = stage.train_each([job(unprefixed(request, GLOBAL), request["trains"].bool().cpu(),
                                             full_logits(request, "target", vocabulary).cpu(), "fedmkt:global")],
                                        loss, **kd)
        global_logits = stage.answer_logits(new_global, rows)
        global_loss = token_losses(global_logits, answers, row_of, rows)
        global_target = full_logits(cut_logits(global_logits, p.top_k, GLOBAL), GLOBAL, vocabulary)
        jobs = []
        for key in keys[1:]:
            cid = key.removeprefix("client:")
            own_loss = request[f"loss:{cid}"].cpu()
            _, trains = lowest_loss(global_loss.unsqueeze(0), own_loss, p.keep_self_best)
            target = global_target
            if p.keep_self_best:  # the client's own logits where it beats g_k
                own_best = (global_loss >= own_loss)[row_of]
                own_logits = full_logits(request, f"logits:{cid}", vocabulary).cpu()
                target = torch.where(own_best.unsqueeze(1), own_logits, global_target)
            jobs.append(job(unprefixed(request, key), trains, target, f"fedmkt:{key}"))
        result = prefixed(new_global, GLOBAL)
        for key, trained in zip(keys[1:], stage.train_each(jobs, loss, **kd)):  # the clients of k take steps together
            result.update(prefixed(trained, key))
        return result

    def after_public_pass(self, server: ServerState, index: int, results: dict[str, TensorDict]) -> ServerState:
        if index == 0:
            tokenizers: dict[str, dict[str, TensorDict]] = {}  # architectures by the first of their tokenizer
            for arch, result in results.items():
                first = next((f for f in tokenizers if self._vocabulary_map(server, f, arch) is None), arch)
                tokenizers.setdefault(first, {})[arch] = result
            for same in tokenizers.values():
                same_answers(same, "fedmkt")
            self._outputs = results
            return server
        new_global, clients = dict(server[Slot.GLOBAL]), dict(server["clients"])
        for arch, result in results.items():
            new_global.update(prefixed(unprefixed(result, GLOBAL), arch))
            for cid in self._clients(arch):
                clients.update(prefixed(prefixed(unprefixed(result, f"client:{cid}"), arch), f"client:{cid}"))
        self._uploads, self._outputs = {}, {}
        return {**server, Slot.GLOBAL: new_global, "clients": clients}
