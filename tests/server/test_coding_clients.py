"""Coding clients in multi-turn tool sessions (spec "Clients and tests"): Codex 0.162.1 over
Responses and Claude Code 2.1.296 over Messages, in normal and bare mode, each fix a bug in a
temporary git repository against helios: read the files (two parallel calls), edit one (Claude
Code's Edit tool; Codex's freeform apply_patch custom tool, whose Lark grammar helios
validates), run the repository's test command, answer. Every turn carries reasoning.

The models this machine can run are too small to drive an agent, so helios serves a real core
whose sampled tokens follow a script keyed on the conversation the client sent
(tests/server/scripted.py: real scheduler, template, parsers, encoders and HTTP). Two cores
exercise two tool-call parsers: a tiny Qwen3 with Qwen3.5's template and qwen3_coder
function-tag calls, and a tiny Qwen3 with Qwen3's template and Hermes JSON calls. Each client
is configured by exactly what `helios clients` prints (client_setup.configure).

Streaming and buffered: both clients stream, and neither lets a session choose buffered
responses. Codex's Responses provider has no buffered mode. Claude Code sends a buffered request
as its fallback after a failed stream (and for its auto permission mode's safety classifier,
whose prompt, ~110k tokens on the test tokenizer, does not prefill on a CPU within the
classifier's 70 s timeout: the sessions run with --permission-mode dontAsk and an allow list).
So the first try of the test step stops inside its tool call: helios ends that stream with the
protocol's failure event (Messages `error`, Responses `response.failed`), Claude Code repeats the
request buffered and Codex reconnects, and each session goes on with helios' answer to the retry.

Runs only with FLARE_RUN_CLIENT_TESTS=1 (a few minutes: Claude Code's normal mode sends about
52k tokens of system prompt and tool definitions on these cores' byte-level tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from client_setup import configure, json_lines
from scripted import Exchange, ScriptedServer, scripted_app
from serving import API_KEY

from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

pytestmark = pytest.mark.skipif(
    os.environ.get("FLARE_RUN_CLIENT_TESTS") != "1",
    reason="coding-client sessions run only with FLARE_RUN_CLIENT_TESTS=1",
)

DATA = Path(__file__).resolve().parents[1] / "data"
CONTEXT = 131072  # Claude Code's normal mode alone sends ~52k tokens on the byte-level test tokenizer
CLIENT_TIMEOUT_S = 900
GENERATION_PATHS = ("/v1/messages", "/v1/responses")
TASK = "The test in test_calc.py fails. Fix the bug in calc.py and run the test."

CALC = "def add_numbers(left, right):\n    total = left - right\n    return total\n"
BUG, FIX = "total = left - right", "total = left + right"
# The test writes a marker file, and prints a line its source does not contain (so the line in a
# later request can only come from running it).
TEST = """import pathlib

from calc import add_numbers

result = add_numbers(2, 3)
pathlib.Path(".tests-ran").write_text(f"add_numbers(2, 3) = {result}\\n")
assert result == 5, f"add_numbers(2, 3) returned {result}"
print("test_calc: " + "passed".upper())
"""
TEST_ONLY = ".upper()"  # in test_calc.py only
TEST_COMMAND = f"{sys.executable} test_calc.py"
PASSED = "test_calc: PASSED"
FINAL = "Fixed add_numbers in calc.py (it subtracted); test_calc.py passes."
PREAMBLE = {"edit": "The subtraction is the bug; fixing it.\n\n"}  # answer text before a turn's calls
THOUGHTS = {
    "read": "The user wants a fix. First look at calc.py and its test.",
    "edit": "add_numbers subtracts where it should add.",
    "test": "Now run the test to check the fix.",
    "final": "The test passed, so the fix works.",
}

Call = tuple[str, dict[str, Any]]  # (tool name, arguments)


# ---------------------------------------------------------------------------- cores
@dataclass(frozen=True)
class Flavour:
    recipe: str  # tests/data/<recipe>.toml
    chat: str | None  # the test checkpoint's chat flavour (None: Qwen3's own)
    syntax: str  # the recipe's tool syntax, as the scripted model writes it


FLAVOURS = {
    "qwen3_coder": Flavour("tiny_qwen3_coder", "qwen3.5", "qwen3_coder"),
    "hermes": Flavour("tiny_qwen3", None, "hermes"),
}


def _long_core(flavour: Flavour, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 core whose context fits the clients' prompts (its rotary embedding has no
    trained length to exceed: the weights are random)."""
    checkpoint = write_testmodel("qwen3", tmp_path_factory.mktemp("ckpt") / flavour.recipe, seed=5, chat=flavour.chat)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    out = tmp_path_factory.mktemp("cores") / flavour.recipe
    export_core(open_source(str(checkpoint)), load_recipe(str(DATA / f"{flavour.recipe}.toml")), ExportOptions(out=out))
    return out


