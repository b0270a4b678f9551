"""Sequence-level unlikelihood fine-tuning against the embedded model's repetition loops.

At temperature 0.2 most of the embedded model's continuations that fail to parse are loops:
the same line, or the same few words, again and again until the token budget ends (inside a
docstring, so the cut text does not parse). Welleck et al., "Neural Text Generation with
Unlikelihood Training" (ICLR 2020), fine-tune on the model's own continuations with a loss
that lowers the probability of each token that repeats an n-gram the continuation already
holds: ``-log(1 - p(token | context))`` at those positions, next to the usual next-token
loss on the training data.

Code repeats short n-grams on its own (``self.``, ``    return``), so the n-gram here is
long: in 400 functions of the stdlib training files, 0.8% of the tokens (over each
function's first 192) complete an 8-token n-gram the function already had, against 23% in
the shipped model's continuations that parse at temperature 0.2 and 55% in those that do
not (``docs/embedded_eval_run11.json``, run 11). The prompts are the function headers of the training
files (never the held-out validation files or the tuning packages), continued as
``scripts/eval_embedded.py`` continues its prompts, and only the function's own tokens count
(up to its first non-blank line at column 0, or the end-of-text token).

``scripts/train_embedded.py --unlikelihood-every K`` adds this loss to every K-th step.

Tried on run 11 (runs 12-15, README "Unlikelihood against the loops"): the repeats went, and
so did the parse rate (tune set at T 0.2: 59.5% -> 53.5% at weight 0.2, 28.4% at 1.0): the
model learnt to end the function at once, where no token counts any more. Not shipped.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F

_FUNCTION_END = re.compile(r"\n(?=\S)")  # a non-blank line at column 0 ends the function


def repeat_candidates(ids, n: int) -> np.ndarray:
    """``[len(ids)]`` bool: position ``t`` completes an ``n``-gram (``ids[t-n+1 : t+1]``)
    that ends at an earlier position of ``ids``."""
    ids = [int(i) for i in ids]
    out = np.zeros(len(ids), bool)
    seen = set()
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1 : t + 1])
        out[t] = gram in seen
        seen.add(gram)
    return out


def function_length(pieces, eot_text: str | None = None) -> int:
    """How many of the generated ``pieces`` (each token's decoded text, in order, right
    after a header that ends at its ``:``) belong to the function: those before the first
    end-of-text piece that start before the first non-blank line at column 0."""
    if eot_text is not None and eot_text in pieces:
        pieces = pieces[: pieces.index(eot_text)]
    end = _FUNCTION_END.search("".join(pieces))
    if end is None:
        return len(pieces)
    first_outside = end.start() + 1  # offset of the column-0 character
    offset = 0
    for i, piece in enumerate(pieces):
        if offset >= first_outside:
            return i
        offset += len(piece)
    return len(pieces)


def kept_lengths(tok, rows, eot_id: int) -> list[int]:
    """Per generated row (token ids), how many tokens belong to the function
    (:func:`function_length` over each token's text). The end-of-text token is decoded as
    itself: ``decode`` skips special tokens by default, which made it (and the padding
    ``generate`` writes after it, the same id) an empty piece that never ended the function."""
    eot_text = tok.decode([eot_id], skip_special_tokens=False)
    return [function_length([tok.decode([int(t)], skip_special_tokens=False) for t in row], eot_text) for row in rows]


@torch.no_grad()
def continuations(model, tok, headers, *, eot_id: int, max_new_tokens: int, temperature: float, generator,
                  device="cpu"):
    """Left-padded ``[B, P + G]`` prompt + continuation ids, the attention mask, and per row
    the number of prompt tokens and of generated tokens that belong to the function."""
    model.eval()
    prompts = [tok.encode(h).ids for h in headers]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eot_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    torch.manual_seed(seed)
    ids, mask = ids.to(device), mask.to(device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                         temperature=temperature, top_k=40, top_p=0.95, pad_token_id=eot_id, eos_token_id=eot_id)
    model.train()
    generated = out[:, width:]
    kept = kept_lengths(tok, generated.tolist(), eot_id)
    full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
    return out, full_mask, width, kept


def unlikelihood_loss(model, out, mask, width: int, kept, n: int):
    """``(loss, candidates, tokens)``: the mean of ``-log(1 - p)`` over the generated tokens
    (within the function) that repeat an ``n``-gram of their continuation, the number of
    such tokens and of generated tokens considered."""
    cand = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
    for b, k in enumerate(kept):
        rep = repeat_candidates(out[b, width : width + k].tolist(), n)
        cand[b, width : width + k] = torch.from_numpy(rep).to(out.device)
    tokens = int(sum(kept))
    if not cand.any():
        return None, 0, tokens
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=out[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1]).logits
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, out[:, 1:, None])[..., 0]
    picked = logp[cand[:, 1:]]
    # log(1 - p) from log p, kept finite as p -> 1
    one_minus = torch.log1p(-picked.exp().clamp(max=1 - 1e-5))
    return -one_minus.mean(), int(cand.sum()), tokens
