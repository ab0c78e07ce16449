"""open_clip: loading a frozen model, and class prompts -> text prototypes (prompt ensembling).

:func:`load_open_clip` builds the frozen model, its eval transform and tokenizer from any name
open_clip accepts; :func:`model_temperature` is its zero-shot temperature (1/exp(logit_scale));
:func:`build_class_prompts` turns class names, templates and descriptions into prompts, and
:func:`encode_prototypes` encodes them into ``(K, d)`` unit prototypes.
"""

from frolic_tta.clip.loading import WeightsNotFoundError, load_open_clip, model_temperature
from frolic_tta.clip.prompts import (
    DATASET_TEMPLATES,
    build_class_prompts,
    encode_prototypes,
    load_descriptions,
    resolve_templates,
)

__all__ = [
    "DATASET_TEMPLATES",
    "WeightsNotFoundError",
    "build_class_prompts",
    "encode_prototypes",
    "load_descriptions",
    "load_open_clip",
    "model_temperature",
    "resolve_templates",
]
