"""The CPU kernels' build: one builder at a time, and a build stopped midway does
not leave every later one waiting forever."""
import subprocess
import sys
import threading
from pathlib import Path

from kernels.cpu_build import build_directory, exclusive_build

REPO = Path(__file__).resolve().parents[2]


def test_a_lock_left_by_a_stopped_build_is_removed(tmp_path):
    (tmp_path / "lock").touch()  # what torch's build leaves when it is killed
    with exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_second_build_waits_for_the_first(tmp_path):
    order = []

    def second():
        with exclusive_build(tmp_path):
            order.append("second")

    with exclusive_build(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and order == []
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]


def test_make_kernels_finishes_over_a_stale_lock():
    """`python -m kernels.cpu_build` (make kernels) with the lock a killed build left
    in the real build folder: it goes on (here the kernels are built already)."""
    stale = build_directory() / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-m", "kernels.cpu_build"], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert "left by a build stopped midway" in done.stderr and "CPU kernels ready" in done.stderr
