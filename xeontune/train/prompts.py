"""Where each training image's prompt comes from: one rule for every method.

1. A caption of its own: ``IMAGE.txt`` beside the image (kohya's convention) or a line of the data
   folder's ``metadata.jsonl`` with ``file_name`` and ``text`` (the Hugging Face image-folder
   convention; ``--caption-column`` names another field than ``text``).
2. Else ``--instance-prompt``, the prompt of every uncaptioned image (DreamBooth's).
3. Else, when no image has either, the method's own prompts (textual inversion's templates, drawn at
   random per sample). A folder that captions some images and not others, without an instance prompt
   for the rest, is a one-line error naming an uncaptioned image; so is a caption naming no image.

Read on every rank; the trainer checks that every rank read the same prompts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from xeontune.errors import UserError
from xeontune.train.images import is_image_file

METADATA_FILE = "metadata.jsonl"
CAPTION_SUFFIX = ".txt"
# CLIP reads 77 tokens (about 300 characters): a caption far longer is most likely the wrong file
MAX_CAPTION_CHARS = 10_000


@dataclass(frozen=True)
class ImagePrompts:
    """Each image's prompt: ``texts[of_image[i]]`` is the prompt of image i."""

    texts: list[str]  # each distinct prompt once, in first-use order
    of_image: list[int]
    source: str  # what they came from, for the log: "captions", "the instance prompt", ...
    where: list[str]  # per text: where it was read (a file, "--instance-prompt"), for error messages


def read_captions(data_dir: Path, caption_column: str) -> dict[str, tuple[str, str]]:
    """{image file name: (caption, where it was read)} from ``IMAGE.txt`` files and ``metadata.jsonl``."""
    captions: dict[str, tuple[str, str]] = {}
    image_names = {p.name for p in data_dir.iterdir() if is_image_file(p)}
    stems: dict[str, list[str]] = {}
    for name in image_names:
        stems.setdefault(Path(name).stem, []).append(name)
    for path in sorted(data_dir.glob("*" + CAPTION_SUFFIX)):
        if path.name.startswith("."):
            continue
        owners = stems.get(path.stem)
        if not path.is_file():
            if not owners:  # no image's caption: a folder of the user's own, say
                continue
            _require_file(path, f"caption {path}")
        if not owners:
            raise UserError(f"caption {path} has no image beside it (an image named {path.stem}.png, .jpg, ...)")
        if len(owners) > 1:
            raise UserError(f"caption {path} could belong to {' or '.join(sorted(owners))}; rename one of them")
        text = _read_text(path)
        if not text:
            raise UserError(f"caption {path} is empty: write {owners[0]}'s caption in it, or delete it (the image "
                            "then takes --instance-prompt)")
        _check_length(text, f"caption {path}")
        captions[owners[0]] = (text, str(path))
    metadata = data_dir / METADATA_FILE
    if metadata.is_symlink() or metadata.exists():
        _require_file(metadata, str(metadata))
    if caption_column != "text" and not metadata.is_file():
        raise UserError(f"--caption-column {caption_column}: names a field of {METADATA_FILE}, and {data_dir} has none")
    if metadata.is_file():
        for where, name, text in _metadata_lines(metadata, caption_column):
            if not text:
                raise UserError(f"{where}: the caption of {name!r} is empty")
            if name not in image_names:
                raise UserError(f"{where}: file_name {name!r} is not an image in {data_dir}")
            _check_length(text, f"{where}: the caption of {name!r}")
            if name in captions and captions[name][0] != text:
                raise UserError(f"{name} has two different captions: {captions[name][1]} and {where}")
            captions[name] = (text, where)
    return captions


def _require_file(path: Path, what: str) -> None:
    """A caption file that is a folder or a broken link would be silently unused: a one-line error."""
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "a broken link" if not path.exists() else "a special file"
        raise UserError(f"{what} is {kind}, not a file of captions")


def _check_length(text: str, what: str) -> None:
    if len(text) > MAX_CAPTION_CHARS:
        raise UserError(f"{what} is {len(text)} characters long: over {MAX_CAPTION_CHARS:,}, the most a caption "
                        "may be (CLIP reads its first 77 tokens, about 300 characters); is it the right file?")


def _decoded(path: Path, what: str) -> str:
    """The file's text; bytes that are not UTF-8 are a one-line error naming the line, not replaced by
    U+FFFD (which would train as part of the caption). A leading byte-order mark (Notepad's) is dropped."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        read = exc.object  # what the codec decoded: after a byte-order mark, which exc.start does not count
        line = read.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{what} line {line} is not UTF-8 text (byte 0x{read[exc.start]:02x})") from None


def _read_text(path: Path) -> str:
    return " ".join(_decoded(path, f"caption {path}").split())


def _metadata_lines(path: Path, column: str) -> list[tuple[str, str, str]]:
    """(where, file_name, caption) per non-empty line. Lines end at a line feed alone (a carriage return
    before it is JSON whitespace): str.splitlines would also cut at U+2028, U+0085 and others, which JSON
    strings may hold."""
    rows = []
    for number, line in enumerate(_decoded(path, str(path)).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise UserError(f"{where} has no \"file_name\"")
        if not isinstance(row.get(column), str):
            fields = ", ".join(sorted(k for k in row if k != "file_name")) or "none"
            raise UserError(f"{where} has no text field {column!r} (--caption-column; its fields: {fields})")
        rows.append((where, Path(row["file_name"]).as_posix(), " ".join(row[column].split())))
    return rows


def image_prompts(data_dir: str | Path, image_paths: list[Path], *, instance_prompt: str | None,
                  caption_column: str = "text") -> ImagePrompts | None:
    """Each image's prompt by the rule above, or None when no image has one (the method's own prompts)."""
    names = [p.name for p in image_paths]
    captions = read_captions(Path(data_dir), caption_column)
    if not captions and instance_prompt is None:
        return None
    rows: dict[str, int] = {}
    where: list[str] = []
    of_image: list[int] = []
    for name in names:
        if name in captions:
            text, source = captions[name]
        elif instance_prompt is not None:
            text, source = instance_prompt, "--instance-prompt"
        else:
            some = next(iter(captions.values()))[1]
            raise UserError(f"{Path(data_dir) / name} has no caption ({Path(name).stem}{CAPTION_SUFFIX} or a "
                            f"{METADATA_FILE} line) while others do ({some}); caption it or give --instance-prompt")
        if text not in rows:
            rows[text] = len(rows)
            where.append(source)
        of_image.append(rows[text])
    captioned = sum(name in captions for name in names)
    if captioned == len(names):
        source = "captions"
    elif captioned:
        source = f"captions ({captioned} images) and the instance prompt ({len(names) - captioned})"
    else:
        source = "the instance prompt"
    return ImagePrompts(texts=list(rows), of_image=of_image, source=source, where=where)


def prompts_digest(given: ImagePrompts | None) -> str:
    """What every rank must agree on: each image's prompt (or none)."""
    if given is None:
        return "the method's own prompts"
    digest = hashlib.sha256(json.dumps([given.texts, given.of_image]).encode()).hexdigest()[:12]
    return f"{len(given.texts)} prompts from {given.source}, {digest}"
