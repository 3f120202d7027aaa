"""What helios keeps between starts: the cache itself, and checksums not re-hashed for
files that have not changed since they last hashed correctly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helios.core import Core, CoreError, bundle, hostcache


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_put_get_and_a_corrupt_file(cache: Path) -> None:
    assert hostcache.get("facts", "a") is None
    hostcache.put("facts", "a", 1)
    hostcache.put("facts", "b", [2, "x"])
    assert hostcache.get("facts", "a") == 1 and hostcache.get("facts", "b") == [2, "x"]
    (cache / "facts.json").write_text("{not json")
    assert hostcache.get("facts", "a") is None  # measured again, never an error
    hostcache.put("facts", "c", 3)
    assert hostcache.load("facts") == {"c": 3}


def test_the_oldest_entries_go_first(cache: Path) -> None:
    for i in range(5):
        hostcache.put("facts", str(i), i, keep=3)
    assert list(hostcache.load("facts")) == ["2", "3", "4"]


def test_an_unwritable_cache_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FLARE_CACHE_DIR", str(blocker / "below-a-file"))
    hostcache.put("facts", "a", 1)
    assert hostcache.get("facts", "a") is None


def test_unchanged_files_are_not_hashed_again(
    tiny_core: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core_dir = tmp_path / "core"
    shutil.copytree(tiny_core, core_dir)
    hashed: list[str] = []
    real = bundle.sha256_file
    monkeypatch.setattr(bundle, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    Core.open(core_dir, trust_unchanged=True)
    first = len(hashed)
    assert first == len(Core.open(core_dir, verify_checksums=False).manifest.files)
    Core.open(core_dir, trust_unchanged=True)
    assert len(hashed) == first  # nothing re-hashed
    Core.open(core_dir)  # without trust_unchanged (ignition verify): everything again
    assert len(hashed) == 2 * first
    # A changed file is hashed again and refused.
    tokenizer = core_dir / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")
    with pytest.raises(CoreError, match="checksum mismatch"):
        Core.open(core_dir, trust_unchanged=True)
