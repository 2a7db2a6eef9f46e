"""FakeExecutor: the Executor protocol (radixserve/executor/base.py) without a model, for driving
the scheduler directly in tests.

Its "model" reads the KV pool like a real one. Every forward writes each new token's id and
position into the KV slot the scheduler assigned it (out_cache_loc), then reads every context back
through the scheduler's tables (an extend segment's context_slots, a decode request's
req_to_token row) and checks that slot i holds position i. The next token is a function of the
whole context as read from the pool (next_token below), so greedy outputs are predictable from
the prompt alone, and any KV bookkeeping error (a slot freed while in use, a wrong prefix after a
retraction or a chunk) changes them or fails the check.

Every forward is recorded (RecordedBatch) so tests can assert which batches the scheduler formed.
The helpers at the end build a scheduler over a fake executor and drive it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.cache.kv_copy import KVCopy, ReadyKV
from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import ExecutorInfo, KVLayout, LoraAdapterInfo
from radixserve.forward.batch import ForwardBatch, ForwardMode
from radixserve.layers.sampler import SamplingBatch, sample
from radixserve.models.config import ModelConfig, VisionConfig
from radixserve.protocol.messages import (
    ControlResult,
    FinishReason,
    GenerateRequest,
    ReqOutput,
    SchedulerOutput,
)
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler

HIDDEN_SIZE = 8
# How far the chosen token's logit stands above the others: greedy picks it whatever the noise.
CHOSEN_LOGIT = 10.0


def next_token(context: list[int], vocab_size: int) -> int:
    """The token the fake model predicts after `context` (a request's whole sequence so far).

    A position-weighted sum, so that the order of the tokens and each one of them matter."""
    return (sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % vocab_size


def adapter_shift(name: str | None) -> int:
    """How far the fake model's LoRA adapter `name` moves each predicted token id (0: the base)."""
    return 0 if name is None else 1 + sum(ord(c) for c in name)


def expected_output(
    prompt: list[int], max_new_tokens: int, vocab_size: int, adapter: str | None = None
) -> list[int]:
    """What greedy decoding of the fake model gives, with no stop token (under a LoRA adapter:
    every token shifted by adapter_shift)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append((next_token(seq, vocab_size) + adapter_shift(adapter)) % vocab_size)
    return seq[len(prompt) :]


@dataclass(frozen=True)
class RecordedBatch:
    """One forward the scheduler asked for, one entry per request in batch order."""

    mode: ForwardMode
    # Tokens each request had in the KV pool before this batch, and how many it computes now
    # (a decode request: its position, and 1).
    prefix_lens: list[int]
    extend_lens: list[int]
    # Each request's input tokens in this batch.
    segments: list[list[int]]
    # Rows sampled (requests that reached the end of their input).
    num_sampled: int

    @property
    def is_prefill(self) -> bool:
        return self.mode is ForwardMode.EXTEND

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def tiny_config(vocab_size: int, eos_token_ids: list[int], context_len: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HIDDEN_SIZE // 2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=context_len,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        sliding_window=None,
        eos_token_ids=list(eos_token_ids),
    )


@dataclass
class FakeExecutor:
    vocab_size: int = 1024
    eos_token_ids: list[int] = field(default_factory=list)
    context_len: int = 256
    max_total_tokens: int = 512
    # Serve embedding requests (one vector per prompt) instead of generating.
    is_embedding: bool = False
    # Pipeline stages (--pp-size): forward_pipeline runs a tick of them, each over a KV pool of its
    # own, as each real stage holds its own layers' K/V.
    stages: int = 1
    batches: list[RecordedBatch] = field(default_factory=list)
    # A vision-language model's images (scheduler/images.py): None for a text model.
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        self.config = tiny_config(self.vocab_size, self.eos_token_ids, self.context_len)
        self.config.vision = self.vision
        # Images encoded per encode_images call, and every embedding row a forward received, as
        # (input id, position, its vector's two telling components: image mean, place in image).
        self.encode_calls: list[int] = []
        self.placed: list[tuple[int, int, float, float]] = []
        self.device = torch.device("cpu")
        self._released: set[str] = set()
        self.idle_calls = 0
        self.closed = False
        # Pipeline ticks run, and the most micro-batches one of them had in flight.
        self.ticks = 0
        self.most_in_flight = 0
        # LoRA (--enable-lora): the adapters "loaded", the one in each slot, and every batch's
        # adapters (by slot content when it ran).
        self.lora_loaded: dict[str, LoraAdapterInfo] = {}
        self.lora_slots: dict[int, str] = {}
        self.batch_adapters: list[set[str]] = []
        self._allocate_kv()

    def _allocate_kv(self) -> None:
        # -1: a slot no forward has written since the pool was (re)allocated.
        self.stage_pools = [
            (
                torch.full((self.max_total_tokens,), -1, dtype=torch.int64),
                torch.full((self.max_total_tokens,), -1, dtype=torch.int64),
            )
            for _ in range(self.stages)
        ]
        self.kv_tokens, self.kv_positions = self.stage_pools[0]

    # ---- the protocol's read-only parts

    @property
    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            self.config,
            self.context_len,
            self.max_total_tokens,
            torch.float32,
            self.device,
            self.is_embedding,
            pipeline_stages=self.stages,
        )

    @property
    def released(self) -> set[str]:
        return self._released

    # ---- running batches

    def forward_pipeline(
        self, batches: list[ForwardBatch | None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stage s writes and reads its own pool for batches[s]: a micro-batch that read K/V a
        stage has not written yet (launched out of order) fails _read's check there."""
        assert len(batches) == self.stages
        self.ticks += 1
        self.most_in_flight = max(self.most_in_flight, sum(b is not None for b in batches))
        result = None
        for stage, batch in enumerate(batches):
            if batch is None:
                continue
            self.kv_tokens, self.kv_positions = self.stage_pools[stage]
            if stage == self.stages - 1:
                result = self.forward(batch, record=stage == 0)
            else:
                self._run(batch, record=stage == 0)
        self.kv_tokens, self.kv_positions = self.stage_pools[0]
        return result

    def forward(self, batch: ForwardBatch, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        contexts, rows = self._run(batch, record)
        # Sample rows, then logprob rows: each row's logits predict the token after its position.
        logit_rows = [*batch.sample_rows.tolist()]
        if batch.logprob_rows is not None:
            logit_rows += batch.logprob_rows.tolist()
        logits = torch.zeros(len(logit_rows), self.vocab_size, dtype=torch.float32)
        adapters = self._row_adapters(batch)
        for out_row, row in enumerate(logit_rows):
            segment, position = rows[row]
            token = next_token(contexts[segment][: position + 1], self.vocab_size) + adapter_shift(
                adapters.get(row)
            )
            logits[out_row, token % self.vocab_size] = CHOSEN_LOGIT
        hidden_rows = list(logit_rows)
        if batch.hidden_rows is not None:
            hidden_rows += batch.hidden_rows.tolist()
        hidden = torch.stack([self._hidden(*rows[row]) for row in hidden_rows]) if hidden_rows else None
        if hidden is None:
            hidden = torch.zeros(0, HIDDEN_SIZE, dtype=torch.float32)
        return logits, hidden

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image token k of an image gets a vector of (the image's mean pixel, k, 0...)."""
        assert self.vision is not None
        n, tokens = pixel_values.shape[0], self.vision.tokens_per_image
        self.encode_calls.append(n)
        out = torch.zeros(n, tokens, HIDDEN_SIZE)
        out[:, :, 0] = pixel_values.mean(dim=(1, 2, 3))[:, None]
        out[:, :, 1] = torch.arange(tokens, dtype=torch.float32)
        return out

    def _record_embeds(self, batch: ForwardBatch) -> None:
        ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
        for row, vectors in batch.input_embeds or []:
            for i, vector in enumerate(vectors.tolist()):
                self.placed.append((ids[row + i], positions[row + i], vector[0], vector[1]))

    def _row_adapters(self, batch: ForwardBatch) -> dict[int, str]:
        """Each input row's adapter, by what its slot holds now (a stale slot gives wrong tokens)."""
        by_row = {}
        for slot, rows in batch.lora_groups or []:
            for row in rows.tolist():
                by_row[row] = self.lora_slots[slot]
        return by_row

    # ---- LoRA adapters: a name per slot is all the fake model keeps

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        return list(self.lora_loaded.values())

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        info = LoraAdapterInfo(name, path, 4, hashlib.sha256(path.encode()).hexdigest())
        self.lora_loaded[name] = info
        return info

    def unload_lora(self, name: str) -> None:
        del self.lora_loaded[name]
        self.lora_slots = {slot: held for slot, held in self.lora_slots.items() if held != name}

    def set_lora_slot(self, slot: int, name: str) -> None:
        assert name in self.lora_loaded
        self.lora_slots[slot] = name

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        return sample(logits, sampling)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._check_resident()
        self.kv_tokens[dst] = self.kv_tokens[src].clone()
        self.kv_positions[dst] = self.kv_positions[src].clone()

    def kv_layout(self) -> KVLayout:
        """One layer, one head of two values per slot: its token and its position (as K and V)."""
        return KVLayout(1, 1, 1, torch.int64)

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        self._check_resident()
        both = torch.stack((self.kv_tokens[slots], self.kv_positions[slots]))
        return both.reshape(1, 2, -1, 1, 1).clone()

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        self._check_resident()
        self.kv_tokens[slots] = kv[0, 0].reshape(-1)
        self.kv_positions[slots] = kv[0, 1].reshape(-1)

    def read_kv_async(self, slots: torch.Tensor) -> KVCopy:
        return ReadyKV(self.read_kv(slots))

    def upload_kv(self, pages: list[torch.Tensor]) -> KVCopy:
        return ReadyKV(torch.cat(pages, dim=2))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        if not self.is_embedding:
            raise TypeError("the fake model only embeds when built with is_embedding=True")
        contexts, rows = self._run(batch)
        vectors = []
        for row in batch.sample_rows.tolist():
            segment, position = rows[row]
            context = contexts[segment][: position + 1]
            vectors.append([float(len(context)), float(sum(context))] + [0.0] * (HIDDEN_SIZE - 2))
        return torch.tensor(vectors, dtype=torch.float32).reshape(-1, HIDDEN_SIZE)

    def _run(self, batch: ForwardBatch, record: bool = True) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Writes the batch's tokens into the fake KV, reads every request's context back and
        records the batch. Returns each request's context and, per input row, (request, position)."""
        self._check_resident()
        if record:
            self._record_embeds(batch)
        ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
        self.kv_tokens[batch.out_cache_loc] = batch.input_ids.cpu()
        self.kv_positions[batch.out_cache_loc] = batch.positions.cpu()
        contexts: list[list[int]] = []
        rows: list[tuple[int, int]] = []
        if batch.mode is ForwardMode.DECODE:
            layout = batch.decode
            assert layout is not None
            seq_lens = layout.seq_lens.tolist()
            pool_indices = layout.req_pool_indices.tolist()
            for b, (pool_idx, seq_len) in enumerate(zip(pool_indices, seq_lens, strict=True)):
                contexts.append(self._read(layout.req_to_token[pool_idx, :seq_len]))
                rows.append((b, seq_len - 1))
            prefix_lens = [n - 1 for n in seq_lens]
            extend_lens = [1] * len(seq_lens)
            segments = [[t] for t in ids]
        else:
            assert batch.extend is not None
            prefix_lens, extend_lens, segments = [], [], []
            masks = batch.verify_masks or [None] * len(batch.extend)
            for seg, mask in zip(batch.extend, masks, strict=True):
                assert seg.context_slots is not None, "the scheduler's extend batches carry context_slots"
                if mask is None:
                    contexts.append(self._read(seg.context_slots))
                    rows += [(len(contexts) - 1, seg.prefix_len + i) for i in range(seg.q_len)]
                else:
                    # A draft tree: node i sees the prefix and the nodes its mask row marks.
                    prefix = self._read(seg.prefix_slots)
                    nodes = ids[seg.q_start : seg.q_start + seg.q_len]
                    for i in range(seg.q_len):
                        contexts.append(
                            prefix + [t for t, seen in zip(nodes, mask[i].tolist(), strict=True) if seen]
                        )
                        rows.append((len(contexts) - 1, len(contexts[-1]) - 1))
                prefix_lens.append(seg.prefix_len)
                extend_lens.append(seg.q_len)
                segments.append(ids[seg.q_start : seg.q_start + seg.q_len])
        expected = [position for _, position in rows]
        assert positions == expected, f"positions {positions}, expected {expected}"
        if record:
            self.batch_adapters.append(set(self._row_adapters(batch).values()))
            sampled = int(batch.sample_rows.numel())
            recorded = RecordedBatch(batch.mode, prefix_lens, extend_lens, segments, sampled)
            self.batches.append(recorded)
        return contexts, rows

    def _read(self, slots: torch.Tensor) -> list[int]:
        """The tokens at a context's KV slots, after checking that slot i holds position i."""
        slots = slots.cpu()
        stored = self.kv_positions[slots]
        expected = torch.arange(len(slots), dtype=torch.int64)
        if not torch.equal(stored, expected):
            bad = int((stored != expected).nonzero()[0])
            raise AssertionError(
                f"KV slot {int(slots[bad])} holds position {int(stored[bad])}, expected {bad}: "
                "the scheduler's tables point at a slot another token overwrote"
            )
        tokens: list[int] = self.kv_tokens[slots].tolist()
        return tokens

    def _hidden(self, segment: int, position: int) -> torch.Tensor:
        return torch.full((HIDDEN_SIZE,), float(position), dtype=torch.float32) + segment

    def _check_resident(self) -> None:
        if self._released:
            raise RuntimeError(f"the fake model's {sorted(self._released)} memory is released")

    # ---- what tests read back

    @property
    def prefills(self) -> list[RecordedBatch]:
        return [b for b in self.batches if b.is_prefill]

    @property
    def decodes(self) -> list[RecordedBatch]:
        return [b for b in self.batches if not b.is_prefill]

    # ---- lifecycle and control plane

    def idle(self) -> None:
        self.idle_calls += 1

    def close(self) -> None:
        self.closed = True

    def describe(self) -> dict[str, Any]:
        return {"attention_backend": "fake", "decode_path": "fake", "cpu_kernels": "none"}

    def stats(self) -> dict[str, Any]:
        return {"fake_forwards": len(self.batches)}

    def release_memory(self, tags: set[str]) -> None:
        self._released |= tags

    def resume_memory(self, tags: set[str]) -> None:
        if "kv_cache" in tags & self._released:
            self._allocate_kv()
        self._released -= tags

    def resident_bytes(self) -> dict[str, int]:
        kv = 0 if "kv_cache" in self._released else 2 * self.max_total_tokens * 8
        return {"weights": 0, "kv_cache": kv}

    def weight_slice(self, name: str, truncate_size: int) -> list[float]:
        return [0.0] * truncate_size

    def load_other_weights(self, model_path: str) -> str:
        return model_path

    def update_weights_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        return len(named)


@dataclass
class FakeDraft(FakeExecutor):
    """A draft model for STANDALONE speculation (scheduler/speculative/draft_model.py): the fake
    model over a KV pool of its own. It drafts the target's own greedy token, except a wrong one
    after every context whose length is a multiple of miss_period (0: never).

    Every extend checks that the draft K/V it reads as its prefix is of the tokens the target's
    pool holds at those slots: a slot the draft never computed, or computed for another token,
    read as valid fails the test (as the base class's position check catches a slot overwritten)."""

    target: FakeExecutor | None = None
    miss_period: int = 0

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.extend is not None and self.target is not None:
            for seg in batch.extend:
                mine, theirs = self.kv_tokens[seg.prefix_slots], self.target.kv_tokens[seg.prefix_slots]
                assert torch.equal(mine, theirs), (
                    f"the draft read K/V of tokens {mine.tolist()} where the target has {theirs.tolist()}"
                )
        logits, hidden = super().forward(batch)
        if self.miss_period:
            lengths = batch.positions[batch.sample_rows] + 1
            missed = (lengths % self.miss_period == 0).nonzero().flatten()
            logits[missed] = logits[missed].roll(1, dims=1)
        return logits, hidden


# ---- driving a scheduler


def make_scheduler(executor: FakeExecutor | None = None, **server_args: Any) -> Scheduler:
    """A scheduler over a fake executor; server_args are ServerArgs fields."""
    server_args.setdefault("log_level", "warning")
    return Scheduler(ServerArgs(**server_args), executor or FakeExecutor())


def greedy(max_new_tokens: int, **params: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **params}


@dataclass
class Results:
    """Every request's streamed tokens and how it finished, gathered from scheduler outputs."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    controls: list[ControlResult] = field(default_factory=list)

    def take(self, outputs: list[SchedulerOutput]) -> None:
        for out in outputs:
            if isinstance(out, ControlResult):
                self.controls.append(out)
            elif isinstance(out, ReqOutput):
                self.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finished_reason is not None:
                    assert out.rid not in self.finish, f"{out.rid} finished twice"
                    self.finish[out.rid] = out.finished_reason


def submit(
    scheduler: Scheduler, results: Results, rid: str, prompt: list[int], max_new_tokens: int, **params: Any
) -> None:
    results.take(
        scheduler.handle(
            GenerateRequest(rid, prompt, SamplingParams.from_dict(greedy(max_new_tokens, **params)))
        )
    )


def check_kv_accounting(scheduler: Scheduler) -> None:
    """Between steps, busy or not: every KV slot is free, in the radix tree (evictable or locked),
    or owned by exactly one request (docs/architecture.md, "KV ownership")."""
    if scheduler.publisher is not None:
        return  # a finished request's KV stays with it until its results are published
    page = scheduler.args.page_size
    holders = [
        *scheduler.queues.running,
        *([scheduler.queues.chunked_req] if scheduler.queues.chunked_req else []),
    ]
    holders += scheduler.queues.in_flight  # in a pipeline's micro-batch (pipeline.py)
    for req in scheduler.queues.waiting:
        assert req.req_pool_idx is None, f"waiting request {req.rid} holds a request slot"
    # A request owns whole pages from its cached (page-aligned) length on.
    owned = sum(-(-(r.kv_len - r.cached_len) // page) * page for r in holders)
    # A decode server's request waiting for its prompt's K/V owns the slots reserved for it.
    handoffs = scheduler.decode_handoffs
    reserved = (
        [e.req for e in handoffs.awaiting.values() if e.req.req_pool_idx is not None] if handoffs else []
    )
    owned += sum(-(-len(r.origin_input_ids) // page) * page for r in reserved)
    holders += reserved
    cache, allocator = scheduler.tree_cache, scheduler.allocator
    accounted = allocator.available_size() + cache.evictable_size() + cache.protected_size() + owned
    assert accounted == allocator.total_slots, (
        f"free {allocator.available_size()} + evictable {cache.evictable_size()} + locked "
        f"{cache.protected_size()} + owned {owned} != {allocator.total_slots}"
    )
    used_slots = scheduler.req_to_token_pool.size - scheduler.req_to_token_pool.available_size()
    assert used_slots == len(holders), f"{used_slots} request slots in use by {len(holders)} requests"


def run_until_idle(scheduler: Scheduler, results: Results, max_steps: int = 10_000) -> None:
    """Steps until nothing is left to do, checking the KV accounting after every step, then once
    more: the idle step runs the scheduler's own KV self-check."""
    for _ in range(max_steps):
        check_kv_accounting(scheduler)
        if scheduler.is_idle:
            break
        results.take(scheduler.step())
    else:
        raise AssertionError(f"the scheduler is still busy after {max_steps} steps")
    results.take(scheduler.step())
    check_kv_accounting(scheduler)


def abort_after_first_verify(
    scheduler: Scheduler, executor: FakeExecutor, victim: list[int], other: list[int], max_new: int
) -> Results:
    """Serves two requests and aborts "victim" right after the first verify step (between two
    steps), checking the KV accounting after every step."""
    results = Results()
    submit(scheduler, results, "victim", victim, max_new)
    submit(scheduler, results, "other", other, max_new)
    while not any(b.mode is ForwardMode.VERIFY for b in executor.batches):
        results.take(scheduler.step())
        check_kv_accounting(scheduler)
    results.take(scheduler.abort("victim"))
    check_kv_accounting(scheduler)
    run_until_idle(scheduler, results)
    assert results.finish["victim"].type == "abort"
    return results


def check_finishes_partway(scheduler: Scheduler, results: Results, prompt: list[int], max_new: int) -> None:
    """A stop token partway along the output, and a max_new_tokens cap, end each request exactly
    there (drafts run past both), with nothing of the rest kept."""
    expected = expected_output(prompt, max_new, scheduler.config.vocab_size)
    stop = expected[17]
    first = expected.index(stop)
    submit(scheduler, results, "stop", prompt, max_new, stop_token_ids=[stop])
    submit(scheduler, results, "cap", prompt, 13)
    run_until_idle(scheduler, results)
    assert results.tokens["stop"] == expected[: first + 1]
    assert results.finish["stop"].type == "stop"
    assert results.tokens["cap"] == expected[:13]
    assert results.finish["cap"].type == "length"
    scheduler.check_kv_invariant()
