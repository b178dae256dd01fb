"""``--dataset``: train on a Hugging Face ``datasets`` dataset, as diffusers' examples read one.

What it reads (``locate``): a folder written by ``save_to_disk`` (``datasets.load_from_disk``; of a
DatasetDict, its ``train`` split or its only one); a folder, file or glob of parquet or arrow files
(``datasets.load_dataset("parquet" | "arrow", data_files=...)``); otherwise a hub id, loaded with
``datasets.load_dataset`` (with ``HF_HUB_OFFLINE=1`` from the local cache alone: an id that is not
there is one line, as is every other mistake here).

Design: the dataset is exported ONCE into a plain training folder -- each row's image file as it was
stored (never decoded: ``Image(decode=False)`` gives the stored bytes or path; the suffix comes from the
stored path, else from the format PIL reads in the header), and ``metadata.jsonl`` with ``file_name``
and the ``--caption-column`` field -- and training then runs with ``opts.data_dir`` set to that folder.
Everything downstream (the folder's checks, buckets, masks, caption rules, ``xeontune run``'s sync of
the data dir to the nodes) is the folder code, unchanged; nothing downstream knows about ``datasets``.

The export lives under the project's cache (``$XEONTUNE_CACHE`` or ``~/.cache/xeontune``, where the
bf16 weight copies are), in ``datasets/<name>-<key>``. The key is cheap to compute, so that a later run
(or another rank) finds a complete export without importing ``datasets``: for a local source, its
resolved path and every data file's path, size and modification time, with the two column names and
the export format; for a hub id, the loaded dataset's fingerprint (which ``datasets`` derives from the
cached files) with the id and the columns. It is written with ``io.atomic_dir``: it exists whole or
not at all, and a folder that exists is complete (``EXPORT_RECORD`` in it says what it holds).

Concurrency, both ways:
1. The export happens where the options are first resolved, and what starts ranks hands them the
   folder instead of the dataset: ``xeontune train --nproc-per-node N`` exports before it starts its
   ranks and passes the folder in ``EXPORT_ENV`` (its ranks inherit the environment, and take the
   folder without loading anything); ``xeontune run`` exports on this machine before a cluster exists
   and gives the ranks ``--data-dir <the folder>`` (``for_the_ranks``), synced to the nodes as any
   --data-dir is.
2. Ranks that resolve ``--dataset`` themselves (``xeontune launch``'s, srun's, a pod's: each node
   reads the dataset as its path or cache holds it) take a ``flock`` on a lock file beside the export
   before they look for it: the first exports, the others wait and then find it complete. Exports are
   deterministic (files named by row), so nodes that each export their own copy agree on the images
   and captions, which the trainer checks across ranks anyway.

Parquet and arrow files are read through ``load_dataset``, which converts them to arrow in a cache of
its own: here a temporary folder beside the export, deleted after it (the export is what is reused).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeontune.errors import UserError
from xeontune.io import atomic_dir, cache_root, disk_errors, flocked
from xeontune.train.prompts import METADATA_FILE

if TYPE_CHECKING:
    from xeontune.train.options import TrainOptions

log = logging.getLogger("xeontune.train")

EXPORT_ENV = "XEONTUNE_DATASET_EXPORT"  # {"source": ..., "dir": ...}: the export a parent process made
EXPORT_RECORD = ".xeontune-dataset.json"  # in every complete export: what it holds
EXPORT_FORMAT = 1  # part of the key: a change to what an export holds makes a new one
DATA_SUFFIXES = (".parquet", ".arrow")
# PIL's format names -> the suffix the folder reader takes (images.IMAGE_SUFFIXES)
FORMAT_SUFFIX = {"PNG": ".png", "JPEG": ".jpg", "MPO": ".jpg", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# why a row gave no image -> how the warning says it
SKIPPED = {"missing": "its image file does not exist", "empty": "it has no image",
           "unreadable": "its image is no image PIL reads",
           "unsupported": "its image is in a format the trainer does not read (it takes PNG, JPEG, WebP, BMP, TIFF)"}


@dataclass(frozen=True)
class Source:
    """What --dataset names, found without loading it."""

    given: str  # as the user wrote it
    kind: str  # "saved" (save_to_disk), "parquet", "arrow" or "hub"
    path: Path | None  # the folder or file (None for a hub id or a glob)
    files: tuple[Path, ...]  # its data files (a saved dataset: every file in its folder)
    base: Path | None  # where an image path relative to the dataset is (None: the working directory)

    @property
    def name(self) -> str:
        """A readable part of the export's folder name."""
        raw = self.given if self.kind == "hub" else (self.path or self.files[0]).name
        raw = raw.replace("/", "--")
        return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(raw).stem if self.kind != "hub" else raw)[:40] or "dataset"


