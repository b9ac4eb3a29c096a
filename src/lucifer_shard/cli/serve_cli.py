"""`lucifer-shard doctor` and `lucifer-shard serve`: thin click commands over lucifer_shard.runtime_shim.serving.doctor.

The runtime shim (and with it vLLM) is imported inside the command bodies only: the converter never
imports vLLM at import time.
"""
from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import click

from ..errors import CONVERT, CONVERT_RESUME, DOCTOR, CheckFailed, MismatchError, OutputError, PreflightFailed, Remedy, UsageRefused
from ..model.arches import backends_help
from ..model.config import MTP
from ..model.drafts import DRAFT_KINDS
from ..output.share import identity_line
from .console import Console, conventions

SERVE_EXAMPLE = "lucifer-shard serve OUT [OPTIONS] -- --max-model-len 65536"


class ServeCommand(click.Command):
    """`serve OUT [OPTIONS] [-- VLLM_ARGS...]`: serve's own options anywhere before `--`, vLLM's after it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own, vllm_args = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        try:
            rest = super().parse_args(ctx, own)
        except click.UsageError as e:
            if isinstance(e, click.NoSuchOption) and e.possibilities:  # a typo of serve's own option
                raise
            if not (isinstance(e, click.NoSuchOption) or "extra argument" in e.message):
                raise
            raise click.UsageError(f"{e.message.rstrip('.')}; vLLM's own arguments go after `--`: {SERVE_EXAMPLE}",
                                   ctx) from None
        ctx.params["vllm_args"] = tuple(vllm_args)
        return rest

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- VLLM_ARGS]..."]


def _failed(checks) -> list:
    from ..runtime_shim.serving.doctor import FAIL

    return [c for c in checks if c.status == FAIL]


def _refusal(failed: list, message: str, otherwise: type[CheckFailed] | type[PreflightFailed],
             remedy: Remedy | None = None):
    """The error for failed checks: kind mismatch when one finds OUT damaged or edited (as every command
    that reads OUT says it), else `otherwise` (check_failed, preflight_failed)."""
    return (MismatchError if any(c.damage for c in failed) else otherwise)(message, remedy=remedy)


def _manifest_or_none(out: Path | None):
    """OUT's manifest, or None where it cannot be read (the output check then says why)."""
    from ..runtime_shim.errors import ShimError
    from ..runtime_shim.manifest import load_manifest

    try:
        return None if out is None else load_manifest(out)
    except ShimError:
        return None


def _output_dir(out: Path) -> Path:
    """OUT as an absolute path (vLLM gets it so). The OUT rule of every command: what is not a
    lucifer-shard output at all is an OutputError (exit 2) that names the next step; a damaged one is
    left to the checks."""
    from ..outnames import MANIFEST_NAME, STATE_DIR
    from ..output.manifest import COMPLETE_NAME
    from .argorder import is_checkpoint

    if out.is_file():
        raise OutputError(f"{out}: a file, not an output directory; pass the directory lucifer-shard convert wrote")
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    if is_checkpoint(out):
        raise OutputError(f"{out}: this is a checkpoint: convert it first, then use OUT",
                          remedy=CONVERT.at(model=str(out), out="OUT"))
    if (out / STATE_DIR).is_dir() and not ((out / MANIFEST_NAME).is_file() and (out / COMPLETE_NAME).exists()):
        raise OutputError(f"{out}: unfinished", remedy=CONVERT_RESUME)
    if not (out / MANIFEST_NAME).exists():
        raise OutputError(f"{out}: not a lucifer-shard output (no {MANIFEST_NAME}): convert into it first",
                          remedy=CONVERT.at(model="MODEL", out=str(out)))
    return out.resolve()


