"""helios' quantized linears (helios/engine/native/linear_q.cpp, linear_q_avx2.cpp): int8 and int4
weights in helios.core.quant's stored layout, packed once (pack_qlinear), multiplied by float32 or
bfloat16 activations (qlinear) on AVX-512 and on AVX2+FMA.

Against helios.core.quant.dequantize and a float64 product on random shapes (odd output sizes,
inputs a multiple of the group, 1-64 rows and a 300-row chunk, with and without bias): within fp32
accumulation error of the exact product; the dequantized weights themselves exact (an identity
input reads them back bit for bit); a row's bits the same alone, beside 63 others, in a 300-row
chunk, on either instruction set and any thread count; stacks of experts packed as [E, bytes]."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from helios.core import quant
from helios.engine import native

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or not (native.load() and torch.ops.flare_native.has_qlinear()),
    reason="not an x86-64 CPU with AVX2 and FMA, or no C++ compiler for helios' native kernels",
)

ISAS = [
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            not (native.loaded() and torch.ops.flare_native.has_qlinear_avx512()), reason="no AVX-512 here"
        ),
    ),
    "avx2",
]
BF16_STEP = 2.0**-7  # relative spacing of bfloat16: rounding moves a value by half of it at most


def _stored(n: int, k: int, fmt: str, group: int, scale_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return quant.quantize(torch.randn(n, k, generator=generator), fmt, group, scale_dtype)


def _pack(stored: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    return torch.ops.flare_native.pack_qlinear(
        stored[quant.QWEIGHT], stored[quant.SCALES], stored.get(quant.MINS), group
    )


def _weight(stored: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    return quant.dequantize(stored[quant.QWEIGHT], stored[quant.SCALES], stored.get(quant.MINS), group)


def _qlinear(isa: str, monkeypatch: pytest.MonkeyPatch, *args) -> torch.Tensor:
    monkeypatch.setenv("FLARE_QLINEAR_ISA", isa)
    return torch.ops.flare_native.qlinear(*args)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product in float64, and the scale of its rounding error (sum of |terms|)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
    return exact, scale


def _check(y: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor], k: int) -> None:
    """y within fp32 accumulation error (plus bfloat16 rounding of bfloat16 outputs) of the exact product."""
    exact, scale = reference[0][: y.shape[0]], reference[1][: y.shape[0]]
    bound = k * 2.0**-24 * scale + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + BF16_STEP / 2 * exact.abs()
    assert bool(((y.double() - exact).abs() <= bound).all())


CASES = [  # (out, in) per group: odd outputs, one block and less, many blocks and a part
    (1, 1),
    (17, 3),
    (45, 2),
    (203, 5),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("group", quant.GROUPS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_reference(isa: str, fmt: str, group: int, scale_dtype: torch.dtype, monkeypatch) -> None:
    for i, (n, groups) in enumerate(CASES):
        k = group * groups
        stored = _stored(n, k, fmt, group, scale_dtype, seed=i)
        packed, w = _pack(stored, group), _weight(stored, group)
        generator = torch.Generator().manual_seed(100 + i)
        x = torch.randn(300, k, generator=generator)
        b = torch.randn(n, generator=generator) if i % 2 else None
        reference, reference_bf16 = _reference(x, w, b), _reference(x.to(torch.bfloat16), w, b)
        for rows in (1, 2, 3, 5, 16, 33, 64, 300):
            y = _qlinear(isa, monkeypatch, x[:rows], packed, b, n)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            _check(y, reference, k)
            yb = _qlinear(isa, monkeypatch, x[:rows].to(torch.bfloat16), packed, b, n)
            assert yb.dtype == torch.bfloat16
            _check(yb, reference_bf16, k)
            # bfloat16 outputs are the fp32 sums of the (exactly widened) inputs, rounded
            exact_in = _qlinear(isa, monkeypatch, x[:rows].to(torch.bfloat16).float(), packed, b, n)
            assert torch.equal(exact_in.to(torch.bfloat16), yb)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_are_the_dequantized_values(isa: str, fmt: str, scale_dtype: torch.dtype, monkeypatch) -> None:
    """An identity input reads every weight back: exactly dequantize's float32 value (q * scale, or
    q * scale + min as a product then a sum), on the few-row and on the many-row kernel."""
    for group in quant.GROUPS:
        n, k = 37, group * 2
        stored = _stored(n, k, fmt, group, scale_dtype, seed=group)
        packed, w = _pack(stored, group), _weight(stored, group)
        assert torch.equal(_qlinear(isa, monkeypatch, torch.eye(k), packed, None, n), w.T)
        for i in range(0, k, 7):  # one row at a time: the decode kernel
            assert torch.equal(_qlinear(isa, monkeypatch, torch.eye(k)[i : i + 1], packed, None, n)[0], w[:, i])


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_a_rows_bits_never_depend_on_its_neighbours(fmt: str, monkeypatch) -> None:
    """Alone, beside 63 others, in a 300-row chunk, on either instruction set, with 1 or 2 threads:
    the same bits (one fp32 fused multiply-add chain per output, features ascending)."""
    n, k, group = 203, 384, 64
    stored = _stored(n, k, fmt, group, torch.bfloat16, seed=7)
    packed = _pack(stored, group)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    b = torch.randn(n)
    isas = ["avx2"] + (["avx512"] if torch.ops.flare_native.has_qlinear_avx512() else [])
    chunk = _qlinear(isas[0], monkeypatch, x, packed, b, n)
    threads = torch.get_num_threads()
    try:
        for isa in isas:
            for count in (1, 2):
                torch.set_num_threads(count)
                assert torch.equal(_qlinear(isa, monkeypatch, x, packed, b, n), chunk)
                assert torch.equal(_qlinear(isa, monkeypatch, x[:64], packed, b, n), chunk[:64])
                for rows in (1, 2, 3, 5, 16):
                    assert torch.equal(
                        _qlinear(isa, monkeypatch, x[40 : 40 + rows], packed, b, n), chunk[40 : 40 + rows]
                    )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_expert_stacks_pack_one_blob_per_expert(isa: str, fmt: str, monkeypatch) -> None:
    experts, n, k, group = 3, 45, 128, 32
    w = torch.randn(experts, n, k, generator=torch.Generator().manual_seed(3))
    stored = quant.quantize(w, fmt, group, torch.bfloat16)
    blob = _pack(stored, group)
    assert blob.dim() == 2 and blob.shape[0] == experts and blob.dtype == torch.uint8
    x = torch.randn(2, 5, k)  # leading dims kept
    for e in range(experts):
        one = {name: tensor[e] for name, tensor in stored.items()}
        assert torch.equal(blob[e], _pack(one, group))
        y = _qlinear(isa, monkeypatch, x, blob[e], None, n)
        assert y.shape == (2, 5, n)
        _check(y.reshape(10, n), _reference(x.reshape(10, k), _weight(one, group), None), k)
        assert torch.allclose(y, F.linear(x, _weight(one, group)), rtol=1e-4, atol=1e-4)


def test_wrong_inputs_say_what_is_wrong() -> None:
    stored = _stored(16, 64, quant.INT8, 32, torch.float32, seed=1)
    packed = _pack(stored, 32)
    with pytest.raises(RuntimeError, match="group must be 32, 64 or 128"):
        torch.ops.flare_native.pack_qlinear(stored[quant.QWEIGHT], stored[quant.SCALES], None, 16)
    with pytest.raises(RuntimeError, match="input size 63 does not match"):
        torch.ops.flare_native.qlinear(torch.randn(2, 63), packed, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.flare_native.qlinear(torch.randn(2, 64), packed, None, 15)
    with pytest.raises(RuntimeError, match="not a pack_qlinear blob"):
        torch.ops.flare_native.qlinear(torch.randn(2, 64), torch.zeros(640, dtype=torch.uint8), None, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 activations"):
        torch.ops.flare_native.qlinear(torch.randn(2, 64).half(), packed, None, 16)


def test_blobs_of_an_earlier_build_still_read(monkeypatch) -> None:
    """A compiled step holds its blobs as constants: a bfloat16 blob packed before the header named
    its scale type (scale_bytes = 2 in all 64 bits) multiplies as it always did."""
    stored = _stored(45, 128, quant.INT4, 64, torch.bfloat16, seed=5)
    packed = _pack(stored, 64)
    old = packed.clone()
    old[48:56].view(torch.int64)[0] = 2  # header word 6: scale_bytes as one int64
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    for isa in ("avx2",) + (("avx512",) if torch.ops.flare_native.has_qlinear_avx512() else ()):
        assert torch.equal(
            _qlinear(isa, monkeypatch, x, old, None, 45), _qlinear(isa, monkeypatch, x, packed, None, 45)
        )
