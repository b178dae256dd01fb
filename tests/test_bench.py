"""`xeontune bench` on the tiny model: the JSON contract, the peak-RSS child, bad input.

Speeds are not asserted here (a shared 2-core machine makes timed tests flaky); the targets live in
`make bench` and docs/performance.md. The tests that run a bench (training steps) are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xeontune import bench, hardware
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train.loop import PHASES

FAST = ["--resolution", "32", "--steps", "1", "--warmup", "0", "--allocator", "none", "--matmul-size", "256",
        "--ranks-per-node", "none"]


def _assert_documented_keys(result: dict) -> None:
    for variant in ("optimized", "baseline"):
        v = result[variant]
        assert v["s_per_step"] > 0 and v["images_per_s"] > 0
        assert "peak_rss_mb" in v and set(v["phases"]) == set(PHASES)
    assert result["baseline"]["phases"]["latents"] > 0  # the baseline encodes with the VAE every step
    for key in ("speedup", "model_compute_s_per_step", "model_gflop_per_step", "achieved_gflops",
                "machine_peak_gflops"):
        assert result[key] > 0, key


@pytest.mark.slow
@pytest.mark.parametrize("fake_cpu", ["amx-xeon"], indirect=True)  # avx2-only: the FLOPs test below
def test_bench_json_has_the_documented_keys(tiny_model, capsys, tmp_path, fake_cpu):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_model), *FAST, "--no-rss", "--json", "--json-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    _assert_documented_keys(result)
    # the precision follows the (faked) CPU: bf16 runs emulated on a CPU without AMX, fine at this size
    assert result["config"]["precision"] == "bf16"


@pytest.mark.slow
def test_ranks_per_node_sweep_and_mfu_with_one_variant_at_a_time(tiny_model, capsys, tmp_path):
    """Each count is a real `xeontune train --nproc-per-node R` run; auto is marked with what it chose,
    and the table judges it against its target. --one-at-a-time (for models whose two copies do not fit
    together: sdxl-arch in fp32 on 24 GB): the same result keys, the baseline stepped in its own process
    once the optimized variant is done."""
    from xeontune import placement
    from xeontune.bench import SHARED_TARGETS
    from xeontune.train.options import parse_args
    from xeontune.train.ranks import plan_ranks

    argv = FAST[:-2]  # without --ranks-per-node none
    saved = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_model), *argv, "--steps", "2", "--no-rss", "--json-out", str(saved),
                 "--ranks-per-node", "auto", "--one-at-a-time"]) == 0
    table = capsys.readouterr().out
    result = json.loads(saved.read_text())
    assert result["config"]["one_at_a_time"] and result["speedup"] > 0
    assert len(result["baseline"]["step_times_s"]) == len(result["optimized"]["step_times_s"]) == 2
    assert result["baseline"]["phases"]["latents"] > 0
    assert any("--one-at-a-time" in n for n in result["config"]["backend_notes"])
    auto_row = next(r for r in result["ranks_per_node"] if r["auto"])
    assert (f"auto ranks per node: {auto_row['vs_example']:.2f}x the example's images/s "
            f"(target >= {SHARED_TARGETS['auto_ranks_speedup_min']})") in table
    opts = parse_args(["--model", str(tiny_model), "--data-dir", ".", "--placeholder-token", "<t>",
                       "--initializer-token", "toy", "--resolution", "32", "--nproc-per-node", "auto"])
    auto = plan_ranks(opts, result["config"]["precision"]).ranks
    rows = result["ranks_per_node"]
    assert [r["ranks"] for r in rows] == [auto]  # (lists of counts: test_rank_counts_read_lists_powers_and_none)
    assert [r["ranks"] for r in rows if r["auto"]] == [auto]
    for r in rows:
        assert r["images_per_s"] > 0 and r["s_per_step"] > 0 and r["peak_pss_mb"] > 50 and r["vs_example"] > 0
        assert 0 < r["mfu"] < 1
    assert result["physical_cores"] == len(placement.physical_cores())
    # MFU is measured against one core's peak times the physical cores. (Not compared with the
    # whole-machine peak: on two hyperthreads of one core, or a busy host, that can come out lower.)
    node_peak = result["core_peak_gflops"] * result["physical_cores"]
    assert result["core_peak_gflops"] > 0 and result["machine_peak_gflops"] > 0
    assert result["mfu"] == pytest.approx(result["achieved_gflops"] / node_peak)
    batch = result["config"]["batch_size"]
    for r in rows:
        assert r["mfu"] == pytest.approx(r["images_per_s"] * result["model_gflop_per_step"] / batch / node_peak)


@pytest.mark.slow
def test_peak_rss_child_reports_its_own_peak(tiny_model):
    done = subprocess.run(
        [sys.executable, "-m", "xeontune.bench", "--rss-child", "baseline", "--model", str(tiny_model),
         "--resolution", "32", "--steps", "1", "--warmup", "0", "--allocator", "none"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["variant"] == "baseline" and report["peak_rss_mb"] > 50


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--resolution", "60"], ["--model", "/nonexistent/model"], ["--warmup", "-1"],
     ["--ranks-per-node", "1,x"], ["--ranks-per-node", "1,4096"],
     ["--nodes", "2"], ["--nodes", "1,x"], ["--link-rate", "10gbit"], ["--nodes", "1,2", "--link-rate", "fast"],
     ["--nodes", "1,2", "--check-rate", "1 gbit"], ["--nodes", "1,2", "--shard", "optimizer"],
     ["--nodes", "1,2", "--predict-rate", "25gbit", "--predict-nodes", "8,x"]],
)
def test_bad_input_is_a_one_line_error(argv, capsys):
    assert main(["bench", *argv, "--allocator", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_missing_requested_allocator_is_a_user_error(monkeypatch):
    monkeypatch.delenv(hardware.PRELOAD_MARKER, raising=False)
    monkeypatch.setattr(hardware, "launch_env", lambda *a, **k: {"OMP_NUM_THREADS": "2"})
    with pytest.raises(UserError, match="tcmalloc"):
        hardware.reexec_with_allocator(["-m", "xeontune.bench"], "tcmalloc")
    assert not hardware.reexec_with_allocator(["-m", "xeontune.bench"], "auto")  # nothing found: runs on as it is
    assert main(["bench", "--allocator", "jemalloc", "--steps", "1"]) == 2  # one line, before any model is built


def test_reexec_preloads_once(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(hardware, "launch_env", lambda *a, **k: {"LD_PRELOAD": "/lib/libtcmalloc.so.4"})
    monkeypatch.delenv(hardware.PRELOAD_MARKER, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert hardware.reexec_with_allocator(["-m", "xeontune.bench"])
    _, argv, env = calls[0]
    assert argv[1:] == ["-m", "xeontune.bench"] and env["LD_PRELOAD"] == "/lib/libtcmalloc.so.4"
    monkeypatch.setenv(hardware.PRELOAD_MARKER, "1")
    assert not hardware.reexec_with_allocator(["-m", "xeontune.bench"])  # the re-executed process
    assert len(calls) == 1


ALLOCATOR_PROBE = "from xeontune.bench import loaded_allocator; print(loaded_allocator())"


def _allocator_of_a_process(preload: str | None) -> str:
    """What loaded_allocator() says in a fresh Python with ``preload`` as its LD_PRELOAD (None: none)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", hardware.PRELOAD_MARKER)}
    if preload:
        env["LD_PRELOAD"] = preload
    done = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_loaded_allocator_names_the_malloc_mapped_into_the_process(monkeypatch):
    """The rule: tcmalloc or jemalloc where that library is mapped into the process (LD_PRELOAD puts
    it there), glibc malloc where neither is, unknown where the memory map cannot be read."""
    assert _allocator_of_a_process(None) == "glibc malloc"
    libs = hardware.libraries()
    for name, path in (("tcmalloc", libs.tcmalloc), ("jemalloc", libs.jemalloc)):
        if path:  # this machine has it (CI installs tcmalloc): a real process that maps it
            assert _allocator_of_a_process(path) == name, path

    class Maps:  # /proc/self/maps as bench reads it, faked for the libraries this machine may not have
        text: str | None = ""

        def __init__(self, path: str) -> None:
            assert path == "/proc/self/maps"

        def read_text(self) -> str:
            if Maps.text is None:
                raise PermissionError("/proc/self/maps")
            return Maps.text

    monkeypatch.setattr(bench, "Path", Maps)
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/{}\n"
    for maps, want in (([line.format("libc.so.6")], "glibc malloc"),
                       ([line.format("libc.so.6"), line.format("libtcmalloc_minimal.so.4")], "tcmalloc"),
                       ([line.format("libjemalloc.so.2"), line.format("libc.so.6")], "jemalloc"),
                       (None, "unknown")):
        Maps.text = None if maps is None else "".join(maps)
        assert bench.loaded_allocator() == want, maps


