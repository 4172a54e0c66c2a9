"""The router's side of a group failure, in one process: stand-in leaders are plain sockets, so
every message the router sends them is checked (moves, aborts, peer notices, heartbeats)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdserve.cluster.protocol import (
    Abort,
    Chunk,
    Error,
    Final,
    Generate,
    Heartbeat,
    PeerFailed,
    PeerRestarted,
    Ready,
    Sampling,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
    WorkerError,
    WorkerStats,
    WorkRequest,
    encode,
)
from pdserve.engine.timings import RequestTimings
from pdserve.tests.router.helpers import RouterRig, router_rig

PROMPT = [5, 6, 7]


class Rig(RouterRig):
    def ready(self, role: str, group: int) -> None:
        self.worker(Ready(role, group, 100))


def _rig(tmp_path_factory: pytest.TempPathFactory, **settings: object) -> Iterator[Rig]:
    with router_rig(tmp_path_factory.mktemp("run"), {"decode_groups": 2, "decode_tp": 2, **settings}, Rig) as rig:
        yield rig


@pytest.fixture
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory, migration_limit=2)


def _start(rig: Rig, max_tokens: int = 10) -> WorkRequest:
    rig.client.send(
        encode(Generate(request_id="c1", token_ids=PROMPT, sampling=Sampling(max_tokens=max_tokens, temperature=0.0)))
    )
    (work,) = rig.received("prefill", 0)
    assert isinstance(work, WorkRequest)
    return work


def test_a_request_moves_off_a_dead_decode_group_and_streams_on_without_gap_or_repeat(rig: Rig) -> None:
    work = _start(rig)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))  # first token, from prefill
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12, 13])]))  # two from decode
    dead = work.decode_group
    rig.router.group_failed("decode", dead, "killed")
    moved = [m for m in rig.received("prefill", 0)]
    # The prefill group forgets the dead group and the old attempt, then gets the request again
    # with its tokens so far, under a new id, for the other decode group.
    assert moved[:2] == [PeerFailed("decode", dead), Abort(work.request_id)]
    again = moved[2]
    assert isinstance(again, WorkRequest) and again.request_id != work.request_id
    assert again.token_ids == PROMPT + [11, 12, 13]
    # Its tokens so far are output, not prompt, for its limits and penalties (max_tokens stays).
    assert (again.generated, again.sampling.max_tokens) == (3, 10)
    assert again.decode_group == 1 - dead
    assert rig.received("decode", 1 - dead) == []  # the live decode group was not serving it: nothing to abort
    # Late outputs of the old attempt are ignored; the new attempt's index 0 is the 4th token.
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 3, [99])]))
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 0, [14])]))
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 1, [15, 16, 17, 18, 19, 20], True, "length")]))
    replies = rig.replies()
    streamed = [t for m in replies if isinstance(m, Chunk) for t in m.token_ids]
    finals = [m for m in replies if isinstance(m, Final)]
    assert streamed == list(range(11, 21))
    assert len(finals) == 1 and finals[0].token_ids == list(range(11, 21)) and len(replies) == 5
    assert rig.router.faults["migrated"] == 1 and not rig.router.requests


def test_a_request_waits_while_its_role_has_no_ready_group_and_goes_when_one_is_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for rig in _rig(tmp_path_factory):
        work = _start(rig)
        rig.router.group_failed("prefill", 0, "killed")  # before the first token: it is retried
        assert rig.received("decode", work.decode_group) == [PeerFailed("prefill", 0), Abort(work.request_id)]
        rig.client.send(encode(Generate(request_id="c2", token_ids=PROMPT, sampling=Sampling(max_tokens=4))))
        rig.pump()
        assert len(rig.router.parked) == 2 and not rig.replies()
        rig.ready("prefill", 0)  # a dead generation's late ``ready`` is ignored
        assert len(rig.router.parked) == 2 and not rig.router.is_ready(("prefill", 0))
        rig.router.group_restarting("prefill", 0, 1)
        assert rig.received("decode", 0) == [PeerRestarted("prefill", 0, 1)]
        rig.ready("prefill", 0)
        works = rig.received("prefill", 0)
        assert [w.token_ids for w in works if isinstance(w, WorkRequest)] == [PROMPT, PROMPT]


def test_past_the_migration_limit_a_request_ends_with_worker_failed(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """It ends with worker_failed, and a log line names it by its client's id, with why."""
    for rig in _rig(tmp_path_factory, migration_limit=1):
        work = _start(rig)
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
        rig.worker(WorkerError(work.request_id, "kv_lease_expired", "no decode group took it"))  # moves once
        abort, again = rig.received("prefill", 0)
        assert abort == Abort(work.request_id)
        assert isinstance(again, WorkRequest) and again.token_ids == PROMPT + [11]
        rig.router.group_failed("decode", again.decode_group, "killed")
        replies = rig.replies()
        assert [type(m) for m in replies] == [Chunk, Error]
        assert replies[1].code == "worker_failed" and "migration limit 1" in replies[1].message
        assert rig.router.faults["worker_failed"] == 1 and not rig.router.requests
        (line,) = [r.getMessage() for r in caplog.records if "ends with worker_failed" in r.getMessage()]
        assert line.startswith(f"request {replies[1].request_id} ends with worker_failed: decode group"), line


