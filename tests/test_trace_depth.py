"""The allocation trace at a model's whole depth from four short stacks (``probe_kit.trace_depth``):
event for event the trace of every layer run (two families); what is not periodic is refused, and the
dry run then runs every layer."""

from __future__ import annotations

import pytest

from probe_kit.allocator import RESET_PEAK, replay
from probe_kit.trace_depth import whole_depth
from test_depth import deeper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name, layers, recipe", [
    ("tiny-llama", 9, dict(quant="4bit", rank=16, optimizer="adamw_torch")),
    ("tiny-qwen2", 8, dict(quant="bf16", rank=8)),
])
def test_four_short_stacks_give_every_layers_trace_event_for_event(tmp_path, name, layers, recipe):
    from probe_kit.depth import trace_stacks, with_layers
    from probe_kit.dry_run import CUBLAS_WORKSPACE_MIB, _traced_step, allocation_trace
    from probe_kit.recipe import ProbeConfig, load_config

    cfg = ProbeConfig(model=deeper(tmp_path, name, layers), random_weights=True, seq_len=128,
                      response_len=16, fixes=[], **recipe)
    config = load_config(cfg.model)
    stacks, periods = trace_stacks(config, always=True)
    assert [len(s) for s in stacks] == [2, 3, 4, 5] and periods == layers - 2
    assert trace_stacks(config) is None  # so shallow a model runs every layer: cheaper than four stacks
    short = [_traced_step(cfg, with_layers(config, s), CUBLAS_WORKSPACE_MIB)[0] for s in stacks]
    extended, how = whole_depth(short, periods)
    full, raw = allocation_trace(cfg)
    assert raw["depth"]["method"] == "every layer"
    assert extended == full, how
    assert replay(extended).peak_reserved == replay(full).peak_reserved


def test_what_is_not_periodic_is_refused():
    a, b = 1024, 4096
    # The stacks' traces: a layer's two allocations each time, freed in the step, then one more.
    def stack(layers: int, odd: int = 0) -> list[int]:
        trace = [a] * layers + [RESET_PEAK]
        trace += [b + odd] + [-(i + 1) for i in range(layers)]
        return trace
    good = [stack(n) for n in (2, 3, 4, 5)]
    out, how = whole_depth(good, 10)
    assert out == stack(12), how
    # The fourth stack's trace differs: the rules are not trusted beyond what they were fitted to.
    out, how = whole_depth(good[:3] + [stack(5, odd=512)], 10)
    assert out is None and "fourth stack" in how
    # Events removed rather than inserted: not the same step with more layers.
    out, how = whole_depth([stack(2), stack(2)[1:], stack(4), stack(5)], 10)
    assert out is None


def test_a_deep_models_trace_is_extended(tmp_path):
    from probe_kit.dry_run import allocation_trace
    from probe_kit.recipe import ProbeConfig

    cfg = ProbeConfig(model=deeper(tmp_path, "tiny-qwen2", 40), random_weights=True, seq_len=128, response_len=16,
                      rank=8, quant="4bit", fixes=[])
    trace, raw = allocation_trace(cfg)
    assert raw["depth"]["method"] == "extended" and raw["depth"]["from_layers"] == [2, 3, 4, 5]
    assert sum(1 for e in trace if e >= 0) > 0 and replay(trace).oom is None
