"""POST /v1/chat/completions: render the chat template, run, answer as JSON or server-sent events."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving_common import (
    ChoiceTracker, ResponseLog, ServerContext, collect, now_seconds, prompt_logprobs_json, run_unless_disconnected,
    sse_response, stream_updates, top_entries, usage,
)
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.tool_calls import ToolCall, ToolParser, forced_tool_calls, read_forced_calls


@dataclass
class ToolPlan:
    """How a request's reply may call tools: "none", "auto" (read by the template's parser), or
    forced ("required" / a named function: constrained JSON, read as such)."""

    choice: str | dict
    parser: ToolParser | None
    reasoning: ReasoningParser | None = None  # --reasoning-parser: <think> text out of the content

    @property
    def is_forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The reply's message (reasoning, content and/or tool_calls) and its finish reason."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        message, finish_reason = self.content_message(text, finish_reason)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message, finish_reason

    def content_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The message of reasoning-free text: content and/or tool calls."""
        calls: list[ToolCall] = []
        content: str | None = text
        if self.is_forced:
            calls = read_forced_calls(text, self.choice)
            content = None if calls else text
        elif self.choice == "auto" and self.parser is not None:
            content, calls = self.parser.parse(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


def _tool_plan(ctx: ServerContext, body: ChatCompletionRequest, params: SamplingParams) -> tuple[ToolPlan, SamplingParams]:
    """The request's tool plan, and its sampling parameters with a forced choice's constraint.
    Under a constraint the grammar applies from the first token, so a reasoning block is one only
    if the output opens it with <think> itself (deepseek_r1's template-opened block cannot be)."""
    choice = body.effective_tool_choice()
    reasoning = ctx.reasoning_parser
    if reasoning is not None and params.structured_outputs is not None and not reasoning.opens_itself:
        reasoning = dataclasses.replace(reasoning, opens_itself=True)
    if choice == "none":
        return ToolPlan("none", None, reasoning), params
    if ctx.tool_parser is None:
        raise InvalidParameterError("this model's chat template does not support tools (it never mentions them); "
                                    "give a template that does with --chat-template", param="tools")
    plan = ToolPlan(choice, ctx.tool_parser, reasoning)
    if plan.is_forced:
        plan.reasoning = None  # the output is the calls' JSON
        if params.structured_outputs is not None:
            raise InvalidParameterError("tool_choice \"required\" or a named function constrains the output "
                                        "already: give no response_format or structured_outputs with it",
                                        param="tool_choice")
        forced = forced_tool_calls(body.tool_dicts(), choice, body.parallel_tool_calls)
        params = dataclasses.replace(params, structured_outputs=forced)
    return plan, params


@dataclass
class ChatPrompt:
    """A chat request made ready for the engine: its tool plan, parameters and rendered prompt."""

    plan: ToolPlan
    params: SamplingParams
    prompt: str | None  # None where truncate_prompt_tokens cut it
    prompt_token_ids: list[int]


async def render_chat_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> ChatPrompt:
    """The model check, limits, tool plan and chat template of a request: what generation and
    /v1/chat/completions/render share."""
    ctx.check_model(body.model)
    conversation = body.conversation()
    ctx.check_text_length(sum(len(m["content"]) for m in conversation), "messages")
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: up to max_model_len
    plan, params = _tool_plan(ctx, body, body.sampling_params(max_tokens, body.num_logprobs(), ctx.vocab_size))
    tools = body.tool_dicts() if plan.choice != "none" else None
    prompt, prompt_token_ids = await ctx.off_loop(
        lambda: ctx.inputs.tokenize_chat(conversation, body.add_generation_prompt, tools,
                                         continue_final_message=body.continue_final_message,
                                         template_kwargs=body.chat_template_kwargs))
    if body.truncate_prompt_tokens is not None:  # the text no longer says what the engine gets
        prompt, prompt_token_ids = None, body.truncate(prompt_token_ids, ctx.max_model_len)
    return ChatPrompt(plan, params, prompt, prompt_token_ids)


async def render_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, receive: Receive, log: ResponseLog
) -> Response:
    """vLLM's POST /v1/chat/completions/render: the prompt's token ids, generating nothing (routers
    read it to place a request by its prefix)."""
    rendered = await render_chat_prompt(ctx, body)
    ctx.validate(rendered.prompt_token_ids, rendered.params)  # refused here what a generation would refuse
    return JSONResponse({"request_id": f"chatcmpl-{log.request_id}", "model": ctx.model_name,
                         "token_ids": rendered.prompt_token_ids})


