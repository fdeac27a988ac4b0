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


def token_errors(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row (token): ``max |ours - reference|`` over the vocabulary, over ``max |reference|`` of all rows."""
    return (ours.float() - reference.float()).abs().amax(dim=-1) / reference.float().abs().max()


@torch.inference_mode()
def oracle_agreement(model, prompt: torch.Tensor, tokens: list[int], **multimodal) -> float:
    """Fraction of ``tokens`` (a greedy continuation of ``prompt``) that are ``model``'s argmax at their step,
    teacher-forcing the continuation through ``model`` in one forward pass."""
    sequence = torch.cat([prompt, torch.tensor(tokens[:-1], device=prompt.device)])
    logits = model(input_ids=sequence[None], **multimodal).logits[0, prompt.shape[0] - 1 :]
    return float((logits.argmax(dim=-1) == torch.tensor(tokens, device=prompt.device)).float().mean())
