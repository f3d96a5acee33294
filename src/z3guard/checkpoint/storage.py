"""Which ranks save into one filesystem. On a shared filesystem that is all of them, and one rank stages,
lists, renames and points `latest` for all. With DeepSpeed's `use_node_local_storage`, or a save path that
differs between nodes, each node's disk holds only its own ranks' files: there the lowest rank of each
group does that for its group, and `latest` moves only once every group has committed."""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import digest, dist, manifest
from .errors import CheckpointError


@dataclass(frozen=True)
class Storage:
    members: tuple[int, ...]  # the ranks that write into this rank's filesystem
    index: int  # this filesystem's number among the save's filesystems (order of their lowest rank)
    count: int

    @property
    def leads(self) -> bool:
        """This rank stages, lists, renames and writes `latest` for its group."""
        return dist.rank() == self.members[0]


def of(root: Path, node_local: bool) -> Storage:
    """The group of this rank: the ranks that name the same folder (on the same host, with node-local
    storage). One collective."""
    keys = dist.gather_all((socket.gethostname() if node_local else "", os.path.abspath(root)))
    distinct = sorted(set(keys), key=keys.index)
    mine = keys[dist.rank()]
    return Storage(tuple(r for r, k in enumerate(keys) if k == mine), distinct.index(mine), len(distinct))


def entries(staging: Path, store: Storage, written: dict[str, dict[str, Any]],
            pool: ThreadPoolExecutor) -> dict[str, dict[str, Any]]:
    """The manifest entries of this group's staging folder: the files hashed while they were written (any
    rank's), and the rest read and hashed here, split among the group. A file a rank wrote that its group's
    lead does not see means the folder is not one filesystem for the group: refused on every rank."""
    seen = dist.on_every_rank(lambda: manifest.listing(staging) if store.leads else None, CheckpointError)
    groups = dist.gather_all((store.index, written))
    names = seen[store.members[0]]
    hashed = {n: e for index, part in groups if index == store.index for n, e in part.items()}
    lead_of: dict[int, int] = {}
    for r, (index, _) in enumerate(groups):
        lead_of.setdefault(index, r)
    problem = None
    for r, (index, part) in enumerate(groups):
        unseen = sorted(set(part) - set(seen[lead_of[index]]))
        if unseen:
            problem = (f"rank {r} wrote {unseen[0]} into {staging}, which rank {lead_of[index]} does not see "
                       "there: the save folder is not one filesystem for these ranks. With a disk per node, set "
                       "\"checkpoint\": {\"use_node_local_storage\": true} in the DeepSpeed config, or give each "
                       "node its own path.")
            break
        foreign = sorted(set(part) & {n for i, lead in lead_of.items() if i != index for n in seen[lead]})
        if foreign and problem is None:
            problem = (f"rank {r} wrote {foreign[0]} into {staging}, and another node's lead rank lists it in its own "
                       "folder: the folders are one shared filesystem. Unset \"use_node_local_storage\" (or give "
                       "every node the same path).")
    dist.raise_if_any(problem, CheckpointError)
    left = [n for n in names if n not in hashed]
    mine = [n for i, n in enumerate(left) if manifest.owner(n, i, list(store.members)) == dist.rank()]
    read = dist.on_every_rank(lambda: (store.index, {n: e for n, e in zip(
        mine, digest.hash_files([staging / n for n in mine], pool).values())}), CheckpointError)
    for index, part in read:
        if index == store.index:
            hashed.update(part)
    return {n: hashed[n] for n in names}
