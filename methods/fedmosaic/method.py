"""FedMosaic: relevance-guided aggregation (RELA) and PQ-LoRA across heterogeneous multi-modal clients.

From *Not All Clients Are Equal: Collaborative Model Personalization on Heterogeneous Multi-Modal Clients* (Alg. 1-4;
no arXiv id known); docs/fedmosaic.md#the-method describes this implementation. Each client trains, over its frozen
backbone (any of K architectures), a *local* adapter (kept, never overwritten) next to a *global* adapter it receives
every round (frozen while it trains), mixed per decoder layer by a learnable gate (Eq. 7,
:mod:`rayfed.methods.fedmosaic.pqlora`). The last decoder layer of each of ``blocks`` blocks carries PQ-LoRA
(docs/fedmosaic.md#pq-lora-and-the-dual-adapter): a frozen orthonormal basis ``A``, ``B`` and trained ``P`` (r x r),
``Q`` (r), the same shapes in every architecture, so the k-th PQ layers of all clients are averaged together; the
other layers carry conventional LoRA, averaged only within an architecture (``conv_agg``, docs/fedmosaic.md#rela).

Before round 1 (``pre_federation``) every architecture's actor runs the public data (``data.public``) through its
pretrained model and returns the inputs of its PQ layers, mean-pooled per sequence; the server then trains each
non-pivot architecture's ``A`` to reproduce the pivot's codes (L2 + ``align_lambda`` orthogonality, Eq. 20), makes it
exactly orthonormal (thin SVD), computes its ``B`` by ridge CCA (Alg. 4) and sends the aligned basis to each of that
architecture's clients once (they keep it, frozen; docs/fedmosaic.md#cross-model-alignment;
:mod:`rayfed.methods.fedmosaic.alignment`).

RELA (docs/fedmosaic.md#rela): every ``grad_interval`` local steps a client takes the gradient of the last linear
layer of one frozen small model ``W_s`` (``relevance_model``, the same for all clients, without adapters) on the batch
just trained on, keeps the shared random ``sample_ratio`` of its entries (one mask from the run's seed, the same on
every client) plus noise ``noise``, averages them over the round and folds them into a decayed mean (``alpha``, once
per round: Alg. 1), which it uploads. The server turns the cosines of these vectors into per-client weights
``w_ij = softmax_j(cos(g_i, g_j) / tau)`` and sends each client its own global adapter ``G_i = sum_j w_ij L_j``
(conventional layers: over i's architecture, weights renormalized). ``self_weight`` says whether j runs over every
client, i included, as Eq. 4 reads (``include``), or over the others only, as the authors' code has it
(``exclude``). The weights of every round are kept in the server state (``relevance/history``).

Ablations (Tab. 7, Tab. 30): ``pq: false`` (Vanilla: conventional LoRA only), ``relevance: equal`` (+PQ-LoRA: equal
weights), ``frozen_current`` / ``training_current`` (the latest gradient of W_s / of the trained model's last PQ
layer, no decay), ``align: false`` (random non-pivot basis, Tab. 32).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rayfed import seeding
from rayfed.aggregation import Mixture
from rayfed.architectures import prefixed, unprefixed
from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.method import ClientState, LocalResult, Method, PreFederationStage, ServerState, TensorDict, Upload
from rayfed.methods.fedmosaic import pqlora
from rayfed.methods.fedmosaic.alignment import aligned_basis, public_features
from rayfed.methods.fedmosaic.params import FedMosaicParams
from rayfed.methods.fedmosaic.pqlora import GLOBAL, LOCAL, global_name, is_global, is_local
from rayfed.methods.fedmosaic.rela import (RelevanceSource, decayed_gradient, equal_weights, last_linear,
                                           relevance_gradient, relevance_weights)
from rayfed.models import Backbone, ClientModel, build_backbone, build_lora_set
from rayfed.param_names import components
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import ClientContext, Phase, PreFederation, Step

TRAINING_COMPUTE_FACTOR = 1.098  # training-only relative compute (Tab. 15; docs/fedmosaic.md#the-offline-benchmark)


@register_method("fedmosaic")
class FedMosaic(Method):
    Params = FedMosaicParams
    stages = (PreFederationStage(),)

    def __init__(self, params: FedMosaicParams | None = None):
        super().__init__(params)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def aggregation(self) -> Mixture:
        """Each client's global adapter: the clients' latest local adapters mixed by the RELA weights, P and Q over
        every client (matched by block and module), the conventional layers within the architecture, the weights
        renormalized there, or equal ones (``conv_agg: equal_within_type``, ``relevance: equal``)."""
        equal = self.params.conv_agg == "equal_within_type" or self.params.relevance == "equal"
        return Mixture(weights=("relevance", "weights"), within_weights=("relevance", "within") if equal else None,
                       across=pqlora.pq_groups)

    # The model ---------------------------------------------------------------------------------------------
    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        lora, params = config.lora, self.params

        def attach(encoder: nn.Module, seed_of: Callable[[str], int]) -> pqlora.PQPlacement:
            # the dual adapter, PQ-LoRA on the last layer of each block (none with pq: false), the global one frozen
            return pqlora.attach(
                encoder, rank=lora.rank, adapters=(LOCAL, GLOBAL), pq_blocks=params.blocks if params.pq else 0,
                scale=lora.alpha / lora.rank, pq_scale=params.pq_scale, frozen=(GLOBAL,), gate=True,
                scope=backbone.lora_scope, targets=lora.targets or backbone.lora_targets, pq_init=params.pq_init,
                seed_of=seed_of)

        model = build_lora_set(backbone, config, tasks, seed, (LOCAL, GLOBAL), frozen=(GLOBAL,), stream="fedmosaic",
                               owner="methods (fedmosaic)", attach=attach)
        if self.params.relevance in ("rela", "frozen_current"):
            self._attach_relevance_model(model, backbone, tasks, seed)
        return model

    def _attach_relevance_model(self, model: ClientModel, backbone: Backbone, tasks: Sequence[Task], seed: int) -> None:
        name = self.params.relevance_model
        if not name:
            if len(set(self.architecture_of)) > 1:
                raise ConfigError("methods (fedmosaic).relevance_model must name W_s, one frozen model shared by all "
                                  "clients (e.g. the smallest architecture's backbone), when clients have several "
                                  "architectures.")
            name = backbone.name
        if name == backbone.name:  # W_s is this backbone: the client model with its adapters off
            layer = last_linear(model.encoder, backbone.lora_scope, self.params.last_layer)
            model.attachments.put(RelevanceSource(layer))
            return
        # random weights are drawn where the client's backbone is (an actor's GPU; meta in the driver's preflight)
        relevance = build_backbone(ModelConfig(backbone=name), seed, next(backbone.encoder.parameters()).device)
        if relevance.tokenizer is None or backbone.tokenizer is None or (
                relevance.tokenizer.get_vocab() != backbone.tokenizer.get_vocab()):
            raise ConfigError(f"methods (fedmosaic).relevance_model = {name!r} tokenizes text differently from "
                              f"model.backbone = {backbone.name!r}; W_s reads the clients' batches as they are, so it "
                              "must share their tokenizer.")
        wrapper = ClientModel(relevance, nn.Identity(), tasks)
        wrapper.requires_grad_(False)
        model.relevance_model = wrapper  # a frozen submodule: moved with the model, never in its trainable state
        layer = last_linear(relevance.encoder, relevance.lora_scope, self.params.last_layer)
        model.attachments.put(RelevanceSource(layer, wrapper))

    def is_shared(self, name: str) -> bool:
        if not is_local(name):
            return False
        if pqlora.is_pq(name):
            return True
        return self.params.conv_agg != "none"

    # Client side -------------------------------------------------------------------------------------------
    def init_client(self, initial: TensorDict) -> ClientState:
        return {"personal": {n: v for n, v in initial.items() if not is_global(n)}, "optimizer": {}, "relevance": {}}

    def _trains(self, name: str) -> bool:
        return is_local(name) or components(name)[-2:] == [pqlora.GATE, "beta"]

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        received = payload or {}
        params = {**state["personal"], **received}  # the received global adapter (and, once, the aligned basis)
        pq_lr = self.params.pq_lr or 2.5 * client.train_config.lr
        gradients: list[torch.Tensor] = []
        noise = torch.Generator().manual_seed(
            seeding.torch_seed(client.seed, client.round, client.client_id, "rela_noise"))
        tracking = self.params.relevance != "equal"

        def take_gradient(step: Step) -> None:
            if (step.index + 1) % self.params.grad_interval == 0:
                gradient = relevance_gradient(step, self.params.relevance)
                kept = gradient.flatten()[self._mask(client.seed, gradient.numel())]
                if self.params.noise_stage == "per_grad" and self.params.noise:
                    kept = kept + self.params.noise * torch.randn(kept.shape, generator=noise)
                gradients.append(kept)

        def loss(step: Step) -> torch.Tensor:
            take_gradient(step)
            return step.task_loss()

        # W_s's gradient reads the batch alone, not the values being trained: taken once the step is (observe), the
        # step is the task loss, which train.cuda_graphs may replay. The trained model's own gradient
        # (training_current) is taken before its step, in the loss.
        in_loss = self.params.relevance == "training_current"
        steps = client.default_steps()
        if self.params.compute_matched_steps:
            steps = max(1, math.floor(steps / TRAINING_COMPUTE_FACTOR))
        phase = Phase(trains=self._trains, loss=loss if in_loss else None,
                      lr_of=lambda name: pq_lr if pqlora.is_pq(name) else None)
        result = client.train(params, steps=steps, phases=[phase], optimizer_state=state["optimizer"] or None,
                              keep_optimizer_state=True, observe=take_gradient if tracking and not in_loss else None)
        personal = {n: v for n, v in result.params.items() if not is_global(n)}
        shared = {n: v for n, v in personal.items() if self.is_shared(n)}
        upload: dict[str, TensorDict] = {"shared": shared}
        new_state: ClientState = {"personal": personal, "optimizer": result.optimizer_state or {}, "relevance": {}}
        stats: dict[str, float] = {}
        if tracking:
            decayed = decayed_gradient(state["relevance"].get("decayed"), gradients, self.params.alpha,
                                       self.params.relevance.endswith("_current"), self.params.ema_granularity)
            if decayed is not None:
                new_state["relevance"] = {"decayed": decayed}
                sent = decayed
                if self.params.noise_stage == "on_upload" and self.params.noise:
                    sent = decayed + self.params.noise * torch.randn(decayed.shape, generator=noise)
                upload["relevance"] = {"gradient": sent}
                rms = float(decayed.pow(2).mean().sqrt())
                stats = {"relevance_rms": rms, "noise_over_rms": self.params.noise / rms if rms > 0 else 0.0}
        return LocalResult(new_state, upload, result.loss, weight=1.0, stats=stats)

    def _mask(self, seed: int, size: int) -> torch.Tensor:
        """The kept entries of the relevance gradient: one random subset of the run (its seed), the same on every
        client and actor."""
        key = (seed, size)
        if key not in self._masks:
            generator = torch.Generator().manual_seed(seeding.torch_seed(seed, 0, seeding.SERVER, "rela_mask"))
            kept = max(1, round(self.params.sample_ratio * size))
            self._masks[key] = torch.randperm(size, generator=generator)[:kept].sort().values
        return self._masks[key]

    # Before round 1: the alignment of the PQ basis ---------------------------------------------------------
    def pre_federation(self, stage: PreFederation) -> dict[str, Any]:
        """The architecture's public features, a tree (:func:`~rayfed.methods.fedmosaic.alignment.public_features`)."""
        if not (self.params.pq and self.params.align) or not stage.public:
            return {}
        return public_features(stage, self.params)

    def before_federation(self, server: ServerState, prepared: dict[str, dict[str, Any]]) -> ServerState:
        prepared = {arch: tensors for arch, tensors in prepared.items() if tensors}
        if len(prepared) < 2:
            if len(set(self.architecture_of)) > 1 and self.params.pq and self.params.align:
                raise ConfigError("methods (fedmosaic) aligns the PQ basis of its architectures on public data before "
                                  "round 1: set data.public (e.g. a captioning source), or align: false.")
            return server
        pivot = self.params.pivot or min(prepared, key=lambda arch: (float(prepared[arch]["backbone_params"]), arch))
        if pivot not in prepared:
            raise ConfigError(f"methods (fedmosaic).pivot = {pivot!r} is not an architecture of the run; allowed: "
                              f"{', '.join(sorted(prepared))}.")
        aligned, report = aligned_basis(server["pq_layout"], prepared, pivot, self.params)
        return {**server, "aligned": aligned, "alignment": report}

    # Server side: the weights of the engine's mixture (rayfed.aggregation.Mixture) -----------------------------
    def init_server(self, initial_shared: TensorDict) -> ServerState:
        server = super().init_server(initial_shared)  # every client's rows, at its architecture's initial adapter
        layout: TensorDict = {}
        for arch in dict.fromkeys(self.architecture_of):
            blocks = pqlora.pq_tensor_blocks(unprefixed(initial_shared, arch))
            layout.update(prefixed({name: torch.tensor(block) for name, block in blocks.items()}, arch))
        clients = len(self.architecture_of)
        relevance = {"weights": equal_weights(clients, self.params.self_weight)}
        if self.aggregation.within_weights:  # equal weights over each architecture (renormalized by the engine)
            same = torch.tensor([[a == b for b in self.architecture_of] for a in self.architecture_of]).float()
            relevance["within"] = same if self.params.self_weight == "include" else same.fill_diagonal_(0.0)
        return {**server, "pq_layout": layout, "aligned": {}, "alignment": {},
                "received": {"aligned": torch.zeros(clients)}, "relevance": relevance}

    def aggregate(self, server: ServerState, uploads: Sequence[Upload]) -> ServerState:
        relevance, received = dict(server["relevance"]), server["received"]["aligned"]
        for upload in uploads:
            client = upload.client_id
            received[client] = 1.0
            sent = next(iter(upload.tensors.get("relevance", {}).values()), None)  # one tensor, under any name
            if sent is not None:
                if "gradients" not in relevance:
                    relevance["gradients"] = torch.zeros(len(self.architecture_of), sent.numel())
                    relevance["has_gradient"] = torch.zeros(len(self.architecture_of))
                relevance["gradients"][client] = sent.float()
                relevance["has_gradient"][client] = 1.0
        if self.params.relevance != "equal" and "gradients" in relevance:
            relevance["cosine"], relevance["weights"] = relevance_weights(
                relevance["gradients"], relevance["has_gradient"].bool(), self.params.tau, self.params.self_weight)
        if self.params.relevance_history:
            history = relevance.get("history")
            current = relevance["weights"].unsqueeze(0)
            relevance["history"] = current if history is None else torch.cat([history, current])
        return {**server, "relevance": relevance, "received": {"aligned": received}}

    def payload(self, server: ServerState, client_id: int) -> TensorDict | None:
        """The client's mix of every client's local adapter as its global one; once, its architecture's aligned basis.

        A client whose weights give nothing to any client of its architecture (no client of it has sent a gradient
        yet, or, with ``self_weight: exclude``, none but itself) keeps its own adapter in the conventional layers,
        as the authors' code does wherever it has no weight to give (before the first gradients, and for a client
        alone of its type). It has no relevance to go by there; for a client that has not trained, its own adapter
        is its architecture's initial one, what equal weights would give and what round 1 sent it."""
        payload = {global_name(name): value for name, value in super().payload(server, client_id).items()}
        if not server["received"]["aligned"][client_id]:
            arch = self.architecture_of[client_id]
            payload.update(prefixed(unprefixed(server["aligned"], arch), arch))
        return payload

