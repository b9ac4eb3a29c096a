"""Each node's launch for `lucifer-shard serve --nnodes N`: the node-to-node link's interface settings serve
gives vLLM, and one script per node that starts `lucifer-shard serve` on that node's share (docs/three-boxes.md).

A script, not a systemd unit: the first starts are attended (node 0 first, the others once it listens; a
failed preflight must show on the terminal), and a script is what a unit's ExecStart would run anyway.
Each script runs serve, not vllm, so that every box runs its own preflight on its own share.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lucifer_shard.errors import STAGE_AGAIN, PreflightFailed, UsageRefused
from lucifer_shard.guarded_io import Refused, Tree, read_regular
from lucifer_shard.output.share import identity_line

# serve's link options -> the environment variables vLLM's process group libraries read: NCCL's TCP bootstrap
# and socket transport, gloo's (vLLM's CPU group: its metadata, and lucifer_tp3's cross-node check), and the
# RDMA devices NCCL uses (a DGX Spark's ConnectX-7 ports; `ibdev2netdev` pairs them with interfaces).
# VLLM_HOST_IP: the address vLLM gives the other nodes for this one (its own guess may be another link's).
LINK_ENV = {
    "ifname": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "ib_hca": ("NCCL_IB_HCA",),
    "host_ip": ("VLLM_HOST_IP",),
}
EXPECT_FLAG = "--expect-identity"  # what each script gives its node's serve: the identity of the output written from
VENV_VAR = "LUCIFER_VENV"  # a box whose lucifer-shard is in a venv not active: LUCIFER_VENV=/path/venv bash node-R.sh
NODE_KEY = re.compile(r"([0-9]+)=(.*)", re.S)  # R=VALUE: node R's value
SCRIPT_NAME = "node-{rank}.sh"
SHARE_VAR = "LUCIFER_SHARE"  # a box whose share is elsewhere: LUCIFER_SHARE=/path bash node-R.sh
SCRIPT_MODE = 0o755
SYS = Path("/sys")
DOWN = ("down", "lowerlayerdown", "notpresent")  # operstate values of a link that carries nothing


def link_environment(ifname: str | None, ib_hca: str | None, host_ip: str | None = None) -> dict[str, str]:
    """The variables serve adds to vLLM's environment for --ifname / --ib-hca / --host-ip (those given)."""
    given = {"ifname": ifname, "ib_hca": ib_hca, "host_ip": host_ip}
    return {var: value for opt, value in given.items() if value for var in LINK_ENV[opt]}


@dataclass(frozen=True)
class Links:
    """The link options as given, per node: `ifname` and `host_ip` map a node rank (None: every node) to its value."""

    ifname: dict[int | None, str]
    ib_hca: str | None
    host_ip: dict[int | None, str]

    def given(self) -> bool:
        return bool(self.ifname or self.ib_hca or self.host_ip)

    def of(self, rank: int) -> tuple[str | None, str | None, str | None]:
        """Node `rank`'s (ifname, ib_hca, host_ip): its own value, else the one for every node."""
        return self.ifname.get(rank, self.ifname.get(None)), self.ib_hca, self.host_ip.get(rank, self.host_ip.get(None))


def parse_links(ifname: Sequence[str], ib_hca: str | None, host_ip: Sequence[str], nnodes: int | None,
                every_node: bool) -> Links:
    """serve's --ifname and --host-ip, each given as VALUE (this node's; with --write-launch every node's) or
    R=VALUE per node (repeated); UsageRefused for a node named twice or out of range, a --host-ip that is no IP
    address, or one --host-ip for every node's launch (`every_node`: they cannot share one address)."""
    ifnames, ips = _per_node("--ifname", ifname, nnodes), _per_node("--host-ip", host_ip, nnodes)
    for rank, addr in ips.items():
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise UsageRefused(f"--host-ip {addr!r}: not an IP address; pass the node's address on the link between "
                               f"the boxes (`ip -br addr` lists them), as VLLM_HOST_IP takes it") from None
    if every_node and None in ips and (nnodes or 1) > 1:
        raise UsageRefused(f"--host-ip {ips[None]}: every node's launch would give each node this one address; pass "
                           f"R=ADDR per node (--host-ip 0=ADDR0 --host-ip 1=ADDR1 ...)")
    return Links(ifnames, ib_hca, ips)


