"""helios' int8-activation quantized linears (helios/engine/native/linear_qa.cpp, linear_qa_avx2.cpp):
pack_qlinear(..., act_bits=8) and qlinear on that blob quantize each activation row per 32-feature
block to int8 (Q8_0's rule) and multiply integers (AVX512-VNNI vpdpbusd, AVX2 vpmaddubsw).

Against helios.engine.quantized_ref (float64 from the stored tensors and the same activation
quantization) on odd output sizes, groups 32/64/128, int8 and int4, float32, bfloat16 and float16 scales and
activations, 1-64 rows and a 300-row chunk, with and without bias: within float32 rounding of the
per-block terms. A row's bits are the same alone, beside 63 others, in a 300-row chunk, on either
instruction set and any thread count."""

from __future__ import annotations

import platform

import pytest
import torch

from helios.core import quant
from helios.engine import native, quantized, quantized_ref

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or not (native.load() and torch.ops.flare_native.has_qlinear()),
    reason="not an x86-64 CPU with AVX2 and FMA, or no C++ compiler for helios' native kernels",
)

BF16_STEP = 2.0**-7


def _isas() -> list[str]:
    return ["avx2"] + (["avx512"] if torch.ops.flare_native.has_qlinear_avx512() else [])


def _stored(n: int, k: int, fmt: str, group: int, scale_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return quant.quantize(torch.randn(n, k, generator=generator), fmt, group, scale_dtype)


def _args(stored: dict[str, torch.Tensor], group: int) -> tuple:
    return stored[quant.QWEIGHT], stored[quant.SCALES], stored.get(quant.MINS), group


def _pack(stored: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    return torch.ops.flare_native.pack_qlinear(*_args(stored, group), act_bits=8)


def _qlinear(isa: str, monkeypatch: pytest.MonkeyPatch, *args) -> torch.Tensor:
    monkeypatch.setenv("FLARE_QLINEAR_ISA", isa)
    return torch.ops.flare_native.qlinear(*args)


def _reference(x: torch.Tensor, stored: dict[str, torch.Tensor], group: int, b: torch.Tensor | None):
    """The float64 result of the quantized activations, and a bound on the kernel's float32 error:
    each block term rounds a few times (scale product, conversion-free integer, fused add), and the
    sum of |terms| bounds how far that moves the total."""
    main, low = quantized_ref.terms(x, *_args(stored, group))
    exact = main.sum(-1) + (low.sum(-1) if low is not None else 0.0) + (b.double() if b is not None else 0.0)
    size = main.abs().sum(-1) + (low.abs().sum(-1) if low is not None else 0.0)
    size = size + (b.double().abs() if b is not None else 0.0)
    blocks = x.shape[-1] // quantized_ref.ACT_BLOCK
    return exact, (blocks + 3) * 2.0**-23 * size + 1e-30


def _check(y: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    exact, bound = reference[0][: y.shape[0]], reference[1][: y.shape[0]]
    if y.dtype == torch.bfloat16:
        bound = bound + BF16_STEP / 2 * exact.abs()
    assert bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("group", quant.GROUPS)
def test_matches_the_reference(fmt: str, group: int, monkeypatch) -> None:
    for i, (n, groups, scale_dtype) in enumerate(
        [(1, 1, torch.float32), (45, 2, torch.bfloat16), (203, 3, torch.float32), (33, 2, torch.float16)]
    ):
        k = group * groups
        stored = _stored(n, k, fmt, group, scale_dtype, seed=i)
        packed = _pack(stored, group)
        generator = torch.Generator().manual_seed(100 + i)
        chunk = i == 2  # a 300-row prompt chunk; else 1-64 rows
        x = torch.randn(300 if chunk else 64, k, generator=generator)
        x[3, : quantized_ref.ACT_BLOCK] = 0.0  # an all-zero block: d = 0, q = 0
        b = torch.randn(n, generator=generator) if i % 2 else None
        xb = x.to(torch.bfloat16)
        reference, reference_bf16 = _reference(x, stored, group, b), _reference(xb, stored, group, b)
        for isa in _isas():
            for rows in (1, 5, 300) if chunk else (1, 2, 3, 4, 5, 16, 33, 64):
                y = _qlinear(isa, monkeypatch, x[:rows], packed, b, n)
                assert y.dtype == torch.float32 and y.shape == (rows, n)
                _check(y, reference)
                yb = _qlinear(isa, monkeypatch, xb[:rows], packed, b, n)
                assert yb.dtype == torch.bfloat16
                _check(yb, reference_bf16)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_a_rows_bits_never_depend_on_its_neighbours(fmt: str, monkeypatch) -> None:
    """Alone, beside 63 others, in a 300-row chunk, on either instruction set, with 1 or 2 threads:
    the same bits (exact integer block sums, then the same float32 steps in the same order)."""
    n, k, group = 203, 384, 128
    stored = _stored(n, k, fmt, group, torch.bfloat16, seed=7)
    packed = _pack(stored, group)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    b = torch.randn(n)
    isas = _isas()
    chunk = _qlinear(isas[0], monkeypatch, x, packed, b, n)
    threads = torch.get_num_threads()
    try:
        for isa in isas:
            for count in (1, 2):
                torch.set_num_threads(count)
                assert torch.equal(_qlinear(isa, monkeypatch, x, packed, b, n), chunk)
                assert torch.equal(_qlinear(isa, monkeypatch, x[:64], packed, b, n), chunk[:64])
                for rows in (1, 2, 3, 4, 5, 16):
                    got = _qlinear(isa, monkeypatch, x[40 : 40 + rows], packed, b, n)
                    assert torch.equal(got, chunk[40 : 40 + rows])
    finally:
        torch.set_num_threads(threads)


def test_the_reference_quantizes_as_q8_0() -> None:
    x = torch.tensor([[0.0] * 31 + [2.54], [127.0, -63.5, 0.5, 1.5] * 8])  # d = 1 in the second row
    q, d = quantized_ref.quantize_activations(torch.cat([x, torch.zeros(2, 32)], dim=1))
    assert torch.equal(d[:, 1], torch.zeros(2)) and torch.equal(q[:, 1], torch.zeros(2, 32))
    assert d[0, 0].item() == pytest.approx(2.54 / 127) and q[0, 0, 31].item() == 127.0
    assert q[1, 0, :4].tolist() == [127.0, -64.0, 0.0, 2.0]  # halves round to even


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_expert_stacks_and_the_float_blob(fmt: str, monkeypatch) -> None:
    """act_bits=8 packs a stack as [E, bytes] too; a float-activation blob of the same weights still
    gives the exact product, the int8 one the quantized activations' product."""
    experts, n, k, group = 3, 45, 128, 64
    stored = quant.quantize(torch.randn(experts, n, k, generator=torch.Generator().manual_seed(3)), fmt, group)
    blob = _pack(stored, group)
    assert blob.dim() == 2 and blob.shape[0] == experts and blob.dtype == torch.uint8
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(4))
    for e in range(experts):
        one = {name: tensor[e] for name, tensor in stored.items()}
        assert torch.equal(blob[e], _pack(one, group))
        y = _qlinear("avx2", monkeypatch, x, blob[e], None, n)
        assert y.shape == (2, 5, n)
        _check(y.reshape(10, n), _reference(x.reshape(10, k), one, group, None))
        exact = torch.ops.flare_native.pack_qlinear(*_args(one, group))  # act_bits=32
        w = quant.dequantize(*_args(one, group))
        assert torch.allclose(_qlinear("avx2", monkeypatch, x, exact, None, n), x @ w.T, rtol=1e-5, atol=1e-5)


def test_embedding_rows_read_the_int8_activation_blob() -> None:
    """A tied table packed for int8 activations: its lookup gathers exactly dequantize's rows, read
    natively (flare_native::qembedding_a8) and by the torch ops that describe the layout alike."""
    for fmt in quant.FORMATS:
        for group, scale_dtype in ((32, torch.float32), (128, torch.bfloat16), (64, torch.float16)):
            stored = _stored(45, group * 3, fmt, group, scale_dtype, seed=group)
            ids = torch.tensor([[0, 44, 17], [16, 15, 3]])
            packed = _pack(stored, group)
            for dtype in (torch.float32, torch.bfloat16):
                want = quant.dequantize(*_args(stored, group), dtype=dtype)[ids]
                assert torch.equal(quantized.embedding_rows(packed, ids, dtype), want)
                assert torch.equal(torch.ops.flare_native.qembedding_a8(packed, ids, dtype, group * 3), want)
                assert torch.equal(quantized._a8_rows(packed, ids, dtype), want)


def _earlier_layout(blob: torch.Tensor) -> torch.Tensor:
    """The same weight in the layout earlier builds wrote (magic "FLQ8"; a compiled step's constants
    keep it): per block all its scales in one region padded to 64 bytes, then all its weights."""
    h = quantized._header(blob)
    groups, int4 = h.width // h.group, h.bits == 4
    line = 16 * h.scale_bytes * (2 if int4 else 1)
    region = -(-groups * line // 64) * 64
    block_bytes = region + h.width * 16 * h.bits // 8
    earlier = torch.zeros(-(-(64 + h.blocks * block_bytes) // 64) * 64, dtype=torch.uint8)
    earlier[:64] = blob[:64]
    words = earlier[:64].view(torch.int64)
    words[0], words[7] = quantized._MAGIC_A8_REGION, block_bytes
    geo = quantized._a8_geom(h)
    run, kbs = 16 * h.scale_bytes, h.group // 32
    for b in range(h.blocks):
        old, new = 64 + b * block_bytes, 64 + b * h.block_bytes
        for g in range(groups):
            chunk, i = divmod(g, geo.per_chunk)
            at = new + chunk * geo.stride + i * run
            earlier[old + g * run : old + (g + 1) * run] = blob[at : at + run]
            if int4:
                mins = old + (groups + g) * run
                earlier[mins : mins + run] = blob[at + geo.mins : at + geo.mins + run]
            for kb in range(g * kbs, (g + 1) * kbs):
                src = new + chunk * geo.stride + geo.head + (kb - chunk * geo.per_chunk * kbs) * geo.kb_bytes
                dst = old + region + kb * geo.kb_bytes
                earlier[dst : dst + geo.kb_bytes] = blob[src : src + geo.kb_bytes]
    return earlier


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_blobs_of_earlier_builds_give_the_same_bits(fmt: str, monkeypatch) -> None:
    """A blob in the earlier layout (all of a block's scales at its start) multiplies and looks up
    to the same bits as the current one, on either instruction set."""
    for group, scale_dtype in ((32, torch.float16), (64, torch.float32), (128, torch.bfloat16)):
        stored = _stored(45, group * 3, fmt, group, scale_dtype, seed=group + 1)
        blob = _pack(stored, group)
        earlier = _earlier_layout(blob)
        assert not torch.equal(earlier[64:], blob[64 : len(earlier)])
        for rows in (1, 3, 16, 37):
            x = torch.randn(rows, group * 3, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
            for isa in _isas():
                want = _qlinear(isa, monkeypatch, x, blob, None, 45)
                assert torch.equal(_qlinear(isa, monkeypatch, x, earlier, None, 45), want)
        ids = torch.tensor([0, 44, 17, 16])
        want = quant.dequantize(*_args(stored, group), dtype=torch.float32)[ids]
        assert torch.equal(torch.ops.flare_native.qembedding_a8(earlier, ids, torch.float32, group * 3), want)
        assert torch.equal(quantized._a8_rows(earlier, ids, torch.float32), want)
        assert torch.equal(quantized.embedding_rows(earlier, ids, torch.float32), want)


def test_embedding_rows_outside_the_table_are_refused() -> None:
    stored = _stored(45, 64, quant.INT4, 32, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match="outside the table's 45 rows"):
        torch.ops.flare_native.qembedding_a8(_pack(stored, 32), torch.tensor([3, 45]), torch.float32, 64)
    with pytest.raises(RuntimeError, match="rows are 64 wide, not 65"):
        torch.ops.flare_native.qembedding_a8(_pack(stored, 32), torch.tensor([3]), torch.float32, 65)


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("act_bits", [8, 32])
def test_float32_scales_of_float16_values_stream_as_float16(fmt: str, act_bits: int, monkeypatch) -> None:
    """A GGUF grid's scales are float16 values stored as float32: the engine packs them as float16
    (quantized._narrowed), a smaller blob whose products keep every bit, on both instruction sets."""
    half = _stored(37, 96, fmt, 32, torch.float16, seed=11)
    wide = {name: t.float() if t.is_floating_point() else t for name, t in half.items()}
    scales, mins = quantized._narrowed(wide[quant.SCALES], wide.get(quant.MINS))
    assert scales.dtype == torch.float16 and (mins is None or mins.dtype == torch.float16)
    narrow = torch.ops.flare_native.pack_qlinear(wide[quant.QWEIGHT], scales, mins, 32, act_bits)
    full = torch.ops.flare_native.pack_qlinear(*_args(wide, 32), act_bits)
    assert quantized._header(narrow).scale_dtype == torch.float16 and narrow.numel() < full.numel()
    assert quantized._header(full).scale_dtype == torch.float32
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(12))
    for isa in _isas():
        for rows in (1, 5):
            for xs in (x[:rows], x[:rows].to(torch.bfloat16)):
                want = _qlinear(isa, monkeypatch, xs, full, None, 37)
                assert torch.equal(_qlinear(isa, monkeypatch, xs, narrow, None, 37), want)
    other = wide[quant.SCALES].clone()
    other.view(-1)[0] += 2.0**-20  # one scale that is not a float16 value: all stay float32
    assert quantized._narrowed(other, wide.get(quant.MINS))[0].dtype == torch.float32


def test_wrong_act_bits_say_what_to_do() -> None:
    stored = _stored(16, 64, quant.INT8, 32, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="act_bits must be 32"):
        torch.ops.flare_native.pack_qlinear(*_args(stored, 32), act_bits=4)
