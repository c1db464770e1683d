"""Several "nodes" on one machine: one `deepspeed --no_ssh --node_rank i` launcher per node.

Each node is started in its own process group (so a test can SIGKILL a whole node: launcher and
rank) and, where possible, in its own network namespace joined to the other by a veth pair, so
the rendezvous and gloo traffic really cross between two "hosts" with their own addresses and
interfaces. Without root or `ip netns`, both nodes share the loopback interface instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tests.launch import ROOT, free_port, rank_command, subprocess_env

SUBNET = "10.77.0"  # only ever assigned inside the namespaces created here


@dataclass
class Node:
    """Where one node runs: its address in the hostfile, its namespace and gloo interface (if any)."""

    address: str
    netns: str | None = None
    ifname: str | None = None


@dataclass
class Cluster:
    nodes: list[Node]
    mode: str  # "netns" or "loopback"
    master_addr: str  # node 0's address
    reason: str = ""  # why loopback was used


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


NETNS_PREFIX = "dsmn-"
_COUNTER = 0


def _remove_stale_namespaces() -> None:
    """Namespaces this helper created in a test process that no longer exists (killed with SIGKILL)."""
    listing = _ip("netns", "list", check=False).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        parts = name[len(NETNS_PREFIX) :].split("-") if name.startswith(NETNS_PREFIX) else []
        if len(parts) == 3 and parts[0].isdigit() and not os.path.exists(f"/proc/{parts[0]}"):
            _ip("netns", "del", name, check=False)


def _netns_unavailable() -> str:
    """'' when network namespaces can be used, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if subprocess.run(["sh", "-c", "command -v ip"], capture_output=True).returncode != 0:
        return "iproute2 is not installed (apt-get install -y iproute2)"
    if os.environ.get("MULTI_NODE_TEST_NETNS", "1") == "0":
        return "MULTI_NODE_TEST_NETNS=0"
    return ""


@contextlib.contextmanager
def two_nodes(prefer_netns: bool = True):
    """Yields a Cluster of two nodes; namespaces and veth pair are removed on exit."""
    # The hostfile needs two DIFFERENT names (the launcher keys nodes by name); both are this machine.
    loopback = Cluster([Node("localhost"), Node("127.0.0.1")], "loopback", "127.0.0.1")
    reason = _netns_unavailable() if prefer_netns else "netns not requested"
    if reason:
        loopback.reason = reason
        yield loopback
        return
    _remove_stale_namespaces()
    global _COUNTER
    _COUNTER += 1
    pid = os.getpid()
    names = [f"{NETNS_PREFIX}{pid}-{_COUNTER}-{side}" for side in "ab"]
    ifnames = [f"mn{pid}x{_COUNTER}{side}"[-15:] for side in "ab"]  # interface names: <= 15 characters
    created = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", ifnames[0], "netns", names[0], "type", "veth", "peer", "name", ifnames[1], "netns", names[1])
        nodes = []
        for i, (ns, ifname) in enumerate(zip(names, ifnames)):
            address = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            nodes.append(Node(address, ns, ifname))
        _check_link(names, nodes)
        cluster = Cluster(nodes, "netns", nodes[0].address)
    except (subprocess.SubprocessError, RuntimeError, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        for ns in created:
            _ip("netns", "del", ns, check=False)
        created = []
        loopback.reason = f"ip netns failed: {detail.strip()}"
        cluster = loopback
    try:
        yield cluster
    finally:
        for ns in created:  # deleting a namespace also deletes its end of the veth pair (and the pair)
            _ip("netns", "del", ns, check=False)


def _check_link(names: list[str], nodes: list[Node]) -> None:
    """A TCP connection from namespace 0 to node 1's address (the rendezvous would fail obscurely)."""
    port = free_port()
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            names[1],
            sys.executable,
            "-c",
            "import socket,sys; s=socket.create_server((sys.argv[1], int(sys.argv[2])));"
            "s.settimeout(20); c,_=s.accept(); c.sendall(b'ok')",
            nodes[1].address,
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                names[0],
                sys.executable,
                "-c",
                "import socket,sys,time\nfor _ in range(100):\n try:\n"
                "  c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break\n"
                " except ConnectionRefusedError: time.sleep(0.1)\nprint(c.recv(2).decode())",
                nodes[1].address,
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if client.stdout.strip() != "ok":
            raise RuntimeError(f"the veth pair does not carry TCP: {client.stdout} {client.stderr}")
    finally:
        server.kill()
        server.wait()


def write_hostfile(path, cluster: Cluster, slots: int = 1) -> str:
    with open(path, "w") as f:
        f.writelines(f"{node.address} slots={slots}\n" for node in cluster.nodes)
    return str(path)


@dataclass
class NodeRun:
    node_rank: int
    proc: subprocess.Popen
    log_path: str
    killed_at: float | None = None
    ended_at: float | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@dataclass
class MultiNodeRun:
    nodes: list[NodeRun] = field(default_factory=list)

    def wait(self, timeout: float) -> list[int | None]:
        """Waits for every node until `timeout` seconds from now; None for a node still running."""
        deadline = time.time() + timeout
        while time.time() < deadline and any(n.proc.poll() is None for n in self.nodes):
            self.poll()
            time.sleep(0.2)
        self.poll()
        return [n.proc.poll() for n in self.nodes]

    def poll(self) -> None:
        for n in self.nodes:
            if n.ended_at is None and n.proc.poll() is not None:
                n.ended_at = time.time()

    def kill_node(self, node_rank: int) -> None:
        """SIGKILL the node's whole process group (launcher and its ranks), like a machine dying."""
        node = self.nodes[node_rank]
        node.killed_at = time.time()
        _killpg(node.proc)

    def kill_all(self) -> None:
        for n in self.nodes:
            _killpg(n.proc)
        for n in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=10)

    def logs(self, n_chars: int = 3000) -> str:
        return "\n".join(f"=== node {n.node_rank} ({n.log_path}) ===\n{n.log()[-n_chars:]}" for n in self.nodes)


