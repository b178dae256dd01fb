"""Packed frozen layers (xeontune/train/packed.py): the same outputs and input gradients as the stock
layers, in fp32 and in bf16, on every CPU; only their forward changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from xeontune.errors import UserError
from xeontune.train import backends, packed

DTYPES = [torch.float32, torch.bfloat16]


def onednn_runs(dtype: torch.dtype) -> bool:
    """torch's own answer to whether oneDNN has kernels for ``dtype`` on this CPU: fp32 everywhere,
    bf16 with AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU has none)."""
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _frozen(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    return module.to(dtype).requires_grad_(False).eval()


def _out_and_input_grad(model: nn.Module, x: torch.Tensor, autocast: bool = False):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() ** 2).sum().backward()
    return out.detach().float(), x.grad.float()


def _stock_then_packed(model: nn.Module, x: torch.Tensor, autocast: bool = False):
    """(output, input gradient) of ``model`` as it is, then of the same model packed in place."""
    want = _out_and_input_grad(model, x, autocast)
    packed.pack(model)
    return want, _out_and_input_grad(model, x, autocast)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: the same numbers up to summation order; bf16: within bf16 rounding of the largest value."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    else:
        assert (got - want).norm() / want.norm() < 2e-2


def _packs(dtype: torch.dtype) -> bool:
    """Where oneDNN runs ``dtype``, packing must be available. Where packing says no (a CPU without
    oneDNN bf16 kernels), it must say why."""
    ok, why = packed.available(dtype)
    if onednn_runs(dtype):
        assert ok, f"oneDNN runs {dtype} here, so packed layers should too: {why}"
    if not ok:
        assert "oneDNN cannot run packed" in why
    return ok


def _require_packing(dtype: torch.dtype) -> None:
    """Skip a comparison of packed numbers where packing cannot run; _packs has checked the refusal
    first, and the test just below checks what such a CPU does instead."""
    if not _packs(dtype):
        pytest.skip(f"no packed {dtype} layers on this CPU: {packed.available(dtype)[1]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packing_runs_where_onednn_has_the_kernels_and_is_refused_in_one_line_elsewhere(dtype):
    """On every CPU (bf16 on an AVX2-only one included): packed layers where oneDNN runs the dtype,
    else `--pack-weights on` is a one-line error and the stock layers stay."""
    unet, vae = _unet_and_vae()
    unet.to(dtype)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    if _packs(dtype):
        backends.prepare_frozen_models(unet, vae, precision=precision, ipex="off", pack="on")
        assert type(unet[0]) is packed.PackedConv2d
        _out_and_input_grad(unet, torch.randn(1, 4, 4, 4, dtype=dtype))
        assert unet[0]._packed is not None and unet[0]._packed_back is not None
    else:
        with pytest.raises(UserError, match=f"^--pack-weights on, but oneDNN cannot run packed {dtype} layers here"):
            backends.prepare_frozen_models(unet, vae, precision=precision, ipex="off", pack="on")
        assert type(unet[0]) is nn.Conv2d


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel,padding", [(3, 1), (1, 0), (3, 0), (5, 2)])
def test_packed_conv_matches_stock_forward_and_input_gradient(dtype, kernel, padding):
    _require_packing(dtype)
    torch.manual_seed(0)
    stock = _frozen(nn.Conv2d(16, 24, kernel, padding=padding), dtype)
    x = torch.randn(2, 16, 9, 9, dtype=dtype)
    want = _out_and_input_grad(stock, x)
    report = packed.pack(stock)
    assert (report.convolutions, report.linears) == (1, 0) and isinstance(stock, packed.PackedConv2d)
    got = _out_and_input_grad(stock, x)
    assert stock._packed is not None and stock._packed_back is not None  # the packed path ran, both ways
    for g, w in zip(got, want, strict=True):
        _assert_close(g, w, dtype)
    # another input shape than the one the weights were packed for (validation's batch, say)
    other = torch.randn(3, 16, 5, 7, dtype=dtype)
    packed.unpack(stock)
    want = _out_and_input_grad(stock, other)
    packed.pack(stock)
    _out_and_input_grad(stock, x)
    for g, w in zip(_out_and_input_grad(stock, other), want, strict=True):
        _assert_close(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 32), (2, 7, 32)], ids=["2d", "3d"])
def test_packed_linear_matches_stock_forward_and_input_gradient(dtype, shape):
    _require_packing(dtype)
    torch.manual_seed(0)
    stock = _frozen(nn.Linear(32, 48), dtype)
    want, got = _stock_then_packed(stock, torch.randn(*shape, dtype=dtype))
    assert stock._packed is not None and stock._packed_back is not None
    for g, w in zip(got, want, strict=True):
        _assert_close(g, w, dtype)


def test_under_bf16_autocast_packed_bf16_layers_compute_what_autocast_did():
    """The trainer's case: bf16 weights, fp32 activations, bf16 autocast."""
    _require_packing(torch.bfloat16)
    torch.manual_seed(0)
    stock = _frozen(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(2), nn.Linear(36, 12)), torch.bfloat16)
    want, got = _stock_then_packed(stock, torch.randn(2, 8, 6, 6), autocast=True)
    assert stock[0]._packed is not None and stock[2]._packed is not None
    assert got[1].dtype == torch.float32  # the gradient reaches the fp32 input in its dtype
    for g, w in zip(got, want, strict=True):
        _assert_close(g, w, torch.bfloat16)


