"""A step's requests come out of the step proto in one order in every process:
tensor-parallel ranks decode the same bytes and must lay the tokens out alike
(a proto map's iteration order depends on the process)."""
import subprocess
import sys

from services.common import convert
from services.common.scheduler_output import SchedulerOutput

DECODE = """
import sys
from services.common import convert
from services.common.pb import worker_pb2
pb = worker_pb2.SchedulerOutput.FromString(sys.stdin.buffer.read())
print(",".join(convert.scheduler_output_from_proto(pb).num_scheduled_tokens))
"""


def test_every_process_decodes_one_request_order():
    step = SchedulerOutput(num_scheduled_tokens={f"req-{i}": i + 1 for i in (5, 2, 7, 0, 3, 6)})
    data = convert.scheduler_output_to_proto(step).SerializeToString()
    orders = {subprocess.run([sys.executable, "-c", DECODE], input=data, capture_output=True,
                             check=True).stdout.decode().strip() for _ in range(3)}
    assert orders == {"req-0,req-2,req-3,req-5,req-6,req-7"}
