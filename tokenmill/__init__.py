"""tokenmill: an LLM inference engine with an OpenAI-compatible server."""

from tokenmill.engine.input_processor import TextPrompt, TokensPrompt
from tokenmill.sampling_params import SamplingParams
from tokenmill.version import __version__

__all__ = ["LLM", "SamplingParams", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):
    # LLM (and with it torch) is imported on first use: `tokenmill serve`'s server process never needs it
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
