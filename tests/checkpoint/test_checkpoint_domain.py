"""Pure checkpoint domain: the state machine and request validation, as tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainyard_checkpoint.domain import (
    TRANSITIONS,
    BeginRequest,
    Checkpoint,
    CheckpointState,
    Shard,
    abort,
    can_transition,
    commit,
    delete,
    fallback_latest,
    mark_damaged,
    moves_latest,
    new_checkpoint,
    storage_problems,
)
from trainyard_checkpoint.domain.checkpoint import MAX_ABORT_REASON_CHARS
from trainyard_checkpoint.domain.validation import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    MAX_SHARDS,
    page_size,
    shard_path_problem,
    validate_begin,
    validate_checkpoint_id,
    validate_page_token,
    validate_shards,
)
from trainyard_core.errors import FailedPrecondition, InvalidArgument

NOW = 1_700_000_000.0
W, C, A, D, X = (CheckpointState.WRITING, CheckpointState.COMMITTED, CheckpointState.ABORTED,
                 CheckpointState.DELETED, CheckpointState.DAMAGED)


def make_ckpt(state: CheckpointState = W, *, step: int = 10, shards: tuple[Shard, ...] = (),
              aborted_at: float | None = None, ckpt_id: str = "ckpt-0000000001abcdefgh") -> Checkpoint:
    base = new_checkpoint(checkpoint_id=ckpt_id, job_id="job-a", attempt=0, step=step, world_size=2,
                          location="file:///ckpt/job-a/" + ckpt_id, metadata={}, now=NOW)
    return replace(base, state=state, shards=shards, aborted_at=aborted_at)


def shard(path: str = "__0_0.distcp", size: int = 10, rank: int = 0, checksum: str = "crc32c:0badf00d") -> Shard:
    return Shard(rank=rank, path=path, size_bytes=size, checksum=checksum)


SHARDS = (shard("__0_0.distcp", 10, 0), shard("__1_0.distcp", 12, 1), shard(".metadata", 3, 0))


def test_transition_table_is_the_documented_machine() -> None:
    assert {s: set(t) for s, t in TRANSITIONS.items()} == {W: {C, A}, C: {D, X}, A: {D}, X: {D}, D: set()}
    assert can_transition(W, C) and not can_transition(C, W) and not can_transition(D, C)
    assert can_transition(C, X) and not can_transition(X, C) and not can_transition(W, X)


@pytest.mark.parametrize(("state", "outcome"), [(W, "refused"), (C, "ok"), (A, "refused"), (D, "refused"),
                                                (X, "same")])
def test_mark_damaged(state: CheckpointState, outcome: str) -> None:
    ckpt = replace(make_ckpt(state), damaged_at=NOW - 5 if state is X else None,
                   damage="first finding" if state is X else "")
    if outcome == "refused":
        with pytest.raises(FailedPrecondition, match="cannot be marked damaged"):
            mark_damaged(ckpt, "x", NOW)
        return
    marked = mark_damaged(ckpt, "shard 'a' is missing" + "!" * 5000, NOW)
    if outcome == "same":
        assert marked is ckpt and marked.damage == "first finding"
    else:
        assert marked.state is X and marked.damaged_at == NOW
        assert marked.damage.startswith("shard 'a' is missing") and len(marked.damage) == MAX_ABORT_REASON_CHARS
    # A damaged checkpoint is never committed again, and can be deleted once it is not latest.
    with pytest.raises(FailedPrecondition):
        commit(replace(ckpt, state=X), [], NOW)
    assert delete(replace(ckpt, state=X), latest_id=None, now=NOW).state is D


def test_fallback_latest_is_the_highest_committed_step_left() -> None:
    def at(step: int, state: CheckpointState, n: int) -> Checkpoint:
        return make_ckpt(state, step=step, ckpt_id=f"ckpt-{n:010d}abcdefgh")

    bad = at(50, C, 9)
    others = [at(40, C, 1), at(45, W, 2), at(48, A, 3), at(47, X, 4), at(30, C, 5), at(40, C, 6), at(49, D, 7)]
    # Step 40 twice: the newer id wins.
    assert fallback_latest([bad, *others], excluded=bad.id) == others[5]
    assert fallback_latest([bad], excluded=bad.id) is None


# (state, aborted_at set, outcome): "ok" changes, "same" returns unchanged, "refused" raises.
COMMIT_CASES = [
    (W, False, "ok"),
    (C, False, "same"),
    (A, True, "refused"),
    (D, False, "refused"),
]


@pytest.mark.parametrize(("state", "was_aborted", "outcome"), COMMIT_CASES)
def test_commit(state: CheckpointState, was_aborted: bool, outcome: str) -> None:
    ckpt = make_ckpt(state, shards=tuple(sorted(SHARDS)) if state is C else (),
                     aborted_at=NOW if was_aborted else None)
    if outcome == "refused":
        with pytest.raises(FailedPrecondition, match=state.value):
            commit(ckpt, list(SHARDS), NOW + 5)
        return
    result = commit(ckpt, list(reversed(SHARDS)), NOW + 5)
    if outcome == "same":
        assert result is ckpt
    else:
        assert result.state is C and result.committed_at == NOW + 5
        assert result.shards == tuple(sorted(SHARDS)), "shards are stored in canonical (rank, path) order"
        assert result.total_bytes == 25


def test_commit_of_committed_with_other_shards_is_refused() -> None:
    ckpt = make_ckpt(C, shards=tuple(sorted(SHARDS)))
    with pytest.raises(FailedPrecondition, match="different shard list"):
        commit(ckpt, [*SHARDS[:2]], NOW)


ABORT_CASES = [
    (W, None, "ok"),
    (A, NOW, "same"),
    (D, NOW, "same"),  # deleted after it was aborted: a retried abort still succeeds
    (D, None, "refused"),  # deleted after commit
    (C, None, "refused"),
]


@pytest.mark.parametrize(("state", "aborted_at", "outcome"), ABORT_CASES)
def test_abort(state: CheckpointState, aborted_at: float | None, outcome: str) -> None:
    ckpt = make_ckpt(state, aborted_at=aborted_at)
    if outcome == "refused":
        with pytest.raises(FailedPrecondition, match=state.value):
            abort(ckpt, "why", NOW + 1)
        return
    result = abort(ckpt, "why", NOW + 1)
    if outcome == "same":
        assert result is ckpt
    else:
        assert result.state is A and result.aborted_at == NOW + 1 and result.abort_reason == "why"


def test_abort_reason_is_cut_not_refused() -> None:
    result = abort(make_ckpt(), "x" * 10_000, NOW)
    assert len(result.abort_reason) == MAX_ABORT_REASON_CHARS


# (state, is latest, outcome)
DELETE_CASES = [
    (C, False, "ok"),
    (A, False, "ok"),
    (C, True, "refused"),
    (W, False, "refused"),
    (D, False, "same"),
]


@pytest.mark.parametrize(("state", "is_latest", "outcome"), DELETE_CASES)
def test_delete(state: CheckpointState, is_latest: bool, outcome: str) -> None:
    ckpt = make_ckpt(state)
    latest_id = ckpt.id if is_latest else "ckpt-0000000002abcdefgh"
    if outcome == "refused":
        with pytest.raises(FailedPrecondition, match="latest" if is_latest else "abort it first"):
            delete(ckpt, latest_id=latest_id, now=NOW)
        return
    result = delete(ckpt, latest_id=latest_id, now=NOW)
    if outcome == "same":
        assert result is ckpt
    else:
        assert result.state is D and result.deleted_at == NOW


@pytest.mark.parametrize(("latest_step", "step", "moves"), [
    (None, 0, True), (None, 5, True), (10, 11, True), (10, 10, False), (10, 9, False), (0, 0, False),
])
def test_latest_moves_only_forward(latest_step: int | None, step: int, moves: bool) -> None:
    assert moves_latest(latest_step, step) is moves


def test_storage_problems_name_each_bad_shard() -> None:
    declared = [shard("a", 10), shard("b", 10, rank=1), shard("c", 10), shard("d", 0)]
    problems = storage_problems(declared, {"a": 10, "b": 4, "c": 11, "d": 0})
    assert problems == [
        "shard 'b' (rank 1) is truncated: 4 bytes in storage, 10 declared",
        "shard 'c' (rank 0) has 11 bytes in storage, 10 declared",
    ]
    assert storage_problems([shard("x")], {}) == ["shard 'x' (rank 0) is missing"]
    assert storage_problems([shard("x", 0)], {"x": 0}) == []


@pytest.mark.parametrize(("path", "problem"), [
    ("__0_0.distcp", None),
    (".metadata", None),
    ("model/layer.0/weights.distcp", None),
    ("..data", None),  # dots inside a name are fine; only '..' as a component escapes
    ("", "is empty"),
    ("/abs", "is absolute"),
    ("../x", "contains '..'"),
    ("a/../b", "contains '..'"),
    ("a/..", "contains '..'"),
    ("a//b", "canonical form"),
    ("a/", "canonical form"),
    ("./a", "canonical form"),
    ("a\\..\\b", "backslash"),
    ("a\x00b", "control character"),
    ("a\nb", "control character"),
    ("x" * 1025, "longer than"),
])
def test_shard_paths(path: str, problem: str | None) -> None:
    found = shard_path_problem(path)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@pytest.mark.parametrize(("checksum", "ok"), [
    ("crc32c:0badf00d", True),
    ("xxh3:0123456789abcdef", True),
    ("crc32c:0BADF00D", False),
    ("crc32c:0badf00", False),
    ("crc32c:0badf00dd", False),
    ("xxh3:0123456789abcde", False),
    ("sha256:0badf00d", False),
    ("0badf00d", False),
    ("", False),
])
def test_checksum_format(checksum: str, ok: bool) -> None:
    shards = [shard(checksum=checksum)]
    if ok:
        validate_shards(shards, world_size=1)
    else:
        with pytest.raises(InvalidArgument, match="checksum"):
            validate_shards(shards, world_size=1)


@pytest.mark.parametrize(("shards", "world_size", "message"), [
    ([], 1, "shards is empty"),
    ([shard(size=-1)], 1, "size_bytes"),
    ([shard(rank=1)], 1, r"must be in \[0, 1\)"),
    ([shard(rank=-1)], 4, r"must be in \[0, 4\)"),
    ([shard("a"), shard("a", rank=1)], 2, "declared twice"),
    ([shard(f"s{i}") for i in range(MAX_SHARDS + 1)], 1, "at most"),
])
def test_bad_shard_lists(shards: list[Shard], world_size: int, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_shards(shards, world_size)


def begin(**overrides: object) -> BeginRequest:
    fields: dict[str, object] = dict(job_id="job-a", attempt=0, step=0, world_size=1, metadata={})
    fields.update(overrides)
    return BeginRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("request_", "message"), [
    (begin(), None),
    (begin(step=10**15, world_size=4096, attempt=3, metadata={"code_version": "abc"}), None),
    (begin(job_id=""), "job_id is required"),
    (begin(job_id="ab"), "not a valid job id"),
    (begin(job_id="1job"), "not a valid job id"),
    (begin(job_id="job/x"), "not a valid job id"),
    (begin(step=-1), "step must be >= 0"),
    (begin(world_size=0), "world_size must be >= 1"),
    (begin(attempt=-2), "attempt must be >= 0"),
    (begin(metadata={f"k{i}": "v" for i in range(65)}), "at most 64"),
    (begin(metadata={"k": "v" * 20_000}), "bytes"),
    (begin(metadata={"k" * 200: "v"}), "metadata key"),
])
def test_begin_validation(request_: BeginRequest, message: str | None) -> None:
    if message is None:
        validate_begin(request_)
    else:
        with pytest.raises(InvalidArgument, match=message):
            validate_begin(request_)


@pytest.mark.parametrize(("value", "ok"), [
    ("ckpt-01hx0000000abcdefgh", True),
    ("ckpt-abc", True),
    ("", False),
    ("job-0123456789", False),
    ("ckpt_0123", False),
    ("ckpt-ABC", False),
    ("ckpt-a/b", False),
])
def test_checkpoint_id_format(value: str, ok: bool) -> None:
    if ok:
        validate_checkpoint_id(value)
    else:
        with pytest.raises(InvalidArgument, match="checkpoint_id"):
            validate_checkpoint_id(value)


def test_page_size_and_token() -> None:
    assert page_size(0) == DEFAULT_PAGE_SIZE
    assert page_size(7) == 7
    assert page_size(10**6) == MAX_PAGE_SIZE
    with pytest.raises(InvalidArgument, match="page_size"):
        page_size(-1)
    validate_page_token("")
    validate_page_token("ckpt-0000000001abcdefgh")
    with pytest.raises(InvalidArgument, match="page_token"):
        validate_page_token("../../etc")
