"""The fake-quantization harness: exact mode is the plain model, blocks are cut as the
table-wise all-to-all cuts them, the table optimizer is fbgemm's, and a fixed-weight
sensitivity check on a tiny trained model tells the paper's error model from a gentler one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fake_quant as fq  # noqa: E402
import fq_harness as h  # noqa: E402

SAMPLE = next(
    (
        p
        for p in (d / "shared" / "data" / "criteo_1tb_day0_head1000.tsv.gz" for d in ROOT.parents)
        if p.is_file()
    ),
    None,
)
pytestmark = pytest.mark.skipif(SAMPLE is None, reason="../shared/data Criteo sample not found")


@pytest.fixture(scope="module")
def data() -> h.Data:
    torch.set_num_threads(1)
    return h.load_data(
        str(SAMPLE), world=2, batch_size=32, holdout_every=4, eval_batches=4, max_rows=1000
    )


def _state(run: h.Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def test_exact_mode_reproduces_the_unperturbed_model_bit_for_bit(data: h.Data) -> None:
    plain, exact = h.build(data, 3), h.build(data, 3)
    exact.fq.model, exact.fq.in_eval = fq.parse_model("exact"), True
    assert all(torch.equal(a, b) for a, b in zip(_state(plain), _state(exact), strict=True))
    assert h.train(plain, data, 1) == h.train(exact, data, 1)
    assert all(torch.equal(a, b) for a, b in zip(_state(plain), _state(exact), strict=True))
    assert all(map(torch.equal, h.predict(plain, data), h.predict(exact, data)))
    kjt = data.eval_batches[0].sparse_features
    assert torch.equal(exact.fq(kjt).values(), exact.fq.ebc(kjt).values())
    # ... and the error model does change training when it is not exact.
    coarse = h.build(data, 3)
    coarse.fq.model = fq.parse_model("block-nearest:0.3")
    assert h.train(coarse, data, 1) != h.train(h.build(data, 3), data, 1)


def test_blocks_are_one_per_destination_rank_and_table(data: h.Data) -> None:
    run = h.build(data, 0)
    seen: list[torch.Tensor] = []

    def spy(x: torch.Tensor, gen: Any) -> tuple[torch.Tensor, None]:
        seen.append(x.clone())
        return -x, None

    run.fq.model, run.fq.tables = fq.ErrorModel("spy", "spy", "", 0.0, spy), [1, 4]
    batch = data.train_batch(0)
    run.fq.train()
    values = run.fq.ebc(batch.sparse_features).values()
    out = run.fq(batch.sparse_features).values()
    blocks, d, b = seen[0], 16, data.batch_size
    assert blocks.shape == (2, 26, b, d)
    for w in range(2):
        for t in range(26):
            exact = values[w * b : (w + 1) * b, t * d : (t + 1) * d]
            assert torch.equal(blocks[w, t], exact)
            sent = out[w * b : (w + 1) * b, t * d : (t + 1) * d]
            assert torch.equal(sent, -exact if t in (1, 4) else exact)


def test_gradient_is_straight_through_times_the_world_size(data: h.Data) -> None:
    run = h.build(data, 0)
    run.fq.model = fq.parse_model("block-nearest:0.3")
    kjt = data.train_batch(0).sparse_features
    out = run.fq(kjt).values()
    g = torch.randn_like(out)
    out.backward(g)
    w = run.fq.ebc.embedding_bags["t_cat_0"].weight
    ids = kjt["cat_0"].values()
    expect = torch.zeros_like(w).index_add_(0, ids, 2.0 * g[:, :16])
    assert torch.allclose(w.grad.to_dense(), expect, atol=1e-6)


def test_backward_model_perturbs_each_gradient_block_within_its_bound(data: h.Data) -> None:
    run = h.build(data, 0)
    run.fq.bwd_model = fq.parse_model("rowexp-nearest:0.1")
    kjt = data.train_batch(0).sparse_features
    run.fq.train()
    out = run.fq(kjt).values()
    assert torch.equal(out, run.fq.ebc(kjt).values())  # the forward stays exact
    g = torch.randn_like(out) * torch.logspace(-6, 0, out.shape[0]).view(-1, 1)
    out.backward(g)
    w = run.fq.ebc.embedding_bags["t_cat_0"].weight
    ids = kjt["cat_0"].values()
    exact = 2.0 * g[:, :16]
    # Table 0's rows of each source rank are one block; the model saw exactly those.
    blocks = exact.view(2, data.batch_size, 16)
    sent = run.fq.bwd_model(blocks)
    assert not torch.equal(sent, blocks)
    expect = torch.zeros_like(w).index_add_(0, ids, sent.reshape(-1, 16))
    assert torch.allclose(w.grad.to_dense(), expect, rtol=0, atol=1e-12)
    err = (sent.double() - blocks.double()).abs()
    assert bool((err <= fq.stated_bound(run.fq.bwd_model, blocks) * (1 + 1e-6)).all())
    # An exact backward model trains bit for bit like none.
    plain, exact_bwd = h.build(data, 3), h.build(data, 3)
    exact_bwd.fq.bwd_model = fq.parse_model("exact")
    assert h.train(plain, data, 1) == h.train(exact_bwd, data, 1)
    coarse = h.build(data, 3)
    coarse.fq.bwd_model = fq.parse_model("block-nearest:0.3")
    assert h.train(coarse, data, 1) != h.train(h.build(data, 3), data, 1)


def test_rowwise_adagrad_matches_fbgemm_exact_rowwise_adagrad() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05,
        eps=1e-8,
    )
    w = tbe.split_embedding_weights()[0].clone().requires_grad_(True)
    opt = h.RowwiseAdagrad([w], lr=0.05)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids, offsets = torch.tensor([1, 3, 1, 7]), torch.arange(5)  # id 1 twice: summed
        g = torch.randn(4, 4, generator=gen)
        tbe(ids, offsets).backward(g)
        torch.nn.functional.embedding_bag(ids, w, offsets[:-1], mode="sum", sparse=True).backward(g)
        opt.step()
    ref = tbe.split_embedding_weights()[0]
    assert torch.allclose(w.detach(), ref, atol=1e-6)
    assert not torch.allclose(w.detach(), w.detach()[[0]])  # rows moved apart: not vacuous


def test_fixed_weight_sensitivity_of_the_recommended_models_stays_under_the_papers(
    data: h.Data,
) -> None:
    # docs/accuracy.md: block-relative 0.01 with stochastic rounding (today's options) and the
    # per-value relative 3% (log domain) move a trained model's logits several times less than
    # the paper's 3% of block range, at fixed weights (no seed noise).
    run = h.build(data, 0)
    h.train(run, data, 2)
    paper = h.logit_shift(run, data, fq.parse_model("block-nearest:0.03"))
    for spec in ("block-stochastic:0.01", "log:0.03"):
        assert 0 < h.logit_shift(run, data, fq.parse_model(spec)) < 0.5 * paper, spec
    assert h.logit_shift(run, data, fq.parse_model("exact")) == 0.0