def _nodes(nnodes: int | None, node_rank: int | None, master_addr: str | None,
           master_port: int | None) -> dict | None:
    """vLLM's multi-node options, as serve takes them before `--` and passes them on; None: one node."""
    if nnodes is None and node_rank is None and master_addr is None and master_port is None:
        return None
    if nnodes is None or node_rank is None or master_addr is None:
        raise UsageRefused("--nnodes, --node-rank and --master-addr go together (--master-port optional); pass "
                           "all three, or none for one node")
    if node_rank >= nnodes:
        raise UsageRefused(f"--node-rank {node_rank}: nodes are numbered 0..{nnodes - 1}")
    if not is_host(master_addr):
        raise UsageRefused(f"--master-addr {master_addr!r}: not a host name or IP address; pass node 0's address "
                           f"(serve adds --headless itself on nodes above 0)")
    return {"nnodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port}


HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def is_host(text: str) -> bool:
    """A host name (RFC 1123 labels) or an IPv4/IPv6 address: what vLLM can connect to as --master-addr."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and HOST_NAME.fullmatch(text) is not None


def _importing_note(con: Console) -> None:
    """Importing vLLM takes from seconds to a minute: say so before the wait."""
    from ..runtime_shim.serving.doctor import vllm_identity

    version = vllm_identity()[0]
    if version is not None:
        con.note(f"importing vLLM {version} to check it (this can take a minute) ...")


def draft_asked(draft: bool, mtp: bool, out: Path | None, manifest) -> bool:
    """Whether serve (or doctor) is asked for OUT's own draft: --draft takes whichever kind OUT holds,
    --mtp only an MTP layer (a DSpark output served as MTP would build a class that has none of its weights)."""
    from ..runtime_shim.manifest import draft_kind

    held = draft_kind(manifest) if manifest is not None else None
    if mtp and held not in (None, MTP):
        kind = DRAFT_KINDS[held]
        raise UsageRefused(f"--mtp: {out}/draft holds a {kind.label}, not an MTP layer; use --draft "
                           f"(--speculative-config method {kind.method!r})")
    return draft or mtp


DRAFT_HELP = ("With OUT's own draft (speculative decoding), whichever kind OUT/draft holds: an MTP layer (method "
              "'mtp') or DeepSeek-V4-Flash-0731's DSpark drafter (method 'dspark').")
MTP_HELP = "As --draft, refused unless OUT's draft is an MTP layer (the original DeepSeek-V4-Flash)."


@click.command("doctor")
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--draft", is_flag=True, help="Also check that OUT can be served with its draft (serve --draft): "
              + DRAFT_HELP.split(", ", 1)[1])
@click.option("--mtp", is_flag=True, help=MTP_HELP)
@click.option("--ifname", default=None, metavar="IFACE[,IFACE]",
              help="Also check the interface(s) serve --ifname would name on this box: present and up.")
@click.option("--ib-hca", default=None, metavar="HCA", help="Also check the RDMA device(s) serve --ib-hca would name "
              "(NCCL_IB_HCA's syntax): present under /sys/class/infiniband.")
@click.option("--host-ip", default=None, metavar="ADDR",
              help="Also check that serve --host-ip's address (VLLM_HOST_IP) is one of this box's.")
@conventions(interrupted="interrupted: doctor changes nothing")
def doctor(out: Path | None, draft: bool, mtp: bool, ifname: str | None, ib_hca: str | None,
           host_ip: str | None) -> None:
    """Check this environment for serving lucifer-shard outputs (and OUT, if given) with vLLM.

    Prints each check with its fix: given OUT, its TP size, arch, layout and roles first; then
    lucifer-shard's install and dependencies, the vLLM version and commit, each symbol the shim
    needs with its source hash, virtual-TP support, the plugin registration and the GPU. Then which
    vLLM builds serve which outputs (--arch, expert layout, draft) and how far each is proven, where
    to get one (inside a vetted build: that one first), and how to put lucifer-shard into it. Runs
    with or without vLLM. --ifname, --ib-hca and --host-ip check this box's link as serve's dry run
    does (docs/three-boxes.md, §3). Exit 1 if a check fails.
    """
    from ..runtime_shim.serving.doctor import doctor_report, format_report
    from ..runtime_shim.serving.guide import builds, guide_lines, installed_build, routes

    if (draft or mtp) and out is None:
        raise UsageRefused(f"--{'draft' if draft else 'mtp'} checks an output's draft: pass OUT")
    con = Console.of()
    out = None if out is None else _output_dir(out)
    asked = draft_asked(draft, mtp, out, _manifest_or_none(out))
    _importing_note(con)
    checks = doctor_report(out, asked) + _link_checks(ifname, ib_hca, host_ip)
    here = installed_build()
    con.emit({"checks": [c.to_dict() for c in checks], "builds": builds(),
              "routes": [{"route": r, "how": h} for r, h in routes(here)]},
             [format_report(checks, verbose=con.verbosity > 0), "", *guide_lines(here)])
    failed = _failed(checks)
    if failed:
        raise _refusal(failed, f"doctor: {len(failed)} check(s) failed; first: {failed[0]}", CheckFailed)


def _with_backends(f):
    """Writes model/arches.py's backends per --arch into serve's help, in place of its docstring's BACKENDS line."""
    f.__doc__ = f.__doc__.replace("BACKENDS\n", "\n      ".join(backends_help()) + "\n", 1)
    return f


@click.command("serve", cls=ServeCommand)
@_with_backends
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True,
              help="Print the preflight report and the exact vllm command, run nothing. Exit 0 when the "
                   "preflight passes, and on a machine without vLLM (the conversion box) when OUT's own checks "
                   "pass: the environment's are then skipped, to be run on the serving host. The command is "
                   "printed only then.")
