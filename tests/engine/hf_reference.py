"""transformers' greedy generation: the reference the engine is checked against."""

import torch
import transformers


def hf_greedy(path: str, prompts: list[list[int]], max_new: int, **config_overrides) -> list[list[int]]:
    """Each prompt's greedy continuation (float32, no EOS stop), the prompt cut off."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config_overrides)
    return greedy_of(hf, prompts, max_new)


def greedy_of(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """hf_greedy on a model already loaded (and changed, or on a GPU, say)."""
    outs = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def prefix_agreement(outs: list[list[int]], refs: list[list[int]]) -> float:
    """Share of reference tokens reproduced before each sequence's first divergence."""
    agree = 0
    for out, ref in zip(outs, refs):
        for a, b in zip(out, ref):
            if a != b:
                break
            agree += 1
    return agree / sum(len(r) for r in refs)
