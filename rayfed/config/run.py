"""Run configuration: YAML -> validated, frozen pydantic objects.

Every invalid value is reported as one sentence naming the field, the value and what is
allowed (see :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, SerializationInfo, SerializerFunctionWrapHandler,
                      ValidationInfo, field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError, to_jsonable_python

from rayfed import registry
from rayfed.errors import ConfigError, suggest

log = logging.getLogger(__name__)

_MOVED = "moved"  # the error type of a field that is no longer read, whose message says what to write instead


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


@dataclass(frozen=True)
class _PluginKind:
    """Marks a config field that names a plug-in of ``kind`` (see :func:`plugins`)."""

    kind: str


def _plugin(kind: str, optional: bool = False, recorded: Callable[[Any], Any] = lambda value: value) -> Any:
    """A config value naming a plug-in: a name, a ``"package.module:Name"`` string, or (from Python) the
    object itself, which a config dump writes as the registered name or import path of ``recorded(object)``."""

    def check(value: Any) -> Any:
        if value is None and optional:
            return value
        if value is None or isinstance(value, (bool, int, float, list, dict, tuple)):
            raise ValueError(f"it must be a name, a 'package.module:Name' string or a {kind} object")
        return value

    def dump(value: Any) -> Any:
        return value if value is None or isinstance(value, str) else registry.name_of(kind, recorded(value))

    return Annotated[Any, pydantic.AfterValidator(check), PlainSerializer(dump, when_used="json"), _PluginKind(kind)]


def _is_instance(method: Any) -> bool:
    """Whether a method entry's ``name`` is a built method (from Python) rather than a name or a class."""
    return not isinstance(method, (str, type))


def _class_of(method: Any) -> Any:
    return type(method) if _is_instance(method) else method


def _plain(params: Any) -> dict[str, Any]:
    """A method's frozen dataclass of hyperparameters as plain YAML values (tuples as lists)."""
    return to_jsonable_python(dataclasses.asdict(params))


SourceName = _plugin("source")
PartitionerName = _plugin("partitioner")
BackboneName = _plugin("backbone")
ClientModelName = _plugin("client_model", optional=True)
TaskKindName = _plugin("task_kind", optional=True)
MethodName = _plugin("method", recorded=_class_of)  # a built method: its class (its params: MethodEntry)


class PartitionConfig(_Section):
    """How the pooled dataset is split into clients (see ``rayfed.data.partition``)."""

    name: PartitionerName = "iid"
    alpha: float | None = Field(None, gt=0, description="Dirichlet concentration (dirichlet)")
    classes_per_client: int | None = Field(None, gt=0, description="classes each client holds (shards)")
    samples_per_client: int | None = Field(None, gt=0, description="exact samples per client (shards)")
    column: str | None = Field(None, description="the column whose values are the clients (natural) or domains")
    clients_per_domain: int | None = Field(None, gt=0, description="clients each domain is split over (domain_dirichlet)")
    min_samples: int = Field(2, ge=2, description="fewest samples a client may hold (train + test)")
    max_group_size: int | None = Field(
        None, gt=0, description="natural: keep only groups of min_samples..max_group_size samples (LEAF-style filter)"
    )
    test_samples_per_client: int | None = Field(
        None, gt=0, description="shards: exact test samples per client; samples_per_client then counts training samples"
    )
    global_test_samples: int | None = Field(
        None, gt=0, description="a shared test set of this many samples no client holds, over all classes: global_acc"
    )
    options: dict[str, Any] | None = Field(None, description="options of a partitioner that takes them, which it checks")

    @model_validator(mode="after")
    def _exact_test(self) -> PartitionConfig:
        if self.test_samples_per_client is not None and (self.name != "shards" or self.samples_per_client is None):
            raise ValueError(
                "data.partition.test_samples_per_client needs data.partition.name = 'shards' and "
                "data.partition.samples_per_client (the exact training samples per client)"
            )
        return self


