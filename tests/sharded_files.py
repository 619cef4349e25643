"""The files of a sharded checkpoint (`gb.dist.save_sharded`), read and rewritten entry by
entry as a damaged copy would be: shared by the tests of `load_sharded`'s checks."""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def data_of(path: str | Path) -> Path:
    """The folder of DCP's files that the checkpoint's manifest names."""
    return Path(path) / json.loads((Path(path) / "gbfunc.json").read_text())["data"]


def entries(path: str | Path) -> dict[str, torch.Tensor]:
    """Every entry of the checkpoint at `path`, read whole in one process."""
    data = data_of(path)
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in dcp.FileSystemReader(data).read_metadata().state_dict_metadata.items()
    }
    dcp.load(state, checkpoint_id=data, no_dist=True)
    return state


def rewrite(path: str | Path, altered: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Write `state` as a checkpoint at `altered` under `path`'s manifest, unchanged."""
    dcp.save(state, checkpoint_id=Path(altered) / data_of(path).name, no_dist=True)
    shutil.copy(Path(path) / "gbfunc.json", Path(altered) / "gbfunc.json")
