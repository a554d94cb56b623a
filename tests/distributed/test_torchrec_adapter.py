"""The TorchRec adapter: the one module that touches TorchRec's private attributes.

1. On the installed TorchRec, every attribute the adapter replaces is where it expects it
   (a one-rank gloo group, no worker processes), and a TorchRec that moved one fails with a
   message naming the class and the attribute.
2. No other module of the package assigns a private attribute TorchRec defines (``self._x``
   in a subclass of a TorchRec class), assigns a private attribute of another object, or
   overrides a private method of a TorchRec base class.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec")

from torchrec.distributed.dist_data import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.grid_sharding import GridPooledEmbeddingDist
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist

from torchrec_lossy.distributed import torchrec_adapter as adapter

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrec_lossy"
ADAPTER = PACKAGE / "distributed" / "torchrec_adapter.py"


@pytest.fixture
def pg() -> Iterator[torch.distributed.ProcessGroup]:
    """A one-rank gloo group (TorchRec's dists only read its size and rank here)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Marker(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner


def _two_hop(pg: torch.distributed.ProcessGroup, cls: type) -> nn.Module:
    kwargs = {"callbacks": [torch.neg]} if cls is GridPooledEmbeddingDist else {}
    return cls(
        rank=0,
        cross_pg=pg,
        intra_pg=pg,
        dim_sum_per_node=[4],
        emb_dim_per_node_per_feature=[[4]],
        **kwargs,
    )


def test_rw_input_dist_keeps_its_kjt_all_to_all_where_the_adapter_replaces_it(pg) -> None:
    sparse = RwSparseFeaturesDist(pg=pg, num_features=2, feature_hash_sizes=[10, 10])
    assert type(adapter.kjt_all_to_all(sparse)) is KJTAllToAll
    # TorchRec's forward calls it there, so the replacement is what runs.
    assert "self._dist(" in inspect.getsource(inspect.unwrap(RwSparseFeaturesDist.forward))
    mine = KJTAllToAll(pg, [2])
    adapter.replace_kjt_all_to_all(sparse, mine)
    assert adapter.kjt_all_to_all(sparse) is mine


@pytest.mark.parametrize("cls", [TwRwPooledEmbeddingDist, GridPooledEmbeddingDist])
def test_two_hop_dists_create_the_cross_host_all_to_all_the_adapter_replaces(pg, cls) -> None:
    two_hop = _two_hop(pg, cls)
    built: list[nn.Module] = []

    def cross() -> nn.Module:
        built.append(_Marker())
        return built[-1]

    vbe = EmbeddingShardingContext(variable_batch_per_feature=cls is TwRwPooledEmbeddingDist)
    adapter.install_cross_host_dists(two_hop, vbe, cross, _Marker)
    assert two_hop._cross_dist is built[0]
    assert isinstance(two_hop._intra_dist, PooledEmbeddingsReduceScatter)
    if cls is TwRwPooledEmbeddingDist:  # the VBE hop wraps the same lossy all-to-all
        assert isinstance(two_hop._variable_cross_dist, _Marker)
        assert two_hop._variable_cross_dist.inner is built[0]
    adapter.install_cross_host_dists(two_hop, vbe, cross, _Marker)
    assert len(built) == 1, "the collectives are created once, as TorchRec's forward does"
    assert "self._cross_dist)(" in inspect.getsource(inspect.unwrap(cls.forward))
    group, device = adapter.cross_host_group(two_hop)
    assert group is pg and device is None
    want = [torch.neg] if cls is GridPooledEmbeddingDist else None
    assert adapter.cross_host_callbacks(two_hop) == want


def test_the_enumerator_caches_the_search_space_where_the_adapter_forgets_it() -> None:
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import Topology

    enumerator = EmbeddingEnumerator(Topology(world_size=1, compute_device="cpu"), batch_size=8)
    enumerator._last_stored_module = nn.Linear(1, 1)
    adapter.forget_search_space(enumerator)
    assert enumerator._last_stored_module is None
    assert "self._last_stored_module == module" in inspect.getsource(EmbeddingEnumerator.enumerate)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_sharded_modules_keep_their_env_and_fqn_where_the_adapter_reads_them(pg, kind) -> None:
    """``step_lossy_bounds`` (the guard's all-reduce) and ``lossy_stats`` read a sharded
    module's process group and FQN through the adapter; TorchRec sets both in ``__init__``."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.types import ShardingEnv

    cls = ShardedEmbeddingBagCollection if kind == "ebc" else ShardedEmbeddingCollection
    source = inspect.getsource(cls.__init__)
    assert "self._env = env" in source and "self._module_fqn = module_fqn" in source
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m._env, m._module_fqn = ShardingEnv(world_size=1, rank=0, pg=pg), "model.ebc"
    assert adapter.module_process_group(m) is pg and adapter.module_fqn(m) == "model.ebc"
    del m._env
    with pytest.raises(adapter.TorchRecLayoutError, match=rf"{cls.__name__} has no .*'_env'"):
        adapter.module_process_group(m)
    m._module_fqn = 3
    with pytest.raises(adapter.TorchRecLayoutError, match=r"_module_fqn is a int, expected str"):
        adapter.module_fqn(m)


def test_a_moved_kjt_all_to_all_fails_naming_the_attribute(pg) -> None:
    sparse = RwSparseFeaturesDist(pg=pg, num_features=2, feature_hash_sizes=[10, 10])
    del sparse._dist
    with pytest.raises(adapter.TorchRecLayoutError, match=r"RwSparseFeaturesDist has no .*'_dist'"):
        adapter.replace_kjt_all_to_all(sparse, KJTAllToAll(pg, [2]))
    sparse._dist = nn.Identity()
    with pytest.raises(
        adapter.TorchRecLayoutError,
        match=r"RwSparseFeaturesDist\._dist is a Identity, expected KJT",
    ):
        adapter.kjt_all_to_all(sparse)


def test_a_two_hop_dist_creating_another_collective_fails_naming_it(pg, monkeypatch) -> None:
    two_hop = _two_hop(pg, TwRwPooledEmbeddingDist)

    def create(self: TwRwPooledEmbeddingDist, ctx: object = None) -> None:
        self._intra_dist = PooledEmbeddingsReduceScatter(pg=pg)
        self._cross_dist = nn.Identity()  # not the PooledEmbeddingsAllToAll it replaces

    monkeypatch.setattr(TwRwPooledEmbeddingDist, "_create_output_dist_modules", create)
    with pytest.raises(adapter.TorchRecLayoutError, match=r"_cross_dist is a Identity.*AllToAll"):
        adapter.install_cross_host_dists(two_hop, None, _Marker, _Marker)
    with pytest.raises(adapter.TorchRecLayoutError, match="expected PooledEmbeddingsAllToAll"):
        adapter.expect_attribute(two_hop, "_cross_dist", PooledEmbeddingsAllToAll)


# ---------------------------------------------------------------------------------------------
# No private writes into TorchRec outside the adapter.


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _assigned_attributes(tree: ast.AST) -> Iterator[tuple[ast.stmt, ast.Attribute]]:
    """(statement, attribute) of every private attribute an assignment in ``tree`` writes."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and _private(sub.attr):
                    yield node, sub  # type: ignore[misc]


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_writes(source: str) -> set[str]:
    """Private names assigned as ``self._x`` (also augmented and annotated) in ``source``."""
    tree = ast.parse(textwrap.dedent(source))
    return {a.attr for _, a in _assigned_attributes(tree) if _is_self(a.value)}


def _torchrec_privates(cls: type) -> tuple[set[str], set[str]]:
    """(attributes, methods) TorchRec's classes in ``cls``'s MRO define with a private name."""
    attrs: set[str] = set()
    methods: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("torchrec."):
            continue
        # An abstract private method (``Awaitable._wait_impl``) is TorchRec's extension point.
        methods |= {
            n
            for n, v in vars(base).items()
            if _private(n) and callable(v) and not getattr(v, "__isabstractmethod__", False)
        }
        try:
            attrs |= _self_writes(inspect.getsource(base))
        except (OSError, TypeError):
            continue
    return attrs, methods


def private_writes_into_torchrec(classes: list[type]) -> list[str]:
    """Each private attribute TorchRec defines that one of ``classes`` (or a class of this
    project it inherits code from) assigns, and each private TorchRec method it overrides.

    Args:
        classes: Classes of this project.

    Returns:
        ``"module.Class: self._x = ..."`` / ``"module.Class: def _x"`` lines.
    """
    found: list[str] = []
    for cls in classes:
        attrs, methods = _torchrec_privates(cls)
        if not attrs and not methods:
            continue
        for own in cls.__mro__:
            if own.__module__.startswith("torchrec.") or own.__module__ in ("builtins", "typing"):
                continue
            try:
                source = inspect.getsource(own)
            except (OSError, TypeError):
                continue
            where = f"{own.__module__}.{own.__qualname__}"
            found += [f"{where}: self.{a} = ..." for a in sorted(_self_writes(source) & attrs)]
            found += [f"{where}: def {m}" for m in sorted(set(vars(own)) & methods)]
    return sorted(set(found))


def foreign_private_writes(rel: str, source: str) -> list[str]:
    """Assignments to a private attribute of an object other than ``self`` (``obj._x = ...``,
    ``setattr(obj, "_x", ...)``) in a file.

    Args:
        rel: The file's path (for the message).
        source: Its text.

    Returns:
        ``"file:line: ..."`` lines.
    """
    tree = ast.parse(source)
    found = [
        f"{rel}:{stmt.lineno}: {ast.unparse(a)} = ..."
        for stmt, a in _assigned_attributes(tree)
        if not _is_self(a.value)
    ]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{rel}:{node.lineno}: setattr(..., {node.args[1].value!r}, ...)")
    return found


def _package_classes() -> list[type]:
    """Every class defined at module level in the package's modules that import TorchRec."""
    classes: list[type] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ADAPTER or "torchrec." not in path.read_text():
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        module = importlib.import_module(name)
        classes += [
            v
            for v in vars(module).values()
            if isinstance(v, type) and v.__module__ == module.__name__
        ]
    return classes


def test_no_module_but_the_adapter_writes_a_torchrec_private_attribute() -> None:
    classes = _package_classes()
    assert any(c.__name__ == "LossyRwSparseFeaturesDist" for c in classes), "scan found no dists"
    found = private_writes_into_torchrec(classes)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != ADAPTER:
            found += foreign_private_writes(str(path.relative_to(ROOT)), path.read_text())
    assert not found, (
        "writes into TorchRec's private attributes outside distributed/torchrec_adapter.py "
        "(use TorchRec's public constructors and hooks, or add one checked function to the "
        "adapter):\n" + "\n".join(found)
    )


_PROBE = """
import torch
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist


class Mixin:
    def _create_output_dist_modules(self, ctx=None):
        super()._create_output_dist_modules(ctx)
        self._cross_dist = torch.nn.Identity()


class Probe(Mixin, TwRwPooledEmbeddingDist):
    pass


class Replacer(RwSparseFeaturesDist):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._dist = None
        self._mine = 1


def swap(dist, other):
    dist._dist = other
    setattr(dist, "_cross_dist", other)
"""


def test_the_scan_finds_each_kind_of_private_write(tmp_path, monkeypatch) -> None:
    """The scan is not vacuous: the seam's old writes (RW's ``_dist`` after ``__init__``, the
    two-hop dists' ``_create_output_dist_modules`` override) are found; a private attribute of
    the project's own is not."""
    (tmp_path / "adapter_probe.py").write_text(_PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec("adapter_probe")
    assert spec is not None
    probe = importlib.import_module("adapter_probe")
    try:
        found = private_writes_into_torchrec([probe.Probe, probe.Replacer])
        assert found == [
            "adapter_probe.Mixin: def _create_output_dist_modules",
            "adapter_probe.Mixin: self._cross_dist = ...",
            "adapter_probe.Replacer: self._dist = ...",
        ]
        foreign = foreign_private_writes("probe.py", _PROBE)
        assert [f.split(": ", 1)[1] for f in foreign] == [
            "dist._dist = ...",
            "setattr(..., '_cross_dist', ...)",
        ]
    finally:
        sys.modules.pop("adapter_probe", None)
