"""The tiny Gemma 4 core exported with --host-embeddings (its per-layer input table kept out of the
programs, served through helios' embedding row cache) against the same checkpoint's default core:
the gather is exact, so programs, greedy tokens, generation and prompt logprobs are identical, with
the table read from RAM or disk and with a cache smaller than the step's distinct tokens; the row
cache's counters and the readiness wait move; cores without host tables report zeros."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.golden import recheck
from helios.core.host_rows import HostFed
from helios.core.program import STEP, run_prompt
from helios.engine import EngineConfig, RowCacheConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from ignition.errors import UsageError
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import TEXTS

# (tiny Gemma 4 checkpoint, its default core with prompt logprobs), once per module.
tiny, reference = family_checks.tiny_fixtures("gemma4", "gemma4", "Gemma4ForCausalLM")


@pytest.fixture(scope="module")
def hosted(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint exported with --host-embeddings (and prompt logprobs)."""
    out = tmp_path_factory.mktemp("cores") / "tiny-gemma4-host"
    options = ExportOptions(out=out, prompt_logprobs=True, host_embeddings=True)
    export_core(open_source(str(tiny[0])), load_recipe("gemma4"), options)
    return out


def test_the_manifest_records_the_host_table(tiny: tuple[Path, Path], hosted: Path) -> None:
    plain, core = Core.open(tiny[1]), Core.open(hosted)
    assert plain.manifest.host_embeddings == ()
    (entry,) = core.manifest.host_embeddings
    assert (entry.name, entry.input, entry.file, entry.image_row_id) == (
        "embed_per_layer",
        "embed_per_layer_rows",
        "weights.safetensors",
        None,  # a text-only checkpoint: no image-row substitution
    )
    table = plain.load_weights()["embed_per_layer"]
    assert (entry.rows, entry.width, entry.dtype) == (*table.shape, str(table.dtype).removeprefix("torch."))
    for kind in (STEP, "scored_prefill"):
        inputs = core.manifest.programs[kind].inputs
        assert inputs[-1].name == "embed_per_layer_rows" and inputs[-1].shape == ("T", entry.width)
    assert "embed_per_layer" not in core.load_weights()  # the programs never take the table
    ((_, mapped),) = core.host_tables("disk")
    assert torch.equal(mapped, table)


def test_programs_and_golden_values_are_identical(tiny: tuple[Path, Path], hosted: Path) -> None:
    plain, core = Core.open(tiny[1]), Core.open(hosted)
    prompt = list(range(5, 60))
    for kind in (STEP, "scored_prefill"):
        program = core.load_program(kind)
        assert isinstance(program, HostFed) and "embed_per_layer_rows" not in program.input_names
        ours = run_prompt(program, core.load_weights(), core.manifest.kv, 16, prompt, chunk=7)
        theirs = run_prompt(plain.load_program(kind), plain.load_weights(), plain.manifest.kv, 16, prompt, chunk=7)
        assert torch.equal(ours.logprobs, theirs.logprobs)
    assert recheck(core) <= core.manifest.golden.tolerance


def _generate(core_dir: Path, rows: RowCacheConfig = RowCacheConfig()):
    """Greedy generation with logprobs and prompt logprobs for the texts together (16-token chunks),
    then again from cached prefixes; (outputs of both rounds, the engine's metrics)."""
    core = Core.open(core_dir)
    tok = core.tokenizer()
    requests = [
        EngineRequest(
            f"r{i}", tuple(tok.encode(t).ids), (GREEDY,), 10, ignore_eos=True, num_top_logprobs=3, prompt_logprobs=2
        )
        for i, t in enumerate(TEXTS)
    ]
    engine = build_engine(core, EngineConfig(num_pages=128, prefill_chunk_size=16, row_cache=rows))
    first = run_to_completion(engine, requests)
    second = run_to_completion(
        engine, [replace(r, request_id=r.request_id + "b", prompt_logprobs=None) for r in requests]
    )
    outputs = {rid: (c[0].token_ids, c[0].logprobs, c[0].prompt_logprobs) for rid, c in (first | second).items()}
    return outputs, engine.metrics()


