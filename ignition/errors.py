"""ignition's failure kinds and their documented exit codes."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug: please report it
    USAGE = 2  # bad flags or arguments, unknown recipe, --out exists without --force
    SOURCE = 3  # the checkpoint is missing, unreadable, corrupted or of an unsupported architecture
    VERIFY = 4  # a checksum, self-check or golden comparison failed
    FORMAT = 5  # the core's format version is newer (or older) than this ignition understands


class IgnitionError(Exception):
    """An expected failure with a message for the user and an exit code."""

    code = ExitCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(IgnitionError):
    code = ExitCode.USAGE


class SourceError(IgnitionError):
    code = ExitCode.SOURCE


class VerifyError(IgnitionError):
    code = ExitCode.VERIFY


class FormatError(IgnitionError):
    code = ExitCode.FORMAT
