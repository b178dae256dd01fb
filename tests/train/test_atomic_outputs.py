"""Every file a run writes whole lands by rename, never written in place under its final name.

"No .tmp left behind" is passed by a direct write too. Here inotify watches the output dir during real
runs of the tiny model and records what happened to each name: a file written in place shows a create,
a modify or a close-after-write under its own name (whoever writes it: Python, or safetensors' Rust);
one written atomically shows only a rename onto it. The embedding and its step copies, the LoRA files
(both layouts, and their step copies), train_config.json, checkpoints, validation images and the full
pipeline are checked so, on a first run and on a resume that replaces them. metrics.jsonl is the one
file appended in place (xeontune/io.py): whole lines after every step, and its rewrite on a resume
(dropping the steps trained again) is a rename.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

import pytest

from xeontune.io import atomic_path, atomic_write_text
from xeontune.train import loop
from xeontune.train.options import parse_args

IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_Q_OVERFLOW = 0x100, 0x200, 0x4000
IN_PLACE = IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE  # what a write under the final name shows
NAMES = {IN_MODIFY: "modify", IN_CLOSE_WRITE: "close-write", IN_MOVED_FROM: "moved-from", IN_MOVED_TO: "moved-to",
         IN_CREATE: "create", IN_DELETE: "delete"}


class Watch:
    """inotify on some directories (not their subdirectories): every event, in order, as (path, mask)."""

    def __init__(self, *dirs: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, Path] = {}
        for d in dirs:
            wd = self._libc.inotify_add_watch(self.fd, os.fsencode(d), IN_PLACE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.dirs[wd] = Path(d)
        self.events: list[tuple[Path, int]] = []

    def drain(self) -> list[tuple[Path, int]]:
        """Read what the kernel queued so far (called at every step, so its queue never overflows)."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.events
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                offset += 16 + length
                assert not mask & IN_Q_OVERFLOW, "inotify's queue overflowed: events were lost"
                self.events.append((self.dirs[wd] / name, mask))

    def in_place(self, path: Path) -> list[str]:
        """The events that show ``path`` written under its own name."""
        return [name for p, mask in self.drain() if p == path for name in describe(mask & IN_PLACE)]

    def renamed_onto(self, path: Path) -> bool:
        return any(p == path and mask & IN_MOVED_TO for p, mask in self.drain())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def describe(mask: int) -> list[str]:
    return [name for bit, name in NAMES.items() if mask & bit]


@pytest.fixture
def watch():
    """Watch(*dirs), each closed at the end of the test."""
    watches: list[Watch] = []

    def start(*dirs: Path) -> Watch:
        watches.append(Watch(*dirs))
        return watches[-1]

    yield start
    for w in watches:
        w.close()


def assert_only_renamed(w: Watch, paths: list[Path]) -> None:
    assert paths
    written = {str(p): w.in_place(p) for p in paths if w.in_place(p)}
    assert written == {}, f"written in place under the final name: {written}"
    assert [str(p) for p in paths if not w.renamed_onto(p)] == []