def test_engine_output_is_identical_and_counters_move(tiny: tuple[Path, Path], hosted: Path) -> None:
    expected, plain = _generate(tiny[1])
    assert (plain.embedding_row_lookups, plain.embedding_row_capacity, plain.embedding_rows_resident) == (0, 0, 0)
    vocab = Core.open(hosted).manifest.host_embeddings[0].rows
    for rows in (RowCacheConfig(8192, "ram"), RowCacheConfig(8192, "disk"), RowCacheConfig(4, "disk")):
        got, m = _generate(hosted, rows)
        assert got == expected, rows
        assert m.embedding_row_lookups == m.embedding_row_hits + m.embedding_row_misses
        assert m.embedding_row_misses > 0 and m.embedding_row_hits > 0
        assert (
            m.embedding_row_host_bytes
            == m.embedding_row_misses * Core.open(hosted).manifest.host_embeddings[0].width * 4
        )
        assert m.embedding_row_capacity == rows.rows
        assert 0 < m.embedding_rows_resident <= min(rows.rows, vocab)
        assert m.readiness_samples > 0 and m.readiness_wait_ns > 0  # missed rows' delivery is readiness wait
        if rows.rows == 4:  # far fewer rows than the prompts' distinct tokens: evictions, pass-through
            assert m.embedding_row_evictions > 0 and m.embedding_rows_resident == 4
        else:
            assert m.embedding_row_evictions == 0
            assert m.embedding_row_misses == m.embedding_rows_resident  # each row read once, then kept


def test_the_option_is_refused_where_it_does_not_apply(tmp_path: Path) -> None:
    checkpoint = write_testmodel("gemma3", tmp_path / "gemma3", seed=1)  # no per-layer input table
    with pytest.raises(UsageError, match="--host-embeddings"):
        export_core(
            open_source(str(checkpoint)),
            load_recipe("gemma3"),
            ExportOptions(out=tmp_path / "core", host_embeddings=True),
        )
    assert not (tmp_path / "core").exists()


@pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")
def test_image_rows_take_the_pad_row_in_a_vision_core(tmp_path: Path) -> None:
    """A vision core's image positions gather the vision pad id's row (as the program substitutes it
    when it holds the table): export's self-check of the vision path passes, and the engine's greedy
    tokens and logprobs over a prompt with an image equal the default core's."""
    from helios.core.program import VISION
    from helios.engine.request import EngineImage
    from helios.frontend import images
    from tests.ignition.test_gemma4_vision import _prompt, encoded_images

    checkpoint = write_testmodel("gemma4", tmp_path / "ckpt", seed=3, vision=True)
    outputs = []
    for name, host in (("plain", False), ("host", True)):
        options = ExportOptions(out=tmp_path / name, dtype="float32", host_embeddings=host)
        export_core(open_source(str(checkpoint)), load_recipe("gemma4"), options)
        core = Core.open(tmp_path / name)
        profile = core.manifest.vision
        assert profile is not None
        data = encoded_images()[0]
        pixels, positions = images.prepare(images.decode(data), profile)
        features = core.load_program(VISION)(core.load_weights(), [], pixel_values=pixels, pixel_positions=positions)
        ids, image_positions = _prompt(core, len(features["image_features"]))
        image = EngineImage(
            start=image_positions[0],
            num_tokens=len(image_positions),
            digest=b"host-rows",
            prepare=lambda data=data, profile=profile: images.prepare_views(images.decode(data), profile),
        )
        request = EngineRequest("r", tuple(ids), (GREEDY,), 6, ignore_eos=True, num_top_logprobs=3, images=(image,))
        engine = build_engine(core, EngineConfig(num_pages=32, prefill_chunk_size=11))
        out = run_to_completion(engine, [request])["r"][0]
        outputs.append((out.token_ids, out.logprobs))
        if host:
            (entry,) = core.manifest.host_embeddings
            assert entry.image_row_id == json_config(checkpoint)["text_config"].get("pad_token_id", 0)
            assert engine.metrics().embedding_row_misses > 0
    assert outputs[0] == outputs[1]


def json_config(checkpoint: Path) -> dict:
    import json

    return json.loads((checkpoint / "config.json").read_text())
