"""The safety nets of the email guarantee, and how a chaos run switches one off, so that the
full profile can show with data which nets the goals need (``python -m chaos.ablation``).

Each net is switched off the plainest way it allows: its periodic task disabled in the chaos
database; a net with no switch of its own is switched off by a patch (``<name>.patch`` beside
this file, a minimal diff), applied only to a throwaway worktree of the revision under test.
``python -m chaos --without NET`` disables the periodic tasks, and runs only where the patches
applied to its own checkout are exactly those of the nets it was told are off, so a report
never names a net the code it ran did not have, nor misses one it lacked.
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
    jobs_off: tuple[str, ...] = ()  # periodic tasks disabled in the chaos database
    patched: bool = False  # switched off by PATCHES / f"{name}.patch"
    brokers: tuple[str, ...] = BROKERS  # where the net can act at all

    @property
    def patch(self) -> Path | None:
        return PATCHES / f"{self.name}.patch" if self.patched else None


NETS = {
    net.name: net
    for net in (
        Net(
            "N1",
            "lease-expiry recovery (job email-claims-recover)",
            jobs_off=("email-claims-recover",),
        ),
        Net("N2", "heartbeat rescue of claims (workers-rescue: email-claims)", patched=True),
        Net("N3", "held-jobs rescue (workers-rescue: held-jobs)", patched=True),
        Net(
            "N4",
            "reconcile, periodic and at once on recovery (job email-reconcile)",
            jobs_off=("email-reconcile",),
        ),
        Net(
            "N4-detection",
            "reconcile at once on a broker restart (the beat leader's broker watch)",
            patched=True,
            # The watch reads Redis's run id: on RabbitMQ it never fires.
            brokers=(REDIS,),
        ),
    )
}


def jobs_off(names: Iterable[str]) -> tuple[str, ...]:
    """The periodic tasks to disable for the nets ``names``."""
    return tuple(job for name in names for job in NETS[name].jobs_off)


def patch_applied(net: Net, root: Path) -> bool:
    """Whether ``net``'s patch is applied to the checkout at ``root`` (it can be reversed)."""
    assert net.patch is not None
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
        if net.patch is None:
            continue
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