async def create_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, receive: Receive, log: ResponseLog
) -> Response:
    rendered = await render_chat_prompt(ctx, body)
    plan, params, prompt, prompt_token_ids = rendered.plan, rendered.params, rendered.prompt, rendered.prompt_token_ids
    num_top = body.num_logprobs()
    effective_max_tokens = ctx.validate(prompt_token_ids, params)
    await ctx.compile_grammar(params)
    ctx.check_request_tokens(body.n * (len(prompt_token_ids) + effective_max_tokens))
    ctx.check_accepting(body.n)

    request_id = f"chatcmpl-{log.request_id}"
    log.is_generation = True
    log.prompt_tokens = len(prompt_token_ids)
    streams = [ctx.engine.generate(f"chatcmpl-{log.engine_id}", prompt_token_ids, params, prompt_text=prompt)]
    header = {"id": request_id, "created": now_seconds(), "model": ctx.model_name}
    if body.stream:
        return sse_response(_chunks(body, header, streams, num_top, plan, log), log)
    (final,) = await run_unless_disconnected(collect(streams), receive)
    response = _response(header, final, num_top, plan, log)
    if body.prompt_logprobs is not None and final.prompt_logprobs is not None:  # vLLM's extra
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
    return JSONResponse(response)


def _response(header: dict, final: RequestOutput, num_top: int | None, plan: ToolPlan, log: ResponseLog) -> dict:
    choices = []
    for sample in final.outputs:
        logprobs = None
        if num_top is not None:
            logprobs = {"content": _logprobs(sample.logprobs or [], sample.token_ids, num_top)}
        message, finish_reason = plan.message(sample.text, sample.finish_reason)
        choices.append({"index": sample.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": sample.stop_reason})
    log.completion_tokens = sum(len(s.token_ids) for s in final.outputs)
    log.first_token_time = final.metrics.first_token_time
    return {**header, "object": "chat.completion", "choices": choices,
            "usage": usage(log.prompt_tokens, log.completion_tokens)}


@dataclass
class _StreamedChoice:
    """One choice of a stream under tools: its text so far and how much went out as content."""

    text: str = ""
    num_sent: int = 0
    in_call: bool = False
    reasoning: ReasoningStream | None = None


def _stream_deltas(plan: ToolPlan, state: _StreamedChoice, text: str, finish_reason: str | None
                   ) -> tuple[list[dict], str | None]:
    """The deltas one update adds under `plan`: reasoning as it comes; content as soon as it cannot
    be part of a tool call; the calls, whole, once the choice ends."""
    if state.reasoning is None:
        return _content_deltas(plan, state, text, finish_reason)
    reasoning, text = state.reasoning.feed(text, finished=finish_reason is not None)
    deltas, finish_reason = _content_deltas(plan, state, text, finish_reason)
    return ([{"reasoning_content": reasoning}] if reasoning else []) + deltas, finish_reason


def _content_deltas(plan: ToolPlan, state: _StreamedChoice, text: str, finish_reason: str | None
                    ) -> tuple[list[dict], str | None]:
    state.text += text
    if plan.choice == "none" or (plan.choice == "auto" and plan.parser is None):
        state.num_sent = len(state.text)
        return ([{"content": text}] if text else []), finish_reason
    deltas = []
    if plan.choice == "auto" and not state.in_call:
        end = plan.parser.content_end(state.text)
        state.in_call = end < len(state.text) and state.text.startswith(plan.parser.start, end)
        if end > state.num_sent:
            deltas.append({"content": state.text[state.num_sent:end]})
            state.num_sent = end
    if finish_reason is None:
        return deltas, None
    message, finish_reason = plan.content_message(state.text, finish_reason)
    if "tool_calls" in message:
        deltas.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]})
    elif len(state.text) > state.num_sent:
        deltas.append({"content": state.text[state.num_sent:]})
    state.num_sent = len(state.text)
    return deltas, finish_reason


async def _chunks(body: ChatCompletionRequest, header: dict, streams: list[AsyncIterator[RequestOutput]],
                  num_top: int | None, plan: ToolPlan, log: ResponseLog) -> AsyncIterator[dict]:
    header = {**header, "object": "chat.completion.chunk"}
    tracker = ChoiceTracker(body.n)
    states = [_StreamedChoice(reasoning=None if plan.reasoning is None else ReasoningStream(plan.reasoning))
              for _ in range(body.n)]
    for index in range(body.n):
        yield _chunk(header, index, {"role": "assistant", "content": ""}, None, None)
    async for updates in stream_updates(streams, tracker, log):
        for update in updates:
            logprobs = None
            if num_top is not None:
                logprobs = {"content": _logprobs(update.logprobs or [], update.token_ids, num_top)}
            deltas, finish_reason = _stream_deltas(plan, states[update.index], update.text, update.finish_reason)
            if not deltas and logprobs is None and finish_reason is None:
                continue
            deltas = deltas or [{}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield _chunk(header, update.index, delta, logprobs if i == 0 else None, finish_reason if last else None,
                             update.stop_reason if last else None)
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage(log.prompt_tokens, tracker.num_completion_tokens)}


def _chunk(header: dict, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
           stop_reason: int | str | None = None) -> dict:
    return {**header, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num_top: int) -> list[dict]:
    """Chat logprobs content entries of these tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        content.append({
            **_token_logprob(chosen),
            "top_logprobs": [_token_logprob(lp) for _, lp in top_entries(entry, num_top)],
        })
    return content


def _token_logprob(logprob: Logprob) -> dict:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode("utf-8"))}
