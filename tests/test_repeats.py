"""cachepipe.repeats: which sample takes a skipped item's step (pure bookkeeping, no I/O)."""

import pytest

from cachepipe.errors import NothingToRepeatError
from cachepipe.repeats import Repeats


def run(steps: list[str | None], weight: int = 1) -> list[str]:
    """The samples yielded for ``steps`` (None: a skipped step), as the adapter yields them."""
    repeats, out = Repeats("rank 0 worker 0", weight), []
    for i, step in enumerate(steps):
        if step is None:
            out += [repeats.previous] * repeats.skipped(f"bad{i}", "ChecksumError: x")
        else:
            out += [step] * repeats.sample(step, step)
    repeats.end()
    return out


def test_each_skipped_step_is_taken_by_the_sample_before_it_or_at_the_start_by_the_next():
    assert run(["a", None, "b", None, None]) == ["a", "a", "b", "b", "b"]
    assert run([None, None, "a", "b"]) == ["a", "a", "a", "b"]
    assert run(["a", "b"]) == ["a", "b"]


def test_a_resumed_first_step_is_yielded_as_often_as_was_due_and_a_skip_there_passes_it_on():
    assert run(["a", "b"], weight=2) == ["a", "a", "b"]
    assert run([None, "b", None], weight=2) == ["b", "b", "b", "b"]


def test_nothing_to_repeat_raises_naming_the_items():
    with pytest.raises(NothingToRepeatError, match=r"rank 0 worker 0: every step .*'bad0', 'bad1'.*ChecksumError"):
        run([None, None])
    with pytest.raises(ValueError, match="repeat 0 in the state"):
        Repeats("w", 0)
