"""Unit tests of the sequence all-to-all's exact row dedupe (``sequence_dedupe``), no processes.

Two ranks are simulated in one process: each plans its dedupe from its own ids only (as owner,
the ids it looks up; as receiver, the ids of its batch), the exchange is a list hand-over, and
the expanded rows and the placed gradients are compared with what every id's row would give.
"""

from __future__ import annotations

import torch

from torchrec_lossy.distributed.sequence_dedupe import plan_sequence_dedupe

DIM = 4
# Owner 0 holds table A (features a1, a2) and B (b); owner 1 holds C (c).
LAYOUT = {0: [("A", ["a1", "a2"]), ("B", ["b"])], 1: [("C", ["c"])]}
ROWS = {"A": 6, "B": 5, "C": 3}
TABLE_OF = {f: t for specs in LAYOUT.values() for t, fs in specs for f in fs}


def _spans(owner: int) -> list[tuple[int, int]]:
    out, f0 = [], 0
    for _, fs in LAYOUT[owner]:
        out.append((f0, f0 + len(fs)))
        f0 += len(fs)
    return out


def _features(owner: int) -> list[str]:
    return [f for _, fs in LAYOUT[owner] for f in fs]


def _setup() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    weights = {t: torch.randint(-8, 8, (n, DIM), generator=g).float() for t, n in ROWS.items()}
    # Per source rank, per feature: its ids (repeats within and across features of table A;
    # rank 1 has no id of feature b).
    ids = {
        r: {
            f: torch.randint(
                0, ROWS[TABLE_OF[f]], (0 if (r, f) == (1, "b") else 7 + r,), generator=g
            )
            for f in TABLE_OF
        }
        for r in (0, 1)
    }
    return weights, ids


def _plan(rank: int, ids: dict) -> tuple:
    """Rank ``rank``'s dedupe plan, and the lookup output it would send (feature-major, by
    source) with the ids of its rows, and the receiver's ids in arrival order."""
    feats = _features(rank)
    lookup_ids = torch.cat([ids[d][f] for f in feats for d in (0, 1)])
    feature_rows = [[ids[d][f].numel() for d in (0, 1)] for f in feats]
    recv_ids = torch.cat([ids[rank][f] for o in (0, 1) for f in _features(o)])
    rows_per_owner = [[ids[rank][f].numel() for f in _features(o)] for o in (0, 1)]
    plan = plan_sequence_dedupe(
        lookup_ids, feature_rows, _spans(rank), recv_ids, rows_per_owner, [_spans(0), _spans(1)]
    )
    return plan, lookup_ids, recv_ids


def test_expand_restores_every_row_and_gradient_adjoint_sums_per_id() -> None:
    weights, ids = _setup()
    plans = {r: _plan(r, ids) for r in (0, 1)}
    table_rows = {
        r: [TABLE_OF[f] for f in _features(r) for d in (0, 1) for _ in ids[d][f]] for r in (0, 1)
    }
    embs = {
        r: torch.stack(
            [weights[t][i] for t, i in zip(table_rows[r], plans[r][1].tolist(), strict=True)]
        )
        for r in (0, 1)
    }
    sent = {o: plans[o][0].owner_blocks(embs[o]) for o in (0, 1)}
    for r in (0, 1):
        plan, _, recv_ids = plans[r]
        for o in (0, 1):  # both sides agree on the rows of every block, and rows repeat no id
            assert [b.shape[0] for b in sent[o][r]] == plan.recv_rows[o] == plans[o][0].send_rows[r]
        assert sum(map(sum, plan.recv_rows)) < recv_ids.numel()  # the dedupe removes rows
        out = plan.expand(torch.cat([b for o in (0, 1) for b in sent[o][r]]))
        tables = [TABLE_OF[f] for o in (0, 1) for f in _features(o) for _ in ids[r][f]]
        full = torch.stack([weights[t][i] for t, i in zip(tables, recv_ids.tolist(), strict=True)])
        assert torch.equal(out, full)
    # Backward: integer gradients, so sums in any order are exact.
    g = torch.Generator().manual_seed(1)
    grads = {
        r: torch.randint(-4, 5, (plans[r][2].numel(), DIM), generator=g).float() for r in (0, 1)
    }
    reduced = {r: plans[r][0].reduce_grad(grads[r]) for r in (0, 1)}
    for o in (0, 1):
        plan, lookup_ids, _ = plans[o]
        placed = plan.place_grad(
            [reduced[d][o] for d in (0, 1)], lookup_ids.numel(), DIM, torch.float32
        )
        # Per table row, the placed gradient sums to what every position's gradient sums to.
        full = torch.cat(
            [grads[d][_recv_slice(ids, d, o, f)] for f in _features(o) for d in (0, 1)]
        )
        for t in {TABLE_OF[f] for f in _features(o)}:
            mask = torch.tensor([x == t for x in table_rows[o]])
            want = torch.zeros(ROWS[t], DIM).index_add_(0, lookup_ids[mask], full[mask])
            got = torch.zeros(ROWS[t], DIM).index_add_(0, lookup_ids[mask], placed[mask])
            assert torch.equal(got, want), t
        # One nonzero row per distinct id per (source, table): the other copies get zeros.
        assert (placed.abs().sum(1) > 0).sum() <= sum(map(sum, plan.send_rows))


def _recv_slice(ids: dict, rank: int, owner: int, feature: str) -> slice:
    """Positions of ``feature``'s ids among what ``rank`` receives (owners, then features)."""
    start = 0
    for o in (0, 1):
        for f in _features(o):
            n = ids[rank][f].numel()
            if (o, f) == (owner, feature):
                return slice(start, start + n)
            start += n
    raise KeyError(feature)


def test_empty_blocks() -> None:
    plan = plan_sequence_dedupe(
        torch.empty(0, dtype=torch.int64), [[0, 0]], [(0, 1)],
        torch.empty(0, dtype=torch.int64), [[0], []], [[(0, 1)], []],
    )  # fmt: skip
    assert plan.send_rows == [[0], [0]] and plan.recv_rows == [[0], []]
    assert plan.expand(torch.empty(0, DIM)).shape == (0, DIM)
    assert plan.place_grad(
        [[torch.empty(0, DIM)], [torch.empty(0, DIM)]], 0, DIM, torch.float32
    ).shape == (0, DIM)
    # A rank holding no table shard still returns the lookup output's width.
    assert plan.place_grad([[], []], 0, DIM, torch.float32).shape == (0, DIM)
