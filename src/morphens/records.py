"""Typed records of a run: one trained net's score, a method's time split, a method's result (a results.json row)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Seconds:
    """Wall-clock and CPU seconds of some work (CPU time is not inflated by other jobs on a shared machine)."""

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(self.wall + other.wall, self.cpu + other.cpu)


@dataclass
class NetScore:
    """One trained net: its test-split softmax and accuracy, and what its training took."""

    probs: torch.Tensor
    acc: float
    seconds: Seconds
    flops: float
    param_epochs: float
    hatch: Seconds = field(default_factory=Seconds)
    """Hatching it from its mother (hatched members only)."""


@dataclass
class TimeSplit:
    """A method's training time in parts: MotherNets' mothers' first training, their warm-restart cycles, hatching,
    and the hatched (or lone) members' training; the independent members' and a snapshot chain's are all members."""

    mothers: Seconds = field(default_factory=Seconds)
    snapshots: Seconds = field(default_factory=Seconds)
    hatch: Seconds = field(default_factory=Seconds)
    members: Seconds = field(default_factory=Seconds)

    def total(self) -> Seconds:
        return self.mothers + self.snapshots + self.hatch + self.members


@dataclass
class Mother:
    arch: str
    members: list[int]
    """Indices of the members hatched from it."""
    snapshot_acc: list[float] = field(default_factory=list)
    """Test accuracy of the mother, then of each warm-restart cycle's end point."""


@dataclass
class Speedup:
    """The independent baseline's training cost over this method's, at the same ensemble size and budget."""

    cost: float
    wall: float
    cpu: float


@dataclass
class MethodResult:
    """One method at one ensemble size and budget: a row of the table and of results.json."""

    method: str
    """mothernets, independent or snapshot."""
    ensemble_size: int
    device: str
    ensemble_acc: float
    member_acc: list[float]
    train_cost: float
    """Training FLOPs."""
    param_epochs: float
    time: TimeSplit
    budget: float = 1.0
    """The factor on every epoch count (run.budgets)."""
    elapsed_s: float = 0.0
    """Seconds from its start to its last result, evaluation included (until the slowest rank's, when spread)."""
    members: list[dict] = field(default_factory=list)
    """The architectures of its members (arch_to_dict; a snapshot ensemble's: its one net)."""
    clusters: int = 0
    """MotherNets' g."""
    cycle_epochs: float = 0.0
    """A Snapshot Ensemble's epochs per cycle."""
    mothers: list[Mother] = field(default_factory=list)
    speedup: Speedup | None = None

    @property
    def wall_s(self) -> float:
        """Training seconds of its nets added up (hatching included, evaluation not), over all ranks when spread."""
        return self.time.total().wall

    @property
    def cpu_s(self) -> float:
        return self.time.total().cpu

    def to_json(self) -> dict:
        return {**asdict(self), "wall_s": self.wall_s, "cpu_s": self.cpu_s}

    @classmethod
    def from_json(cls, row: dict) -> MethodResult:
        """The record that `to_json` wrote (a results.json row)."""
        fields = {k: v for k, v in row.items() if k not in ("wall_s", "cpu_s")}
        fields["time"] = TimeSplit(**{part: Seconds(**s) for part, s in row["time"].items()})
        fields["mothers"] = [Mother(**m) for m in row["mothers"]]
        fields["speedup"] = Speedup(**row["speedup"]) if row["speedup"] else None
        return cls(**fields)
