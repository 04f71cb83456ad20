"""From a data config to per-client data: load each task's source, partition it, split train/test, and
encode a client's samples for the backbone (by the task's kind) where the client lives."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rayfed.config import DataConfig, ModelConfig, StreamConfig
from rayfed.data.batches import ClientData, Columns, EvalSet, TaskData
from rayfed.data.partition import Partition, exact_test_split, global_test_indices, partition, split_train_test
from rayfed.data.sources import ArrayDataset, DataError, load_source
from rayfed.data.sources.memory import decode_within_memory
from rayfed.errors import ConfigError
from rayfed.tasks.kinds import TaskKind, infer_kind
from rayfed.models import Backbone, check_image_channels
from rayfed.models.image_processing import ImagePreprocessing, image_preprocessing
from rayfed.registry import entries, resolve
from rayfed.data.streams import Window, arrival_rounds, task_windows
from rayfed.tasks import Task, task_client_ids


@dataclass(frozen=True)
class Holding:
    """One task's data: its dataset, the clients holding it and each one's (train, test) sample indices."""

    task: int
    dataset: ArrayDataset
    clients: tuple[int, ...]
    splits: tuple[tuple[np.ndarray, np.ndarray], ...]
    where: str  # the config section it comes from, for errors ("data", "data.tasks['vqa']")
    text_length: int | None = None  # data.max_text_length

    def split_of(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.splits[self.clients.index(client_id)]


@dataclass(frozen=True)
class SharedEval:
    """A test set every client is scored on: ``indices`` of ``dataset`` in the run's task ``task``."""

    name: str
    holding: Holding
    indices: np.ndarray
    task: int
    exclude_own_classes: bool = False


@dataclass(frozen=True)
class Federation:
    """The run's tasks, which clients hold each task's data, the shared evaluation sets, and (a stream) when
    data arrives."""

    tasks: tuple[Task, ...]
    holdings: tuple[Holding, ...]
    num_clients: int
    shared: tuple[SharedEval, ...] = ()
    stream: StreamConfig | None = None
    seed: int = 0

    def windows(self, client_id: int) -> dict[int, Window]:
        """In a stream, the arrival window of each of the client's tasks."""
        tasks = self.tasks_of(client_id)
        return dict(zip(tasks, task_windows(self.stream, self.seed, client_id, len(tasks))))

    def first_round(self, task: int) -> int:
        """The first round any client's samples of ``task`` arrive in (0 without a stream)."""
        if self.stream is None:
            return 0
        return min(self.windows(c)[task].start for h in self.holdings if h.task == task for c in h.clients)

    def task_test(self, task: int, backbone: Backbone) -> Columns:
        """Every holder's test samples of ``task``, encoded for ``backbone`` (another client's view of it)."""
        (holding,) = [h for h in self.holdings if h.task == task]
        indices = np.sort(np.concatenate([test for _, test in holding.splits]))
        return self._encode(holding, indices, backbone)

    def tasks_of(self, client_id: int) -> tuple[int, ...]:
        return tuple(sorted(h.task for h in self.holdings if client_id in h.clients))

    def sizes(self, client_id: int) -> dict[str, int]:
        splits = [h.split_of(client_id) for h in self.holdings if client_id in h.clients]
        return {"num_train": sum(len(train) for train, _ in splits), "num_test": sum(len(test) for _, test in splits)}

    def restricted_to(self, clients: set[int]) -> Federation:
        """The holdings of ``clients`` only (the tasks and shared sets stay)."""
        holdings = []
        for holding in self.holdings:
            kept = [i for i, client in enumerate(holding.clients) if client in clients]
            if kept:
                holdings.append(dataclasses.replace(holding, clients=tuple(holding.clients[i] for i in kept),
                                                    splits=tuple(holding.splits[i] for i in kept)))
        return dataclasses.replace(self, holdings=tuple(holdings))

    def check(self, backbone: Backbone) -> None:
        """One sentence if the backbone cannot run a task on its data (wrong inputs, kind, channels)."""
        for holding in self.holdings:
            self.tasks[holding.task].kind.check(holding.dataset, backbone, holding.where)
            if holding.dataset.images is not None:
                check_image_channels(holding.dataset.images.shape[-1], backbone)

    def client_data(self, client_id: int, backbone: Backbone) -> ClientData:
        """The client's samples of every task it holds, encoded for ``backbone``; in a stream with the round
        each training sample arrives in."""
        windows = self.windows(client_id) if self.stream is not None else {}
        parts = []
        for holding in self.holdings:
            if client_id in holding.clients:
                train, test = holding.split_of(client_id)
                part = TaskData(holding.task, self._encode(holding, train, backbone),
                                self._encode(holding, test, backbone))
                if self.stream is not None:
                    window = windows[holding.task]
                    part.arrival = arrival_rounds(self.stream, self.seed, client_id, holding.task, window, len(train))
                    part.first_round = window.start
                parts.append(part)
        return ClientData(sorted(parts, key=lambda part: part.task))

    def eval_sets(self, backbone: Backbone) -> list[EvalSet]:
        """The test sets every client is also scored on; an actor loads them once for all its clients."""
        return [EvalSet(e.name, self._encode(e.holding, e.indices, backbone), e.task, e.exclude_own_classes)
                for e in self.shared]

    def _encode(self, holding: Holding, indices: np.ndarray, backbone: Backbone):
        if holding.text_length is not None:
            backbone = dataclasses.replace(backbone, max_text_length=holding.text_length)
        return self.tasks[holding.task].kind.encode(holding.dataset, indices, backbone)


