"""jkv: a JAX/Pallas LLM inference engine whose speciality is the KV cache."""

from jkv.api import LLM
from jkv.engine.sampling import SamplingParams
from jkv.outputs import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
