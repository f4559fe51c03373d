"""Where a worker runs and which attention backend it takes, decided on any machine."""
import pytest
import torch

from services.common.errors import FailedPrecondition
from services.worker.attention import CpuPagedBackend, make_attention_backend
from services.worker.sampler import SamplingMetadata
from services.worker.worker import resolve_device

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cpu_and_auto_without_a_gpu():
    assert resolve_device("cpu", 3) == CPU
    if not torch.cuda.is_available():
        assert resolve_device("auto", 0) == CPU


@NO_GPU
def test_cuda_without_a_gpu_says_what_to_do():
    with pytest.raises(FailedPrecondition, match="sees no CUDA GPU.*--device cpu"):
        resolve_device("cuda", 0)


def test_auto_backend_on_the_cpu_is_cpu_paged():
    assert isinstance(make_attention_backend("auto", CPU, 16, torch.float32), CpuPagedBackend)


def test_a_block_size_the_cpu_kernels_lack_is_served_with_a_warning(caplog):
    for block_size in (16, 32, 64, 128):
        make_attention_backend("cpu_paged", CPU, block_size, torch.float32)
    assert not caplog.records
    assert isinstance(make_attention_backend("auto", CPU, 48, torch.float32), CpuPagedBackend)
    assert "--block-size 48" in caplog.text and "16, 32, 64, 128" in caplog.text


@pytest.mark.parametrize("name", ["flash_attn", "triton_attn"])
def test_cuda_backends_refuse_the_cpu(name):
    with pytest.raises(ValueError, match=f"the {name} backend runs on CUDA only"):
        make_attention_backend(name, CPU, 256, torch.bfloat16)


@pytest.mark.parametrize("block_size,dtype,message", [
    (16, torch.bfloat16, "multiple of 256.*triton_attn"),
    (256, torch.float32, "fp16 and bf16 only.*triton_attn"),
])
def test_flash_attn_names_what_does_not_fit(block_size, dtype, message):
    # Checked before flash-attn is imported: the message comes on machines without it too.
    with pytest.raises(ValueError, match=message):
        make_attention_backend("flash_attn", CUDA, block_size, dtype)


def test_sampling_metadata_moves_every_tensor():
    meta = SamplingMetadata(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int64),
                            top_p=torch.ones(2), min_p=torch.zeros(2), generators=[None, None],
                            logit_bias=(torch.tensor([0]), torch.tensor([5]), torch.tensor([1.])),
                            num_logprobs=[1, -1])
    moved = meta.to(torch.device("meta"))
    assert moved.temperature.device.type == "meta" and moved.top_k.dtype == torch.int64
    assert all(t.device.type == "meta" for t in moved.logit_bias)
    assert moved.num_logprobs == [1, -1] and moved.generators == [None, None]
    assert meta.temperature.device == CPU  # the original is left alone
