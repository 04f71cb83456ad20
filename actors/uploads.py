"""A ClientActor's part of a round as it leaves the actor: the clients' uploads collected as they come (summed into one
partial sum when the method allows it), what of them went NaN or infinite, and the lot moved to the host."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rayfed.aggregation import Aggregation, Mixture, presums
from rayfed.method import PartialSum, TensorDict, Upload, largest_magnitudes, nonfinite_names
from rayfed.state_tree import map_tree, tree_leaves
from rayfed.transport import in_ray_actor
from rayfed.types import ReadOnlyTensors, host_copies, moved_together, pinned_copies


@dataclass
class RoundUploads:
    """One actor's part of a round: what goes to the server, and what its clients sent and lost."""

    uploads: list[Upload]
    up_bytes: int  # what the clients uploaded (a partial sum's own size is a simulator detail)
    up_params: int
    train_losses: dict[int, float]
    stats: dict[str, float] = field(default_factory=dict)  # the methods' per-client statistics, summed
    busy_s: float = 0.0  # seconds from the actor's first local update to the end of its last one on the device
    # what was NaN or infinite -> the clients it came from
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    round_idx: int | None = None
    slot_clients: dict[str, int] = field(default_factory=dict)  # each upload slot -> the first client that sent it
    gpu_peak_bytes: int = 0  # the actor's most GPU memory so far, after its updates (0 on a CPU)


class SlotSender:
    """One slot of each upload sent on ahead, as soon as its client's local update is queued: its tensors copied to
    the host without waiting for the device, then, on a thread of their own once the copy is done, handed to ``put``
    (``ray.put`` in a Ray actor) while the actor's next client trains. At the round's end only the last client's slot
    is still on its way, not every client's: serialized after the round's call returns, a mixture's uploads of one
    actor (4 GB for FedMosaic's LLaVA mix at paper size) held its aggregation back by seconds."""

    def __init__(self, put: Callable[[ReadOnlyTensors], Any]):
        self.put = put
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayfed-uploads")

    def send(self, tensors: TensorDict) -> Future:
        """``put``'s result for ``tensors`` (read-only views of their host copy), to come."""
        on_gpu, copied = pinned_copies(value for value in tensors.values() if value.is_cuda)
        on_host = ReadOnlyTensors({name: on_gpu.get(id(value), value.detach()) for name, value in tensors.items()})
        return self.pool.submit(self._put, on_host, copied)

    def _put(self, on_host: ReadOnlyTensors, copied: list[torch.cuda.Event]) -> Any:
        for done in copied:
            done.synchronize()
        return self.put(on_host)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class UploadCollector:
    """A round's uploads on one actor, added as each client's local update ends (in client-id order, the order they
    are summed in). With ``presum`` (:func:`rayfed.aggregation.presums` of the method's aggregation) they go into
    one partial sum as they come, on the device where they were trained: then no copy to the host, and no float64
    arithmetic on the host, per client."""

    def __init__(self, presum: bool, weight_scale: dict[int, float], read_only_slot: str | None = None,
                 sender: SlotSender | None = None):
        """``read_only_slot``: an upload slot the server only reads (a mixture's, which it copies into its rows);
        ``sender``: sends that slot of each upload on ahead (the server then gets what its ``put`` returned)."""
        self.partial = PartialSum() if presum else None
        self.read_only_slot = read_only_slot
        self.sender = sender
        self.sending: dict[int, Future] = {}  # client id -> the sender's result for its read-only slot
        self.weight_scale = weight_scale
        self.uploads: list[Upload] = []
        self.up_bytes = self.up_params = 0
        self.losses: dict[int, float | torch.Tensor] = {}
        self.magnitudes: dict[int, tuple[list[str], torch.Tensor | None]] = {}
        self.slot_clients: dict[str, int] = {}  # see RoundUploads

    def add(self, upload: Upload) -> None:
        cid = upload.client_id
        upload.weight_scale = self.weight_scale[cid]
        self.up_bytes += upload.nbytes
        self.up_params += upload.nparams
        self.losses[cid] = upload.train_loss
        self.magnitudes[cid] = largest_magnitudes(upload.tensors)
        for slot in upload.tensors:
            self.slot_clients.setdefault(slot, cid)
        if upload.tensors and self.partial is not None:
            self.partial.add(upload)
        elif upload.tensors:
            self.uploads.append(upload)
            if self.sender is not None and self.read_only_slot in upload.tensors:
                self.sending[cid] = self.sender.send(upload.tensors[self.read_only_slot])

    def read_losses(self) -> dict[int, float]:
        """The clients' training losses as numbers, read together once the last client's steps are queued (one wait
        for the device to finish them all)."""
        on_host = host_copies([loss for loss in self.losses.values() if isinstance(loss, torch.Tensor)])
        self.losses = {cid: float(on_host[id(loss)] if isinstance(loss, torch.Tensor) else loss)
                       for cid, loss in self.losses.items()}
        return self.losses

    def nonfinite(self, arrived_rows: Callable[[int], object]) -> dict[str, list[int]]:
        """What is NaN or infinite, with the clients it came from: each upload tensor (its magnitudes read in one go)
        and the training loss (after :meth:`read_losses`) of every client that trained (``arrived_rows(client)``: the
        rows its stream has brought, None outside a stream; one whose stream has brought none trains nothing and
        reports a NaN loss)."""
        found: dict[str, list[int]] = {}
        for cid, names in nonfinite_names(self.magnitudes).items():
            for name in names:
                found.setdefault(f"upload tensor {name!r}", []).append(cid)
        for cid, loss in self.losses.items():
            if not math.isfinite(loss):
                pool = arrived_rows(cid)
                if pool is None or len(pool):
                    found.setdefault("training loss", []).append(cid)
        return found

    def on_host(self) -> list[Upload]:
        """The uploads, or their partial sum, moved to the host together, as the aggregation reads them."""
        uploads = self.uploads
        if self.partial is not None and self.partial.client_ids:
            uploads = [self.partial.upload()]
        slot = self.read_only_slot
        for upload in uploads:
            if upload.client_id in self.sending:
                upload.tensors = {name: values for name, values in upload.tensors.items() if name != slot}
        to_host(uploads, sent_only_slot=slot)
        for upload in uploads:
            if upload.weight_sums is not None:  # a partial sum, which the aggregation only reads (weighted_sums)
                upload.tensors = ReadOnlyTensors(upload.tensors)
            elif upload.client_id in self.sending:  # the server fetches it (fetch_sent_slots)
                upload.tensors = {**upload.tensors, slot: self.sending[upload.client_id].result()}
            elif slot in upload.tensors:  # through Ray the server gets views of the object store's copy, not a copy
                upload.tensors = {**upload.tensors, slot: ReadOnlyTensors(upload.tensors[slot])}
        if self.sender is not None:
            self.sender.close()
        return uploads


