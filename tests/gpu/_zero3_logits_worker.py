"""Test-only worker for test_zero3_lora_save...: `lmstack train CFG` that also records the trained
model's logits on a fixed input at the end of training (computed through the DeepSpeed engine,
whose ZeRO-3 forward gathers the partitioned weights). Nothing of this is in the product."""

import sys

import torch
from transformers import TrainerCallback

import lmstack.train.common as common
from lmstack.cli.main import main

CFG, OUT = sys.argv[1], sys.argv[2]
IDS = torch.tensor([[5, 17, 99, 300, 2, 41, 7, 8]])


class DumpLogits(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.eval()
        with torch.no_grad():
            logits = model(IDS.to(args.device)).logits.float().cpu()
        if state.is_world_process_zero:
            torch.save({"input_ids": IDS, "logits": logits}, OUT)


_original = common.make_callbacks
common.make_callbacks = lambda cfg: [*_original(cfg), DumpLogits()]
sys.exit(main(["train", CFG]))
