"""Ranks per node: the core placement and the `auto` rule (fake topologies), and
`xeontune train --nproc-per-node` for real: same result as one process with N times the batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.checks import moved_from_initializer
from tests.trainlib import train_in_process
from xeontune import placement
from xeontune.train.families import get as get_family
from xeontune.train.options import parse_args
from xeontune.train.ranks import frozen_weight_bytes, packs, plan_ranks

GB = 10**9


def fake_sysfs(root: Path, layout: list[tuple[int, int, int]]) -> tuple[Path, Path]:
    """A /sys/devices/system/{cpu,node} with one (numa node, package, core id) per logical CPU."""
    cpu_dir, node_dir = root / "cpu", root / "node"
    nodes: dict[int, list[int]] = {}
    for cpu, (node, package, core) in enumerate(layout):
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
        nodes.setdefault(node, []).append(cpu)
    for node, cpus in nodes.items():
        (node_dir / f"node{node}").mkdir(parents=True)
        (node_dir / f"node{node}" / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    return cpu_dir, node_dir


def two_socket_host(tmp_path: Path) -> tuple[Path, Path]:
    """2 sockets x 4 cores x 2 hyperthreads, one NUMA node per socket, numbered as Linux does:
    CPUs 0-7 are each core's first thread (socket 0 then 1), 8-15 the siblings."""
    first = [(s, s, c) for s in range(2) for c in range(4)]
    return fake_sysfs(tmp_path, first + first)


def test_physical_cores_skip_hyperthreads_and_keep_numa_order(tmp_path):
    cpu_dir, node_dir = two_socket_host(tmp_path)
    cores = placement.physical_cores(set(range(16)), cpu_dir, node_dir)
    assert [c.cpu for c in cores] == list(range(8))
    assert [c.numa_node for c in cores] == [0] * 4 + [1] * 4
    # an affinity mask that leaves out some first threads: their siblings stand in for them
    cores = placement.physical_cores({1, 2, 8, 9, 12}, cpu_dir, node_dir)
    assert [c.cpu for c in cores] == [8, 1, 2, 12]


