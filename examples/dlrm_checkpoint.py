"""Checkpoints of the DLRM example: DCP for the sharded model and optimizer, a file per rank.

A run with ``--checkpoint-dir`` resumes from the newest complete checkpoint there, so a job
restarted by ``torchrun --max-restarts N`` continues where it stopped and ends bit-identical to
an uninterrupted run (the synthetic stream is indexed by step, files are skipped to the saved
position, and the bound providers' and the guard's state is restored per rank). The speeds
the first attempt planned from are saved beside the checkpoints, so every restart plans alike.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from dlrm_data import Position
from dlrm_env import DistEnv
from torch import nn

from torchrec_lossy.distributed import (
    bounds_state,
    check_lossy_decodes,
    guard_state,
    load_bounds_state,
    load_guard_state,
)
from torchrec_lossy.planner.speeds import Speeds

__all__ = ["Checkpointer", "Resumed", "simulate_failure"]


class Resumed(NamedTuple):
    """Where a resumed run continues.

    Attributes:
        step: Training steps done.
        position: This rank's data position after them.
        path: The checkpoint folder.
        recent_losses: This rank's training losses of the last steps before the checkpoint
            (the window the final ``train_loss`` averages), so that the figure of a resumed run
            is the uninterrupted run's.
    """

    step: int
    position: Position
    path: Path
    recent_losses: list[float]


class Checkpointer:
    """Saves and restores the run: model and optimizer through ``torch.distributed.checkpoint``
    (sharded tensors stay sharded), plus one small file per rank with the step counter, the data
    position and the bound providers' state (each rank's adaptive state is its own, so it is not
    left to DCP, which keeps one copy of a replicated buffer).

    A checkpoint ``step_NNNNNNNN/`` counts once its ``COMPLETE`` marker exists; the two newest
    are kept.

    Args:
        root: Checkpoint folder.
        env: This process's placement.
        comm: The ``--comm`` mode (a checkpoint only resumes the same mode).
    """

    KEEP = 2
    # The speeds the first attempt planned with (``planned_speeds``), beside the checkpoints.
    SPEEDS = "plan_speeds.json"

    def __init__(self, root: str | Path, env: DistEnv, comm: str) -> None:
        self.root = Path(root)
        self.env = env
        self.comm = comm
        # The run's format re-check (``RuntimeRecheck``), saved and restored with the step.
        self.recheck: Any = None

    def planned_speeds(self, measure: Callable[[], Speeds]) -> Speeds:
        """The speeds this run plans with: the ones saved by an earlier attempt, else measured
        now and saved (collective: every rank calls it).

        ``comms.format: auto`` plans from measured speeds, and a restarted job measuring anew
        could plan another sharding (a table data-parallel instead of table-wise) than the one
        its checkpoint holds, which it then could not load. Rank 0 decides and broadcasts, so
        every rank takes the same figures.

        Args:
            measure: Measures (and agrees across ranks) the speeds; called on every rank or
                on none.

        Returns:
            The speeds to plan with.
        """
        path = self.root / self.SPEEDS
        saved = [path.read_text() if self.env.rank == 0 and path.is_file() else None]
        dist.broadcast_object_list(saved, src=0)
        if saved[0] is not None:
            speeds = Speeds.from_dict(json.loads(saved[0]))
            return replace(speeds, source=f"{speeds.source}; saved in {path} by the first attempt")
        speeds = measure()
        if self.env.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(speeds.to_dict(), indent=1))
            tmp.replace(path)  # whole or absent, should the job die here
        return speeds

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p for p in self.root.glob("step_*") if p.is_dir() and (p / "COMPLETE").is_file()
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self._complete()
        return done[-1] if done else None

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Path:
        """Writes a checkpoint (collective: every rank calls it).

        Args:
            step: Training steps done.
            model: The DMP model.
            optimizer: The combined optimizer.
            extra: This rank's small state (positions, bound providers, ...).

        Returns:
            The checkpoint folder.
        """
        import torch.distributed.checkpoint as dcp

        path = self.root / f"step_{step:08d}"
        if self.env.rank == 0 and path.exists():
            shutil.rmtree(path)  # a partial one from a run that died while writing it
        dist.barrier()
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
        torch.save(extra, path / f"rank{self.env.rank}.pt")
        dist.barrier()
        if self.env.rank == 0:
            meta = f"step={step}\nworld_size={self.env.world_size}\ncomm={self.comm}\n"
            (path / "COMPLETE").write_text(meta)
            for old in self._complete()[: -self.KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load(self, path: Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """Restores model, optimizer and this rank's extra state from a checkpoint.

        Args:
            path: A complete checkpoint folder.
            model: The DMP model (same plan and world size as when saved).
            optimizer: The combined optimizer.

        Returns:
            This rank's extra state.
        """
        import torch.distributed.checkpoint as dcp

        meta = dict(
            line.split("=", 1) for line in (path / "COMPLETE").read_text().split() if "=" in line
        )
        if int(meta.get("world_size", -1)) != self.env.world_size or meta.get("comm") != self.comm:
            raise RuntimeError(
                f"checkpoint {path} was written with world_size={meta.get('world_size')} and "
                f"--comm {meta.get('comm')}; this run has world_size={self.env.world_size} and "
                f"--comm {self.comm}. Resume with the same settings or use another "
                "--checkpoint-dir"
            )
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        try:
            dcp.load(state, checkpoint_id=path)
        except Exception as e:  # DCP's own error is a traceback per rank around "Missing key"
            raise RuntimeError(
                f"checkpoint {path} does not fit this run's model and optimizer ({e!s:.300}): "
                "it was written under another sharding plan or model. Resume with the flags and "
                "config that wrote it, or use another --checkpoint-dir"
            ) from e
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        extra = torch.load(path / f"rank{self.env.rank}.pt", weights_only=True)
        load_bounds_state(model, extra.get("bounds", {}))
        load_guard_state(model, extra.get("guard", {}))  # the tightened bounds resume
        return extra

    def save_step(
        self,
        step: int,
        position: Position,
        model: nn.Module,
        optimizer: Any,
        recent_losses: Sequence[float] = (),
    ) -> Path:
        """Writes the checkpoint of a training step (collective: every rank calls it).

        Args:
            step: Training steps done.
            position: This rank's data position after them.
            model: The DMP model.
            optimizer: The combined optimizer.
            recent_losses: This rank's losses of the last steps (the final train-loss window).

        Returns:
            The checkpoint folder.
        """
        check_lossy_decodes(model)  # never checkpoint past an unreported corrupt payload
        extra = {
            "step": step,
            "position": list(position),
            "bounds": bounds_state(model),
            "guard": guard_state(model),
            "recent_losses": [float(v) for v in recent_losses],
        }
        if self.recheck is not None:  # the run's format choice and its pending streak
            extra["recheck"] = self.recheck.state_dict()
        return self.save(step, model, optimizer, extra)

    def resume(self, model: nn.Module, optimizer: Any) -> Resumed | None:
        """Loads the newest complete checkpoint, if there is one.

        Args:
            model: The DMP model.
            optimizer: The combined optimizer.

        Returns:
            Where the run continues, or None.
        """
        path = self.latest()
        if path is None:
            return None
        extra = self.load(path, model, optimizer)
        step = int(extra["step"])
        if self.env.rank == 0:
            print(f"resumed from {path} at step {step}", flush=True)
        position = (int(extra["position"][0]), int(extra["position"][1]))
        if self.recheck is not None and "recheck" in extra:  # re-applies the saved choice
            self.recheck.load_state_dict(extra["recheck"])
        # A checkpoint of an older run has no losses: the window then restarts empty.
        return Resumed(step, position, path, list(extra.get("recent_losses", [])))


def simulate_failure(env: DistEnv, step: int) -> None:
    """``--simulate-failure-at``: the last rank exits (code 17) on torchrun's first attempt.

    A restarted job (``torchrun --max-restarts N``) then resumes from the newest checkpoint;
    later attempts do not fail again.

    Args:
        env: This process's placement.
        step: The step just finished.
    """
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and env.rank == env.world_size - 1:
        print(f"rank {env.rank}: simulated failure after step {step}", flush=True)
        os._exit(17)
