"""python -m services.frontend: serve the public Inference API over gRPC and the
OpenAI-compatible HTTP API, from one process and event loop."""
from __future__ import annotations

import argparse
import asyncio

from services.common.auth import add_api_key_arg
from services.common.config_cli import add_model_flag
from services.common.metrics import ServiceMetrics, add_metrics_port_arg
from services.common.model_store import resolve_model, served_model_name
from services.common.pb import inference_pb2, inference_pb2_grpc
from services.common.ports import add_optional_port_arg, add_port_arg
from services.common.server import (ServiceServer, add_drain_arg, add_health_port_arg,
                                    run_service)
from services.common.tls import add_tls_args, tls_from_args
from services.frontend.async_llm import AsyncLLM
from services.frontend.engine_addresses import parse_engine_addresses
from services.frontend.metrics import FrontendMetrics
from services.frontend.openai_api.app import build_app
from services.frontend.openai_api.http_server import HttpServer
from services.frontend.router import EngineRouter
from services.frontend.processor import Processor
from services.frontend.servicer import InferenceServicer
from services.common.tokenizer import load_tokenizer

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve frontend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    add_port_arg(parser, "--port", 50051, "the public Inference gRPC API's port")
    parser.add_argument("--port-file", help="write host:port here once serving")
    parser.add_argument("--engine-core-addresses", "--engine-core-address", required=True,
                        type=_engine_addresses,
                        help="the engine-core replicas: comma-separated host:port, or "
                             "dns:[//dns-server/]name:port for every address of a DNS name "
                             "(a Kubernetes headless Service), resolved again and again")
    parser.add_argument("--dns-refresh-interval", type=float, default=5.0,
                        help="seconds between lookups of a dns: engine-core address")
    parser.add_argument("--engine-wait-timeout", type=float, default=120.0,
                        help="seconds to wait at start for the engine cores to answer")
    add_model_flag(parser)
    add_optional_port_arg(parser, "--http-port", 8000, "the OpenAI-compatible HTTP API's port")
    parser.add_argument("--http-host", help="its host (default: --host)")
    parser.add_argument("--lora-modules", nargs="*", default=[], type=_lora_module,
                        metavar="NAME=PATH", help="LoRA adapters to load at start (the "
                        "engine cores need --enable-lora)")
    add_metrics_port_arg(parser)
    add_drain_arg(parser)
    add_health_port_arg(parser)
    add_tls_args(parser)
    add_api_key_arg(parser)
    return parser.parse_args(argv)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (name and sep and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def _engine_addresses(text: str):
    try:
        return parse_engine_addresses(text)
    except ValueError as e:  # argparse shows only this type's message
        raise argparse.ArgumentTypeError(str(e)) from None


async def start_async_llm(engine: EngineRouter, args: argparse.Namespace,
                          metrics: ServiceMetrics | None) -> AsyncLLM:
    """Waits for the engine cores while the tokenizer loads: the services of a
    stack (or a Kubernetes deployment's pods) start together, and the tokenizer's
    load then costs nothing on the way to serving."""
    model_dir = resolve_model(args.model)
    tokenizer_load = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, model_dir))
    await engine.start(timeout_s=args.engine_wait_timeout)
    tokenizer, eos_token_ids = await tokenizer_load
    info = await engine.get_info()
    processor = Processor(tokenizer, info, eos_token_ids)
    name = served_model_name(model_dir)
    frontend_metrics = FrontendMetrics(metrics, name, info.max_model_len) if metrics else None
    return AsyncLLM(engine, processor, name, frontend_metrics)


async def serve(args: argparse.Namespace) -> None:
    tls = tls_from_args(args)
    engine = EngineRouter(args.engine_core_addresses, tls=tls,
                          refresh_interval_s=args.dns_refresh_interval)
    # Metrics are kept when something serves them: --metrics-port or the HTTP API.
    metrics = (ServiceMetrics("llmserve-frontend")
               if args.metrics_port is not None or args.http_port is not None else None)
    llm = await start_async_llm(engine, args, metrics)
    for name, path in args.lora_modules:
        await llm.loras.load(name, path)
    servicer = InferenceServicer(llm)
    server = ServiceServer(SERVICE_NAME,
                           lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s),
                           on_error=llm.metrics and (
                               lambda code: llm.metrics.count_error("grpc", code.name)),
                           drainable=llm, drain_timeout_s=args.drain_timeout,
                           # Public callers show an API key, not a client certificate.
                           tls=tls, require_client_cert=False, api_key=args.api_key)
    http = (HttpServer(build_app(llm, args.api_key), args.http_host or args.host,
                       args.http_port, tls) if args.http_port is not None else None)
    try:
        if args.metrics_port is not None:
            metrics.serve(args.host, args.metrics_port)
        if http is not None:
            await http.start()
        await server.start(args.host, args.port, args.port_file, args.health_port)
        await server.serve_until_signal()
    finally:
        if http is not None:
            await http.stop()
        if metrics is not None:
            metrics.shutdown()
        await engine.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    run_service("frontend", "llmserve-frontend", lambda: serve(args))


if __name__ == "__main__":
    main()
