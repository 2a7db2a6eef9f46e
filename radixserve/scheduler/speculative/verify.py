"""From a verify step's logits to the tokens each request emits.

Every node of a request's draft tree was computed in the forward, so its logits are the target
model's distribution for the token after it (given its ancestors). Each node's row is processed
exactly as a decode step would process it at that point: the stop tokens banned until
min_new_tokens, penalties over the output so far plus the drafts on the node's path, logit_bias;
then one token is drawn per row with the request's own sampling parameters and generator (greedy:
the argmax).

The walk: start at the root, emit the token drawn there; while the emitted token is one of the
node's children, move to that child and emit the token drawn there. The drafts are fixed tokens
(an n-gram's guess is a point mass), and for a point-mass proposal rejection sampling accepts a
child with exactly the probability the target gives it and otherwise draws from the target with
the rejected tokens removed, which is the same as drawing from the target and checking whether
the draw is a child. So every emitted token is distributed as the target's next token given the
emitted ones, whatever the temperature, top-p, top-k or min-p; greedy accepts the longest path
that matches the target's argmax.

Random numbers: a row's draw inverts its CDF at one uniform number. All rows at one depth of a
request's tree share the number of that output position (only one of them is on the accepted
path, and the path up to it was chosen by earlier positions' numbers, so each emitted token still
gets a fresh one). A seeded request takes the numbers from its generator and then leaves the
generator exactly as far advanced as the tokens it emitted: the same numbers at the same output
positions as decoding without speculation, so a seeded request's tokens do not depend on what
was drafted (given the same logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.forward.draft_tree import DraftTree
from radixserve.layers.sampler import SamplingBatch
from radixserve.scheduler.request import Req

Sampler = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


@dataclass
class Verified:
    """What one request's verify step gives: the tokens to emit (accepted drafts, then the token
    the target drew after them) and, per token, the tree node whose logits it was drawn from."""

    tokens: list[int]
    nodes: list[int]
    drafted: int  # draft nodes in the tree (its size less the root)
    # Whether the walk stopped at a node with children (a draft was rejected), not at a leaf.
    rejected: bool = False

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def draw_tree_tokens(
    reqs: list[Req], trees: list[DraftTree], logits: torch.Tensor, vocab_size: int, sample: Sampler
) -> list[Verified]:
    """logits: every node's row, the trees' nodes in order. One Verified per request."""
    params, rows, generators, banned, histories = [], [], [], [], []
    penalized = any(r.sampling_row.penalized for r in reqs)
    for req, tree in zip(reqs, trees, strict=True):
        stop_ids = req.stop_token_ids()
        for node in range(len(tree)):
            params.append(req.sampling_params)
            rows.append(req.sampling_row)
            generators.append(req.generator)
            # The token drawn at this node would be output number len(output_ids) + depth + 1.
            outputs = len(req.output_ids) + tree.depths[node]
            banned.append(stop_ids if outputs < req.sampling_params.min_new_tokens else [])
            if penalized:
                histories.append((req.penalized_prompt_ids, req.output_ids + tree.path_tokens(node)))
    # Seeded requests' generator states before this step's draws, to rewind to.
    states = [None if r.generator is None else r.generator.get_state() for r in reqs]
    position_uniforms = [
        _position_uniforms(req.generator, tree.depth + 1) for req, tree in zip(reqs, trees, strict=True)
    ]
    uniforms = torch.cat([u[tree.depths] for u, tree in zip(position_uniforms, trees, strict=True)])
    sampling = SamplingBatch.build(
        params,
        generators,
        vocab_size,
        logits.device,
        banned_ids=banned,
        histories=lambda: histories,
        rows=rows,
        uniforms=uniforms.unsqueeze(1).to(logits.device),
    )
    drawn: list[int] = sample(logits, sampling).tolist()
    results, offset = [], 0
    for req, tree, state in zip(reqs, trees, states, strict=True):
        children = tree.children()
        node, tokens, nodes = 0, [], []
        while True:
            token = drawn[offset + node]
            tokens.append(token)
            nodes.append(node)
            child = children[node].get(token)
            if child is None:
                break
            node = child
        results.append(Verified(tokens, nodes, len(tree) - 1, rejected=bool(children[node])))
        offset += len(tree)
        if req.generator is not None and state is not None:
            _advance(req.generator, state, len(tokens))
    return results


def _position_uniforms(generator: torch.Generator | None, positions: int) -> torch.Tensor:
    """One uniform number per output position from here: a seeded request's from its generator,
    one draw per position as a decode step makes them (layers/sampler.py, _uniforms)."""
    if generator is None:
        return torch.rand(positions)
    draws = [torch.rand(1, 1, generator=generator, device=generator.device) for _ in range(positions)]
    return torch.cat(draws).view(-1).cpu()


def _advance(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Rewinds the generator to state, then advances it by as many draws as tokens were emitted."""
    generator.set_state(state)
    for _ in range(draws):
        torch.rand(1, 1, generator=generator, device=generator.device)
