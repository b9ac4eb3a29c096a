"""Three boxes from one command: serve --write-launch writes each node's script, --ifname/--ib-hca reach vLLM's
environment, and every node's line (serve, doctor, inspect) carries the identity the loader compares across nodes."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import one_error, own_copy, run
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.runtime_shim.serving import doctor, launch, serve
from lucifer_shard.runtime_shim.serving.doctor import OK, Check

ADDR = "10.0.0.1"


def identity(out: Path) -> str:
    m = Manifest.load(out)
    return f"conversion {m.conversion_id[:12]}, content {m.content_identity.removeprefix('blake3:')[:12]}"


def expect(out: Path) -> str:
    """The --expect-identity each script passes: OUT's full conversion id and content identity."""
    m = Manifest.load(out)
    return f"{m.conversion_id},{m.content_identity}"


def test_write_launch_writes_a_script_per_node_that_serves_its_share(converted, tmp_path):
    """Each script, run on its box with a PATH whose lucifer-shard records its arguments, starts serve on the
    share LUCIFER_SHARE names with that node's rank and the options given; that node's own dry run with exactly
    those options passes on the share staged for it."""
    out = converted(expert_layout="model")
    folder = tmp_path / "launch"
    r = run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--ifname", "eth9", "--ib-hca", "mlx5_0",
            "--write-launch", folder, "--", "--max-model-len", "4096")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in folder.iterdir()) == ["node-0.sh", "node-1.sh", "node-2.sh"]
    assert f"every node's launch, written" in r.stdout and str(folder / "node-2.sh") in r.stdout
    stub = tmp_path / "bin" / "lucifer-shard"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n')
    stub.chmod(0o755)
    for rank in range(3):
        script = folder / f"node-{rank}.sh"
        assert os.access(script, os.X_OK) and identity(out) in script.read_text()
        share = tmp_path / f"node{rank}"
        assert run("stage", out, share, "--nnodes", 3, "--node-rank", rank, "-q").exit_code == 0
        record = tmp_path / f"args-{rank}"
        env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "LUCIFER_SHARE": str(share),
               "RECORD": str(record)}
        subprocess.run(["bash", str(script)], env=env, check=True)
        args = record.read_text().splitlines()
        assert args == ["serve", str(share), "--nnodes", "3", "--node-rank", str(rank), "--master-addr", ADDR,
                        "--ifname", "eth9", "--ib-hca", "mlx5_0", "--expect-identity", expect(out), "--",
                        "--max-model-len", "4096"]
        own = args[:args.index("--")]
        r = run(*own, "--dry-run", "--", *args[args.index("--") + 1:])
        assert r.exit_code == 0 and f"rank(s) {rank}: present" in r.stdout, r.output
        assert identity(out) in r.stdout  # the output line of this node's dry run: compared by eye across nodes
    written = {p.name: p.read_bytes() for p in folder.iterdir()}
    r = run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--write-launch", folder)
    assert r.exit_code == 2 and "node-0.sh, node-1.sh, node-2.sh already there" in r.stderr, r.output
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == written


@pytest.mark.parametrize("args,needle", [
    (["--write-launch", "L"], "--write-launch writes every node's launch: pass --nnodes N and --master-addr H"),
    (["--ifname", "eth0"], "--ifname sets the link between nodes: it applies with --nnodes"),
    (["--ib-hca", "mlx5_0"], "--ib-hca sets the link between nodes: it applies with --nnodes"),
])
def test_link_and_launch_options_need_nodes(converted, tmp_path, args, needle):
    r = run("serve", converted(), *args)
    assert r.exit_code == 2 and needle in r.stderr, r.output
    assert not (tmp_path / "L").exists()


def test_a_launch_for_a_refused_output_writes_nothing(converted, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for p in converted().rglob("*"):
        if p.is_file():
            (out / p.relative_to(converted())).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, out / p.relative_to(converted()))
    (out / "target" / "rank-2" / "part-00000.safetensors").unlink()
    r = run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--write-launch", tmp_path / "L")
    assert r.exit_code == 1 and not (tmp_path / "L").exists(), r.output


