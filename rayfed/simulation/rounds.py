"""One round of a method: who takes part (the method's choice from the seeded sample, then the system model's
drop-outs and stragglers), which actor trains whom, the dispatch of payloads and guests' states, the aggregation on the
DriverActor and the method's public passes after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayfed.simulation.actors import RunActors
from rayfed.simulation.placement import assign
from rayfed.stages import public_pass_count
from rayfed.system import RoundPlan, plan_round
from rayfed.tasks import sample_round


@dataclass
class RoundDone:
    """A round as it ran: the sampled clients, the system model's plan for them, and the aggregation's statistics."""

    sampled: list[int]
    plan: RoundPlan
    stats: dict[str, Any]

    def count(self, counters: dict[str, float], wall_s: float) -> None:
        """Add the round's communication and wall-clock time to a method's running ``counters``."""
        counters["up_bytes"] += self.stats["up_bytes"]
        counters["down_bytes"] += self.stats["down_bytes"]
        for key in ("up_params", "down_params"):  # absent from checkpoints of older versions
            counters[key] = counters.get(key, 0) + self.stats[key]
        counters["wall_time_s"] += wall_s

    def event(self, label: str, rounds_done: int, wall_s: float) -> dict[str, Any]:
        """The round's line of ``metrics.jsonl``."""
        plan = self.plan
        return {"event": "round", "method": label, "round": rounds_done, "clients": self.sampled,
                "participants": plan.participants, "dropped": plan.dropped, "late": plan.late,
                "sim_time": plan.sim_time, **self.stats, "wall_s": round(wall_s, 4)}


def run_round(actors: RunActors, method_index: int, round_idx: int, num_train: dict[int, int]) -> RoundDone:
    """Round ``round_idx`` of method ``method_index`` on the started ``actors``; the public passes follow unless
    something went non-finite."""
    config, method = actors.config, actors.methods[method_index]
    sampled = method.participants(round_idx, sample_round(config, round_idx), config.data.num_clients)
    plan = plan_round(config, round_idx, sampled, num_train)
    host_of, clients, driver = actors.host_of, actors.clients, actors.driver
    assignment = assign(plan.participants, actors.slots, host_of, config.placement.balance_rounds)
    guests = {actor: [cid for cid in cids if host_of[cid] != actor] for actor, cids in assignment.items()}
    # Calls on one actor run in the order they are made. Every guest's state is asked for before any actor trains,
    # and the guests' new states are handed back only after every actor's round is queued: otherwise one actor's
    # round would queue behind another's.
    states = {cid: clients[host_of[cid]].client_state.remote(cid) for actor in assignment for cid in guests[actor]}
    # The DriverActor makes the payloads one call after another: the actor that was busiest last round (the most
    # clients, in the first) gets its payloads first. The uploads still reach the aggregation in actor order.
    first = sorted(assignment, key=lambda actor: (-actors.busy_s.get(actor, 0.0), -len(assignment[actor])))
    send_ahead, trained = actors.sends_ahead(), {}
    for actor_index in first:
        client_ids = assignment[actor_index]
        payload_ref = driver.payloads.remote(client_ids)
        weight_scale = {cid: plan.weight_scale[cid] for cid in client_ids}
        trained[actor_index] = clients[actor_index].train_round.remote(
            round_idx, client_ids, payload_ref, weight_scale, guests[actor_index],
            *(states[cid] for cid in guests[actor_index]), send_ahead=send_ahead)
    upload_refs = [trained[actor_index] for actor_index in assignment]
    hosts_to_update = []
    for actor_index in assignment:
        if guests[actor_index]:
            moved = clients[actor_index].take_guest_states.remote()
            hosts_to_update += [clients[host].put_states.remote(moved)
                                for host in sorted({host_of[cid] for cid in guests[actor_index]})]
    stats = actors.executor.get(driver.aggregate.remote(*upload_refs))
    actors.busy_s.update(zip(assignment, stats["actor_busy_s"]))
    actors.store_bytes = stats["store_bytes"]
    actors.executor.get(hosts_to_update)
    if "nonfinite" not in stats:
        actors.public_passes(method_index, round_idx)
    return RoundDone(sampled, plan, stats)


def server_share_flops(actors: RunActors, method_index: int, client_id: int, num_train: dict[int, int]) -> float:
    """``client_id``'s share of the method's server-side passes on public data after round 1 (compute matching,
    :mod:`rayfed.compute`): the FLOPs of the passes on its architecture's actor over the round's participants of that
    architecture. Runs round 1 on the started ``actors``."""
    architecture = actors.slots[actors.host_of[client_id]].architecture
    counter = actors.clients[actors.first_of_each_architecture()[architecture]]
    actors.executor.get(counter.count_public_flops.remote(True))
    done = run_round(actors, method_index, 0, num_train)
    flops = actors.executor.get(counter.count_public_flops.remote(False))
    peers = [cid for cid in done.plan.participants if actors.slots[actors.host_of[cid]].architecture == architecture]
    return flops / max(1, len(peers))


def measured_costs(actors: RunActors, client_id: int, num_train: dict[int, int]) -> tuple[dict[str, float],
                                                                                          dict[str, float]]:
    """Per method label (compute matching): the FLOPs of ``client_id``'s round-1 local update and, for a method with
    public passes, its share of them (:func:`server_share_flops`); on actors started for the measurement alone: they
    are stopped after it."""
    local, server = {}, {}
    try:
        for index, entry in enumerate(actors.config.methods):
            actors.start_method(index)
            actors.before_federation(index)
            local[entry.label] = actors.local_update_flops(client_id)
            if public_pass_count(actors.methods[index]):
                server[entry.label] = server_share_flops(actors, index, client_id, num_train)
    finally:
        actors.stop()
    return local, server
