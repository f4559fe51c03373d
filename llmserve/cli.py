"""The `llmserve` command: serve, generate, and each service on its own."""
from __future__ import annotations

import argparse
import signal
import sys
import time

import grpc


def _serve(argv: list[str]) -> int:
    from services.common.config import add_engine_args, engine_config_from_args
    from llmserve.launcher import LocalStack

    parser = argparse.ArgumentParser(prog="llmserve serve",
                                     description="Start the frontend, engine core and worker.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    stack = LocalStack(engine_config_from_args(args), host=args.host, port=args.port)
    # Explicit handlers: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_keyboard_interrupt)
    try:
        address = stack.start()
        print(f"llmserve: serving {args.model} on {address} (Ctrl-C stops)", flush=True)
        while all(s.process.poll() is None for s in stack.services):
            time.sleep(0.5)
        dead = [s.name for s in stack.services if s.process.poll() is not None]
        print(f"llmserve: {', '.join(dead)} exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _generate(argv: list[str]) -> int:
    from llmserve.client import Client

    parser = argparse.ArgumentParser(prog="llmserve generate",
                                     description="Stream a completion from a running server.")
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-chat", action="store_true",
                        help="send the prompt as is instead of through the chat template")
    args = parser.parse_args(argv)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    inputs = ({"prompt": args.prompt} if args.no_chat
              else {"chat": [{"role": "user", "content": args.prompt}]})
    with Client(args.address) as client:
        try:
            for response in client.generate(**inputs, **sampling):
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nllmserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
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
