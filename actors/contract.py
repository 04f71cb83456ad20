"""What a method returns, checked against what it declared, where it happens: one sentence naming the method, the
hook, the client, the round and the tensor or slot (:class:`rayfed.method.MethodOutputError`).

Every check reads names, flags and tensors' version counters, never a tensor's values: a correct method's numbers
stay bitwise the same. The ClientActor runs each local update through :class:`ClientContract`; the DriverActor
gives ``aggregate`` its uploads as :class:`SlotReads` and watches its first round with :class:`ServerWatch`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rayfed.method import (ClientState, LocalResult, Method, MethodOutputError, ServerState, TensorDict, Upload,
                           check_tensors, tensor_specs)
from rayfed.param_names import behind
from rayfed.state_tree import flatten_tree, tree_leaves
from rayfed.training import ClientContext
from rayfed.actors.uploads import RoundUploads
from rayfed.types import Slot

PARAMETER_SLOT = Slot.SHARED.value  # the upload slot of the model's shared parameters (Method.local_update's default)


class ClientContract:
    """A method's client side as the engine holds it to: ``local_update`` never writes into its payload (the clients
    of a round share one), its upload's ``shared`` tensors are parameters of the client model, of their shapes and
    dtypes, none of them one that :meth:`Method.is_shared` calls personal and the new state keeps as personal."""

    def __init__(self, label: str, initial: TensorDict):
        self.label = label
        self.specs = tensor_specs(initial)  # what payloads and uploads are checked against
        self._personal: tuple[Method | None, frozenset[str]] = (None, frozenset())

    def personal(self, method: Method) -> frozenset[str]:
        """The model's parameters that ``method.is_shared`` calls personal (asked once per method object)."""
        if self._personal[0] is not method:
            self._personal = (method, frozenset(name for name in self.specs if not method.is_shared(name)))
        return self._personal[1]

    def _source(self, hook: str, client: ClientContext) -> str:
        return f"method {self.label!r}, hook {hook}, client {client.client_id}, round {client.round + 1}"

    def local_update(self, method: Method, client: ClientContext, state: ClientState,
                     payload: TensorDict | None) -> LocalResult:
        """``method``'s local update of ``client``, its payload and upload checked."""
        versions = _versions(payload)
        result = method.local_update(client, state, payload)
        written = [name for name, (value, version) in versions.items() if value._version != version]
        if written:
            # views of one buffer share a version counter: which of them was written cannot be told apart
            what = (f"payload tensor {written[0]!r}" if len(written) == 1 else
                    f"one of {len(written)} payload tensors that share a buffer (the first: {written[0]!r})")
            raise MethodOutputError(
                f"{self._source('local_update', client)}: {what} was written in place, but the "
                "clients of a round share one payload: compute into a new tensor (payload[name] * 0.5, not .mul_(0.5)) "
                "or clone it first.")
        self._check_upload(method, client, result)
        return result

    def _check_upload(self, method: Method, client: ClientContext, result: LocalResult) -> None:
        source = self._source("local_update", client)
        for slot, values in result.upload.items():
            check_tensors(values, self.specs if slot == PARAMETER_SLOT else {}, source, "the client model's parameter")
        uploaded = result.upload.get(PARAMETER_SLOT, {})
        unknown = next((name for name in uploaded if name not in self.specs), None)
        if unknown is not None:
            example = next(iter(self.specs), "")
            raise MethodOutputError(
                f"{source}: upload tensor {unknown!r} in slot {PARAMETER_SLOT!r} is no trainable parameter of the "
                f"client model, whose payloads the server builds from it: name it as the model does "
                f"(e.g. {example!r}).")
        kept = result.state.get(Slot.PERSONAL, {}) if isinstance(result.state, Mapping) else {}
        both = sorted(self.personal(method).intersection(uploaded).intersection(kept))
        if both:
            raise MethodOutputError(
                f"{source}: parameter {both[0]!r} is both personal ({type(method).__name__}.is_shared says so and "
                f"the new state keeps it in 'personal') and uploaded in slot {PARAMETER_SLOT!r}, so the server would "
                "average it and send it back over every client's own: upload only shared parameters.")


def _versions(payload: TensorDict | None) -> dict[str, tuple[torch.Tensor, int]]:
    """Each payload tensor with its version counter (which an in-place write raises), held so that a hook replacing
    the payload's entry is not taken for one writing into it; an inference tensor has no version."""
    return {name: (value, value._version) for name, value in flatten_tree(payload or {}).items()
            if isinstance(value, torch.Tensor) and not value.is_inference()}


