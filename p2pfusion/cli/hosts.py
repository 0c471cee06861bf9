"""Separate hosts on one machine: each in its own network namespace, with its own IP on a bridge.

The bridge lives in the caller's namespace, which is a host too (address .1), so a client run
there reaches the peers only across real interfaces, and each peer reaches every other the same
way. Links can be shaped to a rate (`tc qdisc tbf` on both ends of each veth). Hosts behind a NAT
(`behind_nat`) sit each on a LAN of its own behind a router namespace on the bridge that
masquerades them (iptables): they reach every host, and no host reaches them. Tests, benchmarks
and scripts use it; it needs root and iproute2 (and iptables for a NAT), and removes what it made
when it exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from p2pfusion.errors import ConfigError


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make test hosts, or None when it can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (the `ip` command) is not installed"
    name = f"p2pfprobe{os.getpid()}"  # processes probing at once (test workers) must not collide
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this kernel or sandbox refuses network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def nat_unavailable() -> str | None:
    """Why this machine cannot put test hosts behind a NAT, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    return namespaces_unavailable()


class HostNetwork:
    """`hosts` namespaces named `<prefix><i>` at `<subnet>.<11 + i>`, on bridge `<prefix>br` at `<subnet>.1`."""

    def __init__(
        self, hosts: int, prefix: str = "p2pfh", subnet: str = "10.78.0", mbit: int | None = None, behind_nat: int = 0
    ):
        self.hosts, self.prefix, self.subnet, self.mbit, self.behind_nat = hosts, prefix, subnet, mbit, behind_nat
        self.bridge = f"{prefix}br"

    @property
    def gateway(self) -> str:
        """The address of the caller's own namespace on the bridge."""
        return f"{self.subnet}.1"

    def host(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def prefix_of(self, i: int) -> list[str]:
        """The command prefix that runs a program on host `i`."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def natted_prefix_of(self, j: int) -> list[str]:
        """The command prefix that runs a program on host `j` behind the NAT."""
        return ["ip", "netns", "exec", f"{self.prefix}n{j}"]

    def _add_natted(self) -> None:
        router, outside, inside = f"{self.prefix}r", f"{self.prefix}vr", f"{self.prefix}er"
        _ip("netns", "add", router)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", router)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("-n", router, "addr", "add", f"{self.subnet}.250/24", "dev", inside)
        _ip("-n", router, "link", "set", inside, "up")
        for j in range(self.behind_nat):
            ns, lan, host_end = f"{self.prefix}n{j}", f"{self.prefix}l{j}", f"{self.prefix}m{j}"
            _ip("netns", "add", ns)
            _ip("link", "add", lan, "type", "veth", "peer", "name", host_end)
            _ip("link", "set", lan, "netns", router)
            _ip("link", "set", host_end, "netns", ns)
            _ip("-n", router, "addr", "add", f"10.200.{j}.1/24", "dev", lan)
            _ip("-n", router, "link", "set", lan, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"10.200.{j}.2/24", "dev", host_end)
            _ip("-n", ns, "link", "set", host_end, "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.200.{j}.1")
        in_router = ["ip", "netns", "exec", router]
        subprocess.run([*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True, capture_output=True)
        subprocess.run([*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", inside, "-j", "MASQUERADE"],
                       check=True, capture_output=True)

    def bytes_sent(self, i: int) -> int:
        """Bytes host `i` has sent through its interface (its end of the veth)."""
        out = subprocess.run(
            [*self.prefix_of(i), "cat", f"/sys/class/net/{self._inside(i)}/statistics/tx_bytes"],
            check=True, capture_output=True, text=True,
        )
        return int(out.stdout)

    def _inside(self, i: int) -> str:
        return f"{self.prefix}e{i}"

    def _shape(self, device: str, namespace: str | None) -> None:
        burst = max(self.mbit * 1250, 16000)  # bytes: 10 ms at the rate, at least a few packets
        cmd = ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{self.mbit}mbit",
               "burst", str(burst), "latency", "400ms"]
        subprocess.run((["ip", "netns", "exec", namespace] if namespace else []) + cmd, check=True, capture_output=True)

    def __enter__(self) -> HostNetwork:
        reason = namespaces_unavailable()
        if reason is not None:
            raise ConfigError(f"cannot make test hosts: {reason}")
        self.__exit__()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.hosts):
                ns, outside, inside = self.namespace(i), f"{self.prefix}v{i}", self._inside(i)
                _ip("netns", "add", ns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                if self.mbit is not None:
                    self._shape(outside, None)  # toward the host
                    self._shape(inside, ns)  # from the host
            if self.behind_nat:
                self._add_natted()
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise ConfigError(f"cannot make test hosts: {' '.join(exc.cmd)}: {exc.stderr.decode().strip()}") from exc
        return self

    def __exit__(self, *exc) -> None:
        natted = [f"{self.prefix}n{j}" for j in range(self.behind_nat)] + ([f"{self.prefix}r"] if self.behind_nat else [])
        for ns in [self.namespace(i) for i in range(self.hosts)] + natted:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # a namespace goes, with its end of each veth, only once the last process in it has exited:
        # the ends here go now, so that a network of the same names can follow at once
        for outside in [f"{self.prefix}v{i}" for i in range(self.hosts)] + ([f"{self.prefix}vr"] if self.behind_nat else []):
            subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
