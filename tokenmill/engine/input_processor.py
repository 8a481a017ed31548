"""Prompts before they are requests: their accepted shapes, chat templates, tokenization.

The offline API, the CLI and the server all go through here, so a prompt means the same thing
wherever it comes from. The server uses its own InputProcessor (around its own copy of the
tokenizer: HF fast tokenizers must not be shared across threads).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.errors import InvalidParameterError

PromptType = str | list[int]  # text, or token ids
Conversation = list[dict]  # chat messages: {"role": ..., "content": ...}


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text or token ids) or a list of prompts, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidParameterError("the prompt is empty", param="prompt")
    return prompts


class InputProcessor:
    """Tokenizes prompts and renders conversations with one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest token in the vocabulary (as the tokenizer spells it, an upper
        bound of its text): a text longer than max_model_len times this can never fit the context."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))
        return self._max_token_chars

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt; token-id prompts pass through as they are."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return list(prompt)

    def render_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The conversation (and the tools it may call) as the model's chat template writes it."""
        if not self.tokenizer.chat_template:
            raise InvalidParameterError("this model has no chat template", param="messages")
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order)
            raise InvalidParameterError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def tokenize_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The rendered conversation and its token ids (the template writes the special tokens)."""
        prompt = self.render_chat(conversation, add_generation_prompt, tools)
        return prompt, self.tokenize(prompt, add_special_tokens=False)
