"""The consumer kit's decisions (:mod:`app.consumer.core`) over generated schedules.

Each example: a consumer config (batched or per message, a batch handler or not, windows, threads,
prefetch, delivery limit, acks ``multiple`` or single, a dead-letter exchange or not), a few
messages (some published twice) whose handlers follow a plan per try (ok, raise, hang until
released, crash the process), and a schedule of deliveries, jobs run or released, time passing,
database outages and recoveries, lost ``COMMIT`` replies and channel closes (a job that stalls: a
window whose handler is slow is cut). The reference model
(``tests/unit/consumer_model.py``) plays it and then lets it settle. Checked:

- every delivery tag of a channel is settled once: no ack, nack or reject of a tag that is not
  outstanding; a ``multiple`` ack settles exactly the finished head run it counts;
- no ack before the effect committed (or its dead letter was published); no requeue without a
  recorded failure; no reject without a dead-letter verdict;
- a message's effect is recorded at most once, and in the end every message has its effect or is
  dead-lettered, every delivery settled (nothing stuck);
- attempts are bounded: a message whose first ``limit + 1`` tries fail is dead-lettered; one
  dead-lettered had at least ``limit`` tries fail through its own fault, or the schedule had
  outages, closes or crashes that cost tries (a crash during a charged try);
- while the database is out, one probe at a time (one delivery), only after the backoff; the
  pause ends once it answers;
- the ``handled`` and ``dead_lettered`` metrics agree with the model when nothing disrupts.

``make test-unit`` plays ``CONSUMER_CORE_EXAMPLES`` (default 1,000) schedules, derandomized (the
same ones each run); set the variable for more, drawn anew.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from app.consumer.config import ConsumerConfig
from tests.unit.consumer_model import FAULTS, TIMEOUT, Broken, Sim

EXAMPLES = int(os.environ.get("CONSUMER_CORE_EXAMPLES", "1000"))
FIXED = "CONSUMER_CORE_EXAMPLES" not in os.environ

STEPS = st.one_of(
    st.tuples(st.just("deliver"), st.integers(1, 6)),
    st.tuples(st.just("deliver"), st.integers(1, 6)),
    st.tuples(st.just("run"), st.integers(0, 5)),
    st.tuples(st.just("run"), st.integers(0, 5)),
    st.tuples(st.just("run"), st.integers(0, 5)),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("stall"), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.3, 1.0, 4.0, TIMEOUT + 1])),
    st.tuples(st.just("db_down"), st.just(0)),
    st.tuples(st.just("db_up"), st.just(0)),
    st.tuples(st.just("lose_commit"), st.just(0)),
    st.tuples(st.just("close"), st.just(0)),
)
BEHAVIOUR = st.sampled_from(["ok", "ok", "ok", "raise", "raise", "hang", "hang"])
#: a quarter of the schedules have handlers that kill the process (a crash hides much else)
CRASHING = st.sampled_from(["ok", "ok", "raise", "hang", "crash"])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Sim, list[tuple[str, float]]]:
    mode = draw(st.sampled_from(["batch", "message"]))
    config = ConsumerConfig(
        name="model",
        queue="q",
        mode=mode,
        prefetch=draw(st.integers(2, 8)),
        concurrency=draw(st.integers(1, 3)),
        batch_size=draw(st.integers(1, 4)),
        delivery_limit=draw(st.integers(1, 3)),
        handler_timeout=TIMEOUT,
        ack_multiple=draw(st.booleans()),
        dead_letter_exchange=draw(st.sampled_from([None, "dlx"])),
        broker_delivery_limit=None,
    )
    n = draw(st.integers(1, 6))
    mids = [f"m{i}" for i in range(n)]
    twice = draw(st.lists(st.sampled_from(mids), max_size=2, unique=True))
    copies = draw(st.permutations(mids + twice))
    behaviour = CRASHING if draw(st.integers(0, 3)) == 0 else BEHAVIOUR
    plans = {mid: draw(st.lists(behaviour, max_size=4)) for mid in mids}
    batch_handler = mode == "batch" and draw(st.booleans())
    sim = Sim(config=config, plans=plans, copies=copies, batch_handler=batch_handler)
    sim.hangs_time_out = draw(st.booleans())
    return sim, draw(st.lists(STEPS, min_size=6, max_size=40))


def play(sim: Sim, steps: list[tuple[str, float]]) -> None:
    plans = {mid: list(plan) for mid, plan in sim.plans.items()}
    for kind, arg in steps:
        if kind == "deliver":
            sim.deliver(int(arg))
        elif kind == "run":
            sim.run(int(arg))
        elif kind == "release":
            sim.release(int(arg))
        elif kind == "stall":  # a job runs, and if its handler hangs, a second passes
            sim.run(int(arg))
            sim.tick(1.0)
        elif kind == "tick":
            sim.tick(arg)
        elif kind in ("db_down", "db_up"):
            sim.database(kind == "db_up")
            sim.pump()
        elif kind == "lose_commit":
            sim.db.lose_commit_reply = True
        else:
            sim.close_channel()
            sim.pump()
    sim.settle(hangs_time_out=sim.hangs_time_out)
    check_the_end(sim, plans)


def check_the_end(sim: Sim, plans: dict[str, list[str]]) -> None:
    dead = set(sim.broker.dead_lettered) | set(sim.broker.rejected)
    limit = sim.cfg.delivery_limit
    assert not sim.state.outage.down and not sim.state.metrics.database_down, "still paused"
    for mid in sim.copies:
        effects = sim.db.effects[mid]
        assert effects <= 1, f"{mid}: {effects} effects"
        assert effects == 1 or mid in dead, f"{mid}: neither its effect nor dead-lettered"
        if mid in dead:
            assert sim.faults[mid] + sim.disruptions >= limit, (
                f"{mid} dead-lettered after {sim.faults[mid]} faults of its own (limit {limit})"
            )
        doomed = len(plans[mid]) > limit and all(b in FAULTS for b in plans[mid][: limit + 1])
        if doomed and sim.copies[mid] == 1 and not sim.disruptions:
            assert mid in dead and effects == 0, f"{mid}: {plans[mid]} not dead-lettered"
    if not sim.disruptions:
        handled, dead_lettered = sim.totals()
        assert handled == sum(sim.db.effects.values())
        assert dead_lettered == len(sim.broker.dead_lettered) + len(sim.broker.rejected)


@settings(
    max_examples=EXAMPLES,
    derandomize=FIXED,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios())
def test_every_schedule_keeps_the_kits_promises(
    scenario: tuple[Sim, list[tuple[str, float]]],
) -> None:
    sim, steps = scenario
    note(f"{sim!r}\nsteps={steps}")
    play(sim, steps)


# ---------------------------------------------------------------- named schedules


def sim_of(plans: dict[str, list[str]], **config: object) -> Sim:
    cfg = ConsumerConfig(name="model", queue="q", handler_timeout=TIMEOUT, **config)  # type: ignore[arg-type]
    return Sim(config=cfg, plans=plans, copies=list(plans))  # type: ignore[arg-type]


def test_a_poison_is_requeued_then_dead_lettered_at_the_limit() -> None:
    sim = sim_of({"a": ["raise"] * 5, "b": []}, delivery_limit=3, batch_size=2, prefetch=4)
    play(sim, [])
    assert sim.broker.rejected == ["a"] and sim.db.effects == {"b": 1}
    assert sim.verdicts["requeue"] == ["a", "a"] and sim.faults["a"] == 3


def test_a_message_that_crashes_the_process_dies_after_limit_plus_one_crashes() -> None:
    sim = sim_of({"a": ["crash"] * 9, "b": []}, delivery_limit=2, dead_letter_exchange="dlx")
    play(sim, [])
    assert sim.broker.dead_lettered == ["a"] and sim.db.effects == {"b": 1}
    assert sim.faults["a"] == 3  # the first, uncounted, in a window; then 2 charged first


def test_an_outage_holds_everything_and_charges_nothing() -> None:
    sim = sim_of({f"m{i}": [] for i in range(6)}, batch_size=3, prefetch=6)
    play(sim, [("db_down", 0), ("deliver", 6), ("run", 0), ("tick", 0.1), ("run", 0)])
    assert sim.db.effects == {f"m{i}": 1 for i in range(6)} and not sim.broker.rejected
    assert sim.db.attempts == {}


def test_a_lost_commit_reply_is_counted_handled_not_deduplicated() -> None:
    sim = sim_of({"a": [], "b": []}, batch_size=2)
    play(sim, [("deliver", 2), ("lose_commit", 0), ("run", 0)])
    assert sim.totals() == (2, 0) and sim.state.metrics.counts["deduplicated"] == 0


def test_a_hung_handler_is_timed_out_and_the_others_go_on() -> None:
    sim = sim_of({"a": ["hang", "hang"], "b": [], "c": []}, delivery_limit=2, batch_size=3)
    late = TIMEOUT + 1
    steps = [("deliver", 3), ("run", 0), ("tick", late), ("run", 0), ("run", 0), ("deliver", 1)]
    play(sim, [*steps, ("run", 0), ("tick", late), ("run", 0)])
    assert sim.db.effects == {"b": 1, "c": 1} and sim.broker.rejected == ["a"]
    assert sim.faults["a"] == 2 and sim.totals() == (2, 1)


def test_the_model_sees_an_ack_of_a_settled_tag() -> None:
    """The checks can fail: a second ack of one tag is caught."""
    from app.consumer.core import Frame

    sim = sim_of({"a": []})
    play(sim, [])
    try:
        sim.frame(Frame("ack", 1))
    except Broken:
        return
    raise AssertionError("an ack of a settled tag went unseen")


def test_a_slow_handler_gives_the_rest_of_its_window_to_another() -> None:
    sim = sim_of({"a": ["hang"], "b": [], "c": []}, batch_size=3, prefetch=6)
    sim.deliver(3)
    sim.run(0)  # a's handler hangs: its window holds b and c, not started
    sim.tick(1.0)  # past CUT_AFTER: they go to another window
    sim.run(0)
    assert sim.db.effects == {"b": 1, "c": 1} and sim.broker.acked == 2
    play(sim, [])  # a's handler returns: its window commits a alone
    assert sim.db.effects == {"a": 1, "b": 1, "c": 1} and sim.totals() == (3, 0)


def test_an_outage_seen_by_a_closed_channels_job_does_not_pause_an_idle_consumer() -> None:
    """Shrunk from a schedule: the channel closed while a window ran; the new channel handled
    both deliveries; then the old window met the database out. The consumer stayed paused
    (``database_down``, not ready) with nothing held to probe the database with."""
    sim = sim_of({"m0": []}, batch_size=1, prefetch=2, concurrency=2)
    sim.copies["m0"] = 2
    sim.broker.ready.append(("m0", False))
    steps = [("deliver", 1), ("deliver", 1), ("close", 0), ("deliver", 2), ("run", 2)]
    play(sim, [*steps, ("run", 2), ("db_down", 0), ("run", 0), ("run", 0)])
    assert not sim.state.metrics.database_down and sim.state.metrics.counts["database_outages"] == 0