def test_the_watch_catches_a_direct_write_and_passes_a_rename(tmp_path, watch):
    """The check itself: direct writes of a new and of an existing file, from Python and from
    safetensors' Rust writer, are caught; the same files through atomic_path pass."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "old.json").write_text("{}\n")
    w = watch(tmp_path)
    (tmp_path / "new.json").write_text("{}\n")
    (tmp_path / "old.json").write_text('{"a": 1}\n')
    save_file({"t": torch.zeros(2)}, str(tmp_path / "direct.safetensors"))
    atomic_write_text(tmp_path / "atomic.json", "{}\n")
    with atomic_path(tmp_path / "atomic.safetensors") as tmp:
        save_file({"t": torch.zeros(2)}, str(tmp))
    assert set(w.in_place(tmp_path / "new.json")) == {"create", "modify", "close-write"}
    assert set(w.in_place(tmp_path / "old.json")) == {"modify", "close-write"}  # replaced in place: no create
    assert "close-write" in w.in_place(tmp_path / "direct.safetensors")
    assert not w.renamed_onto(tmp_path / "new.json")
    assert_only_renamed(w, [tmp_path / "atomic.json", tmp_path / "atomic.safetensors"])


def run_watched(w: Watch, args: list[str], metrics: Path | None = None) -> None:
    """Train in this process; at every step, before its line is logged, metrics.jsonl holds whole lines
    only, one per step done, and what was there before is still there (appended, never rewritten)."""
    seen = [""]

    def on_step(step: int, *_):
        w.drain()
        if metrics is not None:
            now = metrics.read_text()
            assert now.startswith(seen[-1]) and (now == "" or now.endswith("\n")), (seen[-1], now)
            assert [json.loads(line)["step"] for line in now.splitlines()] == list(range(1, step))
            seen.append(now)

    loop.train(parse_args(args), on_step=on_step)
    w.drain()


def hidden_left(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs for p in d.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_textual_inversion_outputs_land_by_rename_on_a_run_and_on_its_resume(base_args, tmp_path, watch):
    out = tmp_path / "ti"
    validation = out / "validation"
    validation.mkdir(parents=True)  # made here, so that the watch sees the images land in it
    args = base_args + ["--output-dir", str(out), "--resolution", "32", "--mixed-precision", "fp32",
                        "--max-train-steps", "3", "--save-steps", "1", "--checkpointing-steps", "2",
                        "--validation-prompt", "a <toy-bot>", "--validation-steps", "3", "--num-validation-images", "1",
                        "--validation-inference-steps", "1", "--save-as-full-pipeline"]
    w = watch(out, validation)
    run_watched(w, args, out / "metrics.jsonl")
    final = [out / "learned_embeds.safetensors", *(out / f"learned_embeds-steps-{s}.safetensors" for s in (1, 2, 3)),
             out / "train_config.json", out / "checkpoint-2", out / "pipeline", validation / "step-000003-0.png"]
    assert sorted(p for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [*(p for p in final if p.parent == out), validation, out / "metrics.jsonl"])
    assert_only_renamed(w, final)
    assert hidden_left(out, validation) == []
    assert not w.renamed_onto(out / "metrics.jsonl")  # appended in place, as it should be

    # the resume trains step 3 again: metrics.jsonl loses its line 3 by a rename (a rewrite in place,
    # cut short, would lose the lines before it), then the replaced outputs land by rename again
    w.close()
    w = watch(out, validation)
    run_watched(w, args + ["--resume-from-checkpoint", "latest"], out / "metrics.jsonl")
    metrics_events = [mask for p, mask in w.drain() if p == out / "metrics.jsonl" and mask & (IN_PLACE | IN_MOVED_TO)]
    assert metrics_events and metrics_events[0] & IN_MOVED_TO, [describe(m) for m in metrics_events]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert_only_renamed(w, [p for p in final if p.name not in (  # what step 3 and the end write again
        "checkpoint-2", "learned_embeds-steps-1.safetensors", "learned_embeds-steps-2.safetensors")])
    assert hidden_left(out, validation) == []


@pytest.mark.slow
def test_lora_files_land_by_rename(tiny_model, sample_images, tmp_path, watch):
    out = tmp_path / "lora"
    out.mkdir()
    w = watch(out)
    run_watched(w, ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--model", str(tiny_model),
                    "--data-dir", str(sample_images), "--resolution", "32", "--max-train-steps", "2",
                    "--save-steps", "1", "--checkpointing-steps", "0", "--mixed-precision", "fp32",
                    "--output-dir", str(out)])
    final = [out / f"{stem}{suffix}.safetensors" for stem in ("pytorch_lora_weights", "pytorch_lora_weights_kohya")
             for suffix in ("", "-steps-1", "-steps-2")] + [out / "train_config.json"]
    assert sorted(p for p in out.iterdir() if not p.name.startswith(".")) == sorted([*final, out / "metrics.jsonl"])
    assert_only_renamed(w, final)
    assert hidden_left(out) == []
