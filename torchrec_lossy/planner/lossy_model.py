"""This project's sharder as a comms model: the format of each table and link class.

:class:`LossyCommsModel` prices what the lossy sharder sends and resolves ``comms.format:
auto`` into the config the sharder runs (:meth:`LossyCommsModel.resolved_comms`), with the
estimate of :mod:`~torchrec_lossy.planner.formats` and the speeds of
:mod:`~torchrec_lossy.planner.speeds`: the plan, the preview and the run use one decision.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping, Sequence

from torchrec_lossy.config import (
    CAST_FORMATS,
    CODEC_FORMATS,
    LossyCommsConfig,
    LossyPlanConfig,
    TableCodecConfig,
)
from torchrec_lossy.planner.cost import (
    BACKENDS,
    CODEC_THROUGHPUT_GIB_S,
    QCOMM_THROUGHPUT_GIB_S,
    RAW,
    Links,
    TableComms,
    WireFormat,
)
from torchrec_lossy.planner.formats import (
    CANDIDATES,
    FormatChoice,
    admits,
    bandwidth_gib_s,
    choose_format,
    ms_per_byte,
)
from torchrec_lossy.planner.speeds import Speeds, default_speeds

__all__ = ["LossyCommsModel"]


class LossyCommsModel:
    """This project's sharder: per table and link class the format ``comms.format`` gives.

    A table's format is its own ``format`` (or ``compress: false``: raw), else
    ``comms.format``. ``entropy``: the codec at the table's expected ratio (calibrated, else
    ``planner.table_ratios``, else the entropy format's ratio measured with the speeds, else
    ``planner.expected_ratio``), row-wise too (its partial sums by
    the coded all-to-all), and on the cross-host hop of TWRW and grid (their intra-host
    reduce-scatter stays raw). ``raw``: fp32, as TorchRec. ``fp16`` / ``bf16``: each block cast
    where its bound admits it (the seam checks every block), at the casts' measured speeds.
    ``auto`` (the default): the admissible format of least estimated forward + gradient time
    per raw byte on the link (:func:`~torchrec_lossy.planner.formats.choose_format`): per table
    on the cross-host link
    (on one host, the intra-host one), and once for all tables on the same-host link of a
    multi-host cluster (it resolves ``comms.intra_host`` when that is ``auto``). The codec's
    speeds: ``planner.encode_gib_s`` / ``decode_gib_s`` where set (pinned), else ``speeds``
    (measured, :mod:`~torchrec_lossy.planner.speeds`), else the device defaults. The rank's own
    block is never coded. :meth:`resolved_comms` is the config the sharder runs, so the plan,
    the preview and the run agree.

    The backward is priced with the table's format: the codec at the table's expected backward
    ratio (calibrated, else ``planner.backward_ratio``, against TorchRec's dense fp32 gradient)
    when ``comms.backward`` is ``"lossy"``, the configured cast or exact otherwise; a raw table's
    gradient travels raw.

    Args:
        config: The plan config.
        a2a_bandwidth: All-to-all bandwidth of the topology in bytes/ms.
        ratios: Calibrated forward ratios by table name (take precedence over the config).
        backward_ratios: Calibrated backward ratios by table name (likewise).
        links: The topology's intra- and inter-host bandwidths; None: both ``a2a_bandwidth``.
        speeds: Measured format speeds; None: the device defaults (``planner`` keys pin them).
    """

    name = "lossy"

    def __init__(
        self,
        config: LossyPlanConfig,
        a2a_bandwidth: float,
        ratios: Mapping[str, float] | None = None,
        backward_ratios: Mapping[str, float] | None = None,
        links: Links | None = None,
        speeds: Speeds | None = None,
    ) -> None:
        self.config = config
        self.a2a_bandwidth = a2a_bandwidth
        self.links = links or Links(a2a_bandwidth, a2a_bandwidth)
        self.ratios: dict[str, float] = dict(ratios or {})
        self.backward_ratios: dict[str, float] = dict(backward_ratios or {})
        device = config.topology.compute_device
        p = config.planner
        pinned = p.encode_gib_s is not None or p.decode_gib_s is not None
        self.speeds = speeds or default_speeds(device, "no measurement")
        comms = config.comms
        # The seam sends one row per distinct bag before any format (input_dist's exact
        # dedupe): raw and coded tables alike carry and code only the measured distinct rows.
        exact = comms.input_dist.dedupe_outputs or comms.input_dist.dedupe_lookups
        self.dedupe_ratio = self.speeds.ratios.get("dedupe", 1.0) if exact else 1.0
        self.codec_format = self._codec_candidates()[0]  # the run's, until _pick_codec_format
        if pinned:  # the pins are the codec's, in whichever format it runs
            pins = {}
            for f in self._codec_candidates():
                enc, dec = self.speeds.formats.get(f, CODEC_THROUGHPUT_GIB_S[device])
                pins[f] = (
                    p.encode_gib_s if p.encode_gib_s is not None else enc,
                    p.decode_gib_s if p.decode_gib_s is not None else dec,
                )
            self.speeds = dataclasses.replace(
                self.speeds,
                formats={**self.speeds.formats, **pins},
                source=self.speeds.source + "; codec pinned by planner.encode/decode_gib_s",
            )
        bwd_kind = comms.backward
        if bwd_kind == "lossy":
            self._bwd: WireFormat = self._codec_wire(self.codec_format, p.backward_ratio)
        elif bwd_kind in ("fp16", "bf16"):
            enc_q, dec_q = self.speeds.formats.get(
                bwd_kind, QCOMM_THROUGHPUT_GIB_S[(device, bwd_kind)]
            )
            self._bwd = WireFormat(bwd_kind, 2.0, enc_q, dec_q)
        else:
            self._bwd = RAW
        topo = config.topology
        self.one_host = topo.local_world_size in (None, topo.world_size)
        self.codec_format = self._pick_codec_format()
        if bwd_kind == "lossy":
            self._bwd = self._codec_wire(self.codec_format, p.backward_ratio)
        self.same_host_raw, self._same_host_why = self._same_host_choice()
        same_host = "same-host peers raw" if self.same_host_raw else "same-host peers coded"
        if self.one_host and comms.format == "auto" and comms.intra_host == "auto":
            same_host = "every peer on this host, format per table"
        self.description = (
            f"torchrec-lossy: forward format {comms.format} (codec format "
            f"{self.codec_format}; {comms.default_bound.mode} "
            f"{comms.default_bound.value:g} default bound), backward {bwd_kind}; {same_host} "
            f"(comms.intra_host={comms.intra_host}); speeds: {self.speeds.describe()}"
        )
        self.torchrec_path = False  # table_format's auto picks, until decided
        self.torchrec_path, torchrec_why = self._torchrec_path()
        self.pays_note = self._choice_note() + torchrec_why

    @property
    def encode_gib_s(self) -> float:
        """The codec's encode throughput in the run's codec format, GiB/s."""
        return self._codec_wire(self.codec_format, 1.0).encode_gib_s or math.inf

    @property
    def decode_gib_s(self) -> float:
        """The codec's decode throughput in the run's codec format, GiB/s."""
        return self._codec_wire(self.codec_format, 1.0).decode_gib_s or math.inf

    def _codec_candidates(self) -> list[str]:
        """The codec formats ``auto`` may run: the one the config names (``format`` or a
        table's, or ``codec.format: packed``), else those with speeds (both by default)."""
        comms = self.config.comms
        named = {comms.format} | {t.format for t in comms.tables.values() if t.format}
        named &= CODEC_FORMATS
        if named:
            return sorted(named)
        if comms.codec.format == "packed":
            return ["packed"]
        return [f for f in sorted(CODEC_FORMATS) if f in self.speeds.formats] or ["entropy"]

    def _codec_wire(self, codec_format: str, ratio: float) -> WireFormat:
        """The codec in ``codec_format`` for a table whose entropy-format ratio is ``ratio``."""
        device = self.config.topology.compute_device
        enc, dec = self.speeds.formats.get(codec_format, CODEC_THROUGHPUT_GIB_S[device])
        d = self.dedupe_ratio  # the codec sees the distinct rows only: per raw byte, d x faster
        return WireFormat("lossy", ratio * self.speeds.ratio_factor(codec_format), enc * d, dec * d)

    def _pick_codec_format(self) -> str:
        """The run's one codec format (a codec call carries every coded table of a
        destination): of the candidates, the one whose auto tables, each raw or coded
        whichever is faster, take the least estimated time, weighted by the tables' dims."""
        candidates = self._codec_candidates()
        tables = self.config.embedding_tables
        if len(candidates) == 1 or not tables:
            return candidates[0]
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        total = dict.fromkeys(candidates, 0.0)
        for t in tables:
            for f in candidates:
                total[f] += t.embedding_dim * min(
                    self._choice(self.ratio(t.name), t.name, bw, f).estimates.values()
                )
        return min(candidates, key=lambda f: (total[f], f != "entropy"))

    def _torchrec_path(self) -> tuple[bool, str]:
        """Whether the run should take TorchRec's own all-to-all instead of this seam, and why.

        The seam saves wire time (its exact dedupe and the codec send fewer bytes) at a cost
        TorchRec's path does not have. Measured (``speeds.seam_ms``: the seam's fixed work per
        step, :mod:`~torchrec_lossy.planner.seam_cost`): the seam's estimated step, each table
        in its format on the link (wire and codec per raw byte, weighted by the table's share
        of the rows' bytes) plus that fixed cost and its exchange's (``speeds.exchange_ms``),
        against TorchRec's fp32 wire time; the smaller wins, whatever the tables' formats. Not
        measured: only where no table is coded, the dedupe's measured throughput against its
        saved bytes.
        """
        comms, tables = self.config.comms, self.config.embedding_tables
        if comms.format != "auto" or not tables:
            return False, ""
        if not (self.one_host or self.same_host_raw):
            return False, ""
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        torchrec = 2 * ms_per_byte(RAW, bw)  # per raw byte: forward and gradient
        sp = self.speeds
        if sp.seam_ms is not None and sp.rows:
            return self._torchrec_path_measured(bw, torchrec)
        if "dedupe" not in sp.ratios or any(self.table_format(t.name) != "raw" for t in tables):
            return False, ""
        enc, dec = sp.formats["dedupe"]
        dedupe = WireFormat("dedupe", sp.ratios["dedupe"], enc, dec)
        seam = 2 / (dedupe.ratio * bw) + dedupe.codec_ms(1.0)  # a reduce and an expand a step
        pick = torchrec <= seam
        verdict = "TorchRec's own all-to-all" if pick else "the seam raw"
        return pick, (
            f"; no table coded, so {verdict} (exact dedupe at {dedupe.ratio:.2g}x costs "
            f"{seam / torchrec:.2f}x TorchRec's time)"
        )

    def _torchrec_path_measured(self, bw: float, torchrec_per_byte: float) -> tuple[bool, str]:
        """:meth:`_torchrec_path` from the measured fixed cost: step times on the link."""
        sp, topo, tables = self.speeds, self.config.topology, self.config.embedding_tables
        assert sp.seam_ms is not None and sp.rows
        seam_only = CODEC_FORMATS | CAST_FORMATS
        forced = [t.name for t in tables if self.config.comms.table(t.name).format in seam_only]
        if forced:  # a table the config sends coded is not ours to send as TorchRec does
            return False, f"; the seam (tables {forced} are configured coded)"
        world = topo.world_size
        local = world if self.one_host else topo.local_world_size or world
        # What a rank sends over the priced link a direction and step: its rows of every
        # table to the peers there (same-host peers of a multi-host run travel raw either way).
        # A table without feature names pools one feature (TorchRec names it after the table).
        width = {t.name: t.embedding_dim * max(1, len(t.feature_names)) for t in tables}
        dims = sum(width.values())
        peers = (world - 1) if self.one_host else (world - local)
        step_bytes = sp.rows * dims * 4 * peers / world
        per_byte = 0.0
        for t in tables:
            est = self._choice(self.ratio(t.name), t.name, bw).estimates
            per_byte += width[t.name] / dims * est.get(self.table_format(t.name), est["raw"])
        # Its exchange's own fixed cost, forward and gradient: measured on the group against
        # TorchRec's all-to-all (one round each way after a dist's first call, the one-round
        # slots of distributed/exchange_slots.py); not measured: two collective rounds.
        exchange = sp.exchange_ms if sp.exchange_ms is not None else 2 * (sp.round_ms or 0.0)
        fixed = sp.seam_ms + exchange
        seam_ms = step_bytes * per_byte + fixed
        torchrec_ms = step_bytes * torchrec_per_byte
        pick = torchrec_ms <= seam_ms
        verdict = "TorchRec's own all-to-all" if pick else "the seam"
        return pick, (
            f"; so {verdict}: estimated {seam_ms:.3g} ms a step through the seam ({fixed:.3g} "
            f"of it fixed: its work around the wire and its exchange's, measured) against "
            f"{torchrec_ms:.3g} ms of TorchRec's fp32 all-to-all"
        )

    def step_ms(self) -> dict[str, tuple[float, float]]:
        """Estimated wire and codec ms a step on a rank with every table raw or coded, the
        run's re-check's alternatives (:class:`~torchrec_lossy.planner.recheck.RuntimeRecheck`).

        Returns:
            ``{"raw": (wire, 0), codec format: (wire, codec)}`` on the priced link for the
            measured batch (``speeds.rows``); empty where the batch was not measured.
        """
        sp, topo, tables = self.speeds, self.config.topology, self.config.embedding_tables
        if not sp.rows or not tables:
            return {}
        world = topo.world_size
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        peers = (world - 1) if self.one_host else (world - (topo.local_world_size or world))
        out = {}
        for name in ("raw", self.codec_format):
            wire = codec = 0.0
            for t in tables:
                step_bytes = sp.rows * t.embedding_dim * max(1, len(t.feature_names)) * 4
                step_bytes *= peers / world
                if name == "raw":
                    fwd = bwd = WireFormat("raw", self.dedupe_ratio)
                else:
                    fwd = self._codec_wire(name, self.ratio(t.name))
                    bwd = self.backward_format(t.name)
                wire += step_bytes * (1 / (fwd.ratio * bw) + 1 / (bwd.ratio * bw))
                codec += step_bytes * (fwd.codec_ms(1.0) + bwd.codec_ms(1.0))
            out[name] = (wire, codec)
        return out

    def _same_host_choice(self) -> tuple[bool, str]:
        """Whether same-host blocks travel raw, and why (one decision for all tables)."""
        comms = self.config.comms
        if comms.intra_host != "auto":
            return comms.intra_host == "raw", f"comms.intra_host={comms.intra_host}"
        if comms.format != "auto":
            backend = BACKENDS[self.config.topology.compute_device]
            return comms.same_host_raw(backend), f"comms.intra_host=auto on {backend}"
        if self.one_host:  # every peer is same-host: the per-table choice decides
            return False, "one host: per table"
        choice = self._choice(self.default_ratio, None, self.links.intra_bw)
        return choice.name == "raw", choice.reason(bandwidth_gib_s(self.links.intra_bw))

    def _choice(
        self, ratio: float, table: str | None, bandwidth: float, codec_format: str | None = None
    ) -> FormatChoice:
        """The auto pick for a table (None: any table at ``ratio``) on a link: raw or the codec
        in ``codec_format`` (None: the run's)."""
        bound = self.config.comms.table(table).bound if table else self.config.comms.default_bound
        assert bound is not None  # LossyCommsConfig.table() always sets it
        f = codec_format or self.codec_format
        coded = self._codec_wire(f, ratio)
        bwd = self._bwd if self._bwd.name != "lossy" else self.backward_format(table, f)
        raw = WireFormat("raw", self.dedupe_ratio)  # the seam's raw: distinct rows only
        casts = {c: self._cast_wires(c) for c in sorted(CAST_FORMATS)}
        return choose_format({"raw": (raw, raw), f: (coded, bwd), **casts}, bound, bandwidth)

    def _cast_wires(self, cast: str) -> tuple[WireFormat, WireFormat]:
        """A cast table's forward and gradient formats: the cast at its measured speeds (of
        the seam's check and cast, ``speeds``) on the distinct rows; its gradient cast too
        under ``backward: lossy`` where ``backward_bound`` admits the cast (else exact), the
        configured backward otherwise."""
        device = self.config.topology.compute_device
        enc, dec = self.speeds.formats.get(cast, QCOMM_THROUGHPUT_GIB_S[(device, cast)])
        d = self.dedupe_ratio
        fwd = WireFormat(cast, 2.0 * d, enc * d, dec * d)
        comms = self.config.comms
        if self._bwd.name != "lossy":
            return fwd, self._bwd
        if admits(CANDIDATES[cast], comms.backward_bound):
            return fwd, fwd
        return fwd, WireFormat("raw", d)

    def _choice_note(self) -> str:
        """What ``auto`` chose for the plan and why, said once (empty when nothing is auto)."""
        comms = self.config.comms
        auto = [
            t.name for t in self.config.embedding_tables if comms.table(t.name).format == "auto"
        ]
        if comms.format != "auto" and not auto:
            if self.one_host and self.same_host_raw:
                return (
                    "every peer shares the rank's host and travels raw (comms.intra_host "
                    "resolves to raw): no block is coded, no codec time"
                )
            return ""
        link = "intra-host" if self.one_host else "cross-host"
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        r = self.default_ratio
        # Every candidate codec format's estimate, so the line says why this one.
        estimates: dict[str, float] = {}
        for f in self._codec_candidates():
            estimates.update(self._choice(r, None, bw, f).estimates)
        pick = self._choice(r, None, bw).name
        source = "measured" if self.speeds.ratios.get("entropy") else "planner.expected_ratio"
        why = FormatChoice(pick, estimates).reason(bandwidth_gib_s(bw))
        why += f" at ratio {r:.3g}, {source}"
        if auto:
            picks: dict[str, int] = {}
            for n in auto:
                picks[self.table_format(n)] = picks.get(self.table_format(n), 0) + 1
            chosen = ", ".join(f"{f} for {k} table{'s' if k > 1 else ''}" for f, k in picks.items())
        else:  # no tables listed (modules planned later): what every table gets
            chosen = f"{pick} for every table"
        same = ""
        if not self.one_host:
            kind = "raw" if self.same_host_raw else "coded"
            same = f"; same-host peers {kind} ({self._same_host_why})"
        return f"format auto chose on the {link} link: {chosen} ({why}){same}"

    @property
    def default_ratio(self) -> float:
        """The forward ratio of a table with neither a calibrated nor a configured ratio: the
        entropy format's measured on the layout's blocks at start-up (``speeds.ratios``), else
        ``planner.expected_ratio``."""
        return self.speeds.ratios.get("entropy") or self.config.planner.expected_ratio

    def ratio(self, table: str) -> float:
        """The table's expected forward ratio.

        Args:
            table: Table name.

        Returns:
            Calibrated ratio if any, else the config's ``table_ratios`` entry, else
            :attr:`default_ratio` (measured, else ``planner.expected_ratio``).
        """
        if table in self.ratios:
            return self.ratios[table]
        p = self.config.planner
        if any(fnmatch.fnmatchcase(table, pattern) for pattern in p.table_ratios):
            return p.ratio(table)
        return self.default_ratio

    def backward_format(self, table: str | None, codec_format: str | None = None) -> WireFormat:
        """The table's gradient wire format if the table is coded: the codec at its expected
        backward ratio, or the configured cast, or raw.

        Args:
            table: Table name (None: any table, at ``planner.backward_ratio``).
            codec_format: The codec's format; None: the run's.

        Returns:
            Its backward :class:`WireFormat`.
        """
        if self._bwd.name != "lossy":
            return self._bwd
        r = self.config.planner.backward_ratio
        if table is not None:
            r = self.backward_ratios.get(table, r)
        return self._codec_wire(codec_format or self.codec_format, r)

    def table_format(self, table: str) -> str:
        """The format the sharder sends ``table`` in: ``"raw"``, a cast (``"fp16"`` /
        ``"bf16"``) or the run's codec format (``auto`` resolved on the table's link).

        Args:
            table: Table name.

        Returns:
            The resolved format.
        """
        fmt = self.config.comms.table(table).format
        if fmt != "auto":
            return fmt or self.codec_format
        if self.torchrec_path:  # TorchRec's own all-to-all: fp32, every table
            return "raw"
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        return self._choice(self.ratio(table), table, bw).name

    def for_table(self, table: str) -> TableComms:
        """The table's formats under the config (see the class docstring).

        Args:
            table: Table name.

        Returns:
            Its :class:`TableComms`.
        """
        tc = self.config.comms.table(table)
        fmt = self.table_format(table)
        r = self.ratio(table)
        source = "calibrated" if table in self.ratios else "configured"
        if fmt == "raw":
            if tc.format == "auto":
                note = f"sent raw (format auto: raw is faster at ratio {r:.1f}x, {source})"
            else:
                note = "format raw / compress: false in the config"
            return self._per_destination(TableComms(RAW, RAW, note=note, row_wise_all_to_all=True))
        bw = self.links.intra_bw if self.one_host else self.links.inter_bw
        if fmt in CAST_FORMATS:
            fwd, bwd = self._cast_wires(fmt)
            cost = ms_per_byte(fwd, bw) / ms_per_byte(RAW, bw)
            note = f"{fmt} cast where each block's bound admits it, at {cost:.2f} of raw time"
            comms = TableComms(fwd, bwd, note=note, row_wise_all_to_all=True)
            if self.same_host_raw:  # the seam sends raw peers every block exactly
                return dataclasses.replace(
                    comms, fwd_same_host=RAW, bwd_same_host=RAW, own_block_coded=False
                )
            return dataclasses.replace(comms, own_block_coded=False)
        fwd = self._codec_wire(self.codec_format, r)
        cost = ms_per_byte(fwd, bw) / ms_per_byte(RAW, bw)
        note = (
            f"{self.codec_format} at ratio {fwd.ratio:.1f}x ({source}), all-to-all at "
            f"{cost:.2f} of raw time"
        )
        bwd = self.backward_format(table)
        return self._per_destination(TableComms(fwd, bwd, note=note, row_wise_all_to_all=True))

    def resolved_comms(self, tables: Sequence[str]) -> LossyCommsConfig:
        """The comms config the sharder runs: ``auto`` resolved per table and link class.

        Args:
            tables: The tables to resolve (the config's, calibrated and planned ones).

        Returns:
            The config with ``format`` ``"raw"`` / codec-format overrides for the tables whose
            format was ``auto`` (explicit entries first: the first matching pattern wins) and
            ``intra_host`` resolved where it was ``auto``; unchanged when nothing is ``auto``.
        """
        base = self.config.comms
        overrides = {
            n: TableCodecConfig(bound=base.table(n).bound, format=self.table_format(n))  # type: ignore[arg-type]
            for n in dict.fromkeys(tables)
            if base.table(n).format == "auto"
        }
        changes: dict[str, object] = {}
        if overrides:
            # A table's own entry (its bound, no format) is resolved too: its override, which
            # carries that bound, takes the name's place.
            rest = {k: v for k, v in base.tables.items() if k not in overrides}
            changes["tables"] = {**overrides, **rest}
        if base.format == "auto":
            # A table no one listed (resolved nowhere) keeps the codec, as a plain sharder does.
            changes["format"] = self.codec_format
            if base.intra_host == "auto":
                changes["intra_host"] = "raw" if self.same_host_raw else "coded"
        return dataclasses.replace(base, **changes) if changes else base

    def _per_destination(self, comms: TableComms) -> TableComms:
        """Same-host peers raw where the same-host choice is raw (the codec's formats only:
        the fp16/bf16 gradient casts stay casts, as in the sharder); the own block is never
        coded."""
        if not self.same_host_raw:
            return dataclasses.replace(comms, own_block_coded=False)
        bwd_same = RAW if comms.bwd.name == "lossy" else None
        return dataclasses.replace(
            comms, fwd_same_host=RAW, bwd_same_host=bwd_same, own_block_coded=False
        )
