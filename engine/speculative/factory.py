"""From `SpecConfig` to a speculator: the one builder, which `Engine(config)` calls for
`config.spec` and `Engine.speculate` for another config."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig, SpecConfig
from pdserve.engine.models.registry import param_counts
from pdserve.engine.runner.assembly import EngineParts
from pdserve.engine.speculative.adaptive import AdaptiveK, MeasuredCosts, PassCosts, RelativeCosts
from pdserve.engine.speculative.draft_loading import DraftTarget, draft_head_ids, load_draft_model, self_draft_model
from pdserve.engine.speculative.draft_model import ModelDrafter
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculative.mtp import MTPDrafter
from pdserve.engine.speculative.ngram import NgramDrafter
from pdserve.engine.speculative.spec_decoder import SpecDecoder


def draft_target(parts: EngineParts, config: EngineConfig, spec: SpecConfig | None = None) -> DraftTarget:
    """What a model drafter needs of its target engine's parts (it is handed these, never the engine)."""
    return DraftTarget(parts.arch, parts.tokenizer, config.model, parts.device, parts.dtype, parts.sampler,
                       parts.pool.layout, parts.pool.num_blocks, parts.max_model_len, config.scheduler,
                       spec or config.spec)


def build_speculator(parts: EngineParts, config: EngineConfig, spec: SpecConfig | None = None,
                     drafter: Drafter | None = None) -> SpecDecoder | None:
    """The speculator `spec` (default: `config.spec`) describes for the engine made of `parts`
    and `config`; None when speculation is off. `drafter` replaces the drafter `spec` names (a
    benchmark's or a test's own: it is adapted and verified as any other). Raises ValueError
    for a draft that cannot serve this target."""
    spec = spec or config.spec
    if not spec.enabled:
        return None
    draft_graphs = None
    if drafter is not None:
        cost_ratio = 0.0  # unknown: adaptive K weighs `spec.verify_cost` alone, or the graphs' times
        draft_graphs = drafter.runner.graphs if isinstance(drafter, ModelDrafter) else None
    elif spec.method == "ngram":
        drafter, cost_ratio = NgramDrafter(spec.ngram_min, spec.ngram_max, parts.device), 0.0
    elif spec.method == "mtp":
        carry = parts.runner.mtp
        if carry is None:
            parts.arch.with_mtp()  # a model without MTP layers: its own reason
            raise ValueError("speculative method 'mtp' needs the engine built with the model's MTP layer "
                             "(EngineConfig.spec.method 'mtp'): its KV is a layer of the pool")
        drafter, cost_ratio = MTPDrafter(parts.model, carry, parts.pool, parts.sampler), 1 / parts.arch.num_layers
    else:
        target = draft_target(parts, config, spec)
        if spec.method == "self_draft":
            model = self_draft_model(parts.model, spec.num_draft_layers)
            name = f"{parts.model_name}[:{spec.num_draft_layers}]"
            cost_ratio = spec.num_draft_layers / parts.arch.num_layers
        else:
            assert spec.draft_model is not None  # SpecConfig checks it
            model = load_draft_model(spec.draft_model, target)
            name = spec.draft_model
            cost_ratio = param_counts(model.arch).active / param_counts(parts.arch).active
        model_drafter = ModelDrafter(model, target, name, draft_head_ids(spec, parts.arch.vocab_size))
        drafter, draft_graphs = model_drafter, model_drafter.runner.graphs
    adaptive = None
    if spec.adaptive:
        # Timed where the passes replay graphs; else each proposed token costs a draft step
        # and one more verified position, as fractions of a decode step.
        target_graphs = parts.runner.graphs
        costs: PassCosts = (MeasuredCosts(target_graphs, draft_graphs) if target_graphs is not None
                            else RelativeCosts(cost_ratio + spec.verify_cost))
        adaptive = AdaptiveK(spec.num_speculative_tokens, costs)
    return SpecDecoder(drafter, parts.sampler, spec.num_speculative_tokens, adaptive)
