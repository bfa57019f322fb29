"""litgpt's mixture-of-experts MLP (`LLaMAMoE`) with shapes fixed by the step's rows, whatever the routing.

litgpt runs each expert on the rows routed to it (`torch.where`: shapes follow the data). Here each
layer's experts are stacked once, `fc [E, 2I, C]` (each expert's fc_1 rows, then its fc_2 rows) and
`proj [E, C, I]`, and the model's own expert weights become views of them (same values and layout,
so litgpt's own forward is unchanged; no second copy). Routing is litgpt's: top-k of the router
logits, softmax over the k in float32, `routed_scaling_factor`; the grouped router
(`n_expert_groups`) and shared experts are litgpt's own modules. Three layouts of the N * k (row,
expert) pairs, each with shapes fixed by N (`benchmarks/moe_layer.py` measured them on real sizes):

- `grouped`: the pairs sorted by expert, one `torch._grouped_mm` per projection with the group ends
  as data: the active experts' FLOPs and weights only. Used wherever torch runs it for the layer's
  shapes, dtype and device (probed once when the layer is stacked): fastest at every N measured
  (benchmarks/RESULTS.md, "Mixture-of-experts layer: which fixed-shape layout").
- `gathered`: each pair's expert weights gathered from the stacks, one batched matmul per pair;
  copies the active experts' weights. Otherwise, while N * k < E.
- `dense`: every expert over every row, weighted by the routing (zero off each row's top k): E / k
  times the active FLOPs, all weights read. Otherwise, once N * k >= E.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from litgpt.model import LLaMAMoE
from torch import nn

from thunder_batch import fallbacks

LAYOUTS = ("grouped", "gathered", "dense")


def layout_for(rows: int, n_expert: int, per_token: int, grouped_runs: bool) -> str:
    """The layout for a step of `rows` rows (see the module docstring): a shape, never a value."""
    if grouped_runs:
        return "grouped"
    return "gathered" if rows * per_token < n_expert else "dense"


def fixed_shape_mlp(block: nn.Module) -> StackedExperts | None:
    """What a litgpt Block's MLP runs as in the step: its experts stacked for an MoE layer, else None
    (the block's own MLP already has fixed shapes)."""
    return StackedExperts(block.mlp) if isinstance(block.mlp, LLaMAMoE) else None


class StackedExperts(nn.Module):
    """One layer's experts (a litgpt LLaMAMoE) over a step's rows: x [N, C] -> [N, C]."""

    def __init__(self, moe: LLaMAMoE, layout: str | None = None) -> None:
        super().__init__()
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"MoE layout must be one of {LAYOUTS} or None, got {layout!r}")
        cfg = moe.config
        self.config, self.layout = cfg, layout  # layout None: chosen per step shape by layout_for
        self.gate = moe.gate
        self.shared_experts = getattr(moe, "shared_experts", None)
        fc, proj = expert_tensors(moe, "weight")
        self.fc, self.proj = _parameter(fc), _parameter(proj)  # [E, 2I, C], [E, C, I]
        self.fc_bias = self.proj_bias = None  # [E, 2I], [E, C] where the experts have biases
        if cfg.bias:
            fc_bias, proj_bias = expert_tensors(moe, "bias")
            self.fc_bias, self.proj_bias = _parameter(fc_bias), _parameter(proj_bias)
        self.grouped_runs = _grouped_runs(self)  # a plain attribute: the trace depends on it
        if not self.grouped_runs and layout in (None, "grouped"):
            fallbacks.report(
                "moe_layout",
                f"torch's grouped matmul does not run this mixture-of-experts layer ({self.fc.dtype}, "
                f"{self.fc.device.type}, experts {self.fc.shape[1]} x {self.fc.shape[2]}): the gathered or dense "
                "layout runs instead (more weight reads or FLOPs)",
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """litgpt's routing: (weights [N, k], experts [N, k]) for x [N, C]."""
        cfg = self.config
        if not cfg.n_expert_groups:
            probs, indices = torch.topk(self.gate(x), cfg.n_expert_per_token)  # [N, k] of [N, E]
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        else:
            probs, indices = self.gate(x)  # float32 weights, as litgpt's GroupedTopkRouter returns
        if cfg.routed_scaling_factor != 1.0:
            probs = probs * cfg.routed_scaling_factor
        return probs, indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        probs, indices = self.route(x)
        layout = self.layout or layout_for(x.shape[0], cfg.n_expert, cfg.n_expert_per_token, self.grouped_runs)
        y = {"grouped": grouped, "gathered": gathered, "dense": dense}[layout](self, x, probs, indices)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def grouped(experts: StackedExperts, x, probs, indices) -> torch.Tensor:
    """The (row, expert) pairs sorted by expert, a grouped matmul per projection (each group's end is
    data, every shape fixed). x: [N, C]; probs, indices: [N, k] -> [N, C]."""
    N, C = x.shape
    E, k = experts.fc.shape[0], indices.shape[1]
    flat = indices.reshape(N * k)  # [M]: the expert of each (row, choice)
    order = torch.argsort(flat)  # [M]: the pairs grouped by expert
    counts = (flat.unsqueeze(-1) == torch.arange(E, device=x.device)).sum(0)  # [E]
    ends = torch.cumsum(counts, 0).to(torch.int32)  # [E]: where each expert's group ends
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [M, C]
    h = torch._grouped_mm(rows, experts.fc.transpose(1, 2), ends)  # [M, 2I]
    expert = flat.index_select(0, order)  # [M]
    if experts.fc_bias is not None:
        h = h + experts.fc_bias.index_select(0, expert)
    out = torch._grouped_mm(_glu(h), experts.proj.transpose(1, 2), ends)  # [M, C]
    if experts.proj_bias is not None:
        out = out + experts.proj_bias.index_select(0, expert)
    out = out.index_select(0, torch.argsort(order))  # [M]: back in (row, choice) order
    return (out.view(N, k, C) * probs.unsqueeze(-1)).to(x.dtype).sum(1)


def gathered(experts: StackedExperts, x, probs, indices) -> torch.Tensor:
    """Each row's k experts, their weights gathered. x: [N, C]; probs, indices: [N, k] -> [N, C]."""
    N, C = x.shape
    k = indices.shape[1]
    flat = indices.reshape(N * k)  # [M]: expert of each (row, choice)
    rows = x.unsqueeze(1).expand(N, k, C).reshape(N * k, 1, C)  # [M, 1, C]
    h = torch.bmm(rows, experts.fc.index_select(0, flat).transpose(1, 2)).squeeze(1)  # [M, 2I]
    if experts.fc_bias is not None:
        h = h + experts.fc_bias.index_select(0, flat)
    act = _glu(h)  # [M, I]
    out = torch.bmm(act.unsqueeze(1), experts.proj.index_select(0, flat).transpose(1, 2)).squeeze(1)  # [M, C]
    if experts.proj_bias is not None:
        out = out + experts.proj_bias.index_select(0, flat)
    return (out.view(N, k, C) * probs.unsqueeze(-1)).to(x.dtype).sum(1)


def dense(experts: StackedExperts, x, probs, indices) -> torch.Tensor:
    """Every expert over every row, weighted by the routing. x: [N, C]; probs, indices: [N, k] -> [N, C]."""
    N, C = x.shape
    E, I2, _ = experts.fc.shape
    weights = torch.zeros(N, E, dtype=x.dtype, device=x.device).scatter(1, indices, probs.to(x.dtype))  # [N, E]
    bias = None if experts.fc_bias is None else experts.fc_bias.reshape(E * I2)
    h = F.linear(x, experts.fc.reshape(E * I2, C), bias).view(N, E, I2)  # [N, E, 2I]
    act = (_glu(h) * weights.unsqueeze(-1)).transpose(0, 1)  # [E, N, I]
    y = torch.bmm(act, experts.proj.transpose(1, 2)).sum(0)  # [E, N, C] -> [N, C]
    if experts.proj_bias is not None:
        y = y + weights @ experts.proj_bias
    return y


@torch.no_grad()
def _grouped_runs(experts: StackedExperts) -> bool:
    """Whether torch's `_grouped_mm` runs this layer's shapes, dtype and device (CUDA takes bfloat16
    only; strides must be multiples of 16 bytes): one row through it, as the step would."""
    cfg = experts.config
    x = torch.zeros(1, experts.fc.shape[2], dtype=experts.fc.dtype, device=experts.fc.device)
    indices = torch.arange(cfg.n_expert_per_token, device=x.device).unsqueeze(0)  # [1, k]
    try:
        grouped(experts, x, torch.ones(indices.shape, dtype=x.dtype, device=x.device), indices)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _parameter(per_expert: list[list[torch.Tensor]]) -> nn.Parameter:
    return nn.Parameter(_stack(per_expert), requires_grad=False)


def _glu(h: torch.Tensor) -> torch.Tensor:
    """LLaMAMLP's silu(fc_1(x)) * fc_2(x) from h = [fc_1(x), fc_2(x)] along the last dim."""
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def _stack(per_expert: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each expert's tensors, concatenated along dim 0, stacked: [E, rows, ...]. Each tensor then
    becomes a view of the stack (same values and layout, one copy in memory)."""
    first = per_expert[0][0]
    rows = sum(t.shape[0] for t in per_expert[0])
    stack = torch.empty((len(per_expert), rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    _into(stack, per_expert)
    return stack


@torch.no_grad()
def _into(stack: torch.Tensor, per_expert: list[list[torch.Tensor]]) -> None:
    """Each expert tensor that is not yet its view of `stack` is copied in and becomes that view."""
    for e, tensors in enumerate(per_expert):
        start = 0
        for t in tensors:
            view = stack[e, start : start + t.shape[0]]
            if t.data_ptr() != view.data_ptr():
                view.copy_(t)
                t.data = view  # the expert now reads the stack: litgpt's own forward is unchanged
            start += t.shape[0]


def restack(experts: StackedExperts, moe: LLaMAMoE) -> None:
    """After the model's expert weights were replaced (new tensors, or new data: no longer views of the
    stacks), their values go into the stacks and they become views again. Weights edited in place need
    nothing: they are the stacks."""
    for stacks, attr in [((experts.fc, experts.proj), "weight"), ((experts.fc_bias, experts.proj_bias), "bias")]:
        if stacks[0] is not None:
            for stack, per_expert in zip(stacks, expert_tensors(moe, attr)):
                _into(stack, per_expert)


def expert_tensors(moe: LLaMAMoE, attr: str) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each expert's `attr` ("weight" or "bias") of fc_1 then fc_2, and of proj: the stacks' `fc` and `proj`."""
    fc = [[getattr(e.fc_1, attr), getattr(e.fc_2, attr)] for e in moe.experts]
    return fc, [[getattr(e.proj, attr)] for e in moe.experts]
