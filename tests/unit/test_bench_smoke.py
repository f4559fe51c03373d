"""The benchmarks' smoke runs: tiny sizes, so they never rot (no timing checks)."""
from bench import scheduler_step


def test_scheduler_step_bench_runs():
    for policy in ("fcfs", "priority"):
        assert scheduler_step.time_scheduler(num_requests=8, steps=5, policy=policy,
                                             prefix_caching=True) > 0
