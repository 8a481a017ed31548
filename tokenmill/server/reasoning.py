"""Reasoning models (--reasoning-parser): the text a model writes between <think> and </think> goes
to `reasoning_content`, out of `content` (and out of what the tool-call parser reads).

qwen3: the reply opens with <think> itself (a reply without it is all content, as with
enable_thinking off). deepseek_r1: the chat template already opened the block, so everything up
to </think> is reasoning (all of it, if the reply was cut off before the tag).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningParser:
    name: str
    opens_itself: bool  # the reply writes <think> (qwen3) or the template did (deepseek_r1)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif self.opens_itself:
            return None, text
        if END not in body:
            return body.strip() or None, ""
        reasoning, content = body.split(END, 1)
        return reasoning.strip() or None, content.lstrip()


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", opens_itself=True),
                     "deepseek_r1": ReasoningParser("deepseek_r1", opens_itself=False)}


@dataclass
class ReasoningStream:
    """Splits a streamed reply as it comes, as `split` splits the whole: each piece of text goes to
    reasoning or to content, holding back only what could still be part of a tag or whitespace
    that `split` would strip."""

    parser: ReasoningParser
    text: str = ""
    num_routed: int = 0  # characters of `text` given out (or dropped)
    phase: str = "start"  # start -> reasoning -> content
    reasoning_started: bool = False
    after_reasoning: bool = False
    content_started: bool = False

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) that `piece` makes certain (all of the rest when finished)."""
        self.text += piece
        if self.phase == "start" and not self._open(finished):
            return "", ""
        reasoning = ""
        if self.phase == "reasoning":
            while not self.reasoning_started and self.num_routed < len(self.text) \
                    and self.text[self.num_routed].isspace():
                self.num_routed += 1  # split() strips the reasoning
            end = self.text.find(END, self.num_routed)
            if end < 0:
                safe = len(self.text) if finished else _safe_end(self.text, self.num_routed, END)
                while safe > self.num_routed and self.text[safe - 1].isspace():
                    safe -= 1
                reasoning, self.num_routed = self.text[self.num_routed:safe], safe
                self.reasoning_started = self.reasoning_started or bool(reasoning)
                return reasoning, ""
            reasoning = self.text[self.num_routed:end].rstrip()
            self.phase, self.num_routed, self.after_reasoning = "content", end + len(END), True
        pending = self.text[self.num_routed:]
        if self.after_reasoning and not self.content_started:
            stripped = pending.lstrip()
            self.num_routed += len(pending) - len(stripped)
            pending = stripped
        self.content_started = self.content_started or bool(pending)
        self.num_routed = len(self.text)
        return reasoning, pending

    def _open(self, finished: bool) -> bool:
        """Decide, once enough has come, whether the reply opens a reasoning block."""
        body = self.text.lstrip()
        if body.startswith(START):
            self.phase, self.num_routed = "reasoning", len(self.text) - len(body) + len(START)
        elif finished or not START.startswith(body):
            self.phase = "content" if self.parser.opens_itself else "reasoning"
        else:
            return False  # may still become <think>
        return True


def _safe_end(text: str, start: int, tag: str) -> int:
    """Where text can be cut without splitting a `tag` that may be starting at its end."""
    for keep in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
