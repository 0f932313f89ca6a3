"""Where torch.distributed's ranks meet: an address of rank 0 that every rank reaches.

Host names lie on real clusters: rank 0's name may not resolve on the other nodes (the store
then times out after 21 s), or resolve to 127.0.1.1 on rank 0's own node (Debian's default
``/etc/hosts`` line; gloo then listens on loopback and its peers are refused). So no name ever
crosses ranks here. Over MPI (which already works) every rank reports its host name and IPv4
interfaces; rank 0 picks an address, listens on it, and every other rank tries to connect
within :data:`CONNECT_S` seconds; the outcome is gathered, so a bootstrap that cannot connect
ends every rank with the same one-line :class:`UserError` (exit 2) before any GPU work.

The store's port is ``MASTER_PORT`` when set, else one the system gives rank 0. Rank 0's
address is, in this order: ``MASTER_ADDR`` (a name is resolved on rank 0 only), the
address of rank 0's interface named by ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (the
one of the backend), else the address of rank 0 on the network that holds an address of most
other nodes (127.0.0.1 when every rank is on one node). Every rank then uses, for gloo and NCCL
alike, the interface through which it reaches that address, unless the variable is set.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass

import numpy as np
import psutil

from hpc.runtime.errors import UserError

CONNECT_S = 3.0  # how long a rank tries to reach rank 0's address
# Fixed-size JSON messages (bytes per rank): the report (host name and up to ~20 interfaces),
# rank 0's decision (address, port, how chosen, or the error), the outcome of the connection.
_REPORT_BYTES, _DECISION_BYTES, _OUTCOME_BYTES = 1024, 256, 128
_IFNAME_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclass(frozen=True)
class Rendezvous:
    """Rank 0's address and the port of the store, and this rank's interface toward it;
    ``how``: what chose the address (a variable, one node's loopback, or the networks)."""

    addr: str
    port: int
    ifname: str
    how: str = ""


def ipv4_interfaces() -> list[tuple[str, str, int]]:
    """(interface name, IPv4 address, prefix length) of every interface that is up."""
    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        if name not in stats or not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and a.netmask:
                prefix = ipaddress.ip_network(f"0.0.0.0/{a.netmask}").prefixlen
                out.append((name, a.address, prefix))
    return out


def _interface_matches(name: str, spec: str) -> bool:
    """Whether ``name`` is selected by a NCCL/gloo-style list ``spec`` (``eth0,ib``: prefixes;
    ``=eth0``: exact names; ``^docker,lo``: everything but those prefixes)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [s for s in spec.lstrip("=").split(",") if s]
    hit = any(name == s if exact else name.startswith(s) for s in names)
    return hit != exclude


def _root_address(reports: list[dict], backend: str) -> tuple[str, str]:
    """Rank 0: (address, what chose it) from the variables, else from the reports."""
    host, ifaces = reports[0]["host"], reports[0]["ifs"]
    if os.environ.get("MASTER_ADDR"):
        name = os.environ["MASTER_ADDR"]
        try:
            addr = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
        except socket.gaierror:
            raise UserError(f"MASTER_ADDR={name} does not resolve on {host} (rank 0): set "
                            f"MASTER_ADDR to an address of {host}, or unset it") from None
        return addr, f"MASTER_ADDR={name}"
    var = _IFNAME_VARS[backend]
    if os.environ.get(var):
        spec = os.environ[var]
        mine = [a for n, a, _ in ifaces if _interface_matches(n, spec)]
        if not mine:
            raise UserError(f"{var}={spec} names no interface with an IPv4 address on {host} "
                            f"(rank 0); it has {sorted({n for n, _, _ in ifaces})}")
        return mine[0], f"{var}={spec}"
    others = {r["host"] for r in reports} - {host}
    if not others:
        return "127.0.0.1", "one node: loopback"
    best, reached = None, -1
    for _, addr, prefix in ifaces:
        ip = ipaddress.ip_address(addr)
        if ip.is_loopback or ip.is_link_local:
            continue
        net = ipaddress.ip_network(f"{addr}/{prefix}", strict=False)
        n = len({r["host"] for r in reports[1:] for _, a, _ in r["ifs"]
                 if r["host"] != host and ipaddress.ip_address(a) in net})
        if n > reached:
            best, reached = addr, n
    if best is None:
        raise UserError(f"{host} (rank 0) has no IPv4 address but loopback: set MASTER_ADDR "
                        f"to an address of {host} that every node reaches")
    return best, "chosen automatically"


def _interface_toward(addr: str, port: int) -> str:
    """The name of this host's interface that traffic to ``addr`` leaves by (a UDP socket
    'connected' to it sends nothing; its local address tells the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((addr, port))
            local = probe.getsockname()[0]
        except OSError:
            return ""
    return next((n for n, a, _ in ipv4_interfaces() if a == local), "")


def _fix_hint(how: str, host0: str, backend: str) -> str:
    if how.startswith("MASTER_ADDR"):
        return f"set MASTER_ADDR to an address of {host0} that every node reaches"
    var = _IFNAME_VARS[backend]
    if how.startswith(var):
        return f"set {var} to an interface of {host0} that every node reaches, or unset it"
    return (f"set MASTER_ADDR to an address of {host0} that every node reaches (or {var} to "
            f"its interface)")


def _encode(obj: dict, nbytes: int) -> np.ndarray:
    """``obj`` as JSON in ``nbytes`` zero-padded bytes; the last interfaces of a report and the
    end of a message that do not fit are left out."""
    raw = json.dumps(obj).encode()
    while len(raw) > nbytes and obj.get("ifs"):
        obj = dict(obj, ifs=obj["ifs"][:-1])
        raw = json.dumps(obj).encode()
    for key in ("error", "why"):
        while len(raw) > nbytes and obj.get(key):
            obj = dict(obj, **{key: obj[key][: len(obj[key]) - (len(raw) - nbytes) - 4] + "..."})
            raw = json.dumps(obj).encode()
    buf = np.zeros(nbytes, dtype=np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return buf


def _decode(buf: np.ndarray):
    return json.loads(bytes(buf).rstrip(b"\0").decode())


def agree(world, backend: str) -> Rendezvous:
    """Collective: pick rank 0's address, check that every rank connects to it, and set this
    rank's ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (where unset) to its interface
    toward it. Raises the same UserError on every rank when some rank cannot connect."""
    report = {"host": world.hostname, "ifs": ipv4_interfaces()}
    reports = [_decode(b) for b in world.allgather(_encode(report, _REPORT_BYTES),
                                                   tag="bootstrap")]
    listener = None
    decision = {"error": ""}
    if world.is_root:
        try:
            addr, how = _root_address(reports, backend)
            port = int(os.environ.get("MASTER_PORT") or 0)
            listener = socket.create_server((addr, port), backlog=world.size)
            decision.update(addr=addr, how=how, port=listener.getsockname()[1])
        except UserError as err:
            decision["error"] = str(err)
        except OSError as err:
            decision["error"] = (f"{reports[0]['host']} (rank 0) cannot listen on {addr} "
                                 f"({how}): {err.strerror}; "
                                 f"{_fix_hint(how, reports[0]['host'], backend)}")
    decision = _decode(world.bcast(_encode(decision, _DECISION_BYTES), tag="bootstrap"))
    if decision["error"]:
        raise UserError(decision["error"])
    addr, port, how = decision["addr"], int(decision["port"]), decision["how"]
    failure = ""
    if not world.is_root:
        try:
            socket.create_connection((addr, port), timeout=CONNECT_S).close()
        except OSError as err:
            failure = err.strerror or type(err).__name__
    failures = [_decode(b) for b in world.allgather(_encode({"why": failure}, _OUTCOME_BYTES),
                                                    tag="bootstrap")]
    if listener is not None:
        listener.close()
    # Nobody reaches for the store's port before rank 0 has closed the check's listener on it.
    world.barrier()
    bad = [r for r, f in enumerate(failures) if f["why"]]
    if bad:
        r = bad[0]
        others = f" and {len(bad) - 1} more rank(s)" if len(bad) > 1 else ""
        host0 = reports[0]["host"]
        raise UserError(f"rank {r} on {reports[r]['host']}{others} cannot connect to rank 0 at "
                        f"{addr}:{port} on {host0} ({how}): {failures[r]['why']}; "
                        f"{_fix_hint(how, host0, backend)}")
    world.hosts = [r["host"] for r in reports]
    ifname = "lo" if ipaddress.ip_address(addr).is_loopback else _interface_toward(addr, port)
    for var in _IFNAME_VARS.values():
        if ifname and not os.environ.get(var):
            os.environ[var] = ifname
    return Rendezvous(addr=addr, port=port, ifname=ifname, how=how)
