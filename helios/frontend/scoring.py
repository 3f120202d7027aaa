"""The one label scorer behind /v1/systemone and /v1/decisions, and its confidence math.

Each question becomes a chat prompt (a shared system instruction and state message, then
the question with labelled options and an "Answer:" cue) whose first assistant token is
read once: logprobs of the synthetic labels through the ordinary engine path. Protocols
map their wire questions onto `QuestionSpec` and their answers out of `LabelRead`.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

from helios.frontend.generate import Runner, new_request_id, usage_of
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    InferenceRequest,
    LogprobOptions,
    Message,
    RawPrompt,
    RequestError,
    SamplingOptions,
    StopOptions,
    TextPart,
)
from helios.frontend.prompt import PreparedPrompt
from helios.frontend.prompt_images import ImageRejected
from helios.frontend.request import Frontend

MAX_QUESTIONS = 64
MAX_OPTIONS = 128
MAX_LEVELS = 10
# Synthetic labels, tried in order: A..Z, then AA..ZZ; a label is used only when it is one
# token right after the rendered prompt.
LABEL_CANDIDATES = tuple(string.ascii_uppercase) + tuple(
    a + b for a, b in itertools.product(string.ascii_uppercase, repeat=2)
)
SYSTEM_INSTRUCTION = (
    "You answer questions about the state the user describes. Each question lists labelled options; "
    "reply with the label of the single best option and nothing else."
)
DEFAULT_INSTRUCTIONS = {
    "binary": "Which option describes the state?",
    "choice": "Which option best fits the state?",
    "score": "Which level best fits the state?",
}


# ---------------------------------------------------------------------------- neutral questions
# What the model reads for one value: text, or text with images in reading order (System One
# image assets); a tuple always holds at least one ImagePart and never two adjacent strings.
Content = str | tuple[str | ImagePart, ...]


@dataclass(frozen=True, slots=True)
class Option:
    name: Content  # what the model reads as the option (structured values already rendered to text)
    description: Content | None = None  # optional explanation, shown after the name


@dataclass(frozen=True, slots=True)
class QuestionSpec:
    kind: str  # "binary" (options: yes then no) | "choice" | "score" (levels, lowest first)
    instructions: Content | None  # None: a default question for choice and score
    options: tuple[Option, ...]  # 1..MAX_OPTIONS (binary: exactly 2)


def binary_question(
    instructions: Content | None, if_true: Content | None = None, if_false: Content | None = None
) -> QuestionSpec:
    """A yes/no question; the read's first probability is P(true)."""
    return QuestionSpec("binary", instructions, (Option("Yes", if_true), Option("No", if_false)))


@dataclass(frozen=True, slots=True)
class CompiledQuestion:
    prompt: PreparedPrompt  # the rendered chat prompt and its tokens
    labels: tuple[str, ...]  # label text per option, in option order
    label_ids: tuple[int, ...]  # distinct token ids, each verified as the first assistant token


@dataclass(frozen=True, slots=True)
class LabelRead:
    logprobs: tuple[float, ...]  # raw full-vocabulary logprob of each option's label, option order
    probabilities: tuple[float, ...]  # normalized over the labels; sums to 1
    label_mass: float  # total raw probability on the labels, in [0, 1]


@dataclass
class ScoringUsage:
    input_tokens: int = 0  # logical prompt tokens, cached ones included
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    output_tokens: int = 0  # generated read tokens (one per question)


# ---------------------------------------------------------------------------- confidence math
def normalize(logprobs: Sequence[float]) -> tuple[tuple[float, ...], float]:
    """(probabilities over the labels, raw label mass): a softmax of the label logprobs."""
    peak = max(logprobs)
    if peak == -math.inf:  # no label has any mass: nothing distinguishes them
        return tuple(1.0 / len(logprobs) for _ in logprobs), 0.0
    weights = [math.exp(lp - peak) for lp in logprobs]
    total = sum(weights)
    return tuple(w / total for w in weights), min(1.0, math.exp(peak) * total)


def first_argmax(probabilities: Sequence[float]) -> int:
    """Index of the largest probability; ties go to the first option."""
    return max(range(len(probabilities)), key=lambda i: (probabilities[i], -i))


def choice_confidence(probabilities: Sequence[float]) -> float:
    """Jev choice confidence: clamp((k·max p − 1)/(k − 1), 0, 1); one option: 1."""
    k = len(probabilities)
    if k == 1:
        return 1.0
    return min(1.0, max(0.0, (k * max(probabilities) - 1.0) / (k - 1)))


