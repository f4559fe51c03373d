"""Driving LLMEngine by hand: add requests, step, abort some, and serve urgent
requests first under the priority policy (lower values first), as in vLLM's
LLMEngine examples.

    .venv/bin/python examples/engine_step_loop.py
"""
import sys

from llmserve import EngineArgs, LLMEngine, SamplingParams


def main(kv_cache_gib: float) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(scheduling_policy="priority", max_num_seqs=4,
                                                   kv_cache_gib=kv_cache_gib))
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for i in range(6):
        engine.add_request(f"background-{i}", f"Write a sentence about the number {i}.", params,
                           priority=10)
    engine.add_request("urgent", [{"role": "user", "content": "Say hello."}], params, priority=0)

    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                print(f"step {step:3d} {output.request_id:>12}: {output.outputs[0].text!r} "
                      f"({output.outputs[0].finish_reason})")
        step += 1
        if step == 3:
            engine.abort_request(["background-4", "background-5"])
            print("step   3: aborted background-4 and background-5")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
