"""A KV event subscriber written from vLLM's definitions of the wire format (independent of
radixserve's own structs): decodes batches, replays them from a publisher's replay socket, and
keeps the set of cached blocks per medium the way a KV-aware router does."""

from __future__ import annotations

import msgspec
import zmq


class Event(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


def replay(endpoint: str, first: int = 0) -> list[tuple[int, Batch]]:
    """The publisher's kept batches from sequence number `first`, with their numbers (a DEALER
    socket: the replay is many replies to one request)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    batches: list[tuple[int, Batch]] = []
    try:
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        while True:
            assert dealer.poll(30_000), "the replay stopped before its end marker"
            _empty, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches
            batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)


def follow(batches: list[Batch]) -> dict[str | None, set[int]]:
    """The blocks cached after these events, per medium; strict: a block is never stored twice
    in a medium, nor removed without having been stored."""
    blocks: dict[str | None, set[int]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                blocks.clear()  # every medium's
            elif isinstance(event, BlockStored):
                held = blocks.setdefault(event.medium, set())
                assert not held & set(event.block_hashes), f"a {event.medium} block stored twice"
                held.update(event.block_hashes)
            else:
                held = blocks.setdefault(event.medium, set())
                assert set(event.block_hashes) <= held, f"a {event.medium} block removed, never stored"
                held.difference_update(event.block_hashes)
    return {medium: held for medium, held in blocks.items() if held}


def stored_paths(batches: list[Batch]) -> dict[int, list[int]]:
    """Every stored block's whole token path, from the parent chain (blocks whose parent was
    stored before the first of these batches are left out)."""
    paths: dict[int, list[int]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                if parent is not None and parent not in paths:
                    continue
                for i, block in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                    paths[block] = (paths[parent] if parent is not None else []) + tokens
                    parent = block
    return paths