class StreamConfig(_Section):
    """Data that arrives over time (``rayfed.streams``): when each client's tasks and samples become available."""

    mode: Literal["static", "dynamic", "asynchronous"] = Field(
        "dynamic", description="static: everything at round 0; dynamic: a client's tasks one after another, "
        "rounds_per_task each; asynchronous: each client's task windows from one of patterns (seeded)"
    )
    rounds_per_task: int = Field(5, gt=0, description="dynamic: rounds each task's samples arrive over")
    patterns: tuple[tuple[int, ...], ...] = Field(
        ((5, 5, 5, 5), (3, 7, 3, 7), (7, 3, 7, 3)), min_length=1,
        description="asynchronous: rounds per task, one pattern drawn per client",
    )
    gradual: bool = Field(True, description="a task's samples arrive in equal chunks over its window (else at its start)")
    memory: int | None = Field(None, gt=0, description="episodic memory size; null: every arrived sample stays trainable")
    memory_policy: Literal["reservoir", "per_task"] = Field(
        "reservoir", description="reservoir: a seeded uniform sample of the stream; per_task: equal quotas per seen task"
    )
    evaluate_others: bool = Field(True, description="also score each client on other clients' seen tasks (others_*)")
    others_by_task: bool = Field(False, description="with evaluate_others: also each other task's own score, "
                                 "others/<task>_<metric> (e.g. to tell which clients' tasks a method transfers to)")

    @model_validator(mode="after")
    def _positive_patterns(self) -> StreamConfig:
        if any(not pattern or min(pattern) < 1 for pattern in self.patterns):
            raise ValueError("data.stream.patterns must be non-empty lists of rounds >= 1")
        return self


