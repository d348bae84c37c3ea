"""ParallelDims: the parallel degrees of a run and every DeviceMesh built from them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.tools.cli import UserError
from titan.tools.logging import logger


@dataclass
class ParallelDims:
    """Degrees for pipeline, data (replicate x shard), context and tensor parallel over `world_size` ranks, and
    expert parallel, which borrows ranks from data-parallel sharding, context and tensor parallel (TorchTitan's
    dp2ep with etp=1): the ep ranks of an expert group are all of cp and tp and ep / (cp x tp) of dp_shard
    (dp_shard_in_ep, possibly one rank); the experts of a layer are split over them and sharded by FSDP over the
    rest of dp_shard (dp_shard_mod_ep). Each TP rank routes its own sequence shard, so it is one more source of
    tokens for the expert group and no expert is repeated over TP."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
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
        borrowed = self.cp * self.tp
        if self.ep < 1 or self.ep > 1 and (self.ep % borrowed or (self.dp_shard * borrowed) % self.ep):
            raise UserError(
                f"expert_parallel_degree {self.ep} must be a multiple of context_parallel_degree x "
                f"tensor_parallel_degree = {borrowed} and divide data_parallel_shard_degree x "
                f"context_parallel_degree x tensor_parallel_degree = {self.dp_shard * borrowed}: expert parallel "
                "borrows all the cp and tp ranks and some of dp_shard"
            )
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
            ep=parallelism.expert_parallel_degree,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Builds the world mesh over the enabled dims plus flattened views: dp, dp_shard_cp, dp_cp, and cp_tp (the
        ranks holding parts of the same sequences); with expert parallel (dp_shard then split into dp_shard_mod_ep x
        dp_shard_in_ep), dp_shard and ep (dp_shard_in_ep, cp, tp); with tensor parallel, for mixtures of experts
        that see each TP rank's own tokens, dp_shard_cp_tp and dp_cp_tp. Dims of one rank are left out."""
        dims = [(n, d) for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate), *self._shard_dims(),
                                    ("cp", self.cp), ("tp", self.tp)) if d > 1]
        if not dims:
            return None
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        for name, parts in self._views().items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(mesh_dim_name=name)
        logger.info(f"device mesh {dict(dims)} on {device_type}")
        self._mesh = mesh
        return mesh

    def _shard_dims(self) -> list[tuple[str, int]]:
        if self.ep == 1:
            return [("dp_shard", self.dp_shard)]
        borrowed = self.cp * self.tp
        return [("dp_shard_mod_ep", self.dp_shard * borrowed // self.ep), ("dp_shard_in_ep", self.ep // borrowed)]

    def _views(self) -> dict[str, tuple[str, ...]]:
        """Flattened mesh names -> the mesh dims they span."""
        shard = tuple(n for n, _ in self._shard_dims())
        views = {"dp_shard": shard} if self.ep > 1 else {}
        views |= {"dp": ("dp_replicate", *shard), "dp_shard_cp": (*shard, "cp"),
                  "dp_cp": ("dp_replicate", *shard, "cp"), "cp_tp": ("cp", "tp")}
        if self.ep > 1:
            views["ep"] = ("dp_shard_in_ep", "cp", "tp")
        if self.tp > 1:
            views |= {"dp_shard_cp_tp": (*shard, "cp", "tp"), "dp_cp_tp": ("dp_replicate", *shard, "cp", "tp")}
        return views

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called (or the world size is 1)")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """The mesh named `name`, or its only enabled part when the flattened name was not needed."""
        if self._mesh is None:
            return None
        aliases = self._views()
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

    def mesh_dim_name(self, name: str) -> str:
        """`name` as the world mesh knows it, to slice several dims at once: the name itself, or its only enabled
        part where no flattened view was needed (dp_shard is dp_shard_in_ep when expert parallel takes all of it)."""
        enabled = [p for p in self._views().get(name, ()) if p in (self.world_mesh.mesh_dim_names or ())]
        return enabled[0] if len(enabled) == 1 else name

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
    def ep_enabled(self) -> bool:
        return self.ep > 1

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
