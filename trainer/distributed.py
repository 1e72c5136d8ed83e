"""Process groups and FSDP2 sharding, for one process or many (``torchrun``).

    world = init_distributed(timeout_s=60)          # reads torchrun's env, or world of 1
    shard(module, world)                            # fully_shard (bf16 params on CUDA)
    ...
    shutdown()

One code path for every case: a single process without torchrun still gets a (gloo)
process group of size 1, so FSDP2, DCP checkpoints and state-dict gathering behave the
same as with many. Collectives time out after ``timeout_s`` so a lost peer makes the
others fail fast instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# Imported here, before any process group exists, on purpose: importing FSDP pulls in
# torch.distributed.nn, whose functions take ``group=group.WORLD`` as a default
# argument. Imported after init_process_group, those defaults would hold the world
# group for the life of the interpreter, so it could never be torn down before exit.
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from gateway.services import free_port

log = logging.getLogger(__name__)

# FSDP2 warns when a sharded module returns a view (the actor reshapes its action);
# loopgate's algorithms never modify a module's output in place, which is the hazard.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(*, device: str = "auto", timeout_s: float = 60.0) -> World:
    """Join (or create) the process group: NCCL on CUDA, gloo on CPU."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is cuda but no CUDA device is available")
    if "RANK" not in os.environ:  # not under torchrun: a group of one
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }
        )
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = World(rank, size, local_rank, dev, backend)
    log.info("process group: rank %d of %d on %s (%s)", rank, size, dev, backend)
    return world


def shard(module: nn.Module, world: World, methods: tuple[str, ...] = ()) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to ``module`` (bf16 compute with fp32 reduction on CUDA);
    a group of one on the CPU leaves it as it is (nothing to shard, nor to reduce).

    ``methods`` are entry points besides ``forward`` (e.g. the actor's ``sample``) that
    must gather the parameters before they run.
    """
    if world.size == 1 and world.device.type != "cuda":
        # FSDP over one process shards nothing: every gather and reduce is a copy and every
        # optimizer op goes through DTensor's dispatch, which halves a small network's
        # update rate (SAC on the reach task: about 100 against 195 updates/s on one CPU
        # thread). The module stays plain: its DCP checkpoints load at any world size, and
        # into it a checkpoint saved at any world size loads.
        return module
    kwargs = {}
    if world.device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(module, **kwargs)
    for name in methods:
        register_fsdp_forward_method(module, name)
    return module


def from_rank0(world: World, value: float) -> float:
    """Rank 0's ``value`` on every rank: a broadcast, or ``value`` itself in a group of one.

    Every rank must call it at the same point, as with any collective.
    """
    if world.size == 1:
        return value
    shared = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.broadcast(shared, src=0)
    return float(shared.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group, so that none of its threads outlives the interpreter.

    Call it after the sharded modules are dropped. A group that something still
    references survives ``destroy_process_group``: its gloo threads then meet the
    interpreter's teardown at exit, and the process can abort there after its work is
    done. DTensor's plan caches hold the device mesh (and with it the group), so they
    are cleared first; a warning names any group thread that remains.
    """
    if not dist.is_initialized():
        return
    _clear_dtensor_caches()
    gc.collect()  # sharded modules sit in reference cycles (module <-> hook state)
    dist.destroy_process_group()
    left = group_threads()
    if left:
        log.warning("process group still referenced after shutdown; threads alive: %s", ", ".join(left))
    else:
        log.info("process group closed")


# DTensor's caches that hold device meshes: (module, attribute path of the cache's clear).
_DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def _clear_dtensor_caches() -> None:
    """Drop DTensor's caches of sharding plans and mesh topology: they hold device meshes.

    These are torch internals (of the pinned version); if one moves, the group may
    outlive ``shutdown()``, which the warning there and the FSDP checkpoint test report.
    """
    for module, path in _DTENSOR_CACHES:
        try:
            clear = importlib.import_module(module)
            for attr in path.split("."):
                clear = getattr(clear, attr)
        except (ImportError, AttributeError):
            log.debug("no %s.%s in this torch", module, path)
            continue
        clear()


def group_threads() -> list[str]:
    """Names of this process's live gloo threads (Linux; an empty list elsewhere)."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir() if tasks.exists() else ():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return names
