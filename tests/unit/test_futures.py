import concurrent.futures

from services.common.futures import run_into_future


def test_cancelled_call_does_not_run_and_does_not_raise():
    calls = []
    future = concurrent.futures.Future()
    future.cancel()
    run_into_future(future, calls.append, 1)
    assert calls == [] and future.cancelled()


def test_result_and_exception_reach_the_caller():
    ok, bad = concurrent.futures.Future(), concurrent.futures.Future()
    run_into_future(ok, lambda x: x * 2, 21)
    run_into_future(bad, lambda: 1 / 0)
    assert ok.result() == 42 and isinstance(bad.exception(), ZeroDivisionError)
