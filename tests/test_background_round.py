"""A background DiLoCo round issues its collectives only where the training thread lets it (one at the
start, one per ``advance``, the rest when it lands), so every rank issues them at the same points; a round
that raises brings its error to the training thread instead of hanging it."""

import pytest
import torch

from hetero.parallel.compression.background import BackgroundRound


def test_one_collective_is_issued_per_advance_and_the_rest_where_the_round_lands():
    background, step, issued = BackgroundRound(torch.device("cpu")), [0], []

    def round_fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            with background.gate.posting():  # what GroupCollective does around each collective it issues
                issued.append(step[0])
        return x * 2

    background.start(round_fn, torch.ones(3))
    assert issued == [0]
    step[0] = 1
    background.advance()
    assert issued == [0, 1]
    step[0] = 2
    assert torch.equal(background.finish(), torch.full((3,), 2.0))
    assert issued == [0, 1, 2, 2] and not background.in_flight
    background.advance()  # nothing in flight: nothing happens
    background.close()


def test_a_round_that_raises_raises_where_it_lands():
    background = BackgroundRound(torch.device("cpu"))

    def round_fn() -> None:
        with background.gate.posting():
            pass
        raise RuntimeError("the peer went away")

    background.start(round_fn)
    background.advance()
    with pytest.raises(RuntimeError, match="the peer went away"):
        background.finish()
    background.close()
