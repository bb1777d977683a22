"""EventBus: filtering, isolation of failing handlers, async handlers, history, unsubscribe."""

import asyncio
import logging
import threading

from genie_core.events import ClusterEvent, EventBus, EventType, Severity


def ev(kind=EventType.GPU_OVERHEATED, **data):
    return ClusterEvent(kind, "node-a", Severity.WARNING, data)


def test_subscribe_to_all_or_to_some_types():
    bus = EventBus()
    everything, only_heat = [], []
    bus.subscribe(everything.append)
    bus.subscribe(only_heat.append, types=["GPU_OVERHEATED"])
    bus.emit(ev(EventType.GPU_OVERHEATED))
    bus.emit(ev(EventType.MEMORY_PRESSURE))
    assert [e.type for e in everything] == [EventType.GPU_OVERHEATED, EventType.MEMORY_PRESSURE]
    assert [e.type for e in only_heat] == [EventType.GPU_OVERHEATED]


def test_a_failing_handler_is_logged_and_the_others_still_run(caplog):
    bus = EventBus()
    seen = []

    def broken(event):
        raise RuntimeError("handler bug")

    bus.subscribe(broken)
    bus.subscribe(seen.append)
    with caplog.at_level(logging.ERROR, logger="genie.events"):
        bus.emit(ev())
    assert len(seen) == 1 and "handler bug" in caplog.text


def test_async_handlers_run_on_their_loop():
    bus = EventBus()
    got = []

    async def main():
        done = asyncio.Event()

        async def handler(event):
            got.append((event.type, threading.current_thread() is threading.main_thread()))
            done.set()

        bus.subscribe(handler)
        threading.Thread(target=bus.emit, args=(ev(),)).start()  # emitted from another thread
        await asyncio.wait_for(done.wait(), 5)

    asyncio.run(main())
    assert got == [(EventType.GPU_OVERHEATED, True)]


def test_async_handler_without_a_running_loop():
    bus = EventBus()
    done = threading.Event()

    async def handler(event):
        done.set()

    bus.subscribe(handler)
    bus.emit(ev())
    assert done.wait(5)


def test_history_is_bounded_and_replayed_to_late_subscribers():
    bus = EventBus(history=3)
    for i in range(5):
        bus.emit(ev(i=i))
    bus.emit(ClusterEvent(EventType.METRICS, "node-a"))  # snapshots are not history
    late = []
    bus.subscribe(late.append, replay=True)
    assert [e.data["i"] for e in late] == [2, 3, 4]
    assert [e.data["i"] for e in bus.history(limit=2)] == [3, 4]


def test_unsubscribe():
    bus = EventBus()
    seen = []
    unsubscribe = bus.subscribe(seen.append)
    bus.emit(ev())
    unsubscribe()
    bus.emit(ev())
    assert len(seen) == 1


def test_event_round_trip():
    e = ev(gpu=1, temperature=91.5)
    assert ClusterEvent.from_dict(e.to_dict()) == e
