"""tokenmill: an LLM inference engine with an OpenAI-compatible server."""

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]
