"""Sequence tiling of each decoder layer's MLP (`model.tiled_mlp`): the [tokens x intermediate]
activations of the MLP never exist for the whole sequence at once.

A gated MLP (Llama: gate, up, SiLU, product, down) keeps four [tokens x intermediate] tensors for
its backward, and the intermediate is 3.5x the hidden width (14,336 against 4,096 in
Llama-3.1-8B): at long sequences, one layer's MLP is the largest thing a checkpointed step holds.
Every token goes through the MLP on its own (no mixing across positions), so the sequence can be
cut into tiles: `TiledMLPFunction` runs the module on one tile at a time without saving anything
but its input, and in backward recomputes each tile's MLP with autograd on and backpropagates
it, so at most one tile's intermediate activations and their gradients exist at a time (the
scheme of Arctic Long Sequence Training's TiledMLP, arXiv 2506.13996, and DeepSpeed's
`TiledMLP`).

What stays true:
- outputs and the input gradient are computed tile by tile, row for row as the untiled module
  computes them (each row of a matmul reads only its own row of the input), so they are
  bit-identical to the untiled computation wherever the matmul kernel is row-independent;
  tests/test_tiling.py checks that on CPU fp32.
- the gradients of the MLP's trainable parameters (LoRA A/B) are sums over every token: tiled,
  each tile's part is summed in tile order, which is the same sum in another order than the one
  the untiled matmul uses, so they agree to rounding, not bit for bit (the test shows both).
  They are returned as the Function's gradients for those parameters, so autograd accumulates
  them once per step (DDP's and FSDP's gradient hooks fire as for any parameter).
- the backward recompute draws the same random numbers as the forward did (dropout in LoRA or
  the MLP): the generator state at the forward is restored around it, as torch.utils.checkpoint
  does; and it runs under the forward's autocast state.

The wrapper (`TiledMLP`) shares the MLP's child modules instead of holding the MLP as a child,
so parameter names, peft's adapter files and checkpoints are the same tiled or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_TILE_TOKENS = 8192
"""Tokens per MLP tile: at Llama-3.1-8B's width one tile's intermediate tensor is 224 MiB in bf16,
large enough that each matmul keeps the GPU busy, small enough that a tile's working set (its
saved activations and their gradients, about 7 such tensors) stays under 2 GiB."""


class TiledMLPFunction(torch.autograd.Function):
    """out[t] = mlp(x[t]) tile by tile; see the module docstring. `params`: the MLP's trainable
    parameters, inputs here so that the output needs a gradient whenever they do."""

    @staticmethod
    def forward(ctx: Any, mlp: torch.nn.Module, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tile, ctx.params = mlp, tile, params
        ctx.rng = _RngState(x.device)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.size(-1))
        out: torch.Tensor | None = None
        with torch.no_grad():
            for start, stop in spans(flat.size(0), tile):
                y = mlp(flat[start:stop].unsqueeze(0)).squeeze(0)
                if out is None:
                    out = y.new_empty(flat.size(0), y.size(-1))
                out[start:stop] = y
        assert out is not None, "an MLP tile over zero tokens"
        return out.view(*x.shape[:-1], out.size(-1))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        mlp, tile, params = ctx.mlp, ctx.tile, ctx.params
        need_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:], strict=True) if need]
        flat = x.detach().reshape(-1, x.size(-1))
        grads = grad_out.reshape(-1, grad_out.size(-1))
        grad_x = torch.empty_like(flat) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with ctx.rng.restored(), torch.enable_grad(), torch.autocast(**ctx.autocast):
            for start, stop in spans(flat.size(0), tile):
                xt = flat[start:stop].unsqueeze(0).detach().requires_grad_(need_x)
                yt = mlp(xt).squeeze(0)
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


class TiledMLP(torch.nn.Module):
    """`mlp` computed in sequence tiles of `tile` tokens. The MLP's children are this module's
    children (the same objects, under the same names), so nothing about the model's parameters
    changes; the MLP itself is kept outside the module tree and called on each tile."""

    inner: torch.nn.Module

    def __init__(self, mlp: torch.nn.Module, tile: int) -> None:
        super().__init__()
        if tile < 1:
            raise ValueError(f"model.tiled_mlp_tokens must be at least 1, got {tile}")
        object.__setattr__(self, "inner", mlp)  # not a child: its children are ours (the names stay)
        for name, child in mlp.named_children():
            self.add_module(name, child)
        for name, param in mlp.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.tile = tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= self.tile:
            return self.inner(x)  # one tile: the plain module, nothing to gain
        # Without a gradient to come (evaluation, nothing trainable) autograd keeps no graph.
        params = [p for p in self.parameters() if p.requires_grad]
        out: torch.Tensor = TiledMLPFunction.apply(self.inner, self.tile, x, *params)
        return out

    def extra_repr(self) -> str:
        return f"tile={self.tile} tokens, {type(self.inner).__name__}"


def apply(layers: torch.nn.ModuleList, tile: int) -> int:
    """Wrap the `mlp` of every decoder layer in `layers` (once); returns how many were wrapped."""
    wrapped = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or isinstance(mlp, TiledMLP):
            continue
        layer.mlp = TiledMLP(mlp, tile)
        wrapped += 1
    return wrapped


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