def round_collector(aggregation: Aggregation, weight_scale: dict[int, float], send_ahead: bool) -> UploadCollector:
    """A ClientActor's collector of one round's uploads under the method's ``aggregation``: pre-summed for a weighted
    mean; a mixture's slot read-only, and with ``send_ahead`` sent on ahead from a Ray actor
    (``RunActors.sends_ahead``)."""
    mixture = isinstance(aggregation, Mixture)
    sender = SlotSender(ray.put) if mixture and send_ahead and in_ray_actor() else None
    return UploadCollector(presums(aggregation), weight_scale, read_only_slot=aggregation.slot if mixture else None,
                           sender=sender)


def fetch_sent_slots(uploads: Sequence[Upload]) -> None:
    """The upload slots that actors sent on ahead (:class:`SlotSender`, as ObjectRefs) fetched in place, in one
    ``ray.get``: read-only views of the object store's copy."""
    sent = [(upload, slot, ref) for upload in uploads for slot, ref in upload.tensors.items()
            if isinstance(ref, ray.ObjectRef)]
    if sent:
        for (upload, slot, _), values in zip(sent, ray.get([ref for _, _, ref in sent])):
            upload.tensors[slot] = values


def to_host(uploads: Sequence[Upload], sent_only_slot: str | None = None) -> None:
    """Each upload's tensors and training loss moved to the host, in place, all in one copy per GPU and dtype with
    one wait (:func:`rayfed.types.host_copies`); each host tensor owns its storage, so that one the server keeps,
    pickles or checkpoints holds only its own bytes, except those of ``sent_only_slot`` (a slot the server copies
    into storage of its own, which stays views of the copy)."""
    losses = [upload.train_loss for upload in uploads if isinstance(upload.train_loss, torch.Tensor)]
    sent_only = {id(value) for upload in uploads for value in upload.tensors.get(sent_only_slot, {}).values()}
    on_host = host_copies([value for upload in uploads for values in upload.tensors.values()
                           for value in values.values()] + losses, sent_only)
    for upload in uploads:
        upload.tensors = {slot: {name: on_host[id(value)] for name, value in values.items()}
                          for slot, values in upload.tensors.items()}
        loss = upload.train_loss
        upload.train_loss = float(on_host[id(loss)] if isinstance(loss, torch.Tensor) else loss)


def slots_to(slots: dict[str, TensorDict], device: torch.device | str) -> dict[str, TensorDict]:
    """Every tensor of each slot (a slot may hold a tree), detached, on ``device``, those elsewhere moved in one copy
    per dtype (:func:`rayfed.types.moved_together`)."""
    moved = moved_together([value for _, value in tree_leaves(slots)], device)
    return map_tree(slots, lambda value: moved[id(value)])
