"""Every random stream derives from (seed, round, client_id, purpose).

Streams never depend on execution order, on how clients are packed into actors, or on which
actor runs a client: the same key always yields the same numbers.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

SERVER = -1  # client_id used for streams owned by the server (client sampling, model init)


def _purpose_code(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def seed_sequence(seed: int, round_idx: int, client_id: int, purpose: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, round_idx + 1, client_id + 2, _purpose_code(purpose)])


def numpy_rng(seed: int, round_idx: int, client_id: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(seed_sequence(seed, round_idx, client_id, purpose))


def torch_seed(seed: int, round_idx: int, client_id: int, purpose: str) -> int:
    """A 63-bit integer seed for ``torch.manual_seed`` / ``torch.Generator``."""
    return int(seed_sequence(seed, round_idx, client_id, purpose).generate_state(1, np.uint64)[0] >> 1)


def torch_generator(seed: int, round_idx: int, client_id: int, purpose: str) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(torch_seed(seed, round_idx, client_id, purpose))
    return generator


def sample_clients(seed: int, round_idx: int, num_clients: int, clients_per_round: int) -> list[int]:
    """The clients taking part in a round, sorted; a pure function of its arguments."""
    if clients_per_round >= num_clients:
        return list(range(num_clients))
    rng = numpy_rng(seed, round_idx, SERVER, "sample_clients")
    return sorted(int(c) for c in rng.choice(num_clients, size=clients_per_round, replace=False))
