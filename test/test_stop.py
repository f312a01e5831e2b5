"""StopMatcher: streaming result equals a one-shot search, whatever the delta boundaries."""
from hypothesis import given, settings, strategies as st
import pytest

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.stop import StopMatcher

ALPHABET = 'ab\nXY😀'
STOPS = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=0, max_size=4)


def one_shot(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return (text[:min(hits)], True) if hits else (text, False)


def split(text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points + [len(text)]:
        pieces.append(text[last:p])
        last = p
    return pieces


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), stops=STOPS,
       cuts=st.lists(st.integers(0, 1000), max_size=15))
def test_streaming_equals_one_shot(text, stops, cuts):
    matcher = StopMatcher(stops)
    emitted, stopped = [], False
    for delta in split(text, cuts):
        out, stopped = matcher.feed(delta)
        emitted.append(out)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    assert (''.join(emitted), matcher.stopped) == one_shot(text, stops)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30), stops=STOPS.filter(bool))
def test_holds_back_only_a_possible_stop_prefix(text, stops):
    matcher = StopMatcher(stops)
    emitted, stopped = matcher.feed(text)
    if not stopped:
        held = text[len(emitted):]
        assert emitted + held == text
        # What is held could still become a stop string ...
        assert not held or any(s.startswith(held) for s in stops)
        # ... and it is the longest such suffix.
        longer = [text[i:] for i in range(len(text) - len(held))]
        assert not any(s.startswith(t) for t in longer for s in stops if len(t) < len(s))


def test_stop_across_token_boundaries():
    matcher = StopMatcher(['</answer>', '\n\n'])
    assert matcher.feed('The answer is 4</') == ('The answer is 4', False)
    assert matcher.feed('ans') == ('', False)
    assert matcher.feed('wer> and more') == ('', True)
    assert matcher.matched == '</answer>'
    assert matcher.feed('ignored') == ('', True)


def test_longer_stop_starting_earlier_wins():
    matcher = StopMatcher(['b', 'XbX'])
    assert matcher.feed('XXb') == ('X', False)  # 'b' matched, but 'XbX' may start earlier
    assert matcher.feed('X') == ('', True)
    assert matcher.matched == 'XbX'
    matcher = StopMatcher(['b', 'XbX'])
    assert matcher.feed('XXb') == ('X', False)
    assert matcher.feed('Y') == ('X', True)  # 'XbX' failed: stop at 'b'
    matcher = StopMatcher(['b', 'XbX'])
    matcher.feed('XXb')
    assert matcher.flush() == 'X' and matcher.stopped  # the text ended: 'b' it is


def test_false_alarm_is_released():
    matcher = StopMatcher(['STOP'])
    assert matcher.feed('go ST') == ('go ', False)
    assert matcher.feed('ART') == ('START', False)
    assert matcher.feed('S') == ('', False)
    assert matcher.flush() == 'S'


def test_no_stop_strings_passes_through():
    matcher = StopMatcher([])
    assert matcher.feed('anything') == ('anything', False)
    assert matcher.flush() == ''


@pytest.mark.parametrize('stops', [[''], ['ok', ''], [None]])
def test_empty_stop_string_rejected(stops):
    with pytest.raises(InvalidRequestError, match='non-empty'):
        StopMatcher(stops)
