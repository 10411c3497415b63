"""Speculative decoding on decode workers: drafters, the acceptance rule, adaptive K, metrics.

The engine owns the mechanics (proposed tokens scheduled as K+1 verification
tokens, logits for every verified position, KV rollback); this package plugs
into it through `engine.speculator.Speculator`:

    engine = speculative_engine(EngineConfig(spec=SpecConfig(method="ngram", num_speculative_tokens=4)))
"""

from pdserve.decode_node.spec.adaptive import AdaptiveK, best_k, expected_speedup, expected_tokens_per_pass
from pdserve.decode_node.spec.draft_model import ModelDrafter, check_draft, load_draft_model, self_draft_model
from pdserve.decode_node.spec.drafter import Drafter
from pdserve.decode_node.spec.factory import build_speculator, speculative_engine
from pdserve.decode_node.spec.ngram import NgramDrafter
from pdserve.decode_node.spec.rejection import rejection_sample
from pdserve.decode_node.spec.speculator import SpecDecoder
from pdserve.engine.speculator import SpecMetrics

__all__ = [
    "AdaptiveK", "Drafter", "ModelDrafter", "NgramDrafter", "SpecDecoder", "SpecMetrics", "best_k",
    "build_speculator", "check_draft", "expected_speedup", "expected_tokens_per_pass", "load_draft_model",
    "rejection_sample", "self_draft_model", "speculative_engine",
]
