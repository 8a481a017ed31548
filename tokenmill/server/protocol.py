"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Ranges that SamplingParams already checks (temperature, top_p, penalties, n, ...) are checked
there, once; these models check shapes and the limits only the API has.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.engine.input_processor import normalize_prompts
from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_PROMPTS_PER_REQUEST = 64
MAX_MESSAGES = 1024
INT64 = 2**63

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients send options other servers understand.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema (always enforced, strict or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's structured_outputs extra: exactly one of json, json_object, regex, choice, grammar.
    vLLM's other keys (whitespace_pattern, structural_tag, ...) are refused, not dropped."""

    model_config = ConfigDict(extra="forbid")
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Fields that change what the answer must be and that this server does not implement: a 400
# naming them, never a silent drop. (Fields nobody documents are ignored, as vLLM does.)
_GUIDED = "is vLLM's retired name; use structured_outputs (or response_format)"
UNSUPPORTED_FIELDS: dict[str, str] = {
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED, "guided_whitespace_pattern": _GUIDED,
}
UNSUPPORTED_CHAT_FIELDS: dict[str, str] = {
    **UNSUPPORTED_FIELDS,
    "audio": "is not supported: this server generates text only",
    "prediction": "(predicted outputs) is not supported",
    "web_search_options": "is not supported: this server has no web search",
    "functions": "is not supported",
    "function_call": "is not supported",
    "tools": "is not supported yet: this server does not do tool calling",
    "tool_choice": "is not supported yet: this server does not do tool calling",
}


def refuse_unsupported_fields(data: dict, unsupported: dict[str, str]) -> None:
    """InvalidParameterError for the first field of `data` this server cannot honour."""
    for name, why in unsupported.items():
        value = data.get(name)
        if value is None or value == [] or (name == "tool_choice" and value == "none"):
            continue
        raise InvalidParameterError(f"{name} {why}", param=name)
    modalities = data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidParameterError('modalities: only ["text"] is supported', param="modalities")


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of response_format or structured_outputs, if any."""
        response_format = self.response_format if self.response_format and self.response_format.type != "text" else None
        if response_format is not None and self.structured_outputs is not None:
            raise InvalidParameterError("give response_format or structured_outputs, not both", param="response_format")
        if response_format is not None:
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True, param="response_format")
            schema = response_format.json_schema.json_schema
            return StructuredOutputsParams(json=schema if schema is not None else {}, param="response_format")
        body = self.structured_outputs
        if body is None:
            return None
        return StructuredOutputsParams(json=body.json_schema, json_object=body.json_object is True, regex=body.regex,
                                       choice=body.choice, grammar=body.grammar, param="structured_outputs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=_token_bias(self.logit_bias, vocab_size),
            seed=self.seed,
            stop=self.stop,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        )


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; 0 with echo scores a prompt (lm-eval)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompts = normalize_prompts(self.prompt)
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidParameterError(
                f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}", param="prompt"
            )
        if self.suffix:
            raise InvalidParameterError("suffix is not supported", param="suffix")
        return prompts


class TextPart(_Body):
    type: Literal["text"]
    text: str


def _text_parts_only(parts: Any) -> Any:
    """A content part we cannot take (an image, audio, a file) is named as such, not as a shape error."""
    if isinstance(parts, list):
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    "unsupported_content", "content parts of type '{kind}' are not supported: this model takes text only",
                    {"kind": kind[:40]})
    return parts


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return to_conversation(self.messages)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


def to_conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as chat templates take them."""
    # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def _token_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not logit_bias:
        return None
    bias = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            raise InvalidParameterError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
            )
        bias[token_id] = value
    return bias
