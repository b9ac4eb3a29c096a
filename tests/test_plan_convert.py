"""What `plan` and `convert` accept (issue 27): a config.json path and --revision for MODEL, vLLM's
-tp spellings, plan as convert's dry run (the same refusals of MODEL and OUT, in the same words,
writing nothing), the remark on a rank that holds only padding, --arch optional with model layout,
one table of FlashInfer generations, and --max-file-size's units and floor."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import CONFIGS, rank_tensors, run, run_process
from lucifer_shard.cli import cli
from lucifer_shard.errors import OutputError
from lucifer_shard.model.runtimes import FLASHINFER_VERSIONS
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import manifest_text
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.units import parse_rate, parse_size

REPO = Path(__file__).resolve().parent.parent
FLASH = CONFIGS / "deepseek-v4-flash.json"
SHA = "b" * 40


def listing(path: Path) -> list:
    """Everything under `path` (names, types and sizes), or None when it does not exist."""
    if not path.exists():
        return None
    if path.is_file():
        return [("", "file", path.stat().st_size)]
    return sorted((str(p.relative_to(path)), p.is_dir(), p.stat().st_size if p.is_file() else 0)
                  for p in path.rglob("*"))


def cli_subprocess(*args: str, env: dict) -> subprocess.CompletedProcess:
    """huggingface_hub reads its environment at import: a fresh process."""
    return run_process(*args, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


# ---------------------------------------------------------------- 1. MODEL: a config.json, --revision, -tp


def test_plan_takes_the_shipped_config_json():
    r = run("plan", "--tp", 3, "--arch", "sm120", FLASH)
    assert r.exit_code == 0, r.output
    assert re.search(r"routed +2048 +2112 +704 +768", r.output)


def test_convert_refuses_a_config_file_with_the_reason(tmp_path):
    r = run("convert", "--tp", 3, "--arch", "sm120", FLASH, tmp_path / "out")
    assert r.exit_code == 2 and not (tmp_path / "out").exists()
    assert r.output == (f"error: MODEL {FLASH} is a file; convert needs the checkpoint directory (config.json with "
                        f"its safetensors shards); a config.json alone is enough for plan\n")


def test_repo_id_offline_names_the_missing_file_and_the_fix(tmp_path):
    r = cli_subprocess("plan", "--tp", "3", "--arch", "sm120", "--revision", "v2", "deepseek-ai/DeepSeek-V4-Flash",
                       env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2, r.stderr
    assert (f"error: deepseek-ai/DeepSeek-V4-Flash: no such directory here, and as a Hugging Face repo id: config.json "
            f"of deepseek-ai/DeepSeek-V4-Flash at v2 is not in "
            f"the local Hugging Face cache ({tmp_path / 'hub'}) and HF_HUB_OFFLINE is set; run `hf download "
            f"deepseek-ai/DeepSeek-V4-Flash config.json --revision v2` where the hub is reachable, or pass the path "
            f"of a config.json") in r.stderr


def test_revision_applies_only_to_a_repo_id(tiny_pattern):
    r = run("plan", "--tp", 3, "--arch", "sm120", "--revision", "main", tiny_pattern)
    assert r.exit_code == 2 and "--revision applies only to a Hugging Face repo id" in r.output


def _cache_with(model: Path, hub: Path, repo: str = "org/tiny") -> Path:
    """A Hugging Face cache holding `model` as `repo` at commit SHA (refs/main points at it)."""
    root = hub / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, root / "snapshots" / SHA)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA)
    return root


def test_revision_is_recorded_and_diff_finds_it_again(tiny_pattern, tmp_path):
    """convert --revision records repo and commit; `diff OUT` without MODEL re-resolves that commit
    through the cache where the recorded path is gone (the cache moved); with neither the cache nor
    the Hub it names the commit and the download that brings it."""
    _cache_with(tiny_pattern, tmp_path / "hub")
    out = tmp_path / "out"
    r = cli_subprocess("convert", "-q", "--tp", "3", "--expert-layout", "model", "--revision", "main", "org/tiny",
                       str(out), env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    source = Manifest.load(out).source
    assert source.repo == "org/tiny" and source.revision == SHA
    assert source.path == str(tmp_path / "hub" / "models--org--tiny" / "snapshots" / SHA)
    (tmp_path / "hub").rename(tmp_path / "moved")
    r = cli_subprocess("diff", "-q", str(out), env={"HF_HUB_CACHE": str(tmp_path / "moved")})
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli_subprocess("diff", "-q", str(out), env={"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert r.returncode == 2 and f"org/tiny at {SHA} is not in the local Hugging Face cache" in r.stderr
    assert f"hf download org/tiny --revision {SHA}" in r.stderr


def test_local_conversions_record_no_repo(converted):
    source = Manifest.load(converted()).source
    assert source.repo is None and source.revision is None


@pytest.mark.parametrize("spelling", ["-tp", "--tensor-parallel-size"])
def test_vllm_spellings_of_tp(spelling, tiny_pattern, tmp_path):
    for command in ("plan", "convert"):
        ctx = cli.commands[command].make_context(command, [spelling, "3", str(tiny_pattern), str(tmp_path)])
        assert ctx.params["tp"] == 3
    assert run("plan", spelling, 3, "--arch", "sm120", FLASH).output == run("plan", "--tp", 3, "--arch", "sm120", FLASH).output


# ---------------------------------------------------------------- 2. plan is convert's dry run


def _unfinished(converted, tmp_path) -> Path:
    out = tmp_path / "unfinished"
    shutil.copytree(converted(), out)
    (out / "COMPLETE").unlink()
    (out / MANIFEST_NAME).unlink()
    return out


OUTS = {
    "a file": lambda converted, tmp: (tmp / "afile").write_text("x") and tmp / "afile",
    "a non-empty directory": lambda converted, tmp: ((tmp / "full").mkdir(), (tmp / "full" / "x").write_text("x"))
    and tmp / "full",
    "a finished output": lambda converted, tmp: Path(shutil.copytree(converted(), tmp / "done")),
    "an unfinished output": _unfinished,
}


@pytest.mark.parametrize("state,flags,needle", [
    ("a file", [], "exists and is not a directory; choose a directory for OUT"),
    ("a non-empty directory", [], "is not empty and not a lucifer-shard output; choose an empty or new directory"),
    ("a non-empty directory", ["--force"], "--force only replaces outputs of this tool"),
    ("a finished output", [], "already holds a complete conversion; pass --resume to re-check it"),
    ("an unfinished output", [], "holds an unfinished conversion; pass --resume to finish it or --force"),
    ("an unfinished output", ["--resume", "--max-file-size", "2M"],
     "was started with other options (--max-file-size 4G -> --max-file-size 2M)"),
])
def test_plan_refuses_what_convert_refuses_in_its_words(state, flags, needle, converted, tiny_pattern, tmp_path):
    out = OUTS[state](converted, tmp_path)
    before = listing(out)
    args = ["--tp", 3, "--arch", "sm120", *flags, tiny_pattern, out]
    planned, converting = run("plan", *args), run("convert", *args)
    assert planned.exit_code == converting.exit_code == 2, (planned.output, converting.output)
    assert planned.output == converting.output and planned.output.startswith("error: "), planned.output
    assert needle in planned.output and planned.output.count("\n") == 1
    assert listing(out) == before  # neither wrote anything, not even the lock folder


def test_plan_takes_resume_force_and_workers(converted, tiny_pattern, tmp_path):
    out = _unfinished(converted, tmp_path)
    before = listing(out)
    for flags in (["--resume", "--workers", "3"], ["--force"]):
        r = run("plan", "--tp", 3, "--arch", "sm120", *flags, tiny_pattern, out)
        assert r.exit_code == 0 and ": enough" in r.output, r.output
    assert listing(out) == before


def test_plan_writes_nothing_into_a_new_or_empty_out(tiny_pattern, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "out", tmp_path / "empty"):
        before = listing(out)
        assert run("plan", "--tp", 3, "--arch", "sm120", tiny_pattern, out).exit_code == 0
        assert listing(out) == before and listing(tmp_path / "new") is None


@pytest.mark.parametrize("command", ["plan", "convert"])
def test_an_output_as_model_is_named(command, converted, tmp_path):
    out = converted()
    r = run(command, "--tp", 3, "--arch", "sm120", out, tmp_path / "new")
    assert r.exit_code == 2 and not (tmp_path / "new").exists()
    assert r.output == (f"error: MODEL {out} is a lucifer-shard output, not a checkpoint; pass the checkpoint it was "
                        f"converted from; run lucifer-shard inspect {out} (it shows the checkpoint it was converted "
                        f"from)\n")


def test_a_rank_of_only_padding_is_remarked(tiny_pattern, tmp_path):
    text = run("plan", "--tp", 5, "--arch", "sm120", FLASH).output
    message = ("--tp 5: rank 4 holds only padding on heads, groups, shared: its 16 attention heads, 2 output groups "
               "and 512 shared-expert columns are zeros that cost memory and compute for nothing")
    assert f"  note: {message}\n" in text
    doc = json.loads(run("plan", "--tp", 5, "--arch", "sm120", "--json", FLASH).stdout)["result"]
    assert doc["padding_only"] == [{"rank": 4, "axes": ["heads", "groups", "shared"], "message": message}]
    assert json.loads(run("plan", "--tp", 3, "--arch", "sm120", "--json", FLASH).stdout)["result"]["padding_only"] == []
    assert "note:" not in run("plan", "--tp", 3, "--arch", "sm120", FLASH).output
    # convert warns with the same words (the tiny checkpoint has Flash's 64 heads)
    tiny = json.loads(run("plan", "--tp", 5, "--arch", "sm120", "--json", tiny_pattern).stdout)["result"]["padding_only"]
    r = run("convert", "--tp", 5, "--expert-layout", "model", tiny_pattern, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert [f"warning: {p['message']}" for p in tiny] == [l for l in r.stderr.splitlines() if "padding" in l]
    assert tiny and tiny[0]["rank"] == 4


# ---------------------------------------------------------------- 3. --arch and layouts


def test_model_layout_needs_no_arch(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    r = run("convert", "--tp", 3, "--expert-layout", "model", tiny_pattern, out)
    assert r.exit_code == 0, r.output
    m = Manifest.load(out)
    assert m.arch is None and m.options.arch is None and m.moe_variant is None
    assert m.runtime["flashinfer"] == "not required"
    assert run("verify", out).exit_code == 0 and run("diff", out).exit_code == 0
    assert "any arch (model layout" in run("plan", "--tp", 3, "--expert-layout", "model", tiny_pattern).output


def test_model_layout_files_are_the_same_for_every_arch(converted):
    """Model-layout tensors are byte-identical for sm90, sm100, sm120 and no arch (only the
    conversion id stamped in the headers differs): --arch buys nothing there."""
    outs = [converted(expert_layout="model", arch=arch) for arch in ("sm90", "sm100", "sm120", None)]
    for role in ("target", "draft"):
        for rank in range(3):
            first = rank_tensors(outs[0], role, rank)
            assert first
            for out in outs[1:]:
                other = rank_tensors(out, role, rank)
                assert other.keys() == first.keys()
                assert all((other[k] == first[k]).all() and other[k].shape == first[k].shape for k in first)


@pytest.mark.parametrize("kw,flashinfer", [
    ({"arch": "sm90", "flashinfer_layout": "legacy"}, FLASHINFER_VERSIONS["legacy"]),
    ({"arch": "sm90"}, FLASHINFER_VERSIONS["folded"]),
    ({"arch": "sm120"}, "any"),
    ({"arch": "sm90", "expert_layout": "model"}, "not required"),
])
def test_runtime_flashinfer_follows_the_layout(kw, flashinfer, converted):
    assert Manifest.load(converted(**kw)).runtime["flashinfer"] == flashinfer


@pytest.mark.parametrize("kw,backends,forks", [
    ({"arch": "sm90"}, ("FLASHMLA_SPARSE_DSV4", "flashinfer_cutlass"), False),
    ({"arch": "sm90", "expert_layout": "model"}, ("FLASHMLA_SPARSE_DSV4", "marlin"), True),
    ({"arch": "sm120"}, ("FLASHINFER_MLA_SPARSE_DSV4", "flashinfer_cutlass"), True),
    ({"arch": None, "expert_layout": "model"}, ("the serving GPU's (serve picks them)",) * 2, True),
])
def test_runtime_names_the_builds_and_backends_that_serve_the_output(kw, backends, forks, converted):
    """The manifest's runtime record says what really serves each output: a vetted stock vLLM with the plugin
    for every arch and layout (sm90 kernel layout with FlashInfer's MoE), the mlow/vllm builds only where
    their SM12x policy reaches."""
    rt = Manifest.load(converted(**kw)).runtime
    assert (rt["attention_backend"], rt["moe_backend"]) == backends
    assert rt["vllm_line"].startswith("stock vLLM (a vetted release: lucifer-shard doctor) with the plugin's virtual TP") and ("mlow/vllm" in rt["vllm_line"]) == forks


def test_flashinfer_generations_are_one_statement():
    """--flashinfer-layout's help and the output page's layout table say what the manifest records."""
    helptext = " ".join(run("convert", "--help").output.split())
    readme = (REPO / "docs" / "output-format.md").read_text()
    for gen, versions in FLASHINFER_VERSIONS.items():
        assert f"{gen} = FlashInfer {versions}" in helptext
        assert f"sm90 {gen} (FlashInfer {versions})" in readme


def test_a_manifest_with_no_arch_but_kernel_layout_is_refused(converted):
    doc = Manifest.load(converted(expert_layout="model", arch=None)).to_dict()
    edited = {**doc, "expert_layout": "kernel"}
    with pytest.raises(OutputError, match="arch is null .* but the experts are in kernel layout"):
        Manifest.parse(manifest_text({k: v for k, v in edited.items() if k != "manifest_digest"}).encode(), "m")


# ---------------------------------------------------------------- 4. sizes


@pytest.mark.parametrize("text,n", [("1M", 1 << 20), ("4G", 4 << 30), ("4g", 4 << 30), ("1.5K", 1536),
                                    ("2T", 2 << 40), ("4GiB", 4 << 30), ("500MB", 500 * 10**6), ("1048576", 1 << 20)])
def test_sizes_are_binary_with_single_letter_suffixes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text,n", [("1GiB/s", 1 << 30), ("200M/s", 200 << 20), ("500MB/s", 500 * 10**6),
                                    ("10Gbit/s", 1.25e9), ("1Gbps", 1.25e8), ("100Mbit/s", 1.25e7)])
def test_link_rates_are_sizes_a_second_or_decimal_bits(text, n):
    assert parse_rate(text) == n


def test_plan_times_each_route_at_the_link_it_states():
    """Issue 63 item 5: each route's time at a stated link rate (a default, named as such, or --link), beside its
    download and disk: the download at that rate, and the conversion at convert's measured disk rate."""
    def routes(*extra: str) -> tuple[dict, str]:
        r = run("plan", "--tp", 3, CONFIGS / "deepseek-v4-flash-0731.json", *extra)
        assert r.exit_code == 0, r.output
        return json.loads(run("plan", "--tp", 3, CONFIGS / "deepseek-v4-flash-0731.json", "--json", *extra)
                          .stdout)["result"]["routes"], r.output

    default, text = routes()
    assert default["link"] == {"rate": "1Gbit/s", "bytes_per_s": 125_000_000, "default": True}
    assert "times at a link to the Hub of 1Gbit/s (0.12 GiB/s, the default; --link RATE gives yours)" in text
    fast, text = routes("--link", "10Gbit/s")
    assert fast["link"]["default"] is False and "of 10Gbit/s (1.16 GiB/s, --link)" in text
    staged, streamed, fetched = fast["routes"]
    assert streamed["download_seconds"] == round(fast["source_bytes"] / 1.25e9, 1)
    assert fetched["download_seconds"] == round(fetched["download_per_node"] / 1.25e9, 1)
    assert staged["download_seconds"] == streamed["download_seconds"]  # the conversion box downloads the source
    assert fetched["convert_seconds"] == 0 < streamed["convert_seconds"] < staged["convert_seconds"]
    for slow, quick in zip(default["routes"], fast["routes"]):
        assert slow["download_seconds"] == pytest.approx(quick["download_seconds"] * 10, abs=1)
        assert slow["convert_seconds"] == quick["convert_seconds"]
    assert text.count(" to download") == 3 and "then the copy over the boxes' own link" in text
    assert routes("--link", "1.25GB/s")[0]["routes"] == fast["routes"]


@pytest.mark.parametrize("text", ["10G", "fast", "0Gbit/s", "-1GiB/s"])
def test_a_link_that_is_no_rate_is_refused(text):
    r = run("plan", "--tp", 3, CONFIGS / "deepseek-v4-flash-0731.json", "--link", text)
    assert r.exit_code == 2 and r.output.startswith(f"error: Invalid value for '--link': {text!r}: expected a size "
                                                    f"per second"), r.output


def test_max_file_size_in_gguf_split_style():
    doc = json.loads(run("plan", "--tp", 3, "--arch", "sm120", "--json", "--max-file-size", "1G", FLASH).stdout)
    same = json.loads(run("plan", "--tp", 3, "--arch", "sm120", "--json", "--max-file-size", "1GiB", FLASH).stdout)
    assert doc["ok"] and doc["result"]["footprint"] == same["result"]["footprint"]
    assert "4G = 4 GiB" in " ".join(run("plan", "--help").output.split())


@pytest.mark.parametrize("text", ["0", "1", "4K", "1023K", "1048575"])
def test_max_file_size_below_the_floor_is_refused(text, tiny_pattern, tmp_path):
    for command in ("plan", "convert"):
        r = run(command, "--tp", 3, "--arch", "sm120", "--max-file-size", text, tiny_pattern, tmp_path / "out")
        assert r.exit_code == 2 and not (tmp_path / "out").exists()
        assert r.output.startswith(f"error: --max-file-size {text!r} is below the floor of 1.00 MiB: a tensor larger "
                                   f"than the limit gets a file of its own anyway"), r.output


def test_plan_resume_refuses_a_changed_source_as_convert_does(converted, tiny_pattern, tmp_path):
    """With a local checkpoint, plan --resume holds the earlier run's record against its headers too."""
    out = _unfinished(converted, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(tiny_pattern, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 2}))
    args = ["--tp", 3, "--arch", "sm120", "--resume", other, out]
    planned, converting = run("plan", *args), run("convert", *args)
    assert planned.exit_code == converting.exit_code == 2
    assert planned.output == converting.output and "was started with other source" in planned.output, planned.output


