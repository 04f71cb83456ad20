"""`rayfed bench --workload <paper> --profile`: where one steady local update's time goes, from torch.profiler.

One client's local update (the first client of a round's first architecture, as the bench's FLOP count takes) runs
once as a warm-up and once under the profiler, from the same state (kept aside and restored, so the bench's rounds
are untouched). The breakdown (``profile.json``, ``profile.md``):

* CUDA time by kernel family (:func:`kernel_family`): each kernel's and copy's device time, summed per family;
  the busy time (the union of their intervals) against the update's wall time gives the GPU's idle fraction;
* the host: the CPU ops' self time (the dispatcher and the ops' host code), the time between ops (Python), and
  the CUDA runtime's calls; on a CPU the ops' self time by the same families;
* host phases of the engine, each timed by a profiler range the profile wraps around its function while it runs
  (:data:`HOST_PHASES`: building the batches, the payloads and states moved to the device, the uploads to the host);
* copies by direction (H2D / D2H / D2D, memsets) and waits (the host blocked on the GPU: stream, device and event
  synchronizations, blocking copies).
A chrome trace (large) is written only when asked (``--profile-trace``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table

FAMILIES = ("gemm", "attention", "elementwise", "normalization", "reduction", "copy", "optimizer", "other")

# (family, pattern on the lower-cased kernel or op name); the first match wins. Copies and the optimizer's kernels
# come first (a cast is an elementwise kernel running a copy; the optimizer's foreach kernels hold "norm" and
# "add"), attention before the matrix products (flash and memory-efficient attention are CUTLASS kernels).
_FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("copy", r"^memcpy|^memset|copy_kernel|direct_copy|catarraybatchedcopy|aten::(_to_copy|copy_|to|contiguous|"
             r"clone|cat)$"),
    ("optimizer", r"multi_tensor_apply|fused_?adam|fused_?sgd|aten::_foreach_|aten::_fused_"),
    ("attention", r"flash|fmha|attention|sdpa|softmax|mha_|_attn"),
    ("gemm", r"gemm|xmma|cutlass|s16816|s1688|matmul|gemv|cublas|nvjet|implicit_convolve|conv2d|convolution|"
             r"aten::(mm|addmm|bmm|baddbmm|linear)$"),
    ("normalization", r"layer_?norm|rms_?norm|batch_?norm|group_?norm|instance_?norm|gammabetabackward|"
                      r"cuapplylayernorm|cucomputegradgammabeta|cucomputepartgradgammabeta"),
    ("reduction", r"reduce|cub::|devicereduce|nll_loss|cross_entropy|triton_(red|per)_|aten::(sum|mean|max|min|"
                  r"amax|argmax|norm|std|var)$"),
    ("elementwise", r"elementwise|triton_poi_|gelu|relu|silu|swish|tanh|sigmoid|dropout|fill|aten::(add|sub|mul|"
                    r"div|neg|exp|log|pow|rsqrt|sqrt|where|clamp|masked_fill|abs|erf)_?$"),
)


def kernel_family(name: str) -> str:
    """The family (one of :data:`FAMILIES`) of a CUDA kernel, a CUDA copy or a CPU op, by its profiler name."""
    lowered = name.lower()
    for family, pattern in _FAMILY_PATTERNS:
        if re.search(pattern, lowered):
            return family
    return "other"


# Engine functions whose time on the host the profile reports, as "module:attribute path"; one that a later
# version of the engine renames is reported as missing, not silently skipped.
HOST_PHASES: dict[str, tuple[str, ...]] = {
    "batch building": ("rayfed.training.client_context:ClientContext.batch_order",
                       "rayfed.training.client_context:ClientContext.micro_batch"),
    "payloads and states to the device": ("rayfed.actors.client:ClientActor._on_device",
                                          "rayfed.actors.hosted:states_to"),
    "uploads to the host": ("rayfed.actors.client:to_host",),
}
# The host blocked on the GPU; aten::_local_scalar_dense is a read of a GPU value (``.item()``), a sync inside.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense")
COPY_KINDS = {"h2d": r"htod", "d2h": r"dtoh", "d2d": r"dtod", "memset": r"^memset"}


@dataclass(frozen=True)
class TraceEvent:
    """What the breakdown reads of one profiler event: times in microseconds from the trace's start; ``self_us``
    the CPU time outside the event's child ops (CPU events)."""

    name: str
    on_gpu: bool
    start_us: float
    end_us: float
    self_us: float = 0.0
    annotation: bool = False

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``intervals`` (overlaps counted once)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def _by_family(events: list[TraceEvent], seconds: Callable[[TraceEvent], float]) -> dict[str, dict[str, float]]:
    total = sum(seconds(e) for e in events) or 1.0
    families = {family: {"s": 0.0, "count": 0, "share": 0.0} for family in FAMILIES}
    for event in events:
        family = families[kernel_family(event.name)]
        family["s"] += seconds(event)
        family["count"] += 1
    for family in families.values():
        family["share"] = family["s"] / total
    return families


