"""Speculative decoding: drafters, the acceptance rule, adaptive K, metrics (for any engine:
the offline one and the decode workers').

The engine owns the mechanics (proposed tokens scheduled as K+1 verification
tokens, logits for every verified position, KV rollback); this package plugs
into it through `engine.speculator.Speculator`. `factory.build_speculator` is the one builder,
which the engine calls for its config's `spec`:

    engine = Engine(EngineConfig(spec=SpecConfig(method="ngram", num_speculative_tokens=4)))
"""

from pdserve.engine.speculative.adaptive import AdaptiveK, best_k, expected_speedup, expected_tokens_per_pass
from pdserve.engine.speculative.draft_loading import check_draft, load_draft_model, self_draft_model
from pdserve.engine.speculative.draft_model import ModelDrafter
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculative.factory import build_speculator, draft_target
from pdserve.engine.speculative.mtp import MTPDrafter
from pdserve.engine.speculative.ngram import NgramDrafter
from pdserve.engine.speculative.rejection import rejection_sample
from pdserve.engine.speculative.spec_decoder import SpecDecoder
from pdserve.engine.speculator import SpecMetrics

__all__ = [
    "AdaptiveK", "Drafter", "MTPDrafter", "ModelDrafter", "NgramDrafter", "SpecDecoder", "SpecMetrics", "best_k",
    "build_speculator", "check_draft", "draft_target", "expected_speedup", "expected_tokens_per_pass",
    "load_draft_model", "rejection_sample", "self_draft_model",
]
