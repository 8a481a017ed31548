"""Incremental detokenization with stop strings.

Text is emitted only once it is final: a token that ends inside a multi-byte character
decodes to U+FFFD and is held until the character completes, and text that could still
be the beginning of a stop string is held until it can no longer match.
"""

from __future__ import annotations

from tokenmill.sampling_params import SamplingParams

# Prompt tokens kept as left context, so the first output token decodes with the
# spacing it has in context.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params or SamplingParams()
        self.skip_special_tokens = self.params.skip_special_tokens
        self.stop_strings = self.params.stop_strings
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.num_emitted = 0  # chars of self.text already returned
        self.stop_string: str | None = None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_token(self, token_id: int, flush: bool = False) -> str:
        """Feed one token; returns the text that became final. flush=True on the last token."""
        self.token_ids.append(token_id)
        self.num_output_tokens += 1
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and (flush or not full_text.endswith("\ufffd")):
            self._append(full_text[len(prefix_text) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._take(final=flush)

    def finish(self) -> str:
        """The request ended without a new token to feed: release any held text."""
        if self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full_text = self._decode(self.token_ids[self.prefix_offset :])
            self._append(full_text[len(prefix_text) :])
            self.prefix_offset = self.read_offset = len(self.token_ids)
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        if self.stop_string is not None:
            return
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if not self.stop_strings or not self.params.may_stop_at(self.num_output_tokens):
            return
        found = [(i, s) for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
        if found:
            index, stop = min(found)
            self.text = self.text[: index + len(stop) if self.params.include_stop_str_in_output else index]
            self.stop_string = stop

    def _take(self, final: bool) -> str:
        if final or self.stop_string is not None:
            end = len(self.text)
        else:
            end = max(self.num_emitted, len(self.text) - self.hold)
        piece = self.text[self.num_emitted : end]
        self.num_emitted = end
        return piece
