"""Data-host positions across the jobs of a run (training/data_service/positions.py): what a checkpoint
records as trained, what a resumed host serves, and the producer that serves it (a real BatchProducer's
tasks, and a real data host's streams)."""

from __future__ import annotations

import itertools
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from training.data_service import data_service_pb2 as pb
from training.data_service.dataset import ImageDataset
from training.data_service.positions import (
    MAX_GAP_RANGES,
    Layout,
    Position,
    advance,
    from_message,
    ranges_of,
    resume_plan,
    runs,
    serve_positions,
    subtract,
    to_message,
    union,
)
from training.data_service.server import DataPositionConflict
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.samples import BatchRecipe
from training.workload.serving import WorkloadBatchProducer


def trained_set(position: Position) -> set[int]:
    untrained = {value for start, end in position.gaps for value in range(start, end)}
    return set(range(position.next)) - untrained


@given(st.lists(st.lists(st.integers(0, 300), max_size=40), max_size=6), st.booleans())
def test_a_position_holds_exactly_the_positions_trained_in_any_order_of_checkpoints(checkpoints: list[list[int]], as_ranges: bool) -> None:
    position = Position()
    for trained in checkpoints:
        # As positions, or as the ranks record them: ranges, several ranks' (here, two halves) at once.
        half = len(trained) // 2
        ranges = [ranges_of(np.array(trained[:half], dtype=np.int64)), ranges_of(np.array(trained[half:], dtype=np.int64))]
        position = advance(position, ranges if as_ranges else np.array(trained, dtype=np.int64))
        assert list(position.gaps) == sorted(position.gaps) and all(start < end <= position.next for start, end in position.gaps)
    everything = {value for trained in checkpoints for value in trained}
    assert trained_set(position) == everything
    # What a resumed host serves first is exactly what was not trained below next, then next onwards.
    served = list(itertools.islice(serve_positions(position), position.next - len(everything) + 3))
    assert served == sorted(set(range(position.next)) - everything) + [position.next, position.next + 1, position.next + 2]


def test_runs_union_and_subtract() -> None:
    assert runs(np.array([5, 3, 4, 9, 10, 3])) == [(3, 6), (9, 11)] and runs([]) == []
    assert union([np.array([[8, 12], [0, 4]]), np.array([[4, 6], [10, 20], [30, 30]])]) == [(0, 6), (8, 20)] and union([]) == []
    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22), (29, 40)]) == [(0, 2), (4, 8), (22, 29)]
    assert subtract([(0, 5)], []) == [(0, 5)] and subtract([], [(0, 5)]) == []


def test_gaps_past_the_cap_are_given_up_oldest_first_and_counted() -> None:
    every_other = np.arange(0, 4 * MAX_GAP_RANGES, 2)
    position = advance(Position(), every_other)
    assert len(position.gaps) == MAX_GAP_RANGES and position.gaps[-1] == (4 * MAX_GAP_RANGES - 3, 4 * MAX_GAP_RANGES - 2)
    assert position.dropped == MAX_GAP_RANGES - 1  # 1,999 one-position gaps: the oldest 999 given up
    assert Position.from_json(position.as_json()) == position
    assert len(to_message(Position(2**40, tuple((2**39 + 4 * i, 2**39 + 4 * i + 1) for i in range(MAX_GAP_RANGES)))).SerializeToString()) < 20 << 10
    plan = resume_plan({"layout": LAYOUT.as_json(), "positions": {"algo-1": position.as_json()}}, LAYOUT, {})
    assert plan.summary()["untrained_positions_given_up"] == {"algo-1": MAX_GAP_RANGES - 1}


def test_a_position_travels_in_the_stream_request_and_back() -> None:
    position = Position(40, ((3, 5), (17, 20)))
    request = pb.StreamRequest(client_id="algo-3/rank0", batch_size=8)
    request.resume.CopyFrom(to_message(position))
    assert from_message(pb.StreamRequest.FromString(request.SerializeToString()).resume, share=48) == position
    assert from_message(pb.DataPosition(start_epoch=2), share=48) == Position(96)
    assert Position.from_json(position.as_json()) == position


@pytest.mark.parametrize("gaps", [[3], [5, 3], [3, 5, 4, 8], [3, 50]], ids=["odd", "empty range", "overlapping", "past next"])
def test_a_resume_position_that_does_not_read_is_refused(gaps: list[int]) -> None:
    with pytest.raises(ValueError, match="gap"):
        from_message(pb.DataPosition(next=40, gaps=gaps), share=48)


LAYOUT = Layout(("algo-1",), False, 7, (96,), ("a" * 32,))


