"""The dry run's depth extrapolation: a deep model's step from two short stacks of its layers.

A dry run's cost is the number of fake operations, which grows with the number of decoder layers
and hardly with the sequence length (a 70B model's 80 layers take 20-40 s whatever the length). Its
memory is affine in the number of layers, phase by phase: every decoder layer of a dense model
holds the same weights, adapter, saved input (or activations, without checkpointing) and gradients,
so

- after load and before the step: a + b * layers;
- in the forward (up to the loss): a + b * layers;
- in backward, while the k-th layer from the top is processed: a + b * layers + c * k (the inputs
  still saved shrink, the adapter's gradients grow): its largest value is at the first or at the
  last layer processed, each affine in the number of layers;
- after the layers (the optimizer's step, the next step's forward): a + b * layers.

So the step is run on a few short stacks (``depth_plan``): a base of the model's bottom and top
layer types with every other type once between them (two layers for a model of one type; Gemma 3's
sliding-window and global layers give two or three), and the base with one more layer of each type;
the tracker's peak is read in each phase (``TrackerMeter.mark``: a mark as each backward starts and
as each decoder layer's input receives its gradient), and each phase's peak is extrapolated to the
model's depth; the step's peak is the largest. The largest of the first and last layer's windows
bounds every layer between them only if the layers are alike: a sample whose middle layers peak
higher, or whose phases differ between the stacks, is refused (``extrapolate`` returns None)
and the dry run runs every layer. A config whose layers differ other than by their type (a
per-layer list, dense layers among mixture-of-experts ones) is never extrapolated (``depth_plan``
returns None). A mixture of experts whose every decoder layer is sparse (Qwen3-MoE, Mixtral,
gpt-oss) is as alike, layer by layer, as a dense model: the same experts, router and adapter in
each, and under the dry run's fixed routing the same routed activations
(``tests/test_moe.py`` checks the extrapolation against every layer run).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .meters import MIB, TrackerMeter

#: Config fields that make decoder layers differ from each other, each with the value that leaves
#: them alike (None: any value set makes them differ); such a config runs every layer.
UNLIKE_LAYERS = {"first_k_dense_replace": 0, "moe_layer_freq": 1, "mlp_only_layers": None,
                 "decoder_sparse_step": 1, "layer_scheme": None, "block_configs": None}


def _unlike_layers(config) -> bool:
    """Whether the config's decoder layers differ other than by their type."""
    for name, alike in UNLIKE_LAYERS.items():
        value = getattr(config, name, None)
        if value not in (None, alike) and not (alike is None and value in ([], ())):
            return True
    return False


@dataclass(frozen=True)
class DepthPlan:
    """The short stacks a deep model's dry run is extrapolated from: a base stack (the model's
    bottom and top layer types, and every other type once between them) and, per layer type, the
    base with one more layer of that type; ``counts`` are the model's layers of each type."""

    types: tuple[str, ...]
    base: tuple[str, ...]
    counts: dict

    @property
    def layers(self) -> int:
        return len(self.types)

    def stacks(self) -> list[tuple[str, ...]]:
        """The base, then one stack per type (a layer of it added just above the bottom one)."""
        kinds = sorted(set(self.types), key=self.types.index)
        return [self.base] + [self.base[:1] + (kind,) + self.base[1:] for kind in kinds]


