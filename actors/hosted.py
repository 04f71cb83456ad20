"""HostedClients: the clients one ClientActor hosts, and the guests it trains for a round.

For each client: its tasks, its data (built on the actor from the run's federation), its view of the method's
initial parameters and its state (personal parameters, method state), each on the device the placement gives it
(``placement.client_state``). Guests are clients another actor of the architecture hosts: their states arrive for
a round and leave again for their hosts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from rayfed.config import PlacementConfig
from rayfed.data.clients import Federation
from rayfed.actors.devices import resident_data, resident_device, resource_usage
from rayfed.actors.evaluation import ClientEvaluation
from rayfed.actors.uploads import slots_to
from rayfed.method import ClientState, Method, TensorDict, tensor_bytes
from rayfed.models.backbone import Backbone
from rayfed.tasks import task_view
from rayfed.types import states_to


class HostedClients:
    """The hosted clients' tasks, data, initial views and states, and the guests' new states until their hosts take
    them."""

    def __init__(self, federation: Federation, client_ids: Sequence[int], backbone: Backbone, device: torch.device,
                 placement: PlacementConfig) -> None:
        """``placement.client_state`` says where the states and the data are kept."""
        self.federation, self.backbone, self.device = federation, backbone, device
        self.placement = placement.client_state
        self.client_ids = list(client_ids)
        self.tasks_of = {cid: federation.tasks_of(cid) for cid in self.client_ids}
        self.data_device, self.data, self.eval_sets = resident_data(
            federation, self.client_ids, backbone, device, self.placement)
        self.states: dict[int, ClientState] = {}
        self.guest_states: dict[int, ClientState] = {}  # guests' new states, until their hosts take them
        self.state_device = device
        self.initial_params: TensorDict = {}
        self.initial: dict[int, TensorDict] = {}
        self.tags: dict[str, frozenset[int]] = {}

    def start(self, method: Method, initial: TensorDict, tags: dict[str, frozenset[int]]) -> None:
        """Every hosted client's view of the method's ``initial`` parameters (one resident copy, shared) and its
        initial state; ``tags``: the tasks each parameter belongs to."""
        self.tags = tags
        self.state_device = resident_device(self.device, self.placement,
                                            3 * tensor_bytes(initial) * len(self.client_ids))
        resident = {name: value.to(self.state_device) for name, value in initial.items()}  # one copy, shared
        self.initial_params = resident
        # A client holds, trains and uploads only its tasks' view (shared + its tasks' own parameters).
        self.initial = {cid: task_view(resident, self.tasks_of[cid], self.tags) for cid in self.client_ids}
        self.states = {cid: method.init_client(self.initial[cid]) for cid in self.client_ids}

    def move(self, client_ids: Iterable[int], device: torch.device | str) -> None:
        """The states of ``client_ids`` onto ``device`` (the round's, or back where they are kept)."""
        self.states.update(states_to({cid: self.states[cid] for cid in client_ids}, device))

    def welcome(self, guests: Sequence[int], states: Sequence[ClientState], evaluation: ClientEvaluation) -> None:
        """Each guest client's state on this actor, and what it needs here: its tasks, data, initial view and (a
        stream, through ``evaluation``) other tasks."""
        for client_id, state in zip(guests, states):
            self.states[client_id] = slots_to(state, self.state_device)
            if client_id in self.data:
                continue
            self.tasks_of[client_id] = self.federation.tasks_of(client_id)
            self.data[client_id] = self.federation.client_data(client_id, self.backbone).to(self.data_device)
            self.initial[client_id] = task_view(self.initial_params, self.tasks_of[client_id], self.tags)
            evaluation.add_client(client_id, self.tasks_of[client_id], self.initial_params, self.tags)

    def keep_guest_states(self, guests: Iterable[int]) -> None:
        """The guests' new states, off the states trained here and kept on the host's CPU for their hosts."""
        for cid in guests:
            self.guest_states[cid] = slots_to(self.states.pop(cid), "cpu")

    def client_state(self, client_id: int) -> ClientState:
        """A hosted client's state, to train it on another actor this round."""
        return slots_to(self.states[client_id], "cpu")

    def take_guest_states(self) -> dict[int, ClientState]:
        """The new states of the guests trained here, for their hosts (emptied)."""
        states, self.guest_states = self.guest_states, {}
        return states

    def put_states(self, states: dict[int, ClientState]) -> None:
        """Hosted clients' new states, trained on another actor."""
        self.states.update({cid: slots_to(state, self.state_device) for cid, state in states.items()
                            if cid in self.client_ids})

    def get_states(self) -> dict[int, ClientState]:
        """Every hosted client's state on the CPU (a checkpoint's)."""
        return states_to(self.states, "cpu")

    def set_states(self, states: dict[int, ClientState]) -> None:
        """Every hosted client's state from ``states`` (a checkpoint's)."""
        self.states = {cid: slots_to(states[cid], self.state_device) for cid in self.client_ids}

    def resource_usage(self) -> dict[str, int]:
        """Peak GPU memory, resident host memory, and the bytes of hosted client state and data."""
        return resource_usage(self.device, len(self.client_ids), self.states, self.data)