def test_a_request_whose_kv_its_prefill_groups_death_cut_off_moves_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The decode group reports the receive its prefill group's death cut off before the launcher
    sees that death (its next supervision pass, between two polls of the router): the request
    must not go to the dead group meanwhile, which would cost it a second move."""
    for rig in _rig(tmp_path_factory, migration_limit=1):
        work = _start(rig)
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
        rig.to_router.send(encode(WorkerError(work.request_id, "kv_transfer_failed", "KV transfer cut off")))
        rig.router.poll(1000)  # as the launcher's loop: one poll, then its supervision pass
        rig.router.group_failed("prefill", 0, "rank 0 was killed by SIGKILL")
        assert [type(m) for m in rig.replies()] == [Chunk]  # the first token, and no error
        rig.router.group_restarting("prefill", 0, 1)
        rig.ready("prefill", 0)
        moved = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
        assert [m.token_ids for m in moved] == [PROMPT + [11]]
        assert rig.router.faults["migrated"] == 1 and rig.router.requests


def test_a_stall_of_the_router_itself_fails_no_group(rig: Rig) -> None:
    """Stopped (SIGSTOP, a paused VM) or starved of CPU, the router read no heartbeat, and on
    waking it failed every healthy group before reading the beats waiting in its sockets; a
    group joined from another node was removed for good. A rank that stays silent is still
    reported, a full timeout after the stall."""

    def beat(silent: tuple[str, int, int] | None = None) -> None:
        for role, group, tp in (("prefill", 0, 1), ("decode", 0, 2), ("decode", 1, 2)):
            for rank in range(tp):
                if (role, group, rank) != silent:
                    rig.to_router.send(encode(Heartbeat(role, group, rank)))

    beat()
    rig.pump(0.05)
    assert rig.router.check_heartbeats(0.3) == []
    for _ in range(6):  # the ranks beat on while the router reads nothing
        beat()
        time.sleep(0.1)
    assert rig.router.check_heartbeats(0.3) == []
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        beat(silent=("decode", 1, 1))
        rig.pump(0.05)
    (silent,) = rig.router.check_heartbeats(0.3)
    assert silent[:2] == ("decode", 1) and "rank 1" in silent[2]


def test_a_long_queue_is_read_in_slices_and_reading_is_no_stall(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages that keep coming (here slow to handle, as the longest text prompts are to
    tokenize) no longer hold one ``poll`` until the queue is empty: it returns once past its read
    budget, so the launcher's loop goes round (it fails dead groups and moves their requests).
    The time spent reading is no stall of the router: a rank silent throughout is still
    reported, where the heartbeat check used to take the busy poll for the router stopped and
    start every deadline again."""
    handled = []

    def slow(client: bytes, data: bytes) -> None:
        handled.append(data)
        time.sleep(0.4)

    monkeypatch.setattr(rig.router, "_on_client", slow)
    deadline = time.monotonic() + 0.9
    while time.monotonic() < deadline:  # decode1's rank 1 silent past the timeout below
        for role, group, tp in (("prefill", 0, 1), ("decode", 0, 2), ("decode", 1, 2)):
            for rank in range(tp):
                if (role, group, rank) != ("decode", 1, 1):
                    rig.to_router.send(encode(Heartbeat(role, group, rank)))
        rig.pump(0.05)
    for i in range(10):
        rig.client.send(b"%d" % i)
    time.sleep(0.02)  # queued
    started = time.monotonic()
    rig.router.poll(0)
    assert time.monotonic() - started < 1.2 and len(handled) == 1
    (silent,) = rig.router.check_heartbeats(0.7)  # the poll read for 0.4 s: past half of it
    assert silent[:2] == ("decode", 1) and "rank 1" in silent[2]