def test_a_changed_layout_starts_the_next_epoch_and_says_why() -> None:
    before = Layout(("algo-1", "algo-2"), False, 7, (96, 96), ("d1", "d1"))
    saved = {"layout": before.as_json(), "positions": {"algo-1": {"next": 30, "gaps": []}}}
    exact = resume_plan(saved, before, {"algo-1": 0})
    assert exact.exact and exact.positions == {"algo-1": Position(30)} and exact.message("algo-2") == pb.DataPosition()
    changed = resume_plan(saved, Layout(("algo-1",), False, 7, (96,)), {"algo-1": 1, "algo-2": 2})
    assert not changed.exact and changed.start_epoch == 3 and "data hosts ['algo-1', 'algo-2'] → ['algo-1']" in changed.why
    assert changed.message("algo-1") == pb.DataPosition(start_epoch=3)
    assert resume_plan(saved, Layout(before.hosts, False, 8, (96, 96), ("d1", "d1")), {}).why.count("seed 7 → 8") == 1
    assert "the listing" in resume_plan(saved, Layout(before.hosts, False, 7, (96, 96), ("d2", "d2")), {}).why  # same count, other files


# The producer ---------------------------------------------------------------------------------------


def producer(samples: int = 20, hosts: int = 2, host: int = 0, batch: int = 4) -> WorkloadBatchProducer:
    listing = ImageDataset(Path("."), ("a",), tuple((f"{index}.jpg", 0) for index in range(samples)))
    recipe = BatchRecipe(BUILTIN_WORKLOADS_DIR, "vision", None, listing.samples, {}, 3, ())  # for workers that never start
    made = WorkloadBatchProducer(listing, recipe, batch_size=batch, workers=1, seed=3, host_index=host, hosts=hosts)
    made._pool.shutdown()  # never started: only its tasks are read
    return made


def test_a_resumed_host_serves_its_gaps_then_goes_on_with_the_first_jobs_order() -> None:
    first = producer()
    fresh = list(itertools.islice(first._tasks(Position()), 6))  # share 10: epochs 0, 1 and part of 2
    # The first job trained batches 0, 1 and 3 (batch 2 was in flight when it stopped).
    position = advance(Position(), [p for number in (0, 1, 3) for p in fresh[number][4]])
    assert position == Position(16, ((8, 12),))
    resumed = list(itertools.islice(producer()._tasks(position), 3))
    assert resumed[0][4] == [8, 9, 10, 11] and resumed[0][0] == fresh[2][0] and resumed[0][3] == fresh[2][3]  # the gap: the same samples, epochs
    assert resumed[1][0] == fresh[4][0] and resumed[2][0] == fresh[5][0]  # then the first job's order from next on
    assert resumed[0][1] == fresh[2][1]  # even the spares: drawn from the batch's first position


def test_the_first_unbounded_stream_fixes_where_a_host_starts() -> None:
    made = producer()
    request = pb.StreamRequest(batch_size=4)
    request.resume.CopyFrom(to_message(Position(8)))
    bounded_read_took_batches = True
    made.begin(pb.StreamRequest(batch_size=4), served=False)  # a fresh job's first stream: nothing to redo
    made.begin(pb.StreamRequest(batch_size=4))  # another of its ranks
    with pytest.raises(DataPositionConflict, match="as its first stream asked"):
        made.begin(request)
    again = producer()
    again.begin(request, served=bounded_read_took_batches)
    again.begin(request)
    assert again._start == Position(8)
    with pytest.raises(DataPositionConflict, match="does not read"):
        producer().begin(pb.StreamRequest(batch_size=4, resume=pb.DataPosition(next=4, gaps=[1])))


def test_a_real_host_refuses_a_stream_that_asks_for_another_start(images: Path) -> None:
    from tests.conftest import TOKEN
    from tests.training.test_data_service import data_host
    from training.data_service.auth import call_metadata
    from training.data_service.client import DataServiceDataset
    from training.data_service.server import STREAM_BATCHES

    with data_host(images) as host:
        dataset = DataServiceDataset([host.target], 8, TOKEN, "test")
        first = next(iter(dataset))
        request = pb.StreamRequest(batch_size=8, resume=pb.DataPosition(next=16))
        with grpc.insecure_channel(host.target) as channel:
            call = channel.unary_stream(STREAM_BATCHES, request_serializer=pb.StreamRequest.SerializeToString, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(call(request, metadata=call_metadata(TOKEN))))
    assert tuple(first["image"].shape) == (8, 3, 32, 32)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "as its first stream asked" in refused.value.details()
