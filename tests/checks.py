"""Checks that many test files make, in one place: waiting for a condition or a run's metrics lines,
comparing a run's learned vectors with a reference run's or its initializer's, and training each
distinct reference run once."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

EMBEDS = "learned_embeds.safetensors"


def lines(path: Path) -> list[str]:
    """The lines of ``path``; none while it does not exist yet."""
    return path.read_text().splitlines() if path.exists() else []


def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.5, *,
               proc: subprocess.Popen | None = None, tick: Callable[[], None] | None = None) -> bool:
    """Poll ``done()`` until it is true (then True), ``timeout_s`` passed, or ``proc`` (when given) ended
    (then False: ``done()`` was false when last asked, after the deadline if that is what ended it).
    Between polls, ``tick()`` (say, one that drains a pty) or else a sleep of ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline or (proc is not None and proc.poll() is not None):
            return False
        if tick is None:
            time.sleep(poll_s)
        else:
            tick()
    return True


def wait_while_running(proc: subprocess.Popen, done: Callable[[], bool], what: str, output: Callable[[], str],
                       timeout: float = 180, tick: Callable[[], None] | None = None) -> None:
    """Until ``done()`` (polled every 0.2 s, or after each ``tick()``); fails, with the command's output,
    if the command ``proc`` ends first or it takes longer than ``timeout`` seconds."""
    if not wait_until(done, timeout, 0.2, proc=proc, tick=tick):
        raise AssertionError(f"{what}: not within {timeout:.0f} s (exit {proc.poll()}):\n{output()[-3000:]}")


def wait_for_lines(path: Path, count: int, timeout_s: float = 120.0, poll_s: float = 0.1,
                   until: Callable[[], bool] | None = None) -> int:
    """Poll ``path`` (a run's metrics.jsonl: one line a step) until it has ``count`` lines, ``timeout_s``
    passed, or ``until()`` is true (say, the process ended); returns how many lines it has then."""
    deadline = time.monotonic() + timeout_s
    while len(lines(path)) < count and time.monotonic() < deadline and not (until and until()):
        time.sleep(poll_s)
    return len(lines(path))


def load_vectors(path: Path) -> dict:
    """The learned vectors of a run: ``path`` is its output dir (its learned_embeds.safetensors) or the file."""
    from safetensors.torch import load_file

    return load_file(str(path / EMBEDS if path.is_dir() else path))


# "It trained": the vectors moved away from the initializer's row (which they start as, and which is not
# zero) by far more than fp32 rounding (the rows are below 0.1: an ulp there is under 1e-8), and by less
# than one step of Adam moves them (about the learning rate, 5e-4 or more in these tests).
MOVED_MIN = 1e-4


def initializer_row(model, token: str = "toy", tokenizer_dir: str = "tokenizer",
                    encoder_dir: str = "text_encoder"):
    """The row of ``token`` (the initializer) in the token table of the base ``model``'s text encoder."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    encoder_class = CLIPTextModelWithProjection if encoder_dir == "text_encoder_2" else CLIPTextModel
    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder=tokenizer_dir)
    table = encoder_class.from_pretrained(model, subfolder=encoder_dir).get_input_embeddings().weight
    [token_id] = tokenizer.encode(token, add_special_tokens=False)  # as the trainer reads it ("toy</w>")
    return table[token_id].detach()


def moved_from_initializer(model, vectors, token: str = "toy") -> float:
    """The largest change of any learned value in ``vectors`` from the initializer ``token``'s row in the
    base ``model``'s text encoder."""
    return float((vectors - initializer_row(model, token)).abs().max())


def run_moved_from_initializer(run_dir: Path) -> float:
    """The largest change of any learned value of the textual-inversion run in ``run_dir`` from its
    initializer token's row in its base model's text encoder(s), as its train_config.json names them."""
    import json

    config = json.loads((run_dir / "train_config.json").read_text())
    vectors = load_vectors(run_dir)
    # SDXL's file holds one row set per encoder (clip_l, clip_g); SD1/SD2's, the placeholder token's
    parts = ({"clip_l": ("tokenizer", "text_encoder"), "clip_g": ("tokenizer_2", "text_encoder_2")}
             if vectors.keys() == {"clip_l", "clip_g"} else
             {key: ("tokenizer", "text_encoder") for key in vectors})
    rows = {key: initializer_row(config["model"], config["initializer_token"], *dirs) for key, dirs in parts.items()}
    return max(float((vectors[key] - row).abs().max()) for key, row in rows.items())


def assert_same_vectors(got: Path, want: Path, atol: float = 1e-5, trained: bool = True) -> float:
    """The learned vectors of ``got`` (a run's output dir, or the file itself) are those of ``want`` (a
    run's output dir): the same names, and no element further than ``atol`` apart (0: bit for bit).
    ``trained``: the reference's vectors moved from their initializer by more than rounding (a run that
    trained nothing would match anything). Returns the largest difference."""
    have, expected = load_vectors(got), load_vectors(want)
    assert have.keys() == expected.keys(), (sorted(have), sorted(expected))
    diff = max(float((have[k].double() - expected[k].double()).abs().max()) for k in expected)
    assert diff <= atol, f"learned vectors differ from the reference's by {diff:.3g} (allowed: {atol:g})"
    if trained:
        moved = run_moved_from_initializer(want)
        assert moved > MOVED_MIN, f"the reference moved {moved:.2e} from its initializer: it learned nothing"
    return diff


class References:
    """Reference ("straight") runs, each trained once per distinct command line and reused: a module
    fixture holds one, so the tests that compare with the same run share it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, ...], Path] = {}

    def train(self, argv: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 600,
              cwd: Path | None = None) -> Path:
        """The output dir of ``argv`` (a training command line, without --output-dir), trained the first
        time it is asked for."""
        key = tuple(argv)
        if key not in self.done:
            out = self.root / f"reference-{len(self.done)}"
            proc = subprocess.run([*argv, "--output-dir", str(out)], capture_output=True, text=True,
                                  timeout=timeout_s, env=dict(os.environ) if env is None else env, cwd=cwd)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            self.done[key] = out
        return self.done[key]


def rank_pids(marker: str) -> list[int]:
    """The rank processes (``python -m xeontune.train``, not srun's or a launcher's, whose command lines
    hold the rank's) whose command line names ``marker`` (e.g. their unique --output-dir). A rank's own
    short-lived children (a fork before its exec carries the rank's command line: seen once in CI as a
    fourth "rank") are left out."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            # the parent pid is the second field after the command name, which may hold spaces
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if cmd[1:3] == [b"-m", b"xeontune.train"] and marker.encode() in cmd:
            found[int(proc.name)] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)