def test_the_interface_reaches_vllm_and_a_missing_one_is_refused_before_it_starts(converted, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "SYS", _sysfs(tmp_path, {}, ["mlx5_0", "mlx5_1"]))  # this box has no RDMA device
    ran = []
    passed = [Check("vllm", OK, "vetted build")]
    monkeypatch.setattr(doctor, "quick_checks", lambda out, mtp=False, node_ranks=None, manifest=None: passed)
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append(env))
    here = [name for _, name in __import__("socket").if_nameindex()][0]
    out = own_copy(converted(), tmp_path / "out")
    r = run("serve", out, "--nnodes", 1, "--node-rank", 0, "--master-addr", ADDR, "--ifname", here,
            "--ib-hca", "mlx5_0,mlx5_1")
    assert r.exit_code == 0, r.output
    assert {k: ran[0][k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA")} == {
        "NCCL_SOCKET_IFNAME": here, "GLOO_SOCKET_IFNAME": here, "NCCL_IB_HCA": "mlx5_0,mlx5_1"}
    r = run("serve", out, "--nnodes", 1, "--node-rank", 0, "--master-addr", ADDR, "--ifname", "nosuch0")
    assert r.exit_code == 2 and "--ifname nosuch0: no such network interface on this host (it has " in r.stderr
    assert len(ran) == 1


def test_link_environment_and_interface_problem():
    assert launch.link_environment(None, None) == {}
    assert launch.link_environment("enp1s0f0np0", None) == {"NCCL_SOCKET_IFNAME": "enp1s0f0np0",
                                                            "GLOO_SOCKET_IFNAME": "enp1s0f0np0"}
    assert launch.interface_problem("eth0", ["lo", "eth0"]) is None
    assert launch.interface_problem("eth1", ["lo", "eth0"]).startswith("--ifname eth1: no such network interface "
                                                                       "on this host (it has eth0, lo)")


# Hostile text for every value a launch script carries: shell syntax, quotes, expansions, globs, whitespace,
# control characters, leading dashes, non-UTF-8 bytes (as Python holds them: surrogate escapes).
HOSTILE = [
    "$(touch PWN)", "`touch PWN`", "'", '"', "a b", "a\nb", "*", "?", "[ab]", "-rf", "--help", "~", "~root",
    "$HOME", "${IFS}", "a;touch PWN", "a&&touch PWN", "a|touch PWN", ">PWN", "<in", "\\", "\t", "!", "!!",
    "{a,b}", "#x", "%s", "'; touch PWN; '", '"; touch PWN; "', "$'\\x41'", "a\rb", "\u00e9t\u00e9", "=x",
    " lead", "trail ", "\x1b[31m", "$((1+1))", "\\$(touch PWN)", os.fsdecode(b"\xff\xfe-bytes"),
]


def _recording_stub(tmp_path: Path) -> Path:
    """A `lucifer-shard` that writes its argv, NUL-separated, to $RECORD: what the script really passed."""
    stub = tmp_path / "bin" / "lucifer-shard"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > "$RECORD"\n')
    stub.chmod(0o755)
    return stub


def _argv_of(script: Path, stub: Path, tmp_path: Path, **env: str) -> list[str]:
    """Run `script` with `stub` first on PATH, in an empty folder; the argv it gave serve. Nothing the script
    ran may have made a file there (every hostile string's payload is `touch PWN`)."""
    record, cwd = tmp_path / "argv", tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k != "LUCIFER_SHARE"}
    full.update(PATH=f"{stub.parent}:{os.environ['PATH']}", RECORD=str(record), HOME=str(cwd), **env)
    subprocess.run(["bash", str(script)], env=full, cwd=cwd, check=True)
    assert list(cwd.iterdir()) == [], f"{script.name} ran text as code: {list(cwd.iterdir())}"
    return [os.fsdecode(a) for a in record.read_bytes().split(b"\0")[:-1]]


def test_hostile_strings_table_is_thirty_and_more():
    assert len(set(HOSTILE)) >= 30