def test_fp32_weights_under_bf16_autocast_run_the_stock_layer():
    """The packed kernels take one dtype; where autocast wants another, the stock layer runs, exactly."""
    torch.manual_seed(0)
    model = _frozen(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(1), nn.Linear(64, 3)), torch.float32)
    want, got = _stock_then_packed(model, torch.randn(1, 4, 4, 4), autocast=True)
    assert model[0]._packed is None and model[2]._packed is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_an_input_without_gradient_never_packs_the_backward_weight():
    """The UNet's first convolution sees the noisy latents, which need no gradient: no second copy."""
    conv = _frozen(nn.Conv2d(4, 8, 3, padding=1), torch.float32)
    packed.pack(conv)
    hidden = torch.randn(1, 8, 4, 4, requires_grad=True)
    (conv(torch.randn(1, 4, 4, 4)) * hidden).sum().backward()
    assert conv._packed is not None and conv._packed_back is None


def test_only_frozen_stride_one_layers_are_packed_and_the_state_dict_is_kept():
    model = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Conv2d(4, 4, 3, padding=1),
        nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Flatten(), nn.Linear(4, 4), nn.Linear(4, 4),
    ).requires_grad_(False)
    model[2].requires_grad_(True)  # a trainable layer: its weight gradient is not computed by packing
    model[6].requires_grad_(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = packed.pack(model)
    assert (report.convolutions, report.linears) == (1, 1)
    assert report.parameters == model[0].weight.numel() + model[5].weight.numel()
    assert [type(m).__name__ for m in model] == [
        "PackedConv2d", "Conv2d", "Conv2d", "Conv2d", "Flatten", "PackedLinear", "Linear"]
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert isinstance(model[0], nn.Conv2d)  # code that asks for a Conv2d still finds one
    packed.unpack(model)
    assert [type(m) for m in model][:2] == [nn.Conv2d, nn.Conv2d] and not hasattr(model[0], "_packed")


def test_stock_layers_swaps_back_for_a_while_and_keeps_the_packed_weights():
    conv = _frozen(nn.Conv2d(4, 4, 3, padding=1), torch.float32)
    packed.pack(conv)
    conv(torch.randn(1, 4, 4, 4))
    kept = conv._packed
    with packed.stock_layers(conv):
        assert type(conv) is nn.Conv2d
    assert type(conv) is packed.PackedConv2d and conv._packed is kept


def _unet_and_vae():
    unet, vae = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), nn.Sequential(nn.Conv2d(3, 4, 1))
    return unet.requires_grad_(False), vae.requires_grad_(False)  # frozen, as components.load leaves them


