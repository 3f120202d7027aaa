"""Configuration: the [server] table, flags, the key file, and startup refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_cli

from helios.config import ConfigError, ServerConfig, load_config


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "helios.toml"
    path.write_text(text)
    return path


def test_file_flags_and_key_file(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, '[server]\napi_key = "a"\nport = 9000\naliases = ["x", "y"]\n'), port=9100)
    assert (config.api_key, config.port, config.aliases) == ("a", 9100, ("x", "y"))
    key = tmp_path / "key"
    key.write_text("from-file\n")
    assert load_config(_write(tmp_path, '[server]\napi_key = "a"\n'), api_key_file=key).api_key == "from-file"
    assert not load_config(_write(tmp_path, '[server]\napi_key = ""\n')).auth_enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nport = 0\n", "port must be a positive integer"),
        ("[server]\nmax_concurrency = -1\n", "max_concurrency must be a positive integer"),
        ("[server]\nthinking_token_budget = 4294967296\n", "thinking_token_budget"),
        ("[server]\nprefil_chunk_size = 8\n", "unknown [server] keys ['prefil_chunk_size']"),
        ("[serve]\nport = 1\n", "unknown tables"),
        ("[server\n", "not valid TOML"),
        ("[server]\nserial_decode_rows = -1\n", "serial_decode_rows must be a non-negative integer"),
        ('[server]\nhost_cache = "yes"\n', "host_cache must be true or false"),
        ("[server]\nhost_cache_memory_mb = 0\n", "host_cache_memory_mb must be a positive integer"),
        ("[server]\nhost_cache_disk_mb = -5\n", "host_cache_disk_mb must be a non-negative integer"),
        ('[server]\nhost_cache_dir = ""\n', "host_cache_dir must be a nonempty path string"),
        ("[server]\nhost_cache_copy_queue_mb = 0\n", "host_cache_copy_queue_mb must be a positive integer"),
        ("[server]\nstate_snapshots = -1\n", "state_snapshots must be a non-negative integer"),
        ("[server]\nsnapshot_interval = 1.5\n", "snapshot_interval must be a non-negative integer"),
        ("[server]\ncheckpoint_work_fraction = -0.1\n", "checkpoint_work_fraction must be a number from 0 to 100"),
        ("[server]\ncheckpoint_work_fraction = true\n", "checkpoint_work_fraction must be a number from 0 to 100"),
        ('[server]\ndevice = "gpu"\n', 'device must be "auto", "cpu", "cuda" or "cuda:N"'),
        ('[server]\ndevice = "cuda:x"\n', 'device must be "auto", "cpu", "cuda" or "cuda:N"'),
        ("[server]\ncuda_graphs = 1\n", "cuda_graphs must be true or false"),
        ('[server]\nwindow_pool = "no"\n', "window_pool must be true or false"),
        ("[server]\npacked_kv_pages = 0\n", "packed_kv_pages must be true or false"),
        ("[server]\nimage_cache_mb = -1\n", "image_cache_mb must be a non-negative integer"),
        ("[server]\nimage_cache_mb = 1.5\n", "image_cache_mb must be a non-negative integer"),
        ("[server]\nkv_memory_fraction = 0\n", "kv_memory_fraction must be a number above 0 and at most 1"),
        ("[server]\nkv_memory_fraction = 1.5\n", "kv_memory_fraction must be a number above 0 and at most 1"),
        ("[server]\nkv_memory_mb = 0\n", "kv_memory_mb must be a positive integer"),
    ],
)
def test_invalid_settings(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert message in str(info.value)


def test_device_setting() -> None:
    """[server] device: auto is CUDA only where torch sees a device; cuda on a host without one is a
    ConfigError that says what to do (helios.engine.devices.resolve)."""
    import torch

    from helios.server.state import resolve_device

    config = load_config(None)
    assert (config.device, config.cuda_graphs, config.kv_memory_mb, config.kv_memory_fraction) == (
        "auto",
        True,
        None,
        0.9,
    )
    assert resolve_device(config) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(ServerConfig(device="cpu")) == "cpu"
    if not torch.cuda.is_available():
        for setting in ("cuda", "cuda:0"):
            with pytest.raises(ConfigError, match='no usable CUDA device.*set device = "cpu"'):
                resolve_device(ServerConfig(device=setting))


def test_startup_refuses_invalid_settings(tiny_core: Path, tmp_path: Path) -> None:
    done = run_cli("helios", "serve", str(tiny_core), "--config", str(_write(tmp_path, "[server]\nhttp_slots = 0\n")))
    assert done.returncode == 2 and "http_slots must be a positive integer" in done.stderr
    budget = _write(tmp_path, "[server]\nthinking_token_budget = 100\n")
    done = run_cli("helios", "serve", str(tiny_core), "--config", str(budget))
    assert done.returncode == 2 and "declares no reasoning syntax" in done.stderr


def test_thinking_budget_needs_a_default_output_start_it_cuts(qwen3_core: Path, tmp_path: Path) -> None:
    # Qwen3's own template starts output in content (the model opens <think>): a default never cuts.
    budget = _write(tmp_path, "[server]\nthinking_token_budget = 100\n")
    done = run_cli("helios", "serve", str(qwen3_core), "--config", str(budget))
    assert done.returncode == 2 and "starts output in content" in done.stderr