def input_modalities(dataset: ArrayDataset) -> frozenset[str]:
    """The inputs a model reads from ``dataset``: ``image`` where it has images, ``text`` where it has input text."""
    return frozenset(name for name, column in (("image", dataset.images), ("text", dataset.text)) if column is not None)


def task_kind(config: DataConfig, dataset: ArrayDataset, where: str) -> TaskKind:
    """The task kind ``config.kind`` names (an instance, a class or a name), else the one the data calls for."""
    if config.kind is None and all(getattr(dataset, column) is None
                                   for column in ("labels", "target", "choices", "images")):
        found = [column for column in ("text", "groups") if getattr(dataset, column) is not None]
        kinds = ", ".join(entry.name for entry in entries("task_kind"))
        raise DataError(
            f"{where}.source = {resolve('source', config.source).name!r} gives no labels, nor anything else to learn "
            f"(its columns: {', '.join(found)}); return them in a 'label' column or name their column with "
            f"{where}.label_column, or set {where}.kind ({kinds})."
        )
    resolved = resolve("task_kind", config.kind if config.kind is not None else infer_kind(dataset), f"{where}.kind")
    kind = resolved.obj() if isinstance(resolved.obj, type) else resolved.obj
    if not isinstance(kind, TaskKind):
        raise ConfigError(
            f"{where}.kind = {resolved.name!r} is a {type(kind).__name__}, not a rayfed.tasks.kinds.TaskKind."
        )
    return kind


def build_federation(config: DataConfig, seed: int, models: Sequence[ModelConfig] = ()) -> Federation:
    """Deterministic in (config, seed): every actor that calls it gets the same clients.

    With ``data.tasks`` every task's clients are built from its own config alone, so a task's data does
    not depend on which other tasks exist. An hf dataset's images are decoded last, only those of the samples some
    client or shared test set holds, once the host memory of all of them is stated and found to fit.
    ``models``: the run's model configs (one per architecture), whose backbone ``data.resize = 'backbone'`` follows."""
    processing = backbone_image_processing([config, *(config.tasks or ())], models)
    if config.tasks is None:
        federation = _one_task(config, seed, 0, "task", list(range(config.num_clients)), "data", processing)
        return _decoded(dataclasses.replace(federation, stream=config.stream, seed=seed), {"data": config})
    tasks, holdings, shared = [], [], []
    for index, task_config in enumerate(config.tasks):
        where = f"data.tasks[{task_config.name!r}]"
        part = _one_task(task_config, seed, index, task_config.name, task_client_ids(config, index), where, processing)
        if len(part.tasks) > 1:
            raise DataError(f"{where}.partition.name = {resolve('partitioner', task_config.partition.name).name!r} "
                            f"makes {len(part.tasks)} tasks of one dataset, which data.tasks does not support; use it "
                            "in a run of one dataset (data.partition).")
        tasks += part.tasks
        holdings += part.holdings
        shared += [dataclasses.replace(e, name=f"{task_config.name}_{e.name}") for e in part.shared]
    federation = Federation(tuple(tasks), tuple(holdings), config.num_clients, tuple(shared), config.stream, seed)
    return _decoded(federation, {f"data.tasks[{task.name!r}]": task for task in config.tasks})


def backbone_image_processing(configs: Sequence[DataConfig],
                              models: Sequence[ModelConfig]) -> ImagePreprocessing | None:
    """The backbone's resize and crop where a data config sets ``resize: backbone`` (one for every architecture)."""
    if not models or all(config.resize != "backbone" for config in configs):
        return None  # (without models, a source asked for the backbone's resize says it was not given)
    found = {model.backbone: image_preprocessing(model) for model in models}
    if len(set(found.values())) > 1:
        raise DataError(f"data.resize = 'backbone' needs one image processing, but the run's backbones "
                        f"{', '.join(map(repr, found))} resize and crop differently; set data.resize to a size.")
    return next(iter(found.values()))


def _decoded(federation: Federation, configs: dict[str, DataConfig]) -> Federation:
    """The federation with its holdings' images decoded (:func:`decode_within_memory`)."""
    parts = [(h.where, resolve("source", configs[h.where].source).name, h.dataset) for h in federation.holdings]
    datasets = decode_within_memory(parts)
    holdings = [dataclasses.replace(h, dataset=dataset) for h, dataset in zip(federation.holdings, datasets)]
    decoded = {id(old): new for old, new in zip(federation.holdings, holdings)}
    shared = tuple(dataclasses.replace(e, holding=decoded[id(e.holding)]) for e in federation.shared)
    return dataclasses.replace(federation, holdings=tuple(holdings), shared=shared)


