"""Offline API: LLM.generate and LLM.chat, in vLLM's shapes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.engine_core import LLMEngine
from tokenmill.engine.engine_info import EngineStats
from tokenmill.engine.input_processor import Conversation, PromptType, normalize_prompts
from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams


class LLM:
    """Batch generation with the tokenmill engine.

    >>> llm = LLM()  # the default model, SmolLM2-135M-Instruct
    >>> llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | float | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        device: str = "auto",
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        tensor_parallel_size: int = 1,
        quantization: str | None = None,
        enforce_eager: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or block_size < 1:
            raise InvalidParameterError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        # kv_cache_memory: bytes, or a float in (0, 1] meaning that share of the available memory
        kv_fraction = None
        if isinstance(kv_cache_memory, float):
            if not 0.0 < kv_cache_memory <= 1.0:
                raise InvalidParameterError("kv_cache_memory as a fraction must be in (0, 1]", param="kv_cache_memory")
            kv_fraction, kv_cache_memory = kv_cache_memory, None
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            quantization=quantization,
            enforce_eager=enforce_eager,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                kv_cache_memory_fraction=kv_fraction,
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_kv_blocks,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
        )
        self.engine = LLMEngine(config)
        self._counter = itertools.count()

    def close(self) -> None:
        """Release tensor-parallel worker processes (nothing to do on one device)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        return self._run([(p, True) for p in normalize_prompts(prompts)], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat template
        (vLLM's arguments: go on with the last message instead of starting a reply, more template
        variables such as Qwen3's enable_thinking, tools rendered into the prompt, another template)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [(self.apply_chat_template(c, add_generation_prompt, continue_final_message=continue_final_message,
                                             chat_template_kwargs=chat_template_kwargs, tools=tools,
                                             chat_template=chat_template), False)
                   for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, chat_template: str | None = None) -> str:
        return self.engine.input_processor.render_chat(conversation, add_generation_prompt, tools,
                                                       continue_final_message=continue_final_message,
                                                       template_kwargs=chat_template_kwargs,
                                                       chat_template=chat_template)

    def _run(
        self,
        prompts: list[tuple[PromptType, bool]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidParameterError(
                f"got {len(params_list)} SamplingParams for {len(prompts)} prompts", param="sampling_params"
            )
        engine = self.engine
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        tokenized = []
        for (prompt, add_special), params in zip(prompts, params_list):
            ids = engine.tokenize(prompt, add_special)
            engine.validate_request(ids, params)
            tokenized.append((prompt, ids))
        order: dict[str, int] = {}
        for i, ((prompt, ids), params) in enumerate(zip(tokenized, params_list)):
            request_id = f"offline-{next(self._counter)}"
            order[request_id] = i
            engine.add_request(request_id, ids, params, prompt_text=prompt if isinstance(prompt, str) else None,
                               output_kind=OutputKind.FINAL_ONLY)
        results: list[RequestOutput | None] = [None] * len(prompts)
        progress = _progress_bar(len(prompts)) if use_tqdm and len(prompts) > 1 else None
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.error is not None:
                        raise output.error
                    if output.finished:
                        results[order[output.request_id]] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            for request_id, i in order.items():
                if results[i] is None:
                    engine.abort_request(request_id)
        return results  # type: ignore[return-value]


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