Served = tuple[Flavour, Path, ScriptedServer]  # (the core's flavour, its directory, helios serving it)


@pytest.fixture(scope="module", params=sorted(FLAVOURS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    flavour = FLAVOURS[request.param]
    core = _long_core(flavour, tmp_path_factory)
    with scripted_app(core, api_key=API_KEY, kv_pages=16384, host_cache=False) as app:
        yield flavour, core, app


# ---------------------------------------------------------------------------- the scripted model
def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def render_calls(syntax: str, calls: list[Call]) -> str:
    """Tool calls as the core's model writes them."""
    if syntax == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    blocks = [
        "<tool_call>\n<function="
        + name
        + ">\n"
        + "".join(f"<parameter={k}>\n{_value(v)}\n</parameter>\n" for k, v in arguments.items())
        + "</function>\n</tool_call>"
        for name, arguments in calls
    ]
    return "\n".join(blocks)


def unfinished_call(syntax: str, call: Call) -> str:
    """A call the model stops writing before its envelope closes (helios fails the response)."""
    text = render_calls(syntax, [call])
    return text[: text.rindex("}\n</tool_call>" if syntax == "hermes" else "</function>")]


@dataclass(frozen=True)
class Agent:
    """One client's tools for each step of the task, and how it recovers from a failed stream."""

    tools: tuple[str, ...]  # what the agent loop's requests declare (other requests get plain text)
    read: Callable[[Path], list[Call]]  # two parallel calls: calc.py and test_calc.py
    edit: Callable[[Path], Call]
    test: Callable[[Path], Call]
    failed_stream: bytes  # how helios ends a stream whose generation failed, in this client's protocol
    buffered_retry: bool  # the client repeats a failed stream's request buffered (else streamed)


# Typed arguments (booleans, numbers) and indented multi-line strings: the qwen3_coder parser
# converts parameter text by the client's own schemas, and the clients validate what arrives.
CLAUDE = Agent(
    tools=("Read", "Edit", "Bash"),
    read=lambda repo: [("Read", {"file_path": str(repo / name)}) for name in ("calc.py", "test_calc.py")],
    edit=lambda repo: (
        "Edit",
        {
            "file_path": str(repo / "calc.py"),
            "old_string": f"    {BUG}\n    return total",
            "new_string": f"    {FIX}\n    return total",
            "replace_all": False,
        },
    ),
    test=lambda repo: ("Bash", {"command": TEST_COMMAND, "description": "Run the test", "timeout": 120000}),
    failed_stream=b"event: error\n",
    buffered_retry=True,  # Claude Code's non-streaming fallback
)
PATCH = (
    f"*** Begin Patch\n*** Update File: calc.py\n@@ def add_numbers(left, right):\n-    {BUG}\n+    {FIX}\n"
    "*** End Patch\n"
)
CODEX = Agent(
    tools=("exec_command", "apply_patch"),
    read=lambda repo: [
        ("exec_command", {"cmd": "cat calc.py", "login": False}),
        ("exec_command", {"cmd": "cat test_calc.py", "yield_time_ms": 2000}),
    ],
    edit=lambda repo: ("apply_patch", {"input": PATCH}),
    test=lambda repo: ("exec_command", {"cmd": TEST_COMMAND}),
    failed_stream=b"event: response.failed\n",
    buffered_retry=False,  # Codex reconnects
)


@dataclass
class Policy:
    """The next assistant turn from the conversation so far: read, edit, test, answer. The step
    is the furthest one whose evidence is in the prompt (the bug shown by a read, the fix in an
    edit call, the test's output in a tool result). The first try of the test step stops inside
    its call, so helios fails that stream and the client's recovery repeats the request."""

    agent: Agent
    syntax: str
    repo: Path
    turns: list[tuple[str, str]] = field(default_factory=list)  # (step, what the model wrote)

    def step(self, prompt: str) -> str:
        # The template renders each declared tool as JSON; a request declaring none of the loop's
        # tools is outside the agent loop (a title, a summary).
        if not all(f'"name": "{name}"' in prompt for name in self.agent.tools):
            return "side"
        return "final" if PASSED in prompt else "test" if FIX in prompt else "edit" if BUG in prompt else "read"

    def __call__(self, prompt: str) -> str:
        step = self.step(prompt)
        opened = prompt.endswith("<think>\n")  # Qwen's templates open reasoning in the generation prompt
        if step == "side":
            output = ("</think>\n\n" if opened else "") + "Fixing calc.py"
        elif step == "test" and "broken" not in (s for s, _ in self.turns):
            step = "broken"
            output = (
                ("" if opened else "<think>\n")
                + f"{THOUGHTS['test']}\n</think>\n\n"
                + unfinished_call(self.syntax, self.agent.test(self.repo))
            )
        else:
            calls = {
                "read": lambda: self.agent.read(self.repo),
                "edit": lambda: [self.agent.edit(self.repo)],
                "test": lambda: [self.agent.test(self.repo)],
                "final": lambda: [],
            }[step]()
            answer = PREAMBLE.get(step, "") + render_calls(self.syntax, calls) if calls else FINAL
            output = ("" if opened else "<think>\n") + f"{THOUGHTS[step]}\n</think>\n\n{answer}"
        self.turns.append((step, output))
        return output


# ---------------------------------------------------------------------------- sessions
@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed (the task's repository is a git repository, as the clients expect)")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text(CALC)
    (repo / "test_calc.py").write_text(TEST)
    git = ["git", "-c", "user.name=flare", "-c", "user.email=flare@localhost"]
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "a calculator"]):
        subprocess.run(git + argv, cwd=repo, check=True, capture_output=True)
    return repo


def _text(stream: str | bytes | None) -> str:
    return stream.decode("utf-8", "replace") if isinstance(stream, bytes) else stream or ""


def _tail(data: bytearray, size: int) -> str:
    return bytes(data[-size:]).decode("utf-8", "replace")


def report(app: ScriptedServer, policy: Policy, stdout: str, stderr: str) -> str:
    """What a failure prints: the client's output, the scripted turns, the requests helios received."""
    requests = [
        f"--- {e.method} {e.path} ({len(e.body)} bytes) -> {e.status}: ...{_tail(e.body, 1500)}\n"
        f"    response ({len(e.response)} bytes): ...{_tail(e.response, 1500)}"
        for e in app.exchanges[-8:]
    ]
    turns = [f"--- {step}: {output!r}" for step, output in policy.turns]
    return "\n".join(
        [
            "client stdout:",
            stdout[-6000:],
            "client stderr:",
            stderr[-4000:],
            "scripted turns:",
            *turns,
            "last requests:",
            *requests,
        ]
    )


def run_session(argv: list[str], env: dict[str, str], app: ScriptedServer, policy: Policy) -> str:
    """Run the client to completion in the repository; its stdout. The session's exchanges and
    the client's output are kept beside the repository (exchanges.txt, client.stdout/stderr)."""
    first = len(app.exchanges)
    app.follow(policy)
    try:
        result = subprocess.run(
            argv,
            env=env,
            cwd=policy.repo,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{argv[0]} ran past {CLIENT_TIMEOUT_S} s\n" + report(app, policy, _text(exc.stdout), _text(exc.stderr))
        ) from None
    finally:
        log = policy.repo.parent / "exchanges.txt"
        log.write_text(
            "\n\n".join(
                f"=== {e.method} {e.path} -> {e.status}\n{_tail(e.body, len(e.body))}\n"
                f"--- response\n{_tail(e.response, len(e.response))}"
                for e in app.exchanges[first:]
            )
        )
    (log.parent / "client.stdout").write_text(result.stdout)
    (log.parent / "client.stderr").write_text(result.stderr)
    diagnosis = report(app, policy, result.stdout, result.stderr) + f"\n(all exchanges: {log})"
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}\n{diagnosis}"
    check_task(policy, app.exchanges[first:], diagnosis)
    return result.stdout


