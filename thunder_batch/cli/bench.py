"""`thunder-batch bench`: load the model and run the benchmark (`bench.run.run_benchmark`).

Its flags are the benchmark's options (`bench.options.BenchOptions`) and the model's (ModelOptions):
one dataclass holding both, BenchFlags, which jsonargparse follows from `bench(**flags)`."""

from __future__ import annotations

import inspect
import tempfile
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path

from thunder_batch.bench.options import BenchOptions
from thunder_batch.cli.options import ModelOptions


def _args_section(cls: type) -> str:
    """The entries of a dataclass docstring's Args section: the flags' help."""
    return inspect.cleandoc(cls.__doc__).partition("Args:\n")[2]


@dataclass(frozen=True)
class BenchFlags(ModelOptions, BenchOptions):
    # jsonargparse reads a flag's help from this class's own docstring only: both Args sections, joined.
    __doc__ = f"`thunder-batch bench`'s flags.\n\nArgs:\n{_args_section(BenchOptions)}\n{_args_section(ModelOptions)}"

    def bench_options(self) -> BenchOptions:
        """The benchmark's options alone (the model's are the command's: it loads the model)."""
        return BenchOptions(**{f.name: getattr(self, f.name) for f in fields(BenchOptions)})


# The generated __init__ would evaluate its fields' annotations (strings) in this module, which lacks the
# names they use; get_type_hints evaluates each in its own class's module, so jsonargparse sees real types.
BenchFlags.__init__.__annotations__ = {**typing.get_type_hints(BenchFlags), "return": None}


def bench(**flags) -> None:
    """Benchmark the engine (eager and under Thunder per executor) against litgpt's generate_fn and
    batched_generate_fn on the same requests and weights; greedy tokens are checked across systems.
    """
    from thunder_batch.chat import prompt_style_for

    command = BenchFlags(**flags)  # the engine's shape options are bench's own: it sweeps batch sizes
    with tempfile.TemporaryDirectory(prefix="thunder-batch-") as folder:  # a random K-quant model's file
        gpt, tokenizer, config, checkpoint_dir = command.load_model(command.device, Path(folder))
        command.quantize(gpt)  # every system runs the same quantized linears
        files = model_files(command, checkpoint_dir, Path(folder))
        options = replace(command.bench_options(), llama_cpp_gguf=files)
        label = command.random_weights or Path(checkpoint_dir).name
        run_dataset(command, options, gpt, tokenizer, prompt_style_for(config, checkpoint_dir), label)


def model_files(command: BenchFlags, checkpoint_dir, folder: Path) -> str | None:
    """The GGUF files llama.cpp may run (bench.llama_cpp_files): those given, the checkpoint when it is a GGUF file
    read as it is, and a random K-quant model's own file."""
    from thunder_batch.checkpoints import is_gguf_file

    files = [f for f in (command.llama_cpp_gguf or "").split(",") if f.strip()]
    if command.random_weights is None and is_gguf_file(checkpoint_dir) and command.made_quantization is None:
        files.append(str(checkpoint_dir))
    files += sorted(str(p) for p in folder.glob("*.gguf"))
    return ",".join(files) or None


def run_dataset(command: BenchFlags, options: BenchOptions, gpt, tokenizer, prompt_style, label: str) -> None:
    """The benchmark its dataset and flags choose: prefix reuse, JSON schemas, speculative decoding, or requests."""
    from thunder_batch.bench.json_schema import run_json_schema_benchmark
    from thunder_batch.bench.prefix import PREFIX_DATASETS
    from thunder_batch.bench.prefix_run import run_prefix_benchmark
    from thunder_batch.bench.run import run_benchmark
    from thunder_batch.bench.speculative import parse_ks, run_speculative_benchmark

    if options.dataset in PREFIX_DATASETS:
        run_prefix_benchmark(gpt, tokenizer, options)
    elif options.dataset == "json-schema":
        run_json_schema_benchmark(gpt, tokenizer, prompt_style, options)
    elif parse_ks(options.speculative_tokens) != [0]:
        run_speculative_benchmark(gpt, tokenizer, prompt_style, options)
    else:
        label += f" {command.quantization}" if command.quantization else ""
        label += " int8 activations" if command.int8_activations else ""
        run_benchmark(gpt, tokenizer, prompt_style, options=options, model_label=label)
