"""One window drafted through a ``DraftingSession`` when HF's assisted generation calls a drafter's ``generate``.

transformers' assisted loop calls ``assistant.generate(input_ids=<committed>, generation_config=<is_assistant>,
logits_processor=<the target's>, max_new_tokens=...)`` each round and reads the returned ``scores`` as the drafter
distributions ``q``. Drafters that HF cannot run as causal LMs (an EAGLE-3 head reading the target's features,
prompt lookup) get a ``generate`` that catches their session up on the committed ids and calls ``draft_window``:
the project's window rule (``PPOWWindowCriteria``, as every route applies it), sampling from the target's logits
processors' output exactly as HF's own assistant decoding does, and the online guard's bookkeeping. HF verifies
the window as usual, so the output is lossless.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..core.custom_generate.generate import PPOWWindowCriteria, _applied_temperature, guard_of, ppow_window_policy


def check_assistant_call(generation_config, input_ids, family: str) -> None:
    """Refuse a call that is not HF's assistant call (batch 1, ``is_assistant``), saying how to use the drafter."""
    if generation_config is None or not getattr(generation_config, "is_assistant", False):
        raise TypeError(f"A {family} drafter only drafts for its target: call target.generate(..., assistant_model="
                        "drafter) after ppow_trl.serving.assisted.load_assistant(folder, target=target) (or the family's "
                        "attach).")
    if input_ids.shape[0] != 1:
        raise ValueError(f"{family} assisted generation runs batch size 1.")


@torch.no_grad()
def draft_window(model, session, logits, input_ids, generation_config, logits_processor=None, max_new_tokens=None,
                 *, need_one: str = "", looked_up_before: int | None = None) -> GenerateDecoderOnlyOutput:
    """Draft one window after the committed ``input_ids`` (batch 1) from ``logits`` (the session's next-token logits
    after them, ``None`` when it cannot draft yet) under the policy in ``model``'s generation config; the session
    is rolled back to the committed tokens afterwards. ``need_one``: the message when no token could be drafted
    (HF's loop needs at least one candidate). ``looked_up_before``: the session's ``looked_up`` count before
    ``logits`` were computed (a hybrid's), so the guard charges no drafter step for the window's lookups."""
    sequence = input_ids[0].tolist()
    committed = len(sequence)
    policy = ppow_window_policy(model)
    do_sample = bool(getattr(generation_config, "do_sample", False))
    rule = PPOWWindowCriteria(policy["max_window"], policy["threshold"], policy["confidence_temperature"], do_sample,
                              _applied_temperature(generation_config, logits_processor, model) if do_sample else 1.0,
                              policy["vocab_size"])
    eos = generation_config.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    ids, scores = input_ids.to(model.device), []
    limit = max_new_tokens if max_new_tokens is not None else policy["max_window"]
    guard = guard_of(model)
    if guard is not None:
        guard.drafting_call(sequence)
    if looked_up_before is None:
        looked_up_before = getattr(session, "looked_up", 0)
    while logits is not None and len(scores) < limit:
        processed = logits_processor(ids, logits.float()) if logits_processor else logits.float()
        token = (torch.multinomial(torch.softmax(processed, -1), 1) if do_sample else processed.argmax(-1, keepdim=True))
        scores.append(processed)
        ids = torch.cat([ids, token], dim=-1)
        if bool(rule(ids, tuple(scores))[0]) or int(token) in eos or len(scores) == limit:
            break
        logits = session.step(token[0])
    session.rollback(committed)  # HF verifies the window; the session re-reads what it accepts next round
    if not scores:
        raise RuntimeError(need_one or "The drafter proposed no token; HF's assisted loop needs at least one.")
    if guard is not None:
        guard.drafted(committed, ids[0, committed:].tolist(), getattr(session, "looked_up", 0) - looked_up_before)
    return GenerateDecoderOnlyOutput(sequences=ids, scores=tuple(scores), cache=None)
