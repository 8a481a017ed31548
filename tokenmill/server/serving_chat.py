"""POST /v1/chat/completions: render the chat template, run, answer as JSON or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving_common import (
    ChoiceTracker, ResponseLog, ServerContext, collect, now_seconds, prompt_logprobs_json, run_unless_disconnected,
    sse_response, stream_updates, top_entries, usage,
)


async def create_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, receive: Receive, log: ResponseLog
) -> Response:
    ctx.check_model(body.model)
    conversation = body.conversation()
    ctx.check_text_length(sum(len(m["content"]) for m in conversation), "messages")
    prompt, prompt_token_ids = await ctx.off_loop(ctx.inputs.tokenize_chat, conversation, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: up to max_model_len
    num_top = body.num_logprobs()
    params = body.sampling_params(max_tokens, num_top, ctx.vocab_size)
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
        return sse_response(_chunks(body, header, streams, num_top, log), log)
    (final,) = await run_unless_disconnected(collect(streams), receive)
    response = _response(header, final, num_top, log)
    if body.prompt_logprobs is not None and final.prompt_logprobs is not None:  # vLLM's extra
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
    return JSONResponse(response)


def _response(header: dict, final: RequestOutput, num_top: int | None, log: ResponseLog) -> dict:
    choices = []
    for sample in final.outputs:
        logprobs = None
        if num_top is not None:
            logprobs = {"content": _logprobs(sample.logprobs or [], sample.token_ids, num_top)}
        choices.append({
            "index": sample.index,
            "message": {"role": "assistant", "content": sample.text},
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
        })
    log.completion_tokens = sum(len(s.token_ids) for s in final.outputs)
    log.first_token_time = final.metrics.first_token_time
    return {**header, "object": "chat.completion", "choices": choices,
            "usage": usage(log.prompt_tokens, log.completion_tokens)}


async def _chunks(body: ChatCompletionRequest, header: dict, streams: list[AsyncIterator[RequestOutput]],
                  num_top: int | None, log: ResponseLog) -> AsyncIterator[dict]:
    header = {**header, "object": "chat.completion.chunk"}
    tracker = ChoiceTracker(body.n)
    for index in range(body.n):
        yield _chunk(header, index, {"role": "assistant", "content": ""}, None, None)
    async for updates in stream_updates(streams, tracker, log):
        for update in updates:
            logprobs = None
            if num_top is not None:
                logprobs = {"content": _logprobs(update.logprobs or [], update.token_ids, num_top)}
            elif not update.text and update.finish_reason is None:
                continue
            delta = {"content": update.text} if update.text else {}
            yield _chunk(header, update.index, delta, logprobs, update.finish_reason)
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage(log.prompt_tokens, tracker.num_completion_tokens)}


def _chunk(header: dict, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {**header, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish_reason}]}


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
