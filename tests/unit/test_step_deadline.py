"""StepDeadline: expiry once for a wait that lasts, none for short waits back to
back however long they run together, and none after stop()."""
import threading
import time

from services.engine_core.step_deadline import StepDeadline


def deadline(timeout_s: float) -> tuple[StepDeadline, threading.Event]:
    expired = threading.Event()
    return StepDeadline(timeout_s, expired.set), expired


def test_a_wait_that_lasts_the_timeout_expires():
    watch, expired = deadline(0.2)
    watch.begin()
    assert expired.wait(timeout=10)


def test_short_waits_back_to_back_do_not_expire():
    watch, expired = deadline(1.0)
    end = time.monotonic() + 2.5
    while time.monotonic() < end:  # 2.5 s of waits of 10 ms each
        watch.begin()
        time.sleep(0.01)
        watch.end()
    time.sleep(0.2)  # between waits
    assert not expired.is_set()
    watch.begin()  # after an idle spell: the thread is woken, and still watches
    assert expired.wait(timeout=10)


def test_a_stopped_deadline_does_not_expire():
    watch, expired = deadline(0.3)
    watch.begin()
    watch.stop()
    time.sleep(0.6)
    assert not expired.is_set()
    assert not watch._thread.is_alive()
