"""The CPU matmul strategies: the GEMV, packed GEMM and AMX kernels against their
definitions, and each layer set-up of cpu_matmul against F.linear."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_build import cpu_ops_available, kernels_built_for_avx512
from services.worker import cpu_info
from services.worker.cpu_info import cpu_is_intel
from services.worker.cpu_matmul import choose, matmul
from services.worker.cpu_matmul.amx import (AMX_MAX_ROWS, GEMV_OVER_AMX_ROWS, AMXWeights,
                                            pack_amx_weight)
from services.worker.cpu_matmul.choose import (MKL_PACKED_PATH, ONEDNN_PACKED_PATH,
                                               PACKED_GEMM_PATH, fp32_gemv_rows, fp32_path,
                                               onednn_gemv_rows, sixteen_bit_weights,
                                               weight_dtype_max_rows)
from services.worker.cpu_matmul import gemm as gemm_module
from services.worker.cpu_matmul.gemm import (FP16_GEMV_OVER_PACKED_GEMM_ROWS,
                                             GEMV_OVER_PACKED_GEMM_ROWS,
                                             GEMV_OVER_PACKED_GEMM_ROWS_ON_INTEL,
                                             BF16_GEMV_OVER_DOT_GEMM_ROWS,
                                             BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH,
                                             PackedGemmWeights, bf16_dot_gemm_available)
from services.worker.cpu_matmul.gemm import fused_silu_and_mul
from services.worker.cpu_matmul import gemv as gemv_module
from services.worker.cpu_matmul.gemv import (BF16_GEMV_OVER_ONEDNN_ROWS_FULL_WIDTH,
                                             GEMV_MAX_ROWS, GEMV_OVER_ONEDNN_ROWS,
                                             GEMV_ROWS_WITHOUT_AVX512, GemvForFewRows, gemv_rows)
from services.worker.cpu_matmul.mkl import (GEMV_OVER_MKL_ROWS, MKLPackedWeights,
                                            mkl_packing_available)
from services.worker.cpu_matmul.onednn import OneDNNWeights, onednn_native
from services.worker.linear import (ColumnParallelLinear, PackedColumnParallelLinear,
                                    ParallelLMHead, RowParallelLinear, linear_layers)


def prepare_cpu_linears(model, dtype, weight_dtype):
    return choose.prepare_cpu_linears(linear_layers(model), dtype, weight_dtype)


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert cpu_ops_available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [576, 80, 1536])
@pytest.mark.parametrize("n", [291, 5])  # a tail of 36 rows (4.5 grains); less than a grain
def test_gemv_sums_in_fp32(rows, weight_dtype, k, n):
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(weight_dtype)
    got = torch.ops.llmserve.gemv(x, weight)
    want = F.linear(x.double(), weight.double()).float()  # the exact sums of the same values
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemv_asks_ahead_for_fp32_weights_on_intel_only_and_for_16_bit_ones_everywhere():
    """The choice bench/NOTES.md measured: fp32 weights streamed faster without the
    software prefetch on Zen 3 and with it on an Intel Xeon; bf16 ones faster with it
    on both. A prefetch moves no value, so the sums above hold either way."""
    prefetches = torch.ops.llmserve.gemv_prefetches
    assert prefetches(torch.bfloat16) and prefetches(torch.float16)
    assert prefetches(torch.float32) == cpu_is_intel()


def test_gemv_walks_eight_weight_rows_at_once_for_one_fp32_row_on_intel_with_avx512():
    """The choice bench/NOTES.md measured on an Ice Lake Xeon; unmeasured elsewhere."""
    walks = torch.ops.llmserve.gemv_walks_rows_at_once
    assert walks(torch.float32) == (kernels_built_for_avx512() and cpu_is_intel())
    assert not walks(torch.bfloat16) and not walks(torch.float16)


@pytest.mark.parametrize("k", [80, 576, 1552])  # K's tail of 16 after steps of 32; none
@pytest.mark.parametrize("n", [5, 8, 291, 960])  # under the 8 rows a walk takes; their tail
def test_one_row_gemv_gives_the_bits_of_the_row_at_a_time_walk(k, n):
    """One row of x (the eight-weight-row walk where the CPU takes it) sums each
    output in the order the walk of one weight row at a time does, which the
    two-row call below runs: the same bits, not merely close ones."""
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(2, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) * 0.05
    one = torch.ops.llmserve.gemv(x[:1].contiguous(), weight)
    assert torch.equal(one, torch.ops.llmserve.gemv(x, weight)[:1])


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 9, 13, 17, 64, 65, 130, 300, 777])
@pytest.mark.parametrize("n,k", [(48, 16), (50, 33), (576, 576), (1001, 80), (96, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_gemm_sums_in_fp32(rows, n, k, dtype):
    """Any rows (tiles of up to 8 rows with AVX-512, 6 with AVX2, and their remainders;
    blocks of up to 256 rows), any N (a last panel of fewer real columns than its 48,
    or 16), any K; 16-bit weights and x with fp32 sums, rounded once to their dtype."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    packed = torch.ops.llmserve.pack_gemm_weight(weight)
    assert packed.shape == packed_shape(n, k, dtype) and packed.dtype == dtype
    got = torch.ops.llmserve.gemm(x, packed, n)
    assert got.dtype == dtype
    want = F.linear(x.double(), weight.double())  # the exact sums of the same values
    if dtype == torch.float32:
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    else:  # within the one rounding to dtype (half an ulp), plus fp32's error
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(got.double(), want, rtol=ulp / 2 + 1e-5, atol=1e-5)