def test_a_silent_rank_of_a_ready_group_is_reported_within_the_timeout(rig: Rig) -> None:
    assert rig.router.check_heartbeats(0.3) == []
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # every rank beats but decode1's rank 1
        for role, group, tp in (("prefill", 0, 1), ("decode", 0, 2), ("decode", 1, 2)):
            rig.to_router.send(encode(WorkerStats(role, group, 100, 100, 0, 0, 0, 0)))  # not a heartbeat
            for rank in range(tp):
                if (role, group, rank) != ("decode", 1, 1):
                    rig.to_router.send(encode(Heartbeat(role, group, rank)))
        rig.pump(0.05)
    (silent,) = rig.router.check_heartbeats(0.3)
    assert silent[:2] == ("decode", 1) and "rank 1" in silent[2]
    rig.router.group_failed("decode", 1, silent[2])
    assert rig.router.check_heartbeats(0.3) == []  # a failed group is no longer watched
    rig.client.send(encode(StatsRequest()))
    (stats,) = rig.replies()
    assert "decode1" not in stats.groups and not stats.ready and stats.faults["group_failures"] == 1


def test_an_abort_that_crosses_its_requests_final_is_answered_without_a_warning(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Every client has this race (the HTTP front end's stop strings end a request from its last
    chunk): the abort gets its one reply, and the log keeps its warnings for clients at fault."""
    work = _start(rig, max_tokens=2)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12], True, "length")]))
    with caplog.at_level("WARNING"):
        rig.client.send(encode(Abort("c1")))
        replies = rig.replies()
    assert [type(m) for m in replies] == [Chunk, Chunk, Final, Error]
    assert replies[-1].code == "unknown_request" and replies[-1].request_id == "c1"
    assert not caplog.records


def test_a_request_moved_before_its_first_token_leaves_no_claim_on_its_old_group(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Cache-aware dispatch counts a prompt as cached in its entry group from dispatch to first
    token. A request that moves before its first token (here its decode group dies) must take
    that claim with it: once it has ended, no group is credited with a prefix it never cached."""
    prompt = list(range(100, 164))  # four blocks of 16
    for rig in _rig(tmp_path_factory, prefill_groups=2):
        index = rig.router.prefix_index
        assert index is not None
        hashes = index.hashes(prompt)
        rig.client.send(encode(Generate(request_id="c1", token_ids=prompt, sampling=Sampling(max_tokens=3))))
        (entry, work), *_ = [(g, m) for g in (0, 1) for m in rig.received("prefill", g) if isinstance(m, WorkRequest)]
        assert index.matched_tokens(hashes)[entry] == 64  # being computed there
        rig.router.group_failed("decode", work.decode_group, "killed")
        (again,) = [m for g in (0, 1) for m in rig.received("prefill", g) if isinstance(m, WorkRequest)]
        rig.worker(TokenOutputs([TokenOutput(again.request_id, 0, [11])]))
        rig.worker(TokenOutputs([TokenOutput(again.request_id, 1, [12, 13], True, "length")]))
        assert isinstance(rig.replies()[-1], Final) and not rig.router.requests
        assert index.matched_tokens(hashes) == {0: 0, 1: 0}


def test_an_aborted_requests_final_counts_its_decoding_so_far(rig: Rig) -> None:
    """The router writes an abort's final: its timings carry the decode time since the first
    token (for the decode-time metric), besides the entry group's own."""
    work = _start(rig)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
    time.sleep(0.05)
    rig.client.send(encode(Abort("c1")))
    final = rig.replies()[-1]
    assert isinstance(final, Final) and final.finish_reason == "abort"
    assert 0.05 <= final.timings["decode"] <= final.timings["total"]


def test_a_moved_requests_phases_are_its_first_prefill_then_decoding_to_its_end(rig: Rig) -> None:
    """A request moved mid-decode: its final's queue and prefill are its first attempt's, as its
    first token is, and its decoding runs from that token to its end, the new attempt's prefill
    included. The last attempt's own figures made the phases add up to seconds less than the
    total, and its queue the first attempt's first token less the new prefill (review)."""
    work = _start(rig, max_tokens=30)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11], timings=RequestTimings(queue=0.0, prefill=0.01))]))
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, list(range(12, 29)))]))
    time.sleep(0.1)
    rig.router.group_failed("decode", work.decode_group, "killed")
    (again,) = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 0, [30], timings=RequestTimings(queue=0.0, prefill=0.5))]))
    done = RequestTimings(queue=0.0, prefill=0.5, transfer=0.002, decode=0.01)
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 1, [31] * 11, True, "length", timings=done)]))
    final = rig.replies()[-1]
    assert isinstance(final, Final) and final.finish_reason == "length"
    t = final.timings
    assert t["prefill"] == 0.01 and t["queue"] == pytest.approx(t["first_token"] - 0.01)
    assert t["decode"] >= 0.1 and t["decode"] == pytest.approx(t["total"] - t["first_token"], abs=0.02)