@click.option("--draft", is_flag=True, help="Serve " + DRAFT_HELP.split(" ", 1)[1] + " Adds --speculative-config "
              "'{\"method\":M,\"num_speculative_tokens\":K}'.")
@click.option("--mtp", is_flag=True, help=MTP_HELP)
@click.option("--draft-tokens", "--mtp-tokens", "mtp_tokens", type=click.IntRange(1), default=None,
              help="With --draft: draft tokens per step (K)  [default: the manifest's: 1 for MTP (more reruns the "
                   "one layer), the config's dspark_block_size for DSpark]")
@click.option("--nnodes", type=click.IntRange(1), default=None,
              help="vLLM's multi-node launch: the node count (the TP size must divide by it); with --node-rank and "
                   "--master-addr. The preflight checks this node's ranks; the dry run prints every node's command.")
@click.option("--node-rank", type=click.IntRange(0), default=None, help="With --nnodes: this node, 0..N-1.")
@click.option("--master-addr", default=None, help="With --nnodes: node 0's address, as vLLM takes it.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="With --nnodes: node 0's port (vLLM's default when left out).")
@click.option("--ifname", multiple=True, metavar="[R=]IFACE",
              help="With --nnodes: the network interface of the link between the boxes (e.g. a ConnectX port; a "
                   "triangle's two: IFACE,IFACE; `ip -br addr` lists them). vLLM gets NCCL_SOCKET_IFNAME and "
                   "GLOO_SOCKET_IFNAME=IFACE; refused before vLLM starts where this host has no such interface or it "
                   "is down (the dry run says so). R=IFACE, repeated, names node R's (--write-launch writes each "
                   "into its node's script; IFACE alone: every node's).")
@click.option("--ib-hca", default=None, metavar="HCAS",
              help="With --nnodes: the RDMA devices NCCL may use (NCCL_IB_HCA, e.g. mlx5_0,mlx5_1; `ibdev2netdev` "
                   "pairs them with interfaces); refused before vLLM starts where /sys/class/infiniband has none of "
                   "them (the dry run says so).")
@click.option("--host-ip", multiple=True, metavar="[R=]ADDR",
              help="With --nnodes: this node's address on that link, as vLLM gives it to the other nodes "
                   "(VLLM_HOST_IP); refused before vLLM starts where it is no address of this host. With "
                   "--write-launch: R=ADDR, repeated, node R's (docs/three-boxes.md, §3).")
@click.option("--expect-identity", default=None, metavar="CONVERSION,CONTENT",
              help="Refuse OUT, before vLLM starts, unless it is of this conversion id and content identity (each "
                   "--write-launch script passes its output's, so that a wrong share stops at its own node).")
