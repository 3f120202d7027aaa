"""Grammar compiles tried first in worker processes, so native compiler failures stay there.

llguidance is native code: some grammars within the size limit crash it (a few thousand
chained Lark rules overflow its stack), others take gigabytes or run past any deadline. A
new grammar is first compiled in a worker process (helios.frontend.grammar_worker) with an
address-space limit; a crash, an allocation failure or a missed deadline kills only that
worker (it is replaced), and the request gets a 400. Only grammars that compiled there are compiled in the server, and the
worker's measured memory for them is what the server's grammar cache charges.
Cheap structural pre-checks (rule count, alternation width, nesting, repetition) run
before any of it.
"""

from __future__ import annotations

import json
import logging
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

log = logging.getLogger("helios.grammar")

MAX_LARK_RULES = 1000  # a few thousand chained rules overflow llguidance's stack
MAX_ALTERNATIVES = 1000  # llguidance refuses rows of over 2,000 items mid-generation
MAX_NESTING = 50  # parentheses inside each other
MAX_REPETITION = 10_000  # product of nested bounded repetitions: (x{1000}){1000} builds a million states
WORKER_ADDRESS_SPACE = 4 << 30  # the worker's whole virtual memory, libraries and tokenizer included
STARTUP_SECONDS = 60.0  # a new worker imports llguidance and builds the tokenizer
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?\s*:", re.MULTILINE)
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_STRINGS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*')


class ProbeRefused(ValueError):
    """The grammar failed its pre-checks or its trial compile; the message says why."""


# ---------------------------------------------------------------------------- pre-checks
def precheck(kind: str, definition: str) -> None:
    """Structural bounds checked on the text, before any compiling."""
    if kind == "lark":
        rules = len(_LARK_RULE.findall(definition))
        if rules > MAX_LARK_RULES:
            raise ProbeRefused(f"the grammar has {rules} rules; at most {MAX_LARK_RULES} are accepted")
        body = _STRINGS.sub('""', definition)  # '|' and parentheses inside literals do not count
        for rule in re.split(r"\n(?=\s*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?\s*:)", body):
            width = rule.count("|") + 1
            if width > MAX_ALTERNATIVES:
                raise ProbeRefused(f"a rule has {width} alternatives; at most {MAX_ALTERNATIVES} are accepted")
        _check_nesting(body)
    elif kind == "regex":
        _check_regex(definition)
    elif kind == "json_schema":
        for pattern in _schema_patterns(definition):
            _check_regex(pattern)


def _check_regex(pattern: str) -> None:
    _check_nesting(pattern)
    weight = _repetition_weight(pattern)
    if weight > MAX_REPETITION:
        raise ProbeRefused(f"nested bounded repetitions multiply to {weight}; at most {MAX_REPETITION} are accepted")


def _schema_patterns(definition: str) -> list[str]:
    """Every regex a JSON schema carries ("pattern" values, "patternProperties" keys)."""
    try:
        stack = [json.loads(definition)]
    except ValueError:
        return []  # the compiler reports malformed JSON
    patterns: list[str] = []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                patterns += [key for key in node["patternProperties"] if isinstance(key, str)]
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return patterns


def _check_nesting(text: str) -> None:
    depth = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    if deepest > MAX_NESTING:
        raise ProbeRefused(f"parentheses nest {deepest} deep; at most {MAX_NESTING} are accepted")


def _repetition_weight(pattern: str) -> int:
    """The largest product of bounded repetition counts along any nesting path of a regex."""
    stack = [1]  # per open group: the heaviest weight inside it so far
    last = 1  # weight of the atom just closed (a quantifier multiplies it)
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            last = 1
            continue
        if char == "(":
            stack.append(1)
            last = 1
        elif char == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
        elif char == "{" and (match := _QUANTIFIER.match(pattern, i)):
            upper = int(match.group(2)) if match.group(2) else int(match.group(1))
            last *= max(upper, 1)
            stack[-1] = max(stack[-1], last)
            i = match.end()
            continue
        else:
            last = 1
        i += 1
    return max(stack[0], last)