def check_task(policy: Policy, exchanges: list[Exchange], diagnosis: str) -> None:
    """The client did the work with helios' answers: every generation succeeded but the broken
    one, whose stream ended in the protocol's failure event and whose retry (buffered for Claude
    Code) succeeded; the file changed on disk; both parallel reads and the test's output went
    back as results."""
    repo, agent = policy.repo, policy.agent
    generations = [e for e in exchanges if e.path in GENERATION_PATHS]
    assert generations and all(e.status == 200 for e in generations), diagnosis
    assert [s for s, _ in policy.turns if s != "side"] == ["read", "edit", "broken", "test", "final"], diagnosis
    failed = [i for i, e in enumerate(generations) if agent.failed_stream in e.response]
    assert len(failed) == 1 and failed[0] + 1 < len(generations), diagnosis
    retry = generations[failed[0] + 1]
    streamed = [json.loads(e.body).get("stream") is True for e in generations]
    assert streamed == [not (agent.buffered_retry and e is retry) for e in generations], diagnosis
    if agent.buffered_retry:
        assert json.loads(retry.response)["stop_reason"] == "tool_use", diagnosis
    assert (repo / "calc.py").read_text() == CALC.replace(BUG, FIX), diagnosis
    assert (repo / ".tests-ran").read_text() == "add_numbers(2, 3) = 5\n", diagnosis
    bodies = [bytes(e.body).decode("utf-8") for e in generations]
    assert any(BUG in b and TEST_ONLY in b and FIX not in b for b in bodies), diagnosis  # both reads, one request
    assert any(PASSED in b for b in bodies), diagnosis  # the test's output, as a tool result
    assert any(THOUGHTS["read"] in b for b in bodies), diagnosis  # reasoning went back as history
    assert any(PREAMBLE["edit"].strip() in b for b in bodies), diagnosis  # and the text before a call


