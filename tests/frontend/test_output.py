"""The per-choice output pipeline fed hand-made engine events over a real byte-level tokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from helios.engine.logprobs import TokenLogprobs
from helios.engine.request import EngineEvent, FinishCause
from helios.frontend.detokenizer import TokenBytes
from helios.frontend.inference import LogprobOptions, StopOptions, Termination
from helios.frontend.output import ChoiceOutput, OutputDelta, TokenEntry, text_offsets
from ignition.testmodel import build_tokenizer

TOKENIZER = build_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
TOKENS = TokenBytes(TOKENIZER)
EOS = TOKENIZER.token_to_id("<|endoftext|>")
IM_END = TOKENIZER.token_to_id("<|im_end|>")
LOGPROBS = LogprobOptions(top=2)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def entry_of(token_id: int) -> TokenLogprobs:
    """Deterministic fake logprobs: value and alternatives derived from the id."""
    return TokenLogprobs(token_id, -token_id / 100, ((token_id, -token_id / 100), ((token_id + 1) % 287, -5.0)))


def events(
    tokens: list[int],
    cuts: Sequence[int] = (),
    finish: FinishCause | None = FinishCause.LENGTH,
    stop_match_len: int = 0,
    error: str | None = None,
) -> list[EngineEvent]:
    bounds = [0, *sorted(cuts), len(tokens)]
    chunks = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
    return [
        EngineEvent(
            "r",
            0,
            tuple(chunk),
            tuple(entry_of(t) for t in chunk),
            finish if last else None,
            stop_match_len=stop_match_len if last else 0,
            error=error if last else None,
        )
        for last, chunk in ((i == len(chunks) - 1, c) for i, c in enumerate(chunks))
    ]


def run(
    evts: list[EngineEvent],
    stop: StopOptions = StopOptions(),
    logprobs: LogprobOptions = LOGPROBS,
    skip_special_tokens: bool = True,
) -> tuple[ChoiceOutput, list[OutputDelta]]:
    output = ChoiceOutput(TOKENS, stop, logprobs, frozenset({EOS}), skip_special_tokens)
    return output, [output.push(event) for event in evts]


def joined(deltas: list[OutputDelta]) -> tuple[str, tuple[TokenEntry, ...], tuple[int, ...]]:
    return (
        "".join(d.text for d in deltas),
        tuple(e for d in deltas for e in d.entries),
        tuple(t for d in deltas for t in d.token_ids),
    )


def test_streaming_equals_buffered_for_any_event_split() -> None:
    text = "Hello there world 😀 héllo, the end of the wörld. Hello again"
    tokens = [*ids(text[:30]), EOS, *ids(text[30:]), IM_END]
    cases = [
        (StopOptions(), FinishCause.LENGTH, 0),
        (StopOptions(strings=("wörld", "d 😀x", "the end of", "end")), FinishCause.LENGTH, 0),
        (StopOptions(strings=("not there", "xyz😀")), FinishCause.EOS, 0),
        (StopOptions(token_sequences=(tuple(ids(" the end")), (ids(" again")[-1], IM_END))), FinishCause.STOP_TOKEN, 2),
    ]
    for stop, finish, match_len in cases:
        buffered, buffered_deltas = run(events(tokens, [], finish, match_len), stop)
        expected = joined(buffered_deltas)
        for seed in range(60):
            rng = random.Random(seed)
            cuts = rng.sample(range(1, len(tokens)), rng.randint(0, len(tokens) - 1))
            streamed, deltas = run(events(tokens, cuts, finish, match_len), stop)
            assert joined(deltas) == expected
            assert [d.finish for d in deltas if d.finish] == [buffered_deltas[-1].finish]
            assert streamed.text == buffered.text and streamed.num_generated == buffered.num_generated


def test_plain_text_matches_the_tokenizer() -> None:
    text = "Hello there 😀 wörld"
    output, deltas = run(events(ids(text), [1, 4, 5]))
    assert joined(deltas)[0] == output.text == TOKENIZER.decode(ids(text))
    assert output.token_ids == tuple(ids(text)) and output.num_generated == len(ids(text))
    assert deltas[-1].finish is Termination.LENGTH


def test_stop_spanning_token_boundaries_cuts_before_it_and_asks_for_abort() -> None:
    tokens = ids("Hello there world")  # H e ll o Ġthe re Ġw or l d
    output, deltas = run(events(tokens, list(range(1, len(tokens)))), StopOptions(strings=("ere wo",)))
    assert [d.text for d in deltas[:8]] == ["H", "", "ell", "o", " th", "", "", ""]  # each "e" may start it
    assert deltas[7].finish is Termination.STOP_STRING and deltas[7].matched_stop == "ere wo"
    assert output.text == "Hello th" and output.needs_abort
    # " the" is clipped but keeps its entry and bytes; "or" completes the stop; later tokens get nothing.
    assert [e.token for d in deltas for e in d.entries] == ["H", "e", "ll", "o", " the", "re", " w", "or"]
    assert deltas[4].entries[0].bytes == tuple(b" the")
    assert all(d == OutputDelta("", (), (), None, None, None) for d in deltas[8:])
    assert output.token_ids == tuple(tokens[:8]) and output.num_generated == 8


def test_tokens_beyond_a_stop_in_the_same_event_have_no_entries() -> None:
    tokens = ids("Hello there world")
    output, deltas = run(events(tokens, [], None), StopOptions(strings=("ere",)))
    assert output.text == "Hello th" and deltas[0].finish is Termination.STOP_STRING
    assert [e.token for e in deltas[0].entries] == ["H", "e", "ll", "o", " the", "re"]
    assert output.needs_abort


def test_stop_on_the_final_event_needs_no_abort() -> None:
    output, deltas = run(events(ids("Hello there"), [2]), StopOptions(strings=("there",)))
    assert output.text == "Hello " and deltas[-1].finish is Termination.STOP_STRING
    assert not output.needs_abort


@pytest.mark.parametrize("stops", [("Hello world", "lo w"), ("lo w", "Hello world")])
def test_first_completed_stop_wins_regardless_of_order(stops: tuple[str, ...]) -> None:
    # Streamed token by token "lo w" would complete first, so it wins in one event too.
    output, deltas = run(events(ids("Hello world")), StopOptions(strings=stops))
    assert output.text == "Hel" and deltas[-1].matched_stop == "lo w"


@pytest.mark.parametrize("stops", [("th", " the"), (" the", "th")])
def test_first_completed_stop_wins_inside_one_token(stops: tuple[str, ...]) -> None:
    # The single token " the" holds " the" (starts first) and "th" (ends first, as a stream would see).
    output, deltas = run(events(ids(" the")), StopOptions(strings=stops))
    assert output.text == " " and deltas[-1].matched_stop == "th"


def test_stop_that_is_a_prefix_of_another() -> None:
    for stops in [("the end", "the"), ("the", "the end")]:
        output, deltas = run(events(ids("at the end"), [1, 2, 3]), StopOptions(strings=stops))
        assert output.text == "at " and [d.matched_stop for d in deltas if d.finish] == ["the"]
    # Held "aa" must give back its first "a" when a third "a" shifts the candidate start.
    output, deltas = run(events(ids("xaaab"), [1, 2, 3, 4]), StopOptions(strings=("aab",)))
    assert [d.text for d in deltas] == ["x", "", "", "a", ""] and output.text == "xa"


def test_held_text_is_released_when_no_stop_matches() -> None:
    tokens = ids("Hello wor")
    output, deltas = run(events(tokens, list(range(1, len(tokens)))), StopOptions(strings=("world!", "lo!")))
    assert [d.text for d in deltas] == ["H", "e", "l", "", "lo ", "wor"]  # the last event flushes "wor"
    assert output.text == "Hello wor" and deltas[-1].finish is Termination.LENGTH and not output.needs_abort


def test_partial_utf8_gives_entries_with_empty_text_then_the_character() -> None:
    tokens = ids("Hi 😀")  # H i Ġ ð Ł ĺ Ģ: the emoji is four byte tokens
    output, deltas = run(events(tokens, list(range(1, len(tokens))), None))
    assert [d.text for d in deltas] == ["H", "i", " ", "", "", "", "😀"]
    assert [len(d.entries) for d in deltas] == [1] * 7
    emoji = [d.entries[0] for d in deltas[3:]]
    assert [e.token for e in emoji] == ["\ufffd"] * 4
    assert b"".join(bytes(e.bytes) for e in emoji) == "😀".encode()
    _, cut = run(events(tokens[:5]))
    assert [d.text for d in cut] == ["Hi \ufffd"]  # an unfinished character is flushed replaced


def test_terminating_eos_has_no_text_or_entry() -> None:
    tokens = [*ids("Hi"), EOS]
    output, deltas = run(events(tokens, [2], FinishCause.EOS))
    assert deltas[-1].finish is Termination.EOS and deltas[-1].entries == () and deltas[-1].text == ""
    assert output.text == "Hi" and output.token_ids == tuple(tokens) and output.num_generated == 3


def test_eos_under_ignore_eos_keeps_its_entry() -> None:
    tokens = [*ids("Hi"), EOS, *ids(" yo")]
    output, deltas = run(events(tokens), StopOptions(ignore_eos=True))
    assert output.text == "Hi yo" and [e.token_id for e in deltas[0].entries] == tokens
    shown, _ = run(events(tokens), StopOptions(ignore_eos=True), skip_special_tokens=False)
    assert shown.text == "Hi<|endoftext|> yo"


def test_special_tokens_are_hidden_but_keep_entries() -> None:
    tokens = [*ids("a"), IM_END, *ids("b")]
    output, deltas = run(events(tokens))
    assert output.text == "ab" and deltas[0].entries[1].token == "<|im_end|>"


def test_token_id_stop_is_removed() -> None:
    stop_id = ids("!")[0]
    evts = events([*ids("Hi"), stop_id], [1], FinishCause.STOP_TOKEN, 1)
    output, deltas = run(evts, StopOptions(token_ids=(stop_id,)))
    assert output.text == "Hi" and deltas[-1].finish is Termination.STOP_TOKEN
    assert [e.token for d in deltas for e in d.entries] == ["H", "i"] and output.num_generated == 3


def test_token_sequence_stop_across_events_is_held_then_removed() -> None:
    sequence = tuple(ids(" the end"))  # Ġthe Ġ en d
    stop = StopOptions(token_sequences=(sequence,))
    tokens = [*ids("at"), *sequence]
    output, deltas = run(events(tokens, [1, 2, 3, 4], FinishCause.STOP_TOKEN, len(sequence)), stop)
    assert [d.text for d in deltas] == ["at", "", "", "", ""] and output.text == "at"
    assert [len(d.entries) for d in deltas] == [1, 0, 0, 0, 0]
    assert output.token_ids == tuple(tokens)
    # A broken prefix is released, entries included, once it cannot be the stop any more.
    tokens = [*ids("at"), *sequence[:2], *ids("x")]
    output, deltas = run(events(tokens, [1, 2, 3], None), stop)
    assert [d.text for d in deltas] == ["at", "", "", " the x"]
    assert [len(d.entries) for d in deltas] == [1, 0, 0, 3] and output.num_generated == 4


def test_as_token_ids_strings_keep_exact_bytes() -> None:
    tokens = ids("Hi 😀")
    _, deltas = run(events(tokens), logprobs=LogprobOptions(top=2, as_token_ids=True))
    entries = deltas[0].entries
    assert [e.token for e in entries] == [f"token_id:{t}" for t in tokens]
    assert all(a.token == f"token_id:{a.token_id}" for e in entries for a in e.top)
    assert b"".join(bytes(e.bytes) for e in entries) == "Hi 😀".encode()
    assert entries[0].top[1].bytes == tuple(TOKENS.bytes_of(tokens[0] + 1))


def test_no_entries_without_logprob_request() -> None:
    _, deltas = run(events(ids("Hi")), logprobs=LogprobOptions())
    assert deltas[0].entries == () and deltas[0].text == "Hi"


def test_engine_causes_map_and_errors_are_carried() -> None:
    for cause, termination in [(FinishCause.ABORT, Termination.ABORT), (FinishCause.LENGTH, Termination.LENGTH)]:
        assert run(events(ids("Hi"), [], cause))[1][-1].finish is termination
    _, deltas = run(events(ids("Hi"), [], FinishCause.ERROR, error="boom"))
    assert deltas[-1].finish is Termination.ERROR and deltas[-1].error == "boom" and deltas[-1].text == "Hi"


def test_text_offsets_count_released_characters() -> None:
    tokens = ids("Hi 😀 there")  # H i Ġ ð Ł ĺ Ģ Ġthe re
    _, deltas = run(events(tokens))
    assert text_offsets(deltas[0].entries, 10) == [10, 11, 12, 13, 13, 13, 13, 14, 18]
    assert text_offsets((), 0) == []
