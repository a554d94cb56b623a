"""Fast fake-quantization harness: the example's DLRM in one process, its pooled embeddings
perturbed by an error model (:mod:`fake_quant`) as the pooled all-to-all would see them.

It reproduces one ``examples/dlrm_criteo.py`` run on a Criteo TSV file (``--dataset
criteo-kaggle``, ``--sharding table_wise``, ``world`` gloo ranks) without sharding: the same model
(``dlrm_criteo.build_model``), the same rows per rank and step (``criteo_data.RawCriteoReader``),
the same held-out batches, a row-wise Adagrad on the tables equal to fbgemm's
``EXACT_ROWWISE_ADAGRAD`` (duplicate ids summed, ``eps`` 1e-8) and torch's Adagrad on the dense
part. Step ``k`` trains on the concatenation of every rank's ``k``-th batch; the dense gradient is
the mean over that global batch (DDP averages the ranks' means) and the table gradient is
``world`` times it (the table-wise backward all-to-all sums the ranks' gradients).

Table-wise, each table's pooled output travels as one block per destination rank: ``[batch,
dim]``. The error model is applied to exactly those blocks, in training and/or evaluation, with a
straight-through gradient (the backward all-to-all is exact unless ``bwd_model`` is set: then
that model perturbs each (source rank, table) block of the gradient, per sample; the codec sums
the rows of one distinct bag first, the harness does not). Stochastic models draw from their
own generator seeded per run, so the model's init and data order are the same for every error
model of a seed: runs are paired.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fake_quant import ErrorModel
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import criteo_data  # noqa: E402
import dlrm_criteo  # noqa: E402
from dlrm_metrics import auroc  # noqa: E402

__all__ = ["Data", "FakeQuantEBC", "Run", "build", "evaluate", "load_data", "train"]


@dataclass
class Data:
    """Every rank's rows, cut as the example cuts them.

    Attributes:
        sizes: Rows per table.
        train: Per rank: ``(dense, ids, labels)`` of its training rows in stream order.
        eval_batches: Global held-out batches (rank 0's ``k``-th batch, then rank 1's, ...).
        batch_size: Rows per rank and step.
        world: Number of ranks simulated.
    """

    sizes: list[int]
    train: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    eval_batches: list[Any]
    batch_size: int
    world: int

    @property
    def steps_per_epoch(self) -> int:
        """Full batches every rank has (the example stops when the first rank runs out)."""
        return min(int(t[2].shape[0]) for t in self.train) // self.batch_size

    def train_batch(self, step: int) -> Any:
        """The global batch of step ``step`` within an epoch (every rank's batch, rank order)."""
        b = self.batch_size
        parts = [tuple(a[step * b : (step + 1) * b] for a in t) for t in self.train]
        return criteo_data.make_batch(*(torch.cat(p) for p in zip(*parts, strict=True)))


def load_data(
    path: str,
    world: int = 2,
    batch_size: int = 512,
    holdout_every: int = 16,
    eval_batches: int = 8,
    max_rows: int = criteo_data.DEFAULT_MAX_ROWS,
) -> Data:
    """Reads a Criteo TSV file as ``world`` ranks of the example would.

    Args:
        path: The TSV(.gz) file.
        world: Ranks simulated.
        batch_size: The example's ``--batch-size`` (per rank).
        holdout_every: The example's ``--holdout-every``.
        eval_batches: The example's ``--eval-batches``.
        max_rows: The example's ``--max-rows`` (cap on table rows).

    Returns:
        The data.
    """
    sizes = criteo_data.table_sizes("criteo_kaggle", max_rows)
    readers = [
        criteo_data.RawCriteoReader([path], sizes, r, world, holdout_every) for r in range(world)
    ]
    train = [tuple(torch.from_numpy(a) for a in rd.arrays("train", 1 << 40)) for rd in readers]
    held = [rd.arrays("eval", eval_batches * batch_size) for rd in readers]
    # As dlrm_data._common_eval_batches: one size and count on every rank.
    rows = min(h[2].shape[0] for h in held)
    size = min(batch_size, rows)
    count = min(eval_batches, rows // size) if size else 0
    batches = []
    for k in range(count):
        cut = [tuple(torch.from_numpy(a[k * size : (k + 1) * size]) for a in h) for h in held]
        batches.append(criteo_data.make_batch(*(torch.cat(p) for p in zip(*cut, strict=True))))
    return Data(sizes, train, batches, batch_size, world)  # type: ignore[arg-type]


class _StraightThrough(torch.autograd.Function):
    """Forward: the perturbed value; backward: the gradient, times ``scale``, through
    ``grad_error`` when one is given (the backward all-to-all's error)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        scale: float,
        grad_error: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        ctx.scale, ctx.grad_error = scale, grad_error
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = g * ctx.scale
        return (g if ctx.grad_error is None else ctx.grad_error(g)), None, None, None


class FakeQuantEBC(nn.Module):
    """An ``EmbeddingBagCollection`` whose pooled output passes through an error model.

    Args:
        ebc: The collection (one feature per table, equal dims).
        world: Destination ranks: each table's output is cut into this many row blocks.
        grad_scale: Factor on the gradient of the pooled output (see the module docstring).

    Attributes:
        model: The error model (None: exact).
        bwd_model: The error model of the gradient all-to-all, applied in training to each
            (source rank, table) block of the pooled gradient, per sample (None: exact).
        tables: Indices of the tables ``model`` applies to (None: all).
        in_train: Apply it in training mode.
        in_eval: Apply it in evaluation mode.
        gen: Random source of stochastic models.
    """

    def __init__(self, ebc: nn.Module, world: int, grad_scale: float) -> None:
        super().__init__()
        self.ebc = ebc
        self.world = world
        self.grad_scale = grad_scale
        self.model: ErrorModel | None = None
        self.bwd_model: ErrorModel | None = None
        self.tables: Sequence[int] | None = None
        self.in_train = True
        self.in_eval = False
        self.gen = torch.Generator()

    def embedding_bag_configs(self) -> Any:
        """The wrapped collection's table configs (DLRM's ``SparseArch`` reads them)."""
        return self.ebc.embedding_bag_configs()

    def perturb(self, values: torch.Tensor) -> torch.Tensor:
        """Applies the error model to the ``[batch, tables * dim]`` pooled values (no grad).

        Args:
            values: The exact pooled values.

        Returns:
            The values as the destination ranks would decode them.
        """
        assert self.model is not None
        return self._blockwise(values, self.model, self.tables)

    def perturb_grad(self, grads: torch.Tensor) -> torch.Tensor:
        """Applies ``bwd_model`` to the ``[batch, tables * dim]`` gradient of the pooled values.

        Args:
            grads: The exact gradient (already times ``grad_scale``).

        Returns:
            The gradient as the table owners would decode it.
        """
        assert self.bwd_model is not None
        return self._blockwise(grads, self.bwd_model, None)

    def _blockwise(
        self, values: torch.Tensor, model: ErrorModel, tables: Sequence[int] | None
    ) -> torch.Tensor:
        b, width = values.shape
        n_tables = len(self.ebc.embedding_bag_configs())
        dim = width // n_tables
        # [world, rows, table, dim] -> blocks [world, table, rows, dim]
        blocks = values.detach().view(self.world, b // self.world, n_tables, dim).transpose(1, 2)
        out = model(blocks, self.gen)
        if tables is not None:
            keep = torch.ones(n_tables, dtype=torch.bool)
            keep[list(tables)] = False
            out = torch.where(keep.view(1, -1, 1, 1), blocks, out)
        return out.transpose(1, 2).reshape(b, width)

    def forward(self, features: Any) -> Any:
        """Pooled lookup, perturbed when the mode says so.

        Args:
            features: The KJT.

        Returns:
            A ``KeyedTensor`` like the collection's.
        """
        from torchrec.sparse.jagged_tensor import KeyedTensor

        kt = self.ebc(features)
        active = self.model is not None and (self.in_train if self.training else self.in_eval)
        y = self.perturb(kt.values()) if active else kt.values()
        bwd = self.perturb_grad if self.bwd_model is not None and self.training else None
        values = _StraightThrough.apply(kt.values(), y, self.grad_scale, bwd)
        return KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=values)


class RowwiseAdagrad:
    """fbgemm's ``EXACT_ROWWISE_ADAGRAD`` on sparse table gradients.

    Per touched row (gradients of duplicate ids summed): ``m += mean(g^2)``, ``w -= lr * g /
    (sqrt(m) + eps)``.

    Args:
        weights: The table weights (their ``grad`` sparse).
        lr: Learning rate.
        eps: fbgemm's epsilon.
    """

    def __init__(self, weights: Sequence[torch.Tensor], lr: float, eps: float = 1e-8) -> None:
        self.weights = list(weights)
        self.lr = lr
        self.eps = eps
        self.state = [torch.zeros(w.shape[0]) for w in self.weights]

    @torch.no_grad()
    def step(self) -> None:
        """Applies and clears the tables' sparse gradients."""
        for w, m in zip(self.weights, self.state, strict=True):
            if w.grad is None:
                continue
            g = w.grad.coalesce()
            rows, vals = g.indices()[0], g.values()
            m.index_add_(0, rows, vals.pow(2).mean(dim=1))
            w.index_add_(0, rows, -self.lr * vals / (m[rows].sqrt() + self.eps).unsqueeze(1))
            w.grad = None


@dataclass
class Run:
    """One model of the harness with its optimizers.

    Attributes:
        model: ``DLRMTrain`` with a :class:`FakeQuantEBC` in its sparse arch.
        fq: That :class:`FakeQuantEBC`.
        dense_opt: Adagrad of the dense part.
        table_opt: Row-wise Adagrad of the tables.
    """

    model: nn.Module
    fq: FakeQuantEBC
    dense_opt: torch.optim.Optimizer
    table_opt: RowwiseAdagrad


def build(data: Data, seed: int, argv: Sequence[str] = ()) -> Run:
    """The example's model for ``seed``, its tables on CPU, wrapped for fake quantization.

    Args:
        data: The data (table sizes, world).
        seed: The example's ``--seed``.
        argv: More example flags (model and optimizer ones apply: ``--lr``, dims, ...).

    Returns:
        The run, exact until an error model is set on ``run.fq``.
    """
    from torchrec import EmbeddingBagCollection

    args = dlrm_criteo.parse_args(
        ["--dataset", "criteo-kaggle", "--data-path", "-", "--seed", str(seed), *argv]
    )
    if args.emb_optimizer != "rowwise_adagrad":
        raise ValueError("the harness implements --emb-optimizer rowwise_adagrad only")
    model = dlrm_criteo.build_model(args, data.sizes, torch.device("cpu"))
    meta = model.model.sparse_arch.embedding_bag_collection
    # The sharded tables' init: uniform(-sqrt(1/n), sqrt(1/n)), drawn from a per-seed generator.
    gen = torch.Generator().manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=meta.embedding_bag_configs(), device=torch.device("cpu"))
    for cfg, bag in zip(meta.embedding_bag_configs(), ebc.embedding_bags.values(), strict=True):
        bound = cfg.num_embeddings**-0.5
        with torch.no_grad():
            bag.weight.uniform_(-bound, bound, generator=gen)
        bag.sparse = True  # the fused optimizer touches only the looked-up rows
    fq = FakeQuantEBC(ebc, data.world, grad_scale=float(data.world))
    model.model.sparse_arch.embedding_bag_collection = fq
    dense = [p for n, p in model.named_parameters() if ".ebc." not in n]
    tables = [bag.weight for bag in ebc.embedding_bags.values()]
    return Run(model, fq, torch.optim.Adagrad(dense, lr=args.lr), RowwiseAdagrad(tables, args.lr))


