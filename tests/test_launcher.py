"""The launcher's DrainingServer: what SIGTERM/SIGINT do to a running server (the end-to-end runs,
through a real process, are in test_server_limits.py)."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import pytest
import uvicorn

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import ServerBusyError
from tokenmill.models.model_files import load_tokenizer, resolve_model_path
from tokenmill.server import launcher


def test_a_second_signal_inside_the_first_ones_handler_still_aborts_at_once(tiny_llm, monkeypatch):
    """Python may run a second signal's handler inside the first one's (between any two bytecodes),
    so the 'abort now' callback is queued before the 'drain for 30 s' one: the drain must stay short."""
    engine = tiny_llm.engine
    endless = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def body():
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        ctx = SimpleNamespace(engine=async_engine, draining=False, end_streams=lambda: None)
        server = launcher.DrainingServer(uvicorn.Config(app=None), ctx, drain_timeout=30.0)
        server._loop, server.started = asyncio.get_running_loop(), True
        log_info = launcher.logger.info

        def info_then_the_second_signal(message, *args):
            log_info(message, *args)
            if "draining" in message:  # inside the first handler, after `draining` is set
                server.handle_exit(signal.SIGTERM, None)

        monkeypatch.setattr(launcher.logger, "info", info_then_the_second_signal)
        outputs = []

        async def read():
            async for output in async_engine.generate("long", engine.tokenize("The mill turns"), endless):
                outputs.append(output)

        reader = asyncio.ensure_future(read())
        while not outputs:
            await asyncio.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
        try:
            with pytest.raises(ServerBusyError, match="shutting down"):
                await asyncio.wait_for(reader, 10)
            for _ in range(200):
                if server.should_exit:
                    break
                await asyncio.sleep(0.05)
            return server.should_exit, sum(len(o.outputs[0].token_ids) for o in outputs)
        finally:
            await async_engine.shutdown()

    should_exit, num_tokens = asyncio.run(body())
    assert should_exit and num_tokens < 480
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_the_tokenizer_and_the_servers_copy_are_made_while_the_engine_loads(monkeypatch):
    """serve() loads a GGUF's cached tokenizer, with the --chat-template, and ServerContext's copy of
    it before it waits for the engine process; once the engine is ready neither is made again (the
    copy was ~0.2 s of every start-up). Another model's tokenizer is loaded, and copied, as before."""
    path = resolve_model_path(None)
    load_tokenizer(path)  # the cache entry a first start writes
    early = launcher._tokenizer_loaded_meanwhile(None, "{{ messages[0].content }}!")
    assert early.tokenizer is not None and early.server_copy is not None and early.server_copy is not early.tokenizer
    text = "The mill turns; the miller sings."
    assert early.server_copy.encode(text) == early.tokenizer.encode(text)
    for tokenizer in (early.tokenizer, early.server_copy):
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
    monkeypatch.setattr(launcher, "_load_tokenizer", lambda info: "loaded after the engine")
    assert early.for_engine(SimpleNamespace(model_path=str(path))) is early.tokenizer
    assert early.server_copy_of(early.tokenizer) is early.server_copy
    assert early.for_engine(SimpleNamespace(model_path=str(path) + ".other")) == "loaded after the engine"
    assert early.server_copy_of("loaded after the engine") is None  # ServerContext copies that one itself
    assert launcher._tokenizer_loaded_meanwhile(str(path) + ".missing").for_engine(None) == "loaded after the engine"
