"""The run's other sections: federation, training, system heterogeneity, placement, architectures, Ray, and a
method entry."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BeforeValidator, Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer,
                      model_validator)

from rayfed.config.fields import BackboneName, MethodName, Section, is_built_method, method_label, plain_params


class FederationConfig(Section):
    rounds: int = Field(10, gt=0)
    clients_per_round: int = Field(10, gt=0)
    eval_every: int = Field(1, gt=0)
    eval_round_zero: bool = Field(False, description="also evaluate the initial model, before round 1 (round 0)")
    checkpoint_every: int = Field(0, ge=0, description="0 = only restart points kept in memory")
    target_acc: float | None = Field(
        None, gt=0, le=1, description="rounds_to_target's accuracy; default: 95% of the best mean local_acc in the run"
    )
    representation_shift: bool = Field(
        False, description="also evaluate 1 - cosine(features of the initial model, features now) on test data"
    )
    max_failures: int = Field(3, ge=0, description="actor failures survived before giving up")
    on_nonfinite: Literal["stop", "warn"] = Field(
        "stop", description="a NaN or infinite training loss, upload, server tensor or evaluation metric: stop the run "
        "(keeping the last checkpoint written before it) or warn once per method and go on"
    )


class ComputeMatch(Section):
    """Local steps per method from a measured cost: every method gets ``round(train.local_steps / C)`` steps, C its
    local update's FLOPs (plus the client's share of the method's server-side passes on public data) over the
    reference method's (:mod:`rayfed.compute`)."""

    reference: str = Field(description="the label of the method whose local update costs 1 and keeps train.local_steps")
    client: int = Field(0, ge=0, description="the client whose round-1 local update is measured for every method")


def _yaml_off(value: Any) -> Any:
    return "off" if value is False else value  # YAML reads an unquoted off (and false) as False


Autocast = Annotated[Literal["bf16", "off"], BeforeValidator(_yaml_off)]


class TrainConfig(Section):
    local_steps: int | None = Field(10, gt=0, description="optimizer steps per local update")
    local_epochs: int | None = Field(None, gt=0)
    batch_size: int = Field(16, gt=0, description="samples per micro-batch")
    grad_accum: int = Field(1, gt=0, description="micro-batches whose gradients make one optimizer step")
    lr: float = Field(0.05, gt=0)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    eval_batch_size: int = Field(256, gt=0)
    schedule: Literal["constant", "warmup_cosine", "round_warmup"] = Field(
        "constant", description="warmup_cosine: linear warm-up, then cosine decay to 0 over decay_steps global steps; "
        "round_warmup: lr grows linearly from warmup_start_lr to lr over warmup_rounds rounds, then stays"
    )
    warmup_steps: int = Field(100, ge=0, description="warmup_cosine: steps of linear warm-up")
    decay_steps: int | None = Field(
        None, gt=0, description="warmup_cosine: global steps until lr reaches 0 (rounds x local steps)"
    )
    warmup_rounds: int = Field(20, gt=0, description="round_warmup: rounds until lr is reached")
    warmup_start_lr: float = Field(1e-4, gt=0, description="round_warmup: the lr of round 0")
    grad_clip: float | None = Field(None, gt=0, description="clip the L2 norm of the trained parameters' gradient")
    cuda_graphs: bool = Field(
        True, description="on a GPU, capture a training step once as a CUDA graph and replay it (any optimizer, "
        "schedule and grad_clip; off: every step eager): a one-task client's whole step with one micro-batch a step, "
        "its phases each with its optimizer; a client holding several tasks, train.grad_accum > 1 or a kept "
        "optimizer state replays each part's forward and backward (a graph per task and row count) and steps its "
        "optimizer eagerly; a step with a phase at its own learning rate, a method's own loss or an extra loss term "
        "runs eagerly, unless the loss is a rayfed.CapturedLoss or rayfed.training.RecordedTaskLoss and the term a "
        "rayfed.training.TensorPenalty (whole steps only), which are captured with it; a step that cannot be "
        "captured trains eagerly after one warning"
    )
    compile: bool = Field(
        False, description="train through torch.compile of the model (inductor: fused kernels for the forward and "
        "backward; patch-embedding convolutions become matrix products), compiled once per model and reused by every "
        "client it trains; the first steps of each task and batch shape pay the compilation; a forward that fails to "
        "compile trains eagerly after one warning"
    )
    autocast: Autocast = Field(
        "bf16", description="what a GPU's training steps and evaluations compute in: bf16 (autocast to bfloat16, "
        "a method's frozen linear and convolution weights stored in bfloat16: the same products) "
        "or off (float32 throughout, to bound bf16 round-off; a backbone stored in "
        "bfloat16 on a GPU, the llama: ones and the LLaVA models built on them, is refused rather than run in "
        "float32); a CPU always computes in float32"
    )
    cudnn_attention: bool = Field(
        False, description="on a GPU, let torch's scaled_dot_product_attention choose cuDNN's kernels, as torch does "
        "by default on Hopper GPUs: cuDNN builds a plan for every new shape of an attention (70 ms to 2 s on an H100, "
        "in each actor), which a run whose clients, tasks and texts give many shapes pays many times over; "
        "false: the flash, memory-efficient and math kernels, whose first call of a shape costs under a millisecond"
    )
    batch_clients: int = Field(
        1, ge=1, description="train up to this many of an actor's sampled clients in one forward and backward "
        "(torch.func.vmap over their stacked parameters and batches) when their updates are plain (the task loss, "
        "optionally a penalty) and train the same tensors; 1: each client's steps alone"
    )
    compute_match: ComputeMatch | None = Field(
        None, description="scale each method's local steps so that its local update, with its share of the server's "
        "passes on public data, costs what the reference method's does (FLOPs measured on one client's update and "
        "round 1's passes before the run; reported in summary.json)"
    )

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.local_epochs is not None:
            object.__setattr__(self, "local_steps", None)
        if self.schedule == "warmup_cosine" and self.decay_steps is None:
            raise ValueError(
                "train.schedule = 'warmup_cosine' needs train.decay_steps (the run's rounds x local steps)"
            )
        return self


