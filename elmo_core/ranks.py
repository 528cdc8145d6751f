"""Which process of a launch this one is, as torchrun says it through the environment, read in one place.

Training asks it before the process group exists (does this rank hold the run folder's lock and log?), to set the
group up, and to know whether a SIGTERM comes from a launch; ``launch`` asks whether it already runs inside one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """This process in its launch; a process nobody launched is rank 0 of a world of one."""

    launched: bool  # started by torchrun (LOCAL_RANK set), a world of one included
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    node: int = 0  # this machine's number (torchrun's GROUP_RANK)
    per_node: int = 1  # ranks on each machine (LOCAL_WORLD_SIZE)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes the run folder and logs."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.per_node)


def this_process() -> Rank:
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Rank(
        launched="LOCAL_RANK" in env,
        rank=int(env.get("RANK", "0")),
        world=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        node=int(env.get("GROUP_RANK", "0")),
        per_node=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )
