"""The grammar probe's worker process (`python -m helios.frontend.grammar_worker`, started by
helios.frontend.grammar_probe): compiles each grammar it is sent under an address-space limit
and answers with the bytes the compiled grammar holds. It may die trying; that is what it is for.
"""

from __future__ import annotations

import ctypes
import resource
import sys

import llguidance
from tokenizers import Tokenizer

from helios.frontend import grammar
from helios.frontend.grammar_probe import recv, send


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_bytes() -> int:
    """Bytes allocated and in use (glibc's mallinfo2: heap plus mmapped blocks), else the RSS.
    Allocated bytes, unlike the RSS, also count memory reused from earlier, freed compiles."""
    try:
        info = ctypes.CDLL(None).mallinfo2
        info.restype = _MallInfo2
        stats = info()
        return int(stats.uordblks + stats.hblkhd)
    except (AttributeError, OSError):
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize()


def main() -> None:
    """Compile what arrives on stdin until it closes; answer each on stdout with ("ok", bytes
    held), ("invalid", message) or ("memory", 0)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer_json, vocab_size, eos_ids, address_space = recv(stdin)  # type: ignore[misc]
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    built: dict[str, llguidance.LLTokenizer] = {}

    def tokenizer_for(target: str) -> llguidance.LLTokenizer:
        if target not in built:
            if target == "bytes":
                built[target] = grammar._byte_tokenizer()
            else:
                plain = Tokenizer.from_str(tokenizer_json)
                plain.no_padding()
                plain.no_truncation()
                built[target] = llguidance.LLTokenizer(plain.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
        return built[target]

    tokenizer_for("tokens")
    send(stdout, ("ready", 0))
    while True:
        try:
            target, kind, definition = recv(stdin)  # type: ignore[misc]
        except EOFError:
            return
        try:
            tokenizer = tokenizer_for(target)
            before = heap_bytes()
            matcher = llguidance.LLMatcher(
                tokenizer, grammar.grammar_source(kind, definition), log_level=0, limits=grammar.parser_limits()
            )
            if not matcher.is_error():
                matcher.compute_bitmask()  # the lexer is built here: part of the cost
            if matcher.is_error():
                send(stdout, ("invalid", matcher.get_error()))
            else:
                send(stdout, ("ok", max(0, heap_bytes() - before)))
            del matcher
        except MemoryError:
            send(stdout, ("memory", 0))
        except Exception as exc:  # noqa: BLE001 - a compile error is the answer
            send(stdout, ("invalid", str(exc)))


if __name__ == "__main__":
    main()