@click.option("--write-launch", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
              help="With --nnodes and --master-addr (--node-rank defaults to 0): run the dry run, then write "
                   "DIR/node-R.sh for every node: each runs lucifer-shard serve on that node's share with these "
                   "options and that node's --ifname/--host-ip, refusing a share of another output (copy each to "
                   "its box; LUCIFER_SHARE=PATH names a share at another path, LUCIFER_VENV=VENV the environment "
                   "to activate). Starts nothing.")
@click.option("--no-kernel-cache", is_flag=True,
              help="Leave the compilers' caches where vLLM's defaults put them. Without it every cache vLLM's start "
                   "fills is OUT/kernel-cache/run/, started from the recorded cache (lucifer-shard cache record) only "
                   "when its key is this start's and every file verifies, else cold "
                   "(docs/serving.md#kernel-caches-a-warm-start).")
@conventions(interrupted="interrupted: serve started nothing")
def serve(out: Path, dry_run: bool, draft: bool, mtp: bool, mtp_tokens: int | None, nnodes: int | None,
          node_rank: int | None, master_addr: str | None, master_port: int | None, ifname: tuple[str, ...],
          ib_hca: str | None, host_ip: tuple[str, ...], expect_identity: str | None, write_launch: Path | None,
          no_kernel_cache: bool, vllm_args: tuple[str, ...]) -> None:
    """Preflight OUT against the installed vLLM, then exec `vllm serve OUT` with the flags it needs.

    \b
    The command is
      vllm serve /abs/OUT --tensor-parallel-size <from the manifest> --load-format lucifer_tp3
        --attention-backend A --moe-backend M
        [--speculative-config '{"method":M,"num_speculative_tokens":K}'  with --draft: M is "mtp"
          for an MTP layer, "dspark" for DeepSeek-V4-Flash-0731's DSpark drafter]
        [VLLM_ARGS: everything after `--`]
    with A, M for the output's --arch on stock vLLM (virtual TP supplied by the plugin):
      BACKENDS
    (a model-layout output may take another --moe-backend among VLLM_ARGS: vLLM lays its experts out);
    for an output converted without --arch, those of the serving host's GPU (left out where no GPU
    is visible); FLASHINFER_MLA_SPARSE_DSV4, flashinfer_cutlass on a vetted mlow/vllm build.
    VLLM_ARGS the plugin refuses at load are refused here, before vLLM starts: a pipeline, data or
    prefill-context parallel size above 1, --enable-expert-parallel, --enable-eplb, --enable-lora,
    a --model-loader-extra-config that is not an object of the loader's keys (verify, role).
    e.g. lucifer-shard serve out/ --draft -- --max-model-len 65536 --port 8000
    Three boxes: lucifer-shard serve OUT --nnodes 3 --master-addr H --ifname IFACE --write-launch DIR
    writes DIR/node-R.sh, each node's serve on its share (docs/three-boxes.md); on a triangle
    (no switch), each node's own: --ifname 0=IF0 --host-ip 0=ADDR0 --ifname 1=IF1 --host-ip 1=ADDR1 ...
    Before exec, the preflight checks OUT and what needs no vLLM import (package versions, the
    vllm command, the plugin's entry point, an NVIDIA GPU in sight of nvidia-smi unless vLLM is the
    CPU build): it adds well under 2 s to the start. The checks that
    need vLLM (symbols, source hashes, virtual TP, the GPU) run inside vLLM's own process as it
    starts, where the plugin is loaded anyway; a failed check stops serve, or vLLM, with exit 1.
    --dry-run runs every check (`lucifer-shard doctor OUT`).
    """
    con = Console.of()
    served = preflight_serve(con, out, dry_run, draft, mtp, mtp_tokens, nnodes, node_rank, master_addr, master_port,
                             ifname, ib_hca, host_ip, expect_identity, write_launch, not no_kernel_cache, vllm_args)
    show_served(con, served)