def packed_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """pack_gemm_weight's panels of 48 columns (16 with AVX2), a row per step of K; bf16
    ones in pairs of K (a row of 96) where our GEMM multiplies bf16 pairs and K is even."""
    cols = torch.ops.llmserve.gemm_panel_columns()
    assert cols == (48 if kernels_built_for_avx512() else 16)
    if dtype == torch.bfloat16 and bf16_dot_gemm_available() and k % 2 == 0:
        return (-(-n // cols), k // 2, 2 * cols)
    return (-(-n // cols), k, cols)


@pytest.mark.skipif(not bf16_dot_gemm_available(), reason="needs AVX512-BF16 kernels")
def test_bf16_pair_panels_follow_their_documented_layout():
    """Panel p, row k // 2, place 2c + k % 2 holds W[48p + c][k]; zeros past W's rows."""
    weight = torch.randn(100, 32).to(torch.bfloat16)
    packed = torch.ops.llmserve.pack_gemm_weight(weight)
    assert packed.shape == (3, 16, 96)
    for p in range(3):
        for c in range(48):
            row = weight[48 * p + c] if 48 * p + c < 100 else torch.zeros(32, dtype=torch.bfloat16)
            assert torch.equal(packed[p, :, 2 * c], row[0::2])
            assert torch.equal(packed[p, :, 2 * c + 1], row[1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemm_refuses_a_weight_packed_for_another_shape(dtype):
    packed = torch.ops.llmserve.pack_gemm_weight(torch.randn(100, 32).to(dtype))
    with pytest.raises(RuntimeError, match="pack_gemm_weight's panels"):
        torch.ops.llmserve.gemm(torch.randn(4, 32).to(dtype), packed, 200)
    with pytest.raises(RuntimeError, match="pack_gemm_weight's panels"):
        torch.ops.llmserve.gemm(torch.randn(4, 16).to(dtype), packed, 100)
    assert torch.ops.llmserve.gemm(torch.randn(0, 32).to(dtype), packed, 100).shape == (0, 100)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 130, 600])
@pytest.mark.parametrize("half,k", [(48, 16), (96, 576), (1536, 576), (144, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_gemm_fuses_silu_and_mul_bit_for_bit(rows, half, k, dtype):
    """gemm_silu_and_mul is silu_and_mul(gemm(...)) in one pass: the same bits (in
    16 bits, the same roundings between), and SiLU(gate) * up of the exact products
    (gates large enough to reach the exp's clamps)."""
    gen = torch.Generator().manual_seed(rows * half + k)
    x = (torch.randn(rows, k, generator=gen) * 4).to(dtype)
    weight = (torch.randn(2 * half, k, generator=gen) * 0.5).to(dtype)
    packed = torch.ops.llmserve.pack_gemm_weight(weight)
    got = torch.ops.llmserve.gemm_silu_and_mul(x, packed, 2 * half)
    assert got.shape == (rows, half) and got.dtype == dtype
    assert torch.equal(got, torch.ops.llmserve.silu_and_mul(torch.ops.llmserve.gemm(
        x, packed, 2 * half)))
    gate, up = F.linear(x.double(), weight.double()).chunk(2, dim=-1)
    want = F.silu(gate) * up  # fp32 sums' error is relative to the largest products
    rtol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # three roundings
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_packed_gemm_fuses_only_halves_of_whole_panels():
    weight = torch.randn(2 * 50, 32)
    packed = torch.ops.llmserve.pack_gemm_weight(weight)
    cols = torch.ops.llmserve.gemm_panel_columns()
    with pytest.raises(RuntimeError, match=f"halves are multiples of {cols} rows"):
        torch.ops.llmserve.gemm_silu_and_mul(torch.randn(4, 32), packed, 100)
    assert PackedGemmWeights(weight).silu_and_mul(torch.randn(4, 32)) is None
    bf16 = weight.to(torch.bfloat16)  # pair panels where our GEMM multiplies bf16 pairs
    assert PackedGemmWeights(bf16).silu_and_mul(torch.randn(4, 32).to(bf16.dtype)) is None
    assert PackedGemmWeights(torch.randn(96, 32)).silu_and_mul(torch.randn(0, 32)).shape == (0, 48)


def test_a_gate_up_layer_fuses_its_activation_where_our_packed_gemm_takes_the_rows(monkeypatch):
    """Above the GEMV's rows, through the 16-bit weights mode's nesting too; never with
    a bias or LoRA, whose terms come before the activation."""
    fused = []
    real = PackedGemmWeights.silu_and_mul
    monkeypatch.setattr(PackedGemmWeights, "silu_and_mul",
                        lambda self, x: fused.append(len(x)) or real(self, x))
    layer = PackedColumnParallelLinear(64, {"gate": 96, "up": 96}, bias=False)
    nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(2, 5, 64)  # leading dims kept
    gate, up = F.linear(x, layer.weight).chunk(2, dim=-1)
    want = F.silu(gate) * up
    packed = PackedGemmWeights(layer.weight)
    for weights, rows, fused_at in (
            (GemvForFewRows(layer.weight, 1, packed), 5, [10]),
            (GemvForFewRows(layer.weight.bfloat16(), 4,
                            GemvForFewRows(layer.weight, 1, packed)), 5, [10]),
            (GemvForFewRows(layer.weight, 8, packed), 4, [])):  # 8 rows: all the GEMV's
        fused.clear()
        layer.cpu_weights = weights
        torch.testing.assert_close(layer.silu_and_mul(x[:, :rows]), want[:, :rows],
                                   rtol=1e-2, atol=1e-2)
        assert fused == fused_at
        assert fused_silu_and_mul(weights, x[0, :1]) is None  # one row: the GEMV's
    fused.clear()
    layer.cpu_weights = packed
    layer.lora = OneMore()  # its delta comes after the product: not fused
    gate, up = (F.linear(x, layer.weight) + 1).chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    biased = PackedColumnParallelLinear(64, {"gate": 96, "up": 96}, bias=True)
    for param in biased.parameters():  # our layers leave their weights to the checkpoint
        nn.init.normal_(param, std=0.1)
    biased.cpu_weights = PackedGemmWeights(biased.weight)
    gate, up = F.linear(x, biased.weight, biased.bias).chunk(2, dim=-1)
    torch.testing.assert_close(biased.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert fused == []


class OneMore:
    """A LoRA layer's stand-in: adds one to every output."""

    def add_delta(self, y, x):
        return y + 1


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_gemv_returns_x_dtype_and_rejects_what_it_cannot_read(x_dtype):
    x = torch.randn(2, 64, dtype=x_dtype)
    weight = torch.randn(40, 64, dtype=torch.bfloat16)
    got = torch.ops.llmserve.gemv(x, weight)
    assert got.dtype == x_dtype
    want = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -8, atol=1e-6)  # one rounding
    # The kernel widens x and narrows its sums itself: as torch's conversions would.
    assert torch.equal(got, torch.ops.llmserve.gemv(x.float(), weight).to(x_dtype))
    strided = torch.randn(64, 2, dtype=x_dtype).t()
    assert torch.equal(torch.ops.llmserve.gemv(strided, weight),
                       torch.ops.llmserve.gemv(strided.contiguous(), weight))
    for bad_x, bad_weight in [(torch.randn(9, 64), weight.float()),  # more rows than 8
                              (torch.randn(2, 60), torch.randn(40, 60)),  # K not a multiple of 16
                              (torch.randn(2, 64), weight.double())]:
        with pytest.raises(RuntimeError, match="gemv"):
            torch.ops.llmserve.gemv(bad_x, bad_weight)


def test_amx_packing_follows_its_documented_layout():
    n, k = 64, 96
    weight = torch.randn(n, k)
    packed = pack_amx_weight(weight)
    assert packed.shape == (n // 32, k // 32, 1024)
    for nb, kb, tile, r, c, j in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 15, 1), (1, 0, 0, 3, 7, 1),
                                  (0, 1, 1, 9, 2, 0)]:
        want = weight[nb * 32 + tile * 16 + c, kb * 32 + 2 * r + j]
        assert packed[nb, kb, tile * 512 + r * 32 + c * 2 + j] == want


def _amx_or_skip():
    if not torch.ops.llmserve.amx_bf16_available():
        pytest.skip("this CPU (or the kernels' build) has no AMX-BF16")


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 32, 33, 64, 100, AMX_MAX_ROWS])
@pytest.mark.parametrize("n,k", [(96, 64), (960, 576), (64, 1536)])
def test_amx_linear_sums_in_fp32_and_rounds_once_to_bf16(rows, n, k):
    _amx_or_skip()
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    got = torch.ops.llmserve.amx_bf16_linear(x, pack_amx_weight(weight))
    exact = F.linear(x.double(), weight.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # One rounding of (nearly) exact sums: within half a bf16 step, so equal to
    # the rounded exact result except where fp32 sums land across a rounding edge.
    torch.testing.assert_close(got.double(), exact, rtol=2.0 ** -8, atol=1e-6)
    if rows:
        assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ColumnParallelLinear(64, 96, bias=True)
        self.b = RowParallelLinear(96, 64, bias=False)
        self.head = ParallelLMHead(300, 64)
        for p in self.parameters():
            nn.init.normal_(p, std=0.1)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_sixteen_bit_weights_serve_few_rows_and_fp32_weights_the_rest():
    model = Tiny()
    x = torch.randn(GEMV_MAX_ROWS + 5, 64)
    exact = model(x)
    assert prepare_cpu_linears(model, torch.float32, torch.bfloat16).startswith("bfloat16")
    rounded = Tiny()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() if k.endswith("weight") else v
                             for k, v in model.state_dict().items()})  # biases stay fp32
    few = x[:weight_dtype_max_rows()]
    torch.testing.assert_close(model(few), rounded(few), rtol=1e-5, atol=1e-5)  # 16-bit weights
    # One row more, where the 16-bit GEMV no longer beats the fp32 path: fp32 weights.
    over = x[:len(few) + 1]
    torch.testing.assert_close(model(over), exact[:len(over)], rtol=1e-6, atol=1e-6)
    # Many rows: the fp32 weights (prepacked: equal up to the order of the sums).
    torch.testing.assert_close(model(x), exact, rtol=1e-6, atol=1e-6)


def test_sixteen_bit_models_take_this_cpus_path():
    """AMX where the CPU has it; on Intel without it our packed GEMM on the bf16
    weights where its tiles are AVX-512's (AVX2 ones never raced oneDNN there: an
    Intel host's AVX2 build takes oneDNN); elsewhere oneDNN where it computes bf16
    natively, else our packed GEMM
    (on an AMD EPYC Zen 3, with AVX2 only, 3.6x F.linear's rate at 8 rows and 7x at
    64: bench/NOTES.md)."""
    model = Tiny().to(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    many = torch.randn(AMX_MAX_ROWS + 20, 64, dtype=torch.bfloat16)  # oneDNN's side
    expected, expected_many = model(x), model(many)
    path = prepare_cpu_linears(model, torch.bfloat16, None)
    native = onednn_native(torch.bfloat16)
    if native and torch.ops.llmserve.amx_bf16_available():
        assert path == (f"AMX for <= {AMX_MAX_ROWS} rows, oneDNN prepacked above, our GEMV "
                        f"for <= {GEMV_OVER_AMX_ROWS} rows")
        # 96 x 64 and 64 x 96 fill whole AMX blocks; the 300-row head does not.
        assert model.a.cpu_weights.max_rows == GEMV_OVER_AMX_ROWS
        assert isinstance(model.a.cpu_weights.many, AMXWeights)
        assert isinstance(model.head.cpu_weights.many, OneDNNWeights)
    elif (bf16_dot_gemm_available() or (cpu_is_intel() and kernels_built_for_avx512())
          or not native):
        rows = choose.bf16_packed_gemv_rows()
        assert path == f"{PACKED_GEMM_PATH}, our GEMV for <= {rows} rows"
        assert isinstance(model.a.cpu_weights.many, PackedGemmWeights)
        assert model.a.cpu_weights.many.packed.dtype == torch.bfloat16
    else:
        rows = onednn_gemv_rows(torch.bfloat16)
        assert path == f"oneDNN prepacked, our GEMV for <= {rows} rows"
        assert isinstance(model.a.cpu_weights, GemvForFewRows)
    for rows in (1, 3, 4, 5, 64):  # around the GEMV's last row count where it has one
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(model(many), expected_many, rtol=2e-2, atol=2e-2)
    assert matmul(model.a, x[None, :2]).shape == (1, 2, 96)  # leading dims kept


@pytest.mark.parametrize("intel,amx,avx512,dot", [
    (True, False, True, False), (True, True, True, False), (False, False, True, False),
    (True, False, False, False), (False, False, True, True), (True, False, True, True),
    (True, True, True, True)])
def test_bf16_models_take_our_gemm_without_amx_where_it_wins(monkeypatch, intel, amx, avx512,
                                                            dot):
    """On an Intel Xeon without AMX oneDNN's bf16 product ran at 0.61-0.76x our GEMM's on
    the same bf16 weights, and our GEMV beat that GEMM up to 8 rows; where our GEMM
    multiplies bf16 pairs (AVX512-BF16) oneDNN's ran at 0.78-0.91x it on an AMD EPYC
    Zen 5, and our GEMV beat it up to four rows (bench/NOTES.md). AMX keeps its
    kernel behind our GEMV; other CPUs keep oneDNN (not measured there)."""
    if not onednn_native(torch.bfloat16):
        pytest.skip("oneDNN does not compute bf16 natively here")
    monkeypatch.setattr(choose, "cpu_is_intel", lambda: intel)
    monkeypatch.setattr(choose, "amx_available", lambda: amx)
    monkeypatch.setattr(choose, "bf16_dot_gemm_available", lambda: dot and avx512)
    monkeypatch.setattr(choose, "avx512_full_width", lambda: True)
    monkeypatch.setattr(gemm_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(gemv_module, "kernels_built_for_avx512", lambda: avx512)
    model = Tiny().to(torch.bfloat16)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    expected = model(x)
    path = prepare_cpu_linears(model, torch.bfloat16, None)
    if amx:  # (this CPU may lack it: nothing runs)
        assert f"AMX for <= {AMX_MAX_ROWS}" in path
        assert model.a.cpu_weights.max_rows == GEMV_OVER_AMX_ROWS
        assert isinstance(model.a.cpu_weights.many, AMXWeights)
        return
    ours = (intel or dot) and avx512
    assert path.startswith(PACKED_GEMM_PATH) == ours
    if ours:
        rows = BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH if dot else GEMV_MAX_ROWS
        assert model.a.cpu_weights.max_rows == rows
        assert isinstance(model.a.cpu_weights.many, PackedGemmWeights)
    for rows in (1, 2, 3, 8, 9, 20):  # the GEMV's rows, then the GEMM's
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("native", [False, True])
def test_fp16_models_take_our_gemm_where_onednn_has_no_native_fp16(monkeypatch, native):
    """torch's fp16 product ran 7-9x slower than our GEMM on the fp16 weights from 16 rows
    on (an AMD EPYC Zen 5), and our GEMV beat the GEMM up to 4 rows (bench/NOTES.md);
    where oneDNN computes fp16 natively it keeps the model (measured on an Intel Xeon)."""
    monkeypatch.setattr(choose, "onednn_native", lambda dtype: native)
    if native:  # (oneDNN's fp16 pack needs that CPU: the rule alone)
        assert choose._choose(torch.float16, None)[1] == ONEDNN_PACKED_PATH
        return
    model = Tiny().to(torch.float16)
    x = torch.randn(64, 64, dtype=torch.float16)
    expected = model(x)
    path = prepare_cpu_linears(model, torch.float16, None)
    assert path == f"{PACKED_GEMM_PATH}, our GEMV for <= {FP16_GEMV_OVER_PACKED_GEMM_ROWS} rows"
    assert isinstance(model.a.cpu_weights.many, PackedGemmWeights)
    assert model.a.cpu_weights.many.packed.dtype == torch.float16
    for rows in (1, 4, 5, 64):  # the GEMV's rows, then the GEMM's
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=2e-2, atol=2e-2)


def test_fp32_models_use_this_cpus_prepacked_weights_for_any_row_count():
    """The weights are packed once (for 64 rows) and serve every row count above our
    GEMV's, equal to F.linear up to the order of the sums."""
    model = Tiny()
    x = torch.randn(300, 64)
    expected = {rows: model(x[:rows]) for rows in (0, 1, 2, 3, 7, 64, 100, 300)}
    path = prepare_cpu_linears(model, torch.float32, None)
    assert path.startswith(fp32_path())
    if path == "F.linear":
        return
    for rows, want in expected.items():
        torch.testing.assert_close(model(x[:rows]), want, rtol=1e-5, atol=1e-5)
    assert matmul(model.a, x[None, :5]).shape == (1, 5, 96)  # leading dims kept
    # The product reads the packed weight above our GEMV's rows, where the GEMV reads
    # the weight itself.
    weights, gemv_limit = model.a.cpu_weights, 0
    if isinstance(weights, GemvForFewRows):  # where the kernels are built
        gemv_limit = fp32_gemv_rows()
        assert weights.max_rows == gemv_limit
        assert weights.gemv_weight.data_ptr() == model.a.weight.data_ptr()  # no copy
        weights = weights.many
    if isinstance(weights, PackedGemmWeights):
        weights.packed.zero_()
    else:
        assert weights.packed.is_mkldnn
        weights.packed = (torch.ops.mkl._mkl_reorder_linear_weight if path.startswith("MKL")
                          else torch.ops.mkldnn._reorder_linear_weight)(
            torch.zeros_like(model.a.weight), 64)
    for rows in (gemv_limit + 1, 64, 300):
        assert torch.equal(model.a(x[:rows]), model.a.bias.expand(rows, -1)), rows


@pytest.mark.parametrize("intel,avx512,built", [(True, True, True), (False, True, True),
                                                (True, False, True), (False, False, True),
                                                (False, False, False)])
def test_fp32_takes_our_gemm_but_on_intel_without_avx512(monkeypatch, intel, avx512, built):
    """Our packed GEMM beat oneDNN on an AMD EPYC and MKL's pack on an Intel Xeon from 2
    rows on with AVX-512's tiles, and oneDNN on an AMD EPYC Zen 3 with AVX2's; Intel
    CPUs without AVX-512 keep MKL's pack (not measured against those tiles), and oneDNN
    takes the rest where the kernel is not built (MKL runs generic code on other
    vendors' CPUs; bench/NOTES.md). Our GEMV in front of each."""
    monkeypatch.setattr(choose, "cpu_is_intel", lambda: intel)
    monkeypatch.setattr(gemm_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(gemm_module, "cpu_ops_available", lambda: built)
    if built and (avx512 or not intel):
        want = PACKED_GEMM_PATH
    elif intel:
        want = "MKL prepacked" if torch.backends.mkl.is_available() else "F.linear"
    else:
        want = "oneDNN prepacked" if torch.backends.mkldnn.is_available() else "F.linear"
    assert choose.fp32_path() == want
    model = Tiny()
    x = torch.randn(64, 64)
    expected = model(x)
    assert prepare_cpu_linears(model, torch.float32, None).startswith(want)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    many = {PACKED_GEMM_PATH: PackedGemmWeights, MKL_PACKED_PATH: MKLPackedWeights,
            ONEDNN_PACKED_PATH: OneDNNWeights}.get(want)
    if many is not None and cpu_ops_available():
        assert isinstance(model.a.cpu_weights, GemvForFewRows)
        assert isinstance(model.a.cpu_weights.many, many)
        # Our GEMV's rows in front: up to 8 before our GEMM on Intel (measured there).
        rows = {PACKED_GEMM_PATH: GEMV_OVER_PACKED_GEMM_ROWS_ON_INTEL if intel
                else GEMV_OVER_PACKED_GEMM_ROWS, MKL_PACKED_PATH: GEMV_OVER_MKL_ROWS,
                ONEDNN_PACKED_PATH: GEMV_OVER_ONEDNN_ROWS}[want]
        assert model.a.cpu_weights.max_rows == gemv_rows(rows)


def test_the_path_name_says_which_layers_our_gemv_skips():
    """The GEMV takes inputs whose width is a multiple of 16; a 40-wide layer keeps
    the packed product for every row count, and the path's name says so."""
    model = nn.Sequential(nn.Linear(64, 40, bias=False), nn.Linear(40, 64, bias=False))
    path = prepare_cpu_linears(model, torch.float32, None)
    if path.startswith((ONEDNN_PACKED_PATH, MKL_PACKED_PATH, PACKED_GEMM_PATH)):
        first, second = model[0].cpu_weights, model[1].cpu_weights
        assert isinstance(first, GemvForFewRows)
        assert path == (f"{fp32_path()}, our GEMV for <= {first.max_rows} rows "
                        "where the input width is a multiple of 16")
        assert isinstance(second, (OneDNNWeights, MKLPackedWeights, PackedGemmWeights))
    else:
        assert "GEMV" not in path
    x = torch.randn(2, 64)
    torch.testing.assert_close(matmul(model[1], matmul(model[0], x)), model(x), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("avx512,expected", [(True, (1, 1)), (False, (1, 6))])
def test_built_without_avx512_16_bit_weights_take_the_rows_of_one_pass(monkeypatch, avx512,
                                                                        expected):
    """Off Intel the fp32 path is our packed GEMM, with our GEMV in front for one row.
    On an AMD Zen 4 (AVX-512 at half width) 16-bit weights beat it at one row only; built
    for AVX2, on an AMD EPYC Zen 3, at every row count up to the 6 rows of one pass of
    our GEMV there, and at 7 not always (bench/NOTES.md, the AVX2 entry)."""
    monkeypatch.setattr(gemv_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(gemm_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(choose, "cpu_is_intel", lambda: False)
    monkeypatch.setattr(choose, "avx512_full_width", lambda: False)
    assert fp32_path() == PACKED_GEMM_PATH
    assert (fp32_gemv_rows(), weight_dtype_max_rows()) == expected
    expected = (expected[1],)
    weight = torch.randn(32, 64)
    sixteen = sixteen_bit_weights(weight, torch.bfloat16)
    assert isinstance(sixteen, GemvForFewRows) and sixteen.max_rows == expected[0]
    x = torch.randn(expected[0] + 1, 64)
    # Past its rows, the fp32 path reads the fp32 weight: the exact fp32 product.
    torch.testing.assert_close(sixteen(x), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (mkl_packing_available() and cpu_ops_available()),
                    reason="needs torch's MKL and our kernels")
@pytest.mark.parametrize("avx512,rows,many",
                         [(True, GEMV_MAX_ROWS, PackedGemmWeights),
                          (False, GEMV_ROWS_WITHOUT_AVX512, MKLPackedWeights)])
def test_on_intel_16_bit_weights_take_every_row_our_gemv_takes(monkeypatch, avx512, rows, many):
    """On an Intel Xeon our GEMV on a 16-bit copy of the weights beat the fp32 path, our
    packed GEMM, at every row count it takes, 1 to 8 (bench/NOTES.md). Built for AVX2,
    the fp32 path is MKL's pack, which it beat up to the 6 rows of one pass (at 8 MKL's
    pack won)."""
    monkeypatch.setattr(gemv_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(gemm_module, "kernels_built_for_avx512", lambda: avx512)
    monkeypatch.setattr(choose, "cpu_is_intel", lambda: True)
    monkeypatch.setattr(choose, "avx512_full_width", lambda: True)
    assert weight_dtype_max_rows() == rows
    weight = torch.randn(32, 64)
    sixteen = sixteen_bit_weights(weight, torch.bfloat16)
    assert isinstance(sixteen, GemvForFewRows) and sixteen.max_rows == rows
    fp32 = sixteen.many
    assert isinstance(fp32, GemvForFewRows) and fp32.max_rows == fp32_gemv_rows()
    assert isinstance(fp32.many, many)
    x = torch.randn(rows + 1, 64)
    # Up to its rows, the 16-bit copy's product.
    torch.testing.assert_close(sixteen(x[:rows]), x[:rows] @ weight.bfloat16().float().T,
                               rtol=1e-5, atol=1e-5)
    # Past its rows, the fp32 path on the fp32 weight: the fp32 product.
    torch.testing.assert_close(sixteen(x), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vendor,family,flags,full_width", [
    ("GenuineIntel", "6", "avx2 avx512f", True), ("AuthenticAMD", "26", "avx2 avx512f", True),
    ("AuthenticAMD", "25", "avx2 avx512f", False), ("AuthenticAMD", "26", "avx2", False),
    ("AuthenticAMD", "", "avx2 avx512f", False)])
def test_avx512_runs_at_full_width_on_intel_and_from_zen_5(monkeypatch, vendor, family, flags,
                                                           full_width):
    fields = {"vendor_id": vendor, "cpu family": family, "flags": flags}
    monkeypatch.setattr(cpu_info, "cpuinfo_field", lambda name: fields.get(name, ""))
    assert cpu_info.avx512_full_width() == full_width


@pytest.mark.parametrize("full_width,sixteen_bit_rows,bf16_rows,dot_rows", [
    (True, GEMV_MAX_ROWS, BF16_GEMV_OVER_ONEDNN_ROWS_FULL_WIDTH,
     BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH),
    (False, 1, GEMV_OVER_ONEDNN_ROWS, BF16_GEMV_OVER_DOT_GEMM_ROWS)])
def test_off_intel_full_width_avx512_gives_16_bit_gemvs_more_rows(monkeypatch, full_width,
                                                                  sixteen_bit_rows, bf16_rows,
                                                                  dot_rows):
    """On an AMD EPYC Zen 5 our GEMV on a 16-bit copy of the weights beat our packed GEMM
    on the fp32 ones at every row count it takes, and on a bf16 model's own weights
    oneDNN's bf16 product up to 4 rows, and our GEMM on pair panels up to 4 rows too;
    the fp32 GEMV tied the GEMM from 2 to 6 rows and lost at 7-8, so it keeps one row.
    Zen 4 keeps one row and two (bench/NOTES.md)."""
    monkeypatch.setattr(gemv_module, "kernels_built_for_avx512", lambda: True)
    monkeypatch.setattr(gemm_module, "kernels_built_for_avx512", lambda: True)
    monkeypatch.setattr(choose, "cpu_is_intel", lambda: False)
    monkeypatch.setattr(choose, "avx512_full_width", lambda: full_width)
    assert weight_dtype_max_rows() == sixteen_bit_rows
    assert onednn_gemv_rows(torch.bfloat16) == bf16_rows
    monkeypatch.setattr(choose, "bf16_dot_gemm_available", lambda: True)
    assert choose.bf16_packed_gemv_rows() == dot_rows
    assert onednn_gemv_rows(torch.float16) == onednn_gemv_rows(torch.float32) == \
        GEMV_OVER_ONEDNN_ROWS
    assert fp32_gemv_rows() == GEMV_OVER_PACKED_GEMM_ROWS


@pytest.mark.parametrize("items", [1, 2, 7, 64])
def test_work_stealing_runs_every_item_once_and_others_take_a_stalled_threads_share(items):
    """The GEMM and decode attention share out their items this way
    (kernels/csrc/work_stealing.h): thread 0 stalls on the first item it takes, as
    one that lost its core would, and the others take the rest of its range (a
    static split would leave it half the items)."""
    threads = min(torch.get_num_threads(), items)
    ran_by, times = torch.ops.llmserve.stolen_items(items, 200_000 if threads > 1 else 0)
    assert times.tolist() == [1] * items
    assert set(ran_by.tolist()) <= set(range(threads))
    if threads > 1:
        assert (ran_by == 0).sum() <= 1, ran_by


@pytest.mark.parametrize("rows", [1, 7, 16, 291, 576, 3072])
def test_shared_tail_runs_static_shares_then_gives_a_stalled_threads_tail_away(rows):
    """Our GEMV shares out its weight rows this way (work_stealing.h
    parallel_for_shared_tail, grains of 8): each thread runs its static share of the
    first 7/8 of the rows; thread 0 stalls at its first range, and the others take
    every row of the tail."""
    threads = max(1, min(torch.get_num_threads(), rows // 8))
    ran_by, times = torch.ops.llmserve.shared_tail_rows(rows, 8, 200_000 if threads > 1 else 0)
    assert times.tolist() == [1] * rows
    head = rows - rows // 8 if threads > 1 else rows
    for t in range(threads):
        assert set(ran_by[head * t // threads:head * (t + 1) // threads].tolist()) == {t}
    assert 0 not in ran_by[head:].tolist()
