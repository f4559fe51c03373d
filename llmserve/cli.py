"""The `llmserve` command: serve, generate, and each service on its own."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import grpc


def _serve(argv: list[str]) -> int:
    from services.common.config_cli import (add_engine_args, engine_config_from_args,
                                            parse_args_refusing_vllm_flags)
    from services.common.auth import add_api_key_arg
    from services.common.ports import add_optional_port_arg, add_port_arg
    from services.common.server import add_drain_arg
    from services.common.tls import add_tls_args, tls_from_args
    from llmserve.launcher import LocalStack

    parser = argparse.ArgumentParser(prog="llmserve serve",
                                     description="Start the frontend, engine core and worker.")
    parser.add_argument("--host", default="127.0.0.1")
    add_port_arg(parser, "--port", 50051, "the public Inference gRPC API's port")
    parser.add_argument("--engine-replicas", type=int, default=1,
                        help="engine cores (each with its own worker) behind the frontend")
    add_optional_port_arg(parser, "--http-port", 8000, "the OpenAI-compatible HTTP API's port")
    add_optional_port_arg(parser, "--metrics-port", None,
                          "Prometheus metrics: the frontend on this port, engine core i on "
                          "+1+i, then the workers (0: a free port each)")
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                        help="LoRA adapters to serve from the start (with --enable-lora)")
    add_drain_arg(parser)
    add_tls_args(parser)
    add_api_key_arg(parser)
    add_engine_args(parser)
    args = parse_args_refusing_vllm_flags(parser, argv)
    stack = LocalStack(engine_config_from_args(args), host=args.host, port=args.port,
                       engine_replicas=args.engine_replicas, http_port=args.http_port,
                       metrics_port=args.metrics_port,
                       drain_timeout_s=args.drain_timeout, restart_dead=True,
                       tls=tls_from_args(args), api_key=args.api_key,
                       lora_modules=args.lora_modules)
    # Explicit handlers: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_keyboard_interrupt)
    try:
        address = stack.start()
        http = f", OpenAI HTTP API on http://{stack.http_address}" if stack.http_address else ""
        print(f"llmserve: serving {args.model} on {address} (gRPC){http} (Ctrl-C stops)",
              flush=True)
        if stack.metrics_addresses:
            print("llmserve: metrics at " + ", ".join(
                f"{name} http://{a}/metrics" for name, a in stack.metrics_addresses.items()),
                flush=True)
        # Dead workers and engine cores are started again (see supervisor.py); the
        # frontend's death stops everything.
        frontend = next(s for s in stack.services if s.name == "frontend")
        while frontend.process.poll() is None:
            time.sleep(0.5)
        print("llmserve: the frontend exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


_SCALAR_SAMPLING_FLAGS = ["n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
                          "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                          "seed", "logprobs", "prompt_logprobs"]


def _generate(argv: list[str]) -> int:
    from google.protobuf.json_format import MessageToDict

    from llmserve.client import Client
    from services.common.sampling_params import OutputKind, SamplingParams

    defaults = SamplingParams(max_tokens=256, temperature=0.0)
    parser = argparse.ArgumentParser(prog="llmserve generate",
                                     description="Stream a completion from a running server.")
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--no-chat", action="store_true",
                        help="send the prompt as is instead of through the chat template")
    parser.add_argument("--json", action="store_true",
                        help="print every response message as a line of JSON")
    parser.add_argument("--request-id")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--lora-name",
                        help="a LoRA adapter the server has loaded (--lora-modules, or "
                             "LoadLoraAdapter); the base model when not given")
    parser.add_argument("--timeout", type=float, help="deadline in seconds")
    for name in _SCALAR_SAMPLING_FLAGS:
        default = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=default,
                            type=float if isinstance(default, float) else int,
                            help=f"default: {default}")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                        default=[], help="a stop token id (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--include-stop-str-in-output", action="store_true")
    parser.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false")
    args = parser.parse_args(argv)
    params = SamplingParams(output_kind=OutputKind.DELTA, **{
        f: getattr(args, f) for f in _SCALAR_SAMPLING_FLAGS + [
            "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
            "skip_special_tokens"]})
    inputs = ({"prompt": args.prompt} if args.no_chat
              else {"chat": [{"role": "user", "content": args.prompt}]})
    texts: dict[int, list[str]] = {}
    with Client(args.address) as client:
        try:
            for response in client.generate(**inputs, sampling=params, timeout=args.timeout,
                                            request_id=args.request_id, priority=args.priority,
                                            lora_name=args.lora_name):
                if args.json:
                    print(json.dumps(MessageToDict(response)), flush=True)
                elif params.n == 1:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                else:
                    texts.setdefault(response.index, []).append(response.text)
        except grpc.RpcError as e:
            print(f"\nllmserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    for index in sorted(texts):
        print(f"--- choice {index} ---\n{''.join(texts[index])}")
    if not args.json and params.n == 1:
        sys.stdout.write("\n")
    return 0


def _service(module: str):
    def run(argv: list[str]) -> int:
        import importlib
        importlib.import_module(module).main(argv)
        return 0
    return run


COMMANDS = {
    "serve": _serve,
    "generate": _generate,
    "bench": _service("bench.__main__"),
    "frontend": _service("services.frontend.__main__"),
    "engine-core": _service("services.engine_core.__main__"),
    "worker": _service("services.worker.__main__"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: llmserve {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[argv[0]](argv[1:]))


if __name__ == "__main__":
    main()
