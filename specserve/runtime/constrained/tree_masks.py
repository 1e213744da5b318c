"""Grammar masks for a tree of drafts: each node masked by the state its own path reaches.

A verify forward scores every node of a request's draft tree; node u's row predicts the token
after u's path (the root, the last committed token, then the drafts down to u). Plain
constrained decoding would mask that row with the grammar's state after that path, so each node
gets exactly that mask (`constrain_tree`: the request's matcher walked depth-first, accepting a
node's token on the way down and rolling it back on the way up). A draft token the grammar
forbids after its parent's path can never be accepted (its masked probability is 0), so it is
dropped with its subtree before the forward, and no row is spent on it. A node whose path
completes the grammar keeps no children: nothing may follow the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.runtime.constrained.base import Matcher


def constrain_tree(matcher: Matcher, tokens: Sequence[int], parents: Sequence[int]
                   ) -> tuple[list[int], torch.Tensor, list[bool]]:
    """The nodes of the tree (`tokens`, `parents`: topological order, node 0 the root, whose
    token `matcher` has accepted) that the grammar allows, in order; their masks
    [kept, ceil(V / 32)]; and per kept node whether its path completed the grammar (its row
    needs no mask: the request ends there). `matcher` is left where it was."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    for u in range(1, n):
        children[parents[u]].append(u)
    masks = matcher.backend.allocate_masks(n)  # [n, words]: row u for node u
    allowed = [False] * n
    ended = [False] * n
    allowed[0] = True
    ended[0] = matcher.is_terminated()
    if not ended[0]:
        matcher.fill_mask(masks, 0)
    stack: list[tuple[int, int]] = [(0, 0)]  # (node, index of its next child to visit)
    while stack:
        u, k = stack.pop()
        if k < len(children[u]) and not ended[u]:
            stack.append((u, k + 1))
            v = children[u][k]
            if matcher.accept(tokens[v]):
                allowed[v] = True
                ended[v] = matcher.is_terminated()
                if not ended[v]:
                    matcher.fill_mask(masks, v)
                stack.append((v, 0))
        elif u != 0:
            matcher.rollback(1)  # leaving u: undo its token
    kept = [u for u in range(n) if allowed[u]]
    return kept, masks[kept], [ended[u] for u in kept]
