"""A sandbox per session worker: what one user's cell may see and touch on a shared server.

Each sandboxed worker starts under bubblewrap in PID, mount, IPC, UTS and cgroup namespaces (and a
user namespace when the server is not root),
as an unprivileged uid of its own session (when the server runs as root), with no capabilities and
`no_new_privs`; it sees the file system read-only except its session directory, a private /tmp and
a private /dev/shm; only its GPU's device nodes; cgroup limits on memory, processes and CPU; and a
network chosen by the admin (`none`, `outbound`: no route to this host's or the cluster's services,
`host`). See the README's isolation section for the threat model.
"""

from .policy import NETWORKS, Protection, SandboxPolicy, policy_of, probe, refuse_unisolated, require
from .sandbox import Sandbox, SandboxedWorker

__all__ = [
    "NETWORKS",
    "Protection",
    "Sandbox",
    "SandboxPolicy",
    "SandboxedWorker",
    "policy_of",
    "probe",
    "refuse_unisolated",
    "require",
]