def batches(data: Data, epochs: int) -> Iterator[Any]:
    """The training batches of ``epochs`` passes, in the example's order.

    Args:
        data: The data.
        epochs: Passes.

    Yields:
        Global batches.
    """
    for _ in range(epochs):
        for k in range(data.steps_per_epoch):
            yield data.train_batch(k)


def train(run: Run, data: Data, epochs: int) -> list[float]:
    """Trains ``run`` for ``epochs`` passes.

    Args:
        run: The run (its error model set as wanted).
        data: The data.
        epochs: Passes over the training rows.

    Returns:
        The training losses.
    """
    run.model.train()
    losses = []
    for batch in batches(data, epochs):
        run.dense_opt.zero_grad()
        loss, _ = run.model(batch)
        loss.backward()
        run.dense_opt.step()
        run.table_opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def predict(run: Run, data: Data) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out probabilities and labels (the mode's ``in_eval`` decides the perturbation).

    Args:
        run: The run.
        data: The data.

    Returns:
        ``(probabilities, labels)``.
    """
    run.model.eval()
    probs, labels = [], []
    for b in data.eval_batches:
        _, (_, logits, y) = run.model(b)
        probs.append(torch.sigmoid(logits.float()))
        labels.append(y.float())
    run.model.train()
    return torch.cat(probs), torch.cat(labels)


def evaluate(run: Run, data: Data) -> dict[str, float]:
    """Held-out AUC and log loss, computed as ``dlrm_metrics.evaluate`` does.

    Args:
        run: The run.
        data: The data.

    Returns:
        ``{"auc", "logloss"}``.
    """
    p, y = predict(run, data)
    logloss = float(torch.nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    return {"auc": auroc(p, y), "logloss": logloss}


def pooled_blocks(run: Run, data: Data, steps: int) -> list[torch.Tensor]:
    """Exact pooled blocks ``[table, rows, dim]`` of the first ``steps`` training batches.

    Args:
        run: The run.
        data: The data.
        steps: Batches to take.

    Returns:
        Per batch and destination rank, the blocks of every table.
    """
    out = []
    with torch.no_grad():
        for k in range(min(steps, data.steps_per_epoch)):
            v = run.fq.ebc(data.train_batch(k).sparse_features).values()
            n_tables = len(data.sizes)
            w = v.view(data.world, -1, n_tables, v.shape[1] // n_tables).transpose(1, 2)
            out.extend(w.unbind(0))
    return out


def _dense_grads(run: Run) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in run.dense_opt.param_groups[0]["params"]])


def _keep_output(store: list[torch.Tensor]) -> Any:
    def hook(_m: nn.Module, _i: Any, out: Any) -> None:
        store.append(out.values())

    return hook


def gradient_change(run: Run, data: Data, model: ErrorModel, steps: int = 8) -> dict[str, float]:
    """At fixed weights: how the error changes the gradients of training batches.

    Args:
        run: A trained run (left unchanged).
        data: The data.
        model: The error model.
        steps: Training batches to average over.

    Returns:
        Mean cosine and relative error norm ``|g' - g| / |g|`` of the dense gradient and of
        the gradient of the pooled embeddings (what the tables receive).
    """
    saved = (run.fq.model, run.fq.in_train)
    run.model.train()
    acc: dict[str, list[float]] = {"dense_cos": [], "dense_rel": [], "emb_cos": [], "emb_rel": []}
    for k in range(min(steps, data.steps_per_epoch)):
        grads = []
        for m in (None, model):
            run.fq.model, run.fq.in_train = m, True
            run.dense_opt.zero_grad()
            batch = data.train_batch(k)
            pooled: list[torch.Tensor] = []
            handle = run.fq.register_forward_hook(_keep_output(pooled))
            loss, _ = run.model(batch)
            handle.remove()
            emb_g = torch.autograd.grad(loss, pooled[0], retain_graph=True)[0]
            loss.backward()
            grads.append((_dense_grads(run).clone(), emb_g.reshape(-1)))
        for i, name in enumerate(("dense", "emb")):
            g, h = grads[0][i], grads[1][i]
            acc[f"{name}_cos"].append(float(torch.nn.functional.cosine_similarity(g, h, dim=0)))
            acc[f"{name}_rel"].append(float((h - g).norm() / g.norm()))
    run.fq.model, run.fq.in_train = saved
    run.dense_opt.zero_grad()
    for w in run.table_opt.weights:
        w.grad = None
    return {k: float(np.mean(v)) for k, v in acc.items()}


def logit_shift(run: Run, data: Data, model: ErrorModel, seed: int = 0) -> float:
    """Mean absolute change of the held-out logits when ``model`` perturbs the evaluation.

    A fixed-weight sensitivity without AUC's rank noise (usable on tiny or skewed held-out
    sets). ``run`` is left as it was.

    Args:
        run: A trained run.
        data: The data.
        model: The error model.
        seed: Seed of its random source.

    Returns:
        ``mean |logit' - logit|``.
    """
    saved = (run.fq.model, run.fq.in_eval)
    run.fq.model = None
    p0, _ = predict(run, data)
    run.fq.model, run.fq.in_eval = model, True
    run.fq.gen.manual_seed(seed)
    p1, _ = predict(run, data)
    run.fq.model, run.fq.in_eval = saved
    return float((torch.logit(p1.double()) - torch.logit(p0.double())).abs().mean())
