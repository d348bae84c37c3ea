"""ParallelDims: the parallel degrees of a run and every DeviceMesh built from them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.tools.cli import UserError
from titan.tools.logging import logger


@dataclass
class ParallelDims:
    """Degrees for pipeline, data (replicate x shard), context and tensor parallel over `world_size` ranks."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel degree {name} must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise UserError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp*pp = {others}; "
                    "change the parallel degrees or the number of processes"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise UserError(f"data_parallel_shard_degree must be >= 1 or -1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise UserError(
                f"parallel degrees multiply to {product} (dp_replicate={self.dp_replicate} x dp_shard="
                f"{self.dp_shard} x cp={self.cp} x tp={self.tp} x pp={self.pp}) but the world size is "
                f"{self.world_size}; make their product equal the number of processes"
            )

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Builds the world mesh over the enabled dims plus flattened dp, dp_shard_cp and dp_cp views."""
        dims = [(n, d) for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                    ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)) if d > 1]
        if not dims:
            return None
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._flatten(mesh, ("dp_replicate", "dp_shard"), "dp")
        self._flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        self._flatten(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
        logger.info(f"device mesh {dict(dims)} on {device_type}")
        self._mesh = mesh
        return mesh

    @staticmethod
    def _flatten(mesh: DeviceMesh, parts: tuple[str, ...], name: str) -> None:
        present = tuple(p for p in parts if p in mesh.mesh_dim_names)
        if len(present) > 1:
            mesh[present]._flatten(mesh_dim_name=name)

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called (or the world size is 1)")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """The mesh named `name`, or its only enabled part when the flattened name was not needed."""
        if self._mesh is None:
            return None
        aliases = {
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        }
        root = self._mesh
        names = set(root.mesh_dim_names or ())
        try:
            with warnings.catch_warnings():
                # Slicing a flattened dim from the root is what TorchTitan does; torch warns about it each time.
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                return root[name]
        except (KeyError, RuntimeError, ValueError):
            enabled = [p for p in aliases.get(name, ()) if p in names]
            return root[enabled[0]] if len(enabled) == 1 else None

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_degree(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self) -> int:
        mesh = self.submesh("dp")
        return mesh.get_local_rank() if mesh is not None else 0