@pytest.mark.parametrize("mode", ["normal", "bare"])
def test_claude_code_session(claude: Path, served: Served, repo: Path, mode: str) -> None:
    flavour, core, app = served
    env = configure("claude", core, app.url, API_KEY, repo.parent / "home")
    settings = repo.parent / "home" / ".claude" / "flare.json"
    policy = Policy(CLAUDE, flavour.syntax, repo)
    argv = [
        str(claude),
        *(["--bare"] if mode == "bare" else []),
        "--settings",
        str(settings),
        "-p",
        TASK,
        "--output-format",
        "stream-json",
        "--verbose",
        "--max-turns",
        "8",
        # Tools run without prompts, and without the auto mode's classifier (see the docstring).
        "--permission-mode",
        "dontAsk",
        "--allowedTools",
        "Read,Edit,Bash",
    ]
    events = json_lines(run_session(argv, env, app, policy))
    final = events[-1]
    assert final["type"] == "result" and final["is_error"] is False and final["result"].strip() == FINAL, final


def test_codex_session(codex: Path, served: Served, repo: Path) -> None:
    flavour, core, app = served
    env = configure("codex", core, app.url, API_KEY, repo.parent / "home")
    policy = Policy(CODEX, flavour.syntax, repo)
    argv = [str(codex), "exec", "--profile", "flare", "--json", "--sandbox", "workspace-write", TASK]
    events = json_lines(run_session(argv, env, app, policy))
    answers = [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert answers and answers[-1].strip() == FINAL, events
