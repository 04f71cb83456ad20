"""What a client uploads (:class:`Upload`), how a method's uploads combine, as a value the engine reads
(``Method.aggregation``), and what the engine keeps for each way: partial sums, or a per-client mixture's rows.

- :class:`WeightedMean` (the default): ``aggregate`` reads only the uploads' per-tensor weighted sums
  (``rayfed.method.weighted_mean``, ``weighted_sums``), so each actor pre-sums its clients' uploads.
- :class:`EachUpload`: ``aggregate`` reads every client's own upload (a count of uploads, teachers, a median).
- :class:`Mixture`: client i receives ``sum_j W_ij x_j`` of every tensor of a slot, ``x_j`` the latest upload of
  client j (its architecture's initial value before it has sent one) and ``W`` a clients x clients matrix that the
  method keeps in its server state. The DriverActor keeps the rows (server slot ``Slot.ROWS``) and their index
  (:class:`MixedRows`), writes each upload into its client's row before ``aggregate`` runs, and hands the hooks the
  state as a :class:`MixedServer`, whose :meth:`MixedServer.mixed` the default ``payload`` sends; the method only
  computes ``W``.

In a run of several architectures a mixture runs within client i's architecture, ``W``'s row i restricted to it and
renormalized (a client with no weight there keeps its own row), except for the tensors that ``Mixture.across`` puts in
a group: a group's tensors, one per architecture, mix over every client with ``W`` as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rayfed.architectures import prefixed, unprefixed
from rayfed.errors import ConfigError
from rayfed.param_names import PREFIX_SEP, split_prefix
from rayfed.state_tree import tree_at
from rayfed.types import Loss, ServerState, Slot, TensorDict, tensor_bytes, tensor_params


@dataclass
class Upload:
    """What one client sends to the server in one round."""

    client_id: int
    num_samples: int
    tensors: dict[str, TensorDict]
    train_loss: Loss
    weight_scale: float = 1.0  # < 1 for a late upload that the system config down-weights
    # Set on a partial sum made on an actor (see presum): ``tensors`` then hold, per tensor, the float64
    # sum of weight * value over the actor's clients, and ``weight_sums`` the sum of their weights.
    weight_sums: dict[str, dict[str, float]] | None = None
    dtypes: dict[str, dict[str, torch.dtype]] | None = None

    @property
    def weight(self) -> float:
        return self.num_samples * self.weight_scale

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    def under_server_names(self, architecture: str) -> Upload:
        """This upload with its tensors named as the server names them (``<architecture>/<name>``;
        unchanged in a run of one architecture)."""
        if not architecture:
            return self
        name = f"{architecture}/{{}}".format
        return dataclasses.replace(
            self,
            tensors={slot: {name(n): v for n, v in values.items()} for slot, values in self.tensors.items()},
            weight_sums=None if self.weight_sums is None else
            {slot: {name(n): w for n, w in values.items()} for slot, values in self.weight_sums.items()},
            dtypes=None if self.dtypes is None else
            {slot: {name(n): d for n, d in values.items()} for slot, values in self.dtypes.items()},
        )

    @property
    def nparams(self) -> int:
        return tensor_params(self.tensors)


def weighted_sums(uploads: Sequence[Upload], slot: str) -> tuple[TensorDict, dict[str, float]]:
    """Per tensor of one slot: the float64 sum of weight * value and the sum of weights, in client-id order.

    Each tensor is summed over the uploads that contain it (a per-task head over that task's clients
    only). Products of float32 values and sample counts are exact in float64, and grouping the sums
    differently (pre-summed per actor, see :func:`presum`) moves them only far below float32
    precision: the packing tests check that the float32 means come out bitwise equal. A sum may be a
    pre-summed upload's own tensor (one actor's round): read it, never write to it.
    """
    sums: TensorDict = {}
    totals: dict[str, float] = {}
    borrowed: set[str] = set()
    for upload in sorted(uploads, key=lambda u: u.client_id):
        _add_weighted(sums, totals, borrowed, upload, slot)
    return sums, totals


def _add_weighted(sums: TensorDict, totals: dict[str, float], borrowed: set[str], upload: Upload, slot: str) -> None:
    """Add one upload's weight * value (or a partial sum's sums) of ``slot`` into ``sums``, its weights into ``totals``.

    A partial sum's tensor that starts a sum is taken as it is, its name put in ``borrowed``, and the next term
    is added into a new tensor: with one actor a round, a copy of its whole sum (90 MB for an LLM's LoRA) is saved.
    """
    for name, value in upload.tensors.get(slot, {}).items():
        if upload.weight_sums is None:
            # Multiply, then add, as separate operations: the same float64 roundings on every device.
            term, weight = value.to(torch.float64, copy=True).mul_(upload.weight), upload.weight
        else:
            term, weight = value, upload.weight_sums[slot][name]
        if name not in sums:
            sums[name] = term
            if upload.weight_sums is not None:
                borrowed.add(name)
        elif name in borrowed:
            sums[name] = sums[name] + term
            borrowed.discard(name)
        else:
            sums[name].add_(term)  # in place: this runs once per client and tensor every round
        totals[name] = totals.get(name, 0.0) + weight


def weighted_mean(uploads: Sequence[Upload], slot: str) -> TensorDict:
    """Sample-count weighted mean of one upload slot, each tensor over the uploads that contain it."""
    sums, totals = weighted_sums(uploads, slot)
    dtypes: dict[str, torch.dtype] = {}
    for upload in uploads:
        dtypes.update(_dtypes(upload, slot))
    return {name: mean_as(total, totals[name], dtypes[name]) for name, total in sums.items()}


def mean_as(total: torch.Tensor, weight: float, dtype: torch.dtype) -> torch.Tensor:
    """``(total / weight).to(dtype)``, the same values, in one pass over the tensor for a floating ``dtype``
    (computed at ``total``'s precision and rounded once, as the two steps do)."""
    if not dtype.is_floating_point:
        return (total / weight).to(dtype)
    return torch.div(total, weight, out=torch.empty(total.shape, dtype=dtype, device=total.device))


def _dtypes(upload: Upload, slot: str) -> dict[str, torch.dtype]:
    """The dtypes the clients' tensors of ``slot`` had (a partial sum holds float64 sums of them)."""
    if upload.dtypes:
        return upload.dtypes.get(slot, {})
    return {name: value.dtype for name, value in upload.tensors.get(slot, {}).items()}


class PartialSum:
    """One actor's uploads of a round summed as they come (see :func:`presum`), in client-id order.

    Adding each upload as soon as it is made keeps one float64 sum rather than every upload, on the
    device where the uploads were trained; :meth:`upload` then moves it to the host in one go.
    """

    def __init__(self) -> None:
        self.sums: dict[str, TensorDict] = {}
        self.borrowed: dict[str, set[str]] = {}  # see _add_weighted
        self.weights: dict[str, dict[str, float]] = {}
        self.dtypes: dict[str, dict[str, torch.dtype]] = {}
        self.client_ids: list[int] = []
        self.num_samples = 0

    def add(self, upload: Upload) -> None:
        if self.client_ids and upload.client_id <= self.client_ids[-1]:
            raise ValueError(
                f"PartialSum.add: client {upload.client_id} after client {self.client_ids[-1]}; uploads are "
                "summed in increasing client-id order, the order weighted_sums adds them in."
            )
        for slot in upload.tensors:
            _add_weighted(self.sums.setdefault(slot, {}), self.weights.setdefault(slot, {}),
                          self.borrowed.setdefault(slot, set()), upload, slot)
            self.dtypes.setdefault(slot, {}).update(_dtypes(upload, slot))
        self.client_ids.append(upload.client_id)
        self.num_samples += upload.num_samples

    def upload(self) -> Upload:
        """The partial sum as one upload, its tensors where they were summed (the actor moves them to the host with its
        other uploads, in one copy per dtype)."""
        return Upload(
            client_id=self.client_ids[0], num_samples=self.num_samples,
            tensors={slot: self.sums[slot] for slot in sorted(self.sums)},
            train_loss=float("nan"), weight_sums=self.weights, dtypes=self.dtypes,
        )


def presum(uploads: Sequence[Upload]) -> Upload:
    """One actor's uploads of a round as one partial sum, for methods whose aggregate is a weighted mean."""
    partial = PartialSum()
    for upload in sorted(uploads, key=lambda u: u.client_id):
        partial.add(upload)
    return partial.upload()


ROWS = Slot.ROWS  # the server slot of a mixture's rows: one stack per tensor (or group), a row per client


@dataclass(frozen=True)
class WeightedMean:
    """``aggregate`` reads only per-tensor weighted sums of the uploads, of every slot: actors may pre-sum them."""


@dataclass(frozen=True)
class EachUpload:
    """``aggregate`` reads every client's own upload: nothing is pre-summed."""


@dataclass(frozen=True)
class Mixture:
    """Each client gets its own mixture of every client's latest upload of ``slot``, by the weight matrix at
    ``weights``: its path in the server state, ``(<server slot>, <name>, ...)`` (a slot may hold a tree; the
    string ``"<server slot>/<name>"`` is read as that path); row i: client i's weights over the clients.

    ``within_weights``: another matrix for the tensors mixed within an architecture (default: ``weights``).
    ``across``: given one architecture's shared tensor names, those that mix across architectures, each with its
    group's key; every architecture must have one tensor of each group, of one shape.
    """

    weights: tuple[str, ...] | str
    within_weights: tuple[str, ...] | str | None = None
    slot: str = Slot.SHARED
    across: Callable[[Sequence[str]], Mapping[str, str]] | None = None

    def __post_init__(self) -> None:
        for field in ("weights", "within_weights"):
            path = getattr(self, field)
            if isinstance(path, str):
                if path.count(PREFIX_SEP) != 1:
                    raise ValueError(f"Mixture.{field} = {path!r} must be '<server slot>/<tensor name>' or a path "
                                     "of names, (<server slot>, <name>, ...)")
                object.__setattr__(self, field, tuple(split_prefix(path)))
            elif path is not None and (len(path) < 2 or not all(isinstance(key, str) for key in path)):
                raise ValueError(f"Mixture.{field} = {path!r} must be a path of names, (<server slot>, <name>, ...)")


Aggregation = WeightedMean | EachUpload | Mixture


def presums(aggregation: Aggregation) -> bool:
    """Whether actors add their clients' uploads into one partial sum before sending them."""
    if not isinstance(aggregation, (WeightedMean, EachUpload, Mixture)):
        raise TypeError(f"Method.aggregation is a {type(aggregation).__name__}; it must be a rayfed.aggregation "
                        "WeightedMean, EachUpload or Mixture.")
    return isinstance(aggregation, WeightedMean)


def _matrix(server: ServerState, path: Sequence[str]) -> torch.Tensor:
    return tree_at(server, path)


_MIX_COLUMNS = 1 << 14
"""Columns of a stack mixed at a time: their float64 copy and product stay in the CPU's cache, where a whole stack's
would take four times the stack's memory (bitwise the same; ``benchmarks/mixture_server.py``)."""


def _mixed(weights: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
    """Row i: ``sum_j weights_ij stack_j``, in float64, in the stack's dtype."""
    flat = stack.flatten(1)
    mixed = flat.new_empty((len(weights), flat.shape[1]))
    for start in range(0, flat.shape[1], _MIX_COLUMNS):
        columns = slice(start, start + _MIX_COLUMNS)
        mixed[:, columns] = weights @ flat[:, columns].double()
    return mixed.view(len(weights), *stack.shape[1:])


class MixedRows:
    """A mixture's index for one run: which stack and row hold each server-named tensor of each client, and the
    last mixed stacks, each kept until the weights or its rows change (one client's payload at a time would otherwise
    read every stack once per client)."""

    def __init__(self, mixture: Mixture, architecture_of: Sequence[str], initial_shared: TensorDict, label: str):
        self.mixture = mixture
        self.rows_of: dict[str, list[int]] = {}  # each architecture's clients, in id order
        for client, arch in enumerate(architecture_of):
            self.rows_of.setdefault(arch, []).append(client)
        self.architecture_of = tuple(architecture_of)
        self.row_in_arch = {client: rows.index(client) for rows in self.rows_of.values() for client in rows}
        self.stack_of: dict[str, str] = {}  # server name -> the stack holding its rows
        self.names_of: dict[str, list[str]] = {}  # architecture -> its server names, those mixed across first
        groups: dict[str, dict[str, str]] = {}  # group -> architecture -> server name
        for arch in self.rows_of:
            own = unprefixed(initial_shared, arch)
            keys = prefixed(dict(mixture.across(list(own))) if mixture.across else {}, arch)
            for name, key in keys.items():
                groups.setdefault(key, {})[arch] = name
            within = [name for name in prefixed(own, arch) if name not in keys]
            self.stack_of.update({**keys, **{name: name for name in within}})
            self.names_of[arch] = [*keys, *within]
        for key, members in groups.items():
            missing = [arch for arch in self.rows_of if arch not in members]
            shapes = {tuple(initial_shared[name].shape) for name in members.values()}
            if missing or len(shapes) > 1 or key in initial_shared:
                problem = (f"architecture {missing[0]!r} has no tensor of it" if missing else
                           f"its tensors have shapes {', '.join(map(str, sorted(shapes)))}" if len(shapes) > 1 else
                           "a tensor has that name")
                raise ConfigError(f"method {label!r} mixes group {key!r} across architectures, but {problem}; every "
                                  "architecture needs one tensor of each group, of one shape.")
        self.across = set(groups)
        self._matrices: tuple[tuple, dict[str | None, torch.Tensor]] | None = None  # see _mixing_matrices
        self._mixed: dict[str, tuple[tuple, torch.Tensor]] = {}  # stack -> its inputs as seen, the mixed stack

    def initial_rows(self, initial_shared: TensorDict) -> TensorDict:
        """Every stack with each client's row at its architecture's initial value."""
        stacks: TensorDict = {}
        for arch, clients in self.rows_of.items():
            for name in self.names_of[arch]:
                key, value = self.stack_of[name], initial_shared[name]
                if key in self.across:
                    stack = stacks.setdefault(key, value.new_empty((len(self.architecture_of), *value.shape)))
                    stack[clients] = value
                else:
                    stacks[key] = value.unsqueeze(0).repeat(len(clients), *([1] * value.dim()))
        return stacks

    def _row(self, name: str, client: int) -> tuple[str, int]:
        key = self.stack_of[name]
        return key, client if key in self.across else self.row_in_arch[client]

    def store(self, server: ServerState, uploads: Sequence[Upload]) -> None:
        """Each upload's tensors of the mixed slot into its client's rows (in place)."""
        stacks = server[ROWS]
        for upload in sorted(uploads, key=lambda u: u.client_id):
            for name, value in upload.tensors.get(self.mixture.slot, {}).items():
                if name not in self.stack_of:
                    raise ConfigError(f"client {upload.client_id} uploads {name!r} in slot {str(self.mixture.slot)!r}, "
                                      "which has no rows: a Mixture mixes the tensors that init_server was given.")
                key, row = self._row(name, upload.client_id)
                stacks[key][row] = value.to(stacks[key].dtype)

    def _mixing_matrices(self, server: ServerState) -> dict[str | None, torch.Tensor]:
        """The float64 matrices that mix the stacks: ``None`` -> ``W`` (the groups mixed across architectures), each
        architecture -> its block of the within matrix, each row renormalized (a row of no weight: the client's own)."""
        weights = _matrix(server, self.mixture.weights)
        within = _matrix(server, self.mixture.within_weights) if self.mixture.within_weights else weights
        if self._matrices is not None and _unchanged(self._matrices[0], (weights, within)):
            return self._matrices[1]
        matrices: dict[str | None, torch.Tensor] = {None: weights.double()}
        within_all = within.double()
        for arch, rows in self.rows_of.items():
            block = within_all[rows][:, rows]
            totals = block.sum(dim=1, keepdim=True)
            matrices[arch] = torch.where(totals > 0, block / totals, torch.eye(len(rows), dtype=torch.float64))
        self._matrices = (_seen((weights, within)), matrices)
        return matrices

    def _mixed_stack(self, server: ServerState, key: str, architecture: str) -> torch.Tensor:
        """Stack ``key`` mixed (``architecture``: the one its rows belong to, unless it mixes across them), kept until
        its matrix or its rows change: a round's payloads mix each stack once, and only the stacks of the
        architectures they are asked for."""
        matrix = self._mixing_matrices(server)[None if key in self.across else architecture]
        stack = server[ROWS][key]
        kept = self._mixed.get(key)
        if kept is not None and _unchanged(kept[0], (matrix, stack)):
            return kept[1]
        mixed = _mixed(matrix, stack)
        self._mixed[key] = (_seen((matrix, stack)), mixed)
        return mixed

    def payload(self, server: ServerState, client_id: int) -> TensorDict:
        """Client ``client_id``'s mixture of every tensor of its architecture, under the server's names."""
        architecture, payload = self.architecture_of[client_id], {}
        for name in self.names_of[architecture]:
            key, row = self._row(name, client_id)
            # a view: Ray ships the row's bytes alone, and an actor copies it
            payload[name] = self._mixed_stack(server, key, architecture)[row]
        return payload


class MixedServer(dict):
    """A :class:`Mixture` method's server state as the DriverActor hands it to the method's hooks: the state's slots,
    and the engine's index of its rows, which :meth:`mixed` reads. Pickled (a checkpoint, a transfer through Ray) it
    is the plain dict of its slots; a dict made from it (``{**server, ...}``) is a plain state again."""

    def __init__(self, server: ServerState, rows: MixedRows):
        super().__init__(server)
        self.rows = rows

    def mixed(self, client_id: int) -> TensorDict:
        """Client ``client_id``'s mixture of every client's rows of its architecture, under the server's names."""
        return self.rows.payload(self, client_id)

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)


def _seen(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, int], ...]:
    """Each tensor with its version: what :func:`_unchanged` compares with later (holding the tensors keeps each
    identity unique)."""
    return tuple((tensor, tensor._version) for tensor in tensors)


def _unchanged(seen: tuple[tuple[torch.Tensor, int], ...], tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are the tensors :func:`_seen` was given, none changed in place since."""
    return len(seen) == len(tensors) and all(a is b and version == b._version for (a, version), b in zip(seen, tensors))