@pytest.mark.slow
@pytest.mark.parametrize("fake_cpu", ["avx2-only"], indirect=True)
def test_baseline_worker_counts_the_same_model_flops_as_the_trainer(tiny_model, capsys, tmp_path, fake_cpu):
    """The FLOPs come from the baseline worker when there is one. Its step encodes latents with the
    VAE every step; that encode is input preparation, so it must not be counted (it once tripled
    the figure), and the count must equal the optimized run's own. On an AVX2-only CPU the precision
    is fp32 (so the counts compare exactly); with --no-baseline the table leaves the baseline out."""
    args = ["bench", "--model", str(tiny_model), *FAST, "--no-rss"]
    assert main([*args, "--json"]) == 0
    with_worker = json.loads(capsys.readouterr().out)
    _assert_documented_keys(with_worker)
    assert with_worker["config"]["precision"] == "fp32"
    saved = tmp_path / "alone.json"
    assert main([*args, "--no-baseline", "--json-out", str(saved)]) == 0
    table = capsys.readouterr().out
    assert "s/step (median)" in table and "optimized" in table and "baseline" not in table
    assert "GFLOP per step" in table
    alone = json.loads(saved.read_text())
    assert with_worker["model_gflop_per_step"] == pytest.approx(alone["model_gflop_per_step"], rel=1e-6)
    assert any(n.startswith("baseline: own process") for n in with_worker["config"]["backend_notes"])


