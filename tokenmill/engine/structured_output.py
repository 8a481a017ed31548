"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by llguidance
into token masks that the sampler applies.

One GrammarCompiler per engine compiles a StructuredOutputsParams once (cached by its text);
each sequence gets its own GrammarMatcher, which the scheduler advances with every token the
sequence keeps. Why llguidance and not xgrammar: see README ("Structured outputs").
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
# Whitespace the JSON grammar allows between tokens: enough to pretty-print nested objects, bounded
# so that a model which prefers whitespace still has to close what it opened.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


@dataclass
class CompiledGrammar:
    """A validated llguidance grammar and a matcher at its start, copied for each sequence."""

    key: tuple[str, str]
    template: object  # llguidance.LLMatcher in its initial state
    executor: object  # llguidance.LLExecutor shared by the compiler's matchers

    vocab_size: int

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy(), self.executor, self.vocab_size)


class GrammarMatcher:
    """Where one sequence stands in its grammar: which tokens may come next."""

    def __init__(self, matcher, executor, vocab_size: int) -> None:
        self.matcher = matcher
        self.executor = executor
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is then
        in an error state for good)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def token_bitmasks(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """The allowed next tokens of each matcher: int32 [len(matchers), ceil(vocab / 32)], bit j of
    word w set when token 32 * w + j is allowed. Computed on llguidance's threads, without the GIL.
    (Straight through the executor: `llguidance.torch` would import torch._dynamo, ~85 MB and ~2 s,
    for a torch.compile'd helper we do not use.)"""
    import torch  # here: a server process checks constraints with this module and never loads torch

    bitmask = torch.full((len(matchers), (matchers[0].vocab_size + 31) // 32), -1, dtype=torch.int32)
    pairs = [(m.matcher, row) for row, m in enumerate(matchers)]
    matchers[0].executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, so the server compiles off the engine loop."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar of `spec`, from the cache or compiled now; InvalidParameterError if it is bad."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        ll_tokenizer, executor = self._backend()
        try:
            grammar = _grammar_text(spec)
        except ValueError as exc:
            raise InvalidParameterError(f"{spec.param}: {_first_line(str(exc))}", param=spec.param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
        if is_error:
            raise InvalidParameterError(f"{spec.param}: invalid {_KIND_NAMES[spec.kind]}: {_clip(messages[0])}",
                                        param=spec.param)
        template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidParameterError(f"{spec.param}: invalid {_KIND_NAMES[spec.kind]}: {_clip(template.get_error())}",
                                        param=spec.param)
        return CompiledGrammar(spec.key, template, executor, self.vocab_size)

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer, and its first mask, now rather than on the first
        constrained request (~0.6 s and ~40 MB here: the server leaves it to that request, on its
        grammar thread, so that a server nobody asks for structured outputs does not hold it)."""
        try:
            token_bitmasks([self.compile(StructuredOutputsParams(json_object=True)).new_matcher()])
        except InvalidParameterError:  # a slow tokenizer: constrained requests will say so
            pass

    def _backend(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                # What llguidance.hf.from_tokenizer does, without its import of transformers: the
                # tokenizers JSON of a fast tokenizer (transformers' or a DecodingTokenizer).
                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise InvalidParameterError("structured outputs need a fast tokenizer (tokenizers' JSON)",
                                                param="structured_outputs")
                backend = copy.copy(backend)
                backend.no_padding()
                backend.no_truncation()
                self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer, self._executor


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
               "choice": "choice", "grammar": "grammar"}


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (ValueError when it cannot be built)."""
    import llguidance

    options = {"whitespace_pattern": JSON_WHITESPACE}
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, overrides=options)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or llama.cpp's GBNF


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "invalid"


def _clip(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
