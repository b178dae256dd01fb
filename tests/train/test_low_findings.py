"""The data folder read alike on the user's machine (`xeontune run`'s check), in the sync to the nodes and
on a rank: an orientation stored after a PNG's pixels, and symlinks."""

from __future__ import annotations

import io
import logging
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from PIL import ExifTags, Image

from xeontune.cluster import bootstrap, ssh
from xeontune.train.data_check import check_training_data
from xeontune.train.images import decode_upright, open_image, read_image_sizes
from xeontune.train.loop import read_training_data
from xeontune.train.options import parse_args


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """A PNG's chunks as (type, the whole chunk: length, type, data, CRC), after the signature."""
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        chunks.append((data[at + 4:at + 8], data[at:at + 12 + length]))
        at += 12 + length
    return chunks


def exif_after_the_pixels(img: Image.Image, orientation: int) -> bytes:
    """``img`` as a PNG with EXIF orientation ``orientation``, its eXIf chunk moved after the pixels (IDAT)
    to just before IEND: PIL writes it before them."""
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    out = io.BytesIO()
    img.save(out, "PNG", exif=exif)
    data = out.getvalue()
    chunks = png_chunks(data)
    late = [whole for kind, whole in chunks if kind == b"eXIf"]
    rest = [whole for kind, whole in chunks if kind != b"eXIf"]
    assert len(late) == 1 and chunks[-1][0] == b"IEND"
    moved = data[:8] + b"".join(rest[:-1] + late + rest[-1:])
    kinds = [kind for kind, _ in png_chunks(moved)]
    assert kinds.index(b"eXIf") > kinds.index(b"IDAT")
    for _, whole in png_chunks(moved):  # every CRC still sound
        assert struct.unpack(">I", whole[-4:])[0] == zlib.crc32(whole[4:-4])
    return moved


def lora_opts(folder: Path):
    return parse_args(["--method", "lora", "--model", "m", "--data-dir", str(folder), "--instance-prompt",
                       "a photo of sks toy", "--resolution", "64", "--bucket-step", "16"])


@pytest.mark.parametrize("orientation", [6, 8])
def test_an_orientation_after_a_pngs_pixels_is_read_alike_by_runs_check_and_the_rank(tmp_path, orientation):
    """A 40x24 photo stored sideways, its eXIf after IDAT, with its mask stored the same way: the header
    read (`run`'s check) and the decode (a rank) both see it 24x40, and both accept the mask; a second
    photo whose mask is stored upright (no EXIF) is accepted alike too."""
    folder = tmp_path / "data"
    folder.mkdir()
    photo = Image.effect_noise((40, 24), 64).convert("RGB")
    (folder / "photo.png").write_bytes(exif_after_the_pixels(photo, orientation))
    (folder / "photo.mask.png").write_bytes(exif_after_the_pixels(Image.new("L", (40, 24), 255), orientation))
    (folder / "other.png").write_bytes(exif_after_the_pixels(photo, orientation))
    Image.new("L", (24, 40), 255).save(folder / "other.mask.png")
    for name in ("photo.png", "photo.mask.png", "other.png"):
        assert Image.open(folder / name).size == (40, 24)  # stored sideways
    heads = dict(read_image_sizes(folder))
    decoded = {path: open_image(path, decode_upright).size for path in heads}
    assert heads == decoded == {folder / "other.png": (24, 40), folder / "photo.png": (24, 40)}
    opts = lora_opts(folder)
    check_training_data(opts)  # `run`'s check on the user's machine
    images, masks, *_ = read_training_data(opts)  # a rank
    assert images.sizes == [(24, 40), (24, 40)] and [part.size for part in images.parts] == [(48, 80)]
    assert masks[0] is not None and masks[0].shape == (2, 1, 10, 6) and bool(masks[0].all())


