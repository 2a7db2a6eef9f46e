"""The KV event publisher (scheduler/kv_events.py): batches reach a ZMQ subscriber in order with
sequence numbers, a replay request gets the kept batches back, a full queue drops (and counts)
instead of blocking the scheduler, and replicas publish on endpoints of their own."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from radixserve.cache.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from radixserve.config.kv_events_args import KVEventsConfig
from radixserve.scheduler.kv_events import END_OF_REPLAY, KVEventPublisher, binds, replica_endpoint
from tests.ports import free_port


def test_replicas_offset_the_port_or_suffix_the_name() -> None:
    assert replica_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert replica_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert replica_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert replica_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_local_and_wildcard_addresses_bind_remote_ones_connect() -> None:
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://*:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://10.1.2.3:5557")


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    config = KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic="kv",
    )
    live = KVEventPublisher(config, page_size=1, medium="CPU", dp_rank=0)
    yield live
    live.shutdown()


def test_batches_arrive_in_order_and_replay_returns_the_kept_ones(publisher: KVEventPublisher) -> None:
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    received: list[tuple[int, KVEventBatch]] = []
    try:
        # A SUB socket misses what is sent before it has joined: publish until one arrives.
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            publisher.recorder.stored([11], None, [5])
            publisher.flush()
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                received.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        assert received, "no batch reached the subscriber"
        publisher.recorder.cleared()
        publisher.flush()
        assert sub.poll(10_000)
        seq, payload = sub.recv_multipart()[1:]
        batch = decoder.decode(payload)
        assert batch.events == [AllBlocksCleared()] and batch.data_parallel_rank == 0
        last = int.from_bytes(seq, "big")
        assert last > received[0][0]
    finally:
        sub.close(linger=0)
    assert received[0][1].events == [BlockStored([11], None, [5], 1, None, "CPU")]

    # A DEALER, not a REQ: the replay is many replies to one request.
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint or "")
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(10_000)
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END_OF_REPLAY:
                assert payload == b""
                break
            replayed.append(int.from_bytes(seq_bytes, "big"))
            decoder.decode(payload)
        assert replayed == list(range(last + 1))
    finally:
        dealer.close(linger=0)


def test_a_full_queue_drops_and_counts_instead_of_waiting(publisher: KVEventPublisher) -> None:
    publisher.shutdown()  # the thread is gone: nothing drains the queue
    publisher._queue = queue.Queue(maxsize=1)
    for _ in range(3):
        publisher.recorder.stored([1], None, [1])
        publisher.flush()
    assert publisher.dropped == 2


def test_an_address_in_use_is_a_clear_startup_error(publisher: KVEventPublisher) -> None:
    with pytest.raises(RuntimeError, match="cannot open"):
        KVEventPublisher(KVEventsConfig(endpoint=publisher.endpoint), page_size=1, medium="CPU")
