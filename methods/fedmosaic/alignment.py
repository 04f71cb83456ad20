"""FedMosaic's cross-model alignment of the PQ basis before round 1 (Alg. 2-4, Eq. 20;
docs/fedmosaic.md#cross-model-alignment): each architecture's public-data features, pooled on its actor, and the
server's alignment of every non-pivot architecture's ``A`` (trained, then orthonormal) and ``B`` (ridge CCA) to the
pivot's. The linear algebra is :mod:`rayfed.methods.fedmosaic.pqlora`'s.

An architecture's features are a tree (:mod:`rayfed.state_tree`): ``{"pq": {block: {module: {"h", "A", "B"[, "y"]}}},
"backbone_params"}``, ``block`` the rank of the PQ layer among them, ``module`` the linear layer's name in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rayfed import seeding
from rayfed.architectures import prefixed, unprefixed
from rayfed.errors import ConfigError
from rayfed.method import TensorDict
from rayfed.methods.fedmosaic import pqlora
from rayfed.models.peft.named_adapters import adapted_modules, adapters_off
from rayfed.param_names import adapter_part, adapter_tensor, parent
from rayfed.training import PreFederation, mixed_precision

if TYPE_CHECKING:
    from rayfed.methods.fedmosaic.params import FedMosaicParams


def public_features(stage: PreFederation, params: FedMosaicParams) -> dict[str, Any]:
    """An architecture's public-data features for the alignment: the inputs ``h`` (and, for ``b_features:
    base_output``, outputs ``y``) of its PQ layers, mean-pooled per sequence, its bases A and B, its backbone's
    size."""
    model = stage.model
    model.load_trainable(stage.initial)
    placement = model.attachments[pqlora.PQPlacement]
    block_of = {layer: k for k, layer in enumerate(placement.pq_layers)}
    modules = dict(adapted_modules(model.encoder))
    pq_modules = {}
    for qualified, layer, _ in placement.modules:
        if layer in block_of:
            module_name = qualified.split(f".{layer - 1}.", 1)[1]
            pq_modules[str(block_of[layer]), module_name] = modules[qualified]
    rows = len(next(iter(stage.public.values())))
    rows = min(rows, params.align_samples or rows)
    batch_size = stage.train_config.eval_batch_size
    pooled: dict[tuple[str, str], dict[str, list[torch.Tensor]]] = {key: {} for key in pq_modules}
    outputs = params.b_features == "base_output"
    task = stage.public_task
    # batches of eval_batch_size on the actor's device, pooled there (one copy to the host at the end), the forward
    # stopped before the output head: only the PQ layers' inputs are needed (a paper-size LM's head is 128k wide); in
    # the steps' precision, which the frozen weights may be stored in (rayfed.models.frozen_weights)
    precision = mixed_precision(stage.device, stage.train_config.autocast)
    with torch.no_grad(), precision, adapters_off(model), pqlora.captured_inputs(pq_modules, outputs) as captured, \
            pqlora.output_head_skipped(model.encoder) as skipped:
        for first in range(0, rows, batch_size):
            batch = {name: column[first:first + batch_size].to(stage.device) for name, column in stage.public.items()}
            try:
                task.kind.forward(model, batch)
            except skipped:
                pass
            for key, values in captured.items():
                for what, value in values.items():
                    pooled[key].setdefault(what, []).append(pqlora.mean_pool(value, batch["attention_mask"]))
    features: dict[str, dict[str, dict[str, TensorDict]]] = {}
    for (block, module_name), module in pq_modules.items():
        # float32 as A and B are: a GPU's forward (bf16 weights, autocast) pools bf16 features
        entry = {what: torch.cat(values).cpu().float() for what, values in pooled[block, module_name].items()}
        entry.update(A=module.A.detach().cpu(), B=module.B.detach().cpu())
        features.setdefault(block, {})[module_name] = entry
    frozen = sum(p.numel() for p in model.encoder.parameters() if not p.requires_grad)
    return {"pq": features, "backbone_params": torch.tensor(float(frozen), dtype=torch.float64)}


def aligned_basis(layout: TensorDict, prepared: dict[str, dict[str, Any]], pivot: str,
                  params: FedMosaicParams) -> tuple[TensorDict, dict[str, Any]]:
    """Each non-pivot architecture's PQ basis aligned to the pivot's (Eq. 20, then ridge CCA for B, Alg. 4), under the
    server's names, and the alignment's losses and correlations by architecture, block and module."""
    aligned: TensorDict = {}
    report: dict[str, Any] = {}
    reference = prepared[pivot]["pq"]
    generator = torch.Generator().manual_seed(seeding.torch_seed(0, 0, seeding.SERVER, "fedmosaic:align"))
    for arch, tensors in sorted(prepared.items()):
        if arch == pivot:
            continue
        own = tensors["pq"]
        for block, module in sorted((block, module) for block, by_module in own.items() for module in by_module):
            if module not in reference.get(block, {}):
                raise ConfigError(f"methods (fedmosaic): architecture {arch!r} has PQ module {module!r} in block "
                                  f"{block} but the pivot {pivot!r} does not; architectures must share their linear "
                                  "layer names.")
            pivot_pq, other_pq = reference[block][module], own[block][module]
            pivot_h, pivot_a, pivot_b = pivot_pq["h"], pivot_pq["A"], pivot_pq["B"]
            other_h, other_a, other_b = other_pq["h"], other_pq["A"], other_pq["B"]
            if len(pivot_h) != len(other_h):
                raise ConfigError("methods (fedmosaic): the architectures saw different numbers of public samples.")
            new_a, losses = pqlora.align_rows(
                other_h, pivot_h @ pivot_a.T, other_a, ortho_weight=params.align_lambda,
                epochs=params.align_epochs, lr=params.align_lr, batch_size=params.align_batch_size,
                generator=generator)
            new_b = other_b
            stats = report.setdefault(arch, {}).setdefault(block, {}).setdefault(module, {})
            if params.align_b:
                if params.b_features == "base_output":
                    pivot_y, other_y = pivot_pq["y"], other_pq["y"]
                else:  # the B-branch output with P = I
                    pivot_y, other_y = (pivot_h @ pivot_a.T) @ pivot_b.T, (other_h @ new_a.T) @ other_b.T
                new_b, correlations = pqlora.cca_basis(pivot_y, other_y, pivot_b, params.cca_ridge)
                if params.ortho_b_after_cca:
                    new_b = pqlora.nearest_orthonormal_columns(new_b)
                stats["cca_mean_correlation"] = correlations.mean()
            stem = pq_stem(layout, arch, int(block), module)
            aligned.update(prefixed({f"{stem}.A": new_a, f"{stem}.B": new_b}, arch))
            stats.update({name: torch.tensor(value) for name, value in losses.items()})
    return aligned, report


def pq_stem(layout: TensorDict, arch: str, block: int, module: str) -> str:
    """The name, without ``.local_P``, of ``arch``'s PQ module ``module`` of block ``block``."""
    for name, layer_block in unprefixed(layout, arch).items():
        if adapter_part(name) == (pqlora.LOCAL, "P") and int(layer_block) == block and \
                adapter_tensor(name).module == module:
            return parent(name)
    raise KeyError(f"{arch}: no PQ module {module} in block {block}")