def _used_rows_only(holding: Holding, shared: tuple[SharedEval, ...]) -> tuple[Holding, tuple[SharedEval, ...]]:
    """Where the images are still to decode: the holding's dataset cut to the samples some client or shared set
    uses, and their indices into it (the same samples in the same order)."""
    if not holding.dataset.pending:
        return holding, shared
    used = np.unique(np.concatenate([np.empty(0, np.int64), *(i for split in holding.splits for i in split),
                                     *(e.indices for e in shared)]))
    splits = tuple(tuple(np.searchsorted(used, i) for i in split) for split in holding.splits)
    cut = dataclasses.replace(holding, dataset=holding.dataset.subset(used), splits=splits)
    return cut, tuple(dataclasses.replace(e, holding=cut, indices=np.searchsorted(used, e.indices)) for e in shared)


def _one_task(config: DataConfig, seed: int, index: int, name: str, clients: list[int], where: str,
              processing: ImagePreprocessing | None = None) -> Federation:
    dataset = load_source(config, seed, decode=False, image_processing=processing, where=where)
    kind = task_kind(config, dataset, where)
    kind.check_data(dataset, where)
    part = config.partition
    test_samples = part.test_samples_per_client
    total_per_client = None if part.samples_per_client is None else part.samples_per_client + (test_samples or 0)
    cut = partition(
        dataset.strata, len(clients), part.name, seed=seed, groups=dataset.groups, test_fraction=config.test_fraction,
        class_names=dataset.class_names, options=part.options, alpha=part.alpha,
        classes_per_client=part.classes_per_client, min_samples=part.min_samples, samples_per_client=total_per_client,
        clients_per_domain=part.clients_per_domain,
    )
    if isinstance(cut, Partition):
        return _partitioned(config, dataset, kind, cut, index, name, clients, where)
    client_indices = cut
    if test_samples is not None:
        splits = exact_test_split(client_indices, dataset.strata, test_samples, seed=seed)
    else:
        splits = split_train_test(client_indices, dataset.strata, config.test_fraction, seed=seed)
    task = Task(index, name, kind=kind, modalities=input_modalities(dataset), **kind.task_fields(dataset))
    holding = Holding(index, dataset, tuple(clients), tuple(splits), where, config.max_text_length)
    shared: tuple[SharedEval, ...] = ()
    if part.global_test_samples is not None:
        indices = global_test_indices(splits, len(dataset), part.global_test_samples, seed=seed)
        shared = (SharedEval("global", holding, indices, index),)
    holding, shared = _used_rows_only(holding, shared)
    return Federation((task,), (holding,), len(clients), shared)


def _partitioned(config: DataConfig, dataset: ArrayDataset, kind: TaskKind, cut: Partition, index: int, name: str,
                 clients: list[int], where: str) -> Federation:
    """The tasks, holding and shared test sets of a partitioner's :class:`Partition`: with label spaces, one task
    each, the dataset relabelled within its space."""
    if config.partition.global_test_samples is not None:
        raise DataError(f"{where}.partition.global_test_samples cannot be used with {where}.partition.name = "
                        f"{resolve('partitioner', config.partition.name).name!r}, which makes its own test sets.")
    fields = {**kind.task_fields(dataset), "modalities": input_modalities(dataset)}
    if cut.label_spaces:
        labels = dataset.labels.copy()
        for space in cut.label_spaces:
            for position, label in enumerate(space.classes):
                labels[dataset.labels == label] = position
        dataset_in_spaces = dataclasses.replace(dataset, labels=labels)
        tasks = tuple(Task(index + i, space.name, kind=kind, **{**fields, "class_names": tuple(
            dataset.class_names[label] for label in space.classes)}) for i, space in enumerate(cut.label_spaces))
    else:
        dataset_in_spaces, tasks = dataset, (Task(index, name, kind=kind, **fields),)
    holding = Holding(index, dataset_in_spaces, tuple(clients), cut.splits, where, config.max_text_length)
    shared = tuple(SharedEval(test.name, holding, test.indices, index + test.space, test.exclude_own_classes)
                   for test in cut.shared_tests)
    holding, shared = _used_rows_only(holding, shared)
    return Federation(tasks, (holding,), len(clients), shared)


def encode_public(config: DataConfig, seed: int, backbone: Backbone, models: Sequence[ModelConfig] = ()
                  ) -> tuple[Task, Columns]:
    """The public dataset (``data.public``), whole, as a task of its kind and named tensors for ``backbone``
    (``models``: the run's model configs, for ``data.resize = 'backbone'``)."""
    processing = backbone_image_processing([config], models)
    dataset = load_source(config, seed, image_processing=processing, where="data.public")
    kind = task_kind(config, dataset, "data.public")
    kind.check_data(dataset, "data.public")
    kind.check(dataset, backbone, "data.public")
    task = Task(-1, "public", kind=kind, **kind.task_fields(dataset))
    if config.max_text_length is not None:
        backbone = dataclasses.replace(backbone, max_text_length=config.max_text_length)
    return task, kind.encode(dataset, np.arange(len(dataset)), backbone)
