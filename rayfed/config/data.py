"""The ``data`` section: the source, its partition into clients, tasks, streams and public data."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rayfed import compat
from rayfed.config.fields import MOVED, PartitionerName, Section, SourceName, TaskKindName


class PartitionConfig(Section):
    """How the pooled dataset is split into clients (see ``rayfed.data.partition``)."""

    name: PartitionerName = "iid"
    alpha: float | None = Field(None, gt=0, description="Dirichlet concentration (dirichlet)")
    classes_per_client: int | None = Field(None, gt=0, description="classes each client holds (shards)")
    samples_per_client: int | None = Field(None, gt=0, description="exact samples per client (shards)")
    column: str | None = Field(None, description="the column whose values are the clients (natural) or domains")
    clients_per_domain: int | None = Field(
        None, gt=0, description="clients each domain is split over (domain_dirichlet)"
    )
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
    options: dict[str, Any] | None = Field(
        None, description="options of a partitioner that takes them, which it checks"
    )

    @model_validator(mode="after")
    def _exact_test(self) -> PartitionConfig:
        if self.test_samples_per_client is not None and (self.name != "shards" or self.samples_per_client is None):
            raise ValueError(
                "data.partition.test_samples_per_client needs data.partition.name = 'shards' and "
                "data.partition.samples_per_client (the exact training samples per client)"
            )
        return self


class OnePerGroupConfig(Section):
    """One row for each value of a column (one frame per video): chosen before any image is decoded."""

    column: str | tuple[str, ...] = Field(description="the column whose values are the groups (e.g. a video id), or "
                                          "several columns whose values together name a group")
    order_column: str | None = Field(None, description="the column that orders a group's rows (e.g. a frame "
                                     "number); null: the dataset's order")
    pick: Literal["middle", "first"] = Field(
        "middle", description="middle: the row at position n // 2 of a group's n rows in that order; first: the first"
    )


class StreamConfig(Section):
    """Data that arrives over time (``rayfed.data.streams``): when each client's tasks and samples become available."""

    mode: Literal["static", "dynamic", "asynchronous"] = Field(
        "dynamic", description="static: everything at round 0; dynamic: a client's tasks one after another, "
        "rounds_per_task each; asynchronous: each client's task windows from one of patterns (seeded)"
    )
    rounds_per_task: int = Field(5, gt=0, description="dynamic: rounds each task's samples arrive over")
    patterns: tuple[tuple[int, ...], ...] = Field(
        ((5, 5, 5, 5), (3, 7, 3, 7), (7, 3, 7, 3)), min_length=1,
        description="asynchronous: rounds per task, one pattern drawn per client",
    )
    gradual: bool = Field(
        True, description="a task's samples arrive in equal chunks over its window (else at its start)"
    )
    memory: int | None = Field(
        None, gt=0, description="episodic memory size; null: every arrived sample stays trainable"
    )
    memory_policy: Literal["reservoir", "per_task"] = Field(
        "reservoir",
        description="reservoir: a seeded uniform sample of the stream; per_task: equal quotas per seen task",
    )
    evaluate_others: bool = Field(True, description="also score each client on other clients' seen tasks (others_*)")
    others_by_task: bool = Field(False, description="with evaluate_others: also each other task's own score, "
                                 "others/<task>_<metric> (e.g. to tell which clients' tasks a method transfers to)")

    @model_validator(mode="after")
    def _positive_patterns(self) -> StreamConfig:
        if any(not pattern or min(pattern) < 1 for pattern in self.patterns):
            raise ValueError("data.stream.patterns must be non-empty lists of rounds >= 1")
        return self


class DataConfig(Section):
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
    resize: int | Literal["backbone"] | None = Field(
        None, description="hf: images converted to RGB and resized to this square size on load; backbone: resized and "
        "center-cropped as the backbone's own image processor does (its saved config)"
    )
    one_per_group: OnePerGroupConfig | None = Field(
        None, description="hf: keep one row for each value of a column (one frame per video), before decoding"
    )
    partition: PartitionConfig = PartitionConfig()
    tasks: tuple[TaskDataConfig, ...] | None = Field(
        None, min_length=1, description="multi-task: one data config per task, client ids contiguous in task order"
    )
    stream: StreamConfig | None = Field(None, description="data that arrives over rounds (continual PFL)")
    public: DataConfig | None = Field(
        None, description="public data for a method's pre-federation stage (e.g. aligning adapters), whole, "
        "on every architecture's first actor"
    )

    @field_validator("resize", mode="before")
    @classmethod
    def _a_size_or_the_backbone(cls, value: Any) -> Any:
        if value is None or value == "backbone" or (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        ):
            return value
        raise ValueError("it must be a size > 0 (square images) or 'backbone' (the backbone's own resize and crop)")

    @model_validator(mode="before")
    @classmethod
    def _earlier_fields(cls, raw: Any) -> Any:
        # Earlier field names are read (rayfed.compat.RENAMED_FIELDS); a field a plug-in replaced
        # (rayfed.compat.register_moved_field) is refused with the plug-in's sentence.
        raw = compat.renamed_fields("data", raw)
        for key in raw if isinstance(raw, dict) else ():
            if key not in cls.model_fields and (moved := compat.moved_field(f"data.{key}")) is not None:
                raise PydanticCustomError(MOVED, "{moved}", {"moved": moved})
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


DataConfig.model_rebuild()