@dataclass(frozen=True)
class Served:
    """What serve found: the preflight's verdict on OUT and this host, the vllm command (None where OUT's
    manifest is refused) and, for a dry run, the lines it ends with."""

    out: Path
    manifest: object | None
    dry_run: bool
    draft: bool  # served with OUT's draft
    argv: list[str] | None
    checks: list
    verdict: object
    notes: list[str]
    tail: list[str]
    link: tuple  # this node's (ifname, ib_hca, host_ip): launch.Links.of
    caches: Callable  # kernel_cache.serve_start for this start, but for its dry_run argument

    @property
    def line(self) -> str | None:
        """The command as one shell line; None where none is printed."""
        if self.argv is None or (self.dry_run and not self.verdict.ok):  # -q's capture gets no command to run
            return None
        return shlex.join(self.argv)


def preflight_serve(con: Console, out: Path, dry_run: bool, draft: bool, mtp: bool, mtp_tokens: int | None,
                    nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
                    ifname: tuple[str, ...], ib_hca: str | None, host_ip: tuple[str, ...],
                    expect_identity: str | None, write_launch: Path | None, kernel_cache: bool,
                    vllm_args: tuple[str, ...]) -> Served:
    """serve up to the exec: the refusals of its options, OUT's manifest, the vllm command (built by one
    call, for this node and every other), the preflight and, with --write-launch, every node's script."""
    from ..runtime_shim.errors import ShimError
    from ..runtime_shim.manifest import draft_kind, draft_tokens, load_manifest
    from ..runtime_shim.serving import doctor as dr, kernel_cache as kc, launch, serve as sv

    if mtp_tokens is not None and not (draft or mtp):
        raise UsageRefused("--draft-tokens applies only with --draft")
    if con.json and not dry_run:
        raise UsageRefused("--json applies only with --dry-run (serve otherwise becomes vLLM)")
    share_node = write_launch is not None and node_rank is None  # a share then tells its node (below)
    if write_launch is not None:
        if nnodes is None:
            raise UsageRefused("--write-launch writes every node's launch: pass --nnodes N and --master-addr H")
        node_rank, dry_run = 0 if node_rank is None else node_rank, True
    nodes = _nodes(nnodes, node_rank, master_addr, master_port)
    if (ifname or ib_hca or host_ip) and nodes is None:
        raise UsageRefused(f"--{'ifname' if ifname else 'ib-hca' if ib_hca else 'host-ip'} sets the link between "
                           f"nodes: it applies with --nnodes")
    links = launch.parse_links(ifname, ib_hca, host_ip, nnodes, write_launch is not None)
    out = _output_dir(out)
    try:
        manifest = load_manifest(out)
        tp, arch = manifest.tp_size, manifest.arch
    except ShimError:
        manifest = tp = arch = None  # the output check says why; no command is printed for it
    if expect_identity and manifest is not None:
        launch.refuse_other_share(out, manifest.conversion_id, manifest.content_identity, expect_identity)
    mtp = draft_asked(draft, mtp, out, manifest)  # from here on: serve with OUT's draft
    tokens = (mtp_tokens or (draft_tokens(manifest) if manifest is not None else 1)) if mtp else None
    layout = manifest.expert_layout if manifest is not None else "kernel"
    backends = dr.serve_backends(arch, layout, manifest.options.moe_backend) if manifest is not None else None
    node_ranks = None  # the TP ranks this node runs: all of them on one node
    if tp is not None:
        from ..output.share import SHARE_NAME, node_ranks as ranks_of

        if share_node:
            _refuse_another_nodes_share(out, manifest.conversion_id, tp, nnodes)

        # --write-launch on a whole output (the conversion box) checks every node's ranks; on a share, its own
        every_node = write_launch is not None and not (out / SHARE_NAME).exists()
        node_ranks = ranks_of(tp, nnodes, node_rank) if nodes is not None and not every_node else list(range(tp))
    # the one vllm command, for this node and (the dry run's list) every other
    kind = draft_kind(manifest) if manifest is not None else MTP
    argv_of = partial(sv.serve_argv, out, tp or 1, vllm_args, tokens, backends=backends, expert_layout=layout,
                      draft_kind=kind, moe_route=manifest.options.moe_backend if manifest is not None else None)
    try:  # the refused vLLM arguments are refused whatever OUT is
        argv = argv_of(node=nodes)
    except ShimError as e:
        raise UsageRefused(str(e)) from None
    if manifest is None:
        argv = None
    elif shutil.which("vllm") is None and dr.vllm_command():  # beside this python, not on PATH
        argv[0] = dr.vllm_command()
    if dry_run:  # the thorough report (it runs nothing, so it may take its time)
        _importing_note(con)
        checks = dr.doctor_report(out, mtp, node_ranks)
        if write_launch is None:  # this box's link (a launch written for every box checks it on each, at start)
            checks += _link_checks(*links.of(node_rank))
    else:  # before exec only what needs no vLLM import; the rest runs inside vLLM as it starts
        checks = dr.quick_checks(out, mtp, node_ranks, manifest)
    verdict = sv.preflight(checks, dry_run)
    notes = [n for n in (verdict.note(), sv.backends_remark() if backends is None and manifest is not None else None)
             if n]
    caches = partial(kc.serve_start, out, manifest, kind if mtp else None, tokens, vllm_args, kernel_cache)
    served = Served(out, manifest, dry_run, mtp, argv, checks, verdict, notes, [], links.of(node_rank), caches)
    if not dry_run:
        return served
    return replace(served, tail=_dry_run_tail(served, nodes, argv_of, write_launch, mtp_tokens, links, vllm_args))


