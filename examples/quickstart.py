"""Batch 12 prompts of mixed lengths through 4 slots of a Thunder-compiled step program, and check
every output against litgpt's own one-prompt-at-a-time generate_fn (a small random litgpt model)."""

import copy

import torch
from litgpt import GPT, Config
from litgpt.generate.base import generate_fn

from thunder_batch import Engine, EngineConfig, SamplingParams

torch.manual_seed(0)
config = Config.from_name("pythia-14m", n_layer=2, block_size=128, vocab_size=256, padded_vocab_size=256)
model = GPT(config).eval()
prompts = [torch.randint(0, 256, (n,)).tolist() for n in (1, 3, 7, 8, 9, 15, 17, 25, 30, 2, 5, 12)]


def litgpt_greedy(prompt, max_new_tokens):
    single = copy.deepcopy(model)
    single.set_kv_cache(batch_size=1, max_seq_length=len(prompt) + max_new_tokens)
    tokens = generate_fn(
        single,
        torch.tensor(prompt),
        len(prompt) + max_new_tokens,
        temperature=0.0,
        include_prompt=False,
        include_eos=False,
    )
    return [int(t) for t in tokens]


expected = [litgpt_greedy(p, 10) for p in prompts]
engine = Engine(copy.deepcopy(model), EngineConfig(batch_size=4, max_seq_length=64, prefill_chunk=8, compile="thunder"))
results = engine.generate(prompts, SamplingParams(max_new_tokens=10))

same = sum(r.token_ids == e for r, e in zip(results, expected))
stats = engine.stats()
print(f"{same}/{len(prompts)} prompts token-identical to litgpt generate_fn")
print(
    f"cache_misses={stats['cache_misses']} (step shapes {stats['step_shapes']}), steps={stats['steps']}, "
    f"generated_tokens={stats['generated_tokens']}"
)
assert same == len(prompts) and stats["cache_misses"] <= 3