@pytest.mark.parametrize("text", HOSTILE, ids=ascii)
def test_every_value_in_a_launch_script_reaches_serve_as_its_argv(tmp_path, text):
    """The share's path, node 0's address, the interface, the RDMA devices, the host IP, the expected identity
    and vLLM's arguments, each the hostile text: the script passes exactly them, and runs none of it."""
    share = tmp_path / f"share {text}"
    args = launch.node_serve_args(3, 2, text, 29500, True, 5, text, text, ["--served-model-name", text, text],
                                  host_ip=text, expect=text)
    assert args.count(text) == 7  # the address, interface, RDMA devices, host IP, identity and vLLM's two
    launch.write_launch(tmp_path / "launch", {2: launch.launch_script(share, 2, 3, f"conversion {text}", args)})
    script = tmp_path / "launch" / "node-2.sh"
    stub = _recording_stub(tmp_path)
    assert _argv_of(script, stub, tmp_path) == ["serve", str(share), *args]
    # LUCIFER_SHARE names a share elsewhere: that path, as given (a relative one led by '-' made ./-...)
    moved = f"other {text}"
    expect = f"./{moved}" if moved.startswith("-") else moved
    assert _argv_of(script, stub, tmp_path, LUCIFER_SHARE=moved) == ["serve", expect, *args]


def test_a_share_path_led_by_a_dash_is_never_an_option(tmp_path):
    args = launch.node_serve_args(3, 0, ADDR, None, False, None, None, None, [])
    launch.write_launch(tmp_path / "launch", {0: launch.launch_script(Path("/x"), 0, 3, "conversion x", args)})
    argv = _argv_of(tmp_path / "launch" / "node-0.sh", _recording_stub(tmp_path), tmp_path, LUCIFER_SHARE="--help")
    assert argv == ["serve", "./--help", *args]


def test_an_identity_with_a_newline_stays_in_its_comment(tmp_path):
    args = launch.node_serve_args(3, 0, ADDR, None, False, None, None, None, [])
    text = launch.launch_script(Path("/x"), 0, 3, "conversion x\ntouch PWN\r\x00", args)
    assert "touch PWN" in text and all(line.startswith("#") for line in text.splitlines()[1:3])
    launch.write_launch(tmp_path / "launch", {0: text})
    assert _argv_of(tmp_path / "launch" / "node-0.sh", _recording_stub(tmp_path), tmp_path)[1] == "/x"


@pytest.mark.parametrize("name", ["$(touch PWN)", "`touch PWN`", "it's", 'say "hi"', "a b\nc", "-x *"], ids=ascii)
def test_serve_write_launch_from_an_output_at_a_hostile_path(converted, tmp_path, name):
    """The whole command: OUT at a path of hostile text, the link options and vLLM's arguments hostile too (serve
    refuses such a --master-addr itself); each node's script gives serve exactly them, and runs nothing."""
    src = converted(expert_layout="model")
    out = tmp_path / name
    for p in src.rglob("*"):
        if p.is_file():
            (out / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, out / p.relative_to(src))
    folder = tmp_path / "launch"
    r = run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--ifname", name, "--ifname", f"2={name}2",
            "--ib-hca", name, "--host-ip", "1=10.0.0.2", "--write-launch", folder, "--", "--served-model-name", name)
    assert r.exit_code == 0, r.output
    stub = _recording_stub(tmp_path)
    for rank in range(3):
        own = [["--ifname", name, "--ib-hca", name], ["--ifname", name, "--ib-hca", name, "--host-ip", "10.0.0.2"],
               ["--ifname", f"{name}2", "--ib-hca", name]][rank]
        assert _argv_of(folder / f"node-{rank}.sh", stub, tmp_path) == [
            "serve", str(out), "--nnodes", "3", "--node-rank", str(rank), "--master-addr", ADDR, *own,
            "--expect-identity", expect(src), "--", "--served-model-name", name]


def test_inspect_and_doctor_print_the_identity_every_node_compares(converted):
    out = converted(expert_layout="model")
    assert f"identity       {identity(out)}" in run("inspect", out).stdout
    assert f": {identity(out)}, tp 3" in run("doctor", out).stdout


def _sysfs(tmp_path: Path, states: dict[str, str], hcas: list[str]) -> Path:
    root = tmp_path / "sys"
    for name, state in states.items():
        (root / "class" / "net" / name).mkdir(parents=True)
        (root / "class" / "net" / name / "operstate").write_text(state + "\n")
    (root / "class" / "infiniband").mkdir(parents=True)
    for hca in hcas:
        (root / "class" / "infiniband" / hca).mkdir()
    return root