def test_auto_packs_in_both_precisions_on_both_cpu_kinds_where_the_kernels_run(fake_cpu, monkeypatch):
    """fp32 packs on AVX-512 and on AVX2-only CPUs alike (measured faster on both: docs/performance.md);
    the faked flags must not change that, only oneDNN's own check (available()) can."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a rank's threads where bf16 packs on AMX too
    unet, vae = _unet_and_vae()
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack="auto")
    assert packed.available(torch.float32)[0]  # fp32 kernels run on every x86 CPU
    assert type(unet[0]) is packed.PackedConv2d and "1 convolution and 0 Linear layers" in notes[-1]
    unet, vae = _unet_and_vae()
    backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack="off")
    assert type(unet[0]) is nn.Conv2d
    unet, vae = _unet_and_vae()
    unet.to(torch.bfloat16)
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto")
    if _packs(torch.bfloat16):
        assert type(unet[0]) is packed.PackedConv2d and type(vae[0]) is nn.Conv2d
    else:  # a CPU without oneDNN bf16 kernels forced to bf16: the stock layers, and a note that says why
        assert type(unet[0]) is nn.Conv2d and notes[-1].startswith("packed weights: not used (oneDNN cannot")
    unet, vae = _unet_and_vae()
    backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="off")
    assert type(unet[0]) is nn.Conv2d


def test_auto_leaves_sdxl_stock_in_bf16_without_amx(fake_cpu, monkeypatch):
    """SDXL in bf16 was no faster packed on an AVX512-BF16 CPU without AMX (docs/performance.md, "SDXL"),
    for one UNet more in memory: auto packs it only with AMX; SD1.x packs on both (1.29x without AMX).
    The kernels' check is faked as passing, so that the rule is asserted on every CPU (an AVX2-only
    one has no oneDNN bf16 kernels); where that check fails, every family stays stock (asserted last)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a rank's threads, as measured (see below)
    monkeypatch.setattr(packed, "available", lambda dtype: (True, "the kernels run"))  # any CPU: the rule alone
    for family in ("sdxl", "sd"):
        unet, vae = _unet_and_vae()
        unet.to(torch.bfloat16)
        _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto",
                                                     family=family)
        expect_packed = family == "sd" or fake_cpu == "amx-xeon"
        assert (type(unet[0]) is packed.PackedConv2d) == expect_packed, (family, notes)
        if not expect_packed:
            assert notes[-1].startswith("packed weights: not used (SDXL in bf16 without AMX")
    unet, vae = _unet_and_vae()  # fp32 SDXL: the kernels and the memory decide, not AMX
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack="auto", family="sdxl")
    assert type(unet[0]) is packed.PackedConv2d
    # no oneDNN bf16 kernels (an AVX2-only CPU's answer): stock for every family, AMX flag or not
    monkeypatch.setattr(packed, "available", lambda dtype: (dtype != torch.bfloat16, "no bf16 kernels here"))
    for family in ("sdxl", "sd"):
        unet, vae = _unet_and_vae()
        unet.to(torch.bfloat16)
        _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto",
                                                     family=family)
        assert type(unet[0]) is nn.Conv2d and notes[-1] == "packed weights: not used (no bf16 kernels here)", notes


def test_auto_leaves_bf16_stock_on_amx_above_a_few_threads_a_rank(fake_cpu, monkeypatch):
    """On a 16-core AMX Xeon a bf16 step with 16 threads was faster on stock layers (1.43 against 1.83
    s/step, docs/performance.md) while packing won with 2: auto packs bf16 on AMX only up to
    AMX_BF16_MAX_PACKED_THREADS threads a rank. Other CPUs and fp32 keep their measured rule."""
    monkeypatch.setattr(packed, "available", lambda dtype: (True, "the kernels run"))  # any CPU: the rule alone
    limit = packed.AMX_BF16_MAX_PACKED_THREADS
    amx = fake_cpu == "amx-xeon"
    for family in ("sd", "sdxl"):
        assert packed.auto_choice("bf16", family, threads=limit)[0] == (family == "sd" or amx)
        used, why = packed.auto_choice("bf16", family, threads=limit + 1)
        assert used == (family == "sd" and not amx), (family, why)
        if amx:
            assert why == (f"not used ({limit + 1} threads a rank: in bf16 on AMX stock torch was faster above "
                           f"{limit}, 1.43 against 1.83 s/step with 16 at 512 px; --pack-weights on forces it)")
        assert packed.auto_choice("fp32", family, threads=64)[0]
    # the rank asks with its own threads: 16 on an AMX host leaves its UNet stock, with the note
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    unet, vae = _unet_and_vae()
    unet.to(torch.bfloat16)
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto")
    assert (type(unet[0]) is packed.PackedConv2d) == (not amx)
    assert notes[-1].startswith("packed weights: not used (16 threads a rank") == amx
    # before the ranks exist their threads are not known: memory is counted as for packed copies
    from xeontune.train.ranks import packs

    assert packs("auto", "bf16", "sd")