def _dry_run_tail(served: Served, nodes: dict | None, argv_of, write_launch: Path | None, mtp_tokens: int | None,
                  links, vllm_args: tuple[str, ...]) -> list[str]:
    """The lines a dry run ends with: the command, every node's, or the launch scripts it wrote."""
    line = served.line
    if served.argv and not served.verdict.ok:
        return ["no command: the preflight failed (the FAIL lines above say what to fix)"]
    if not line:
        return ["no command: OUT's manifest is refused (the output check above says why)"]
    if write_launch is not None and served.verdict.output_ok:
        return _write_launch(write_launch, served.out, served.manifest, nodes, served.draft, mtp_tokens, links,
                             vllm_args)
    if nodes is None:
        return [line]
    nnodes = nodes["nnodes"]
    tail = ["every node's command (each on its own share: lucifer-shard stage OUT DEST --nnodes "
            f"{nnodes} --node-rank R, or convert ... --nnodes {nnodes} --node-rank R on that node; node 0 "
            f"serves the API, start it first). Each names this box's "
            f"path, {served.out}: on another box put the path of that node's share there:"]
    for r in range(nnodes):
        other = argv_of(node={**nodes, "node_rank": r})
        tail.append(f"  node {r}{' (this one)' if r == nodes['node_rank'] else ''}: "
                    f"{shlex.join([served.argv[0], *other[1:]])}")
    return tail


def show_served(con: Console, served: Served) -> None:
    """serve's rendering: the dry run's report and command, or the preflight's line and the exec into vLLM."""
    from ..runtime_shim.serving import doctor as dr, serve as sv

    verdict, line = served.verdict, served.line
    if served.dry_run:
        caches = served.caches(True)
        con.emit({"preflight_ok": verdict.ok, "output_ok": verdict.output_ok,
                  "environment_checked": verdict.environment_checked, "notes": served.notes,
                  "checks": [c.to_dict() for c in verdict.shown], "argv": served.argv if line else None,
                  "command": line, "kernel_caches": caches.to_dict()},
                 [dr.format_report(list(verdict.shown), verbose=con.verbosity > 0), "", *caches.lines(),
                  *served.notes, *served.tail])
    elif verdict.failed:
        click.echo("\n".join(str(c) for c in verdict.failed), err=True)
    else:
        con.note("; ".join([f"preflight passed ({len(served.checks)} checks before vLLM; vLLM's own run as it starts)",
                            identity_line(served.manifest.conversion_id, served.manifest.content_identity),
                            *served.notes, f"exec {line}"]))
    if not verdict.ok:
        raise _refusal(list(verdict.failed), f"serve: preflight failed ({len(verdict.failed)} check(s)); first: "
                       f"{verdict.failed[0]}", PreflightFailed, DOCTOR.at(out="OUT"))
    if not served.dry_run:
        from ..runtime_shim.serving import launch

        problems = launch.link_problems(*served.link)
        if problems:
            raise UsageRefused("; ".join(problems))
        caches = served.caches()
        con.note(caches.line)
        sv.exec_vllm(served.argv, {**sv.serve_environment(served.out, served.draft),
                                   **launch.link_environment(*served.link), **caches.env})