def score_confidence(probabilities: Sequence[float]) -> float:
    """Jev score confidence: 1 − (mean distance from the first modal level) / (uniform's MAD)."""
    k = len(probabilities)
    if k == 1:
        return 1.0
    mode = first_argmax(probabilities)
    distance = sum(p * abs(i - mode) for i, p in enumerate(probabilities))
    center = (k - 1) / 2
    mad = sum(abs(i - center) for i in range(k)) / k
    return max(0.0, 1.0 - distance / mad)


def expected_score(probabilities: Sequence[float]) -> float:
    """Σ i·p_i over zero-based levels (may land between levels)."""
    return sum(i * p for i, p in enumerate(probabilities))


def label_mass_confidence(read: LabelRead) -> float:
    """Decisions confidence: the winner's full-vocabulary probability (normalized × mass)."""
    return read.probabilities[first_argmax(read.probabilities)] * read.label_mass


# ---------------------------------------------------------------------------- prompts
def require_explicit_ids(frontend: Frontend) -> None:
    if not frontend.manifest.capabilities.explicit_logprob_ids:
        raise RequestError(
            "this core has no explicit-id logprob inputs, which scoring reads; re-export it with "
            "`ignition export` without --no-logprob-ids",
            "model",
        )


def joined(*pieces: Content | ImagePart) -> Content:
    """Pieces read one after another: a plain string while there are no images (the text-only
    prompt is byte-for-byte the same), else a Content tuple with adjacent strings merged."""
    flat: list[str | ImagePart] = []
    for piece in pieces:
        for item in piece if isinstance(piece, tuple) else (piece,):
            if isinstance(item, str) and flat and isinstance(flat[-1], str):
                flat[-1] += item
            elif not (isinstance(item, str) and not item):
                flat.append(item)
    if not any(isinstance(item, ImagePart) for item in flat):
        return "".join(flat)  # type: ignore[arg-type]
    return tuple(flat)


def _question_text(question: QuestionSpec, labels: Sequence[str]) -> Content:
    instructions = question.instructions or DEFAULT_INSTRUCTIONS.get(question.kind, "")
    heading = "Levels, from lowest to highest:" if question.kind == "score" else "Options:"
    lines: list[Content] = [instructions, "", heading]
    for label, option in zip(labels, question.options):
        lines.append(joined(f"{label}. ", option.name, *((": ", option.description) if option.description else ())))
    lines += ["", f"Reply with one label ({', '.join(labels)}).", "Answer:"]
    return joined(*(piece for i, line in enumerate(lines) for piece in ((line,) if i == 0 else ("\n", line))))


def _parts(content: Content) -> tuple[TextPart | ImagePart, ...]:
    return (
        (TextPart(content),)
        if isinstance(content, str)
        else tuple(TextPart(item) if isinstance(item, str) else item for item in content)
    )


def _conversation(state: Content, question_text: Content, merged: bool) -> Conversation:
    """The state as its own user message, or (for templates that insist on alternating
    roles) merged into the question's turn; either way the state prefix is shared."""
    system = Message("system", (TextPart(SYSTEM_INSTRUCTION),))
    state_text = joined("State:\n", state)
    if merged:
        turns = (Message("user", _parts(joined(state_text, "\n\n", question_text))),)
    else:
        turns = (Message("user", _parts(state_text)), Message("user", _parts(question_text)))
    return Conversation((system, *turns), thinking=False)


def _render(frontend: Frontend, state: Content, question_text: Content) -> PreparedPrompt:
    try:
        return frontend.prompt(_conversation(state, question_text, merged=False))
    except ImageRejected:
        raise  # the images, not the template: the merged form would be refused the same way
    except RequestError:
        pass
    try:
        return frontend.prompt(_conversation(state, question_text, merged=True))
    except ImageRejected:
        raise
    except RequestError as exc:
        raise RequestError(
            f"this model's chat template cannot render a scoring prompt: {exc.message}", "model"
        ) from None


class _LabelCheck:
    """Which labels are one token right after a given prompt.

    Tokenization splits on special tokens first, so only the text from the prompt's last
    special token on can change where a label's token starts; that tail is re-encoded.
    """

    def __init__(self, frontend: Frontend, prompt: PreparedPrompt) -> None:
        self.tokenizer = frontend.tokenizer
        text = prompt.text or ""
        specials = frontend.manifest.tokenizer.special_tokens
        start = max((text.rfind(s) for s in specials if s), default=-1)
        self.tail = text[max(start, 0) :]
        self.tail_ids = self._encode(self.tail)
        if tuple(self.tail_ids) != prompt.token_ids[len(prompt.token_ids) - len(self.tail_ids) :]:
            self.tail, self.tail_ids = text, list(prompt.token_ids)  # the split assumption failed: check it all

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token(self, label: str) -> int | None:
        ids = self._encode(self.tail + label)
        if len(ids) == len(self.tail_ids) + 1 and ids[:-1] == self.tail_ids:
            return ids[-1]
        return None

    def pick(self, count: int) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        seen: set[int] = set()
        for label in LABEL_CANDIDATES:
            token = self.token(label)
            if token is not None and token not in seen:
                seen.add(token)
                found.append((label, token))
                if len(found) == count:
                    break
        return found