class DataConfig(_Section):
    source: SourceName = "sklearn:digits"
    kind: TaskKindName = Field(
        None, description="task kind (classification, multiple_choice, text_generation, reconstruction, or a "
        "plug-in); default: what the source's columns say (choices -> multiple_choice, labels -> classification, "
        "target text -> text_generation, images alone -> reconstruction)"
    )
    options: dict[str, Any] | None = Field(None, description="options of the source (generators, user functions)")
    path: str | None = None
    split: str | None = None
    image_column: str | None = Field("image", description="hf: the image column (used when present unless set)")
    label_column: str | None = Field("label", description="the class-label column of an hf: dataset (used when present "
                                     "unless set) or of a source's dict of columns")
    text_column: str | None = Field(None, description="hf: the input text column (question, caption, prompt)")
    target_column: str | None = Field(None, description="hf: the output text column (answer, description)")
    choices_column: str | None = Field(None, description="hf: the column of a multiple-choice question's options")
    max_text_length: int | None = Field(None, gt=0, description="tokens per text; default: the backbone's limit")
    num_clients: int = Field(10, gt=0)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    max_samples: int | None = Field(None, gt=0)
    resize: int | None = Field(None, gt=0, description="hf: images converted to RGB and resized to this size on load")
    partition: PartitionConfig = PartitionConfig()
    tasks: tuple[TaskDataConfig, ...] | None = Field(
        None, min_length=1, description="multi-task: one data config per task, client ids contiguous in task order"
    )
    stream: StreamConfig | None = Field(None, description="data that arrives over rounds (continual PFL)")
    public: DataConfig | None = Field(
        None, description="public data for a method's pre-federation stage (e.g. aligning adapters), whole, "
        "on every architecture's first actor"
    )

    @model_validator(mode="before")
    @classmethod
    def _synthetic_is_options(cls, raw: Any) -> Any:
        # `synthetic:` is the earlier name of `options:` (the generators' options); both are read.
        if isinstance(raw, dict) and "synthetic" in raw:
            if raw.get("options") is not None:
                raise ValueError("data.synthetic and data.options are both set; data.synthetic is the old name of "
                                 "data.options, keep one")
            raw = {**{k: v for k, v in raw.items() if k != "synthetic"}, "options": raw["synthetic"]}
        if isinstance(raw, dict) and "base_novel" in raw:
            raise PydanticCustomError(_MOVED, "{moved}", {"moved": (
                "data.base_novel is now a partitioner: write data.partition: {name: base_novel, options: {shots, "
                "class_seed, base_excludes_local}} instead (docs/pfedmma.md#data-and-metrics)")})
        return raw

    @model_validator(mode="after")
    def _public_is_plain(self) -> DataConfig:
        if self.public is not None and (self.public.public is not None or self.public.tasks is not None):
            raise ValueError("data.public is one dataset: it has no public or tasks of its own")
        return self

    @model_validator(mode="after")
    def _task_list(self) -> DataConfig:
        if self.tasks is None:
            return self
        if isinstance(self, TaskDataConfig):
            raise ValueError(f"data.tasks[{self.name!r}] has its own `tasks`; tasks do not nest")
        explicit = [task.clients is not None for task in self.tasks]
        if any(explicit) and not all(explicit):
            raise ValueError("data.tasks: set clients in every task (clients holding several tasks) or in none")
        if all(explicit):
            ids = sorted({client for task in self.tasks for client in task.clients})
            if ids != list(range(len(ids))):
                missing = sorted(set(range(ids[-1] + 1)) - set(ids))
                raise ValueError(f"data.tasks[*].clients name clients up to {ids[-1]} but none holds client "
                                 f"{missing[0]}; client ids must be 0..N-1, each in at least one task")
            if any(task.clients_per_round is not None for task in self.tasks):
                raise ValueError("data.tasks[*].clients_per_round (stratified sampling) needs each client in one "
                                 "task; remove it when tasks list their clients")
            total = len(ids)
        else:
            total = sum(task.num_clients for task in self.tasks)
        others = [
            name for name, field in DataConfig.model_fields.items()
            if name not in ("tasks", "num_clients", "stream", "public")
            and getattr(self, name) != field.get_default(call_default_factory=True)
        ]
        if others:
            raise ValueError(f"data.{others[0]} is set next to data.tasks; with tasks, set it inside each task")
        if "num_clients" in self.model_fields_set and self.num_clients != total:
            raise ValueError(f"data.num_clients = {self.num_clients} differs from the {total} clients of data.tasks")
        object.__setattr__(self, "num_clients", total)
        names = [task.name for task in self.tasks]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"data.tasks: the name {name!r} is used twice; give each task a distinct name")
        per_round = [task.clients_per_round for task in self.tasks]
        if any(n is not None for n in per_round) and None in per_round:
            raise ValueError("data.tasks: set clients_per_round in every task (stratified sampling) or in none")
        return self


class TaskDataConfig(DataConfig):
    """One task of a multi-task run: its data, which clients hold it, and how many of them a round samples."""

    name: str
    clients: tuple[int, ...] | None = Field(
        None, min_length=1, description="the client ids this task's data is partitioned over (a client may hold "
        "several tasks); default: num_clients new ids after the previous tasks'"
    )
    clients_per_round: int | None = Field(None, gt=0, description="stratified sampling: this task's clients per round")

    @model_validator(mode="after")
    def _explicit_clients(self) -> TaskDataConfig:
        for run_level in ("stream", "public"):
            if getattr(self, run_level) is not None:
                raise ValueError(f"data.tasks[{self.name!r}].{run_level} belongs to the run: set data.{run_level}")
        if self.clients is None:
            return self
        if len(set(self.clients)) != len(self.clients) or min(self.clients) < 0:
            raise ValueError(f"data.tasks[{self.name!r}].clients = {list(self.clients)} must be distinct ids >= 0")
        if "num_clients" in self.model_fields_set and self.num_clients != len(self.clients):
            raise ValueError(f"data.tasks[{self.name!r}].num_clients = {self.num_clients} differs from its "
                             f"{len(self.clients)} clients")
        object.__setattr__(self, "num_clients", len(self.clients))
        return self

    @model_validator(mode="after")
    def _per_round(self) -> TaskDataConfig:
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise ValueError(
                f"data.tasks[{self.name!r}].clients_per_round = {self.clients_per_round} is larger than its "
                f"num_clients = {self.num_clients}"
            )
        return self