def _link_checks(ifname: str | None, ib_hca: str | None, host_ip: str | None) -> list:
    """The dry run's lines for --ifname, --ib-hca and --host-ip on this host: what the real start refuses (exit 2)."""
    from ..runtime_shim.checks import FAIL, OK, Check
    from ..runtime_shim.serving import launch

    checks = []
    if ifname:
        why = launch.interface_problem(ifname)
        checks.append(Check("--ifname", FAIL if why else OK, why or f"{ifname}: present and up here"))
    if ib_hca:
        why = launch.ib_hca_problem(ib_hca)
        checks.append(Check("--ib-hca", FAIL if why else OK, why or f"{ib_hca}: present here"))
    if host_ip:
        why = launch.host_ip_problem(host_ip)
        checks.append(Check("--host-ip", FAIL if why else OK, why or f"{host_ip}: an address of this host"))
    return checks


def _refuse_another_nodes_share(out: Path, conversion_id: str, tp: int, nnodes: int) -> None:
    """--write-launch without --node-rank runs as node 0: refused on a share of other ranks, whose own node
    is named (its dry run would check node 0's ranks, absent there)."""
    from ..output.share import SHARE_NAME, node_ranks as ranks_of, read_share

    try:
        share = read_share(out, conversion_id, tp)
    except OutputError:
        return  # not a valid record: the output check names it
    if share is None or list(share.ranks) == ranks_of(tp, nnodes, 0):
        return
    held = ",".join(map(str, share.ranks))
    node = f"node {share.node_rank}'s share (of {share.nnodes})" if share.node_rank is not None else \
        f"a share of rank(s) {held}"
    fix = f"pass --node-rank {share.node_rank}" if share.node_rank is not None else \
        "pass the --node-rank of the node that runs those ranks"
    raise UsageRefused(f"{out}: {node} by its {SHARE_NAME}, not node 0's, which --write-launch without --node-rank "
                       f"checks; {fix}, or write the launch from node 0's share or the whole output")


def _write_launch(folder: Path, out: Path, manifest, nodes: dict, draft: bool, tokens: int | None, links,
                  vllm_args: tuple[str, ...]) -> list[str]:
    """serve --write-launch: every node's script (src/lucifer_shard/runtime_shim/serving/launch.py), each with its
    node's link (`links`: launch.Links) and the identity its share must have; the lines the dry run ends with."""
    from ..runtime_shim.serving import launch

    identity = identity_line(manifest.conversion_id, manifest.content_identity)
    expect = launch.expected_identity(manifest.conversion_id, manifest.content_identity)
    scripts = {}
    for r in range(nodes["nnodes"]):
        ifname, ib_hca, host_ip = links.of(r)
        scripts[r] = launch.launch_script(out, r, nodes["nnodes"], identity, launch.node_serve_args(
            nodes["nnodes"], r, nodes["master_addr"], nodes["master_port"], draft, tokens, ifname, ib_hca, vllm_args,
            host_ip=host_ip, expect=expect))
    written = launch.write_launch(folder, scripts)
    return [f"every node's launch, written (copy node-R.sh to node R's box, which holds its share at {out} or at "
            f"LUCIFER_SHARE; start node 0 first):", *(f"  {p}" for p in written)]