def compile_question(frontend: Frontend, state: Content, question: QuestionSpec, where: str) -> CompiledQuestion:
    """Render one question and verify its labels against the final rendered prompt.

    Labels are chosen against a first rendering (the prompt's tail does not depend on them),
    then every one is re-verified on the prompt actually submitted. `where` names the
    question in error messages.
    """
    count = len(question.options)
    labels = list(LABEL_CANDIDATES[:count])
    for _ in range(2):
        prompt = _render(frontend, state, _question_text(question, labels))
        check = _LabelCheck(frontend, prompt)
        ids = [check.token(label) for label in labels]
        if None not in ids and len(set(ids)) == count:
            if len(prompt.token_ids) + 1 > frontend.max_model_len:
                raise RequestError(
                    f"{where}: the prompt ({len(prompt.token_ids)} tokens) leaves no room for the "
                    f"answer token in the context of {frontend.max_model_len}",
                    where,
                )
            return CompiledQuestion(prompt, tuple(labels), tuple(ids))  # type: ignore[arg-type]
        picked = check.pick(count)
        if len(picked) < count:
            raise RequestError(
                f"{where}: {count} options need {count} distinct single-token labels, and this "
                f"model's tokenizer offers {len(picked)} after its prompt",
                where,
            )
        labels = [label for label, _ in picked]
    raise RequestError(f"{where}: the labels could not be verified as single tokens after the rendered prompt", where)


def compile_questions(
    frontend: Frontend, state: Content, questions: Sequence[tuple[str, QuestionSpec]]
) -> list[CompiledQuestion]:
    """CPU work (rendering, tokenization) for every question; run it off the event loop."""
    require_explicit_ids(frontend)
    compiled = []
    for where, spec in questions:
        try:
            compiled.append(compile_question(frontend, state, spec, where))
        except ImageRejected as exc:  # images count in the prompt's order: state first, then the question's
            raise ImageRejected(f"{where}: {exc.message}", "assets") from None
    return compiled


# ---------------------------------------------------------------------------- reads
def _read_request(question: CompiledQuestion) -> InferenceRequest:
    """One generated token with the labels' raw logprobs; EOS may be that token (ignore_eos
    keeps its entry), and sampling settings do not touch the raw distribution."""
    return InferenceRequest(
        input=RawPrompt(token_ids=question.prompt.token_ids),
        sampling=SamplingOptions(),
        max_tokens=1,
        stop=StopOptions(ignore_eos=True),
        logprobs=LogprobOptions(top=0, token_ids=question.label_ids),
    )


async def read_labels(
    frontend: Frontend, runner: Runner, questions: Sequence[CompiledQuestion], request_id: str | None = None
) -> tuple[list[LabelRead], ScoringUsage]:
    """Read the questions one after another (later ones reuse the cached state prefix)."""
    request_id = request_id or new_request_id("score")
    reads: list[LabelRead] = []
    usage = ScoringUsage()
    for index, question in enumerate(questions):
        prepared = frontend.prepare(_read_request(question), f"{request_id}-q{index}", [question.prompt])
        generations = runner.submit(prepared).generations
        values: dict[int, float] = {}
        failure: str | None = None
        async for update in runner.merged(generations):
            for entry in update.delta.entries:
                values.update((alt.token_id, alt.logprob) for alt in entry.top)
            if update.delta.error is not None:
                failure = update.delta.error
        if failure is not None or any(token not in values for token in question.label_ids):
            raise RuntimeError(f"the label read of question {index} failed: {failure or 'no logprobs came back'}")
        counted = usage_of(generations)
        usage.input_tokens += counted.prompt_tokens
        usage.cached_tokens += counted.cached_tokens
        usage.output_tokens += counted.completion_tokens
        logprobs = tuple(values[token] for token in question.label_ids)
        probabilities, mass = normalize(logprobs)
        reads.append(LabelRead(logprobs, probabilities, mass))
    return reads, usage