def test_packing_gives_way_to_compile_and_refuses_to_be_forced_where_it_cannot_run(monkeypatch):
    unet, vae = _unet_and_vae()
    out, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto", compile=True)
    assert type(unet[0]) is nn.Conv2d and getattr(out, "_orig_mod", None) is unet
    with pytest.raises(UserError, match="cannot be combined"):
        backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="on", compile=True)
    with pytest.raises(UserError, match="--pack-weights must be"):
        backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="yes")
    monkeypatch.setattr(packed, "available", lambda dtype: (False, "no oneDNN here"))
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="auto")
    assert type(unet[0]) is nn.Conv2d and notes[-1] == "packed weights: not used (no oneDNN here)"
    with pytest.raises(UserError, match="--pack-weights on, but no oneDNN here"):
        backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="off", pack="on")


def _rss_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


def test_released_weight_pages_leave_resident_memory_and_read_back_the_same(tmp_path):
    """Once reordered, a layer's plain weights (memory-mapped from the bf16 copy) leave this process's
    resident memory; read again, they come back from the file unchanged. Memory of no file is kept."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.randn(2048, 2048).to(torch.bfloat16)}, str(path))  # 8 MB
    weight = load_file(str(path))["w"]
    want = weight.clone()
    weight.float().sum()  # every page resident
    before = _rss_file_kb()
    assert packed.release_file_pages(weight)
    assert _rss_file_kb() < before - 6 * 1024
    assert torch.equal(weight, want)
    assert not packed.release_file_pages(want) and torch.equal(want, weight)  # anonymous memory: untouched


def test_pages_written_in_a_private_file_mapping_are_never_released(tmp_path):
    """Issue 18, finding 14: in a private writable mapping a written page is a copy-on-write copy;
    MADV_DONTNEED would revert it to the file's bytes. Such a range is kept; an untouched one is released."""
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(torch.ones(64 * 1024, dtype=torch.float32).numpy().tobytes())  # 256 KB
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, writable
    weight = torch.frombuffer(mapping, dtype=torch.float32)
    weight.sum()  # resident, still file pages
    assert packed.release_file_pages(weight) and torch.equal(weight, torch.ones_like(weight))
    weight[40000] = 7.0  # one page copied on write: now anonymous memory
    assert not packed.release_file_pages(weight)
    assert weight[40000].item() == 7.0 and path.read_bytes()[160000:160004] == torch.ones(1).numpy().tobytes()
    del weight
    mapping.close()


def test_ipex_auto_gives_way_to_packed_weights_in_bf16_without_importing_it(monkeypatch):
    from xeontune import hardware

    def no_import(*_):
        raise AssertionError("ipex_info imports IPEX; auto should not get that far")

    monkeypatch.setattr(hardware, "ipex_info", no_import)
    monkeypatch.setattr(hardware, "ipex_version", lambda: "2.8.0")  # installed (only its metadata is read)
    unet, vae = _unet_and_vae()
    unet.to(torch.bfloat16)
    if _packs(torch.bfloat16):
        _, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="auto", pack="auto")
        assert notes[0].startswith("IPEX: not used (stock torch with packed weights")
        assert type(unet[0]) is packed.PackedConv2d
        monkeypatch.setattr(hardware, "ipex_version", lambda: None)
        unet, vae = _unet_and_vae()
        _, _, notes = backends.prepare_frozen_models(unet.to(torch.bfloat16), vae, precision="bf16", ipex="auto")
        assert notes[0] == f"IPEX: not used ({hardware.IPEX_NOT_INSTALLED})"
    else:  # no oneDNN bf16 kernels (AVX2 only): auto does not pack, so `--ipex auto` asks IPEX's own rule
        with pytest.raises(AssertionError, match="imports IPEX"):
            backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="auto", pack="auto")
        assert type(unet[0]) is nn.Conv2d
    with pytest.raises(AssertionError, match="imports IPEX"):  # without packing, auto asks about IPEX
        backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="auto", pack="off")