def test_an_interface_that_is_down_or_an_rdma_device_that_is_missing_is_named(tmp_path):
    root = _sysfs(tmp_path, {"enp1s0f0np0": "up", "enp1s0f1np1": "down", "lo": "unknown"}, ["rocep1s0f0", "roceP2p1s0f1"])
    names = ["lo", "enp1s0f0np0", "enp1s0f1np1"]
    assert launch.interface_problem("enp1s0f0np0", names, root) is None
    assert launch.interface_problem("lo", names, root) is None  # "unknown": virtual links that carry traffic
    assert launch.interface_problem("enp1s0f1np1", names, root).startswith("--ifname enp1s0f1np1: enp1s0f1np1 is down "
                                                                            "(its cable, or `ip link set")
    assert launch.interface_problem("enp1s0f0np0,lo", names, root) is None  # a triangle's list, as NCCL takes it
    assert "enp1s0f1np1 is down" in launch.interface_problem("enp1s0f0np0,enp1s0f1np1", names, root)
    assert "no such network interface eth7 on" in launch.interface_problem("enp1s0f0np0,eth7", names, root)
    assert launch.ib_hca_problem("rocep1s0f0,roceP2p1s0f1:1", root) is None
    assert launch.ib_hca_problem("roce", root) is None  # NCCL matches a prefix
    assert launch.ib_hca_problem("^mlx5_9", root) is None  # an exclusion list: nothing to find
    assert launch.ib_hca_problem("=roce", root).startswith("--ib-hca =roce: no RDMA device roce on this host (it "
                                                           "has roceP2p1s0f1, rocep1s0f0)")
    assert "mlx5_0" in launch.ib_hca_problem("mlx5_0,rocep1s0f0", root)
    empty = tmp_path / "bare"
    assert "class/infiniband is empty or missing: no RDMA device or driver" in launch.ib_hca_problem("mlx5_0", empty)


def test_the_dry_run_checks_both_link_options_and_the_start_refuses_them(converted, monkeypatch):
    """Before: the dry run never checked --ifname (only the real start did) and nothing checked --ib-hca."""
    out = converted()
    here = [name for _, name in __import__("socket").if_nameindex()][0]
    r = run("serve", out, "--nnodes", 1, "--node-rank", 0, "--master-addr", ADDR, "--ifname", "nosuch0",
            "--ib-hca", "=nosuch_hca", "--dry-run")
    # vLLM is not installed here: the environment's lines are shown as skipped, as on any conversion box
    assert r.exit_code == 0, r.output
    assert "--ifname: --ifname nosuch0: no such network interface" in r.stdout
    assert "--ib-hca: --ib-hca =nosuch_hca: no RDMA device nosuch_hca" in r.stdout
    ran = []
    monkeypatch.setattr(doctor, "quick_checks", lambda out, mtp=False, node_ranks=None, manifest=None:
                        [Check("vllm", OK, "vetted build")])
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append(env))
    r = run("serve", out, "--nnodes", 1, "--node-rank", 0, "--master-addr", ADDR, "--ifname", here,
            "--ib-hca", "=nosuch_hca")
    assert r.exit_code == 2 and "--ib-hca =nosuch_hca: no RDMA device nosuch_hca" in r.stderr and ran == [], r.output


@pytest.mark.parametrize("stage_args, needle", [
    (["--nnodes", 3, "--node-rank", 1], "node 1's share (of 3) by its lucifer-share.json, not node 0's"),
    (["--ranks", 2], "a share of rank(s) 2 by its lucifer-share.json, not node 0's"),
])
def test_write_launch_on_another_nodes_share_without_node_rank_is_refused(converted, tmp_path, stage_args, needle):
    """Issue 61 G: on node 1's share --write-launch ran as node 0 (the default) and wrote node 0's script for it;
    refused now, naming the share's own node, before anything is written; with --node-rank it goes on."""
    share = tmp_path / "share"
    assert run("stage", converted(), share, *stage_args, "-q").exit_code == 0
    r = run("serve", share, "--nnodes", 3, "--master-addr", ADDR, "--write-launch", tmp_path / "L")
    assert r.exit_code == 2 and needle in r.stderr and not (tmp_path / "L").exists(), r.output
    rank = stage_args[-1]
    r = run("serve", share, "--nnodes", 3, "--node-rank", rank, "--master-addr", ADDR, "--write-launch", tmp_path / "L")
    assert r.exit_code == 0 and (tmp_path / "L" / "node-2.sh").exists(), r.output
    r = run("serve", converted(), "--nnodes", 3, "--master-addr", ADDR, "--write-launch", tmp_path / "whole")
    assert r.exit_code == 0 and (tmp_path / "whole" / "node-2.sh").exists(), r.output


