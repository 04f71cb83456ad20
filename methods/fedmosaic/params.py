"""FedMosaic's hyperparameters (the paper's defaults; docs/fedmosaic.md), apart from the method so that its stages'
modules (``alignment``) can name them without importing the method."""

from __future__ import annotations

from typing import Annotated, Literal

from annotated_types import Ge

from rayfed.params import AtLeastOne, Fraction, NonNegative, Positive, hyperparameters

Relevance = Literal["rela", "equal", "frozen_current", "training_current"]  # Tab. 30
ConvAgg = Literal["rela_within_type", "equal_within_type", "none"]


@hyperparameters
class FedMosaicParams:
    blocks: AtLeastOne = 4  # N_B: PQ-LoRA on the last decoder layer of each of N_B blocks (Eq. 6)
    pq: bool = True  # false: conventional LoRA everywhere (Tab. 7 "Vanilla")
    relevance: Relevance = "rela"
    tau: Positive = 0.5  # softmax temperature (Eq. 4)
    # include: w_ii in the softmax (Eq. 4); exclude: the others only (authors' code)
    self_weight: Literal["include", "exclude"] = "include"
    alpha: Fraction = 0.5  # EMA ratio (Eq. 2)
    sample_ratio: Fraction = 0.4  # N_s: share of the gradient's entries kept (Eq. 3)
    noise: NonNegative = 1e-4  # mu: std of the Gaussian noise added to the kept entries
    grad_interval: AtLeastOne = 10  # m: local steps between two W_s gradients
    # round: Alg. 1 (one EMA update per round); step: Eq. 2 per gradient
    ema_granularity: Literal["round", "step"] = "round"
    # per_grad: Alg. 1, noise on each gradient; on_upload: Eq. 3, on the decayed mean
    noise_stage: Literal["per_grad", "on_upload"] = "per_grad"
    # the last decoder layer's MLP output projection (our reading), or lm_head
    last_layer: Literal["down_proj", "lm_head"] = "down_proj"
    relevance_model: str = ""  # W_s's backbone (model.backbone syntax); "": the client's own (one architecture)
    conv_agg: ConvAgg = "rela_within_type"  # conventional-LoRA layers
    pq_init: Literal["zero", "identity"] = "zero"  # P, Q start at 0 (our reading), or identity: P = I
    pq_scale: Positive = 1.0  # s of the PQ branch (open in the paper); conventional LoRA: model.lora.alpha / rank
    pq_lr: Positive | None = None  # learning rate of P and Q; default 2.5 x train.lr (the paper's 5e-5 vs 2e-5)
    align: bool = True  # false: every architecture keeps its random orthonormal basis (Tab. 32)
    align_b: bool = True  # false: align A only
    pivot: str = ""  # the architecture others align to; "": the one with the fewest backbone parameters
    align_lambda: NonNegative = 0.5  # lambda of the orthogonality term (Eq. 20)
    align_epochs: AtLeastOne = 1
    align_lr: Positive = 5e-5
    align_batch_size: AtLeastOne = 4
    align_samples: Annotated[int, Ge(2)] | None = None  # public samples used (default: all of data.public)
    cca_ridge: Positive = 1e-4  # relative ridge of the CCA covariances
    # CCA features: lora_output = (A h) B^T, P = I (our reading); base_output = W_p h
    b_features: Literal["lora_output", "base_output"] = "lora_output"
    ortho_b_after_cca: bool = False  # polar re-orthonormalization of the CCA basis
    relevance_history: bool = True  # keep every round's weight matrix in the server state
    compute_matched_steps: bool = False  # local steps / 1.098 (TRAINING_COMPUTE_FACTOR)

    def __post_init__(self) -> None:
        if self.relevance == "training_current" and not self.pq:
            raise ValueError("relevance = training_current uses the gradient of the last PQ layer: it needs pq = true")
