"""`--session-network outbound`: sessions' uids may open connections anywhere except this host
(its loopback and its own addresses: the server, Ray's GCS and raylets, the pool endpoint, other
sessions' servers) and the cluster's other machines. One nftables table, matched by the socket's
owner (the sessions' uid range), added at server start and removed at stop."""

from __future__ import annotations

import ipaddress
import os
import subprocess

from .policy import SandboxPolicy


class OutboundFence:
    def __init__(self, policy: SandboxPolicy, table: str) -> None:
        self.policy, self.table = policy, table

    def rules(self) -> str:
        first, last = self.policy.uid_base, self.policy.uid_base + self.policy.uid_count - 1
        owner = f"meta skuid {first}-{last}"
        lines = [
            f"table inet {self.table} {{",
            "  chain output {",
            "    type filter hook output priority 0; policy accept;",
            f"    {owner} udp dport 53 accept",  # name lookups, through the host's resolver too
            f"    {owner} tcp dport 53 accept",
            f"    {owner} fib daddr type local reject",
            f"    {owner} ip daddr 169.254.0.0/16 reject",  # link-local: a cloud's metadata service
            f"    {owner} ip6 daddr fe80::/10 reject",
            f"    {owner} ip daddr 127.0.0.0/8 reject",
            f"    {owner} ip6 daddr ::1 reject",
        ]
        for address in self.policy.cluster_addresses:
            family = "ip6" if ipaddress.ip_address(address).version == 6 else "ip"
            lines.append(f"    {owner} {family} daddr {address} reject")
        lines += ["  }", "}"]
        return "\n".join(lines) + "\n"

    def install(self) -> None:
        self.remove()
        sweep_tables(self.table.rsplit("_", 1)[0])
        done = subprocess.run(["nft", "-f", "-"], input=self.rules(), capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise OSError(f"nftables refused the sessions' network rules: {done.stderr.strip()}")

    def remove(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True, timeout=10)


def sweep_tables(prefix: str) -> None:
    """Remove the tables of servers that died without removing theirs (named PREFIX_PID)."""
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    for line in listed.splitlines():
        name = line.split()[-1] if line.startswith("table inet ") else ""
        pid = name[len(prefix) + 1 :]
        if name.startswith(prefix + "_") and pid.isdigit() and not _alive(int(pid)):
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
