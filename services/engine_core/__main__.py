"""python -m services.engine_core: serve an engine core over gRPC, driving remote workers."""
from __future__ import annotations

import argparse
import asyncio
import logging

from services.common.config_cli import (add_engine_args, engine_config_from_args,
                                        parse_args_refusing_vllm_flags)
from services.common.metrics import ServiceMetrics, add_metrics_port_arg
from services.common.model_store import served_model_name, with_resolved_models
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.ports import add_port_arg
from services.common.server import (ServiceServer, add_drain_arg, add_health_port_arg,
                                    run_service)
from services.common.tls import add_tls_args, tls_from_args
from services.engine_core.engine_core import EngineCore
from services.engine_core.engine_loop import EngineLoop
from services.engine_core.executor import GrpcExecutor, default_init_method
from services.engine_core.metrics import EngineCoreMetrics
from services.engine_core.servicer import EngineCoreServicer

SERVICE_NAME = engine_core_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
logger = logging.getLogger(__name__)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve engine-core", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    add_port_arg(parser, "--port", 50052, "the EngineCore gRPC API's port")
    parser.add_argument("--port-file", help="write host:port here once serving")
    parser.add_argument("--worker-addresses", required=True,
                        help="comma-separated host:port of the workers in rank order: "
                        "stage by stage, each stage's tensor-parallel ranks in order")
    add_metrics_port_arg(parser)
    add_drain_arg(parser)
    add_health_port_arg(parser)
    add_tls_args(parser)
    add_engine_args(parser)
    return parse_args_refusing_vllm_flags(parser, argv)


async def serve(args: argparse.Namespace) -> None:
    config = engine_config_from_args(args)
    config = with_resolved_models(config)
    worker_addresses = args.worker_addresses.split(",")
    if not config.parallel.distributed_init_method:
        config.parallel.distributed_init_method = default_init_method(worker_addresses[0])
    tls = tls_from_args(args)
    executor = GrpcExecutor(worker_addresses, tls)
    await asyncio.to_thread(executor.wait_ready, 120.0)
    core = await asyncio.to_thread(EngineCore, config, executor)
    metrics = _metrics(args, core)
    engine = EngineLoop(core, metrics)
    servicer = EngineCoreServicer(engine)
    register = engine_core_pb2_grpc.add_EngineCoreServicer_to_server
    server = ServiceServer(SERVICE_NAME, lambda s: register(servicer, s),
                           on_error=metrics and metrics.count_rpc_error,
                           drainable=engine, drain_timeout_s=args.drain_timeout, tls=tls)
    await server.start(args.host, args.port, args.port_file, args.health_port)
    try:
        await server.serve_until_signal()
    finally:
        await engine.shutdown()


def _metrics(args: argparse.Namespace, core: EngineCore) -> EngineCoreMetrics | None:
    """The engine core's metrics, served on --metrics-port; None when it is off."""
    if args.metrics_port is None:
        return None
    service = ServiceMetrics("llmserve-engine-core")
    metrics = EngineCoreMetrics(service, served_model_name(core.config.model.model), core.info,
                                core.config.scheduler.max_num_batched_tokens, core.stats)
    service.serve(args.host, args.metrics_port)
    return metrics


def main(argv=None) -> None:
    args = parse_args(argv)
    run_service("engine-core", "llmserve-engine-core", lambda: serve(args))


if __name__ == "__main__":
    main()
