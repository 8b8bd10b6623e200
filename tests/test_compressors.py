"""Each compressor's measured relative error ||C(x) - x||^2 / ||x||^2 on random inputs matches what it
should be: the worst-case contraction bound always, and the expected value for the input distribution."""

import math

import pytest
import torch

from hetero.parallel.compression.codecs import BlockQuant, RandomK, TopK
from hetero.parallel.compression.collective import (
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    all_to_all_wire_bytes,
)
from compression_oracle import quantize


class OneReplica:
    """A Collective of one replica: sums are the input itself."""

    size, rank, bytes_sent = 1, 0, 0

    def all_reduce(self, tensor):
        pass

    def all_gather(self, tensor):
        return tensor.unsqueeze(0).clone()

    def all_to_all(self, tensor):
        return tensor.clone()

    def start_round(self):
        pass

    def commit_round(self):
        return True


def relative_error(codec, x):
    total, own = codec.exchange(x, OneReplica(), {})
    torch.testing.assert_close(total, own)
    return float((own - x).pow(2).sum() / x.pow(2).sum())


def gaussian(numel, seed):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_topk_keeps_the_energy_of_the_gaussian_tail():
    x = gaussian(2**16, 0)
    codec = TopK(0.01, 1024)
    measured = relative_error(codec, x)
    assert measured <= codec.contraction()
    # Keeping the top fraction p of |x| for x ~ N(0, 1) keeps E[x^2; |x| > t] = 2 (t phi(t) + 1 - Phi(t)),
    # with t the (1 - p) quantile of |x|; per segment of 1024 the quantile is the empirical one.
    p = codec.k / codec.segment
    t = _normal_abs_quantile(1 - p)
    phi = math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    kept = 2 * (t * phi + 0.5 * math.erfc(t / math.sqrt(2)))
    assert measured == pytest.approx(1 - kept, abs=0.01)


def test_topk_on_a_vector_with_fewer_nonzeros_than_k_is_exact():
    x = torch.zeros(2048)
    x[[3, 900, 1500]] = torch.tensor([1.0, -2.0, 3.0])
    assert relative_error(TopK(0.01, 1024), x) == 0.0


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_randomk_error_is_one_minus_ratio_on_average(ratio):
    x = gaussian(2**15, 1)
    codec = RandomK(ratio, seed=3)
    state = {}
    errors = []
    for _ in range(20):
        total, own = codec.exchange(x, OneReplica(), state)
        errors.append(float((own - x).pow(2).sum() / x.pow(2).sum()))
        assert int((own != 0).sum()) == round(ratio * x.numel())
    assert sum(errors) / len(errors) == pytest.approx(codec.contraction(), abs=0.01)
    assert len(set(errors)) > 1  # a new set of entries on every call


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 64])
def test_quantization_error_is_the_uniform_rounding_error_of_each_block(bits, block):
    x = gaussian(2**14 + 3 * block, 2)  # not a multiple of 2 * block: padding is exercised
    codec = BlockQuant(bits, block)
    measured = relative_error(codec, x)
    assert measured <= codec.contraction()
    # Rounding to a grid of step s = absmax/qmax leaves an error uniform on [-s/2, s/2]: variance s^2/12.
    steps = x.view(-1, block).abs().amax(dim=1) / (2 ** (bits - 1) - 1)
    expected = float((steps.pow(2) / 12 * block).sum() / x.pow(2).sum())
    assert measured == pytest.approx(expected, rel=0.1)
    torch.testing.assert_close(codec.exchange(x, OneReplica(), {})[1], quantize(x, bits, block))


def test_wire_bytes_follow_the_ring_model():
    assert all_reduce_wire_bytes(4000, 4) == 6000
    assert all_gather_wire_bytes(100, 4) == 300
    assert all_to_all_wire_bytes(400, 4) == 300
    assert all_reduce_wire_bytes(4000, 1) == 0


def _normal_abs_quantile(q):
    """t with P(|x| <= t) = q for a standard normal x, by bisection."""
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if math.erf(mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
    return lo


def test_shared_topk_bytes_per_worker_stay_flat_as_workers_are_added_where_topks_grow():
    """From the collective model (``compression_fan_in``): 100,000 parameters at 4, 8, 16 and 64 workers."""
    from hetero.bench.compression_fan_in import WORKERS, bytes_per_worker
    from hetero.parallel.compression.bit_packing import packed_words
    from hetero.parallel.compression.config import CompressorConfig

    params, segments = 100_000, math.ceil(100_000 / 1024)
    kept = segments * round(0.01 * 1024)
    shared = [bytes_per_worker(CompressorConfig(method="shared_topk", ratio=0.01), params, n) for n in WORKERS]
    topk = [bytes_per_worker(CompressorConfig(method="topk", ratio=0.01), params, n) for n in WORKERS]
    assert shared == [all_reduce_wire_bytes(4 * packed_words(kept, 10), n) + all_reduce_wire_bytes(4 * kept, n)
                      for n in WORKERS]  # 10-bit indices in segments of 1,024
    assert topk == [all_gather_wire_bytes(4 * kept + 4 * packed_words(kept, 10), n) for n in WORKERS]
    assert shared[-1] / shared[0] < 1.32 and topk[-1] / topk[0] == 21  # 2·63/64 over 2·3/4; 63 over 3


@pytest.mark.parametrize("bits", [1, 7, 10, 12, 16, 31, 32])
def test_bit_packing_round_trips_and_survives_a_sum_with_zeros(bits):
    """Values of ``bits`` bits end to end in int32 words (straddling words), back unchanged, also after the
    words are summed with all-zero words (what shared top-k's index all-reduce does)."""
    from hetero.parallel.compression.bit_packing import pack_bits, packed_words, unpack_bits

    for count in (1, 3, 64, 1001):
        values = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(count), dtype=torch.int64)
        values[0] = 2**bits - 1  # every bit set
        words = pack_bits(values, bits)
        assert words.dtype == torch.int32 and words.numel() == packed_words(count, bits) == -(-count * bits // 32)
        summed = words + torch.zeros_like(words) + torch.zeros_like(words)
        assert torch.equal(unpack_bits(summed, bits, count), values)


def test_two_bit_blocks_equal_the_oracles_fitted_magnitudes():
    """2-bit codes over two magnitudes fitted per block (``quantize_fitted``) decode to what the loop-written
    oracle gives, bit for bit: heavy-tailed values, a block of zeros, a block of one magnitude, a lone
    spike; the error stays within the contraction bound."""
    from hetero.kernels.quantize import dequantize_blocks, quantize_blocks

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=generator) * torch.rand(512, generator=generator) ** 3
    x[:64], x[64:128], x[200] = 0.0, -0.5, 40.0
    codes, scales = quantize_blocks(x, 2, 64)
    assert codes.numel() == 512 // 4 and scales.shape == (8, 2)
    decoded = dequantize_blocks(codes, scales.reshape(-1), 2, 64)
    assert torch.equal(decoded, quantize(x, 2, 64))
    assert torch.equal(decoded[:128], x[:128])  # zeros and a single magnitude come back exact
    assert (decoded - x).norm() ** 2 <= BlockQuant(2).contraction() * x.norm() ** 2
