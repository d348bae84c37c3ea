"""Architecture specs of ensemble members: VGG-style conv nets, ResNet-style nets and MLPs.

A spec is a frozen dataclass that fully determines a network's modules (see models.py), so morphisms can work on
specs and map weights by name. All families end in a linear head over their flattened last features.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, int, int]


def _check_shape(in_shape: Shape, num_classes: int) -> None:
    if len(in_shape) != 3 or min(in_shape) < 1:
        raise ValueError(f"in_shape must be (channels, height, width) with positive sizes, got {in_shape}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")


def _check_width(width: int, where: str) -> None:
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"{where}: width must be a positive integer, got {width!r}")


@dataclass(frozen=True)
class Conv:
    """One conv -> BatchNorm -> ReLU layer with 'same' padding."""

    width: int
    """Output channels."""
    kernel: int = 3
    """Odd kernel size (3, 5, 7, ...)."""

    def __post_init__(self):
        _check_width(self.width, "conv")
        if not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"conv: kernel must be a positive odd integer, got {self.kernel!r}")


@dataclass(frozen=True)
class VGG:
    """Blocks of conv layers with 2x2 max pooling between blocks."""

    in_shape: Shape
    num_classes: int
    blocks: tuple[tuple[Conv, ...], ...]
    family = "vgg"

    def __post_init__(self):
        _check_shape(self.in_shape, self.num_classes)
        if not self.blocks or any(not block for block in self.blocks):
            raise ValueError("vgg: needs at least one block and at least one layer per block")
        if min(self.in_shape[1:]) >> (len(self.blocks) - 1) < 1:
            raise ValueError(f"vgg: {len(self.blocks)} blocks pool a {self.in_shape[1:]} image below 1x1")


@dataclass(frozen=True)
class Stage:
    """A transition conv to `width` channels followed by residual blocks on that width."""

    width: int
    """Channels of the residual stream."""
    blocks: tuple[int, ...] = ()
    """Inner width of each residual block (conv -> BN -> ReLU -> conv -> BN, added to the stream)."""

    def __post_init__(self):
        _check_width(self.width, "stage")
        for inner in self.blocks:
            _check_width(inner, "residual block")


@dataclass(frozen=True)
class ResNet:
    """Stages of residual blocks with 2x2 max pooling between stages."""

    in_shape: Shape
    num_classes: int
    stages: tuple[Stage, ...]
    family = "resnet"

    def __post_init__(self):
        _check_shape(self.in_shape, self.num_classes)
        if not self.stages:
            raise ValueError("resnet: needs at least one stage")
        if min(self.in_shape[1:]) >> (len(self.stages) - 1) < 1:
            raise ValueError(f"resnet: {len(self.stages)} stages pool a {self.in_shape[1:]} image below 1x1")


@dataclass(frozen=True)
class MLP:
    """Flattened input through linear -> BatchNorm -> ReLU hidden layers."""

    in_shape: Shape
    num_classes: int
    hidden: tuple[int, ...]
    family = "mlp"

    def __post_init__(self):
        _check_shape(self.in_shape, self.num_classes)
        if not self.hidden:
            raise ValueError("mlp: needs at least one hidden layer")
        for width in self.hidden:
            _check_width(width, "mlp hidden layer")


Arch = VGG | ResNet | MLP
FAMILIES = ("vgg", "resnet", "mlp")


def describe(arch: Arch) -> str:
    """Compact one-line form, e.g. `vgg[16k3,16k5|32k3]`, `resnet[16:16,8|32:32]`, `mlp[256,128]`."""
    if isinstance(arch, VGG):
        body = "|".join(",".join(f"{c.width}k{c.kernel}" for c in block) for block in arch.blocks)
    elif isinstance(arch, ResNet):
        body = "|".join(f"{s.width}:" + ",".join(map(str, s.blocks)) for s in arch.stages)
    else:
        body = ",".join(map(str, arch.hidden))
    return f"{arch.family}[{body}]"


def final_size(arch: VGG | ResNet) -> tuple[int, int]:
    """Height and width of the last feature map of a conv net (2x2 max pooling between levels)."""
    levels = len(arch.blocks) if isinstance(arch, VGG) else len(arch.stages)
    return arch.in_shape[1] >> (levels - 1), arch.in_shape[2] >> (levels - 1)


def forward_flops(arch: Arch) -> int:
    """Multiply-adds x 2 of one forward pass on one sample (convs and linears; BN, ReLU, pooling ignored)."""
    c, h, w = arch.in_shape
    if isinstance(arch, MLP):
        flops, c = 0, c * h * w
        for width in arch.hidden:
            flops, c = flops + 2 * c * width, width
        return flops + 2 * c * arch.num_classes
    levels: list[list[tuple[int, int, int]]] = []  # per pooling level: (c_in, c_out, kernel) of each conv
    if isinstance(arch, VGG):
        for block in arch.blocks:
            levels.append([])
            for conv in block:
                levels[-1].append((c, conv.width, conv.kernel))
                c = conv.width
    else:
        for stage in arch.stages:
            levels.append([(c, stage.width, 3)])
            for inner in stage.blocks:
                levels[-1] += [(stage.width, inner, 3), (inner, stage.width, 3)]
            c = stage.width
    flops = 0
    for i, level in enumerate(levels):
        h, w = (h // 2, w // 2) if i else (h, w)
        flops += sum(2 * h * w * k * k * ci * co for ci, co, k in level)
    return flops + 2 * c * h * w * arch.num_classes


def arch_from_dict(spec: dict[str, Any], in_shape: Shape, num_classes: int) -> Arch:
    """Parses one member from TOML/JSON, e.g. `{family = "vgg", blocks = [[[16, 3], 16], [[32, 5]]]}`.

    A VGG layer is `width`, `[width, kernel]` or `{width, kernel}`; a ResNet stage is `{width, blocks = [...]}`.
    `in_shape` and `num_classes` may be given in the spec; they must then match the data.
    """
    spec = dict(spec)
    family = spec.pop("family", None)
    fields = {"vgg": "blocks", "resnet": "stages", "mlp": "hidden"}
    if family not in fields:
        raise ValueError(f"member {spec}: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    for key, want in (("in_shape", tuple(in_shape)), ("num_classes", num_classes)):
        got = spec.pop(key, want)
        if (tuple(got) if isinstance(got, list) else got) != want:
            raise ValueError(f"member {family}: {key} {got} does not match the data's {want}")
    unknown = set(spec) - {fields[family]}
    if unknown or fields[family] not in spec:
        raise ValueError(f"member {family}: needs exactly the key {fields[family]!r} (got {sorted(spec)})")
    body = spec[fields[family]]
    if family == "vgg":
        blocks = tuple(tuple(_conv_from(layer) for layer in block) for block in body)
        return VGG(tuple(in_shape), num_classes, blocks)
    if family == "resnet":
        stages = tuple(_stage_from(stage) for stage in body)
        return ResNet(tuple(in_shape), num_classes, stages)
    return MLP(tuple(in_shape), num_classes, tuple(body))


def _conv_from(layer: Any) -> Conv:
    if isinstance(layer, int):
        return Conv(layer)
    if isinstance(layer, (list, tuple)) and len(layer) == 2:
        return Conv(*layer)
    if isinstance(layer, dict) and set(layer) <= {"width", "kernel"}:
        return Conv(**layer)
    raise ValueError(f"vgg layer {layer!r}: unknown layer type; write width, [width, kernel] or {{width, kernel}}")


def _stage_from(stage: Any) -> Stage:
    if not isinstance(stage, dict) or not set(stage) <= {"width", "blocks"} or "width" not in stage:
        raise ValueError(f"resnet stage {stage!r}: unknown layer type; write {{width = 32, blocks = [32, 16]}}")
    return Stage(stage["width"], tuple(stage.get("blocks", ())))


def arch_to_dict(arch: Arch) -> dict[str, Any]:
    """Inverse of arch_from_dict (for results.json)."""
    if isinstance(arch, VGG):
        body = [[[c.width, c.kernel] for c in block] for block in arch.blocks]
        return {"family": "vgg", "blocks": body}
    if isinstance(arch, ResNet):
        return {"family": "resnet", "stages": [{"width": s.width, "blocks": list(s.blocks)} for s in arch.stages]}
    return {"family": "mlp", "hidden": list(arch.hidden)}


@dataclass(frozen=True)
class Generator:
    """A random family of diverse members that share a block structure (so one mother can serve them all)."""

    family: str = "vgg"
    """"vgg", "resnet", "mlp", or "mixed" (each member picks one of the three at random)."""
    blocks: int = 3
    """Pooling levels of VGG blocks / ResNet stages."""
    width: int = 16
    """Base width: block b draws widths from width * 2**b * [1, width_ratio] (MLP: width * 16 * [1, width_ratio])."""
    width_ratio: float = 2.0
    """Largest over smallest width a layer may draw; a small ratio keeps the mother (the minimum) large."""
    max_depth: int = 3
    """Most layers per VGG block / residual blocks per stage / MLP hidden layers (at least 1)."""
    kernels: tuple[int, ...] = (3, 5, 7)
    """VGG kernel sizes to draw from."""

    def __post_init__(self):
        if self.family not in (*FAMILIES, "mixed"):
            raise ValueError(f"family {self.family!r} is unknown; choose vgg, resnet, mlp or mixed")
        if self.blocks < 1 or self.width < 1 or self.max_depth < 1 or self.width_ratio < 1:
            raise ValueError("generator: blocks, width, max_depth and width_ratio must be >= 1")
        for k in self.kernels:
            Conv(1, k)

    def sample(self, count: int, in_shape: Shape, num_classes: int, seed: int) -> list[Arch]:
        rng = random.Random(seed)
        return [self._one(rng, in_shape, num_classes) for _ in range(count)]

    def _one(self, rng: random.Random, in_shape: Shape, num_classes: int) -> Arch:
        family = rng.choice(FAMILIES) if self.family == "mixed" else self.family

        def width(level: int) -> int:
            return round(self.width * 2**level * rng.uniform(1, self.width_ratio))

        depth = lambda: rng.randint(1, self.max_depth)
        if family == "vgg":
            blocks = tuple(
                tuple(Conv(width(b), rng.choice(self.kernels)) for _ in range(depth())) for b in range(self.blocks)
            )
            return VGG(in_shape, num_classes, blocks)
        if family == "resnet":
            stages = tuple(Stage(width(b), tuple(width(b) for _ in range(depth()))) for b in range(self.blocks))
            return ResNet(in_shape, num_classes, stages)
        return MLP(in_shape, num_classes, tuple(width(4) for _ in range(depth())))

