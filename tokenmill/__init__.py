"""tokenmill: an LLM inference engine with an OpenAI-compatible server."""

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]