class SlotReads(dict):
    """An upload's slots that records which of them are read (by key, ``get``, or all at once by iterating)."""

    def __init__(self, slots: Mapping[str, TensorDict]):
        super().__init__(slots)
        self.read: set[str] = set()

    def __getitem__(self, slot: str) -> TensorDict:
        self.read.add(slot)
        return super().__getitem__(slot)

    def get(self, slot: str, default: Any = None) -> Any:
        self.read.add(slot)
        return super().get(slot, default)

    def _all(self) -> None:
        self.read.update(super().keys())

    def __iter__(self) -> Iterator[str]:
        self._all()
        return super().__iter__()

    def keys(self):  # type: ignore[override]
        self._all()
        return super().keys()

    def values(self):  # type: ignore[override]
        self._all()
        return super().values()

    def items(self):  # type: ignore[override]
        self._all()
        return super().items()

    def copy(self) -> dict[str, TensorDict]:
        self._all()
        return dict(super().items())


def watched(uploads: Sequence[Upload]) -> list[SlotReads]:
    """Each upload's slots as :class:`SlotReads`, in place (its ``tensors``), to hand to the aggregation."""
    for upload in uploads:
        upload.tensors = SlotReads(upload.tensors)
    return [upload.tensors for upload in uploads]  # type: ignore[misc]


def check_slots_read(reads: Sequence[SlotReads], method: Method, label: str, parts: Sequence[RoundUploads]) -> None:
    """One sentence for an upload slot of the round's ``parts`` that neither the engine nor ``aggregate`` read
    (``reads``, :func:`watched`): the server never uses it. It names the first client that uploaded it."""
    read = {str(slot) for slots in reads for slot in slots.read}
    unread = sorted({str(slot) for slots in reads for slot in dict.keys(slots)} - read)
    if not unread:
        return
    slot = unread[0]
    client = min(part.slot_clients[slot] for part in parts if slot in part.slot_clients)
    kind = type(method.aggregation).__name__
    round_idx = next((part.round_idx for part in parts if part.round_idx is not None), None)
    when = "" if round_idx is None else f", round {round_idx + 1}"
    raise MethodOutputError(
        f"method {label!r}, hook local_update, client {client}{when}: upload slot {slot!r} is "
        f"read by neither the engine nor {type(method).__name__}.aggregate ({kind}; it read "
        f"{', '.join(map(repr, sorted(read))) or 'no slot'}), so the server never uses it: upload under a slot the "
        "aggregation reads.")


def check_global(server: ServerState, method: Method, label: str, hook: str, architectures: Iterable[str],
                 known: Mapping[str, object]) -> None:
    """One sentence for a tensor that the server's ``global`` slot gained (``known``: init_server's ``slot/name``s)
    of a parameter that ``method.is_shared`` calls personal: the default payload would send it over every client's
    own. ``hook``: the hook that returned ``server``, with its round."""
    for name in server.get(Slot.GLOBAL, {}):
        if f"global/{name}" in known:
            continue
        own = next((rest for arch in architectures if arch and (rest := behind(name, arch)) is not None), name)
        if not method.is_shared(own):
            raise MethodOutputError(
                f"method {label!r}, hook {hook}: server tensor 'global/{name}' is of parameter {own!r}, which "
                f"{type(method).__name__}.is_shared calls personal, so the payload would write it over every client's "
                "own: keep personal parameters out of the server's 'global'.")


class ServerWatch:
    """Whether a method's server state changed in its first round with uploads (``aggregate`` and the public passes
    after it); if not, a warning, once, naming the method: its uploads may go where nothing reads them."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, ...], tuple[torch.Tensor, int]] | None = None
        self.pending = True

    def before_first_round(self, server: ServerState, uploads: Sequence[Upload]) -> None:
        """Call before the round's aggregation: remembers the server state of the first round that had uploads."""
        if self.pending and self.seen is None and uploads:
            self.seen = _identities(server)

    def after_first_round(self, server: ServerState, label: str, method: Method) -> None:
        """Call when the next payloads are asked for: warns if the first round left the server state as it was."""
        if self.seen is None:
            return
        now = _identities(server)
        unchanged = now.keys() == self.seen.keys() and all(
            value is self.seen[key][0] and version == self.seen[key][1] for key, (value, version) in now.items())
        self.seen, self.pending = None, False
        if unchanged:
            warnings.warn(f"method {label!r} ({type(method).__name__}): its server state did not change in its first "
                          "round with uploads; if it should learn from them, check that aggregate reads the uploads "
                          "and returns new tensors.", RuntimeWarning, stacklevel=2)


def _identities(server: ServerState) -> dict[tuple[str, ...], tuple[torch.Tensor, int]]:
    """Each server tensor (of a slot's tree too) with its version (a new tensor or an in-place write changes one)."""
    return {path: (value, value._version if not value.is_inference() else -1)
            for path, value in tree_leaves(server) if len(path) > 1 and isinstance(value, torch.Tensor)}
