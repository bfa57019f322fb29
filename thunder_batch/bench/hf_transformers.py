"""Hugging Face transformers as a benchmark peer: batched greedy generation as a transformers user runs it.

The litgpt weights go through litgpt's own converter (the copy functions of
`litgpt.scripts.convert_lit_checkpoint`) into a transformers model of the same layout (Llama or GPT-NeoX),
in the run's precision. Requests are taken in order, in static batches of at most B, left-padded to the
batch's longest prompt, through `generate(do_sample=False, cache_implementation="static")`:

- hf-transformers: the eager forward (after one untimed warm-up call);
- hf-transformers-compile: generate's own torch.compile of the decode forward (`CompileConfig`; on CPU
  transformers compiles only when told to compile on every device), compiled by an untimed first pass over
  the whole workload, so the timed pass meets no new shape.

A static batch runs until its longest member is done (an EOS ends a row's output, not its batch's steps):
finished rows wait, and tokens past a row's own max_new_tokens are discarded. That wait is what the
comparison with the engine's slots is about.
"""

from __future__ import annotations

import sys
import time

import torch

from thunder_batch.bench.metrics import PeakMemory, RequestTrace
from thunder_batch.bench.system_run import BenchContext, SystemRun, progress_bar
from thunder_batch.bench.workloads import BenchRequest
from thunder_batch.checkpoints import LLAMA_LAYOUT

HF_SYSTEMS = ("hf-transformers", "hf-transformers-compile")
INSTALL_HINT = "transformers is not installed (pip install 'thunder_batch[hf]')"


def unavailable() -> str | None:
    """Why the transformers peer cannot run here, or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


# litgpt Config fields that must hold these values for each layout transformers gets (name -> value); Llama's is
# the one llama.cpp's llama files hold too (checkpoints.LLAMA_LAYOUT).
NEOX_LAYOUT = dict(
    mlp_class_name="GptNeoxMLP",
    norm_class_name="LayerNorm",
    bias=True,
    shared_attention_norm=False,
    lm_head_bias=False,
    rope_adjustments=None,
    rope_condense_ratio=1,
    rope_interleave=False,
    norm_qk=False,
    post_attention_norm=False,
    post_mlp_norm=False,
    attention_logit_softcapping=None,
    final_logit_softcapping=None,
    sliding_window_size=None,
)


def layout_of(config) -> str:
    """ "llama" or "gpt_neox": the transformers layout a litgpt config maps onto; ValueError naming what differs."""
    for name, layout in (("llama", LLAMA_LAYOUT), ("gpt_neox", NEOX_LAYOUT)):
        if all(getattr(config, k, None) == v for k, v in layout.items()):
            if name == "gpt_neox" and config.n_query_groups != config.n_head:
                break
            return name
    differ = ", ".join(
        f"{k}={getattr(config, k, None)!r} (Llama: {v!r})"
        for k, v in LLAMA_LAYOUT.items()
        if getattr(config, k, None) != v
    )
    raise ValueError(f"the hf-transformers peer maps the Llama and GPT-NeoX layouts only; {config.name} has {differ}")


def hf_config(config):
    """The transformers config of the same model (no special token ids: generate gets them per call)."""
    from transformers import GPTNeoXConfig, LlamaConfig

    common = dict(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        max_position_embeddings=config.block_size,
        tie_word_embeddings=False,  # litgpt keeps lm_head as its own weight
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    rope = dict(rope_type="default", rope_theta=config.rope_base)
    if layout_of(config) == "llama":
        return LlamaConfig(
            **common,
            num_key_value_heads=config.n_query_groups,
            head_dim=config.head_size,
            rms_norm_eps=config.norm_eps,
            rope_parameters=rope,
        )
    act = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}[config.gelu_approximate]
    return GPTNeoXConfig(
        **common,
        hidden_act=act,
        layer_norm_eps=config.norm_eps,
        use_parallel_residual=config.parallel_residual,
        rope_parameters=dict(rope, partial_rotary_factor=config.rotary_percentage),
    )


@torch.no_grad()
def to_transformers(gpt):
    """A transformers model with a copy of `gpt`'s weights (its dtype and device), converted by litgpt's converter."""
    from litgpt.scripts.convert_lit_checkpoint import copy_weights_gpt_neox, copy_weights_llama
    from transformers import AutoModelForCausalLM

    config = gpt.config
    copy = copy_weights_llama if layout_of(config) == "llama" else copy_weights_gpt_neox
    state: dict[str, torch.Tensor] = {}
    copy(config, state, {name: p.detach() for name, p in gpt.named_parameters()})
    weight = gpt.lm_head.weight
    model = AutoModelForCausalLM.from_config(hf_config(config), dtype=weight.dtype).to(weight.device)
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)


class BatchRecorder:
    """generate's streamer: the first put is the prompt [B, L], each later one a step's tokens [B]. Records a
    row's tokens into its trace until it meets EOS (not recorded) or its own max_new_tokens."""

    def __init__(self, traces: list[RequestTrace], limits: list[int], eos_id: int | None) -> None:
        self.traces, self.limits, self.eos_id = traces, limits, eos_id
        self.live = [True] * len(traces)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for row, token in enumerate(value.view(-1).tolist()):
            if not self.live[row]:
                continue
            if token == self.eos_id:
                self.live[row] = False
                continue
            self.traces[row].record([token], now)
            self.live[row] = len(self.traces[row].token_ids) < self.limits[row]

    def end(self) -> None:
        pass


