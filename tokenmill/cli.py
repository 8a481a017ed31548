"""Command line: `tokenmill generate "prompt"` streams a completion to stdout."""

from __future__ import annotations

import argparse
import sys

from tokenmill.errors import TokenmillError


QUANTIZATION_ARGS = ["auto", "none", "int8", "int4"]
KV_CACHE_DTYPE_HELP = "what the KV cache holds: auto is the model's dtype; a float32 model may keep float16 or bfloat16"
QUANTIZATION_HELP = ("weights: auto keeps a GGUF's own quantization (HF models stay in --dtype), none dequantizes, "
                     "int8/int4 quantize the linears at load (group-wise, round to nearest)")
ENFORCE_EAGER_HELP = "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs"


def _quantization(arg: str) -> str | None:
    return None if arg == "auto" else arg


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine_core import LLMEngine
    from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    quantization=_quantization(args.quantization),
                                    tensor_parallel_size=args.tensor_parallel_size, rendezvous=args.rendezvous,
                                    enforce_eager=args.enforce_eager,
                                    cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
                                    scheduler=SchedulerConfig(max_model_len=args.max_model_len)))
    try:
        return _stream_generation(engine, args, params)
    finally:
        engine.shutdown()


def _stream_generation(engine, args: argparse.Namespace, params) -> int:
    from tokenmill.outputs import OutputKind

    if args.chat:
        prompt, prompt_token_ids = engine.input_processor.tokenize_chat([{"role": "user", "content": args.prompt}])
        engine.add_request("cli", prompt_token_ids, params, prompt_text=prompt, output_kind=OutputKind.DELTA)
    else:
        engine.add_request("cli", args.prompt, params, output_kind=OutputKind.DELTA)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error is not None:
                raise output.error
            sys.stdout.write(output.outputs[0].text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.server.launcher import ServeOptions, serve

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise TokenmillError("--max-queued-requests must be at least 1")
    if args.data_parallel_size < 1:
        raise TokenmillError("--data-parallel-size must be at least 1")
    options = ServeOptions(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})
    options.quantization = _quantization(options.quantization)
    return serve(options)


def _add_serve_parser(sub) -> None:
    from tokenmill.server.reasoning import REASONING_PARSERS
    from tokenmill.server.tool_calls import TOOL_PARSERS

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    serve.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help=KV_CACHE_DTYPE_HELP)
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="waiting requests beyond this get 503 with Retry-After")
    serve.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="S",
                       help="abort a request whose client has read nothing for S seconds")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                       help="on SIGTERM/SIGINT, let in-flight requests finish for up to S seconds")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="auto")
    serve.add_argument("--quantization", default="auto", choices=QUANTIZATION_ARGS, help=QUANTIZATION_HELP)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--log-prompts", action="store_true",
                       help="include request bodies in the access log, and texts in the console's recent requests")
    serve.add_argument("--no-ui", dest="ui", action="store_false", help="do not serve the web console at /")
    serve.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                       help="step the engine on this process's main thread instead of a process of its own")
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="N engine processes (replicas), each on an equal share of the CPUs")
    serve.add_argument("--routing", choices=["cache_aware", "round_robin"], default="cache_aware",
                       help="how requests are spread over replicas: longest cached prefix, else least loaded")
    serve.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                       help="where replicas run: engine processes on this machine (mp), or Ray actors spread "
                            "over the nodes of a running Ray cluster (RAY_ADDRESS, else 'auto')")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template to use instead of the model's")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how to read tool calls (default: from the chat template's format)")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="put a reasoning model's <think> text in reasoning_content, out of content")
    serve.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=16 * 1024 * 1024)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--cost-per-hour", type=float, default=None,
                       help="what the machine costs; enables live cost per 1M tokens in /metrics")
    serve.add_argument("--peak-tflops", type=float, default=None,
                       help="device peak for MFU (default: measured on CPU, catalog on known GPUs)")
    serve.add_argument("--peak-bandwidth-gbs", type=float, default=None, help="device peak for MBU")
    serve.add_argument("--metrics-window", type=float, default=60.0, metavar="S",
                       help="sliding window of the utilization and cost gauges")
    serve.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split the model over N processes (gloo on CPU, NCCL on GPUs)")
    serve.add_argument("--enforce-eager", action="store_true", help=ENFORCE_EAGER_HELP)
    serve.set_defaults(func=_serve, rendezvous=None)


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
    gen.add_argument("--quantization", default="auto", choices=QUANTIZATION_ARGS, help=QUANTIZATION_HELP)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help=KV_CACHE_DTYPE_HELP)
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over N processes")
    gen.add_argument("--enforce-eager", action="store_true", help=ENFORCE_EAGER_HELP)
    gen.set_defaults(func=_generate, rendezvous=None)
    _add_serve_parser(sub)
    from tokenmill.plan.report import add_parser as add_plan_parser

    add_plan_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks: a server under load, or continuous vs static batching")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenmill.bench import offline, serve

    serve.add_parser(bench_sub)
    offline.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("serve", "generate"):
            from tokenmill.executor.rendezvous import torchrun_rendezvous

            launch = torchrun_rendezvous()
            if launch is not None:  # started by torchrun: rank 0 runs the engine, the others are its workers
                rank, rendezvous = launch
                if rank > 0:
                    from tokenmill.executor.tp_worker import main as worker_main

                    return worker_main([rendezvous.host, str(rendezvous.port), str(rank),
                                        str(rendezvous.world_size)])
                args.tensor_parallel_size, args.rendezvous = rendezvous.world_size, rendezvous
        return args.func(args)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
