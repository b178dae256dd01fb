"""Checkpoints: durable, safe to load, `latest` falls back past a broken one, pruning keeps the newest."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train import checkpoint, loop
from xeontune.train.options import parse_args


def run_cli(capsys, args):
    rc = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [line for line in err if line.startswith("error:")], err


def a_state(step: int) -> checkpoint.TrainState:
    param = torch.nn.Parameter(torch.randn(2, 4))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return checkpoint.TrainState(step=step, vectors=param.detach().clone(), optimizer=optimizer.state_dict(),
                                 lr_scheduler=scheduler.state_dict(), placeholder_tokens=["<t>"],
                                 rng=checkpoint.rng_state())


def plant_broken(out: Path, step: int) -> Path:
    """What a crash mid-write leaves behind on a filesystem that reordered the writes: an empty state.pt."""
    broken = out / f"checkpoint-{step}"
    broken.mkdir(parents=True)
    (broken / checkpoint.STATE_FILE).write_bytes(b"")
    return broken


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    path = checkpoint.save(tmp_path, a_state(1), None)
    expected = (random.random(), np.random.standard_normal(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = checkpoint.load(path)
    checkpoint.restore_rng(state.rng)
    assert (random.random(), np.random.standard_normal(), torch.rand(1).item()) == expected


def test_save_fsyncs_the_file_and_the_dirs_and_marks_it_complete_last(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    out = tmp_path / "out"
    out.mkdir()
    target = checkpoint.save(out, a_state(7), None)
    names = [Path(p).name for p in synced]
    assert target == out / "checkpoint-7"
    # both files reached the disk before the rename, and the rename itself after it
    assert checkpoint.STATE_FILE in names and checkpoint.COMPLETE_FILE in names
    assert any(Path(p).name.startswith(".checkpoint-7.") for p in synced), synced  # the temp dir's entries
    assert synced[-1] == str(out), synced  # the parent, after the rename
    marker = json.loads((target / checkpoint.COMPLETE_FILE).read_text())
    data = (target / checkpoint.STATE_FILE).read_bytes()
    assert marker == {"step": 7, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_total_limit_keeps_the_new_checkpoint_when_a_broken_newer_one_lies_around(tmp_path):
    out = tmp_path / "out"
    checkpoint.save(out, a_state(4), 1)
    plant_broken(out, 8)  # a crashed earlier attempt got further than this resumed run
    checkpoint.save(out, a_state(6), 1)
    assert [p.name for _, p in checkpoint.list_checkpoints(out)] == ["checkpoint-6"]
    assert checkpoint.resolve("latest", out)[0] == out / "checkpoint-6"


@pytest.mark.slow
def test_a_checkpoint_carrying_a_pickled_object_is_refused(base_args, tmp_path, capsys):
    canary = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (canary, "code ran"))

    state = a_state(3)
    state.rng["extra"] = Payload()
    path = tmp_path / "sent-to-me" / "checkpoint-3"
    path.mkdir(parents=True)
    torch.save(state.__dict__, path / checkpoint.STATE_FILE)
    data = (path / checkpoint.STATE_FILE).read_bytes()
    (path / checkpoint.COMPLETE_FILE).write_text(json.dumps(  # a marker that matches: only the pickle is wrong
        {"step": 3, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    rc, errors, err = run_cli(capsys, base_args + ["--placeholder-token", "<t>", "--resume-from-checkpoint", str(path)])
    assert rc == 2 and len(errors) == 1 and "objects other than tensors" in errors[0], err
    assert not canary.exists()


@pytest.mark.slow
def test_latest_falls_back_past_an_unreadable_checkpoint(base_args, tmp_path, caplog, capsys):
    caplog.set_level(logging.WARNING, logger="xeontune.train.checkpoint")
    out = tmp_path / "out"
    common = base_args + ["--checkpointing-steps", "2", "--save-steps", "0", "--mixed-precision", "fp32"]
    loop.train(parse_args(common + ["--max-train-steps", "4"]))
    plant_broken(out, 200)

    # an explicit path to it: one line, no traceback
    rc, errors, err = run_cli(capsys, common + ["--max-train-steps", "6", "--resume-from-checkpoint",
                                               str(out / "checkpoint-200")])
    assert rc == 2 and len(errors) == 1 and "checkpoint-200" in errors[0], err
    assert not any("Traceback" in line for line in err)

    # latest: warns and resumes from the newest complete one
    result = loop.train(parse_args(common + ["--max-train-steps", "6", "--resume-from-checkpoint", "latest"]))
    assert any("checkpoint-200" in r.getMessage() and "checkpoint-4" in r.getMessage() for r in caplog.records)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert result.steps == 6

    # from an older checkpoint, after a crash that cut the last line short: steps 5 and 6 are trained
    # again and logged once, and the next line does not glue onto the broken one
    with open(out / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 7, "lo')
    loop.train(parse_args(common + ["--max-train-steps", "6", "--resume-from-checkpoint", str(out / "checkpoint-4")]))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]

    # nothing complete left: one line naming what was skipped
    for _, path in checkpoint.list_checkpoints(out):
        shutil.rmtree(path)
    rc, errors, err = run_cli(capsys, common + ["--max-train-steps", "6", "--resume-from-checkpoint", "latest"])
    assert rc == 2 and len(errors) == 1 and "no complete, readable checkpoint" in errors[0], err


def test_a_damaged_state_file_is_a_one_line_error(tmp_path):
    path = checkpoint.save(tmp_path, a_state(2), None)
    data = (path / checkpoint.STATE_FILE).read_bytes()
    (path / checkpoint.STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="is damaged"):
        checkpoint.load(path)
    (path / checkpoint.COMPLETE_FILE).unlink()
    with pytest.raises(UserError, match="incomplete"):
        checkpoint.load(path)


@pytest.mark.slow
def test_resuming_at_or_past_the_last_step_and_the_final_outputs(base_args, tmp_path, capsys, caplog):
    """A checkpoint at the last step: the run writes its outputs and says nothing was left to train
    (it crashed on the missing loss). Past the last step: a one-line error (it wrote the later step's
    vectors labelled as the earlier one). A run's output dir given for a checkpoint: says which to give.
    The final step gets its step copy like every N-th one, and outputs are not private (0600) files."""
    out = tmp_path / "out"
    common = [a for a in base_args if a not in ("--max-train-steps", "3")]
    steps = ["--max-train-steps", "3", "--checkpointing-steps", "1", "--save-steps", "1", "--mixed-precision", "fp32"]
    assert main(["train", *common, *steps, "--save-as-full-pipeline"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.glob("learned_embeds-steps-*")) == [
        f"learned_embeds-steps-{n}.safetensors" for n in (1, 2, 3)]
    umask = os.umask(0)
    os.umask(umask)
    for file in (out / "learned_embeds.safetensors", out / "learned_embeds-steps-3.safetensors",
                 next((out / "pipeline" / "unet").glob("*.safetensors"))):
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file

    again = tmp_path / "again"
    assert main(["train", *common, *steps, "--output-dir", str(again),
                 "--resume-from-checkpoint", str(out / "checkpoint-3")]) == 0
    assert "no step left to train after 3 steps" in capsys.readouterr().out
    from safetensors.torch import load_file

    resumed, straight = (load_file(d / "learned_embeds.safetensors") for d in (again, out))
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert (again / "checkpoint-3" / "state.pt").is_file()  # another output dir: a copy of its own
    # in its own output dir the checkpoint it resumed from is not written again (a second write
    # replaces the dir: two renames, between which a kill would leave none)
    state, before = out / "checkpoint-3" / "state.pt", (out / "checkpoint-3" / "state.pt").stat()
    assert main(["train", *common, *steps, "--resume-from-checkpoint", "latest"]) == 0
    assert (state.stat().st_ino, state.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # another batch: the data position is step x batch, so the run says it draws other images
    caplog.set_level(logging.WARNING, logger="xeontune.train")
    caplog.clear()
    assert main(["train", *common, *steps, "--output-dir", str(tmp_path / "batch2"), "--train-batch-size", "2",
                 "--resume-from-checkpoint", str(out / "checkpoint-3")]) == 0
    assert "written at a batch of 1 a step" in caplog.text and "this run's is 2" in caplog.text

    rc, errors, _ = run_cli(capsys, [*common, "--max-train-steps", "2", "--output-dir", str(tmp_path / "past"),
                                     "--resume-from-checkpoint", str(out / "checkpoint-3")])
    assert rc == 2 and len(errors) == 1 and "past --max-train-steps 2" in errors[0]
    rc, errors, _ = run_cli(capsys, [*common, *steps, "--output-dir", str(tmp_path / "dir"),
                                     "--resume-from-checkpoint", str(out)])
    assert rc == 2 and len(errors) == 1 and "is a run's output dir" in errors[0] and "checkpoint-3" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("other", ["sd2_model", "sdxl_model"])
def test_a_checkpoint_resumes_only_on_the_model_it_trained_on(base_args, tmp_path, capsys, monkeypatch, request,
                                                             other):
    """An SD1 checkpoint on an SD2 model (shapes alike) or an SDXL one: one line, before any model loads."""
    out = tmp_path / "out"
    args = ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--mixed-precision", "fp32",
            *[a for a in base_args if a not in ("--placeholder-token", "<toy-bot>", "--initializer-token", "toy")]]
    assert main(["train", *args, "--max-train-steps", "2", "--checkpointing-steps", "1"]) == 0
    config = (out / "train_config.json").read_bytes()
    other_model = str(request.getfixturevalue(other))
    loads = []
    monkeypatch.setattr(loop, "load", lambda *a, **k: loads.append(a) or pytest.fail("a model loaded"))
    rc, errors, _ = run_cli(capsys, [*args, "--max-train-steps", "3", "--resume-from-checkpoint", "latest",
                                     "--model", other_model])
    assert rc == 2 and len(errors) == 1, errors
    assert "was trained on" in errors[0] and other_model in errors[0] and "resume it with --model" in errors[0]
    assert loads == [] and (out / "train_config.json").read_bytes() == config
    monkeypatch.undo()
    # the same model under another path (a copy) resumes
    copy = tmp_path / "copy-of-the-model"
    shutil.copytree(base_args[1], copy)
    assert main(["train", *args, "--max-train-steps", "3", "--resume-from-checkpoint", "latest",
                 "--model", str(copy)]) == 0


def test_a_checkpoint_is_written_and_read_without_a_copy_of_its_state_in_memory(tmp_path, monkeypatch):
    """Serialized into its file (not a bytes buffer first) and loaded memory-mapped: a full fine-tuning's
    state is gigabytes."""
    into = []
    real = torch.save
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f, *a, **k: into.append(f) or real(obj, f, *a, **k))
    state = a_state(3)
    state.learned = {"tensors": {"w": torch.randn(256, 256)}}
    path = checkpoint.save(tmp_path, state, None)
    loaded = checkpoint.load(path)
    # a file on disk, not a buffer in memory
    assert len(into) == 1 and Path(getattr(into[0], "name", "")).name == checkpoint.STATE_FILE
    assert torch.equal(loaded.learned["tensors"]["w"], state.learned["tensors"]["w"])
    # the loaded tensors' pages are the file's: mapped, not read into a copy
    assert str(path / checkpoint.STATE_FILE) in Path("/proc/self/maps").read_text()