def linked_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A data folder with an image, an image linked from elsewhere (a dataset's own folder), a link to
    nothing, a link to a folder of images, and a real subfolder."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "more").mkdir(parents=True)
    Image.new("RGB", (32, 24), "red").save(elsewhere / "far.png")
    Image.new("RGB", (32, 32), "blue").save(elsewhere / "more" / "deep.png")
    (elsewhere / "far.txt").write_text("a photo of sks toy far away")
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    Image.new("RGB", (24, 32), "green").save(folder / "near.png")
    (folder / "near.txt").write_text("a photo of sks toy nearby")
    Image.new("RGB", (32, 32), "white").save(folder / "sub" / "inner.png")
    (folder / "far.png").symlink_to(elsewhere / "far.png")  # a linked dataset: read, and synced as its bytes
    (folder / "far.txt").symlink_to(elsewhere / "far.txt")
    (folder / "twin.png").symlink_to("near.png")  # a link inside the folder
    (folder / "gone.png").symlink_to(tmp_path / "nothing.png")  # to nothing: neither read nor synced
    (folder / "pics").symlink_to(elsewhere / "more", target_is_directory=True)  # to a folder: neither
    return folder, elsewhere


def materialize(plan: ssh.TreePlan, into: Path) -> None:
    """What ``put_tree`` sends, written here: the node's copy."""
    into.mkdir()
    for rel in plan.dirs:
        (into / rel).mkdir(parents=True, exist_ok=True)
    for local, rel in plan.files:
        shutil.copyfile(local, into / rel)  # the bytes of a link's target, as sftp.put sends them
    for rel, target in plan.links:
        os.symlink(target, into / rel)


def test_symlinked_files_are_read_and_synced_alike_and_what_is_skipped_is_named(tmp_path, caplog, capsys):
    """One rule for `run`'s check, the sync and the ranks: a link to a file is followed (the sync sends the
    target's bytes), a link to a folder or to nothing is skipped by both with a warning naming it."""
    folder, elsewhere = linked_folder(tmp_path)
    caplog.set_level(logging.WARNING, logger="xeontune.train.data")
    here = {path.name: size for path, size in read_image_sizes(folder)}
    assert here == {"far.png": (32, 24), "near.png": (24, 32), "twin.png": (24, 32)}
    for name in ("gone.png", "pics"):
        assert f"skipping {folder / name}: a symlink to " in caplog.text
    assert "far.png" not in caplog.text and "twin.png" not in caplog.text

    secret = tmp_path / "id_ed25519"
    secret.write_text("a private key")
    os.symlink(secret, folder / "key")  # a stray link to a file training does not read: never sent
    plan = ssh.tree_plan(folder, follow_file_links=bootstrap.DATA_FILE_SUFFIXES)
    assert sorted(rel for _, rel in plan.files) == ["far.png", "far.txt", "near.png", "near.txt", "sub/inner.png"]
    assert plan.dirs == ["sub"] and plan.links == [("twin.png", "near.png")]
    assert sorted(link.name for link, _ in plan.skipped) == ["gone.png", "key", "pics"]
    os.unlink(folder / "key")
    node = tmp_path / "node"
    materialize(plan, node)
    assert (node / "far.png").read_bytes() == (elsewhere / "far.png").read_bytes()
    assert not (node / "far.png").is_symlink()
    caplog.clear()
    there = {path.name: size for path, size in read_image_sizes(node)}
    assert there == here and caplog.text == ""
    opts = lora_opts(folder)
    check_training_data(opts)  # far.png's caption (linked too) is found here and on the node alike
    check_training_data(lora_opts(node))

    # The other trees put_tree sends (the cluster's files) keep its old rule: no link leaves the tree.
    plain = ssh.tree_plan(folder)
    assert sorted(rel for _, rel in plain.files) == ["near.png", "near.txt", "sub/inner.png"]
    assert sorted(link.name for link, _ in plain.skipped) == ["far.png", "far.txt", "gone.png", "pics"]


class LocalSFTP:
    """paramiko's SFTP client, as put_tree uses it, on this machine's disk."""

    def get_channel(self):
        return self

    def settimeout(self, seconds):
        pass

    def stat(self, path):
        return os.stat(path)  # FileNotFoundError, as paramiko raises it

    def mkdir(self, path):
        os.mkdir(path)

    def put(self, local, remote):
        shutil.copyfile(local, remote)  # paramiko opens ``local``: through a link, its target's bytes

    def chmod(self, path, mode):
        os.chmod(path, mode)

    def remove(self, path):
        os.remove(path)

    def symlink(self, target, path):
        os.symlink(target, path)

    def close(self):
        pass


def test_the_data_sync_follows_symlinked_files_and_names_what_it_skips(tmp_path, monkeypatch, capsys):
    """``bootstrap.sync_data`` (`cluster up`, and `run` on a reused cluster) sends the folder by the reader's
    rule: the node's copy reads as the folder does here, and each link left out is named."""
    folder, elsewhere = linked_folder(tmp_path)
    client = type("Client", (), {"open_sftp": lambda self: LocalSFTP(), "close": lambda self: None})()
    monkeypatch.setattr(ssh, "connect", lambda record, node: client)
    monkeypatch.setattr(ssh, "run", lambda record, node, argv, **kw: (0, "", "") if subprocess.run(argv).returncode
                        == 0 else (1, "", "failed"))
    record = type("Record", (), {"work_dir": str(tmp_path / "work")})()
    (tmp_path / "work" / "data").mkdir(parents=True)
    target = Path(bootstrap.sync_data(record, object(), str(folder)))
    err = capsys.readouterr().err
    assert f"warning: not uploading {folder / 'gone.png'}: a symlink to nothing" in err
    assert f"warning: not uploading {folder / 'pics'}: a symlink to a folder" in err
    assert "far.png" not in err and "twin.png" not in err
    assert sorted(p.name for p in target.iterdir()) == ["far.png", "far.txt", "near.png", "near.txt", "sub", "twin.png"]
    assert (target / "far.png").read_bytes() == (elsewhere / "far.png").read_bytes()
    assert not (target / "far.png").is_symlink() and os.readlink(target / "twin.png") == "near.png"
    here = {path.name: size for path, size in read_image_sizes(folder)}
    there = {path.name: size for path, size in read_image_sizes(target)}
    assert there == here == {"far.png": (32, 24), "near.png": (24, 32), "twin.png": (24, 32)}


def test_the_syncs_data_suffixes_are_what_training_reads():
    from xeontune.train.images import IMAGE_SUFFIXES

    assert IMAGE_SUFFIXES | {".txt", ".jsonl"} == bootstrap.DATA_FILE_SUFFIXES
