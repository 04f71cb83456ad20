"""PQ-LoRA and the gated dual adapter (FedMosaic's layer).

From *Not All Clients Are Equal: Collaborative Model Personalization on Heterogeneous Multi-Modal Clients* (Sec. 4.2,
Eq. 5-8 and 18-23; docs/fedmosaic.md#pq-lora-and-the-dual-adapter). Every adapted linear layer ``W_p`` of a
transformer's decoder layers becomes a :class:`GatedLinear` (the engine's named adapters,
:mod:`rayfed.models.peft.named_adapters`) holding FedMosaic's ``local`` and ``global`` adapters, each either

- conventional LoRA: ``s B_a A_a x`` with ``A_a`` (r x d_in) and ``B_a`` (d_out x r) of its own, or
- PQ-LoRA (Eq. 5): ``s_pq B (P_a A x + Q_a)``, where ``A`` (orthonormal rows) and ``B`` (orthonormal columns)
  are one frozen basis shared by the layer's adapters and only ``P_a`` (r x r) and ``Q_a`` (r) are trained:
  r^2 + r parameters whatever the width, so the k-th PQ layer of models of any size can be averaged.

PQ-LoRA goes on every linear layer of the last decoder layer of each of ``N_B`` blocks (Eq. 6, 1-based:
``I_k = k floor(L / N_B)``, ``I_{N_B} = L``), conventional LoRA on the others. The adapters' outputs are combined
by the layer's ``mix`` where a method sets one, else by the gate (Eq. 7: ``(1 - sigmoid(beta)) h_local +
sigmoid(beta) h_global`` with one ``beta`` per decoder layer), else summed.

Parameter names (what methods select by suffix): ``<linear>.A`` / ``<linear>.B`` (the PQ basis),
``<linear>.<adapter>_P`` / ``_Q`` (PQ layers), ``<linear>.<adapter>_A`` / ``_B`` (conventional layers) and
``<decoder layer>.adapter_gate.beta``. The PQ basis is detached in the forward pass, as frozen adapters are.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayfed.models.peft import named_adapters
from rayfed.models.peft.named_adapters import LINEAR_TARGETS, AdaptedLinear, LinearBuilder, Mix, Placement
from rayfed.param_names import adapter_of, adapter_param, adapter_part, adapter_tensor, layer_of, with_adapter

GATE = "adapter_gate"
LOCAL, GLOBAL = "local", "global"  # FedMosaic's two adapters: the client's own, and the one it receives


def is_pq(name: str) -> bool:
    """Whether parameter ``name`` is a PQ layer's P or Q (of any adapter)."""
    parsed = adapter_part(name)
    return parsed is not None and parsed[1] in ("P", "Q")


def is_global(name: str) -> bool:
    return adapter_of(name) == GLOBAL


def is_local(name: str) -> bool:
    return adapter_of(name) == LOCAL


def global_name(name: str) -> str:
    """A local adapter's tensor ``name`` as the global adapter's (other names as they are)."""
    return with_adapter(name, GLOBAL) if is_local(name) else name


def attachment_layers(depth: int, blocks: int) -> tuple[int, ...]:
    """The 1-based decoder layers that get PQ-LoRA (Eq. 6): the last layer of each of ``blocks`` blocks, the
    remainder layers in the last block (``I_k = k floor(depth / blocks)``, ``I_blocks = depth``)."""
    if not 1 <= blocks <= depth:
        raise ValueError(f"the number of PQ blocks must be in 1..{depth} (the model's depth), not {blocks}")
    step = depth // blocks
    return tuple(k * step for k in range(1, blocks)) + (depth,)


def random_orthonormal(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A (rows x cols) matrix with orthonormal rows (rows <= cols) or columns (rows >= cols): QR of a Gaussian."""
    tall = rows >= cols
    gaussian = torch.randn((rows, cols) if tall else (cols, rows), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # a unique Q: Haar-distributed
    return (q if tall else q.T).float().contiguous()


def nearest_orthonormal_rows(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix with orthonormal rows nearest to ``matrix`` (r x d, r <= d) in Frobenius norm: ``U V^T`` of its
    thin SVD (Eq. 21-23)."""
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u @ vh).to(matrix.dtype)


