"""Hosts on one machine, and the network partitions between them: Linux network namespaces
joined by a switch, made and removed by this module alone.

The topology. Every run gets a prefix of its own (``chx-<pid>-<4 hex>``) and a subnet of its
own, ``10.<x>.<y>.0/24`` with random ``x`` (200-254) and ``y``; no address outside it is ever
used, and nothing is routed anywhere else (no default route, no link to the machine's own
namespace). A *switch* namespace holds a bridge; every host is a namespace whose ``eth0`` is
one end of a veth pair whose other end is a port of that bridge (both ends are created
directly inside their namespaces: no name ever appears in the machine's own namespace). A
host has one address; a *service* (PostgreSQL, Redis, ...) gets an address of its own on
its host (a secondary address), so that one service can be cut off while the host stays
reachable. Every host knows every other address's MAC address (permanent neighbour
entries): a cut host is then silently unreachable, as behind a dead router, rather than
failing fast when ARP goes unanswered.

The partitions, every one a *silent* drop (no reset, no ICMP error: a connect times out, an
established connection stalls with its data unacknowledged, as in a real partition):

* ``cut(host)``: the host's switch port is set down. Its ``eth0`` loses its carrier but keeps
  its address and routes, so the host's sockets see no error, only silence; every other host
  sees the same silence from it.
* ``cut_service(host, service)``: on the service's host, two policy-routing rules of type
  ``blackhole``: one for what the service's address sends to ``host``, one for what arrives
  from ``host`` for the service's address (the local table's rule, at preference 0 by
  default, is moved after them: otherwise it would deliver the arriving packets first). The
  rule on what arrives matters as much as the one on replies: with replies alone dropped, a
  request would still reach the server and run there (commit a transaction) while the
  client saw nothing come back. Tried on this kernel (6.x), ``unreachable`` and ``prohibit``
  rules behave the same for the client (a connect times out: no ICMP error reaches it) and
  the same for the server (its own sends fail locally, as with ``blackhole``: ENETUNREACH,
  EACCES instead of EINVAL, which TCP treats as a soft error and keeps retransmitting);
  ``blackhole`` is the one documented to discard silently, so it is the one used.
* ``heal(host)`` / ``heal_service(host, service)`` undo them; ``flap(host, ...)`` cuts and
  heals a host's link in a loop, in a thread, until told to stop.

Processes run on a host through ``argv(host, [...])`` (``ip netns exec``). The calling
process itself can reach the hosts from a *control* host: ``enter(host)`` moves the calling
thread into a host's namespace (``setns``), and every thread and process it starts after
that is born there; ``inside(host)`` does it for a block (for a listening socket that must
belong to a host, such as the SMTP server's or one handed to gunicorn), then moves back.

Cleanup is guaranteed: ``Topology`` is a context manager whose exit (normal, exception,
Ctrl-C) kills every process still inside one of its namespaces and deletes the namespaces,
which takes their links with them; ``stale_remove()`` deletes what an earlier run killed
with SIGKILL left behind (namespaces whose owner process is gone). Needs root (or
CAP_SYS_ADMIN and CAP_NET_ADMIN) and ``ip`` (iproute2).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

FAMILY = "chx"  # every namespace this module makes is named chx-<pid>-<run>-<host>
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")  # per-namespace files ip netns exec mounts over /etc
SWITCH = "switch"
_CLONE_NEWNET = 0x40000000
_SERVICE_BASE = 100  # services get .101, .102, ...: hosts .1 to .100
_RULE_PREF = 1000  # a cut's rules: 1000 + the client host's index
_LOCAL_PREF = 1900  # the local table's rule, after them


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message is its own."""