def _per_node(option: str, values: Sequence[str], nnodes: int | None) -> dict[int | None, str]:
    table: dict[int | None, str] = {}
    for value in values:
        keyed = NODE_KEY.fullmatch(value)
        rank = int(keyed.group(1)) if keyed else None
        if keyed:
            value = keyed.group(2)
            if nnodes is not None and rank >= nnodes:
                raise UsageRefused(f"{option} {rank}={value}: nodes are numbered 0..{nnodes - 1}")
        if rank in table:
            which = f"node {rank}" if rank is not None else "a value without R= (every node's)"
            raise UsageRefused(f"{option}: {which} given twice; pass one value per node (R=VALUE)")
        if not value:
            raise UsageRefused(f"{option}: an empty value")
        table[rank] = value
    return table


def interface_problem(ifname: str, present: Sequence[str] | None = None, sys_root: Path | None = None) -> str | None:
    """Why `ifname` (one interface, or a comma-separated list, as NCCL and gloo take it: a triangle's two ports)
    cannot carry this node's traffic here (no such interface, or one is down), or None. `present`: the host's
    interface names (socket.if_nameindex's, by default); `sys_root`: SYS by default."""
    names = [n for _, n in socket.if_nameindex()] if present is None else list(present)
    for name in ifname.split(","):
        if name not in names:
            which = f" {name}" if name != ifname else ""  # in a list, which one
            return (f"--ifname {ifname}: no such network interface{which} on this host (it has "
                    f"{', '.join(sorted(names))}); pass the interface of the link between the boxes (`ip -br addr` "
                    f"lists them with their addresses)")
        state = _read_text((sys_root or SYS) / "class" / "net" / name / "operstate")
        if state in DOWN:  # "unknown" is what virtual and some RDMA netdevs report while they carry traffic
            return (f"--ifname {ifname}: {name} is {state} (its cable, or `ip link set {name} up`; `ip -br link` "
                    f"shows each state)")
    return None


def ib_hca_problem(ib_hca: str, sys_root: Path | None = None) -> str | None:
    """Why NCCL would find none of `ib_hca`'s RDMA devices here, or None. NCCL_IB_HCA's syntax: `^` excludes
    the devices listed (nothing to check), `=` matches names exactly (else as prefixes), `:port` per device."""
    if ib_hca.startswith("^"):
        return None
    exact = ib_hca.startswith("=")
    wanted = [d.split(":", 1)[0] for d in ib_hca.lstrip("=").split(",") if d]
    folder = (sys_root or SYS) / "class" / "infiniband"
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    missing = [d for d in wanted if not any(n == d if exact else n.startswith(d) for n in present)]
    if not missing:
        return None
    have = f"it has {', '.join(present)}" if present else f"{folder} is empty or missing: no RDMA device or driver"
    return (f"--ib-hca {ib_hca}: no RDMA device {', '.join(missing)} on this host ({have}); `ibdev2netdev` pairs "
            f"each with its interface")


def host_ip_problem(addr: str) -> str | None:
    """Why `addr` is not an address of this host (no socket binds to it), or None: the other nodes would reach
    this one at an address it does not answer on."""
    family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
    except OSError:
        return (f"--host-ip {addr}: not an address of this host; pass this node's address on the link between the "
                f"boxes (`ip -br addr` lists them)")
    return None


def link_problems(ifname: str | None, ib_hca: str | None, host_ip: str | None = None) -> list[str]:
    """Every reason this host's link options cannot work, checked where serve starts (and in its dry run)."""
    return [p for p in (interface_problem(ifname) if ifname else None, ib_hca_problem(ib_hca) if ib_hca else None,
                        host_ip_problem(host_ip) if host_ip else None) if p]


def expected_identity(conversion_id: str, content: str) -> str:
    """The value of EXPECT_FLAG: the full conversion id and content identity (the nodes' line shows 12 digits)."""
    return f"{conversion_id},{content}"


def refuse_other_share(out: Path, conversion_id: str, content: str, expected: str) -> None:
    """PreflightFailed, in one line, when OUT is not of the output the launch was written from (EXPECT_FLAG):
    a share of another conversion or of other weights, found before vLLM starts on any box."""
    want_id, _, want_content = expected.partition(",")
    if (want_id, want_content) == (conversion_id, content):
        return
    what = "other weights" if want_id == conversion_id else "another conversion"
    raise PreflightFailed(
        f"{out}: a share of {identity_line(conversion_id, content)}, not of {identity_line(want_id, want_content)} "
        f"that this launch was written for ({what})", remedy=STAGE_AGAIN.at(ranks="--nnodes N --node-rank R").after(
            "put this node's share of that output there", "fetch it, or write the launch again from this share's output"))