Probability = Annotated[float, Field(ge=0, le=1)]
Positive = Annotated[float, Field(gt=0)]


class SystemConfig(Section):
    """System heterogeneity, independent of the method; seeded and recorded in metrics.jsonl.

    A sampled client drops out of a round with probability ``dropout`` (``dropout_by_round``
    overrides it for given 1-based rounds) and then sends nothing. Each client has a speed
    factor (``speeds``, else LogNormal(0, ``speed_sigma``), fixed per client); its simulated
    time in a round is its local steps / speed. With a ``deadline`` (same units), later
    clients are dropped, or kept with ``late_weight`` times their aggregation weight.
    """

    dropout: float = Field(0.0, ge=0, le=1)
    dropout_by_round: dict[int, Probability] = {}
    speed_sigma: float = Field(0.0, ge=0)
    speeds: dict[int, Positive] = {}
    deadline: float | None = Field(None, gt=0)
    late_policy: Literal["drop", "downweight"] = "drop"
    late_weight: float = Field(0.5, gt=0, le=1)


MEASURED = "measured"


def _gpu_share(value: Any) -> Any:
    if value == MEASURED:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # NaN too
        raise ValueError(f"it must be a number >= 0 (the share of a GPU an actor asks Ray for) or '{MEASURED}' (the "
                         "share its measured peak memory needs)")
    return float(value)


GpuShare = Annotated[float | Literal["measured"], BeforeValidator(_gpu_share)]
"""A ClientActor's GPU share: a number, or ``measured`` (:mod:`rayfed.simulation.gpu_memory`)."""


