"""POST /v1/completions: validate, run, and answer as one JSON body or as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import Logprob, PromptLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving_common import (
    ChoiceTracker, ResponseLog, ServerContext, collect, now_seconds, run_unless_disconnected, sse_response,
    prompt_logprobs_json, stream_updates, top_entries, usage,
)


async def tokenize_prompts(ctx: ServerContext, prompts: list) -> list[list[int]]:
    """Each prompt (text or token ids) as token ids, text over any possible context refused first."""
    for prompt in prompts:
        if isinstance(prompt, str):
            ctx.check_text_length(len(prompt), "prompt")
    return await ctx.off_loop(lambda: [ctx.inputs.tokenize(p) for p in prompts])


async def render_completion(
    ctx: ServerContext, body: CompletionRequest, receive: Receive, log: ResponseLog
) -> Response:
    """vLLM's POST /v1/completions/render: each prompt's token ids, generating nothing (routers
    read it to place a request by its prefix)."""
    ctx.check_model(body.model)
    prompt_token_ids = [body.truncate(ids, ctx.max_model_len) for ids in await tokenize_prompts(ctx, body.prompts())]
    for ids in prompt_token_ids:  # ids a generation would refuse are refused here too
        ctx.validate(ids, SamplingParams(max_tokens=1))
    return JSONResponse([{"request_id": f"cmpl-{log.request_id}-{i}", "model": ctx.model_name, "token_ids": ids}
                         for i, ids in enumerate(prompt_token_ids)])


async def create_completion(
    ctx: ServerContext, body: CompletionRequest, receive: Receive, log: ResponseLog
) -> Response:
    ctx.check_model(body.model)
    prompts = body.prompts()
    if body.max_tokens == 0 and not body.echo:
        raise InvalidParameterError("max_tokens 0 generates nothing: it needs echo", param="max_tokens")
    # echo + logprobs: the prompt's tokens with their logprobs come first, as lm-eval reads them
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(body.max_tokens, body.logprobs, ctx.vocab_size,
                                  prompt_logprobs=max(echo_logprobs or 0, body.prompt_logprobs or 0)
                                  if echo_logprobs is not None else None)
    prompt_token_ids = [body.truncate(ids, ctx.max_model_len) for ids in await tokenize_prompts(ctx, prompts)]
    max_tokens = [ctx.validate(ids, params) for ids in prompt_token_ids]
    ctx.check_request_tokens(body.n * sum(len(ids) + m for ids, m in zip(prompt_token_ids, max_tokens)))
    await ctx.compile_grammar(params)
    ctx.check_accepting(len(prompts) * body.n)

    request_id = f"cmpl-{log.request_id}"
    log.is_generation = True
    log.prompt_tokens = sum(len(ids) for ids in prompt_token_ids)
    prompt_texts = [p if isinstance(p, str) and body.truncate_prompt_tokens is None else None for p in prompts]
    echoes = None
    if body.echo:
        echoes = await ctx.off_loop(lambda: [
            Echo(text if text is not None else ctx.inputs.decode(ids), ids, ctx.inputs.decode(ids[:1]))
            for text, ids in zip(prompt_texts, prompt_token_ids)])
    streams = [
        ctx.engine.generate(f"cmpl-{log.engine_id}-{i}", ids, params, prompt_text=text)
        for i, (ids, text) in enumerate(zip(prompt_token_ids, prompt_texts))
    ]
    header = {"id": request_id, "object": "text_completion", "created": now_seconds(), "model": ctx.model_name}
    if body.stream:
        return sse_response(_chunks(body, header, streams, echoes, log), log)
    finals = await run_unless_disconnected(collect(streams), receive)
    return JSONResponse(_response(body, header, finals, echoes, log))


@dataclass
class Echo:
    """A prompt as echoed back: its text, its tokens, and the text of its first token (which has no logprob)."""

    text: str
    token_ids: list[int]
    first_token_text: str


def _response(body: CompletionRequest, header: dict, finals: list[RequestOutput], echoes: list[Echo] | None,
              log: ResponseLog) -> dict:
    choices = []
    for prompt_index, final in enumerate(finals):
        echo = echoes[prompt_index] if echoes else None
        for sample in final.outputs:
            prefix = echo.text if echo else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(sample.logprobs or [], sample.token_ids, body.logprobs, len(prefix))
                if echo is not None:
                    logprobs = _joined(_echo_logprobs(echo, final.prompt_logprobs, body.logprobs), logprobs)
            choice = {
                "index": prompt_index * body.n + sample.index,
                "text": prefix + sample.text,
                "logprobs": logprobs,
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }
            if body.prompt_logprobs is not None and final.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
            choices.append(choice)
    log.completion_tokens = sum(len(s.token_ids) for f in finals for s in f.outputs)
    log.first_token_time = min((f.metrics.first_token_time or 0.0 for f in finals), default=None) or None
    return {**header, "choices": choices, "usage": usage(log.prompt_tokens, log.completion_tokens)}


async def _chunks(body: CompletionRequest, header: dict, streams: list[AsyncIterator[RequestOutput]],
                  echoes: list[Echo] | None, log: ResponseLog) -> AsyncIterator[dict]:
    tracker = ChoiceTracker(body.n)
    text_offsets: dict[int, int] = {}
    # with logprobs, a choice's echo waits for the prompt's logprobs, which come with its first output
    echo_pending = set()
    for prompt_index, echo in enumerate(echoes or []):
        for sample_index in range(body.n):
            index = prompt_index * body.n + sample_index
            text_offsets[index] = len(echo.text)
            if body.logprobs is None:
                yield _chunk(header, index, echo.text, None, None)
            else:
                echo_pending.add(index)
    async for updates in stream_updates(streams, tracker, log):
        for update in updates:
            if update.index in echo_pending and update.prompt_logprobs is not None:
                echo_pending.discard(update.index)
                echo = echoes[update.index // body.n]
                yield _chunk(header, update.index, echo.text,
                             _echo_logprobs(echo, update.prompt_logprobs, body.logprobs), None)
            logprobs = None
            if body.logprobs is not None:
                offset = text_offsets.get(update.index, 0)
                logprobs = _logprobs(update.logprobs or [], update.token_ids, body.logprobs, offset)
                text_offsets[update.index] = offset + sum(len(t) for t in logprobs["tokens"])
            elif not update.text and update.finish_reason is None:
                continue
            yield _chunk(header, update.index, update.text, logprobs, update.finish_reason, update.stop_reason)
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage(log.prompt_tokens, tracker.num_completion_tokens)}


def _chunk(header: dict, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
           stop_reason: int | str | None = None) -> dict:
    return {**header, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                   "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def _echo_logprobs(echo: Echo, prompt_logprobs: PromptLogprobs | None, num_top: int) -> dict:
    """The legacy logprobs object of an echoed prompt: its first token has no logprob (null)."""
    scored = _logprobs(prompt_logprobs[1:] if prompt_logprobs else [], echo.token_ids[1:], num_top,
                       len(echo.first_token_text))
    first = {"tokens": [echo.first_token_text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return _joined(first, scored)


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num_top: int, text_offset: int) -> dict:
    """The legacy completions logprobs object of these tokens, the first at text_offset."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({lp.decoded_token: lp.logprob for _, lp in top_entries(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
