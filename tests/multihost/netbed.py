"""A multi-host test bed on one machine: one network namespace per host, a veth from each host
into a "switch" namespace holding a bridge, addresses in 10.231.0.0/24. That subnet exists only
inside the bed's namespaces: nothing here sends a packet to an address outside loopback and the
bed's own hosts.

Cleanup on every exit path:
  - names carry a per-run prefix (PREFIX + pid); Bed.destroy() kills the bed's processes and
    deletes its namespaces, and is called from `with Bed(...)`, atexit and SIGTERM/SIGINT;
  - every process started with Bed.spawn() gets PR_SET_PDEATHSIG=SIGKILL, so a killed test
    (ctest's timeout sends SIGKILL) takes its processes with it;
  - sweep_stale() (called at start, and by the bed_sweep ctest fixture) deletes namespaces
    with the prefix whose run is gone, after killing whatever still runs inside them.

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN); can_make_namespaces() says why not otherwise.
"""
import atexit
import ctypes
import os
import signal
import subprocess
import time

PREFIX = "pdbed"
SUBNET = "10.231.0"


def _run(*argv, check=True):
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def can_make_namespaces():
    """(True, '') or (False, why)."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = _run("ip", "link", "add", f"{PREFIX}p{os.getpid() % 100000}", "type", "veth", "peer", "name",
                 f"{PREFIX}q{os.getpid() % 100000}", "netns", probe, check=False)
        if r.returncode != 0:
            return False, f"cannot make a veth pair: {r.stderr.strip()}"
        _run("ip", "link", "del", f"{PREFIX}p{os.getpid() % 100000}", check=False)
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return True, ""


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_inside(ns):
    r = _run("ip", "netns", "pids", ns, check=False)
    for p in r.stdout.split():
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_stale(only_dead=True):
    """Deletes the bed namespaces of runs that are gone (all of them with only_dead=False)."""
    r = _run("ip", "netns", "list", check=False)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        run = name[len(PREFIX):].split("-")[0]
        if only_dead and run.isdigit() and _pid_alive(int(run)):
            continue
        _kill_inside(name)
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
        subprocess.run(["rm", "-rf", os.path.join("/etc/netns", name)])
    # Hosts files of namespaces already gone.
    live = {n.split()[0] for n in _run("ip", "netns", "list", check=False).stdout.splitlines() if n.split()}
    for d in os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []:
        if d.startswith(PREFIX) and d not in live:
            subprocess.run(["rm", "-rf", os.path.join("/etc/netns", d)])
    return removed


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setpgrp()


class Bed:
    """hosts: names ('router-0', 'prefill-0', ...); host i gets 10.231.0.(10 + i)."""

    def __init__(self, hosts, hosts_file=None):
        self.run = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.run}-sw"
        self.hosts = list(hosts)
        self.addr = {h: f"{SUBNET}.{10 + i}" for i, h in enumerate(self.hosts)}
        self.ns = {h: f"{self.run}-{i}" for i, h in enumerate(self.hosts)}
        self.port = {h: f"p{os.getpid() % 100000}s{i}" for i, h in enumerate(self.hosts)}  # switch side
        self.hosts_file = hosts_file or {}  # name -> [host]: /etc/hosts inside every namespace
        self.procs = []
        self.made = False

    # ---- life cycle ---------------------------------------------------------------------------
    def __enter__(self):
        self.create()
        return self

    def __exit__(self, *exc):
        self.destroy()

    def create(self):
        sweep_stale()
        atexit.register(self.destroy)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: (self.destroy(), os._exit(1)))
        self.made = True
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        _run("ip", "-n", self.switch, "link", "set", "lo", "up")
        for h in self.hosts:
            ns = self.ns[h]
            _run("ip", "netns", "add", ns)
            # Made inside the switch namespace, then one end moved: nothing touches the root one.
            _run("ip", "-n", self.switch, "link", "add", self.port[h], "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", self.port[h], "master", "br0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._write_hosts(ns)

    def _write_hosts(self, ns):
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: the bed's DNS.
        d = f"/etc/netns/{ns}"
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n")
            for h in self.hosts:
                f.write(f"{self.addr[h]} {h}\n")
            for name, targets in self.hosts_file.items():
                for t in targets:
                    f.write(f"{self.addr[t]} {name}\n")

    def destroy(self):
        if not self.made:
            return
        self.made = False
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in list(self.ns.values()) + [self.switch]:
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
            subprocess.run(["rm", "-rf", f"/etc/netns/{ns}"])

    # ---- processes ----------------------------------------------------------------------------
    def spawn(self, host, argv, env=None, log=None):
        """Starts argv on `host` (ip netns exec); it dies with this process."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        full_env = dict(os.environ)
        full_env.update(env or {})
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host]] + list(argv), stdout=out,
                             stderr=subprocess.STDOUT, env=full_env, preexec_fn=_die_with_parent)
        p.host = host
        self.procs.append(p)
        return p

    def run_in(self, host, argv, timeout=60, check=True):
        r = subprocess.run(["ip", "netns", "exec", self.ns[host]] + list(argv), capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{host}: {' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    # ---- faults -------------------------------------------------------------------------------
    def link(self, host, up):
        """The host's cable: down drops its packets silently (no reset reaches either side)."""
        _run("ip", "-n", self.switch, "link", "set", self.port[host], "up" if up else "down")

    def partition(self, a, b):
        """Drops every packet between hosts a and b, both ways and silently (no reset, no ICMP: a
        connect times out, an open connection stalls); other pairs are unaffected. Each side's
        ARP entry for the other is pinned to a MAC no port has, so the bridge delivers nothing."""
        for x, y in ((a, b), (b, a)):
            _run("ip", "-n", self.ns[x], "neigh", "replace", self.addr[y], "lladdr", "02:00:00:00:de:ad", "dev",
                 "eth0", "nud", "permanent")

    def heal(self, a, b):
        """Undoes partition(a, b)."""
        for x, y in ((a, b), (b, a)):
            _run("ip", "-n", self.ns[x], "neigh", "del", self.addr[y], "dev", "eth0", check=False)
