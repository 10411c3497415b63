"""From `SpecConfig` to a speculating engine."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models.registry import param_counts
from pdserve.engine.speculative.adaptive import AdaptiveK, MeasuredCosts, RelativeCosts, StepCosts
from pdserve.engine.speculative.draft_model import (
    DraftTarget,
    ModelDrafter,
    draft_head_ids,
    load_draft_model,
    self_draft_model,
)
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculative.ngram import NgramDrafter
from pdserve.engine.speculative.spec_decoder import SpecDecoder


def draft_target(engine: Engine) -> DraftTarget:
    """What a model drafter needs of `engine` (it is handed these parts, never the engine)."""
    return DraftTarget(engine.arch, engine.tokenizer, engine.config.model, engine.device, engine.dtype,
                       engine.sampler, engine.pool.layout, engine.pool.num_blocks, engine.max_model_len,
                       engine.config.scheduler, engine.config.spec)


def build_speculator(engine: Engine, config: SpecConfig | None = None) -> SpecDecoder | None:
    """The speculator `config` (default: the engine's `config.spec`) describes,
    for `engine`'s model; None when speculation is off. Raises ValueError for a
    draft that cannot serve this target."""
    config = config or engine.config.spec
    if not config.enabled:
        return None
    drafter: Drafter
    draft_graphs = None
    if config.method == "ngram":
        drafter, cost_ratio = NgramDrafter(config.ngram_min, config.ngram_max, engine.device), 0.0
    else:
        target = draft_target(engine)
        if config.method == "self_draft":
            model = self_draft_model(engine.model, config.num_draft_layers)
            name = f"{engine.model_name}[:{config.num_draft_layers}]"
            cost_ratio = config.num_draft_layers / engine.arch.num_layers
        else:
            assert config.draft_model is not None  # SpecConfig checks it
            model = load_draft_model(config.draft_model, target)
            name = config.draft_model
            cost_ratio = param_counts(model.arch).active / param_counts(engine.arch).active
        model_drafter = ModelDrafter(model, target, name, draft_head_ids(config, engine.arch.vocab_size))
        drafter, draft_graphs = model_drafter, model_drafter.runner.graphs
    adaptive = None
    if config.adaptive:
        # Timed where the passes replay graphs; else each proposed token costs a draft step
        # and one more verified position, as fractions of a decode step.
        target_graphs = engine.runner.graphs
        costs: StepCosts = (MeasuredCosts(target_graphs, draft_graphs) if target_graphs is not None
                            else RelativeCosts(cost_ratio + config.verify_cost))
        adaptive = AdaptiveK(config.num_speculative_tokens, costs)
    return SpecDecoder(drafter, engine.sampler, config.num_speculative_tokens, adaptive)


def speculative_engine(config: EngineConfig) -> Engine:
    """An engine that speculates as `config.spec` says (a plain one when it is off)."""
    engine = Engine(config)
    engine.set_speculator(build_speculator(engine))
    return engine
