"""Stage sft: supervised fine-tuning. tokenizer -> template -> data -> model -> adapter -> train -> save
(-> predict with do_predict; do_train: false with do_predict only predicts)."""

from __future__ import annotations

from lmstack.data.mm import media_spec
from lmstack.data.mm_av_collate import media_collator
from lmstack.data.packing import pack_dataset
from lmstack.models.adapters import setup_finetuning
from lmstack.models.kernels import apply_training_kernels
from lmstack.models.load import apply_speedups, load_model
from lmstack.models.vision import load_image_processor, save_processor_files
from lmstack.plan.runplan import RunPlan
from lmstack.train import common, predict
from lmstack.train.collators import PackedCollator
from lmstack.train.stage_data import stage_datasets


def run(plan: RunPlan) -> dict:
    cfg = plan.cfg
    if not cfg.training.do_train and cfg.training.do_predict:  # prediction alone (LF's nlg_eval example)
        return predict.run_predict_only(plan)
    resume = common.start_run(plan)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = stage_datasets(plan, tokenizer, template)  # fails here, before the model loads, on bad data
    if plan.stage.data != "text":  # pt's saved tokenizer keeps its own chat template, as before
        common.save_template_in_tokenizer(tokenizer, template)
    train_set, eval_set = data.train, data.eval
    collator = common.PadCollator(tokenizer.pad_token_id)
    if plan.packing:  # whole samples in rows, position ids restart, no cross-sample attention
        train_set, eval_set = (
            pack_dataset(train_set, plan.pack_spec()),
            pack_dataset(eval_set, plan.pack_spec(True)),
        )
        collator = PackedCollator(tokenizer.pad_token_id, width=plan.row_capacity)
    media = media_spec(cfg)  # a vision model: the batch's images too
    if media is not None:  # images, videos, audio: the model's processors per batch
        collator = media_collator(cfg, tokenizer, media, load_image_processor)

    args = common.training_arguments(plan)  # before the model: under ZeRO-3 it loads already sharded
    model = load_model(plan.model_spec(), tokenizer)
    apply_training_kernels(plan.loss_kernel, model)  # fused linear CE: no [tokens x vocab] logits in training
    common.enable_gradient_checkpointing(plan, model)
    model = setup_finetuning(cfg, model, lora_kernel=plan.lora_kernel)
    model = apply_speedups(plan.speedup_spec(), model)  # FP8 GEMMs, regional compile (plan.fp8 / compile)

    trainer = common.build_trainer(plan, model, tokenizer, train_set, eval_set, collator, args)
    metrics = common.train_and_save(plan, trainer, resume)
    if media is not None and trainer.is_world_process_zero():
        save_processor_files(cfg.model.model_name_or_path, cfg.training.output_dir)
    if cfg.training.do_predict:  # generated_predictions.jsonl + predict_results.json
        metrics.update(predict.predict(plan, trainer.model, tokenizer, template))
    return metrics