def test_sdxl_baseline_holds_the_models_as_the_sdxl_example_does(tmp_path):
    """diffusers' textual_inversion_sdxl.py: both encoders' whole token tables trainable (the frozen
    rows copied back after each step), the VAE encoding every step, and with bf16 the UNet, the VAE
    and the whole second text encoder (its token table too) cast to bf16, the first kept in fp32."""
    import argparse

    import torch

    from xeontune import models
    from xeontune.train import loop, tokens

    model = bench.resolve_model("sdxl-tiny", str(tmp_path / "models"))  # a built-in kind, built once
    assert (tmp_path / "models" / "sdxl-tiny" / "text_encoder_2").is_dir()
    data = tmp_path / "data"
    models.write_sample_data(data, count=2, size=64)
    args = argparse.Namespace(resolution=64, batch_size=1, warmup=0, steps=1, mixed_precision="bf16", ipex="off",
                              compile=False, pack_weights="off")
    opts = bench.variant_options(model, data, tmp_path / "out", args, "baseline")
    assert opts.train_full_table and not opts.cache_latents
    run, _ = loop.setup(opts, loop.make_accelerator(opts), components=bench.example_components(model, "bf16"))
    c = run.components
    first, second = run.embedding.clip_l, run.embedding.clip_g
    assert isinstance(first, tokens.FullTableEmbedding) and isinstance(second, tokens.FullTableEmbedding)
    assert first.weight.shape[0] == len(c.tokenizer) and second.weight.shape[0] == len(c.tokenizer_2)
    assert (first.weight.dtype, second.weight.dtype) == (torch.float32, torch.bfloat16)
    trained = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert trained == {id(first.weight), id(second.weight)}
    assert {p.dtype for p in c.denoiser.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in c.vae.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in c.text_encoder_2.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in c.text_encoder.parameters()} == {torch.float32}
    before = (first.weight.detach().clone(), second.weight.detach().clone())
    loop.train_step(run, 0)
    assert run.phases.take()["latents"] > 0  # the VAE encoded this step's images
    for table, old, ids in ((first, before[0], run.placeholder.ids), (second, before[1], run.placeholder_2.ids)):
        changed = (table.weight.detach() != old).any(dim=-1).nonzero().flatten().tolist()
        assert changed == ids  # only the new rows moved, in both tables

    fp32 = bench.example_components(model, "fp32")  # the script casts nothing in fp32
    assert {p.dtype for m in (fp32.denoiser, fp32.vae, fp32.text_encoder_2) for p in m.parameters()} == {torch.float32}