def exports_dir() -> Path:
    return cache_root() / "datasets"


# --- what --dataset names -----------------------------------------------------------------------------


def _is_saved(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _data_files(paths: list[Path], given: str) -> tuple[str, tuple[Path, ...]]:
    """The kind and files of a set of parquet/arrow files: one kind, or a one-line error."""
    by_kind = {suffix: sorted(p for p in paths if p.suffix.lower() == suffix) for suffix in DATA_SUFFIXES}
    kinds = [suffix for suffix, found in by_kind.items() if found]
    if len(kinds) > 1:
        raise UserError(f"--dataset {given} holds both .parquet and .arrow files: name the ones to read (a glob "
                        f"such as {given.rstrip('/')}/**/*.parquet)")
    return kinds[0].lstrip("."), tuple(by_kind[kinds[0]])


def locate(given: str) -> Source:
    """What --dataset names: a saved dataset, parquet or arrow files, or else a hub id (checked when loaded)."""
    expanded = os.path.expanduser(given)
    path = Path(expanded)
    neither = (f"--dataset {given} is neither a saved dataset (a folder written by datasets' save_to_disk) nor "
               "parquet or arrow files")
    if glob.has_magic(expanded):
        found = [Path(p) for p in glob.glob(expanded, recursive=True)]
        found = [p for p in found if p.is_file() and p.suffix.lower() in DATA_SUFFIXES]
        if not found:
            raise UserError(f"--dataset {given} matches no .parquet or .arrow file")
        kind, files = _data_files(found, given)
        prefix = Path(expanded.split("*")[0].split("?")[0].split("[")[0])
        base = prefix if prefix.is_dir() else prefix.parent
        return Source(given, kind, None, files, base.absolute())
    if path.is_dir():
        if _is_saved(path):
            files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
            return Source(given, "saved", path.absolute(), files, path.absolute())
        found = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not found:
            raise UserError(f"{neither}: the folder holds no dataset_info.json and state.json (or "
                            "dataset_dict.json), and no .parquet or .arrow file")
        kind, files = _data_files(found, given)
        return Source(given, kind, path.absolute(), files, path.absolute())
    if path.is_file():
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise UserError(f"{neither}: a file must end in .parquet or .arrow")
        kind = path.suffix.lower().lstrip(".")
        return Source(given, kind, path.absolute(), (path.absolute(),), path.absolute().parent)
    if path.exists() or path.is_symlink():
        raise UserError(f"{neither}: it is {'a broken link' if not path.exists() else 'not a file or folder'}")
    if given.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(given):
        raise UserError(f"--dataset {given} does not exist (a saved dataset's folder, parquet or arrow files, "
                        "or a hub id such as org/name)")
    return Source(given, "hub", None, (), None)


# --- the export's key and folder ----------------------------------------------------------------------


def _key(source: Source, opts: TrainOptions, fingerprint: str | None = None) -> str:
    parts = [f"format {EXPORT_FORMAT}", source.kind, opts.image_column, opts.caption_column]
    if source.kind == "hub":
        parts += [source.given, str(fingerprint)]
    else:
        parts.append(str((source.path or source.base or Path()).resolve()))
        for file in source.files:
            stat = file.stat()
            parts.append(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _complete(folder: Path) -> dict | None:
    """The record of a complete export in ``folder``, or None."""
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _identity(opts: TrainOptions) -> str:
    return json.dumps([os.getcwd(), opts.dataset, opts.image_column, opts.caption_column])


def _handed_over(opts: TrainOptions) -> Path | None:
    """The export the process that started this one made for these very options, if it did."""
    try:
        given = json.loads(os.environ.get(EXPORT_ENV, ""))
    except ValueError:
        return None
    if not isinstance(given, dict) or given.get("source") != _identity(opts):
        return None
    folder = Path(str(given.get("dir")))
    return folder if _complete(folder) is not None else None


def _say_reused(folder: Path, record: dict, given: str) -> None:
    log.info("training on %s: %d image(s) exported from --dataset %s", folder, record.get("images", 0), given)
    _warn_skipped(record, given)


def _warn_skipped(record: dict, given: str) -> None:
    rows = record.get("rows", 0)
    for reason, count in (record.get("skipped") or {}).items():
        example = (record.get("examples") or {}).get(reason)
        log.warning("skipped %d of %d rows of --dataset %s: %s%s", count, rows, given,
                    SKIPPED.get(reason, reason), f" (e.g. {example})" if example else "")


def resolve(opts: TrainOptions) -> Path | None:
    """Set ``opts.data_dir`` to the export of ``opts.dataset`` (made now, or found complete); return it.
    Nothing to do without --dataset. Every mistake is one line (UserError), before any model loads."""
    if not opts.dataset:
        return None
    handed = _handed_over(opts)
    if handed is not None:
        opts.data_dir = str(handed)
        return handed
    source = locate(opts.dataset)
    loaded = None
    if source.kind == "hub":  # its key is its fingerprint: known once it is loaded
        loaded = _load(source, opts, None)
        key = _key(source, opts, loaded._fingerprint)
    else:
        key = _key(source, opts)
    folder = exports_dir() / f"{source.name}-{key}"
    record = _complete(folder)
    if record is None:
        with flocked(folder.with_name(f".{folder.name}.lock"),
                     f"another process to finish exporting --dataset {opts.dataset}"):
            record = _complete(folder)  # another process may have written it meanwhile
            if record is None:
                record = _export(source, opts, folder, loaded)
            else:
                _say_reused(folder, record, opts.dataset)
    else:
        _say_reused(folder, record, opts.dataset)
    opts.data_dir = str(folder)
    return folder


@contextlib.contextmanager
def handed_to_ranks(opts: TrainOptions) -> Iterator[None]:
    """While ranks started here run (they inherit the environment): the export ``resolve`` made, for
    them to take as it is. Removed after, so a later run in this process resolves anew."""
    if not opts.dataset or not opts.data_dir:
        yield
        return
    before = os.environ.get(EXPORT_ENV)
    os.environ[EXPORT_ENV] = json.dumps({"source": _identity(opts), "dir": str(opts.data_dir)})
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(EXPORT_ENV, None)
        else:
            os.environ[EXPORT_ENV] = before


def for_the_ranks(opts: TrainOptions, given: set[str]) -> None:
    """A launcher's options (``xeontune run``): export --dataset here, and give the ranks the folder as
    --data-dir instead (``given``: the names that become the ranks' flags, job.spec.rank_args)."""
    if resolve(opts) is not None:
        given.discard("dataset")
        given.add("data_dir")


# --- reading the dataset ------------------------------------------------------------------------------


def _quiet(datasets: Any) -> None:
    """No progress bars or notes of its own ("Generating train split", "Using the latest cached version"):
    the export has its bar, and errors are one line."""
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load(source: Source, opts: TrainOptions, cache_dir: Path | None) -> Any:
    """The dataset (one split) with its columns checked; ``cache_dir``: where load_dataset's arrow copy
    of parquet/arrow files goes."""
    import datasets

    _quiet(datasets)
    given = source.given
    errors = (OSError, ValueError, datasets.exceptions.DatasetsError)
    no_rows = UserError(f"--dataset {given} has no rows")
    try:
        if source.kind == "saved":
            folder = _saved_split(source)
            if _saved_is_empty(folder):  # datasets itself cannot load one (an IndexError)
                raise no_rows
            loaded = datasets.load_from_disk(str(folder))
        elif source.kind == "hub":
            loaded = datasets.load_dataset(given)
        else:
            loaded = datasets.load_dataset(source.kind, data_files=[str(f) for f in source.files], split="train",
                                           cache_dir=str(cache_dir) if cache_dir else None)
    except errors as exc:
        if "corresponds to no data" in str(exc):  # parquet or arrow files of no rows
            raise no_rows from None
        if source.kind != "hub":
            raise UserError(f"cannot read --dataset {given}: {_first_line(exc)}") from None
        if datasets.config.HF_HUB_OFFLINE:
            raise UserError(f"--dataset {given} is not a file or folder here, and with HF_HUB_OFFLINE=1 it must be "
                            f"in the Hugging Face datasets cache ({datasets.config.HF_DATASETS_CACHE}), where it is "
                            "not: load it once online, or give a path") from None
        raise UserError(f"--dataset {given} is not a file or folder here, and loading it from the Hugging Face hub "
                        f"failed: {_first_line(exc)}") from None
    if isinstance(loaded, dict):  # a DatasetDict from the hub
        loaded = loaded[_split(sorted(loaded), given)]
    _check(loaded, opts, given)
    return loaded


def _split(splits: list[str], given: str) -> str:
    """Of a DatasetDict: its train split, or its only one."""
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise UserError(f"--dataset {given} has the splits {', '.join(splits) or 'none'} and none is named train")


def _saved_split(source: Source) -> Path:
    """The folder of the split to read of a saved dataset (a DatasetDict's: train, or its only one)."""
    assert source.path is not None
    listing = source.path / "dataset_dict.json"
    if not listing.is_file():
        return source.path
    try:
        splits = json.loads(listing.read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"cannot read --dataset {source.given}: {listing} is not datasets' list of splits") from None
    return source.path / _split(sorted(str(s) for s in splits), source.given)


def _saved_is_empty(folder: Path) -> bool:
    try:
        return json.loads((folder / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False  # load_from_disk says what is wrong


def _image_kind(feature: Any) -> str | None:
    """How a column holds images: "image" (datasets.Image), "path" (text), "bytes", "struct" ({bytes, path})."""
    import datasets

    if isinstance(feature, datasets.Image):
        return "image"
    if isinstance(feature, datasets.Value):
        return {"string": "path", "large_string": "path", "binary": "bytes", "large_binary": "bytes"}.get(feature.dtype)
    if isinstance(feature, dict) and {"bytes", "path"} & set(feature):
        return "struct"
    return None


def _check(ds: Any, opts: TrainOptions, given: str) -> None:
    """The columns, the rows and every caption, before anything is written."""
    columns = list(ds.column_names)
    for flag, column in (("--image-column", opts.image_column), ("--caption-column", opts.caption_column)):
        if column not in columns:
            raise UserError(f"--dataset {given} has no column {column!r} ({flag}); its columns: "
                            f"{', '.join(columns) or 'none'}")
    if opts.caption_column == "file_name":
        raise UserError("--caption-column file_name: the export's metadata.jsonl names each image in file_name; "
                        "rename the caption column")
    if _image_kind(ds.features[opts.image_column]) is None:
        raise UserError(f"--dataset {given}: column {opts.image_column!r} (--image-column) holds "
                        f"{ds.features[opts.image_column]}, not images (an Image feature, image bytes or file paths)")
    if ds.num_rows == 0:
        raise UserError(f"--dataset {given} has no rows")
    row = 0
    for batch in ds.select_columns([opts.caption_column]).iter(batch_size=1000):
        for text in batch[opts.caption_column]:
            if not isinstance(text, str):
                what = "missing (null)" if text is None else f"{type(text).__name__}, not text: {str(text)[:60]!r}"
                raise UserError(f"--dataset {given}: the caption of row {row} (counting from 0; column "
                                f"{opts.caption_column!r}) is {what}")
            if not text.strip():
                raise UserError(f"--dataset {given}: the caption of row {row} (counting from 0; column "
                                f"{opts.caption_column!r}) is empty")
            row += 1


# --- the export ---------------------------------------------------------------------------------------


def _sniffed_suffix(head: io.BufferedIOBase | io.BytesIO) -> str | None:
    """The suffix of the image format PIL reads in the header ("" where it reads none it trains on)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(head) as image:
            return FORMAT_SUFFIX.get(str(image.format), "")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None


def _suffix_of(name: str | None) -> str | None:
    from xeontune.train.images import IMAGE_SUFFIXES

    suffix = Path(name).suffix.lower() if name else ""
    return suffix if suffix in IMAGE_SUFFIXES else None


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where atomic_dir's chmod of the export's files leaves the user's file as it is (it is
    theirs, with that mode already); else a copy."""
    stat = src.stat()
    umask = os.umask(0)
    os.umask(umask)
    if stat.st_uid == os.geteuid() and (stat.st_mode & 0o777) == 0o666 & ~umask:
        with contextlib.suppress(OSError):
            os.link(src, dest)
            return
    shutil.copyfile(src, dest)


def _write_image(value: Any, kind: str, folder: Path, stem: str, base: Path | None) -> tuple[str | None, str]:
    """Write one row's image as stored into ``folder``; (its file name, "") or (None, why it was skipped)."""
    data: bytes | None = None
    path: str | None = None
    if kind == "path":
        path = value
    elif kind == "bytes":
        data = value
    elif isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    if data is not None:
        suffix = _suffix_of(path) or _sniffed_suffix(io.BytesIO(data))
        if not suffix:
            return None, "unreadable" if suffix is None else "unsupported"
        (folder / f"{stem}{suffix}").write_bytes(data)
        return f"{stem}{suffix}", ""
    if not path:
        return None, "empty"
    src = Path(path).expanduser()
    if not src.is_absolute():
        src = (base or Path.cwd()) / src
    if not src.is_file():
        return None, "missing"
    suffix = _suffix_of(src.name)
    if suffix is None:
        with open(src, "rb") as head:
            suffix = _sniffed_suffix(head)
    if not suffix:
        return None, "unreadable" if suffix is None else "unsupported"
    _link_or_copy(src, folder / f"{stem}{suffix}")
    return f"{stem}{suffix}", ""


def _export(source: Source, opts: TrainOptions, folder: Path, loaded: Any) -> dict:
    """Write the export (under the lock); return its record."""
    from tqdm.auto import tqdm

    with contextlib.ExitStack() as stack:
        if loaded is None:
            scratch = None
            if source.kind in ("parquet", "arrow"):  # load_dataset's arrow copy: only while exporting
                with disk_errors(folder):
                    folder.parent.mkdir(parents=True, exist_ok=True)
                scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.load.", dir=folder.parent))
                stack.callback(shutil.rmtree, scratch, ignore_errors=True)
            loaded = _load(source, opts, scratch)
        import datasets

        if isinstance(loaded.features[opts.image_column], datasets.Image):
            loaded = loaded.cast_column(opts.image_column, datasets.Image(decode=False))  # the stored bytes
        kind = _image_kind(loaded.features[opts.image_column])
        rows = loaded.num_rows
        width = max(5, len(str(rows - 1)))
        skipped: dict[str, int] = {}
        examples: dict[str, str] = {}
        lines: list[str] = []
        log.info("exporting --dataset %s (%d rows) to %s", source.given, rows, folder)
        with atomic_dir(folder) as tmp, tqdm(total=rows, desc="exporting dataset", unit="image",
                                             disable=not sys.stderr.isatty()) as bar:
            row = 0
            for batch in loaded.select_columns([opts.image_column, opts.caption_column]).iter(batch_size=64):
                for value, caption in zip(batch[opts.image_column], batch[opts.caption_column], strict=True):
                    name, why = _write_image(value, kind, tmp, f"{row:0{width}d}", source.base)
                    if name is None:
                        skipped[why] = skipped.get(why, 0) + 1
                        if why == "missing" and why not in examples:
                            examples[why] = str(value.get("path") if isinstance(value, dict) else value)
                    else:
                        lines.append(json.dumps({"file_name": name, opts.caption_column: caption}, ensure_ascii=False))
                    row += 1
                    bar.update(1)
            record = {"source": source.given, "kind": source.kind, "image_column": opts.image_column,
                      "caption_column": opts.caption_column, "rows": rows, "images": len(lines),
                      "skipped": skipped, "examples": examples, "format": EXPORT_FORMAT}
            if not lines:
                reasons = "; ".join(f"{count}: {SKIPPED[why]}" for why, count in skipped.items())
                raise UserError(f"--dataset {source.given}: no row has an image to train on ({reasons})")
            (tmp / METADATA_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
            (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log.info("exported %d image(s) with their captions to %s", len(lines), folder)
    _warn_skipped(record, source.given)
    return record
