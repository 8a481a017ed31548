"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Ranges that SamplingParams already checks (temperature, top_p, penalties, n, ...) are checked
there, once; these models check shapes and the limits only the API has.
"""

from __future__ import annotations

import json
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
    # vLLM's extras this server does not implement
    "use_beam_search": "(beam search) is not supported",
    "allowed_token_ids": "is not supported; use logit_bias or structured_outputs",
    "bad_words": "is not supported; use logit_bias",
    "cache_salt": "is not supported: this server's prefix cache is shared by all requests",
    "return_tokens_as_token_ids": "is not supported",
}
UNSUPPORTED_CHAT_FIELDS: dict[str, str] = {
    **UNSUPPORTED_FIELDS,
    "audio": "is not supported: this server generates text only",
    "prediction": "(predicted outputs) is not supported",
    "web_search_options": "is not supported: this server has no web search",
    "functions": "(the legacy form of tools) is not supported; use tools",
    "function_call": "(the legacy form of tool_choice) is not supported; use tool_choice",
    "chat_template": "(a chat template per request) is not accepted: start the server with --chat-template",
    "documents": "is not supported",
}


def refuse_unsupported_fields(data: dict, unsupported: dict[str, str]) -> None:
    """InvalidParameterError for the first field of `data` this server cannot honour."""
    for name, why in unsupported.items():
        value = data.get(name)
        if value is None or value is False or value == [] or value == "":
            continue
        raise InvalidParameterError(f"{name} {why}", param=name)
    if data.get("priority") not in (None, 0):
        raise InvalidParameterError("priority is not supported: requests are served first come, first served",
                                    param="priority")
    if data.get("length_penalty") not in (None, 1):  # a beam-search setting
        raise InvalidParameterError("length_penalty is not supported (beam search is not)", param="length_penalty")
    if data.get("best_of") not in (None, 1, data.get("n", 1)):  # best of more than it returns: a different answer
        raise InvalidParameterError("best_of is not supported (other than equal to n)", param="best_of")
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
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens; -1: max_model_len
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len of them)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == 0 or k > max_model_len:
            raise InvalidParameterError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (max_model_len)",
                                        param="truncate_prompt_tokens")
        return prompt_token_ids[-(max_model_len if k == -1 else k):]

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
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
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


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON, as the model wrote it


class AssistantToolCall(_Body):
    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool's reply: to which call
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply goes on with the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables (enable_thinking, ...)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def conversation(self) -> list[dict]:
        return to_conversation(self.messages)

    def effective_tool_choice(self) -> str | dict:
        """"none" without tools; OpenAI's default "auto" with them; a named choice as a dict."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise InvalidParameterError("tool_choice needs tools", param="tool_choice")
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise InvalidParameterError(f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                            f"among the tools ({', '.join(names)})", param="tool_choice")
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

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
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)  # rendered with the messages
    return_prompt: bool = False  # also the rendered text (messages only)


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


def to_conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates take them: tool calls with their arguments as objects (where they
    parse), which is what templates that write them with `tojson` expect."""
    conversation = []
    for m in messages:
        # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
        message: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        conversation.append(message)
    return conversation


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


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
