"""Sequence tiling of each decoder layer's per-token parts (`model.tiled_mlp`): the MLP, the
RMSNorms, and the final norm; their activations never exist for the whole sequence at once.

A gated MLP (Llama: gate, up, SiLU, product, down) keeps four [tokens x intermediate] tensors for
its backward, and the intermediate is 3.5x the hidden width (14,336 against 4,096 in
Llama-3.1-8B): at long sequences, one layer's MLP is the largest thing a checkpointed step holds.
Next come the RMSNorms: each upcasts its [tokens x hidden] input to fp32 and keeps that copy for
its backward, which itself holds four fp32 [tokens x hidden] temporaries at once. Every token goes
through a norm and the MLP on its own (no mixing across positions), so the sequence can be cut
into tiles: `TiledFunction` runs a module on one tile at a time without saving anything but its
input, and in backward recomputes each tile with autograd on and backpropagates it, so at most one
tile's activations and their gradients exist at a time (the scheme of Arctic Long Sequence
Training's TiledMLP, arXiv 2506.13996, and DeepSpeed's `TiledMLP`).

What `apply` tiles in each layer: the post-attention norm and the MLP as one unit (`NormThenMLP`:
the norm's output, the MLP's input, then exists for one tile at a time; the norm module stays at
`post_attention_layernorm` and passes its input through there), the input norm on its own (its
output feeds attention, which mixes positions, so it is computed whole, but its fp32 copies are
not kept), and the decoder's final norm. The norms are tiled in place (`tile_in_place`: only
their `forward` changes), so their parameters stay registered on them and are read at each call.

What stays true:
- outputs and the input gradient are computed tile by tile, row for row as the untiled module
  computes them (each row of a matmul and of a norm reads only its own row of the input), so they
  are bit-identical to the untiled computation wherever the kernels are row-independent;
  tests/test_tiling.py checks that on CPU fp32.
- the gradients of the tiled modules' trainable parameters (LoRA A/B; a norm's weight if it
  trains) are sums over every token: tiled, each tile's part is summed in tile order, which is the
  same sum in another order than the one the untiled matmul uses, so they agree to rounding, not
  bit for bit (the test shows both). They are returned as the Function's gradients for those
  parameters, so autograd accumulates them once per step (DDP's and FSDP's gradient hooks fire as
  for any parameter).
- the backward recompute draws the same random numbers as the forward did (dropout in LoRA or
  the MLP): the generator state at the forward is restored around it, as torch.utils.checkpoint
  does; and it runs under the forward's autocast state.

The MLP's wrapper (`Tiled`) shares the MLP's children instead of holding the MLP as a child, so
parameter names, peft's adapter files and checkpoints are the same tiled or not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEFAULT_TILE_TOKENS = 8192
"""Tokens per tile (MLP and norms): at Llama-3.1-8B's width one tile's intermediate tensor is 224 MiB in bf16,
large enough that each matmul keeps the GPU busy, small enough that a tile's working set (its
saved activations and their gradients, about 7 such tensors) stays under 2 GiB."""


class TiledFunction(torch.autograd.Function):
    """out[t] = module(x[t]) tile by tile; see the module docstring. `params`: the module's trainable
    parameters, inputs here so that the output needs a gradient whenever they do."""

    @staticmethod
    def forward(
        ctx: Any, module: Callable[[torch.Tensor], torch.Tensor], tile: int, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.module, ctx.tile, ctx.params = module, tile, params
        ctx.rng = _RngState(x.device)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.size(-1))
        out: torch.Tensor | None = None
        with torch.no_grad():
            for start, stop in spans(flat.size(0), tile):
                y = module(flat[start:stop].unsqueeze(0)).squeeze(0)
                if out is None:
                    out = y.new_empty(flat.size(0), y.size(-1))
                out[start:stop] = y
        assert out is not None, "a tile over zero tokens"
        return out.view(*x.shape[:-1], out.size(-1))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        module, tile, params = ctx.module, ctx.tile, ctx.params
        need_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:], strict=True) if need]
        flat = x.detach().reshape(-1, x.size(-1))
        grads = grad_out.reshape(-1, grad_out.size(-1))
        grad_x = torch.empty_like(flat) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with ctx.rng.restored(), torch.enable_grad(), torch.autocast(**ctx.autocast):
            for start, stop in spans(flat.size(0), tile):
                xt = flat[start:stop].unsqueeze(0).detach().requires_grad_(need_x)
                yt = module(xt).squeeze(0)
                inputs = ([xt] if need_x else []) + wanted
                got = torch.autograd.grad(yt, inputs, grads[start:stop], allow_unused=True)
                if need_x:
                    assert grad_x is not None
                    grad_x[start:stop] = got[0].squeeze(0)
                    got = got[1:]
                for k, g in enumerate(got):
                    before = sums[k]
                    if g is not None:
                        sums[k] = g if before is None else before + g  # tile order: see the module docstring
        by_param = iter(sums)
        param_grads = [next(by_param) if need else None for need in ctx.needs_input_grad[3:]]
        return None, None, None if grad_x is None else grad_x.view_as(x), *param_grads


class Tiled(torch.nn.Module):
    """`inner` computed in sequence tiles of `tile` tokens. The children and parameters of
    `names_from` (default: `inner`) are this module's own (the same objects, under the same names),
    so nothing about the model's parameter names changes; `inner` itself is kept outside the module
    tree and called on each tile."""

    inner: torch.nn.Module

    def __init__(self, inner: torch.nn.Module, tile: int, names_from: torch.nn.Module | None = None) -> None:
        super().__init__()
        if tile < 1:
            raise ValueError(f"model.tiled_mlp_tokens must be at least 1, got {tile}")
        object.__setattr__(self, "inner", inner)  # not a child: its children are ours (the names stay)
        owner = inner if names_from is None else names_from
        for name, child in owner.named_children():
            self.add_module(name, child)
        for name, param in owner.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.tile = tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= self.tile:
            return self.inner(x)  # one tile: the plain module, nothing to gain
        # Without a gradient to come (evaluation, nothing trainable) autograd keeps no graph.
        # The inner module's parameters, not ours: a fused norm's weight is registered elsewhere.
        params = [p for p in self.inner.parameters() if p.requires_grad]
        out: torch.Tensor = TiledFunction.apply(self.inner, self.tile, x, *params)
        return out

    def extra_repr(self) -> str:
        return f"tile={self.tile} tokens, {type(self.inner).__name__}"


class NormThenMLP(torch.nn.Module):
    """A decoder layer's post-attention norm and its MLP as one per-token unit: tiled together, the
    norm's output (the MLP's input) exists for one tile at a time, never for the whole sequence.
    The norm runs its class's forward (its own `forward` passes its input through, `apply`)."""

    def __init__(self, norm: torch.nn.Module, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.mlp = norm, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(type(self.norm).forward(self.norm, x))
        return out


def tile_in_place(norm: torch.nn.Module, tile: int) -> None:
    """From now on `norm` computes in tiles of `tile` tokens. The module stays where it is, with its
    class and parameters: only its `forward` is replaced (a method bound to it, so a deep copy of
    the model binds to the copy), and the tiled computation reads the parameters at each call, so
    a framework that swaps them (FSDP's gathered weights, a state dict loaded with assign=True) is
    followed."""
    if tile < 1:
        raise ValueError(f"model.tiled_mlp_tokens must be at least 1, got {tile}")
    norm.spotune_tile = tile  # type: ignore[assignment]
    norm.forward = types.MethodType(_tiled_norm_forward, norm)


def _tiled_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    tile = tile_of(norm)
    assert tile is not None
    plain = functools.partial(type(norm).forward, norm)
    if x.shape[:-1].numel() <= tile:
        return plain(x)
    params = [p for p in norm.parameters() if p.requires_grad]
    out: torch.Tensor = TiledFunction.apply(plain, tile, x, *params)
    return out


def tile_of(module: torch.nn.Module) -> int | None:
    """The tile `module` computes in (a `Tiled` wrapper or a norm tiled in place), None if untiled."""
    if isinstance(module, Tiled):
        return module.tile
    tile = getattr(module, "spotune_tile", None)
    return tile if isinstance(tile, int) else None


def _pass_through(x: torch.Tensor) -> torch.Tensor:
    return x


def apply(layers: torch.nn.ModuleList, tile: int, decoder: torch.nn.Module | None = None) -> int:
    """Tile every decoder layer in `layers` (once): its MLP, fused with the post-attention norm
    where the layer's forward feeds that norm straight into the MLP (`_norm_feeds_mlp`; the norm
    stays registered where it is and passes its input through, `NormThenMLP` runs it), and its
    input norm; and `decoder.norm` (the final norm) when given. Returns how many layers were tiled."""
    wrapped = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or isinstance(mlp, Tiled):
            continue
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is not None and _per_token_norm(norm) and _norm_feeds_mlp(type(layer).forward):
            layer.mlp = Tiled(NormThenMLP(norm, mlp), tile, names_from=mlp)
            norm.forward = _pass_through
            norm.spotune_tile = tile  # in the MLP's tiles
        else:
            layer.mlp = Tiled(mlp, tile)
        first = getattr(layer, "input_layernorm", None)
        if first is not None and _per_token_norm(first):
            tile_in_place(first, tile)
        wrapped += 1
    final = getattr(decoder, "norm", None) if decoder is not None else None
    if final is not None and _per_token_norm(final):
        tile_in_place(final, tile)
    return wrapped


def _per_token_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm or LayerNorm over the last dimension (each token on its own), not tiled yet."""
    if tile_of(module) is not None:
        return False
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


_FEEDS_MLP = re.compile(r"(\w+) = self\.post_attention_layernorm\(\w+\)\s*\n\s*\w+ = self\.mlp\(\1\)")


@functools.cache
def _norm_feeds_mlp(forward: Callable[..., Any]) -> bool:
    """Whether a decoder layer's `forward` uses its post-attention norm once, straight as the MLP's input
    (Llama, Mistral, Qwen2/3): only then may the norm run inside the MLP's tiles. Read from the
    forward's source: a layer written otherwise keeps the norm where it is."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return source.count("self.post_attention_layernorm") == 1 and _FEEDS_MLP.search(source) is not None


def spans(tokens: int, tile: int) -> list[tuple[int, int]]:
    """The [start, stop) rows of each tile: consecutive, none overlapping, the last one shorter."""
    return [(start, min(start + tile, tokens)) for start in range(0, tokens, tile)]


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The autocast setting the forward ran under, to recompute each tile under the same one."""
    kind = device_type if device_type in ("cuda", "cpu") else "cpu"
    return {
        "device_type": kind,
        "dtype": torch.get_autocast_dtype(kind),
        "enabled": torch.is_autocast_enabled(kind),
    }


class _RngState:
    """The CPU and (on CUDA) device generator state at the forward; `restored()` replays it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else [], device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
