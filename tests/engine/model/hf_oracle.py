"""transformers' M3 as the oracle: prefill logits and greedy continuation through its own KV cache."""

import torch


@torch.inference_mode()
def hf_greedy(model, input_ids: torch.Tensor, num_tokens: int, **multimodal) -> tuple[torch.Tensor, list[int]]:
    """Float32 prompt logits ``[n, vocab]`` and ``num_tokens`` greedy ids (EOS does not stop it)."""
    out = model(input_ids=input_ids[None], use_cache=True, **multimodal)
    logits = out.logits[0].float()
    cache = out.cache
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_tokens:
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=input_ids.device), cache=cache, use_cache=True)
        cache = out.cache
        tokens.append(int(out.logits[0, -1].argmax()))
    return logits, tokens


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |ours - reference| / max |reference|``: elementwise ratios blow up on logits near zero."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())
