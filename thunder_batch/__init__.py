"""thunder_batch: batched LLM inference for litgpt models, compiled by Lightning Thunder."""

from thunder_batch.config import EngineConfig, SamplingParams
from thunder_batch.engine import Engine
from thunder_batch.index_ops import index_copy_2d, index_select_2d
from thunder_batch.program import batched_next_token
from thunder_batch.request import GenerationResult, StepOutput
from thunder_batch.sampler import batched_sample

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "GenerationResult", "StepOutput",
    "batched_next_token", "batched_sample", "index_copy_2d", "index_select_2d",
]
__version__ = "0.1.0"