def test_forcing_packing_where_it_cannot_run_is_one_line_and_exit_2(base_args, monkeypatch, capsys):
    """What a user of an AVX2-only CPU sees for `--mixed-precision bf16 --pack-weights on`."""
    from xeontune.cli import main

    monkeypatch.setattr(packed, "available", lambda dtype: (False, f"oneDNN cannot run packed {dtype} layers here (x)"))
    assert main(["train", *base_args, "--mixed-precision", "bf16", "--pack-weights", "on"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == ["error: --pack-weights on, but oneDNN cannot run packed torch.bfloat16 layers here (x)"]
    with pytest.raises(SystemExit) as bad_choice:  # argparse's own one-line usage error
        main(["train", *base_args, "--pack-weights", "sometimes"])
    assert bad_choice.value.code == 2


def _file_mapped(module: nn.Module, path) -> nn.Module:
    """``module`` with its weights memory-mapped from a file, as diffusers loads a pipeline's."""
    torch.save(module.state_dict(), path)
    module.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True)
    return module


def test_auto_leaves_the_layers_stock_where_the_packed_copy_would_not_fit(monkeypatch, tmp_path):
    """SDXL in fp32 on 24 GB: two reordered UNets (20.5 GB) and the rest of the run do not fit. A UNet
    mapped from its file is page cache, which MemAvailable counts free, and its pages are handed back once
    packed: two UNets beside the rest. A UNet converted in memory keeps its plain weights: three. Out of
    MemAvailable plus the process's anonymous memory, less the margin. Faked memory: auto packs with room
    exactly, not with less; `on` still forces it; a run that may not fit as prepared is warned."""
    from xeontune import placement

    unet_bytes = backends.module_bytes(_unet_and_vae()[0])
    anonymous, rest = 5000, 1000
    warned: list[str] = []  # recorded at the call: other tests may leave the loggers' levels changed
    monkeypatch.setattr(backends.log, "warning", lambda msg, *args: warned.append(msg % args))
    monkeypatch.setattr(placement, "anonymous_bytes", lambda *a: anonymous)

    def room(nbytes: int) -> None:  # this process can have exactly nbytes
        monkeypatch.setattr(placement, "available_memory_bytes",
                            lambda *a: (nbytes + 1) / (1 - placement.RESERVED_FRACTION) - anonymous)

    def prepared(pack: str, step_bytes: int, mapped: bool) -> tuple[nn.Module, list[str]]:
        unet, vae = _unet_and_vae()
        if mapped:
            _file_mapped(unet, tmp_path / "unet.pt")
        assert packed.file_mapped_bytes(unet.parameters()) == (unet_bytes if mapped else 0)
        _, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack=pack,
                                                     step_bytes=step_bytes)
        return unet, notes

    room(2 * unet_bytes + rest)
    assert type(prepared("auto", rest, mapped=True)[0][0]) is packed.PackedConv2d  # fits exactly
    unet, notes = prepared("auto", rest + 100, mapped=True)
    assert type(unet[0]) is nn.Conv2d
    assert notes[-1].startswith("packed weights: not used (the packed UNet and the rest") and "--pack-weights on" in notes[-1]
    assert type(prepared("auto", rest, mapped=False)[0][0]) is nn.Conv2d  # converted in memory: a third UNet
    assert not warned  # the stock layers fit: nothing to warn of
    room(3 * unet_bytes + rest)
    assert type(prepared("auto", rest, mapped=False)[0][0]) is packed.PackedConv2d
    room(2 * unet_bytes + rest)
    assert type(prepared("on", rest + 100, mapped=True)[0][0]) is packed.PackedConv2d  # forced, and warned
    assert len(warned) == 1 and "may run out of memory" in warned[0] and "--pack-weights off" in warned[0]
    assert type(prepared("off", 2 * unet_bytes + rest, mapped=True)[0][0]) is nn.Conv2d  # not even stock fits
    assert len(warned) == 2 and "--gradient-checkpointing" in warned[1] and "--pack-weights off" not in warned[1]


