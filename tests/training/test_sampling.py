"""Which examples each rank reads (training/trainers/sampling.py) and the learning-rate schedules
(training/trainers/schedule.py): pure functions."""

from __future__ import annotations

import itertools

import pytest

from training.trainers.sampling import EndlessSampler, ShardTooSmallError, epoch_order, eval_batches, rank_share
from training.trainers.schedule import Schedule


def take(sampler: EndlessSampler, count: int, skip: int = 0) -> list[int]:
    return list(itertools.islice(iter(sampler), skip, skip + count))


def test_every_epoch_the_ranks_read_disjoint_shares_of_one_order() -> None:
    ranks = [EndlessSampler(10, rank=rank, world_size=3, seed=7) for rank in range(3)]
    for epoch in range(4):
        shares = [take(sampler, 3, skip=3 * epoch) for sampler in ranks]
        flat = [index for share in shares for index in share]
        assert len(set(flat)) == 9  # each example at most once per epoch; one left out (10 = 3 × 3 + 1)
        assert flat and set(flat) <= set(range(10))
    assert epoch_order(10, 7, 0) != epoch_order(10, 7, 1)  # reshuffled every epoch
    assert epoch_order(10, 7, 1) == epoch_order(10, 7, 1)  # the same on every rank and every run


def test_a_sampler_started_mid_run_continues_the_uninterrupted_one() -> None:
    straight = EndlessSampler(12, rank=1, world_size=2, seed=0)
    for start in (0, 5, 6, 13):
        assert take(EndlessSampler(12, rank=1, world_size=2, seed=0, start=start), 8) == take(straight, 8, skip=start)
    assert EndlessSampler(12, rank=0, world_size=2, seed=0).position(13) == (2, 1)


def test_too_few_examples_for_the_ranks_is_refused() -> None:
    with pytest.raises(ShardTooSmallError, match="3 examples cannot give each of 4"):
        EndlessSampler(3, rank=0, world_size=4, seed=0)
    assert rank_share([5, 6, 7, 8, 9], 1, 2) == [6, 8]


def test_evaluation_batches_hold_every_example_once_and_pad_the_last() -> None:
    batches = [eval_batches(7, rank=rank, world_size=2, batch_size=3) for rank in range(2)]
    counted = [index for rank in batches for batch in rank for index in batch.indices[: batch.valid]]
    assert sorted(counted) == list(range(7))
    assert all(len(batch.indices) == 3 for rank in batches for batch in rank)
    assert [batch.valid for batch in batches[0]] == [3, 1] and [batch.valid for batch in batches[1]] == [3]


def test_vision_rate_scales_with_workers_after_a_warm_up() -> None:
    schedule = Schedule(0.1, total_steps=100, warmup_fraction=0.1, workers=4, scale_with_workers=True)
    assert schedule.peak == pytest.approx(0.4)
    assert [schedule.at(step) for step in (1, 5, 10, 11, 100)] == pytest.approx([0.04, 0.2, 0.4, 0.4, 0.4])
    assert Schedule(0.1, total_steps=100, workers=4).at(1) == pytest.approx(0.1)  # unscaled, no warm-up


def test_text_rate_warms_up_then_decays_to_its_last_step() -> None:
    schedule = Schedule(1.0, total_steps=10, warmup_fraction=0.2, decay=True)
    rates = [schedule.at(step) for step in range(1, 11)]
    assert rates == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    assert schedule.factor(3) == pytest.approx(1.0)