def _killpg(proc: subprocess.Popen) -> None:
    # Only the group this helper created (start_new_session): the launcher and the ranks it started.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def start_nodes(
    cluster: Cluster,
    hostfile: str,
    module: str,
    args: list,
    log_dir,
    master_port: int | None = None,
    env: dict | None = None,
    script: str | None = None,
) -> MultiNodeRun:
    """Starts every node at once, each in its own session (process group) and namespace.

    Without `script`: `deepspeed --hostfile H --no_ssh --node_rank i --master_addr A --master_port P
    --module MODULE ARGS`. With `script` (e.g. scripts/step1_sft/run_multi_node.sh): `bash SCRIPT ARGS`
    with MULTI_NODE_MODE=no_ssh, HOSTFILE, NODE_RANK, MASTER_ADDR and MASTER_PORT set, as a scheduler
    would; the script then runs that same launcher command through scripts/common.sh.
    """
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    master_port = master_port or free_port()
    run = MultiNodeRun()
    for rank, node in enumerate(cluster.nodes):
        node_env = dict(env or subprocess_env())
        if script:
            cmd = ["bash", os.path.join(ROOT, script), *[str(a) for a in args]]
            node_env.update(
                {
                    "MULTI_NODE_MODE": "no_ssh",
                    "HOSTFILE": hostfile,
                    "NODE_RANK": str(rank),
                    "MASTER_ADDR": cluster.master_addr,
                    "MASTER_PORT": str(master_port),
                }
            )
        else:
            cmd = [
                launcher,
                "--hostfile",
                hostfile,
                "--no_ssh",
                "--node_rank",
                str(rank),
                "--master_addr",
                cluster.master_addr,
                "--master_port",
                str(master_port),
                "--module",
                module,
                *[str(a) for a in args],
            ]
        if node.netns:
            cmd = ["ip", "netns", "exec", node.netns, *cmd]
        if node.ifname:  # else gloo binds to the address the machine's hostname resolves to
            node_env["GLOO_SOCKET_IFNAME"] = node.ifname
        log_path = os.path.join(str(log_dir), f"node{rank}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        run.nodes.append(NodeRun(rank, proc, log_path))
    return run


@contextlib.contextmanager
def single_node_running(module: str, args: list, log_path: str, num_ranks: int = 2, env: dict | None = None):
    """N ranks on this node (tests.launch.rank_command, as run_deepspeed), but started in the background in
    its own process group, which is SIGKILLed on exit (no stray rank survives a timeout). Yields the
    NodeRun; wait with `.proc.wait(timeout)`. The ranks are forked by the tests' fork server (tests/zygote.py),
    whose supervisor SIGKILLs them when their front is killed."""
    cmd = rank_command(module, args, num_ranks, zygote=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env or subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield NodeRun(0, proc, log_path)
    finally:
        _killpg(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def nodes_running(*args, **kwargs):
    """start_nodes(...) whose process groups are SIGKILLed on exit, whatever happened."""
    run = start_nodes(*args, **kwargs)
    try:
        yield run
    finally:
        run.kill_all()


def run_nodes(*args, timeout: float = 300, **kwargs) -> MultiNodeRun:
    """Runs the nodes to completion (or `timeout`), then makes sure nothing of them survives."""
    with nodes_running(*args, **kwargs) as run:
        run.wait(timeout)
    return run
