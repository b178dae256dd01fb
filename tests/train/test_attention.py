"""The trainer's attention path against fp64: output and input gradients, in fp32 and bf16, on every CPU.

The path is what the trainer runs: the UNet's diffusers Attention modules with their processor (stock
SDPA today), their Linear layers as `prepare_frozen_models` leaves them (packed where this CPU packs),
in the precision's dtype under the trainer's autocast. The reference is softmax(q k^T / sqrt(d)) v in
fp64 through the same weights. An attention candidate for issue 20 must pass these unchanged.

Bounds: relative Frobenius error. Stock measured 2026-11-25 on an AVX512-BF16 EPYC and on the same CPU
held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), SD1.5 (8 x 40) and SDXL (10 x 64) heads
at 1024 tokens and the tiny models' shapes, unit-scale and 4x inputs: fp32 at most 3.2e-6; bf16 output at
most 7.8e-3 and gradients at most 1.5e-2, growing with the logits' size (4x inputs). The bounds sit about
1.3x above stock's worst, so a path that rounds the logits to bf16 fails them: diffusers' classic
`AttnProcessor` (logits and softmax in the activations' dtype) gave 1.5e-2 and 2.1e-2 at 4x inputs.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import Attention
from torch import nn

from xeontune import models
from xeontune.train import components as components_mod
from xeontune.train.backends import prepare_frozen_models
from xeontune.train.loop import precision_autocast

BOUNDS = {"fp32": (1e-5, 1e-5), "bf16": (1e-2, 2e-2)}  # (output, gradients)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INPUT_SCALES = (1.0, 4.0)  # the blocks' LayerNorms give unit-scale inputs; 4x sharpens the softmax


def reference(attn: Attention, hidden: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in fp64 through ``attn``'s own weights (the UNet's attention blocks
    have no norms, residual or rescale inside the module; asserted)."""
    assert attn.group_norm is None and attn.spatial_norm is None and attn.norm_q is None and attn.norm_cross is None
    assert not attn.residual_connection and attn.rescale_output_factor == 1.0
    weights = {name: p.detach().double() for name, p in attn.named_parameters()}

    def linear(name: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ weights[f"{name}.weight"].T
        return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y

    source = hidden if context is None else context
    q, k, v = linear("to_q", hidden), linear("to_k", source), linear("to_v", source)
    batch, tokens, inner = q.shape
    head = inner // attn.heads
    q, k, v = (t.view(batch, -1, attn.heads, head).transpose(1, 2) for t in (q, k, v))
    probabilities = torch.softmax(q @ k.transpose(-1, -2) * head**-0.5, dim=-1)
    return linear("to_out.0", (probabilities @ v).transpose(1, 2).reshape(batch, tokens, inner))


def relative_errors(attn: Attention, hidden: torch.Tensor, context: torch.Tensor | None,
                    precision: str) -> dict[str, float]:
    """Run ``attn`` as the trainer does and return the output's and input gradients' error against fp64."""
    dtype = DTYPES[precision]
    inputs = {"hidden": hidden} if context is None else {"hidden": hidden, "context": context}
    ours = {name: x.to(dtype).clone().requires_grad_(True) for name, x in inputs.items()}
    exact = {name: x.detach().double().requires_grad_(True) for name, x in ours.items()}  # the same values
    cotangent = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with precision_autocast(precision):
        out = attn(ours["hidden"], encoder_hidden_states=ours.get("context"))
    (out.double() * cotangent).sum().backward()
    want = reference(attn, exact["hidden"], exact.get("context"))
    (want * cotangent).sum().backward()

    def error(have: torch.Tensor, expected: torch.Tensor) -> float:
        return ((have.double() - expected).norm() / expected.norm()).item()

    errors = {"output": error(out, want)}
    errors.update({f"{name} gradient": error(ours[name].grad, exact[name].grad) for name in inputs})
    return errors


def assert_within(errors: dict[str, float], precision: str, what: str) -> None:
    output_bound, gradient_bound = BOUNDS[precision]
    for name, value in errors.items():
        bound = output_bound if name == "output" else gradient_bound
        assert value <= bound, f"{what}: {precision} {name} error {value:.2e} > {bound:.0e} (all: {errors})"


def random_inputs(hidden_shape, context_shape, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(hidden_shape, generator=g) * scale
    context = None if context_shape is None else torch.randn(context_shape, generator=g) * scale
    return hidden, context


# (query dim, heads, head dim, context dim): SD1.5's first level (8 heads of 40, CLIP-L's 768) and
# SDXL's second (10 heads of 64, 768 + 1280), both at 1024 tokens (256 px and 512 px)
FULL_SIZE = {"sd15": (320, 8, 40, 768), "sdxl": (640, 10, 64, 2048)}


@pytest.mark.parametrize("precision", sorted(BOUNDS))
@pytest.mark.parametrize("model", sorted(FULL_SIZE))
def test_attention_at_the_real_models_shapes_matches_fp64(model, precision):
    dim, heads, head, context_dim = FULL_SIZE[model]
    torch.manual_seed(0)
    blocks = nn.ModuleDict({
        "self": Attention(dim, None, heads=heads, dim_head=head),
        "cross": Attention(dim, context_dim, heads=heads, dim_head=head),
    }).to(DTYPES[precision]).requires_grad_(False)
    blocks, _, _ = prepare_frozen_models(blocks, nn.Identity(), precision=precision)
    for kind, attn in blocks.items():
        for scale in INPUT_SCALES:
            hidden, context = random_inputs((1, 1024, dim), (1, 77, context_dim) if kind == "cross" else None,
                                            scale, seed=int(scale))
            assert_within(relative_errors(attn, hidden, context, precision), precision,
                          f"{model} {kind}-attention, inputs x{scale:g}")


@pytest.mark.parametrize("precision", sorted(BOUNDS))
@pytest.mark.parametrize("kind", ["tiny", "sdxl-tiny"])
def test_every_attention_of_the_trainers_unet_matches_fp64(kind, precision, tmp_path):
    """The tiny UNets loaded and prepared as `xeontune train` loads them; every attention module at the
    shapes a 64 px step gives it."""
    model = models.build_pipeline(kind, tmp_path / kind)
    loaded = components_mod.load(str(model), denoiser_dtype=components_mod.frozen_dtype(precision))
    unet, _, _ = prepare_frozen_models(loaded.denoiser, loaded.vae, precision=precision, family=loaded.family.name)
    shapes: dict[str, tuple] = {}

    def capture(name):
        def hook(_module, args, kwargs):
            context = kwargs.get("encoder_hidden_states")
            shapes[name] = (args[0].shape, None if context is None else context.shape)
        return hook

    attentions = {name: m for name, m in unet.named_modules() if isinstance(m, Attention)}
    handles = [m.register_forward_pre_hook(capture(name), with_kwargs=True) for name, m in attentions.items()]
    config = unet.config
    added = None
    if loaded.family.conditions(None, None):  # SDXL's pooled text and size/crop conditions
        text_embeds = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": torch.randn(1, text_embeds), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
    with torch.no_grad(), precision_autocast(precision):
        unet(torch.randn(1, config.in_channels, 8, 8), torch.tensor([500]),
             torch.randn(1, 77, config.cross_attention_dim), added_cond_kwargs=added)
    for handle in handles:
        handle.remove()
    assert set(shapes) == set(attentions) and any(context for _, context in shapes.values())
    for index, (name, (hidden_shape, context_shape)) in enumerate(sorted(shapes.items())):
        for scale in INPUT_SCALES:
            hidden, context = random_inputs(hidden_shape, context_shape, scale, seed=index)
            assert_within(relative_errors(attentions[name], hidden, context, precision), precision,
                          f"{kind} {name}, inputs x{scale:g}")


# --- xeontune's attention kernel (issue 51): the same gate, the kernel called directly and through the UNet's
# processor, then what falls back to torch's SDPA

KERNEL_HEADS = (40, 64, 80, 160)  # SD1.5's levels (40, 80, 160) and SDXL's (64)


def kernel_errors(q, k, v, precision: str) -> dict[str, float]:
    """The kernel's output and q/k/v gradients against fp64 on the same (rounded) inputs."""
    from xeontune.train import attention

    dtype = DTYPES[precision]
    ours = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_(True) for t in ours]
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = attention.attention(*ours)
    (out.double() * cotangent).sum().backward()
    qe, ke, ve = exact
    want = torch.softmax(qe @ ke.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ ve
    (want * cotangent).sum().backward()

    def error(have: torch.Tensor, expected: torch.Tensor) -> float:
        return ((have.double() - expected).norm() / expected.norm()).item()

    errors = {"output": error(out, want)}
    errors.update({f"{name} gradient": error(t.grad, e.grad) for name, t, e in zip("qkv", ours, exact, strict=True)})
    return errors


@pytest.fixture(scope="module")
def kernel_built():
    from xeontune.train import attention

    why = attention.kernel()
    assert why is None, f"the kernel did not build here (CI installs a compiler): {why}"


def test_a_build_killed_hard_does_not_leave_the_next_load_waiting(kernel_built, tmp_path):
    """torch's build lock is a file, which a build killed by SIGKILL or the OOM killer leaves behind (seen:
    every later run waited on it for ever). With that file left in a built kernel's folder, a new process
    still loads the kernel: builds take turns on a flock, which dies with its holder."""
    import os
    import shutil
    import subprocess
    import sys

    from xeontune.io import CACHE_ENV, cache_root
    from xeontune.train import attention

    built = attention.build_directory()
    copy = tmp_path / "cache" / built.relative_to(cache_root())
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "xeontune-build.lock"))
    (copy / "lock").write_text("")  # what a killed build leaves
    done = subprocess.run([sys.executable, "-c", "from xeontune.train import attention; print(attention.kernel())"],
                          env={**os.environ, CACHE_ENV: str(tmp_path / "cache")}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]


