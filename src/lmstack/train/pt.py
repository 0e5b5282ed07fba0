"""Stage pt: continued pre-training on plain text (and the prompt column of alpaca data).

Each text becomes its tokens + EOS, all trained. Packed (the pt default, `plan.packing`): a text
longer than cutoff_len is split into cutoff_len pieces (nothing dropped; train/stage_data.py), and
the pieces are bin-packed into rows exactly like sft packing: position ids restart per piece and
attention never crosses from one text into another (LLaMA-Factory's concatenate-and-cut lets them
see each other). With `packing: false` (or `streaming: true`) every text is one row, cut to
cutoff_len (counted as truncated). The same steps as sft; only the data differs, so pt reuses it.
tokenizer -> template -> data -> split + pack -> model -> adapter -> trainer -> train -> save.
"""

from __future__ import annotations

from lmstack.plan.runplan import RunPlan
from lmstack.train import sft


def run(plan: RunPlan) -> dict:
    return sft.run(plan)