def _other_weights(tiny_random, tmp_path) -> Path:
    """The tiny checkpoint with other weights (another seed): the same schema, headers and sizes."""
    from lucifer_shard.engine.synth import synth

    return synth("tiny", tmp_path / "other-weights", fill="random", seed=8, progress=False)


def test_a_refused_resume_with_other_weights_leaves_out_as_it_was(converted, tiny_random, tmp_path):
    """Issue 43 finding 16: convert --resume on a damaged output, given a same-schema checkpoint of other
    weights, is refused by the content check of the first part it would rewrite; COMPLETE, the record and
    every file stay as they were (COMPLETE used to go first)."""
    out = tmp_path / "out"
    shutil.copytree(converted(tiny_random, expert_layout="model"), out)
    (out / "target" / "rank-1" / "part-00000.safetensors").unlink()
    before = listing(out)
    args = ["--tp", 3, "--arch", "sm120", "--expert-layout", "model", "--resume", _other_weights(tiny_random, tmp_path), out]
    r = run("convert", *args)
    assert r.exit_code == 2 and "holds other weights than the checkpoint" in r.output, r.output
    assert listing(out) == before and (out / "COMPLETE").exists()
    # plan agrees with convert's rule: a finished output of this conversion is repaired against its manifest,
    # so the record's file stamps do not refuse it; whether the weights are the converted ones only the
    # hashing of the parts to rewrite can say (docs/serving.md, issue 43)
    assert run("plan", *args).exit_code == 0
    repaired = run("convert", *args[:-2], tiny_random, out)
    assert repaired.exit_code == 0 and "repaired: rewrote target/rank-1/part-00000.safetensors" in repaired.output


def test_plan_and_resume_agree_on_an_intact_output_and_other_weights(converted, tiny_random, tmp_path):
    """Nothing to rewrite: convert --resume reads no source byte and keeps OUT; plan said so too (it said
    "source checkpoint changed since OUT was started" while convert answered "nothing to repair")."""
    out = tmp_path / "out"
    shutil.copytree(converted(tiny_random, expert_layout="model"), out)
    args = ["--tp", 3, "--arch", "sm120", "--expert-layout", "model", "--resume", _other_weights(tiny_random, tmp_path), out]
    planned, converting = run("plan", *args), run("convert", *args)
    assert planned.exit_code == converting.exit_code == 0, (planned.output, converting.output)
    assert "nothing to repair" in converting.output


@pytest.mark.parametrize("spelling", ["SM120", "Sm120"])
def test_arch_names_are_taken_in_any_case(spelling, tiny_pattern, tmp_path):
    r = run("plan", "--tp", 3, "--arch", spelling, tiny_pattern, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["arch"] == "sm120", r.output
