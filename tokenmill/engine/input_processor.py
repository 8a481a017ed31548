"""Prompts before they are requests: their accepted shapes, chat templates, tokenization.

The offline API, the CLI and the server all go through here, so a prompt means the same thing
wherever it comes from. The server uses its own InputProcessor (around its own copy of the
tokenizer: HF fast tokenizers must not be shared across threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from tokenmill.errors import InvalidParameterError


class TextPrompt(TypedDict):
    """vLLM's dict form of a text prompt."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's dict form of a token-id prompt."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt  # text, or token ids, bare or in vLLM's dicts
Conversation = list[dict]  # chat messages: {"role": ..., "content": ...}


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    """One prompt or a list of them, as a list of texts and token-id lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = [_bare_prompt(p) for p in prompts]
    if not prompts:
        raise InvalidParameterError("the prompt is empty", param="prompt")
    return prompts


def _is_token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _bare_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, dict):
        if "multi_modal_data" in prompt:
            raise InvalidParameterError("multi_modal_data is not supported: this model takes text only",
                                        param="prompt")
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"} and _is_token_ids(prompt["prompt_token_ids"]):
            return list(prompt["prompt_token_ids"])
        raise InvalidParameterError("a prompt dict holds exactly one of 'prompt' (a text) and 'prompt_token_ids' (a "
                                    f"list of token ids), not {sorted(prompt)}", param="prompt")
    raise InvalidParameterError(f"a prompt is a text, a list of token ids or a dict of either, not "
                                f"{type(prompt).__name__}", param="prompt")


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
                    tools: list[dict] | None = None, *, continue_final_message: bool = False,
                    template_kwargs: dict | None = None, chat_template: str | None = None) -> str:
        """The conversation (and the tools it may call) as the model's chat template writes it.
        continue_final_message: end the text inside the last message (for the model to go on with
        it) rather than after it; template_kwargs: more variables for the template (vLLM's
        chat_template_kwargs, e.g. Qwen3's enable_thinking); chat_template: another template (the
        offline API's; the server takes its own at start)."""
        if not (chat_template or self.tokenizer.chat_template):
            raise InvalidParameterError("this model has no chat template", param="messages")
        template_kwargs = check_chat_template_kwargs(template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise InvalidParameterError("continue_final_message and add_generation_prompt cannot both be true",
                                        param="continue_final_message")
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      chat_template=chat_template, **template_kwargs)
        except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order)
            raise InvalidParameterError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def tokenize_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, *, continue_final_message: bool = False,
                      template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The rendered conversation and its token ids (the template writes the special tokens)."""
        prompt = self.render_chat(conversation, add_generation_prompt, tools,
                                  continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return prompt, self.tokenize(prompt, add_special_tokens=False)


# Names the template's own arguments take (apply_chat_template's parameters and the conversation
# itself): a kwarg of these would replace what we pass or fail inside transformers.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_chat_template_kwargs(kwargs: dict | None) -> dict:
    """The extra template variables, or an error naming one the template's own arguments take."""
    if not kwargs:
        return {}
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidParameterError(f"chat_template_kwargs has a key that is not a name: {name!r}",
                                        param="chat_template_kwargs")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameterError(f"chat_template_kwargs cannot set {name!r} (give it as its own field)",
                                        param="chat_template_kwargs")
    return dict(kwargs)
