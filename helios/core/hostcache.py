"""Small facts helios measured or verified on this host, kept between starts.

A start should not redo work whose answer cannot have changed: the thread policy measured
for this core on this CPU, or the checksum of a core file whose size, inode and times are
the same as when it was last hashed. Each fact lives in one JSON file under the cache
directory (`FLARE_CACHE_DIR`, default `~/.cache/flare`); a missing, unreadable or corrupt
file just means measuring again. Delete the directory to forget everything.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()


def directory() -> Path:
    return Path(os.environ.get("FLARE_CACHE_DIR") or Path.home() / ".cache" / "flare")


def _path(name: str) -> Path:
    return directory() / f"{name}.json"


def load(name: str) -> dict[str, Any]:
    try:
        data = json.loads(_path(name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get(name: str, key: str) -> Any:
    return load(name).get(key)


def put(name: str, key: str, value: Any, keep: int = 256) -> None:
    put_many(name, {key: value}, keep)


def put_many(name: str, entries: dict[str, Any], keep: int = 256) -> None:
    """Record each key -> value (JSON-serializable) in one write, keeping the newest `keep`
    entries; never raises for an unwritable cache (the facts are measured again next time)."""
    if not entries:
        return
    with _LOCK:
        data = load(name)
        for key, value in entries.items():
            data.pop(key, None)
            data[key] = value
        for old in list(data)[: max(0, len(data) - keep)]:
            del data[old]
        path = _path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written beside the target and renamed, so a concurrent reader sees a whole file.
            handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(data, out)
            os.replace(staging, path)
        except OSError:
            pass
