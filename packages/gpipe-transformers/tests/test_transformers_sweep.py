"""Every causal LM family of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)
built tiny, pipelined over two partitions at four micro-batches on a padded batch: each is
exact (loss, gradients and logits equal the plain model's float64 labels loss within 1e-10,
or, where the family computes in float32 inside a float64 model, within a small multiple of
the plain model's own micro-batched gradients), or refused before anything runs for a reason
the docs list; none fails inside a step or returns another shape. Families whose plain model
does not build or run from its shrunk configuration are counted apart (not gpipe's)."""

from __future__ import annotations

import collections
import re

import pytest

from hf_support.sweep import Outcome, outcome

#: The refusals the docs list (the transformers page's "Families and refusals"), by the
#: start of their message.
REASONS = {
    "no layer list": r"no single ModuleList of \w+'s decoder layers",
    "not a sequence of its layers": r"\w+'s forward does not run as a sequence of its decoder",
    "not in pieces": r"\w+'s code around its decoder layers does not run in pieces",
}
#: The families exact with transformers 5.25 were 178 of 200 when this test was last
#: changed (173 of 196 with 5.24); a floor, so that a newer transformers' families count
#: too.
EXACT_AT_LEAST = 177


@pytest.mark.timeout(300)
def test_every_causal_lm_family_is_exact_or_refused_for_a_listed_reason() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    seen: dict[str, Outcome] = {name: outcome(name) for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    counts = collections.Counter(result.kind for result in seen.values())
    print(f"\n{len(seen)} families: {dict(sorted(counts.items()))}")
    for name, result in sorted(seen.items()):
        if result.kind != "exact":
            print(f"  {name}: {result.kind}: {result.detail[:200]}")
    wrong = {name: result.detail for name, result in seen.items() if result.kind == "wrong"}
    assert not wrong
    unlisted = {
        name: result.detail
        for name, result in seen.items()
        if result.kind == "refused"
        and not any(re.search(pattern, result.detail) for pattern in REASONS.values())
    }
    assert not unlisted
    assert counts["exact"] >= EXACT_AT_LEAST
    assert counts["exact"] + counts["refused"] + counts["plain fails"] == len(seen)
