"""Candidate error models of the pooled-embedding all-to-all, as plain torch functions.

Each model maps one block (the ``[rows, dim]`` pooled output of one table for one destination
rank, as the all-to-all sends it) to its decoded value and, where the model has integer codes,
the codes (for an order-0 entropy estimate of the bytes). Non-finite values are carried exactly;
every finite value meets the model's stated bound, computed in float64 and rounded once to
float32 (so up to half a float32 ulp of the decoded value beyond it).

Grids are anchored at zero, like the codec's (``q = floor(x / step + 0.5)``). ``nearest`` uses
step ``2 v s`` (error <= ``v s``), ``stochastic`` step ``v s`` (error < ``v s``, unbiased), as
``codec.rounding`` does; ``s`` is the model's scale: the block's value range (``block``), the
row's max magnitude (``row``) or a group of 32 consecutive values' max magnitude (``group``);
``rowexp`` and ``groupexp`` round that magnitude up to a power of two, a shared 8-bit exponent
as MX formats send it (``s = 2**ceil(log2 max|x|)``, so ``max|x| <= s < 2 max|x|``): the
backward candidates of issue 32 (benchmarks/backward_error_study.py).
``midrise`` shifts the nearest grid by half a step (no value is snapped to exactly 0), ``dither``
is subtractive dither (error uniform in ``[-v s, v s]`` and independent of the value). ``log``
bounds each value's relative error by ``v``. ``value`` is the codec's own per-value grid
(``ErrorBound(mode="value")``, through its torch reference: ``|x' - x| <= v |x|`` with m mantissa
bits kept, ``2**-(m + 1) <= v``; what the codec escapes is exact). ``mx4``, ``fp16`` and
``bf16`` are fbgemm's own casts as TorchRec's qcomm codecs use them (references; no stated
bound).

Spec syntax (:func:`parse_model`): ``exact``, ``fp16``, ``bf16``, ``mx4`` or
``SCALE-ROUNDING:V`` with SCALE in ``block``, ``row``, ``group``, ROUNDING in ``nearest``,
``stochastic``, ``midrise``, ``dither`` (e.g. ``block-nearest:0.03``), ``log:V`` or ``value:V``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ErrorModel", "code_entropy_bits", "parse_model", "stated_bound"]

GROUP = 32  # values per scale of the ``group`` models (MX4's group size)
SCALES = ("block", "row", "group", "rowexp", "groupexp")
ROUNDINGS = ("nearest", "stochastic", "midrise", "dither")
CASTS = ("exact", "fp16", "bf16", "mx4")
# Side information per value, bits: one fp16 scale per row of 16, one 8-bit exponent per group
# (``rowexp``: one 8-bit exponent per row of 16).
SIDE_BITS = {
    "block": 0.0, "row": 1.0, "group": 8.0 / GROUP, "rowexp": 0.5, "groupexp": 8.0 / GROUP,
    "log": 0.0, "value": 0.0,
}  # fmt: skip

Result = tuple[torch.Tensor, torch.Tensor | None]
Quantizer = Callable[[torch.Tensor, torch.Generator | None], Result]


@dataclass(frozen=True)
class ErrorModel:
    """One error model: its spec and the function that applies it to a block.

    Attributes:
        spec: The spec it was parsed from.
        scale: ``block``, ``row``, ``group``, ``log`` or a cast name.
        rounding: One of :data:`ROUNDINGS` (``nearest`` for ``log``; ``""`` for casts).
        value: The relative bound ``v`` (0 for casts).
        fn: ``fn(block, generator) -> (decoded, codes or None)``.
    """

    spec: str
    scale: str
    rounding: str
    value: float
    fn: Quantizer

    def __call__(self, block: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """Applies the model to one block.

        Args:
            block: float32 ``[..., rows, dim]`` (leading dims: independent blocks).
            gen: Random source of stochastic rounding and dither.

        Returns:
            The decoded block (same shape and dtype).
        """
        return self.fn(block, gen)[0]


def _finite_max_abs(x: torch.Tensor, dim: int) -> torch.Tensor:
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    return a.amax(dim=dim, keepdim=True)


def _block_range(x: torch.Tensor) -> torch.Tensor:
    """``max - min`` of the finite values of each block (last two dims); 0 if none is finite."""
    x = x.double()  # a float32 range can overflow
    finite = torch.isfinite(x)
    hi = torch.where(finite, x, torch.full_like(x, -math.inf)).amax(dim=(-2, -1), keepdim=True)
    lo = torch.where(finite, x, torch.full_like(x, math.inf)).amin(dim=(-2, -1), keepdim=True)
    any_finite = finite.any(dim=-1, keepdim=True).any(dim=-2, keepdim=True)
    return torch.where(any_finite, hi - lo, torch.zeros_like(hi))


def _pow2_ceil(m: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2 m)`` (float64) where ``m > 0``, else 0: a shared exponent's scale."""
    md = m.double()
    pos = md > 0
    e = torch.ceil(torch.log2(torch.where(pos, md, torch.ones_like(md))))
    return torch.where(pos, torch.exp2(e), torch.zeros_like(md))