def _top(events: list[TraceEvent], seconds: Callable[[TraceEvent], float], count: int = 15) -> list[dict[str, Any]]:
    totals: dict[str, list[float]] = {}
    for event in events:
        totals.setdefault(event.name, [0.0, 0])
        totals[event.name][0] += seconds(event)
        totals[event.name][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [{"name": name[:200], "family": kernel_family(name), "s": s, "count": int(n)} for name, (s, n) in ranked]


def breakdown(events: list[TraceEvent], wall_s: float, phases: dict[str, float]) -> dict[str, Any]:
    """The profile's breakdown of ``events`` (one local update of ``wall_s`` seconds; ``phases``: the host phases'
    seconds) as the module's docstring lists it."""
    gpu = [e for e in events if e.on_gpu and not e.annotation]
    runtime, ops = [], []
    for event in events:
        if not event.on_gpu and not event.annotation:
            is_runtime = event.name.startswith("cu") and not event.name.startswith("cudnn")
            (runtime if is_runtime else ops).append(event)
    busy_s = union_us([(e.start_us, e.end_us) for e in gpu]) / 1e6
    in_ops_s = union_us([(e.start_us, e.end_us) for e in ops]) / 1e6
    result: dict[str, Any] = {
        "wall_s": wall_s,
        "host": {"ops_self_s": sum(e.self_us for e in ops) / 1e6, "in_ops_s": in_ops_s,
                 "between_ops_s": max(wall_s - in_ops_s, 0.0), "cuda_runtime_s": sum(e.us for e in runtime) / 1e6,
                 "phases_s": phases},
        "waits": {name: {"s": sum(e.us for e in runtime + ops if e.name == name) / 1e6,
                         "count": sum(e.name == name for e in runtime + ops)} for name in WAITS},
    }
    if gpu:
        result["cuda"] = {"busy_s": busy_s, "kernel_s": sum(e.us for e in gpu) / 1e6,
                          "idle_fraction": max(1.0 - busy_s / wall_s, 0.0) if wall_s > 0 else None,
                          "families": _by_family(gpu, lambda e: e.us / 1e6), "top": _top(gpu, lambda e: e.us / 1e6)}
        result["copies"] = {kind: {"s": sum(e.us for e in gpu if re.search(p, e.name.lower())) / 1e6,
                                   "count": sum(bool(re.search(p, e.name.lower())) for e in gpu)}
                            for kind, p in COPY_KINDS.items()}
    else:
        result["cpu_families"] = _by_family(ops, lambda e: e.self_us / 1e6)
        result["top_ops"] = _top(ops, lambda e: e.self_us / 1e6)
    return result


def _resolve(target: str) -> tuple[Any, str, Any] | None:
    module_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
    if owner is None or not callable(getattr(owner, attribute, None)):
        return None
    return owner, attribute, owner.__dict__.get(attribute, getattr(owner, attribute))


@contextlib.contextmanager
def host_phase_ranges(phases: dict[str, tuple[str, ...]]) -> Iterator[list[str]]:
    """Each function of ``phases`` wrapped in a profiler range named after its phase while the block runs; yields
    the targets not found (renamed or gone)."""
    missing, patched = [], []
    for phase, targets in phases.items():
        for target in targets:
            found = _resolve(target)
            if found is None:
                missing.append(target)
                continue
            owner, attribute, original = found
            function = getattr(owner, attribute)

            def ranged(*args: Any, _function: Callable = function, _phase: str = phase, **kwargs: Any) -> Any:
                with record_function(f"rayfed phase: {_phase}"):
                    return _function(*args, **kwargs)

            setattr(owner, attribute, functools.wraps(function)(ranged))
            patched.append((owner, attribute, original))
    try:
        yield missing
    finally:
        for owner, attribute, original in reversed(patched):
            setattr(owner, attribute, original)


def trace_events(prof: profile) -> list[TraceEvent]:
    """The profiler's events as :class:`TraceEvent` (kernels, copies and memsets on the GPU; ops, annotations and
    CUDA runtime calls on the host)."""
    events = []
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        events.append(TraceEvent(
            event.name, on_gpu, event.time_range.start, event.time_range.end,
            0.0 if on_gpu else event.self_cpu_time_total,
            annotation=bool(getattr(event, "is_user_annotation", False))
            or "annotation" in str(getattr(event, "activity_type", ""))
            or event.name.startswith(("rayfed phase:", "ProfilerStep"))))
    return events


def phase_seconds(events: list[TraceEvent]) -> dict[str, float]:
    """Seconds of each host phase's ranges (:func:`host_phase_ranges`) on the host (the profiler mirrors a range on
    the GPU's timeline too), nested calls counted once."""
    ranges: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        if not event.on_gpu and event.name.startswith("rayfed phase: "):
            ranges.setdefault(event.name.removeprefix("rayfed phase: "), []).append((event.start_us, event.end_us))
    return {phase: union_us(spans) / 1e6 for phase, spans in ranges.items()}


def profile_local_update(run_update: Callable[[], Any], out_dir: Path, trace: bool = False,
                         device: torch.device | None = None) -> dict[str, Any]:
    """Profile ``run_update`` (a steady local update, already warmed up by the caller) and write ``profile.json``
    and ``profile.md`` into ``out_dir`` (and ``trace.json``, chrome's format, with ``trace``)."""
    cuda = device is not None and device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    out_dir.mkdir(parents=True, exist_ok=True)
    with host_phase_ranges(HOST_PHASES) as missing, profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run_update()
        if cuda:
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - started
    events = trace_events(prof)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "CPU", "torch": torch.__version__,
              **breakdown(events, wall_s, phase_seconds(events)), "missing_phases": missing}
    if trace:
        prof.export_chrome_trace(str(out_dir / "trace.json"))
        result["trace"] = "trace.json"
    atomic_write_json(out_dir / "profile.json", result)
    atomic_write_text(out_dir / "profile.md", profile_markdown(result))
    return result


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def profile_markdown(result: dict[str, Any], title: str = "") -> str:
    """profile.md: the families' table, the host's and the GPU's time, phases, copies, waits, the top kernels."""
    host, cuda = result["host"], result.get("cuda")
    families = cuda["families"] if cuda else result["cpu_families"]
    what = "CUDA time" if cuda else "CPU ops' self time (no GPU)"
    lines = [f"{title}One steady local update on {result['device']} (torch {result['torch']}): "
             f"{_ms(result['wall_s'])} ms wall.\n",
             format_table([[family, _ms(v["s"]), f"{100 * v['share']:.1f}%", str(v["count"])]
                           for family, v in families.items() if v["count"]],
                          ["family", f"{what} ms", "share", "kernels" if cuda else "ops"])]
    if cuda:
        lines.append(f"\nGPU busy {_ms(cuda['busy_s'])} ms of {_ms(result['wall_s'])} ms: idle "
                     f"{100 * cuda['idle_fraction']:.1f}% (kernels summed {_ms(cuda['kernel_s'])} ms).")
    lines.append(f"\nHost: ops' self time {_ms(host['ops_self_s'])} ms, inside ops {_ms(host['in_ops_s'])} ms, "
                 f"between ops (Python) {_ms(host['between_ops_s'])} ms, CUDA runtime calls "
                 f"{_ms(host['cuda_runtime_s'])} ms.")
    phases = ", ".join(f"{phase} {_ms(s)} ms" for phase, s in host["phases_s"].items()) or "none ran"
    missing = result["missing_phases"]
    lines.append(f"\nHost phases: {phases}." + (f" Not found (renamed?): {', '.join(missing)}." if missing else ""))
    if cuda:
        lines.append("\nCopies: " + ", ".join(f"{kind} {_ms(v['s'])} ms ({v['count']})"
                                              for kind, v in result["copies"].items()) + ".")
    lines.append("\nWaits (host blocked on the GPU): " + ", ".join(
        f"{name} {_ms(v['s'])} ms ({v['count']})" for name, v in result["waits"].items()) + ".\n")
    top = cuda["top"] if cuda else result["top_ops"]
    lines.append(format_table([[t["name"][:100].replace("|", "/"), t["family"], _ms(t["s"]), str(t["count"])]
                               for t in top], ["kernel" if cuda else "op", "family", "ms", "calls"]))
    return "\n".join(lines)