def left_padded(group: list[BenchRequest], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [len(group), longest prompt], prompts aligned to the right."""
    longest = max(len(r.prompt_ids) for r in group)
    ids = [[pad_id] * (longest - len(r.prompt_ids)) + list(r.prompt_ids) for r in group]
    mask = [[0] * (longest - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def generate_kwargs(ctx: BenchContext, compiled: bool) -> dict:
    """Greedy, static cache; EOS stops a row unless the run ignores it."""
    from transformers import CompileConfig

    eos = None if ctx.ignore_eos else ctx.eos_id
    kwargs = dict(
        do_sample=False,
        num_beams=1,
        cache_implementation="static",
        eos_token_id=eos,
        pad_token_id=0 if eos is None else eos,
        disable_compile=not compiled,
    )
    if compiled:
        config = CompileConfig(fullgraph=False, mode="default")
        config._compile_all_devices = True  # transformers' own switch to compile on CPU too
        kwargs["compile_config"] = config
    return kwargs


def run_batches(model, workload: list[BenchRequest], batch_size: int, ctx: BenchContext, kwargs: dict, desc: str):
    """Every request through generate in static batches, in order; returns (traces in workload order, wall s)."""
    traces = {r.index: RequestTrace(len(r.prompt_ids), 0.0) for r in workload}
    groups = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    pad_id = kwargs["pad_token_id"]
    with progress_bar(len(workload), desc, ctx.progress) as bar:
        t0 = time.perf_counter()
        for r in workload:
            traces[r.index].arrival = t0
        for group in groups:
            ids, mask = left_padded(group, pad_id, ctx.device)
            limits = [r.max_new_tokens for r in group]
            recorder = BatchRecorder([traces[r.index] for r in group], limits, kwargs["eos_token_id"])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits), streamer=recorder, **kwargs)
            bar.update(len(group))
        wall = time.perf_counter() - t0
    return [traces[r.index] for r in workload], wall


@torch.inference_mode()
def run_transformers(gpt, workload: list[BenchRequest], system: str, batch_size: int, ctx: BenchContext) -> SystemRun:
    """Convert, warm up (compile: a whole untimed pass), then the timed pass over the workload."""
    import transformers

    compiled = system == "hf-transformers-compile"
    with PeakMemory(ctx.device) as memory:
        start = time.perf_counter()
        model = to_transformers(gpt)
        convert_s = time.perf_counter() - start
        kwargs = generate_kwargs(ctx, compiled)
        start = time.perf_counter()
        if compiled:
            desc = f"{system} B={batch_size} (compile)"
            _, first_pass_s = run_batches(model, workload, batch_size, ctx, kwargs, desc)
        else:
            ids, mask = left_padded(workload[:batch_size], kwargs["pad_token_id"], ctx.device)
            model.generate(input_ids=ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 2})
        warmup_s = time.perf_counter() - start
        traces, wall = run_batches(model, workload, batch_size, ctx, kwargs, f"{system} B={batch_size}")
    compile_info = dict(convert_s=convert_s, first_step_s=warmup_s)
    if compiled:  # the first pass paid the compiles: its extra time over the timed pass
        compile_info.update(cold_s=max(first_pass_s - wall, 0.0), first_pass_s=first_pass_s)
    batches = -(-len(workload) // batch_size)
    emitted = sum(len(t.token_ids) for t in traces)
    print(f"[bench] {system} B={batch_size}: {emitted} tokens in {wall:.1f}s", file=sys.stderr)
    note = (
        f"transformers {transformers.__version__} generate, {batches} static batches left-padded to their longest "
        "prompt; each runs until its longest member is done"
    )
    return SystemRun(system, batch_size, traces, wall, memory.as_dict(), compile_info, notes=[note])
