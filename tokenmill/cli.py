"""Command line: `tokenmill generate "prompt"` streams a completion to stdout."""

from __future__ import annotations

import argparse
import sys

from tokenmill.errors import TokenmillError


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine_core import LLMEngine
    from tokenmill.config import EngineConfig, SchedulerConfig
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    scheduler=SchedulerConfig(max_model_len=args.max_model_len)))
    prompt = args.prompt
    if args.chat:
        tokenizer = engine.tokenizer
        if not tokenizer.chat_template:
            raise TokenmillError("--chat: this model has no chat template")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    engine.add_request("cli", prompt, params, add_special_tokens=not args.chat)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.deltas.get(0, ""))
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to PROMPT")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
