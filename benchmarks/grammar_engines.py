"""llguidance vs xgrammar on our workload: tokenizer set-up, schema compile time, per-token mask
time at batch 1 and 32, and whether each refuses what it cannot enforce. The default model's
tokenizer. xgrammar is measured where it is importable (it is not a dependency: e.g.
`pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`, then PYTHONPATH=/tmp/xg).

    python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill.models.model_files import default_model_path, load_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
            "enum": ["a", "b", "c"]}}}, "required": ["id"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "when": {"type": "string", "format": "date"},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["code", "when", "score"]},
]
DOCUMENTS = [
    {"name": "Ada Lovelace", "age": 36},
    {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 22, "tags": []}, {"id": 333}]},
    {"code": "ABC-1234", "when": "2026-12-01", "score": 0.75},
]
UNENFORCEABLE = {"not": {"type": "string"}}  # a keyword neither implements: refused, or silently dropped?


def _ms(seconds: float) -> float:
    return seconds * 1e3


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance  # not llguidance.torch: its import pulls in torch._dynamo
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        row_bytes = bitmask.shape[1] * 4
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                  row_bytes, len(matchers))

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


def measure(engine_type, tokenizer, vocab_size: int, batch: int) -> dict:
    start = time.perf_counter()
    engine = engine_type(tokenizer, vocab_size)
    setup = time.perf_counter() - start
    compile_ms, mask1_us, mask_batch_ms = [], [], []
    for schema, doc in zip(SCHEMAS, DOCUMENTS):
        start = time.perf_counter()
        compiled = engine.compile(schema)
        compile_ms.append(_ms(time.perf_counter() - start))
        token_ids = tokenizer.encode(json.dumps(doc), add_special_tokens=False)
        one = engine.matcher(compiled)
        many = [engine.matcher(compiled) for _ in range(batch)]
        bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        for token_id in token_ids:
            start = time.perf_counter()
            engine.fill([one], bitmask)
            mask1_us.append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            engine.fill(many, bitmask)
            mask_batch_ms.append(_ms(time.perf_counter() - start))
            assert engine.accept(one, token_id) and all(engine.accept(m, token_id) for m in many), engine.name
    try:
        engine.compile(UNENFORCEABLE)
        refuses = False
    except Exception:
        refuses = True
    return {"engine": engine.name, "setup_s": setup, "compile_ms_p50": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms), "mask_us_p50_batch1": statistics.median(mask1_us),
            f"mask_ms_p50_batch{batch}": statistics.median(mask_batch_ms),
            f"mask_ms_p99_batch{batch}": sorted(mask_batch_ms)[int(0.99 * (len(mask_batch_ms) - 1))],
            "refuses_unenforceable": refuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    vocab_size = len(tokenizer)
    rows = []
    for engine_type in (Llguidance, Xgrammar):
        try:
            rows.append(measure(engine_type, tokenizer, vocab_size, args.batch))
        except ImportError as exc:
            print(f"{engine_type.name}: not installed ({exc.name}); skipped")
    keys = [k for k in rows[0] if k != "engine"]
    print(f"\n{'':<24}" + "".join(f"{r['engine']:>14}" for r in rows))
    for key in keys:
        print(f"{key:<24}" + "".join(f"{r[key]:>14.3f}" if isinstance(r[key], float) else f"{r[key]!s:>14}"
                                     for r in rows))
    print(json.dumps({"benchmark": "grammar_engines", "batch": args.batch, "rows": rows}))


if __name__ == "__main__":
    main()