@pytest.mark.slow
def test_sdxl_bench_counts_flops_and_takes_sdxl_targets(tmp_path, capsys):
    assert main(["bench", "--model", "sdxl-tiny", "--models-dir", str(tmp_path), *FAST, "--no-rss", "--json",
                 "--mixed-precision", "fp32", "--gradient-checkpointing"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["family"] == "sdxl" and result["config"]["gradient_checkpointing"]
    assert any(n.startswith("gradient checkpointing") for n in result["config"]["backend_notes"])
    assert result["config"]["targets"]["speedup_min"] == 2.0 and result["config"]["targets"]["rss_ratio_max"] == 0.9
    assert result["baseline"]["phases"]["latents"] > 0 and result["optimized"]["phases"]["latents"] < \
        result["baseline"]["phases"]["latents"]
    assert result["model_gflop_per_step"] > 0 and 0 < result["mfu"] < 1
    assert bench.targets_for("sdxl", "bf16")["rss_ratio_max"] == 0.6
    # textual inversion's own (its declaration's) beside every method's; LoRA's by precision
    assert bench.targets_for("sd", "bf16") == {**bench.SHARED_TARGETS, "speedup_min": 1.6, "rss_ratio_max": 0.8}
    assert bench.targets_for("sd", "fp32", "lora")["speedup_min"] == 1.8
    assert bench.targets_for("sdxl", "fp32", "full") == {**bench.SHARED_TARGETS, "speedup_min": 1.4, "rss_ratio_max": 0.8}


def test_an_unwritable_json_out_is_refused_before_the_bench_runs(tiny_model, tmp_path, capsys):
    """It ran the whole bench, then failed to write (a folder, or a path under a missing one)."""
    for target in (tmp_path, tmp_path / "missing" / "out.json"):
        assert main(["bench", "--model", str(tiny_model), *FAST, "--warmup", "1", "--no-rss", "--json-out",
                     str(target)]) == 2
        err = capsys.readouterr().err
        assert "--json-out" in err and "cannot write there" in err, err
        assert "warm-up" not in err and "step 1" not in err, err  # refused up front: not one step ran


@pytest.mark.slow
def test_lora_bench_baseline_runs_the_vae_and_the_text_encoder_every_step(tiny_model, capsys):
    """diffusers' train_dreambooth_lora.py: VAE and text encoder every step; ours caches both."""
    assert main(["bench", "--method", "lora", "--model", str(tiny_model), *FAST, "--no-rss", "--json",
                 "--mixed-precision", "fp32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["method"] == "lora" and result["config"]["rank"] == 4
    assert result["config"]["targets"]["speedup_min"] == 1.8 and result["config"]["targets"]["rss_ratio_max"] == 0.6
    base, ours = result["baseline"]["phases"], result["optimized"]["phases"]
    assert base["latents"] > 0 and base["text_encoder_forward"] > 0
    assert ours["text_encoder_forward"] < base["text_encoder_forward"] and ours["latents"] < base["latents"]
    assert result["model_gflop_per_step"] > 0


def test_the_sd3_baseline_encodes_its_prompt_once_and_the_flux_one_every_step(sd3_model, flux_model, tmp_path):
    """As the scripts run: train_dreambooth_lora_sd3.py encodes the instance prompt once; the Flux script's
    loop encodes it again at every step (its encoders stay alive in the list it passes). Ours caches both."""
    import argparse

    from xeontune import models

    data = tmp_path / "data"
    models.write_sample_data(data, count=2, size=64)
    args = argparse.Namespace(resolution=64, batch_size=1, warmup=0, steps=1, mixed_precision="fp32", ipex="off",
                              compile=False, pack_weights="off", method="lora", rank=4)
    cached = {name: [bench.variant_options(model, data, tmp_path / "out", args, variant).cache_text
                     for variant in ("baseline", "optimized")]
              for name, model in (("sd3", sd3_model), ("flux", flux_model))}
    assert cached == {"sd3": [True, True], "flux": [False, True]}


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_lora_baseline_casts_every_frozen_model_and_keeps_the_adapters_fp32(family, request, tmp_path):
    import argparse

    import torch

    from xeontune import models
    from xeontune.train import loop

    model = request.getfixturevalue("tiny_model" if family == "sd" else "sdxl_model")
    data = tmp_path / "data"
    models.write_sample_data(data, count=2, size=64)
    args = argparse.Namespace(resolution=64, batch_size=1, warmup=0, steps=1, mixed_precision="bf16", ipex="off",
                              compile=False, pack_weights="off", method="lora", rank=4)
    opts = bench.variant_options(model, data, tmp_path / "out", args, "baseline")
    assert opts.method == "lora" and not opts.cache_latents and not opts.cache_text
    run, _ = loop.setup(opts, loop.make_accelerator(opts),
                        components=bench.example_components(model, "bf16", "lora"))
    c = run.components
    assert run.text_cache is None
    assert {p.dtype for m in c.text_encoders for p in m.parameters()} == {torch.bfloat16}
    # train_dreambooth_lora.py casts its VAE to bf16; train_dreambooth_lora_sdxl.py keeps it fp32
    vae_dtype = torch.bfloat16 if family == "sd" else torch.float32
    assert {p.dtype for p in c.vae.parameters()} == {vae_dtype}
    trainable = [p for p in c.denoiser.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}
    assert {p.dtype for p in c.denoiser.parameters() if not p.requires_grad} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.root
def test_nodes_sweep_measures_scaling_on_shaped_links_and_fits_its_cost_model(tiny_model, xeontune_home, capsys,
                                                                                tmp_path):
    """`bench --method full --nodes 1,2 --link-rate 50mbit`: two real `run --provider local`s (one rank a node,
    one thread each); the 2-node step waits for its bf16 gradients on a 50 Mbit/s link, so it scales below
    1; the cost model fitted to it carries the result to 8 and 16 nodes at 25 Gbit/s. (--check-rate's third
    run, and the arithmetic: test_real_node_step_shapes_the_links_as_much_slower_as_a_node_here_is.)"""
    from tests.cluster.clusterlib import require_local_cluster

    require_local_cluster()
    saved = tmp_path / "nodes.json"
    assert main(["bench", "--method", "full", "--model", str(tiny_model), "--resolution", "32", "--steps", "2",
                 "--warmup", "1", "--mixed-precision", "fp32", "--nodes", "1,2", "--link-rate", "50mbit",
                 "--grad-compression", "bf16", "--predict-rate", "25gbit",
                 "--predict-nodes", "8,16", "--node-speedup", "4", "--json-out", str(saved)]) == 0
    table = capsys.readouterr().out
    result = json.loads(saved.read_text())
    one, two = result["measured"]
    assert (one["nodes"], two["nodes"]) == (1, 2) and one["bytes_per_step"] == 0
    unet_bytes = sum(f.stat().st_size for f in (tiny_model / "unet").glob("*.safetensors"))
    assert two["bytes_per_step"] >= 0.99 * unet_bytes / 2  # the UNet's gradients in bf16 (the file: and a header)
    assert two["link_bps"] == 50e6 and two["wait_s"] > 0 and two["efficiency"] < 1 and two["fitted"]
    assert result["checked"] == [] and result["model"]["bytes_per_step"] == two["bytes_per_step"]
    assert [p["nodes"] for p in result["predicted"]] == [1, 8, 16]
    assert all(not p["measured"] and 0 < p["efficiency"] <= 1 for p in result["predicted"])
    assert "| 2 | 0.05 Gbit/s |" in table and "modelled (a node 4x faster)" in table


def test_the_nodes_sweep_leaves_out_the_second_step_where_ddp_accumulates():
    """Under DDP with accumulation the second step all-reduces one micro-step more, once: each count leaves
    out at least two steps there (the steps it runs grow to match), --warmup's elsewhere."""
    from pathlib import Path
    from types import SimpleNamespace

    from xeontune import scaling

    def argv(**given):
        args = SimpleNamespace(**{"method": "full", "warmup": 1, "steps": 2, "accumulation": 4, "shard": "none",
                                  "resolution": 32, "batch_size": 1, "mixed_precision": "fp32",
                                  "grad_compression": "bf16", "optimizer": "adamw", "use_ema": False,
                                  "gradient_checkpointing": False, **given})
        cmd = scaling.train_argv(args, Path("m"), Path("d"), Path("o"))
        return scaling.warmup_steps(args), int(cmd[cmd.index("--max-train-steps") + 1])

    assert argv() == (2, 4)
    assert argv(shard="optimizer", warmup=3) == (3, 5)
    assert argv(shard="full") == (1, 3) and argv(accumulation=1) == (1, 3)


def test_synthetic_data_is_random_images_each_captioned_apart_as_the_trainer_reads_them(tmp_path):
    """--synthetic-data's images: random pixels at the size asked, a caption of its own each (metadata.jsonl),
    which the trainer takes over the instance prompt: the text encoder sees a new prompt every sample."""
    from PIL import Image

    from xeontune import models
    from xeontune.train.prompts import image_prompts

    paths = models.write_synthetic_data(tmp_path / "synth", count=5, size=40)
    again = models.write_synthetic_data(tmp_path / "again", count=5, size=40)
    assert [Image.open(p).size for p in paths] == [(40, 40)] * 5
    assert all((a.read_bytes() == b.read_bytes()) for a, b in zip(paths, again, strict=True))  # seeded
    assert len({p.read_bytes() for p in paths}) == 5
    prompts = image_prompts(tmp_path / "synth", paths, instance_prompt="a photo of sks toy")
    assert prompts.source == "captions" and len(prompts.texts) == 5 and prompts.of_image == list(range(5))


@pytest.mark.slow
def test_the_full_bench_takes_synthetic_data_ema_and_adafactor_to_both_variants(tiny_model, capsys, tmp_path):
    """`bench --method full --synthetic-data --use-ema --optimizer adafactor` (MosaicML's benchmark run): the
    trainer and the baseline worker both train so, and the result says per core too."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--method", "full", "--model", str(tiny_model), *FAST, "--no-rss", "--synthetic-data",
                 "--use-ema", "--optimizer", "adafactor", "--mixed-precision", "fp32", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    config = result["config"]
    assert (config["synthetic_data"], config["use_ema"], config["optimizer"]) == (True, True, "adafactor")
    assert result["baseline"]["s_per_step"] > 0
    table = capsys.readouterr().out
    per_core = float(next(line for line in table.splitlines() if line.startswith("images/s per core")).split()[3])
    assert per_core == pytest.approx(result["optimized"]["images_per_s"] / result["physical_cores"], abs=1e-4)


def test_rank_counts_read_lists_powers_and_none():
    assert bench.rank_counts("1,auto", 4) == [1, "auto"]
    assert bench.rank_counts("powers", 4) == [1, 2, 4, "auto"]
    assert bench.rank_counts("none", 4) == []


def test_real_node_step_shapes_the_links_as_much_slower_as_a_node_here_is(monkeypatch, tmp_path):
    """--real-node-step 2: a node here taking 8 s a step is 4x slower, so the 10gbit and 5gbit links are shaped
    at 2.5 and 1.25 Gbit/s; the model is fitted on the first and predicts real nodes 4x faster at 10gbit."""
    from xeontune import scaling

    ran = []

    def measure(args, model, data, tmp, nodes, link, threads, log):
        ran.append((nodes, link))
        bps = scaling.rate_bps(link) if link else None
        wait = 0.0 if bps is None else max(0.0, 2 * (nodes - 1) / nodes * 1e9 * 8 / bps - 1.0)  # 1 s hidden
        return scaling.Point(nodes, bps, 8.0 + wait, 4 * nodes / (8.0 + wait), 0 if nodes == 1 else 10**9, 0.0, 0.0)

    monkeypatch.setattr(scaling, "measure", measure)
    args = bench.build_parser().parse_args([
        "--method", "full", "--nodes", "1,2", "--link-rate", "10gbit", "--check-rate", "5gbit", "--real-node-step",
        "2", "--accumulation", "4", "--predict-rate", "10gbit", "--predict-nodes", "8"])
    result = scaling.sweep(args, tmp_path)
    assert ran == [(1, None), (2, "2500000kbit"), (2, "1250000kbit")]
    assert result["config"]["node_speedup"] == pytest.approx(4.0)
    model = result["model"]
    assert model["compute_s"] == 8.0 and model["hidden_s"] == pytest.approx(1.0)  # the fitted 2-node point's
    check = result["checked"][0]
    assert check["modelled_s"] == pytest.approx(check["measured_s"])  # the same law: the check holds
    one, eight = result["predicted"]
    # a real node: 2 s of compute, 0.25 s of it hiding the ring; 8 nodes at 10 Gbit/s: 1.4 s of ring for 1 GB
    assert one["s_per_step"] == pytest.approx(2.0)
    assert eight["s_per_step"] == pytest.approx(2.0 + 2 * 7 / 8 * 8e9 / 10e9 - 0.25)
    assert eight["efficiency"] == pytest.approx(2.0 / eight["s_per_step"])


def test_attention_bench_times_the_kernel_against_torchs_sdpa(capsys, monkeypatch, tmp_path):
    """`bench --attention` (shapes cut down to run in seconds): for each thread count and shape, forward and
    backward times of both, GFLOP/s, the share of the matmul peak and the speedup, as JSON and in --json-out."""
    from xeontune import attention_bench

    monkeypatch.setattr(attention_bench, "SHAPES", (("small self", 1, 2, 256, 256, 40), ("small cross", 1, 2, 256, 77, 64)))
    out = tmp_path / "attention.json"
    assert main(["bench", "--attention", "--threads", "1,all", "--repeats", "1", "--mixed-precision", "fp32",
                 "--matmul-size", "512", "--allocator", "none", "--json", "--json-out", str(out)]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures == json.loads(out.read_text()) and figures["precision"] == "fp32"
    counts = sorted({1, bench.physical_cores()})
    assert [(r["threads"], r["shape"]) for r in figures["rows"]] == [
        (n, s) for n in counts for s in ("small self", "small cross")]
    for row in figures["rows"]:
        for who in ("torch", "xeontune"):
            assert row[who]["forward_ms"] > 0 and row[who]["backward_ms"] > 0 and row[who]["peak_share"] > 0
        ours, theirs = (row[w]["forward_ms"] + row[w]["backward_ms"] for w in ("xeontune", "torch"))
        assert row["speedup"] == pytest.approx(theirs / ours)
    assert main(["bench", "--attention", "--threads", "0,2"]) == 2
    assert "--threads 0,2: a comma-separated list" in capsys.readouterr().err


def test_a_failed_count_is_told_by_the_ranks_error_line_not_by_the_lines_after_it():
    from xeontune.scaling import failure_line

    stderr = ("[0] INFO step 3/3  loss 0.9664\n"
              "[0] error: cannot write out/model.safetensors: no space left on the device (2.9 GB free there)\n"
              "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "the job ended with exit status 1: a rank failed or was lost and the others were stopped\n")
    assert failure_line(stderr) == ("[0] error: cannot write out/model.safetensors: no space left on the device "
                                    "(2.9 GB free there)")
    assert failure_line("one\nthe last\n") == "the last" and failure_line("") == "?"
