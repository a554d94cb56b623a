"""Tests of the planner config: the shipped YAML files, validation errors and documentation."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from torchrec_lossy.cardinalities import CRITEO_1TB_CARDINALITIES, CRITEO_KAGGLE_CARDINALITIES
from torchrec_lossy.config import (
    ConfigError,
    LossyPlanConfig,
    from_dict,
    load_yaml,
    save_yaml,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.mark.parametrize(
    ("name", "cards", "dim"),
    [
        ("criteo_1tb.yaml", CRITEO_1TB_CARDINALITIES, 128),
        ("criteo_kaggle.yaml", CRITEO_KAGGLE_CARDINALITIES, 32),
    ],
)
def test_shipped_criteo_configs_have_the_real_table_sizes(
    name: str, cards: tuple[int, ...], dim: int
) -> None:
    config = load_yaml(LossyPlanConfig, CONFIGS / name)
    tables = config.embedding_tables
    assert [t.num_embeddings for t in tables] == list(cards)
    assert {t.embedding_dim for t in tables} == {dim}
    assert [t.name for t in tables] == [f"t_cat_{i}" for i in range(26)]
    assert [t.feature_names for t in tables] == [(f"cat_{i}",) for i in range(26)]
    assert config.comms.homogenization.enabled
    assert config.comms.schedule.kind == "step"


def test_example_config_sets_every_key() -> None:
    with open(CONFIGS / "example.yaml") as f:
        raw = yaml.safe_load(f)
    config = from_dict(LossyPlanConfig, raw)
    assert config.comms.table("t_cat_5").compress is False
    assert config.comms.table("t_cat_17").bound.value == 0.02
    assert config.planner.ratio("t_cat_23") == 25.0

    def keys(cls: type, data: dict[str, Any], where: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name in data, f"example.yaml lacks {where}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                keys(hints[f.name], data[f.name], f"{where}{f.name}.")

    keys(LossyPlanConfig, raw, "")


def test_round_trip(tmp_path: Path) -> None:
    config = load_yaml(LossyPlanConfig, CONFIGS / "example.yaml")
    save_yaml(config, tmp_path / "c.yaml")
    assert load_yaml(LossyPlanConfig, tmp_path / "c.yaml") == config
    assert from_dict(LossyPlanConfig, to_dict(config)) == config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # Unknown keys, at any depth.
        ({"planer": {}}, "unknown key(s) planer: allowed keys are comms, embedding_tables"),
        (
            {"comms": {"homogenization": {"treshold": [0.1, 0.2]}}},
            "unknown key(s) comms.homogenization.treshold",
        ),
        ({"embedding_tables": [{"name": "a", "rows": 3}]}, "embedding_tables[0].rows"),
        # Wrong types.
        (
            {"topology": {"world_size": "16"}},
            "topology.world_size='16' is invalid: allowed an integer",
        ),
        (
            {"planner": {"data_parallel": "yes"}},
            "planner.data_parallel='yes' is invalid: allowed true",
        ),
        (
            {"planner": {"table_ratios": [1, 2]}},
            "planner.table_ratios=[1, 2] is invalid: allowed a mapping",
        ),
        (
            {"embedding_tables": {"name": "a"}},
            "embedding_tables={'name': 'a'} is invalid: allowed a list",
        ),
        # Out of range.
        (
            {"planner": {"expected_ratio": 0.1}},
            "planner.expected_ratio=0.1 is invalid: allowed [0.5, 10000]",
        ),
        (
            {"planner": {"table_ratios": {"t_*": 1e9}}},
            "planner.table_ratios.t_*=1000000000.0 is invalid: allowed [0.5, 10000]",
        ),
        (
            {"planner": {"encode_gib_s": -1}},
            "planner.encode_gib_s=-1.0 is invalid: allowed a number in (0, 1e+06] or null",
        ),
        (
            {"planner": {"global_batch_size": 0}},
            "planner.global_batch_size=0 is invalid: allowed null or an integer in [1, 1073741824]",
        ),
        (
            {"topology": {"world_size": 16, "local_world_size": 5}},
            "topology.local_world_size=5 is invalid: allowed null or a divisor of world_size=16",
        ),
        (
            {"topology": {"compute_device": "tpu"}},
            "topology.compute_device='tpu' is invalid: allowed one of 'cuda', 'cpu'",
        ),
        (
            {"embedding_tables": [{"name": "a", "num_embeddings": 0, "embedding_dim": 4}]},
            "table 'a': num_embeddings=0 is invalid: allowed an integer in [1, 2**40]",
        ),
        (
            {"embedding_tables": [{"name": "a", "num_embeddings": 1, "embedding_dim": 4}] * 2},
            "embedding_tables=['a'] is invalid: allowed unique table names",
        ),
        (
            {"comms": {"homogenization": {"thresholds": [0.8, 0.3]}}},
            "homogenization.thresholds=(0.8, 0.3) is invalid: allowed (low, high) with 0 <= low",
        ),
        (
            {"comms": {"homogenization": {"sample_rows": 8}}},
            "homogenization.sample_rows=8 is invalid: allowed an integer in [16, 1048576]",
        ),
        (
            {"comms": {"homogenization": {"smoothing": 0}}},
            "homogenization.smoothing=0.0 is invalid: allowed (0, 1]",
        ),
        (
            {"comms": {"homogenization": {"warmup_windows": 0}}},
            "homogenization.warmup_windows=0 is invalid: allowed an integer in [1, 1048576]",
        ),
        (  # the modes are BoundKind's names: a new kind is accepted without another list
            {"comms": {"default_bound": {"mode": "rel"}}},
            "bound.mode='rel' is invalid: allowed one of 'absolute', 'relative', 'value'",
        ),
        (
            {"comms": {"schedule": {"kind": "cosine"}}},
            "schedule.kind='cosine' is invalid: allowed one of 'step', 'linear', 'log', 'constant'",
        ),
    ],
)
def test_validation_errors_name_key_value_and_range(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(LossyPlanConfig, data)
    assert message in str(e.value)


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"c\.yaml='list' is invalid: allowed a mapping"):
        load_yaml(LossyPlanConfig, path)


def _all_fields(cls: type, seen: set[type]) -> set[str]:
    """Field names of a config dataclass and of every config dataclass inside it."""
    if cls in seen:
        return set()
    seen.add(cls)
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        tp = typing.get_type_hints(cls)[f.name]
        for arg in (
            tp,
            *typing.get_args(tp),
            *(a for t in typing.get_args(tp) for a in typing.get_args(t)),
        ):
            if dataclasses.is_dataclass(arg):
                names |= _all_fields(arg, seen)
    return names


def test_docs_document_every_key() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", text))
    missing = sorted(_all_fields(LossyPlanConfig, set()) - documented)
    assert not missing, f"docs/config.md does not document {missing}"