def nearest_orthonormal_columns(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix with orthonormal columns nearest to ``matrix`` (d x r, d >= r): its polar factor."""
    return nearest_orthonormal_rows(matrix.T).T.contiguous()


class LayerGate(nn.Module):
    """One learnable gate per decoder layer (Eq. 7): ``sigmoid(beta)`` weighs the second adapter, 1 - it the first.

    While its decoder layer runs (between :meth:`open` and :meth:`close`, the layer's forward hooks), the gate's
    weights are computed once and shared by the layer's seven adapted linears."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.zeros(()))
        self._open: dict[object, Any] | None = None  # this forward's values, while the layer runs

    def weight(self) -> torch.Tensor:
        return self.weights()[1]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1 - g, g)``: the first adapter's weight and the second's."""
        if self._open is not None and "weights" in self._open:
            return self._open["weights"]
        g = torch.sigmoid(self.beta)
        weights = (1 - g, g)
        if self._open is not None:
            self._open["weights"] = weights
        return weights

    def column_scales(self, rank: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """``scale * (1 - g, ..., 1 - g, g, ..., g)`` in ``dtype``: the weights of a two-adapter code's 2 ``rank``
        columns."""
        key = (rank, scale, dtype)
        if self._open is not None and key in self._open:
            return self._open[key]
        columns = (torch.stack(self.weights()) * scale).repeat_interleave(rank).to(dtype)
        if self._open is not None:
            self._open[key] = columns
        return columns

    def open(self, *_: object) -> None:
        self._open = {}

    def close(self, *_: object) -> None:
        self._open = None


class GatedLinear(AdaptedLinear):
    """A frozen linear layer plus named adapters, conventional or PQ, mixed by its decoder layer's gate where it has
    one (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, adapters: Sequence[str], *, pq: bool, scale: float,
                 frozen: Collection[str] = (), generator: torch.Generator | None = None, pq_init: str = "zero"):
        self.pq, self.pq_init = pq, pq_init  # read by the parameter hooks, which the base constructor calls
        super().__init__(base, rank, adapters, scale=scale, frozen=frozen, generator=generator)
        self._gate: tuple[LayerGate, ...] = ()  # the decoder layer's gate (kept out of this module's parameters)

    def _check_rank(self, d_in: int, d_out: int) -> None:
        if self.rank > min(d_in, d_out):
            raise ValueError(f"PQ-LoRA rank {self.rank} exceeds the layer's width ({d_in} -> {d_out})")

    def _parameter_shapes(self, d_in: int, d_out: int) -> list[tuple[str, tuple[int, ...]]]:
        if not self.pq:
            return super()._parameter_shapes(d_in, d_out)
        self._check_rank(d_in, d_out)
        rank = self.rank
        return [("A", (rank, d_in)), ("B", (d_out, rank))] + [
            (adapter_param(name, part), shape)
            for name in self.adapters for part, shape in (("P", (rank, rank)), ("Q", (rank,)))]

    def _create_parameters(self, d_in: int, d_out: int, device: torch.device, generator: torch.Generator) -> None:
        if not self.pq:
            super()._create_parameters(d_in, d_out, device, generator)
            return
        self._check_rank(d_in, d_out)
        rank = self.rank
        self.A = nn.Parameter(random_orthonormal(rank, d_in, generator).to(device))
        self.B = nn.Parameter(random_orthonormal(d_out, rank, generator).to(device))
        start = torch.eye(rank) if self.pq_init == "identity" else torch.zeros(rank, rank)
        for name in self.adapters:
            setattr(self, adapter_param(name, "P"), nn.Parameter(start.clone().to(device)))
            setattr(self, adapter_param(name, "Q"), nn.Parameter(torch.zeros(rank, device=device)))

    def set_gate(self, gate: LayerGate | None) -> None:
        self._gate = () if gate is None else (gate,)

    def _gated_pair(self) -> bool:
        return self.mix is None and bool(self._gate) and len(self.adapters) == 2

    def weights(self) -> Mix:
        if self._gated_pair():
            g = self._gate[0].weight()
            return {self.adapters[0]: 1 - g, self.adapters[1]: g}
        return super().weights()

    def delta_weight(self, name: str) -> torch.Tensor:
        """Adapter ``name``'s ``Delta W`` (d_out x d_in), its bias-free part (PQ: ``s B P A``)."""
        if self.pq:
            return self.scale * self.B @ self.adapter(name, "P") @ self.A
        return super().delta_weight(name)

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        if self._gated_pair():
            return self._gated(x, self._gate[0])
        return super().delta(x)

    def _mixed(self, x: torch.Tensor, active: list[tuple[str, float | torch.Tensor]], scalar: bool) -> torch.Tensor:
        if not self.pq:
            return super()._mixed(x, active, scalar)
        code = nn.functional.linear(x, self.A.detach())
        if scalar:  # one r x r product: B ((sum_a w_a P_a) z + sum_a w_a Q_a)
            p = sum(w * self.adapter(name, "P") for name, w in active)
            q = sum(w * self.adapter(name, "Q") for name, w in active)
            mixed = nn.functional.linear(code, p, q)
        else:
            mixed = sum(w * nn.functional.linear(code, self.adapter(name, "P"), self.adapter(name, "Q"))
                        for name, w in active)
        return self.scale * nn.functional.linear(mixed, self.B.detach())

    def _gated(self, x: torch.Tensor, gate: LayerGate) -> torch.Tensor:
        """The two adapters mixed by the layer's gate, ``(1 - g) h_first + g h_second``, in fewer products than the
        generic mix (the same numbers within round-off), with the gate's weights computed once per decoder layer."""
        first, second = self.adapters
        if self.pq:  # B (lerp(P_1, P_2, g) A x + lerp(Q_1, Q_2, g))
            g = gate.weight()
            p = torch.lerp(self.adapter(first, "P"), self.adapter(second, "P"), g)
            q = torch.lerp(self.adapter(first, "Q"), self.adapter(second, "Q"), g)
            mixed = nn.functional.linear(nn.functional.linear(x, self.A.detach()), p, q)
            return self.scale * nn.functional.linear(mixed, self.B.detach())
        a = torch.cat([self.adapter(first, "A"), self.adapter(second, "A")])
        b = torch.cat([self.adapter(first, "B"), self.adapter(second, "B")], dim=1)
        code = nn.functional.linear(x, a)
        return nn.functional.linear(code * gate.column_scales(self.rank, self.scale, code.dtype), b)


@dataclass(frozen=True)
class PQPlacement(Placement):
    """The engine's placement plus the 1-based decoder layers that carry PQ-LoRA."""

    pq_layers: tuple[int, ...] = ()


def attach(root: nn.Module, *, rank: int, adapters: Sequence[str], pq_blocks: int = 0, scale: float = 1.0,
           pq_scale: float = 1.0, frozen: Collection[str] = (), gate: bool = False, scope: str | None = None,
           targets: Sequence[str] = LINEAR_TARGETS, seed_of: Callable[[str], int] = lambda purpose: 0,
           pq_init: str = "zero") -> PQPlacement:
    """Replace every ``targets`` linear layer of ``root``'s decoder layers by a :class:`GatedLinear` with the named
    ``adapters``: PQ-LoRA on the layers of :func:`attachment_layers` (``pq_blocks`` > 0), conventional LoRA
    elsewhere; with ``gate``, one :class:`LayerGate` per decoder layer (``<layer>.adapter_gate``). Initial values
    depend on ``seed_of`` only (module by module), so every model built with it starts the same."""
    _, layers = named_adapters.decoder_layers(root, scope)
    pq_layers = attachment_layers(len(layers), pq_blocks) if pq_blocks else ()

    def on_layer(index: int, layer: nn.Module) -> LinearBuilder:
        layer_gate = None
        if gate:
            layer_gate = LayerGate().to(next(layer.parameters()).device)
            setattr(layer, GATE, layer_gate)
            layer.register_forward_pre_hook(layer_gate.open)
            layer.register_forward_hook(layer_gate.close)
        pq = index in pq_layers

        def build(linear: nn.Linear, generator: torch.Generator) -> GatedLinear:
            adapted = GatedLinear(linear, rank, adapters, pq=pq, frozen=frozen, generator=generator,
                                  scale=pq_scale if pq else scale, pq_init=pq_init)
            adapted.set_gate(layer_gate)
            return adapted

        return build

    placement = named_adapters.attach(root, on_layer, scope=scope, targets=targets, seed_of=seed_of)
    return PQPlacement(placement.depth, placement.modules, pq_layers)


@contextlib.contextmanager
def captured_inputs(modules: Mapping[Hashable, AdaptedLinear],
                    outputs: bool = False) -> Iterator[dict[Hashable, dict[str, torch.Tensor]]]:
    """While open, every forward through ``modules`` records each one's input ``h`` (and, with ``outputs``, its frozen
    base layer's output ``y``) of the latest forward, detached, in the yielded dict, by the module's key."""
    captured: dict[Hashable, dict[str, torch.Tensor]] = {}
    handles = []
    for key, module in modules.items():
        def hook(module, args, output, key=key):
            captured[key] = {"h": args[0].detach()}
            if outputs:
                captured[key]["y"] = module.base(args[0]).detach()

        handles.append(module.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class _HeadSkipped(Exception):
    """Raised where a forward reaches the output head that :func:`output_head_skipped` skips."""


@contextlib.contextmanager
def output_head_skipped(model: nn.Module) -> Iterator[type[Exception]]:
    """While open, a forward of the HF ``model`` stops where it would enter its output head (``lm_head``: no
    logits); it raises the yielded exception type there, which the caller catches. A model without an output head
    runs whole."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield _HeadSkipped
        return

    def stop(*_: object) -> None:
        raise _HeadSkipped

    handle = head.register_forward_pre_hook(stop)
    try:
        yield _HeadSkipped
    finally:
        handle.remove()


def mean_pool(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(batch, tokens, d) values averaged over the tokens ``mask`` (batch, tokens) keeps."""
    keep = mask.to(values.dtype).unsqueeze(-1)
    return (values * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)


# Cross-model alignment of the PQ basis (Alg. 2-4; docs/fedmosaic.md#cross-model-alignment) ---------------------
def align_rows(inputs: torch.Tensor, targets: torch.Tensor, start: torch.Tensor, *, ortho_weight: float, epochs: int,
               lr: float, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """Train ``A`` (r x d, from ``start``) so that ``inputs @ A^T`` (n x d -> n x r) matches ``targets`` (n x r): Adam
    with a cosine schedule over ``epochs`` seeded passes of ``batch_size`` rows, on the mean squared L2 distance
    per row plus ``ortho_weight * ||A A^T - I_r||_F^2`` (Eq. 20); then the nearest matrix with orthonormal rows
    (Eq. 21-23). Returns it and the L2 term before and after."""
    a = start.detach().clone().float().requires_grad_(True)
    inputs, targets = inputs.float(), targets.float()
    eye = torch.eye(a.shape[0])
    rows = len(inputs)
    steps = max(1, epochs * math.ceil(rows / batch_size))
    optimizer = torch.optim.Adam([a], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def l2(matrix: torch.Tensor) -> float:
        return float(((inputs @ matrix.T - targets) ** 2).sum(dim=1).mean())

    before = l2(a.detach())
    step = 0
    for _ in range(epochs):
        order = torch.randperm(rows, generator=generator)
        for first in range(0, rows, batch_size):
            batch = order[first:first + batch_size]
            loss = ((inputs[batch] @ a.T - targets[batch]) ** 2).sum(dim=1).mean()
            loss = loss + ortho_weight * ((a @ a.T - eye) ** 2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
    aligned = nearest_orthonormal_rows(a.detach())
    return aligned, {"l2_before": before, "l2_trained": l2(a.detach()), "l2_after": l2(aligned)}


def _inverse_sqrt(matrix: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    return vectors @ torch.diag(values.clamp_min(1e-12).rsqrt()) @ vectors.T


def cca_projections(pivot: torch.Tensor, other: torch.Tensor, rank: int,
                    ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ridge-regularized CCA of paired features ``pivot`` (m x d_p) and ``other`` (m x d_o): the top-``rank``
    canonical projections ``Pi_p`` (d_p x rank) and ``Pi_o`` (d_o x rank), with ``pivot Pi_p ~ other Pi_o``, and the
    canonical correlations. ``ridge`` is relative: ``ridge * trace(C) / d`` is added to each covariance ``C``.

    With fewer samples than features (a paper-size model's 8,192-wide layers, a few thousand public rows), the same
    projections come from the samples' span (:func:`_cca_in_sample_span`), without a d x d covariance."""
    p = (pivot - pivot.mean(0)).double()
    o = (other - other.mean(0)).double()
    if rank <= len(p) < max(p.shape[1], o.shape[1]):
        projections = _cca_in_sample_span(p, o, rank, ridge)
    else:
        projections = _cca_of_covariances(p, o, rank, ridge)
    return tuple(tensor.float() for tensor in projections)


def _cca_of_covariances(p: torch.Tensor, o: torch.Tensor, rank: int,
                        ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = len(p)

    def covariance(x: torch.Tensor) -> torch.Tensor:
        c = x.T @ x / m
        return c + ridge * max(float(torch.trace(c)) / len(c), 1e-12) * torch.eye(len(c), dtype=c.dtype)

    whiten_p, whiten_o = _inverse_sqrt(covariance(p)), _inverse_sqrt(covariance(o))
    u, s, vh = torch.linalg.svd(whiten_p @ (p.T @ o / m) @ whiten_o, full_matrices=False)
    return whiten_p @ u[:, :rank], whiten_o @ vh[:rank].T, s[:rank]


def _cca_in_sample_span(p: torch.Tensor, o: torch.Tensor, rank: int,
                        ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CCA of centred ``p`` and ``o`` through their thin SVDs ``x = U S V^T``: the covariance plus its ridge is
    ``V diag(S^2 / m + lam) V^T`` on the span of ``V`` and ``lam`` off it, and the cross-covariance lies in the spans,
    so the whitened cross-covariance is ``V_p K V_o^T`` with the small ``K`` below, and the projections are
    ``V diag((S^2 / m + lam)^-1/2)`` times ``K``'s singular vectors."""
    m = len(p)

    def span(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        variances = s**2 / m
        scales = (variances + ridge * max(float(variances.sum()) / x.shape[1], 1e-12)).clamp_min(1e-12).rsqrt()
        return u * (s * scales), vh.T, scales

    scaled_p, basis_p, scales_p = span(p)
    scaled_o, basis_o, scales_o = span(o)
    u, s, vh = torch.linalg.svd(scaled_p.T @ scaled_o / m, full_matrices=False)
    return (basis_p * scales_p) @ u[:, :rank], (basis_o * scales_o) @ vh[:rank].T, s[:rank]


def cca_basis(pivot_features: torch.Tensor, other_features: torch.Tensor, pivot_b: torch.Tensor,
              ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """The other model's ``B`` from the pivot's (Alg. 4): ``B_o = (Pi_o^+)^T Pi_p^T B_p`` with the CCA projections of
    the paired output features, so that ``Pi_o^T B_o = Pi_p^T B_p`` (the same r-dim code has the same canonical
    coordinates in both models). Returns it and the canonical correlations."""
    rank = pivot_b.shape[1]
    pi_p, pi_o, correlations = cca_projections(pivot_features, other_features, rank, ridge)
    other_b = torch.linalg.pinv(pi_o.double()).T @ (pi_p.double().T @ pivot_b.double())
    return other_b.float().contiguous(), correlations


def pq_tensor_blocks(names: Sequence[str]) -> dict[str, int]:
    """Each of one architecture's P and Q tensors by its block: the rank of its layer among the PQ layers."""
    pq = [name for name in names if is_pq(name)]
    layers = sorted({layer_of(name) for name in pq})
    return {name: layers.index(layer_of(name)) for name in pq}


def pq_key(block: int, name: str) -> str:
    """The key that matches a P or Q tensor across architectures: its block, module and part."""
    tensor = adapter_tensor(name)
    return f"pq/{block}/{tensor.module}/{tensor.part}"


def pq_groups(names: Sequence[str]) -> dict[str, str]:
    """The tensors of one architecture that mix across architectures: P and Q, matched by block, module and part."""
    return {name: pq_key(block, name) for name, block in pq_tensor_blocks(names).items()}
