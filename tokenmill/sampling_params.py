"""SamplingParams: what a user may ask of one generation, validated on creation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidParameterError

MAX_LOGPROBS = 20
MAX_TOP_K = 1 << 31
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # the detokenizer holds back this much text at most
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_GRAMMAR_CHARS = 64 * 1024  # a JSON schema, regex or grammar as text
MAX_CHOICES = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one of a JSON schema, any JSON
    object, a regular expression, one of some strings, or a Lark/GBNF grammar.

    `param` names the API field it came from, for error messages.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise InvalidParameterError(
                f"{self.param} takes exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) or 'none'}", param=self.param)
        kind = given[0]
        if kind == "json" and isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise InvalidParameterError(f"{self.param}: the JSON schema is not valid JSON ({exc})",
                                            param=self.param) from None
        if kind == "json" and not isinstance(self.json, dict | bool):
            raise InvalidParameterError(f"{self.param}: a JSON schema must be an object", param=self.param)
        if kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise InvalidParameterError(f"{self.param}: {kind} must be a non-empty string", param=self.param)
        if kind == "choice" and (not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
                                 or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidParameterError(f"{self.param}: choice must be a list of 1 to {MAX_CHOICES} non-empty strings",
                                        param=self.param)
        if len(self.key[1]) > MAX_GRAMMAR_CHARS:
            raise InvalidParameterError(
                f"{self.param}: the {kind} has {len(self.key[1])} characters; at most {MAX_GRAMMAR_CHARS}",
                param=self.param)

    @property
    def kind(self) -> str:
        if self.json_object is True:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, "" if kind == "json_object" else getattr(self, kind)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's names and defaults).

    temperature 0 means greedy. max_tokens None means "up to max_model_len"; 0 means the prompt
    only (with prompt_logprobs: score a text without generating).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k of every prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays at its end
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        except TypeError:
            raise InvalidParameterError("stop must be a string or a list of strings", param="stop") from None
        try:
            self.stop_token_ids = list(self.stop_token_ids or [])
        except TypeError:
            raise InvalidParameterError("stop_token_ids must be a list of token ids", param="stop_token_ids") from None
        self._validate()
        if self.top_k > MAX_TOP_K:  # more than any vocabulary: no top-k (and an int every wire can carry)
            self.top_k = -1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def may_stop_at(self, position: int) -> bool:
        """min_tokens: may the position-th generated token (1-based) end the generation, as a stop
        or EOS token or by completing a stop string? The first min_tokens tokens never do."""
        return position > self.min_tokens

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidParameterError:
            shown = repr(getattr(self, param))
            shown = shown if len(shown) <= 80 else shown[:80] + "..."
            return InvalidParameterError(f"{param} {why}, got {shown}", param=param)

        def number(param: str) -> float:
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(param, "must be a number")
            return value

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not 0.0 <= number("temperature") <= 2.0:
            raise bad("temperature", "must be in [0, 2]")
        if not 0.0 < number("top_p") <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:  # above the vocabulary: no top-k
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= number("min_p") <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < number("repetition_penalty") <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not -2.0 <= number("presence_penalty") <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= number("frequency_penalty") <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", "must be a non-negative integer")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            raise bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise bad("logit_bias", "must map token ids to numbers") from None
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.skip_special_tokens, bool):
            raise bad("ignore_eos", "ignore_eos and skip_special_tokens must be booleans")
