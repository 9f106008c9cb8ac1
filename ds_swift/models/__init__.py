"""Models shipped with ds-swift for its examples, tests and demo (DeepSpeed ``LayerSpec`` lists)."""

from __future__ import annotations

from ds_swift.models.gpt import GPTConfig, gpt_layer_specs, gpt_pipeline, lm_loss, synthetic_batch

__all__ = ["GPTConfig", "gpt_layer_specs", "gpt_pipeline", "lm_loss", "synthetic_batch"]
