"""The device mesh, configured in one place: data x tensor x pipeline sizes over the world."""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._numbers import integer

DIMS = (
    "pp",
    "dp",
    "tp",
)  # outermost first: pipeline stages may span nodes, tensor parallel may not


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh dimensions; their product is the world size.

    Attributes:
        dp: Data-parallel replicas (each sees its own shard of the global batch).
        tp: Tensor-parallel ranks (each holds and generates a shard of every sharded weight).
        pp: Pipeline stages (each holds and generates its own layers).
    """

    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def mesh_shape(world_size: int, *, dp: int | None = None, tp: int = 1, pp: int = 1) -> MeshShape:
    """Check and complete the mesh sizes for `world_size` ranks.

    Args:
        world_size: Number of ranks.
        dp: Data-parallel size; `None` takes what `tp` and `pp` leave: `world_size // (tp * pp)`.
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.

    Examples:
        >>> mesh_shape(8, tp=2)
        MeshShape(dp=4, tp=2, pp=1)
    """
    where = "gb.dist.init_mesh"
    world_size = integer(where, "world_size", world_size, minimum=1)
    dp = integer(where, "dp", dp, minimum=1, optional=True)
    tp = integer(where, "tp", tp, minimum=1)
    pp = integer(where, "pp", pp, minimum=1)
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(
                f"gb.dist.init_mesh: world size {world_size} is not divisible by tp x pp = "
                f"{tp} x {pp} = {tp * pp}; launch a multiple of {tp * pp} ranks or change tp/pp."
            )
        dp = world_size // (tp * pp)
    shape = MeshShape(dp, tp, pp)
    if shape.world_size != world_size:
        raise ValueError(
            f"gb.dist.init_mesh: dp x tp x pp = {dp} x {tp} x {pp} = {shape.world_size} does not "
            f"equal the world size {world_size}; their product must be the number of ranks."
        )
    return shape


def init_mesh(
    *,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    device_type: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> DeviceMesh:
    """The `("pp", "dp", "tp")` device mesh over every rank, starting the process group if needed.

    Under `torchrun` this is the only set-up call: NCCL when CUDA is available (each rank on
    `cuda:LOCAL_RANK`), gloo otherwise. A collective that waits longer than `timeout` (a dead
    or hung peer) raises instead of hanging.

    Args:
        dp: Data-parallel size; `None` uses every rank that `tp` and `pp` leave.
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        device_type: `"cuda"` or `"cpu"`; default: the CPU when a gloo process group is
            already started, else CUDA when available.
        timeout: Process-group timeout, used when this call starts the process group: then
            the mesh's groups of each dimension get it too (torch would give those its
            30-minute default).

    Returns:
        A 3-D `DeviceMesh`; `mesh["dp"]`, `mesh["tp"]` and `mesh["pp"]` are its sub-meshes.

    Examples:
        Under `torchrun --nproc_per_node=4`: dp=2, tp=2.

        >>> mesh = gb.dist.init_mesh(tp=2)  # doctest: +SKIP
    """
    if device_type is None:
        device_type = _default_device_type()
    overrides = None
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(_local_gpu())
        backend = "nccl" if device_type == "cuda" else "gloo"
        _start_process_group(backend, timeout)
        overrides = _with_timeout(backend, timeout)
    shape = mesh_shape(dist.get_world_size(), dp=dp, tp=tp, pp=pp)
    return init_device_mesh(
        device_type,
        (shape.pp, shape.dp, shape.tp),
        mesh_dim_names=DIMS,
        backend_override=overrides,
    )


def _with_timeout(backend: str, timeout: datetime.timedelta) -> dict | None:
    """`init_device_mesh`'s `backend_override` giving each dimension's groups `timeout`;
    None where this torch's backend options do not say how (then torch's default)."""
    try:
        gloo = backend == "gloo"
        options = dist.ProcessGroupGloo._Options() if gloo else dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    except (AttributeError, TypeError):
        return None
    return {dim: (backend, options) for dim in DIMS}


def _default_device_type() -> str:
    """The started process group's device (gloo alone: the CPU), else CUDA when available."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _local_gpu() -> int:
    """This rank's GPU, `LOCAL_RANK`; a clear error where the machine has fewer GPUs than ranks."""
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise ValueError(
            f"gb.dist.init_mesh: LOCAL_RANK={local_rank}, but this machine has {gpus} CUDA "
            f"device(s) and NCCL needs one per rank. Start at most {gpus} processes per machine "
            "(torchrun --nproc_per_node), or pass device_type='cpu' for gloo on the CPU."
        )
    return local_rank


def _start_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """`init_process_group(backend)` from the environment, keyed per torchrun attempt.

    torchrun keeps one store across the restarts of a job (`--max-restarts`): a restarted
    rank would read the address its dead peer published in the failed attempt and fail to
    connect. Prefixing the keys with `TORCHELASTIC_RESTART_COUNT` gives each attempt its own.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"gbfunc/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def dim_size(mesh: DeviceMesh, dim: str, where: str) -> int:
    """Size of the named mesh dimension (1 when the mesh's named dimensions lack it)."""
    names = _names(mesh, where)
    return mesh.size(names.index(dim)) if dim in names else 1


def dim_rank(mesh: DeviceMesh, dim: str, where: str) -> int:
    """This rank's coordinate along the named mesh dimension (0 when there is none)."""
    return mesh.get_local_rank(dim) if dim in _names(mesh, where) else 0


def _names(mesh: DeviceMesh, where: str) -> tuple[str, ...]:
    """The mesh's dimension names, each one of `DIMS`: an unnamed mesh, or one named
    otherwise, would have its data-parallel ranks taken for one (every rank the whole batch,
    gradients summed rather than averaged)."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in DIMS]
    if (not names and mesh.size() > 1) or unknown:
        found = f"dimensions named {names}" if names else "unnamed dimensions"
        raise ValueError(
            f"{where}: the mesh has {found}; gbfunc reads its parallelism from the names "
            f"{DIMS}. Build it with gb.dist.init_mesh, or init_device_mesh(..., "
            "mesh_dim_names=('dp',)) for data parallelism alone."
        )
    return names