def test_each_nodes_script_carries_its_own_interface_and_host_ip(converted, tmp_path):
    """Issue 64: every node-R.sh had the same --ifname and no VLLM_HOST_IP; on a triangle each box has its own
    ports and addresses. R=VALUE gives node R its own; a bare --ifname stays every node's default."""
    out = converted(expert_layout="model")
    folder = tmp_path / "launch"
    r = run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--ifname", "enp1s0f0np0,enp1s0f1np1",
            "--ifname", "1=enP2p1s0f0np0,enP2p1s0f1np1", "--host-ip", "0=10.0.0.1", "--host-ip", "1=10.0.1.2",
            "--host-ip", "2=10.0.2.3", "--write-launch", folder)
    assert r.exit_code == 0, r.output
    stub = _recording_stub(tmp_path)
    links = {0: ("enp1s0f0np0,enp1s0f1np1", "10.0.0.1"), 1: ("enP2p1s0f0np0,enP2p1s0f1np1", "10.0.1.2"),
             2: ("enp1s0f0np0,enp1s0f1np1", "10.0.2.3")}
    for rank, (ifname, ip) in links.items():
        assert _argv_of(folder / f"node-{rank}.sh", stub, tmp_path) == [
            "serve", str(out), "--nnodes", "3", "--node-rank", str(rank), "--master-addr", ADDR, "--ifname", ifname,
            "--host-ip", ip, "--expect-identity", expect(out)]


@pytest.mark.parametrize("args,needle", [
    (["--host-ip", "10.0.0.1", "--write-launch", "L"], "--host-ip 10.0.0.1: every node's launch would give each "
                                                       "node this one address; pass R=ADDR per node"),
    (["--host-ip", "3=10.0.0.4", "--write-launch", "L"], "--host-ip 3=10.0.0.4: nodes are numbered 0..2"),
    (["--ifname", "1=eth0", "--ifname", "1=eth1", "--write-launch", "L"], "--ifname: node 1 given twice"),
    (["--ifname", "1=", "--write-launch", "L"], "--ifname: an empty value"),
    (["--host-ip", "0=$(touch PWN)", "--write-launch", "L"], "--host-ip '$(touch PWN)': not an IP address"),
    (["--host-ip", "0=10.0.0.1\nx", "--write-launch", "L"], "not an IP address"),
    (["--host-ip", "spark-1", "--node-rank", 1], "--host-ip 'spark-1': not an IP address"),
])
def test_per_node_link_values_are_refused_when_they_cannot_work(converted, tmp_path, args, needle):
    r = run("serve", converted(), "--nnodes", 3, "--master-addr", ADDR,
            *[tmp_path / a if a == "L" else a for a in args])
    assert r.exit_code == 2 and needle in r.stderr, r.output
    assert not (tmp_path / "L").exists() and not (Path.cwd() / "PWN").exists()


def test_the_host_ip_reaches_vllm_and_one_not_of_this_host_is_refused(converted, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(doctor, "quick_checks", lambda out, mtp=False, node_ranks=None, manifest=None:
                        [Check("vllm", OK, "vetted build")])
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append(env))
    base = ["serve", own_copy(converted(), tmp_path / "out"), "--nnodes", 1, "--node-rank", 0, "--master-addr", ADDR]
    r = run(*base, "--host-ip", "0=127.0.0.1")  # node 0's own value, from a line every node can share
    assert r.exit_code == 0 and ran[0]["VLLM_HOST_IP"] == "127.0.0.1", r.output
    r = run(*base, "--host-ip", "192.0.2.1")  # TEST-NET-1: no host's address
    assert r.exit_code == 2 and "--host-ip 192.0.2.1: not an address of this host" in r.stderr and len(ran) == 1
    r = run(*base, "--host-ip", "192.0.2.1", "--dry-run")  # the dry run names it (skipped without vLLM here)
    assert "--host-ip: --host-ip 192.0.2.1: not an address of this host" in r.stdout, r.output