def _scale_of(x: torch.Tensor, scale: str) -> torch.Tensor:
    """The model's scale ``s`` per row (``row*``) or per group (``group*``: ``x`` grouped)."""
    m = _finite_max_abs(x.double(), dim=-1)
    return _pow2_ceil(m) if scale.endswith("exp") else m


def _groups(x: torch.Tensor) -> torch.Tensor:
    """Each block (last two dims) flattened, zero-padded and cut into groups of :data:`GROUP`."""
    flat = x.reshape(*x.shape[:-2], -1)
    pad = (-flat.shape[-1]) % GROUP
    flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(*flat.shape[:-1], -1, GROUP)


def _ungroup(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    n = like.shape[-2] * like.shape[-1]
    return g.reshape(*g.shape[:-2], -1)[..., :n].reshape(like.shape)


def _grid(
    x: torch.Tensor, step: torch.Tensor, rounding: str, gen: torch.Generator | None
) -> Result:
    """Quantizes ``x`` on the zero-anchored grid of ``step`` (float64 arithmetic)."""
    xd, sd = x.double(), step.double().expand_as(x)
    ok = torch.isfinite(xd) & (sd > 0) & torch.isfinite(sd)
    safe = torch.where(ok, sd, torch.ones_like(sd))
    t = torch.where(ok, xd / safe, torch.zeros_like(xd))
    if rounding == "nearest":
        q = torch.floor(t + 0.5)
        y = q * safe
    elif rounding == "midrise":  # half-integer levels: nothing lands on exactly 0
        q = torch.floor(t)
        y = (q + 0.5) * safe
    elif rounding == "stochastic":
        u = torch.rand(t.shape, generator=gen, dtype=torch.float64)
        q = torch.floor(t)
        q = q + (u < t - q).double()
        y = q * safe
    elif rounding == "dither":  # subtractive: the receiver regenerates u from the shared seed
        u = torch.rand(t.shape, generator=gen, dtype=torch.float64) - 0.5
        q = torch.floor(t + u + 0.5)
        y = (q - u) * safe
    else:
        raise ValueError(f"unknown rounding {rounding!r}; use one of {ROUNDINGS}")
    out = torch.where(ok, y.to(x.dtype), x)
    return out, torch.where(ok, q, torch.zeros_like(q)).long()


def _step_factor(rounding: str) -> float:
    # nearest-like grids keep |error| <= step / 2; stochastic keeps |error| < step.
    return 1.0 if rounding == "stochastic" else 2.0


def _scaled(scale: str, rounding: str, v: float) -> Quantizer:
    k = _step_factor(rounding) * v

    def fn(x: torch.Tensor, gen: torch.Generator | None) -> Result:
        if scale == "block":
            return _grid(x, k * _block_range(x), rounding, gen)
        if scale.startswith("row"):
            return _grid(x, k * _scale_of(x, scale), rounding, gen)
        g = _groups(x)
        y, q = _grid(g, k * _scale_of(g, scale), rounding, gen)
        return _ungroup(y, x), _ungroup(q, x)

    return fn


def _log(v: float) -> Quantizer:
    # Levels exp(k s): the relative error is at most exp(s / 2) - 1 = v.
    s = 2.0 * math.log1p(v)

    def fn(x: torch.Tensor, gen: torch.Generator | None) -> Result:
        xd = x.double()
        ok = torch.isfinite(xd) & (xd != 0)
        mag = torch.where(ok, xd.abs(), torch.ones_like(xd))
        k = torch.floor(torch.log(mag) / s + 0.5)
        y = torch.sign(xd) * torch.exp(k * s)
        out = torch.where(ok, y.to(x.dtype), x)
        # Code: sign and level; exact zeros get their own symbol.
        code = torch.where(ok, 2 * k.long() + (xd < 0).long(), torch.full_like(k, 2**40).long())
        return out, code

    return fn


def _value(v: float) -> Quantizer:
    # The codec's per-value grid, block by block (a block's largest value sets which tiny
    # values the codec escapes), through its torch reference: the codec's decoded bits.
    from torchrec_lossy.codec.format import ESCAPE_SYMBOL
    from torchrec_lossy.codec.quant_params import QuantParams
    from torchrec_lossy.codec.quantize import value_params
    from torchrec_lossy.kernels.quantize_ref import dequantize_reference, quantize_reference

    def fn(x: torch.Tensor, gen: torch.Generator | None) -> Result:
        outs, codes = [], []
        for blk in x.reshape(-1, *x.shape[-2:]):
            fin = blk[torch.isfinite(blk)].abs()
            step, qmax = value_params(v, float(fin.max()) if fin.numel() else 0.0)
            params = QuantParams(step=step, inv_step=0.0, center=int(qmax), value=True)
            sym, _ = quantize_reference(blk, params, v)
            dec = dequantize_reference(sym, params).to(blk.dtype)
            outs.append(torch.where(sym == ESCAPE_SYMBOL, blk.reshape(-1), dec))
            codes.append(sym)
        return torch.stack(outs).view_as(x), torch.stack(codes).view(x.shape)

    return fn


def _cast(name: str) -> Quantizer:
    def fn(x: torch.Tensor, gen: torch.Generator | None) -> Result:
        if name == "exact":
            return x, None
        if name in ("fp16", "bf16"):
            # fbgemm's clamped casts, as TorchRec's FP16/BF16 qcomm codecs send them.
            from fbgemm_gpu import quantize_utils as qu

            to = qu.fp32_to_fp16_with_clamp if name == "fp16" else qu.fp32_to_bf16_with_clamp
            return to(x).float(), None
        from fbgemm_gpu.quantize_utils import fp32_to_mx4, mx4_to_fp32

        g = _groups(x)
        y = mx4_to_fp32(fp32_to_mx4(g.reshape(-1).contiguous(), GROUP), GROUP)
        return _ungroup(y.view_as(g), x), None

    return fn


def parse_model(spec: str) -> ErrorModel:
    """Parses an error-model spec (see the module docstring).

    Args:
        spec: E.g. ``"block-nearest:0.03"``, ``"row-stochastic:0.1"``, ``"log:0.03"``,
            ``"value:0.03"``, ``"mx4"``.

    Returns:
        The model.

    Raises:
        ValueError: On an unknown spec, naming the accepted forms.
    """
    if spec in CASTS:
        return ErrorModel(spec, spec, "", 0.0, _cast(spec))
    head, sep, val = spec.partition(":")
    try:
        v = float(val)
    except ValueError:
        v = -1.0
    if not sep or not (0 < v < 1):
        raise ValueError(f"error model {spec!r}: expected one of {CASTS} or NAME:V with 0 < V < 1")
    if head == "log":
        return ErrorModel(spec, "log", "nearest", v, _log(v))
    if head == "value":
        return ErrorModel(spec, "value", "nearest", v, _value(v))
    scale, _, rounding = head.partition("-")
    if scale not in SCALES or rounding not in ROUNDINGS:
        raise ValueError(
            f"error model {spec!r}: NAME is log, value or SCALE-ROUNDING with SCALE in {SCALES} "
            f"and "
            f"ROUNDING in {ROUNDINGS}"
        )
    return ErrorModel(spec, scale, rounding, v, _scaled(scale, rounding, v))


def stated_bound(model: ErrorModel, block: torch.Tensor) -> torch.Tensor:
    """The largest absolute error the model allows on each element of ``block``.

    Args:
        model: A quantizing model (not a cast).
        block: float32 ``[..., rows, dim]``.

    Returns:
        float64 bounds of ``block``'s shape (``inf`` where a cast states no bound).
    """
    x = block.double()
    v = model.value
    if model.scale == "block":
        return (v * _block_range(x)).expand_as(x).clone()
    if model.scale.startswith("row"):
        return (v * _scale_of(x, model.scale)).expand_as(x).clone()
    if model.scale.startswith("group"):
        g = _groups(x)
        return _ungroup((v * _scale_of(g, model.scale)).expand_as(g), x)
    if model.scale in ("log", "value"):
        return v * x.abs()
    return torch.full_like(x, math.inf)


def code_entropy_bits(
    model: ErrorModel, blocks: list[torch.Tensor], distinct: bool = False
) -> float | None:
    """Bits per value of ``blocks`` under the model: order-0 code entropy plus side information.

    The entropy is taken per block (a block is coded on its own) and averaged by size; casts
    cost their width (MX4: 4 bits plus an 8-bit exponent per 32 values).

    Args:
        model: The model.
        blocks: Blocks ``[rows, dim]`` of real traffic.
        distinct: Code only each block's distinct rows, as the codec's exact dedupe sends them
            (the bits are still per value of the full block).

    Returns:
        Bits per value, or None for ``exact``.
    """
    fixed = {"fp16": 16.0, "bf16": 16.0, "mx4": 4.0 + 8.0 / GROUP}
    if model.scale in fixed:
        return fixed[model.scale]
    if model.scale == "exact":
        return None
    gen = torch.Generator().manual_seed(0)
    bits, n = 0.0, 0
    for b in blocks:
        sent = torch.unique(b, dim=0) if distinct else b
        codes = model.fn(sent, gen)[1]
        assert codes is not None
        _, counts = torch.unique(codes, return_counts=True)
        p = counts.double() / codes.numel()
        entropy = float(-(p * torch.log2(p)).sum()) + SIDE_BITS[model.scale]
        bits += entropy * codes.numel()
        n += b.numel()
    return bits / max(n, 1)


def error_stats(model: ErrorModel, blocks: list[torch.Tensor]) -> dict[str, float]:
    """What the error does to real traffic: its energy and its dead zone.

    Args:
        model: The model.
        blocks: Blocks ``[rows, dim]`` of real traffic (finite).

    Returns:
        ``rel_mse``: ``sum (x' - x)^2 / sum x^2``; ``max_rel_row``: the largest error relative
        to its row's max magnitude; ``zeroed``: share of nonzero values decoded as exactly 0;
        ``row_to_range``: the median row's max magnitude over its block's range (a property of
        the traffic: how loose a block-range bound is for a typical row).
    """
    gen = torch.Generator().manual_seed(0)
    err2 = sig2 = zeroed = nonzero = 0.0
    max_rel_row = 0.0
    ratios = []
    for b in blocks:
        y = model(b, gen).double()
        x = b.double()
        err2 += float(((y - x) ** 2).sum())
        sig2 += float((x**2).sum())
        zeroed += float(((y == 0) & (x != 0)).sum())
        nonzero += float((x != 0).sum())
        row = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        max_rel_row = max(max_rel_row, float(((y - x).abs() / row).max()))
        ratios.append(float(row.median() / _block_range(x).clamp_min(1e-300).squeeze()))
    return {
        "rel_mse": err2 / max(sig2, 1e-300),
        "max_rel_row": max_rel_row,
        "zeroed": zeroed / max(nonzero, 1.0),
        "row_to_range": float(torch.tensor(ratios).median()) if ratios else math.nan,
    }