def test_the_ranks_of_a_host_share_its_memory_and_pack_all_or_none(monkeypatch, tmp_path):
    """Each rank counts its share of MemAvailable among the host's ranks (LOCAL_WORLD_SIZE, as torch's
    launcher, mpirun and Slurm's adoption set it), and all ranks agree: one that cannot pack makes
    every rank run stock layers (``agree``: Sync.all_true, an all-reduce MIN)."""
    from xeontune import placement

    unet_bytes = backends.module_bytes(_unet_and_vae()[0])
    rest = 1000
    monkeypatch.setattr(placement, "anonymous_bytes", lambda *a: 0)
    monkeypatch.setattr(placement, "available_memory_bytes",  # room for one packed rank, not for two
                        lambda *a: (2 * unet_bytes + rest + 1) / (1 - placement.RESERVED_FRACTION))
    asked: list[bool] = []

    def prepared(agree_with_others: bool = True) -> nn.Module:
        unet, vae = _file_mapped(_unet_and_vae()[0], tmp_path / "unet.pt"), _unet_and_vae()[1]
        backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack="auto", step_bytes=rest,
                                       agree=lambda mine: asked.append(mine) or (mine and agree_with_others))
        return unet

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert type(prepared()[0]) is packed.PackedConv2d and asked == [True]
    assert type(prepared(agree_with_others=False)[0]) is nn.Conv2d and asked[-1] is True  # another rank said no
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert type(prepared()[0]) is nn.Conv2d and asked[-1] is False  # half the host each: it asks the others with no
    from xeontune.train.loop import Sync

    assert Sync().all_true(True) and not Sync().all_true(False)  # one process: its own answer


def test_the_trainer_asks_for_room_for_its_step(base_args, monkeypatch):
    """setup passes what the run holds beside the UNet (the text encoder and VAE, a step's activations)
    to the packing decision: with less memory than two UNets and that, auto does not pack."""
    from xeontune import placement
    from xeontune.train import loop
    from xeontune.train.options import parse_args

    seen = {}

    def fits(unet, step_bytes, memory):
        seen["unet"], seen["rest"] = backends.module_bytes(unet), step_bytes
        return False, "not used (faked: no room)"

    monkeypatch.setattr(backends, "_packing_fits", fits)
    opts = parse_args([*base_args, "--mixed-precision", "fp32", "--pack-weights", "auto"])
    run, _ = loop.setup(opts, loop.make_accelerator(opts))
    assert not any(type(m) is packed.PackedConv2d for m in run.components.denoiser.modules())
    assert "packed weights: not used (faked: no room)" in run.backend_notes
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    # as loaded: the run's VAE is released once latents are cached, and its token table became a buffer
    vae = AutoencoderKL.from_pretrained(opts.model, subfolder="vae")
    text_encoder = CLIPTextModel.from_pretrained(opts.model, subfolder="text_encoder")
    beside = backends.module_bytes(text_encoder) + backends.module_bytes(vae)
    assert seen["unet"] == backends.module_bytes(run.components.denoiser) > 0
    # less the step's activations
    counted = seen["rest"] - placement.rank_memory_bytes(0, run.components.family.activation_bytes(opts.resolution,
                                                                                                   run.precision), 1)
    # counted after the token was added: its row, at most a padded block of 64 rows (resize_token_embeddings)
    assert 0 <= counted - beside <= 64 * 4 * text_encoder.config.hidden_size