class PlacementConfig(Section):
    executor: Literal["ray", "local"] = Field(
        "ray", description="ray: every actor a Ray actor of its own; local: the same actors as objects of this "
        "process, run one after another (no Ray start: small runs and tests begin at once; the same numbers)"
    )
    clients_per_actor: int = Field(1, gt=0)
    balance_rounds: bool = Field(
        True, description="spread each round's sampled clients evenly over the actors of their architecture (a "
        "client's state moves to another actor for the round); the numbers do not change"
    )
    balance_by: Literal["clients", "cost"] = Field(
        "clients", description="how the ClientActors share out the clients: clients_per_actor each, or by cost (a "
        "client's: its architecture's parameter count x its local steps): as many actors, shared out over the "
        "architectures in proportion to their clients' cost, each cut into runs of equal cost; the numbers do not "
        "change"
    )
    strategy: Literal["DEFAULT", "SPREAD"] = Field("DEFAULT", description="how Ray places ClientActors on nodes")
    cpus_per_actor: float | None = Field(
        None, gt=0, description="CPUs a ClientActor asks Ray for; unset: 1, or an equal share of the Ray cluster's "
        "CPUs where the run's actors would not fit (an actor trains on one thread either way)"
    )
    gpus_per_actor: GpuShare = Field(
        0.0, description="the share of a GPU each ClientActor asks Ray for (0.25: four actors a GPU), or measured: "
        "before the actors start, one actor's peak GPU memory is measured on a whole GPU (a local update and an "
        "evaluation of each method, rayfed.simulation.gpu_memory) and the share is (peak + memory_headroom_gib) / "
        "the GPU's memory, rounded up to 0.01"
    )
    memory_headroom_gib: float = Field(
        2.0, ge=0, description="GiB added to a measured peak (gpus_per_actor: measured): the CUDA context, which "
        "torch's allocator does not count, and the allocator's fragmentation over a run"
    )
    driver_cpus: float = Field(0.0, ge=0)
    client_state: Literal["auto", "host", "device"] = Field(
        "auto", description="where actors keep clients' data and state: host, device (the actor's GPU), or auto "
        "(the GPU when it fits)"
    )


class ArchitectureConfig(Section):
    """A group of clients sharing one backbone and model config, hosted by ClientActors of their own."""

    clients: tuple[int, ...] = Field(min_length=1, description="the client ids of this architecture")
    backbone: BackboneName = Field(description="as model.backbone")
    model: dict[str, Any] = Field({}, description="overrides of other model fields (lora, adapter, image_size, ...)")
    clients_per_actor: int | None = Field(None, gt=0, description="default: placement.clients_per_actor")
    cpus_per_actor: float | None = Field(None, gt=0, description="default: placement.cpus_per_actor")
    gpus_per_actor: GpuShare | None = Field(
        None, description="default: placement.gpus_per_actor (a larger model may ask for more, or measured)")


class RayConfig(Section):
    address: str | None = None
    num_cpus: int | None = Field(None, gt=0)
    num_gpus: int | None = Field(None, ge=0)
    object_store_memory: int | None = Field(10**9, gt=0)


class MethodEntry(Section):
    """One method to run: a plug-in name (or class), a label for results, and its hyperparameters."""

    name: MethodName
    label: str = ""
    post_train_steps: int = Field(0, ge=0)
    model: dict[str, Any] = Field({}, description="overrides of model.module / lora / adapter / vpt for this method")
    params: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _from_yaml(cls, raw: Any) -> Any:
        if isinstance(raw, MethodEntry):
            return raw
        if not isinstance(raw, dict):
            return {"name": raw}  # a name, or (from Python) the method's class
        known = {"name", "label", "post_train_steps", "model", "params"}
        extra = {k: v for k, v in raw.items() if k not in known}
        entry = {k: v for k, v in raw.items() if k in known}
        entry["params"] = {**raw.get("params", {}), **extra}
        return entry

    @model_validator(mode="after")
    def _default_label(self) -> MethodEntry:
        if not self.label:
            object.__setattr__(self, "label", method_label(self.name) + ("+post" if self.post_train_steps else ""))
        return self

    @model_serializer(mode="wrap")
    def _instance_as_class(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A built method is recorded as its class and every one of its hyperparameters, which rebuild it."""
        data = handler(self)
        if info.mode_is_json() and is_built_method(self.name):
            data["params"] = {**plain_params(self.name.params), **data["params"]}
        return data
