"""python -m services.worker: serve one worker rank over gRPC."""
from __future__ import annotations

import argparse
import asyncio

from services.common import tracing
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.server import ServiceServer, setup_logging
from services.worker.servicer import WorkerServicer
from services.worker.worker import Worker

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve worker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    parser.add_argument("--port-file", help="write host:port here once serving")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    servicer = WorkerServicer(Worker(rank=args.rank, device=args.device))
    server = ServiceServer(SERVICE_NAME,
                           lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s))
    await server.start(args.host, args.port, args.port_file)
    await server.serve_until_signal()


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(f"worker{args.rank}")
    tracing.init_tracing("llmserve-worker")
    try:
        asyncio.run(serve(args))
    finally:
        tracing.shutdown_tracing()


if __name__ == "__main__":
    main()