def test_a_script_says_how_to_activate_the_tools_environment(tmp_path):
    """Issue 64: node-R.sh ran lucifer-shard without saying the venv must be active (bash: command not found)."""
    args = launch.node_serve_args(3, 1, ADDR, None, False, None, None, None, [])
    launch.write_launch(tmp_path / "launch", {1: launch.launch_script(Path("/x"), 1, 3, "conversion x", args)})
    script = tmp_path / "launch" / "node-1.sh"
    assert "LUCIFER_VENV=VENV bash node-1.sh" in script.read_text()
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run(["/bin/bash", str(script)], env=bare, capture_output=True, text=True)
    assert r.returncode == 127 and r.stderr == ("node-1.sh: lucifer-shard is not on PATH: activate the environment it "
                                                "is installed in (source VENV/bin/activate) or run LUCIFER_VENV=VENV "
                                                "bash node-1.sh\n"), r.stderr
    # following it: a venv whose activate puts its bin/ (holding lucifer-shard) first on PATH
    venv = tmp_path / "venv"
    venv.mkdir()
    stub = _recording_stub(venv)
    (stub.parent / "activate").write_text(f'PATH="{stub.parent}:$PATH"; export PATH\n')
    record = tmp_path / "argv"
    subprocess.run(["/bin/bash", str(script)], env={**bare, "LUCIFER_VENV": str(venv), "RECORD": str(record)},
                   check=True)
    assert record.read_bytes().split(b"\0")[:-1] == [a.encode() for a in ["serve", "/x", *args]]


def _preflight_stub(tmp_path: Path) -> Path:
    """A `lucifer-shard` that runs the real serve, as a dry run (this box has no vLLM to become): the node's own
    preflight on the share the script names, with the arguments the script gives it."""
    import sys

    stub = tmp_path / "bin" / "lucifer-shard"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -m lucifer_shard.cli "$1" "$2" --dry-run "${{@:3}}"\n')
    stub.chmod(0o755)
    return stub


def test_a_share_of_another_output_stops_at_its_nodes_preflight(converted, tiny_random, tmp_path):
    """Issue 64: node-2.sh named the expected identity only in a comment; a share of another conversion passed
    that node's preflight and was caught only at load, after vLLM's set-up on all three boxes. Now the script's
    serve refuses it in one line (exit 1) before vLLM starts; the share of its own output passes."""
    out = converted(expert_layout="model")
    folder = tmp_path / "launch"
    assert run("serve", out, "--nnodes", 3, "--master-addr", ADDR, "--write-launch", folder).exit_code == 0
    stub = _preflight_stub(tmp_path)
    shares = {"own": out, "conversion": converted(), "weights": converted(tiny_random, expert_layout="model")}
    assert Manifest.load(shares["weights"]).conversion_id == Manifest.load(out).conversion_id  # weights alone differ
    for name, source in shares.items():
        share = tmp_path / f"share-{name}"
        assert run("stage", source, share, "--nnodes", 3, "--node-rank", 2, "-q").exit_code == 0
        env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "LUCIFER_SHARE": str(share)}
        r = subprocess.run(["bash", str(folder / "node-2.sh")], env=env, capture_output=True, text=True)
        if name == "own":
            assert r.returncode == 0 and "rank(s) 2: present" in r.stdout, r.stdout + r.stderr
            continue
        what = "other weights" if name == "weights" else "another conversion"
        one_error(r, 1, f"{share}: a share of {identity(source)}, not of {identity(out)} that this launch was "
                        f"written for ({what})", alone=True)


def test_the_real_start_refuses_another_share_before_vllm(converted, monkeypatch):
    ran = []
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append(env))
    out, other = converted(expert_layout="model"), converted()
    r = run("serve", other, "--expect-identity", expect(out))
    one_error(r, 1, "another conversion", "put this node's share of that output there")
    assert ran == []


def test_doctor_checks_the_link_options_as_the_dry_run_does(converted):
    """Issue 64: doctor never checked --ifname, --ib-hca or --host-ip; it now shows each and fails on a bad one."""
    here = [name for _, name in __import__("socket").if_nameindex()][0]
    r = run("doctor", converted(), "--ifname", "nosuch0", "--ib-hca", "=nosuch_hca", "--host-ip", "192.0.2.1")
    assert r.exit_code == 1, r.output
    assert "--ifname: --ifname nosuch0: no such network interface" in r.stdout
    assert "--ib-hca: --ib-hca =nosuch_hca: no RDMA device nosuch_hca" in r.stdout
    assert "--host-ip: --host-ip 192.0.2.1: not an address of this host" in r.stdout
    r = run("doctor", converted(), "--host-ip", "127.0.0.1", "--ifname", here)
    assert "--host-ip" in r.stdout and "127.0.0.1: an address of this host" in r.stdout, r.output