# ---------------------------------------------------------------------------- worker processes
@dataclass(frozen=True, slots=True)
class TrialTokenizer:
    """What a worker needs to build the server's llguidance tokenizer."""

    tokenizer_json: str
    vocab_size: int
    eos_ids: tuple[int, ...]


def send(stream: BinaryIO, message: object) -> None:
    """Write one length-prefixed msgpack frame (both ends of a worker's pipes)."""
    frame = msgspec.msgpack.encode(message)
    stream.write(len(frame).to_bytes(4, "little") + frame)
    stream.flush()


def recv(stream: BinaryIO) -> object:
    """Read one frame written by `send`; EOFError when the other end is gone."""
    header = stream.read(4)
    if len(header) < 4:
        raise EOFError
    return msgspec.msgpack.decode(stream.read(int.from_bytes(header, "little")))


class _Worker:
    """One worker process, started with the tokenizer; answers one question at a time."""

    def __init__(self, tokens: TrialTokenizer, address_space: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helios.frontend.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.ready = False
        send(self.process.stdin, (tokens.tokenizer_json, tokens.vocab_size, list(tokens.eos_ids), address_space))

    def ask(self, message: tuple, deadline: float) -> tuple[str, int] | None:
        """The worker's answer, or None when it died or missed the deadline (it is then killed)."""
        try:
            if not self.ready:  # building the tokenizer is not the grammar's time
                if not self._wait(time.monotonic() + STARTUP_SECONDS):
                    self.kill()
                    return None
                recv(self.process.stdout)
                self.ready = True
            send(self.process.stdin, message)
            if self._wait(deadline):
                status, value = recv(self.process.stdout)  # type: ignore[misc]
                return str(status), value
        except (EOFError, OSError, ValueError, msgspec.DecodeError):
            pass
        self.kill()
        return None

    def _wait(self, deadline: float) -> bool:
        readable, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        return bool(readable)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class ProbePool:
    """Worker processes that compile grammars first; a dead or late worker is replaced."""

    def __init__(
        self,
        tokens: TrialTokenizer,
        workers: int = 1,
        memory_limit: int = 128 << 20,
        address_space: int = WORKER_ADDRESS_SPACE,
    ) -> None:
        self.tokens = tokens
        self.memory_limit = memory_limit  # bytes one compiled grammar may hold
        self.address_space = address_space
        self._idle: list[_Worker] = []
        self._slots = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self.crashes = 0

    def start(self) -> None:
        """Start the workers now (they build their tokenizers in the background)."""
        with self._lock:
            self._idle.append(_Worker(self.tokens, self.address_space))

    def trial(self, target: str, kind: str, definition: str, timeout_s: float) -> int:
        """Bytes the compiled grammar holds; ProbeRefused when it cannot be compiled safely."""
        precheck(kind, definition)
        deadline = time.monotonic() + timeout_s
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else _Worker(self.tokens, self.address_space)
            answer = worker.ask((target, kind, definition), deadline)
            if answer is None:
                self.crashes += 1
                late = time.monotonic() >= deadline
                with self._lock:
                    self._idle.append(_Worker(self.tokens, self.address_space))  # the replacement starts now
                if late:
                    raise ProbeRefused(f"compiling the grammar took longer than {timeout_s:g} s")
                raise ProbeRefused("the grammar could not be compiled (the grammar compiler failed on it)")
            with self._lock:
                self._idle.append(worker)
        if time.monotonic() > deadline:  # answered, but after the deadline (e.g. this thread was descheduled)
            raise ProbeRefused(f"compiling the grammar took longer than {timeout_s:g} s")
        status, value = answer
        if status == "memory":
            raise ProbeRefused("compiling the grammar needs more memory than a grammar may use")
        if status == "invalid":
            raise ProbeRefused(str(value))
        if value > self.memory_limit:
            raise ProbeRefused(
                f"the compiled grammar needs about {value >> 20} MiB; at most "
                f"{self.memory_limit >> 20} MiB are allowed per grammar"
            )
        return value

    def close(self) -> None:
        with self._lock:
            for worker in self._idle:
                worker.kill()
            self._idle = []


ProbeFn = Callable[[str, str, str, float], int]