def ip(*args: str, stdin: str | None = None) -> str:
    """Run ``ip <args>`` and return its output; raise ``NetnsError`` with its message."""
    done = subprocess.run(
        ["ip", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def available() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, not permitted), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    name = f"{FAMILY}-{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        ip("netns", "add", name)
    except NetnsError as error:
        return f"ip netns is not permitted here: {error}"
    with contextlib.suppress(NetnsError):
        ip("netns", "del", name)
    return None


def namespaces() -> list[str]:
    """Every named network namespace on the machine."""
    return sorted(p.name for p in NETNS_DIR.glob("*")) if NETNS_DIR.is_dir() else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_remove(name: str) -> None:
    """Kill every process inside the namespace ``name``, then delete it (its links go too)."""
    with contextlib.suppress(NetnsError):
        for pid in ip("netns", "pids", name).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for _ in range(50):
        try:
            ip("netns", "del", name)
            return
        except NetnsError:
            if name not in namespaces():
                return
            time.sleep(0.1)
    ip("netns", "del", name)


def stale_remove() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (killed before its
    cleanup ran); returns their names."""
    removed = []
    for name in namespaces():
        parts = name.split("-")
        ours = len(parts) >= 3 and parts[0] == FAMILY and parts[1].isdigit()
        if ours and not _pid_alive(int(parts[1])):
            _ns_remove(name)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
            removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def _current_ns() -> str:
    return f"/proc/self/task/{threading.get_native_id()}/ns/net"


@dataclass
class _Host:
    name: str
    index: int
    address: str
    port: str  # its veth's name in the switch namespace
    services: dict[str, str] = field(default_factory=dict)  # service -> its address


class Topology:
    """``hosts`` (names, in order) on one switch, with ``services`` (service name -> the host
    it lives on) each on an address of its own. ``with Topology(...) as net:`` makes it and
    removes it afterwards, whatever happens."""

    def __init__(self, hosts: Sequence[str], *, services: dict[str, str] | None = None) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be distinct and at least one: {list(hosts)}")
        if SWITCH in hosts or any(not h.isidentifier() for h in hosts):
            raise ValueError(f"a host's name is an identifier other than {SWITCH!r}: {hosts}")
        services = dict(services or {})
        unknown = {h for h in services.values() if h not in hosts}
        if unknown:
            raise ValueError(f"services on hosts that do not exist: {sorted(unknown)}")
        self.prefix = f"{FAMILY}-{os.getpid()}-{secrets.token_hex(2)}"
        net = f"10.{200 + secrets.randbelow(55)}.{secrets.randbelow(256)}"
        self.subnet = ipaddress.IPv4Network(f"{net}.0/24")
        self._hosts = {
            name: _Host(name, i, f"{net}.{i + 1}", f"p{i + 1}") for i, name in enumerate(hosts)
        }
        for i, (service, host) in enumerate(services.items()):
            self._hosts[host].services[service] = f"{net}.{_SERVICE_BASE + i + 1}"
        self._cut_services: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._made = False

    # --- names and addresses ------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return list(self._hosts)

    def ns(self, host: str) -> str:
        """The namespace of ``host`` (or of the switch)."""
        if host != SWITCH and host not in self._hosts:
            raise KeyError(f"no host {host!r} in this topology")
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return self._hosts[host].address

    def service_address(self, service: str) -> str:
        for host in self._hosts.values():
            if service in host.services:
                return host.services[service]
        raise KeyError(f"no service {service!r} in this topology")

    def service_host(self, service: str) -> str:
        for host in self._hosts.values():
            if service in host.services:
                return host.name
        raise KeyError(f"no service {service!r} in this topology")

    def host_of(self, address: str) -> str | None:
        """The host that has ``address`` (its own or a service's), or None."""
        for host in self._hosts.values():
            if address == host.address or address in host.services.values():
                return host.name
        return None

    def namespaces(self) -> list[str]:
        """This run's namespaces that exist now."""
        return [n for n in namespaces() if n.startswith(self.prefix + "-")]

    def describe(self) -> dict[str, object]:
        return {
            "subnet": str(self.subnet),
            "hosts": {h.name: h.address for h in self._hosts.values()},
            "services": {s: a for h in self._hosts.values() for s, a in h.services.items()},
        }

    # --- making and removing it ---------------------------------------------------------------

    def __enter__(self) -> Topology:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def _make(self) -> None:
        self._made = True
        switch = self.ns(SWITCH)
        ip("netns", "add", switch)
        ip("-n", switch, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        prefix_len = str(self.subnet.prefixlen)
        for host in self._hosts.values():
            ns = self.ns(host.name)
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # The local table is looked up at preference 0, before any rule one could add, and
            # it holds the services' addresses: moved after the cuts' rules, so that a rule can
            # drop what arrives for a service (see cut_service).
            ip("-n", ns, "rule", "add", "pref", str(_LOCAL_PREF), "lookup", "local")
            ip("-n", ns, "rule", "del", "pref", "0", "lookup", "local")
            ip(
                "link", "add", "name", host.port, "netns", switch, "type", "veth",
                "peer", "name", "eth0", "netns", ns,
            )  # fmt: skip
            ip("-n", switch, "link", "set", host.port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{host.address}/{prefix_len}", "dev", "eth0")
            for address in host.services.values():
                ip("-n", ns, "addr", "add", f"{address}/32", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        macs = {
            h.name: json.loads(ip("-n", self.ns(h.name), "-j", "link", "show", "eth0"))[0][
                "address"
            ]
            for h in self._hosts.values()
        }
        for host in self._hosts.values():
            batch = [
                f"neigh replace {address} lladdr {macs[other.name]} dev eth0 nud permanent"
                for other in self._hosts.values()
                if other is not host
                for address in (other.address, *other.services.values())
            ]
            if batch:
                ip("-n", self.ns(host.name), "-batch", "-", stdin="\n".join(batch) + "\n")

    def hosts_file(self, host: str, names: dict[str, list[str]]) -> None:
        """``/etc/hosts`` for what runs on ``host`` through ``argv`` (``ip netns exec``
        bind-mounts ``/etc/netns/<namespace>/hosts`` over it): each name -> its addresses
        (a name with several is resolved to all of them), and localhost."""
        folder = ETC_NETNS / self.ns(host)
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [
            f"{address} {name}" for name, addresses in names.items() for address in addresses
        ]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def remove(self) -> None:
        """Kill every process left in this run's namespaces and delete them, and their
        ``/etc/netns`` files (idempotent)."""
        for folder in ETC_NETNS.glob(f"{self.prefix}-*"):
            shutil.rmtree(folder, ignore_errors=True)
        errors = []
        for name in self.namespaces():
            try:
                _ns_remove(name)
            except NetnsError as error:
                errors.append(str(error))
        if errors:
            raise NetnsError("; ".join(errors))

    # --- running things on a host -------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (``ip netns exec`` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def enter(self, host: str) -> None:
        """Move the calling thread into ``host``'s namespace, for good: every thread and
        process it starts from now on is born there."""
        _setns(str(NETNS_DIR / self.ns(host)))

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread inside ``host``'s namespace for the block (a socket made in it
        stays there), then back where it was."""
        back = os.open(_current_ns(), os.O_RDONLY)
        try:
            _setns(str(NETNS_DIR / self.ns(host)))
            try:
                yield
            finally:
                if _libc.setns(back, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back failed")
        finally:
            os.close(back)

    # --- partitions ---------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Cut ``host`` off from every other host: its switch port down (a silent drop)."""
        ip("-n", self.ns(SWITCH), "link", "set", self._hosts[host].port, "down")

    def heal(self, host: str) -> None:
        ip("-n", self.ns(SWITCH), "link", "set", self._hosts[host].port, "up")

    def is_cut(self, host: str) -> bool:
        out = json.loads(ip("-n", self.ns(SWITCH), "-j", "link", "show", self._hosts[host].port))
        return "UP" not in out[0]["flags"]

    def _service_rules(self, host: str, service: str) -> list[list[str]]:
        client = self.address(host)
        address = self.service_address(service)
        pref = str(_RULE_PREF + self._hosts[host].index)
        return [
            ["from", address, "to", client, "pref", pref, "blackhole"],
            ["from", client, "to", address, "iif", "eth0", "pref", pref, "blackhole"],
        ]

    def cut_service(self, host: str, service: str) -> None:
        """Cut ``host`` off from ``service`` alone, both ways, silently (see the module)."""
        if self.service_host(service) == host:
            raise ValueError(f"{service} runs on {host}: cut the host instead")
        ns = self.ns(self.service_host(service))
        with self._lock:
            if (host, service) in self._cut_services:
                return
            for rule in self._service_rules(host, service):
                ip("-n", ns, "rule", "add", *rule)
            self._cut_services.add((host, service))

    def heal_service(self, host: str, service: str) -> None:
        ns = self.ns(self.service_host(service))
        with self._lock:
            if (host, service) not in self._cut_services:
                return
            for rule in self._service_rules(host, service):
                ip("-n", ns, "rule", "del", *rule)
            self._cut_services.discard((host, service))

    def flap(self, host: str, *, down: float, up: float, seconds: float) -> Flap:
        """Cut and heal ``host`` in turn (``down`` seconds cut, ``up`` seconds healed) for
        ``seconds``, in a thread; ``Flap.stop()`` ends it early. It always ends healed."""
        return Flap(self, host, down=down, up=up, seconds=seconds).start()


class Flap:
    """A host's link going down and up in a loop; records each cut's start and end."""

    def __init__(
        self, topology: Topology, host: str, *, down: float, up: float, seconds: float
    ) -> None:
        self.topology = topology
        self.host = host
        self.down = down
        self.up = up
        self.seconds = seconds
        self.cuts: list[tuple[float, float]] = []  # time.time() of each cut and its heal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"flap-{host}", daemon=True)

    def start(self) -> Flap:
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                started = time.time()
                self.topology.cut(self.host)
                self._stop.wait(self.down)
                self.topology.heal(self.host)
                self.cuts.append((started, time.time()))
                self._stop.wait(self.up)
        finally:
            with contextlib.suppress(NetnsError):
                self.topology.heal(self.host)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