@pytest.mark.parametrize("precision", sorted(BOUNDS))
@pytest.mark.parametrize("head", KERNEL_HEADS)
def test_the_kernel_matches_fp64_at_every_head_size(kernel_built, head, precision):
    """Self-attention over 1024 tokens and cross-attention over 77 keys, heads as the processor lays them out
    ((batch, tokens, heads, head) memory): output and all three gradients within torch's own bounds, at unit
    and 4x inputs. The batch of 2 and 130 queries leave ragged last blocks; 129 queries and 77 keys are odd (the
    bf16 products' VNNI pairs are padded)."""
    g = torch.Generator().manual_seed(head)
    for queries, keys, batch in ((1024, 1024, 1), (130, 77, 2), (129, 77, 1)):
        for scale in INPUT_SCALES:
            q, k, v = (torch.randn(batch, tokens, 4, head, generator=g).transpose(1, 2) * scale
                       for tokens in (queries, keys, keys))
            assert_within(kernel_errors(q, k, v, precision), precision,
                          f"kernel, {queries}x{keys} tokens, heads of {head}, inputs x{scale:g}")


def test_bf16_heads_run_bf16_products_where_the_cpu_has_avx512(kernel_built):
    """The kernel's bf16 path on this CPU: bf16 products (brgemm on VNNI pairs) on an AVX512-BF16 CPU, so that
    a probe that failed there would not silently fall back to the 1.5x slower fp32 path; fp32 products on an
    AVX2-only CPU, where torch's brgemm has no bf16."""
    from xeontune import hardware
    from xeontune.train import attention

    flags = hardware.cpu_flags()
    if "amx_bf16" in flags or ("avx512f" in flags and "avx512_bf16" not in flags):
        pytest.skip("no measured expectation on this CPU kind (AMX, or AVX-512 without BF16): the accuracy "
                    "tests above hold whichever path runs")
    assert attention.bf16_products() == ("avx512_bf16" in flags)


