"""Load and validate core bundles; shared by ignition (writer) and helios (server)."""

from helios.core.bundle import Core, CoreError, CoreFormatError, core_digest

__all__ = ["Core", "CoreError", "CoreFormatError", "core_digest"]
