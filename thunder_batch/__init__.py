"""thunder_batch: batched LLM inference for litgpt models, compiled by Lightning Thunder.

The public names below load on first use, so `import thunder_batch.<module>` of a pure-Python
module (config, versions, the CLI's option parsing) does not import torch or Thunder.
"""

import importlib

_PUBLIC = {
    "Engine": "thunder_batch.engine",
    "EngineConfig": "thunder_batch.config",
    "SamplingParams": "thunder_batch.config",
    "GenerationResult": "thunder_batch.request",
    "StepOutput": "thunder_batch.request",
    "batched_sample": "thunder_batch.sampler",
    "index_copy_rows": "thunder_batch.index_ops",
}

__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'thunder_batch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
