"""A full disk during a run's writes: one line that names the file and the space left, the previous
checkpoint kept, nothing half-written under a final name, and the run resumable once there is room.

The disk is a real one: a small tmpfs mounted for the test (root, as CI runs), filled at a chosen step."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from xeontune.errors import DiskFullError
from xeontune.io import atomic_dir, atomic_path, atomic_paths, disk_errors
from xeontune.train import checkpoint, loop
from xeontune.train.options import parse_args


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 and not os.environ.get("CI"):  # as root or in CI a failing mount fails the test
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave: int = 0) -> Path:
    """Take the disk's free space, all but ``leave`` bytes."""
    filler = disk / "filler"
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    if leave:
        os.truncate(filler, filler.stat().st_size - leave)
    return filler


def names_left(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_each_atomic_writer_says_a_full_disk_in_one_line_and_leaves_the_old_file(small_disk):
    (small_disk / "result.bin").write_bytes(b"the old result")
    (small_disk / "folder").mkdir()
    (small_disk / "folder" / "a").write_bytes(b"old")
    fill(small_disk)
    said = r"cannot write .*result\.bin: no space left on the device \(.* free there\)"
    with pytest.raises(DiskFullError, match=said), atomic_path(small_disk / "result.bin") as tmp:
        tmp.write_bytes(os.urandom(1 << 20))
    with pytest.raises(DiskFullError, match="folder"), atomic_dir(small_disk / "folder") as tmp:
        (tmp / "a").write_bytes(os.urandom(1 << 20))
    assert (small_disk / "result.bin").read_bytes() == b"the old result"
    assert (small_disk / "folder" / "a").read_bytes() == b"old"
    assert names_left(small_disk) == {"result.bin", "folder", "folder/a", "filler"}


def test_files_that_belong_together_land_together_or_not_at_all(small_disk):
    fill(small_disk, leave=1 << 20)
    together = atomic_paths([small_disk / "first", small_disk / "second"])
    with pytest.raises(DiskFullError, match="second"), together as (first, second):
        first.write_bytes(b"small")  # fits
        second.write_bytes(os.urandom(4 << 20))  # does not
    assert names_left(small_disk) == {"filler"}, "the first file must not land without the second"


def test_safetensors_full_disk_error_is_one_line_too(small_disk):
    import torch
    from safetensors.torch import save_file

    fill(small_disk)
    target = small_disk / "weights.safetensors"
    with pytest.raises(DiskFullError, match="weights.safetensors"), disk_errors(target):
        save_file({"w": torch.zeros(1 << 20)}, str(target))


@pytest.mark.slow
def test_a_checkpoint_on_a_full_disk_keeps_the_previous_one_and_the_run_resumes(base_args, small_disk):
    out = small_disk / "out"
    args = [*base_args[:-1], str(out), "--max-train-steps", "3", "--checkpointing-steps", "1",
            "--mixed-precision", "fp32"]
    filled: list[Path] = []

    def fill_before_checkpoint_2(step: int, *_):
        if step == 2:  # called before the outputs of step 2 are written
            filled.append(fill(small_disk))

    with pytest.raises(DiskFullError, match=r"cannot write .*checkpoint-2: no space left on the device"):
        loop.train(parse_args(args), on_step=fill_before_checkpoint_2)
    assert [p.name for _, p in checkpoint.list_checkpoints(out)] == ["checkpoint-1"]
    assert not [n for n in names_left(out) if n.startswith(".") or "checkpoint-2" in n], names_left(out)
    assert not (out / "learned_embeds.safetensors").exists()

    filled[0].unlink()  # room again: the same command resumes from the kept checkpoint
    result = loop.train(parse_args([*args, "--resume-from-checkpoint", "latest"]))
    assert result.steps == 3 and (out / "learned_embeds.safetensors").is_file()


@pytest.mark.slow
def test_a_loras_files_land_together_or_not_at_all_on_a_full_disk(tiny_model, sample_images, tmp_path, small_disk):
    """With room for one layout but not both, neither lands (the diffusers file used to, without kohya's)."""
    def args(out: Path) -> list[str]:
        return ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--model", str(tiny_model),
                "--data-dir", str(sample_images), "--resolution", "32", "--max-train-steps", "2",
                "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32",
                "--output-dir", str(out)]

    loop.train(parse_args(args(tmp_path / "roomy")))
    size = (tmp_path / "roomy" / "pytorch_lora_weights.safetensors").stat().st_size
    out = small_disk / "out"

    def leave_room_for_one(step: int, *_):
        if step == 2:
            fill(small_disk, leave=size + size // 2)

    with pytest.raises(DiskFullError, match="no space left on the device"):
        loop.train(parse_args(args(out)), on_step=leave_room_for_one)
    assert not [p.name for p in out.iterdir() if p.suffix == ".safetensors" or p.name.startswith(".")], \
        sorted(p.name for p in out.iterdir())