class LoraConfig(_Section):
    rank: int = Field(4, gt=0)
    alpha: float = Field(8.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: tuple[str, ...] | None = Field(
        None, description="names of the linear modules LoRA goes on; default: the backbone family's attention "
        "query and value (ViT q_proj/v_proj, ViLT/FLAVA query/value, LLMs q_proj/v_proj)"
    )


class AdapterConfig(_Section):
    dim: int = Field(8, gt=0, description="bottleneck width of the d -> dim -> d adapter")
    site: Literal["mlp", "output"] = Field(
        "mlp", description="mlp: after a block's MLP, inside its residual (ViT/CLIP); output: after a BERT-style "
        "layer's output sublayer (ViLT, FLAVA)"
    )
    activation: Literal["gelu", "relu"] = Field("gelu", description="the bottleneck's nonlinearity (FedDAT: relu)")
    init: Literal["zero", "normal"] = Field(
        "zero", description="zero: PyTorch's default down-projection, zero up-projection (the adapter starts as the "
        "identity); normal: every weight N(0, 0.02), every bias 0 (FedDAT)"
    )


class PromptConfig(_Section):
    tokens: int = Field(5, gt=0, description="learnable prompt tokens per modality (text and image)")
    hidden: int = Field(192, gt=0, description="width of the Embedding -> Linear -> Tanh -> Linear reparameterisation")


class VptConfig(_Section):
    prompts: int = Field(8, gt=0, description="learnable prompt tokens per block (VPT-deep)")


MODULES = ("head", "lora", "adapter", "vpt", "full", "bias", "prompt")
# what a method entry's `model` may override
MODULE_FIELDS = ("module", "lora", "adapter", "vpt", "prompt", "head", "client", "client_options")


class ModelConfig(_Section):
    backbone: BackboneName = "tiny:vit"
    pretrained: str | None = Field(None, description="open_clip: a pretrained tag (openai, ...) or a weights file")
    module: Literal["head", "lora", "adapter", "vpt", "full", "bias", "prompt"] | None = Field(
        None, description="what is trained over the backbone (bias: every parameter named *bias*, BitFit; prompt: "
        "learnable tokens per modality at ViLT's embedding level); unset: lora if model.lora is set, else head"
    )
    lora: LoraConfig | None = LoraConfig()
    adapter: AdapterConfig = AdapterConfig()
    vpt: VptConfig = VptConfig()
    prompt: PromptConfig = PromptConfig()
    head: Literal["linear", "mlp"] = Field(
        "linear", description="a classifier head's form: linear, or mlp: Linear(d, 2d) -> LayerNorm -> GELU -> "
        "Linear(2d, C) (ViLT's VQA head, FedDAT's)"
    )
    image_size: int | None = Field(None, gt=0, description="input size; default: the backbone's own")
    client: ClientModelName = Field(
        None, description="the model a method trains over the backbone: a registered client model (mome: TAP's "
        "modular model), a 'package.module:Name' builder or the builder itself; unset: the backbone with "
        "model.module and a head per task"
    )
    client_options: dict[str, Any] = Field({}, description="model.client's options, which it checks")

    @field_validator("client_options")
    @classmethod
    def _options_of_a_client(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if options and info.data.get("client") is None:
            raise ValueError("it needs model.client, the client model these are options of (the default model's "
                             "settings are model.module, lora, adapter, vpt, prompt and head)")
        return options

    @model_validator(mode="after")
    def _resolve_module(self) -> ModelConfig:
        if self.module is None:
            object.__setattr__(self, "module", "lora" if self.lora is not None else "head")
        elif self.module == "lora" and self.lora is None:
            raise ValueError("model.module = 'lora' needs model.lora (rank, alpha, targets), which is null")
        return self


class FederationConfig(_Section):
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


class ComputeMatch(_Section):
    """Local steps per method from a measured cost: every method gets ``round(train.local_steps / C)`` steps, C its
    local update's FLOPs over the reference method's (:mod:`rayfed.compute`)."""

    reference: str = Field(description="the label of the method whose local update costs 1 and keeps train.local_steps")
    client: int = Field(0, ge=0, description="the client whose round-1 local update is measured for every method")


class TrainConfig(_Section):
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
    decay_steps: int | None = Field(None, gt=0, description="warmup_cosine: global steps until lr reaches 0 (rounds x local steps)")
    warmup_rounds: int = Field(20, gt=0, description="round_warmup: rounds until lr is reached")
    warmup_start_lr: float = Field(1e-4, gt=0, description="round_warmup: the lr of round 0")
    grad_clip: float | None = Field(None, gt=0, description="clip the L2 norm of the trained parameters' gradient")
    cuda_graphs: bool = Field(
        False, description="on a GPU, capture a training step once as a CUDA graph and replay it (adam/adamw, "
        "constant schedule, no grad_clip; steps with a method's extra loss term run eagerly)"
    )
    compile: bool = Field(
        False, description="train through torch.compile of the model (inductor: fused kernels for the forward and "
        "backward; patch-embedding convolutions become matrix products), compiled once per model and reused by every "
        "client it trains; the first steps of each task and batch shape pay the compilation"
    )
    batch_clients: int = Field(
        1, ge=1, description="train up to this many of an actor's sampled clients in one forward and backward "
        "(torch.func.vmap over their stacked parameters and batches) when their updates are plain (the task loss, "
        "optionally a penalty) and train the same tensors; 1: each client's steps alone"
    )
    compute_match: ComputeMatch | None = Field(
        None, description="scale each method's local steps so that its local update costs what the reference "
        "method's does (FLOPs measured on one client's update before the run; reported in summary.json)"
    )

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.local_epochs is not None:
            object.__setattr__(self, "local_steps", None)
        if self.schedule == "warmup_cosine" and self.decay_steps is None:
            raise ValueError("train.schedule = 'warmup_cosine' needs train.decay_steps (the run's rounds x local steps)")
        if self.cuda_graphs:
            for field, value, allowed in [("optimizer", self.optimizer, ("adam", "adamw")),
                                          ("schedule", self.schedule, ("constant",)), ("grad_clip", self.grad_clip, (None,))]:
                if value not in allowed:
                    raise ValueError(f"train.cuda_graphs needs train.{field} in {list(allowed)}, not {value!r}")
        return self


Probability = Annotated[float, Field(ge=0, le=1)]
Positive = Annotated[float, Field(gt=0)]


class SystemConfig(_Section):
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


class PlacementConfig(_Section):
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
        "architectures in proportion to their clients' cost, each cut into runs of equal cost; the numbers do not change"
    )
    strategy: Literal["DEFAULT", "SPREAD"] = Field("DEFAULT", description="how Ray places ClientActors on nodes")
    cpus_per_actor: float | None = Field(
        None, gt=0, description="CPUs a ClientActor asks Ray for; unset: 1, or an equal share of the Ray cluster's "
        "CPUs where the run's actors would not fit (an actor trains on one thread either way)"
    )
    gpus_per_actor: float = Field(0.0, ge=0)
    driver_cpus: float = Field(0.0, ge=0)
    client_state: Literal["auto", "host", "device"] = Field(
        "auto", description="where actors keep clients' data and state: host, device (the actor's GPU), or auto (the GPU when it fits)"
    )


class ArchitectureConfig(_Section):
    """A group of clients sharing one backbone and model config, hosted by ClientActors of their own."""

    clients: tuple[int, ...] = Field(min_length=1, description="the client ids of this architecture")
    backbone: BackboneName = Field(description="as model.backbone")
    model: dict[str, Any] = Field({}, description="overrides of other model fields (lora, adapter, image_size, ...)")
    clients_per_actor: int | None = Field(None, gt=0, description="default: placement.clients_per_actor")
    cpus_per_actor: float | None = Field(None, gt=0, description="default: placement.cpus_per_actor")
    gpus_per_actor: float | None = Field(None, ge=0, description="default: placement.gpus_per_actor (a larger model may ask for more)")


class RayConfig(_Section):
    address: str | None = None
    num_cpus: int | None = Field(None, gt=0)
    num_gpus: int | None = Field(None, ge=0)
    object_store_memory: int | None = Field(10**9, gt=0)


class MethodEntry(_Section):
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
            name = self.name if isinstance(self.name, str) else registry.name_of("method", _class_of(self.name))
            label = name.rsplit(":", 1)[-1].rsplit(".", 1)[-1] + ("+post" if self.post_train_steps else "")
            object.__setattr__(self, "label", label)
        return self

    @model_serializer(mode="wrap")
    def _instance_as_class(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A built method is recorded as its class and every one of its hyperparameters, which rebuild it."""
        data = handler(self)
        if info.mode_is_json() and _is_instance(self.name):
            data["params"] = {**_plain(self.name.params), **data["params"]}
        return data


DataConfig.model_rebuild()


class RunConfig(_Section):
    name: str = "run"
    seed: int = 0
    imports: tuple[str, ...] = Field(
        (), description="modules imported before plug-ins are looked up (their @rayfed.register_* decorators run)"
    )
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    federation: FederationConfig = FederationConfig()
    system: SystemConfig = SystemConfig()
    train: TrainConfig = TrainConfig()
    methods: tuple[MethodEntry, ...] = Field((MethodEntry(name="fedavg"),), min_length=1)
    placement: PlacementConfig = PlacementConfig()
    architectures: dict[str, ArchitectureConfig] | None = Field(
        None, description="clients of different backbones in one run: name -> {clients, backbone, model, placement}"
    )
    ray: RayConfig = RayConfig()
    tune: dict[str, Any] | None = Field(None, description="search spaces for `rayfed tune` (rayfed.tune)")

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        task_rounds = [task.clients_per_round for task in self.data.tasks or ()]
        if task_rounds and None not in task_rounds and self.federation.clients_per_round != sum(task_rounds):
            raise ValueError(
                f"federation.clients_per_round = {self.federation.clients_per_round} differs from the sum "
                f"{sum(task_rounds)} of data.tasks[*].clients_per_round (stratified sampling); set it to {sum(task_rounds)}"
            )
        if self.federation.clients_per_round > self.data.num_clients:
            raise ValueError(
                f"federation.clients_per_round = {self.federation.clients_per_round} is larger than "
                f"data.num_clients = {self.data.num_clients}; it must be at most the number of clients"
            )
        for client_id in self.system.speeds:
            if not 0 <= client_id < self.data.num_clients:
                raise ValueError(
                    f"system.speeds names client {client_id}, but clients are 0..{self.data.num_clients - 1}"
                )
        labels = [m.label for m in self.methods]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"methods: the label {label!r} is used twice; give each entry a distinct `label`")
        for index, entry in enumerate(self.methods):
            method_model_config(self.model, entry, index)
        match = self.train.compute_match
        if match is not None and self.train.local_steps is None:
            raise ValueError("train.compute_match scales train.local_steps, so it needs train.local_steps, not "
                             "train.local_epochs")
        if match is not None and match.reference not in labels:
            raise ValueError(f"train.compute_match.reference = {match.reference!r} is not a method label of this run; "
                             f"allowed: {', '.join(labels)}")
        if match is not None and match.client >= self.data.num_clients:
            raise ValueError(f"train.compute_match.client = {match.client} is not a client of this run; allowed: "
                             f"0..{self.data.num_clients - 1}")
        self._check_architectures()
        return self

    def _check_architectures(self) -> None:
        if self.architectures is None:
            return
        owner: dict[int, str] = {}
        for name, group in self.architectures.items():
            if not name or "/" in name:
                raise ValueError(f"architectures: the name {name!r} is invalid; use a non-empty name without '/'")
            for client in group.clients:
                if client in owner:
                    raise ValueError(f"architectures: client {client} is in both {owner[client]!r} and {name!r}; "
                                     "each client has one architecture")
                if not 0 <= client < self.data.num_clients:
                    raise ValueError(f"architectures.{name}.clients names client {client}, but clients are "
                                     f"0..{self.data.num_clients - 1}")
                owner[client] = name
            architecture_model_config(self, name)
        missing = [c for c in range(self.data.num_clients) if c not in owner]
        if missing:
            raise ValueError(f"architectures: client {missing[0]} is in no architecture; list every client "
                             f"0..{self.data.num_clients - 1} in exactly one")

    @model_serializer(mode="wrap")
    def _with_plugin_modules(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A dump imports the modules defining the user's plug-ins it names, so that it resolves them anywhere."""
        data = handler(self)
        if info.mode_is_json():
            modules = [module for _, module, qualname in user_plugins(self) if _importable(module, qualname)]
            data["imports"] = list(dict.fromkeys([*data["imports"], *modules]))
        return data

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def plugins(section: BaseModel, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(field, kind, value)`` of every plug-in a config section names, in it and in its subsections
    (fields such as ``methods[1].name``, ``data.tasks[0].source``, ``architectures.big.backbone``)."""
    for name, field in type(section).model_fields.items():
        value, where = getattr(section, name), f"{path}{name}"
        kinds = [meta.kind for meta in field.metadata if isinstance(meta, _PluginKind)]
        if kinds:
            if value is not None:
                yield where, kinds[0], value
            continue
        if isinstance(value, tuple):
            children = [(f"{where}[{index}].", item) for index, item in enumerate(value)]
        elif isinstance(value, dict):
            children = [(f"{where}.{key}.", item) for key, item in value.items()]
        else:
            children = [(f"{where}.", value)]
        for prefix, child in children:
            if isinstance(child, BaseModel):
                yield from plugins(child, prefix)


def user_plugins(config: RunConfig) -> list[tuple[str, str, str]]:
    """``(field, module, qualified name)`` of every plug-in of the user's (not a built-in) that ``config`` names."""
    found = [(where, registry.defined_in(kind, value)) for where, kind, value in plugins(config)]
    return [(where, *defined) for where, defined in found if defined is not None]


def _importable(module: str, qualname: str) -> bool:
    return module != "__main__" and "<locals>" not in qualname


def rerun_notes(config: RunConfig) -> list[str]:
    """One sentence per plug-in of ``config`` that a rerun of its dump elsewhere cannot import, saying what to do."""
    return [
        f"{where}: {qualname} is defined in {'the driver script (__main__)' if module == '__main__' else 'a function'}, "
        f"so this config reruns only in that process; to rerun it with `rayfed run`, move {qualname.rsplit('.', 1)[-1]} "
        "into a module and list that module under imports."
        for where, module, qualname in user_plugins(config) if not _importable(module, qualname)
    ]


def with_full_params(config: RunConfig, params: Sequence[Any]) -> RunConfig:
    """``config`` with each method entry given by name or class holding every hyperparameter of its built method
    (``params[i]``, its frozen dataclass, defaults included), so that the run's record names each value it used."""
    methods = tuple(entry if _is_instance(entry.name) else entry.model_copy(update={"params": _plain(values)})
                    for entry, values in zip(config.methods, params))
    return config.model_copy(update={"methods": methods})


def architecture_model_config(config: RunConfig, name: str) -> ModelConfig:
    """The model config of architecture ``name`` (``""``: the run's one architecture, ``config.model``)."""
    if not name:
        return config.model
    group = config.architectures[name]
    raw = {**config.model.model_dump(), **group.model, "backbone": group.backbone}
    _reset_implied(raw, group.model)
    try:
        return ModelConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"architectures.{name}.model.{path} is invalid: {_clean_msg(first['msg'])}") from None


def method_model_config(model: ModelConfig, entry: MethodEntry, index: int = 0) -> ModelConfig:
    """The model config a method entry trains: ``model`` with the entry's module overrides."""
    if not entry.model:
        return model
    for key in entry.model:
        if key not in MODULE_FIELDS:
            raise ValueError(
                f"methods[{index}].model.{key} cannot be set per method{suggest(key, MODULE_FIELDS)}; "
                f"allowed: {', '.join(MODULE_FIELDS)} (the backbone is one per run)"
            )
    raw = model.model_dump(mode="json")
    _reset_implied(raw, entry.model)
    try:
        return ModelConfig.model_validate({**raw, **entry.model})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"methods[{index}].model.{path} is invalid: {_clean_msg(first['msg'])}") from None


def _reset_implied(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Overrides of a model config: ``lora`` alone lets ``module`` follow it again, and another ``client`` starts
    from no options."""
    if "module" not in overrides and "lora" in overrides:
        raw["module"] = None
    if "client_options" not in overrides and "client" in overrides:
        raw["client_options"] = {}


def _clean_msg(msg: str) -> str:
    return msg.removeprefix("Value error, ").rstrip(".")


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_error(err: pydantic.ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1]) or RunConfig
        allowed = list(parent.model_fields)
        return (
            f"unknown config field {path!r}{suggest(str(loc[-1]), allowed)}; "
            f"allowed here: {', '.join(allowed)}."
        )
    if not path or first["type"] == _MOVED:  # a model-level check or a moved field: the message names its fields
        return _clean_msg(first["msg"]) + "."
    return f"{path} = {first.get('input')!r} is invalid: {_clean_msg(first['msg'])}."


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value.")
        try:
            parsed_value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override {key.strip()}: the value {value!r} is not valid YAML ({problem}).") from None
        parsed.append((key.strip().split("."), parsed_value))
    return parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items (values parsed as YAML; list items by index) into ``raw``."""
    for keys, value in parse_overrides(overrides):
        node: Any = raw
        for depth, key in enumerate(keys):
            path = ".".join(keys[: depth + 1])
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise ConfigError(f"override {path}: {key!r} is not an index below {len(node)}.")
                key = int(key)
                if isinstance(node[key], str) and depth < len(keys) - 1:
                    node[key] = {"name": node[key]}  # a method given by name only
            elif not isinstance(node, dict):
                raise ConfigError(f"override {path}: {'.'.join(keys[:depth])} is not a section.")
            if depth == len(keys) - 1:
                node[key] = value
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    node[key] = {}
                node = node[key]
    return raw


def build_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a nested dict; raise :class:`ConfigError` with one sentence on the first problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, not {type(raw).__name__}.")
    try:
        return RunConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(
    source: str | os.PathLike | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
) -> RunConfig:
    """Load a config from a YAML path, a dict or a RunConfig, then apply ``key=value`` overrides."""
    if isinstance(source, RunConfig):
        raw = source.to_dict()
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    return build_config(apply_overrides(raw, overrides or []))


def dump_config(config: RunConfig, path: str | os.PathLike) -> None:
    """Write ``config`` as YAML; a plug-in that a rerun elsewhere cannot import gets a note (a comment on top, and a
    logged warning) saying how to make the file rerunnable."""
    from rayfed.io import atomic_write_text

    notes = rerun_notes(config)
    for note in notes:
        log.warning("%s: %s", path, note)
    comments = "".join(f"# note: {note}\n" for note in notes)
    atomic_write_text(path, comments + yaml.safe_dump(config.to_dict(), sort_keys=False))