def test_core_slices_are_equal_and_stay_on_one_numa_node(tmp_path):
    cores = placement.physical_cores(set(range(16)), *two_socket_host(tmp_path))
    assert placement.core_slices(cores, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert placement.core_slices(cores, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert placement.core_slices(cores, 3) == [[0, 1], [2, 3], [4, 5]]  # cores 6, 7 idle: no slow rank
    with pytest.raises(ValueError):
        placement.core_slices(cores, 9)


@pytest.mark.parametrize(("physical", "numa", "available", "per_rank", "ranks"), [
    (16, 1, 128 * GB, 3 * GB, 8),  # measured best on 16 AMX cores: 8 x 2
    (2, 1, 24 * GB, 3 * GB, 2),  # measured best on 2 cores: 2 x 1
    (1, 1, 24 * GB, 3 * GB, 1),
    (16, 1, 12 * GB, 3 * GB, 3),  # memory: 10.8 GB usable holds 3 ranks of 3 GB
    (16, 1, 2 * GB, 3 * GB, 1),  # never fewer than one
    (32, 2, 256 * GB, 3 * GB, 16),
    (16, 2, 17 * GB, 3 * GB, 4),  # memory allows 5; rounded down to a multiple of the 2 NUMA nodes
])
def test_auto_rule(physical, numa, available, per_rank, ranks):
    plan = placement.auto_ranks(physical, numa, available, per_rank)
    assert plan.ranks == ranks
    assert plan.cores_per_rank == physical // ranks
    assert ("memory" in plan.why) == (ranks < physical // placement.threads_per_rank_rule(physical))


def test_available_memory_is_what_is_left_under_a_cgroup_limit(tmp_path):
    """A container's cgroup v2 limit bounds MemAvailable by what the group has left, its own file pages
    counted as available (as MemAvailable counts the page cache): not by the whole limit."""
    GiB = 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {60 * GiB // 1024} kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert placement.available_memory_bytes(meminfo, cgroup) == 60 * GiB
    (cgroup / "memory.max").write_text(f"{16 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{10 * GiB}\n")
    (cgroup / "memory.stat").write_text(f"anon {7 * GiB}\nfile {3 * GiB}\nkernel 0\n")
    assert placement.available_memory_bytes(meminfo, cgroup) == 9 * GiB  # 16 - 10 used + 3 of it file pages
    (cgroup / "memory.current").write_text(f"{17 * GiB}\n")
    (cgroup / "memory.stat").write_text("file 0\n")
    assert placement.available_memory_bytes(meminfo, cgroup) == 0
    assert placement.available_memory_bytes(meminfo, tmp_path / "no-cgroup") == 60 * GiB  # cgroup v1 or none


def test_rank_memory_grows_with_pixels_and_batch():
    from xeontune.train import families

    sd = families.get("sd")
    at_256 = placement.rank_memory_bytes(2 * GB, sd.activation_bytes(256, "fp32"), 1)
    assert placement.rank_memory_bytes(2 * GB, sd.activation_bytes(512, "fp32"), 1) - 2 * GB \
        == pytest.approx(4 * (at_256 - 2 * GB))
    assert placement.rank_memory_bytes(2 * GB, sd.activation_bytes(256, "fp32"), 2) - 2 * GB \
        == pytest.approx(2 * (at_256 - 2 * GB))


def test_frozen_weight_bytes_of_a_local_model(tiny_model):
    fp32, bf16 = frozen_weight_bytes(str(tiny_model), "fp32"), frozen_weight_bytes(str(tiny_model), "bf16")
    unet = sum(p.stat().st_size for p in (Path(tiny_model) / "unet").glob("*.safetensors"))
    text = sum(p.stat().st_size for p in (Path(tiny_model) / "text_encoder").glob("*.safetensors"))
    # the UNet and the text encoder's Linear layers are held in bf16, the rest as stored
    assert abs((fp32 - bf16) - (unet // 2 + text * get_family("sd").encoders[0].linear_share / 2)) <= 1
    # packed weights: the UNet once more, reordered for the input gradient
    assert frozen_weight_bytes(str(tiny_model), "bf16", packed=True) - bf16 == unet // 2
    assert frozen_weight_bytes(str(tiny_model), "fp32", packed=True) - fp32 == unet


def test_the_memory_plan_counts_no_denoiser_at_load_where_the_prompts_are_encoded_first(tiny_model, monkeypatch):
    """A run that encodes its prompts one encoder at a time before the denoiser loads (ranks.encodes_first)
    holds its largest encoder and the VAE at load, not the denoiser or the other encoders beside them; with
    validation images it keeps the encoders, so everything loads together as before."""
    from xeontune.train import ranks

    unet = sum(p.stat().st_size for p in (Path(tiny_model) / "unet").glob("*.safetensors"))
    assert frozen_weight_bytes(str(tiny_model), "fp32") - frozen_weight_bytes(str(tiny_model), "fp32", encoding=True) == unet
    sdxl = frozen_weight_bytes("", "fp32", family="sdxl", encoding=True)  # its larger encoder alone, no UNet
    parts = get_family("sdxl").default_bytes()
    assert sdxl == int(parts["vae"] + max(parts["text_encoder"], parts["text_encoder_2"]))
    loads = []
    weights = ranks.frozen_weight_bytes
    monkeypatch.setattr(ranks, "rank_memory", lambda *a, **k: 0)  # the load alone
    monkeypatch.setattr(ranks, "frozen_weight_bytes", lambda *a, **k: loads.append(k["encoding"]) or weights(*a, **k))
    args = ["--method", "lora", "--instance-prompt", "a toy", "--model", str(tiny_model), "--data-dir", "x",
            "--mixed-precision", "fp32"]
    ranks.memory_plan(parse_args(args), "fp32", 1, 1)
    ranks.memory_plan(parse_args([*args, "--validation-prompt", "a toy"]), "fp32", 1, 1)
    assert loads == [True, False]
    assert ranks.encodes_first(parse_args(args)) and not ranks.encodes_first(parse_args([*args, "--with-prior-preservation",
                                                                                          "--class-prompt", "a thing", "--class-data-dir", "y"]))


@pytest.mark.parametrize("bf16_kernels", [True, False], ids=["bf16-kernels", "no-bf16-kernels"])
def test_ranks_count_packed_weights_where_auto_packs(fake_cpu, bf16_kernels, monkeypatch):
    """The kernels' check (packed.available) is faked as well as the CPU's flags, so that both answers
    are asserted on every CPU: with oneDNN bf16 kernels only AMX packs SDXL in bf16; without them
    (an AVX2-only CPU) nothing packs in bf16. fp32 packs everywhere."""
    import torch

    from xeontune.train import packed

    monkeypatch.setattr(packed, "available", lambda dtype: (dtype == torch.float32 or bf16_kernels, "faked"))
    amx = fake_cpu == "amx-xeon"
    for precision in ("fp32", "bf16"):
        for family in ("sd", "sdxl"):
            assert packs("on", precision, family) and not packs("off", precision, family)
            # a remote node's CPU is not known: counted
            assert packs("auto", precision, family, here=False)
            # on this machine's CPU auto counts what it will do (one thread a rank: AMX's thread limit is not hit)
            want = precision == "fp32" or (bf16_kernels and (family == "sd" or amx))
            assert packs("auto", precision, family) == want, (precision, family)
            assert packed.auto_choice(precision, family, threads=1)[0] == want
    assert frozen_weight_bytes("some-org/some-model", "bf16") < frozen_weight_bytes("some-org/some-model", "fp32")


PIN_PROBE = """
import json, os, sys
from xeontune import placement
cpus = placement.pin_this_rank()
print(json.dumps({"cpus": cpus, "affinity": sorted(os.sched_getaffinity(0)),
                  "threads": os.environ.get("OMP_NUM_THREADS")}))
"""


def probe_pinning(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", placement.PIN_ENV)}
    out = subprocess.run([sys.executable, "-c", PIN_PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_a_rank_pins_itself_to_its_own_cores():
    cores = [c.cpu for c in placement.physical_cores()]
    ranks = len(cores)  # one rank per core: each gets exactly its own
    for local_rank in (0, ranks - 1):
        got = probe_pinning({placement.PIN_ENV: "1", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(ranks)})
        assert got["cpus"] == got["affinity"] == [cores[local_rank]]
        assert got["threads"] == "1"
    # Hydra's names for the same thing (xeontune launch --ppn)
    got = probe_pinning({placement.PIN_ENV: "1", "MPI_LOCALRANKID": str(ranks - 1), "MPI_LOCALNRANKS": str(ranks)})
    assert got["affinity"] == placement.core_slices(placement.physical_cores(), ranks)[ranks - 1]
    # not asked: untouched
    assert probe_pinning({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})["cpus"] is None


def test_nproc_per_node_bad_values(base_args):
    from xeontune.errors import UserError

    for bad in ("0", "-1", "two"):
        with pytest.raises(UserError, match="--nproc-per-node"):
            parse_args(base_args + ["--nproc-per-node", bad])
    cores = len(placement.physical_cores())
    with pytest.raises(UserError, match="physical cores"):
        plan_ranks(parse_args(base_args + ["--nproc-per-node", str(cores + 1)]), "fp32")
    assert plan_ranks(parse_args(base_args + ["--nproc-per-node", "auto"]), "bf16").ranks >= 1


def run_train(args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def vectors(out: Path):
    return load_file(str(out / "learned_embeds.safetensors"))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_match_one_process_with_twice_the_batch_and_their_checkpoint_resumes(base_args, tiny_model,
                                                                                      tmp_path):
    """Same sample plan, same result: 2 ranks x batch 1 = 1 process x batch 2 (fp32: exact kernels), 4 steps
    under a cosine schedule; the ranks' checkpoint-2, resumed by one process with their batch, ends where
    the ranks did (the schedule's state, the optimizer's and the data position cross the checkpoint).
    (A resume on the ranks themselves, sharing rank 0's checkpoint: test_distributed_training.py.)"""
    import torch

    common = base_args + ["--resolution", "32", "--max-train-steps", "4", "--checkpointing-steps", "2",
                          "--save-steps", "0", "--mixed-precision", "fp32", "--scale-lr", "--lr-scheduler", "cosine",
                          "--learning-rate", "5e-3", "--no-random-flip"]  # 10x the default: steps 3-4 move 3e-3
    ranks = run_train(common + ["--output-dir", str(tmp_path / "ranks"), "--nproc-per-node", "2",
                                "--train-batch-size", "1"])
    train_in_process(common + ["--output-dir", str(tmp_path / "one"), "--train-batch-size", "2"])
    assert "2 rank(s) on this machine" in ranks.stdout and "global batch 1 x 2 rank(s) = 2" in ranks.stdout
    got, want = vectors(tmp_path / "ranks"), vectors(tmp_path / "one")
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    moved = moved_from_initializer(tiny_model, want["<toy-bot>"])
    print(f"2 ranks vs 1 process: max abs diff {diff:.2e} (moved {moved:.2e} from the initializer)")
    assert diff <= 1e-5, diff
    assert moved >= 100 * 1e-5, moved  # two runs that learned nothing agree too: 100x the tolerance
    lines = metrics(tmp_path / "ranks")
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # only rank 0 logs
    assert all(0 < r["allreduce_bytes"] <= 16 * 1024 for r in lines)
    # within 1e-5, not rounded: the ranks' latents are encoded in other batches than one process's
    assert [r["loss"] for r in lines] == pytest.approx([r["loss"] for r in metrics(tmp_path / "one")], abs=1e-5)

    train_in_process(common + ["--output-dir", str(tmp_path / "resumed"), "--train-batch-size", "2",
                               "--resume-from-checkpoint", str(tmp_path / "ranks" / "checkpoint-2")])
    resumed = vectors(tmp_path / "resumed")
    at_two = torch.load(tmp_path / "ranks" / "checkpoint-2" / "state.pt", weights_only=True)["vectors"]
    resumed_steps = float((got["<toy-bot>"] - at_two).abs().max())
    diff = max(float((resumed[k] - got[k]).abs().max()) for k in got)
    print(f"the ranks' checkpoint-2 resumed in one process: max abs diff {diff:.2e} ({resumed_steps:.2e} in steps 3-4)")
    assert diff <= 1e-5 and resumed_steps >= 100 * 1e-5, (diff, resumed_steps)
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [3, 4]


@pytest.mark.slow
def test_a_user_error_in_the_ranks_is_one_line(base_args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *base_args, "--nproc-per-node", "2",
                           "--data-dir", str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors and all("error:" in line and "missing" in line for line in errors), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_an_error_only_rank_0_sees_is_one_line_and_the_others_say_why_they_stopped(base_args, tmp_path):
    """Rank 0 alone checks the output dir: its error is the one "error:" line; rank 1, whose next
    collective finds rank 0 gone, says it stopped for that (it printed gloo's traceback before)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "learned_embeds.safetensors").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *base_args, "--nproc-per-node", "2",
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "holds another run" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_bf16_unet_comes_from_a_mapped_copy(tiny_model, tmp_path, monkeypatch):
    """bf16 loads write a bf16 safetensors copy once; that load and every later one memory-map it (shared
    by the ranks of a node: no converted weights held privately) and hold the same weights; a changed
    model file gets a new copy."""
    import torch

    from xeontune.train import backends, components, packed

    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    first = components.load(str(tiny_model), denoiser_dtype=torch.bfloat16).denoiser
    copy = components.bf16_copy_dir(str(tiny_model), None, None)
    assert copy is not None and (copy / "config.json").is_file()
    weights = next(copy.glob("*.safetensors"))
    assert str(weights.resolve()) in Path("/proc/self/maps").read_text()
    assert packed.file_mapped_bytes(first.parameters()) == backends.module_bytes(first) > 0  # the first run too
    second = components.load(str(tiny_model), denoiser_dtype=torch.bfloat16).denoiser
    assert str(weights.resolve()) in Path("/proc/self/maps").read_text()  # mapped, not read and converted
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (not a dict)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
    source = Path(tiny_model) / "unet" / "diffusion_pytorch_model.safetensors"
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert components.bf16_copy_dir(str(tiny_model), None, None) != copy
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns - 10**9))


def test_a_denoiser_stored_in_bf16_is_mapped_from_its_own_files_without_a_copy(tiny_model, tmp_path, monkeypatch):
    """SD3.5's and Flux's files are bf16 already: a bf16 run maps them as it would map a copy, and writes none
    (a copy would be the same bytes again: 4.5 GB for SD3.5 Medium's transformer)."""
    import torch
    from diffusers import StableDiffusionPipeline

    from xeontune.train import backends, components, packed

    half = tmp_path / "half"
    StableDiffusionPipeline.from_pretrained(str(tiny_model), torch_dtype=torch.bfloat16).save_pretrained(half)
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    unet = components.load(str(half), denoiser_dtype=torch.bfloat16).denoiser
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))
    weights = next((half / "unet").glob("*.safetensors"))
    assert str(weights.resolve()) in Path("/proc/self/maps").read_text()
    assert packed.file_mapped_bytes(unet.parameters()) == backends.module_bytes(unet) > 0
    stored = StableDiffusionPipeline.from_pretrained(str(half), torch_dtype=torch.bfloat16).unet.state_dict()
    assert all(torch.equal(stored[k], v) for k, v in unet.state_dict().items())


def test_a_sharded_unet_gets_a_mapped_bf16_copy_too(tiny_model, tmp_path, monkeypatch):
    """save_pretrained shards a large UNet (an SDXL UNet in fp32, fine-tunes saved by diffusers): its
    bf16 copy is keyed on the index and every shard, and later loads map it instead of converting."""
    import shutil

    import torch
    from diffusers import UNet2DConditionModel

    from xeontune.train import components

    model = tmp_path / "sharded"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("unet"))
    UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet").save_pretrained(
        model / "unet", max_shard_size="200KB")
    shards = sorted((model / "unet").glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) > 1 and not (model / "unet" / "diffusion_pytorch_model.safetensors").exists()
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    first = components.load(str(model), denoiser_dtype=torch.bfloat16).denoiser
    copy = components.bf16_copy_dir(str(model), None, None)
    assert copy is not None and (copy / "config.json").is_file()
    second = components.load(str(model), denoiser_dtype=torch.bfloat16).denoiser
    assert str(next(copy.glob("*.safetensors")).resolve()) in Path("/proc/self/maps").read_text()
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
    os.utime(shards[-1], ns=(shards[-1].stat().st_atime_ns, shards[-1].stat().st_mtime_ns + 10**9))
    assert components.bf16_copy_dir(str(model), None, None) != copy  # any shard changed: a new copy


def test_bf16_text_encoder_linears_come_from_a_mapped_copy(tiny_model, tmp_path, monkeypatch):
    """The text encoder's Linear layers in bf16: the first run casts and writes a copy, the ranks'
    launcher writes it before they start, and later loads memory-map it with the same weights; the
    LayerNorms and the token table stay fp32; a damaged copy only costs the conversion."""
    import torch

    from xeontune.train import components

    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    model = str(tiny_model)

    def loaded():
        parts = components.Components(None, components.load_text_encoder(model), None, None, None)
        components.cast_text_encoder_linears(parts, torch.bfloat16, model)
        assert parts.text_encoder_cast
        return parts.text_encoder

    components.ensure_bf16_copies(model)  # what `--nproc-per-node` runs before the ranks
    copy = components.bf16_copy_dir(model, None, None, "text_encoder") / components.TEXT_LINEARS_FILE
    assert copy.is_file() and str(copy.resolve()) not in Path("/proc/self/maps").read_text()
    cast = {n: p.detach().clone() for n, p in components.load_text_encoder(model).named_parameters()}
    mapped = loaded()
    assert str(copy.resolve()) in Path("/proc/self/maps").read_text()  # mapped, not read and converted
    for name, p in mapped.named_parameters():
        linear = "_proj." in name or ".fc" in name
        assert p.dtype == (torch.bfloat16 if linear else torch.float32), name
        assert torch.equal(p, cast[name].to(p.dtype)), name
    damaged = copy.with_name("damaged")
    damaged.write_bytes(b"damaged")
    damaged.rename(copy)  # a new file, as every writer makes it: a run that maps the old one reads on
    again = loaded()  # converts, with a warning, and trains the same
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), mapped.parameters(), strict=True))


def test_an_unwritable_cache_only_costs_speed(tiny_model, tmp_path, monkeypatch, caplog):
    import torch

    from xeontune.train import components

    caplog.set_level("WARNING", logger="xeontune.train.components")  # bench's tests quiet xeontune.train
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be made
    unet = components.load(str(tiny_model), denoiser_dtype=torch.bfloat16).denoiser
    assert next(unet.parameters()).dtype == torch.bfloat16
    assert "could not write the bf16 UNet copy" in caplog.text


def test_a_full_disk_while_writing_a_bf16_copy_warns_and_leaves_no_partial_folder(tiny_model, tmp_path):
    """Issue 18, finding 13: safetensors reports a failed write as SafetensorError, not OSError. The
    disk 'fills' at 4 KB per file here (RLIMIT_FSIZE: writes past it fail with EFBIG, as ENOSPC would)."""
    from xeontune.train import components

    cache = tmp_path / "cache"
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "from xeontune.train import components\n"
        "components.ensure_bf16_copies(sys.argv[1])\n"
    )
    env = {**os.environ, components.BF16_CACHE_ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not write the bf16 UNet copy" in done.stderr
    assert "could not write the bf16 text encoder's Linear layers copy" in done.stderr
    assert not [p for p in cache.rglob("*") if p.name.startswith(".")]  # no partial folder left
    assert not [p for p in cache.rglob("*") if p.is_file()]  # nor a copy that looks whole


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_bf16_copies_are_byte_for_byte_what_casting_the_loaded_models_wrote(kind, tiny_model, sdxl_model, tmp_path,
                                                                            monkeypatch):
    """Issue 29: the copies are now written from the files one tensor at a time. They hold exactly what
    `model.to(torch.bfloat16)` holds, and are the very files that saving the cast models wrote before."""
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    from xeontune.train import components

    model = str(tiny_model if kind == "sd" else sdxl_model)
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    components.ensure_bf16_copies(model)
    copy = components.bf16_copy_dir(model, None, None)
    cast = UNet2DConditionModel.from_pretrained(model, subfolder="unet").to(torch.bfloat16)
    made = load_file(str(copy / "diffusion_pytorch_model.safetensors"))
    want = cast.state_dict()
    assert made.keys() == want.keys()
    for name, tensor in want.items():
        assert made[name].dtype == tensor.dtype == torch.bfloat16 and torch.equal(made[name], tensor), name
    cast.register_to_config(_name_or_path=model)  # what from_pretrained(torch_dtype=...) records
    cast.save_pretrained(tmp_path / "saved")
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert (copy / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name
    for part in ("text_encoder", "text_encoder_2")[: 2 if kind == "sdxl" else 1]:
        linears = components._linears(components.load_text_encoder(model, part=part))
        for module in linears.values():
            module.to(torch.bfloat16)
        saved = tmp_path / f"{part}.safetensors"
        save_file({f"{n}.{k}": t.contiguous() for n, m in linears.items() for k, t in m.state_dict().items()}, str(saved))
        made_file = components.bf16_copy_dir(model, None, None, part) / components.TEXT_LINEARS_FILE
        assert made_file.read_bytes() == saved.read_bytes(), part


def _unet_layout(tiny_model: Path, tmp_path: Path, layout: str) -> tuple[str, str | None]:
    """The tiny pipeline with its UNet stored otherwise: sharded, a .bin (torch's zip format), an old
    pickled .bin, or a `--variant fp16`. Returns the model folder and the variant to load it with."""
    import shutil

    import torch
    from diffusers import UNet2DConditionModel

    model = tmp_path / layout
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    if layout == "sharded":
        unet.save_pretrained(model / "unet", max_shard_size="200KB")
    elif layout == "fp16":
        unet.to(torch.float16).save_pretrained(model / "unet", variant="fp16")
        shutil.copy(model / "text_encoder" / "model.safetensors", model / "text_encoder" / "model.fp16.safetensors")
        return str(model), "fp16"
    else:
        unet.save_pretrained(model / "unet", safe_serialization=False)
        if layout == "old-bin":
            path = model / "unet" / "diffusion_pytorch_model.bin"
            torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)
    return str(model), None


@pytest.mark.parametrize("layout", ["sharded", "bin", "fp16"])
def test_the_unet_copy_is_made_from_the_files_in_every_layout(layout, tiny_model, tmp_path, monkeypatch):
    """Sharded safetensors with their index, a .bin, a half-precision variant: the copy is made from the
    files tensor by tensor (no UNet is loaded to make it), and holds what loading in bf16 gives."""
    import torch
    from diffusers import UNet2DConditionModel

    from xeontune.train import components

    model, variant = _unet_layout(tiny_model, tmp_path, layout)
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    with monkeypatch.context() as patched:
        def converted(*args, **kwargs):
            raise AssertionError("the UNet was loaded and converted in memory to make its copy")

        patched.setattr(components, "_load_denoiser_in", converted)
        components.ensure_bf16_copies(model, "", variant or "")
    copy = components.bf16_copy_dir(model, None, variant)
    assert copy is not None and (copy / "config.json").is_file()
    made = load_file(str(copy / "diffusion_pytorch_model.safetensors"))
    want = UNet2DConditionModel.from_pretrained(model, subfolder="unet", variant=variant,
                                                torch_dtype=torch.bfloat16).state_dict()
    assert made.keys() == want.keys()
    assert all(made[k].dtype == torch.bfloat16 and torch.equal(made[k], t) for k, t in want.items())


def test_an_old_pickled_bin_is_converted_in_memory_as_before(tiny_model, tmp_path, monkeypatch, caplog):
    """A .bin in torch's pre-1.6 format cannot be read a tensor at a time: loading converts it and
    writes the copy from the converted model, as every UNet was before; later loads map that copy."""
    import torch

    from xeontune.train import components

    caplog.set_level("INFO", logger="xeontune.train.components")
    model, _ = _unet_layout(tiny_model, tmp_path, "old-bin")
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    unet = components.load(model, denoiser_dtype=torch.bfloat16).denoiser
    assert "converting it in memory" in caplog.text
    copy = components.bf16_copy_dir(model, None, None)
    assert (copy / "config.json").is_file()
    assert str(next(copy.glob("*.safetensors")).resolve()) in Path("/proc/self/maps").read_text()
    want = components.load(str(tiny_model), denoiser_dtype=torch.bfloat16).denoiser.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in unet.state_dict().items())


PEAK_CODE = """
import sys
from pathlib import Path
import accelerate, torch  # the code that making the copy runs, imported before the peak is reset
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer
from xeontune.train import components, packed, tensorfiles

def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
before = status("VmRSS")
if sys.argv[2] == "launcher":
    components.ensure_bf16_copies(sys.argv[1])
else:
    components.load(sys.argv[1], denoiser_dtype=torch.bfloat16)
print(status("VmHWM") - before)
"""


@pytest.fixture(scope="module")
def large_unet_model(tiny_model, tmp_path_factory) -> tuple[Path, int]:
    """The tiny pipeline with a 323 MB (fp32) UNet, and that size; made once for the module (each test
    makes its copy in a cache of its own)."""
    import shutil

    from diffusers import UNet2DConditionModel

    model = tmp_path_factory.mktemp("large-unet") / "model"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel(block_out_channels=(160, 320, 320, 320), layers_per_block=2, cross_attention_dim=256,
                                attention_head_dim=8, sample_size=8)
    unet.save_pretrained(model / "unet")
    return model, sum(p.numel() * 4 for p in unet.parameters())


@pytest.mark.slow  # builds a 323 MB UNet (large_unet_model): not in `make test-fast`
@pytest.mark.parametrize("where", ["launcher", "first run"])
def test_making_the_unet_copy_never_holds_the_model(where, large_unet_model, tmp_path, monkeypatch):
    """Issue 29: a first SDXL run converted the fp32 UNet in memory to write its copy (peak 15.4 GB
    against 8.5 GB on later runs). Measured in a fresh process on a 323 MB (fp32) UNet: making its
    copy, as the rank launcher does or as a run's load does, now grows the process by a few of its
    tensors (its largest is 7.4 MB), not by the model (the fp32 pages read and the bf16 model: 480 MB)."""
    from xeontune.train import components

    model, fp32_bytes = large_unet_model
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    assert not (components.bf16_copy_dir(str(model), None, None) / "config.json").exists()  # made by this test
    done = subprocess.run([sys.executable, "-c", PEAK_CODE, str(model), where], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grew = int(done.stdout.split()[-1])
    assert (components.bf16_copy_dir(str(model), None, None) / "config.json").is_file()
    assert grew < fp32_bytes / 4, f"making the copy grew the process by {grew / 1e6:.0f} MB ({fp32_bytes / 1e6:.0f} MB fp32)"


def test_a_hub_models_unet_copy_is_made_from_its_downloaded_files(tiny_model, tmp_path, monkeypatch):
    """A hub id whose UNet is not in the hub cache yet: its files (config, index, shards) are fetched
    without loading the model, and the copy is made from them, as for a local folder."""
    import shutil

    import huggingface_hub

    from xeontune.train import components, families

    hub, _ = _unet_layout(tiny_model, tmp_path, "sharded")  # what the "hub" serves
    snapshot = tmp_path / "hub-cache" / "snapshot"

    def download(repo_id, filename, subfolder=None, revision=None, **kwargs):
        assert repo_id == "org/tiny"
        name = f"{subfolder}/{filename}" if subfolder else filename
        if not (Path(hub) / name).is_file():
            raise huggingface_hub.errors.EntryNotFoundError(name)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(hub) / name, snapshot / name)
        return str(snapshot / name)

    def cached(repo_id, filename, revision=None, **kwargs):
        return str(snapshot / filename) if (snapshot / filename).is_file() else None

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", cached)
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    assert components.bf16_copy_dir("org/tiny", None, None) is None  # not downloaded yet
    copy, _ = components._denoiser_copy(families.get("sd"), "org/tiny", None, None)
    assert copy == components.bf16_copy_dir("org/tiny", None, None) and (copy / "config.json").is_file()
    assert len(list((snapshot / "unet").glob("*.safetensors"))) > 1  # the shards, through the index
    assert json.loads((copy / "config.json").read_text())["_name_or_path"] == "org/tiny"
    local, _ = components._denoiser_copy(families.get("sd"), hub, None, None)  # the same files, as a local folder
    weights = "diffusion_pytorch_model.safetensors"
    assert (copy / weights).read_bytes() == (local / weights).read_bytes()


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_with_one_line_and_no_traceback(base_args, tmp_path):
    """`timeout`, `kill` or a batch system stopping `xeontune train --nproc-per-node 2`: torch's agent stops
    the ranks and raised its SignalException, a traceback; now one line and 128 + the signal."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "xeontune.cli", "train", *base_args, "--nproc-per-node", "2",
                             "--resolution", "32", "--max-train-steps", "100000", "--checkpointing-steps", "0",
                             "--save-steps", "0", "--mixed-precision", "fp32", "--output-dir", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # until the ranks step: the forecast comes after the first steps
        seen.append(line)
        if "forecast:" in line:
            break
    assert "forecast:" in seen[-1], "".join(seen)[-2000:]
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, rest[-2000:]
    assert "Traceback" not in rest and "death signal" not in rest, rest[-3000:]
    assert rest.strip().splitlines()[-1] == "interrupted (SIGTERM): every rank was stopped", rest[-1000:]


def test_half_precision_files_count_as_the_fp32_weights_they_load_as(tiny_model, tmp_path):
    """SD3.5's and Flux.1's files are bf16 (and many SDXL copies fp16): the trainer upcasts them, so the plan
    counts a half-precision tensor at 4 bytes, read from the safetensors header; a variant's files count only
    where the plain ones are absent."""
    import shutil

    import torch
    from diffusers import StableDiffusionPipeline

    half = tmp_path / "half"
    StableDiffusionPipeline.from_pretrained(str(tiny_model), torch_dtype=torch.bfloat16).save_pretrained(half)
    fp32 = frozen_weight_bytes(str(tiny_model), "fp32")
    assert abs(frozen_weight_bytes(str(half), "fp32") - fp32) <= 0.01 * fp32
    both = tmp_path / "both"
    shutil.copytree(tiny_model, both)
    for part in ("unet", "vae", "text_encoder"):  # a --variant fp16 beside the fp32 files
        for f in (half / part).glob("*.safetensors"):
            shutil.copy(f, both / part / f.name.replace(".safetensors", ".fp16.safetensors"))
    assert frozen_weight_bytes(str(both), "fp32") == fp32
