"""DecodingTokenizer: what an engine whose server tokenizes needs of a tokenizer.

An engine process (and a Ray replica) gets prompts as token ids; its tokenizer only turns output
tokens into text, names the EOS token and gives llguidance the tokenizer to compile grammars
against. transformers' fast tokenizer does all that through the `tokenizers` library; this reads
the very state transformers built (its backend's JSON, saved once per model by save()) with
`tokenizers` alone, so an engine never imports transformers: ~1.1 s of every start-up and ~70 MB
resident.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what save() writes changes


@dataclass
class DecodingTokenizer:
    """Token ids to text, as transformers' fast tokenizer decodes them (without its clean-up of
    spaces: save() writes no entry for a tokenizer that would clean up)."""

    backend_tokenizer: Tokenizer  # the name transformers gives it (structured_output reads it)
    eos_token_id: int | None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def read(entry: Path) -> DecodingTokenizer | None:
    """The DecodingTokenizer saved in `entry`, or None where there is none or it is damaged."""
    try:
        saved = json.loads(entry.read_text())
        if saved.get("format") != FORMAT:
            return None
        return DecodingTokenizer(Tokenizer.from_str(saved["tokenizer"]), saved["eos_token_id"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable, not JSON, a key missing, or what tokenizers raises
        logger.warning("ignoring the cached decoding tokenizer %s: %s", entry, str(exc).splitlines()[0])
        return None


def save(tokenizer, entry: Path) -> None:
    """Save what a DecodingTokenizer needs of transformers' `tokenizer`, where it decodes the same:
    a fast tokenizer that does not clean up spaces. Written beside `entry` and renamed into place;
    a cache that cannot be written only costs the next start its time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return
    text = json.dumps({"format": FORMAT, "eos_token_id": tokenizer.eos_token_id, "tokenizer": backend.to_str()})
    scratch = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(scratch, entry)
    except OSError as exc:
        logger.warning("could not cache the decoding tokenizer in %s: %s", entry, exc)
        if scratch is not None:
            Path(scratch).unlink(missing_ok=True)