def depth_plan(config) -> Optional[DepthPlan]:
    """How to extrapolate this config's dry run, or None when every layer must run: layers that
    differ other than by a layer type, or a stack too shallow to save time."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or _unlike_layers(config):
        return None
    for name, value in vars(config).items():  # a per-layer list (sizes, heads) other than the types
        if name != "layer_types" and isinstance(value, (list, tuple)) and len(value) == depth and depth > 3:
            return None
    types = tuple(getattr(config, "layer_types", None) or ("decoder",) * depth)
    if len(types) != depth:
        return None
    kinds = sorted(set(types), key=types.index)
    middle = tuple(k for k in kinds if k not in (types[0], types[-1]))
    base = (types[0],) + middle + (types[-1],)
    plan = DepthPlan(types=types, base=base, counts={k: types.count(k) for k in kinds})
    cost = sum(len(stack) for stack in plan.stacks())
    return plan if cost < depth else None


#: What one fake step costs beside its decoder layers (the model built and adapted, the
#: embeddings, the head and the loss, the optimizer), in layers: llama-3.1-8b's 32 layers at 1,024
#: tokens ran in 19.9 s, its stacks of 2, 3, 4 and 5 layers in 19.0 s (about 0.5 s a layer and 3 s
#: a run, on this project's 2-core CPU).
RUN_LAYERS = 6


def trace_stacks(config, always: bool = False) -> Optional[tuple[list[tuple[str, ...]], int]]:
    """The four short stacks an allocation trace is extended from (``probe_kit.trace_depth``),
    and how many periods the model has over the first: the model's bottom ``m``, ``m + p``,
    ``m + 2p`` and ``m + 3p`` layers, ``p`` the period of its layer types (1 for one type) and
    ``m`` its depth modulo ``p`` (three at the least: a stack of two differs in more than its
    layers, as the bottom layer's neighbour is the top one), so each stack ends with the model's
    top layer type. None when the layers differ other than by a repeating type, or when the stacks would
    run as many layers as the model has."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 2 or _unlike_layers(config):
        return None
    for name, value in vars(config).items():  # a per-layer list (sizes, heads) other than the types
        if name != "layer_types" and isinstance(value, (list, tuple)) and len(value) == depth:
            return None
    types = tuple(getattr(config, "layer_types", None) or ("decoder",) * depth)
    if len(types) != depth:
        return None
    period = next(p for p in range(1, depth + 1) if all(types[i] == types[i - p] for i in range(p, depth)))
    m = depth % period
    while m < 2:
        m += period
    stacks = [types[:m + j * period] for j in range(4)]
    if not always and sum(map(len, stacks)) + 3 * RUN_LAYERS >= depth:
        return None
    return stacks, (depth - m) // period


def with_layers(config, types: tuple[str, ...]):
    """A copy of the config with these decoder layers (``layer_types`` only where it had them)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = len(types)
    if getattr(config, "layer_types", None):
        out.layer_types = list(types)
    return out


def decoder_layers(model: torch.nn.Module, depth: int) -> Optional[torch.nn.ModuleList]:
    """The model's list of decoder layers: the ModuleList of ``depth`` modules named ``layers``."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth and name.split(".")[-1] == "layers":
            return module
    return None


@contextlib.contextmanager
def phase_marks(model: torch.nn.Module, depth: int, meter: TrackerMeter) -> Iterator[Optional[object]]:
    """Marks the step's phases on ``meter`` (see the module docstring). Yields the context every
    backward runs in (``train_step(backward_context=...)``), or None when the model has no list of
    ``depth`` decoder layers."""
    layers = decoder_layers(model, depth)
    if layers is None:
        yield None
        return
    state = {"backward": False}
    handles = []

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            if state["backward"]:  # the recomputed forward of a checkpointed layer
                return
            h = args[0] if args else kwargs.get("hidden_states")
            if isinstance(h, torch.Tensor) and h.requires_grad:
                h.register_hook(lambda grad: meter.mark(index))
            elif index == 0 and not state.get("params"):
                # The bottom layer's input needs no gradient (the embeddings are frozen and
                # nothing asked for their output's): its backward ends with its adapter's
                # gradients, each marking as it is accumulated.
                state["params"] = True
                handles.extend(p.register_post_accumulate_grad_hook(lambda p: meter.mark(0))
                               for p in module.parameters() if p.requires_grad)
        return hook

    @contextlib.contextmanager
    def backward():
        meter.mark("forward")
        state["backward"] = True
        try:
            yield
        finally:
            state["backward"] = False

    handles += [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield backward
    finally:
        for h in handles:
            h.remove()


def phase_peaks(windows: list[tuple[object, int]], peak_bytes: int) -> Optional[dict[tuple, int]]:
    """Each phase's peak bytes, keyed by (phase, step from 1): the forward, the first and the last
    layer processed in backward, and what follows the layers up to the next mark (the optimizer's
    step up to ``warmed``, the end). None when no layer was marked, or when a middle layer peaked
    above both the first and the last of its backward: in a short stack the middle layers sit next
    to the ends, so a deeper one's middle peaks lie further below them (the levels through
    backward are linear in the layer's position), and only such a stack can say the layers are
    alike enough."""
    indices = [label for label, _ in windows if isinstance(label, int)]
    if not indices:
        return None
    top, bottom = max(indices), min(indices)
    out: dict[tuple, int] = {}
    middle: dict[int, int] = {}
    steps = 0
    previous: object = None
    for label, peak in windows:
        previous, before = label, previous
        if label == "forward":
            steps += 1
            key = ("forward", steps)
        elif label == top:
            key = ("first layer", steps)
        elif label == bottom:
            # one window, or several closed by the bottom layer's gradients as they accumulate
            key = ("last layer", steps)
            if key in out and before == bottom:
                out[key] = max(out[key], peak)
                continue
        elif isinstance(label, int):
            middle[steps] = max(middle.get(steps, 0), peak)
            continue
        else:
            key = (str(label), steps)
        if key in out:
            return None
        out[key] = peak
    for step, peak in middle.items():
        if peak > max(out.get(("first layer", step), 0), out.get(("last layer", step), 0)):
            return None
    if max(out.values()) != peak_bytes:
        return None
    return out


def extrapolate(plan: DepthPlan, samples: list[dict]) -> Optional[dict]:
    """The dry run of the whole depth from the plan's stacks (``_fake_step``'s figures, each with
    its ``phases``): every figure is the base stack's plus, per layer type, the model's extra
    layers of that type times what one more layer of it added. None when a sample's phases were
    refused or differ from the base's."""
    base, extra = samples[0], samples[1:]
    kinds = sorted(plan.counts, key=plan.types.index)
    if any(s["phases"] is None or set(s["phases"]) != set(base["phases"]) for s in samples):
        return None
    more = {k: plan.counts[k] - plan.base.count(k) for k in kinds}

    def at(get) -> float:
        return get(base) + sum(more[k] * (get(s) - get(base)) for k, s in zip(kinds, extra))

    phases = {key: at(lambda s, key=key: s["phases"][key]) for key in base["phases"]}
    peak_key = max(phases, key=phases.get)
    return {"after_load_mib": at(lambda s: s["after_load_mib"]), "pre_step_mib": at(lambda s: s["pre_step_mib"]),
            "peak_mib": phases[peak_key] / MIB, "host_peak_mib": at(lambda s: s.get("host_peak_mib", 0.0)),
            "depth": {"method": "extrapolated", "layers": plan.layers,
                      "from_layers": [len(stack) for stack in plan.stacks()],
                      "peak_phase": f"{peak_key[0]}, step {peak_key[1]}" if peak_key[1] else peak_key[0]}}
