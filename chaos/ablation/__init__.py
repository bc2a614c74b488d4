"""The safety nets of the email guarantee, and how a chaos run switches one off, so that the
full profile can show with data which nets the goals need (``python -m chaos.ablation``).

Every net is the machinery's, run by each worker's poll (``asyncwork.poll``), with no switch of
its own: each is switched off by a patch (``<name>.patch`` beside this file, a minimal diff),
applied only to a throwaway worktree of the revision under test. ``python -m chaos --without
NET`` runs only where the patches applied to its own checkout are exactly those of the nets it
was told are off, so a report never names a net the code it ran did not have, nor misses one
it lacked.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from chaos.stack import BROKERS, REDIS

PATCHES = Path(__file__).resolve().parent
CHECKOUT = PATCHES.parent.parent
# The seed of the committed full runs (chaos/results/full.json, full-rabbitmq.json).
SEED = 2966763139


@dataclass(frozen=True)
class Net:
    name: str
    title: str
    brokers: tuple[str, ...] = BROKERS  # where the net can act at all

    @property
    def patch(self) -> Path:
        """What switches it off."""
        return PATCHES / f"{self.name}.patch"


NETS = {
    net.name: net
    for net in (
        Net("N1", "rescue by lease of running jobs (asyncwork.rescue: its lease expired)"),
        Net("N2", "rescue by heartbeat of running jobs (asyncwork.rescue: its worker lapsed)"),
        Net("N3", "rescue of the jobs a dead worker's consumer held (asyncwork.rescue)"),
        Net(
            "N4",
            "republish of what the broker lost (asyncwork.recovery, in the workers' poll)",
            # The watch reads Redis's run id and a key in it: on RabbitMQ it never fires.
            brokers=(REDIS,),
        ),
    )
}


def patch_applied(net: Net, root: Path) -> bool:
    """Whether ``net``'s patch is applied to the checkout at ``root`` (it can be reversed)."""
    try:
        check = subprocess.run(  # noqa: S603 - our own argv, no shell
            ["git", "apply", "--check", "--reverse", str(net.patch)],  # noqa: S607 - git on PATH
            cwd=root,
            capture_output=True,
            check=False,
        )
    except FileNotFoundError:  # no git: nothing can have applied it
        return False
    return check.returncode == 0


def patches_mismatch(names: Iterable[str], root: Path) -> str | None:
    """Why the checkout at ``root`` does not run with exactly the nets ``names`` switched off
    by patch, or None when it does."""
    off = set(names)
    for net in NETS.values():
        applied = patch_applied(net, root)
        if net.name in off and not applied:
            return (
                f"{net.name} is switched off by a patch, and "
                f"{net.patch.relative_to(CHECKOUT)} is not applied to {root}: run "
                "python -m chaos.ablation, which applies it to a "
                "throwaway worktree"
            )
        if applied and net.name not in off:
            return f"{root} has {net.name}'s patch applied: add --without {net.name}"
    return None
