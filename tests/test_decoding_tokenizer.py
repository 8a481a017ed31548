"""The DecodingTokenizer an engine process loads without transformers: it must decode, name EOS and
compile grammars exactly as the transformers tokenizer it was saved from."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tokenmill.engine.structured_output import GrammarCompiler, token_bitmasks
from tokenmill.models import decoding_tokenizer
from tokenmill.models.decoding_tokenizer import DecodingTokenizer
from tokenmill.models.model_files import load_decoding_tokenizer
from tokenmill.sampling_params import StructuredOutputsParams

VOCAB = 49152


def _saved(tokenizer, tmp_path: Path) -> DecodingTokenizer:
    entry = tmp_path / "entry.json"
    decoding_tokenizer.save(tokenizer, entry)
    read = decoding_tokenizer.read(entry)
    assert isinstance(read, DecodingTokenizer)
    return read


def test_decodes_every_token_and_mixed_sequences_as_transformers_does(tokenizer, tmp_path):
    decoding = _saved(tokenizer, tmp_path)
    assert decoding.eos_token_id == tokenizer.eos_token_id
    for skip in (False, True):
        for token_id in range(len(tokenizer)):
            assert decoding.decode([token_id], skip) == tokenizer.decode(
                [token_id], skip_special_tokens=skip, clean_up_tokenization_spaces=False), token_id
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(24)]
        for skip in (False, True):
            assert decoding.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_grammars_over_it_allow_what_they_allow_over_transformers(tokenizer, tmp_path):
    decoding = _saved(tokenizer, tmp_path)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]})
    matchers = [GrammarCompiler(t, VOCAB, [t.eos_token_id]).compile(spec).new_matcher() for t in (tokenizer, decoding)]
    for token_id in [*tokenizer.encode('{"n": 42}', add_special_tokens=False), tokenizer.eos_token_id]:
        masks = token_bitmasks(matchers)
        assert torch.equal(masks[0], masks[1]) and 0 < int((masks[0] != 0).sum())
        assert all(m.accept(token_id) for m in matchers)
    assert all(m.is_terminated for m in matchers)


def test_a_damaged_or_other_format_entry_reads_as_none(tokenizer, tmp_path, caplog):
    entry = tmp_path / "entry.json"
    assert decoding_tokenizer.read(entry) is None  # none yet
    decoding_tokenizer.save(tokenizer, entry)
    saved = json.loads(entry.read_text())
    entry.write_text(json.dumps({**saved, "format": decoding_tokenizer.FORMAT + 1}))
    assert decoding_tokenizer.read(entry) is None
    entry.write_text(json.dumps({**saved, "tokenizer": "{not json"}))
    assert decoding_tokenizer.read(entry) is None
    entry.write_text(entry.read_text()[:100])
    assert decoding_tokenizer.read(entry) is None
    assert "ignoring the cached decoding tokenizer" in caplog.text


def test_a_tokenizer_that_cleans_up_spaces_gets_no_entry(tokenizer, tmp_path):
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    decoding_tokenizer.save(cleaning, tmp_path / "entry.json")
    assert not (tmp_path / "entry.json").exists()


def test_an_entry_serves_until_a_file_of_the_model_changes(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = Path(shutil.copytree(tokenizer_dir, tmp_path / "model"))
    assert not isinstance(load_decoding_tokenizer(model), DecodingTokenizer)  # transformers, then saved
    assert isinstance(load_decoding_tokenizer(model), DecodingTokenizer)
    config = model / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert not isinstance(load_decoding_tokenizer(model), DecodingTokenizer)
    assert isinstance(load_decoding_tokenizer(model), DecodingTokenizer)


_ENGINE_SCRIPT = """
import json, sys
from tokenmill.config import EngineConfig, CacheConfig
from tokenmill.engine.engine_process import serving_engine
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
engine = serving_engine(EngineConfig(model=sys.argv[1], dtype="float32", cache=CacheConfig(num_blocks=64)))
params = [SamplingParams(temperature=0.0, max_tokens=24, stop=["e"], logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,20}"))]
for index, p in enumerate(params):
    engine.add_request(str(index), [1, 504, 3458, 314, 260], p)
texts = {}
while engine.has_unfinished_requests():
    for output in engine.step():
        if output.finished:
            sample = output.outputs[0]
            texts[output.request_id] = [sample.text, sample.finish_reason,
                                        [[lp.decoded_token for lp in step.values()] for step in sample.logprobs or []]]
print(json.dumps({"tokenizer": type(engine.tokenizer).__name__, "transformers": "transformers" in sys.modules,
                  "texts": texts}))
"""


def test_a_serving_engine_decodes_without_transformers_once_its_entry_is_saved(tiny_llama_dir, tmp_path):
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path)}

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_llama_dir)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    first, second = run(), run()
    assert first["tokenizer"] != "DecodingTokenizer" and first["transformers"]
    assert second["tokenizer"] == "DecodingTokenizer" and not second["transformers"]
    assert second["texts"] == first["texts"]
    assert first["texts"]["0"][1] == "stop" and first["texts"]["0"][2]  # the stop string and logprobs ran
    assert 5 <= len(first["texts"]["1"][0]) <= 20
