"""How the scorer lays loglikelihood requests into model rows: requests that share their
context as branches of one row (the context once, every continuation after it), or, for
models whose layers cannot mask branches apart, requests whose inputs are a prefix of
another's inside that one's row.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BRANCHES = 31  # one bit of an int32 set per branch (`BranchSegments`)


@dataclass
class Packed:
    """One model row: its inputs, their positions and branch bit sets (None: one plain
    sequence), the input positions whose hidden states score a target, those targets,
    and where each score goes (a flat slot of the requests' scored tokens)."""

    tokens: list[int]
    positions: list[int]
    bits: list[int] | None
    index: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    where: list[int] = field(default_factory=list)
    requests: int = 0


def slots(rows: list[tuple[list[int], int]]) -> list[int]:
    """The first output slot of each row (row j's scored tokens: slots[j] .. + n_j)."""
    out, at = [], 0
    for _, n in rows:
        out.append(at)
        at += n
    return out


def prefix_groups(rows: list[tuple[list[int], int]], max_scored: int) -> list[list[int]]:
    """Groups of row ids scored in one input row: a row whose inputs (all tokens but the
    last) are a prefix of another's is scored in that one's row, causal attention giving
    it the same log-probabilities there. One-token continuations of one context share it
    this way, and identical requests are computed once. The host (longest) row comes
    first; a group scores at most `max_scored` positions."""
    order = sorted(range(len(rows)), key=lambda i: rows[i][0][:-1])
    host = list(range(len(rows)))
    load = {i: rows[i][1] for i in range(len(rows))}
    # Sorted lexicographically, the rows extending a prefix come right after it.
    for a, b in zip(order[-2::-1], order[:0:-1], strict=True):
        ia, ib = rows[a][0][:-1], rows[b][0][:-1]
        h = host[b]
        if ib[:len(ia)] == ia and load[h] + rows[a][1] <= max_scored:
            host[a] = h
            load[h] += rows[a][1]
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(host[i], []).append(i)
    return [[h] + [i for i in g if i != h] for h, g in groups.items()]


def prefix_rows(rows: list[tuple[list[int], int]], max_scored: int) -> list[Packed]:
    """`prefix_groups` as model rows (plain sequences)."""
    first = slots(rows)
    out = []
    for g in prefix_groups(rows, max_scored):
        host = rows[g[0]][0]
        p = Packed(tokens=list(host[:-1]), positions=list(range(len(host) - 1)), bits=None)
        for j in g:
            seq, n = rows[j]
            end = len(seq) - 1
            p.index += range(end - n, end)
            p.targets += seq[-n:]
            p.where += range(first[j], first[j] + n)
            p.requests += 1
        out.append(p)
    return out


def branch_rows(rows: list[tuple[list[int], int]], *, limit: int,
                max_scored: int) -> list[Packed]:
    """Rows of equal context as branches of one model row: the context (C tokens) once,
    then each continuation's inputs (n_j - 1 tokens) at positions C, C + 1, ... of its own.
    The context carries every branch's bit, a branch its own: a branch attends to the
    context and itself only, and scores its first token at the context's last position.
    A row holds more than one branch only while it stays within `limit` tokens (the
    model's length, and its sliding window: in a packed row a key's distance is counted
    in the row, not in positions), at most MAX_BRANCHES and `max_scored` scored tokens."""
    first = slots(rows)
    by_context: dict[tuple, list[int]] = {}
    for j, (seq, n) in enumerate(rows):
        by_context.setdefault(tuple(seq[:-n]), []).append(j)
    out = []
    for context, members in by_context.items():
        c = len(context)
        row = None
        for j in members:
            seq, n = rows[j]
            own = seq[-n:-1]
            if row is None or len(row.where) + n > max_scored \
                    or len(row.tokens) + len(own) > limit or row.requests == MAX_BRANCHES:
                row = Packed(tokens=list(context), positions=list(range(c)), bits=[0] * c)
                out.append(row)
            bit = 1 << row.requests
            row.bits[:c] = [b | bit for b in row.bits[:c]]
            start = len(row.tokens)
            row.tokens += own
            row.positions += range(c, c + len(own))
            row.bits += [bit] * len(own)
            row.index += [c - 1, *range(start, start + len(own))]
            row.targets += seq[-n:]
            row.where += range(first[j], first[j] + n)
            row.requests += 1
    return out