def test_a_prefill_group_holds_a_request_in_the_stats_only_until_its_first_token(rig: Rig) -> None:
    """A group's ``requests`` in the stats (``--status``'s IN FLIGHT) are those it holds now: a
    prefill group let go of a request once its KV moved, though it was counted there to its end."""
    work = _start(rig)

    def in_flight() -> dict[str, int]:
        return {f"{m.role}{m.group}": m.requests for m in rig.router.members()}

    assert in_flight()["prefill0"] == 1
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12, 13])]))
    assert in_flight() == {"prefill0": 0, f"decode{work.decode_group}": 1, f"decode{1 - work.decode_group}": 0}


def test_an_aborted_requests_final_counts_its_kv_transfer(rig: Rig) -> None:
    """A request ended by an abort after its KV moved (a stop string the HTTP front end matched,
    a client gone): the router's final carries the transfer the decode group reported with its
    first tokens, beside the entry group's timings, for the KV-transfer metrics."""
    work = _start(rig)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11], timings=RequestTimings(prefill=0.01))]))
    moved = RequestTimings(transfer=0.002, transfer_bytes=4096.0)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, [12, 13], timings=moved)]))
    rig.client.send(encode(Abort("c1")))
    final = rig.replies()[-1]
    assert isinstance(final, Final) and final.finish_reason == "abort"
    assert final.timings["transfer_bytes"] == 4096.0 and final.timings["transfer"] == 0.002
    assert final.timings["prefill"] == 0.01


def test_a_request_moved_after_its_first_token_settles_at_its_new_first_token(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A request moved after its first token (its decode group died mid-decode) is prefilled
    again, and counted as computing its prompt there from dispatch. Its new attempt's first
    token ends that claim, as a request's first token does; else it lasts until the request ends."""
    prompt = list(range(100, 164))  # four blocks of 16
    for rig in _rig(tmp_path_factory, prefill_groups=2):
        index = rig.router.prefix_index
        assert index is not None
        rig.client.send(encode(Generate(request_id="c1", token_ids=prompt, sampling=Sampling(max_tokens=40))))
        (entry, work), *_ = [(g, m) for g in (0, 1) for m in rig.received("prefill", g) if isinstance(m, WorkRequest)]
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
        rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, list(range(12, 28)))]))  # 17 tokens out
        rig.router.group_failed("decode", work.decode_group, "killed")
        (again,) = [m for g in (0, 1) for m in rig.received("prefill", g) if isinstance(m, WorkRequest)]
        hashes = index.hashes(again.token_ids)
        assert max(index.matched_tokens(hashes).values()) == 80  # five blocks being computed
        rig.worker(TokenOutputs([TokenOutput(again.request_id, 0, [30])]))  # its new first token
        assert rig.router.requests  # still decoding
        assert index.matched_tokens(hashes) == {0: 0, 1: 0}, "the moved request still claims its prompt"


def test_a_moved_requests_cached_tokens_never_exceed_its_prompt_tokens(rig: Rig) -> None:
    """A request moved mid-decode is prefilled again over its prompt and the tokens it had, and a
    group's cache may hold more of those than the prompt (an identical request's answer, cached
    there): its usage counts only the prompt's tokens as cached, as OpenAI's does."""
    work = _start(rig, max_tokens=30)
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 0, [11])]))
    rig.worker(TokenOutputs([TokenOutput(work.request_id, 1, list(range(12, 29)))]))  # 18 tokens out
    rig.router.group_failed("decode", work.decode_group, "killed")
    (again,) = [m for m in rig.received("prefill", 0) if isinstance(m, WorkRequest)]
    assert len(again.token_ids) == len(PROMPT) + 18
    hit = RequestTimings(prefill=0.01, cached_tokens=16.0)  # 16 of its 21 tokens, in full blocks
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 0, [30], timings=hit)]))
    done = RequestTimings(prefill=0.01, cached_tokens=16.0, decode=0.01, decode_cached_tokens=16.0)
    rig.worker(TokenOutputs([TokenOutput(again.request_id, 1, [31] * 11, True, "length", timings=done)]))
    final = rig.replies()[-1]
    assert isinstance(final, Final) and final.usage["prompt_tokens"] == len(PROMPT)
    assert final.timings["cached_tokens"] == final.timings["decode_cached_tokens"] == len(PROMPT)