@pytest.mark.parametrize("precision", sorted(BOUNDS))
def test_the_processor_runs_the_real_models_attention_through_the_kernel(kernel_built, precision, monkeypatch):
    """The UNet's attention blocks with the kernel's processor, as `--attention xeontune` installs it, meet
    the gate at SD1.5's and SDXL's shapes; every call reached the kernel."""
    from xeontune.train import attention

    calls = []
    real = attention.attention
    monkeypatch.setattr(attention, "attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for model, (dim, heads, head, context_dim) in sorted(FULL_SIZE.items()):
        torch.manual_seed(0)
        blocks = nn.ModuleDict({
            "self": Attention(dim, None, heads=heads, dim_head=head),
            "cross": Attention(dim, context_dim, heads=heads, dim_head=head),
        }).to(DTYPES[precision]).requires_grad_(False)
        assert attention.install(blocks) == 2
        blocks, _, _ = prepare_frozen_models(blocks, nn.Identity(), precision=precision)
        for kind, attn in blocks.items():
            hidden, context = random_inputs((1, 1024, dim), (1, 77, context_dim) if kind == "cross" else None,
                                            4.0, seed=4)
            assert_within(relative_errors(attn, hidden, context, precision), precision,
                          f"{model} {kind}-attention through the kernel")
    assert len(calls) == 4 and all(shape[2] == 1024 for shape in calls), calls


def test_calls_the_kernel_does_not_handle_go_to_torchs_sdpa_unchanged(kernel_built, monkeypatch):
    """A mask, dropout, a causal mask, fp16, 3-D inputs: torch's SDPA, with its very result (mixed dtypes: its
    error); the kernel is not called."""
    from xeontune.train import attention

    monkeypatch.setattr(attention, "attention", lambda *a, **k: pytest.fail("the kernel was called"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    mask = torch.rand(16, 16, generator=g) > 0.3
    for args, kwargs in (((q, k, v), {"attn_mask": mask}), ((q, k, v), {"is_causal": True}),
                         ((q.half(), k.half(), v.half()), {}), ((q[0], k[0], v[0]), {})):
        with torch.random.fork_rng():
            want = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        assert torch.equal(attention.sdpa(*args, **kwargs), want)
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same dtype"):
        attention.sdpa(q, k.bfloat16(), v.bfloat16())  # torch's own refusal
    torch.manual_seed(3)
    dropped = attention.sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(dropped, torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    # the stock processor keeps a block that carries a mask
    blocks = Attention(16, None, heads=2, dim_head=8)
    attention.install(blocks)
    hidden = torch.randn(1, 5, 16, generator=g)
    masked = torch.zeros(1, 1, 5)
    assert torch.equal(blocks(hidden, attention_mask=masked), blocks.processor.stock(blocks, hidden, attention_mask=masked))


AVX2 = frozenset({"avx2", "fma"})
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
AMX = ZEN4 | {"amx_bf16", "amx_tile"}


def test_auto_follows_the_measured_rule_on_each_cpu_kind(kernel_built):
    """--attention auto by the CPU's flags (faked), as measured (docs/performance.md): in fp32 the kernel for
    self-attention over 1024 keys or more on AVX2 and on AVX512-BF16; in bf16 over 256 keys or more where the
    CPU has AVX512-BF16, torch's without bf16 instructions; torch's on AMX (not measured there);
    cross-attention's 77 keys always torch's. torch and xeontune say what they are."""
    from xeontune.train import attention

    for precision in ("bf16", "fp32"):
        mode, note = attention.use_kernel("auto", precision, AMX)
        assert mode is None and "not measured yet on an AMX CPU" in note
    assert not attention.prefers_kernel(torch.bfloat16, 4096, AMX)
    assert not attention.prefers_kernel(torch.float32, 4096, AMX)
    for flags in (ZEN4, AMX, AVX2):
        assert attention.use_kernel("xeontune", "bf16", flags)[0] == "always"
    assert attention.use_kernel("auto", "bf16", ZEN4) == (
        "auto", "xeontune's kernel for self-attention over 256+ keys, torch's SDPA for the rest (--attention auto)")
    assert attention.prefers_kernel(torch.bfloat16, 256, ZEN4) and attention.prefers_kernel(torch.bfloat16, 4096, ZEN4)
    assert not attention.prefers_kernel(torch.bfloat16, 77, ZEN4)
    mode, note = attention.use_kernel("auto", "bf16", ZEN4, tokens=64)
    assert mode is None and "64 tokens at most, the kernel wins from 256" in note
    mode, note = attention.use_kernel("auto", "bf16", AVX2)
    assert mode is None and "in bf16 without bf16 instructions the kernel is not chosen yet" in note
    assert not attention.prefers_kernel(torch.bfloat16, 4096, AVX2)
    for flags in (AVX2, ZEN4):
        assert attention.use_kernel("auto", "fp32", flags) == (
            "auto", "xeontune's kernel for self-attention over 1024+ keys, torch's SDPA for the rest (--attention auto)")
        assert attention.prefers_kernel(torch.float32, 1024, flags)
        assert attention.prefers_kernel(torch.float32, 4096, flags)
        assert not attention.prefers_kernel(torch.float32, 256, flags)
        assert not attention.prefers_kernel(torch.float32, 77, flags)
    mode, note = attention.use_kernel("auto", "fp32", AVX2, tokens=64)  # the tiny model at 64 px: nothing to build
    assert mode is None and "64 tokens at most, the kernel wins from 1024" in note
    assert attention.use_kernel("auto", "fp32", AVX2, tokens=4096)[0] == "auto"
    assert attention.use_kernel("torch", "bf16", AVX2) == (None, "torch's SDPA (--attention torch)")
    with pytest.raises(ValueError, match="--attention must be one of"):
        attention.use_kernel("flash", "fp32", AVX2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_fake_kernels_and_autograd_agree_with_the_real_ones(kernel_built, dtype):
    """torch.library.opcheck on both ops: schema, autograd registration and the fake kernels that
    --compile traces with, whose outputs must have the real ones' strides ((batch, tokens, heads, head)
    memory: the processor's reshape reads them as such)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, tokens, 3, 40, generator=g).transpose(1, 2).to(dtype).requires_grad_(True)
               for tokens in (70, 77, 77))
    torch.library.opcheck(torch.ops.xeontune.attention_forward.default, (q, k, v, 40 ** -0.5))
    out, lse = torch.ops.xeontune.attention_forward(q.detach(), k.detach(), v.detach(), 40 ** -0.5)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    torch.library.opcheck(torch.ops.xeontune.attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out, lse, 40 ** -0.5))
