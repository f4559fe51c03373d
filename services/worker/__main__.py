"""python -m services.worker: serve one worker rank over gRPC."""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import signal
import threading

from services.common import metrics, tracing
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.ports import add_port_arg
from services.common.server import ServiceServer, add_health_port_arg, start_process
from services.common.tls import add_tls_args, tls_from_args
from services.worker.cpu_cores import parse_cores, pin_to_cores
from services.worker.main_thread import MainThreadRunner
from services.worker.metrics import WorkerMetrics
from services.worker.servicer import WorkerServicer
from services.worker.worker import Worker

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve worker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    add_port_arg(parser, "--port", 50053, "the Worker gRPC API's port")
    parser.add_argument("--port-file", help="write host:port here once serving")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--cpu-cores", type=parse_cores,
                        help="run on these cores, e.g. 0-3 or 0,2 (default: all this process "
                             "may use); workers sharing a machine should not share cores")
    metrics.add_metrics_port_arg(parser)
    add_health_port_arg(parser)
    add_tls_args(parser)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, runner: MainThreadRunner,
                stopping: "asyncio.Future[asyncio.Event]") -> None:
    worker = Worker(rank=args.rank, pinned=args.cpu_cores is not None)
    # Ready (health of the Worker service) once the engine core has loaded the model.
    metrics = _metrics(args, worker)
    servicer = WorkerServicer(worker, run=runner.run, metrics=metrics,
                              on_ready=lambda: server.set_ready())
    server = ServiceServer(SERVICE_NAME,
                           lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
                           on_error=metrics and metrics.count_rpc_error,
                           tls=tls_from_args(args), ready_at_start=False)
    await server.start(args.host, args.port, args.port_file, args.health_port)
    stop = asyncio.Event()
    stopping.set_result((asyncio.get_running_loop(), stop))
    await server.serve_until(stop)


def _metrics(args: argparse.Namespace, worker: Worker) -> WorkerMetrics | None:
    """The worker's metrics, served on --metrics-port; None when it is off."""
    if args.metrics_port is None:
        return None
    service = metrics.ServiceMetrics("llmserve-worker")
    worker_metrics = WorkerMetrics(service, worker)
    service.serve(args.host, args.metrics_port)
    return worker_metrics


def main(argv=None) -> None:
    """The gRPC server runs on a background thread; the model on the main thread."""
    args = parse_args(argv)
    start_process(f"worker{args.rank}", "llmserve-worker")
    if args.cpu_cores is not None:
        pin_to_cores(args.cpu_cores)
    runner = MainThreadRunner()
    stopping: concurrent.futures.Future = concurrent.futures.Future()

    def serve_in_thread() -> None:
        try:
            asyncio.run(serve(args, runner, stopping))
        finally:
            runner.stop()

    def on_signal(signum, frame) -> None:
        if stopping.done():
            loop, stop = stopping.result()
            loop.call_soon_threadsafe(stop.set)
        else:  # not serving yet: nothing to drain
            runner.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    threading.Thread(target=serve_in_thread, name="grpc-server", daemon=True).start()
    try:
        runner.serve_forever()
    finally:
        tracing.shutdown_tracing()
        metrics.shutdown_otlp_metrics()


if __name__ == "__main__":
    main()