def _read_text(path: Path) -> str:
    try:
        return read_regular(path, 64, follow=True).decode(errors="replace").strip()
    except (OSError, Refused):  # not readable here (no sysfs): nothing known against it
        return "unknown"


def node_serve_args(nnodes: int, node_rank: int, master_addr: str, master_port: int | None, draft: bool,
                    draft_tokens: int | None, ifname: str | None, ib_hca: str | None,
                    vllm_args: Sequence[str], host_ip: str | None = None, expect: str | None = None) -> list[str]:
    """serve's arguments after OUT for node `node_rank`: its rank, its link (interface, host IP), the rest the
    same for every node; `expect`: the identity its share must have (EXPECT_FLAG)."""
    args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr]
    args += ["--master-port", str(master_port)] if master_port else []
    args += ["--draft"] if draft else []
    args += ["--draft-tokens", str(draft_tokens)] if draft_tokens else []
    args += ["--ifname", ifname] if ifname else []
    args += ["--ib-hca", ib_hca] if ib_hca else []
    args += ["--host-ip", host_ip] if host_ip else []
    args += [EXPECT_FLAG, expect] if expect else []
    return args + (["--", *vllm_args] if vllm_args else [])


def launch_script(share: Path, node_rank: int, nnodes: int, identity: str, args: Sequence[str]) -> str:
    """Node `node_rank`'s script: serve on its share (at `share` unless LUCIFER_SHARE names another path).

    Every value reaches serve as exactly the argv it was given: each is one single-quoted word (shlex), never
    inside double quotes or a `${VAR:-default}`, where the shell would still run `$(...)` and backticks."""
    order = "start it first: it serves the API" if node_rank == 0 else "start it once node 0 is up (headless)"
    name = SCRIPT_NAME.format(rank=node_rank)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# lucifer-shard: node {node_rank} of {nnodes}; {order}.",
        f"# Its share must be of {_comment_text(identity)}: `lucifer-shard inspect \"$SHARE\"` prints that identity line,",
        f"# and serve refuses any other share before vLLM starts ({EXPECT_FLAG}).",
        "# lucifer-shard runs from the environment it is installed in, with vLLM: activate it first",
        f"# (source VENV/bin/activate), or name it: {VENV_VAR}=VENV bash {name}",
        "set -euo pipefail",
        f'if [ -n "${{{VENV_VAR}:-}}" ]; then set +u; . "${VENV_VAR}/bin/activate"; set -u; fi',
        f'command -v lucifer-shard >/dev/null || {{ echo "{name}: lucifer-shard is not on PATH: activate the '
        f'environment it is installed in (source VENV/bin/activate) or run {VENV_VAR}=VENV bash {name}" >&2; exit 127; }}',
        f"DEFAULT_SHARE={shlex.quote(str(share))}",
        f"SHARE=\"${{{SHARE_VAR}:-$DEFAULT_SHARE}}\"",  # a variable's value is never expanded again
        'case "$SHARE" in -*) SHARE="./$SHARE";; esac',  # a relative path is never read as an option
        f"exec lucifer-shard serve \"$SHARE\" {shlex.join(args)}",
        "",
    ])


def _comment_text(text: str) -> str:
    """`text` for a comment line: a newline or other control character would end the comment and start code."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def write_launch(folder: Path, scripts: dict[int, str]) -> list[Path]:
    """Write each node's script into `folder` (made if missing), executable; UsageRefused before writing any
    when one is there already (serve never replaces a file it did not just write)."""
    tree = Tree(folder)
    names = {rank: SCRIPT_NAME.format(rank=rank) for rank in scripts}
    if folder.exists():
        there = [n for n in names.values() if tree.lstat(n) is not None]
        if there:
            raise UsageRefused(f"--write-launch {folder}: {', '.join(there)} already there; remove them or name "
                               f"another folder")
    folder.mkdir(parents=True, exist_ok=True)
    for rank, text in scripts.items():
        tree.write_bytes(names[rank], text.encode("utf-8", "surrogateescape"))  # a path's non-UTF-8 bytes as they are
        fd = tree.open_read(names[rank])  # the file just written (never a link): made executable
        try:
            os.fchmod(fd, SCRIPT_MODE)
        finally:
            os.close(fd)
    return [tree.path(names[rank]) for rank in scripts]
