"""Which changes a resume accepts (output_dir.run_changes) and what a tokenized_path key compares
(saved.key_changes), on plain dicts as the checkpoint manifest stores them."""

from __future__ import annotations

from lmstack.config.schema import field_owner
from lmstack.data.saved import key_changes
from lmstack.reliability.run_changes import SAFE_TO_CHANGE, SAFE_TO_RAISE, run_changes


def run(**config) -> dict:
    base = {"learning_rate": 0.01, "max_steps": 10, "num_train_epochs": 3.0, "logging_steps": 1, "seed": 0}
    return {
        "config": {**base, **config},
        "decisions": {"world_size": 1, "micro_batch": 4, "checkpointing": False},
        "data": {"dataset:a/a.json": "11"},
    }


def test_every_safe_name_is_a_schema_field():
    assert (SAFE_TO_CHANGE | SAFE_TO_RAISE) <= set(field_owner())


def test_a_raised_length_and_a_new_cadence_are_safe_a_new_lr_is_not():
    unsafe, safe = run_changes(run(), run(max_steps=20, logging_steps=5, learning_rate=0.001))
    assert unsafe == ["learning_rate: 0.01 -> 0.001"]
    assert safe == ["logging_steps: 1 -> 5", "max_steps: 10 -> 20"]


def test_a_lowered_or_switched_length_is_not_safe():
    assert run_changes(run(), run(max_steps=5))[0] == ["max_steps: 10 -> 5 (only a raise resumes)"]
    assert run_changes(run(max_steps=-1), run(max_steps=5))[0] == [
        "max_steps: -1 -> 5 (only a raise resumes)"
    ]
    by_epochs = run(max_steps=-1)
    assert run_changes(by_epochs, run(max_steps=-1, num_train_epochs=4.0)) == (
        [],
        ["num_train_epochs: 3.0 -> 4.0"],
    )
    assert run_changes(by_epochs, run(max_steps=-1, num_train_epochs=2.0))[0] == [
        "num_train_epochs: 3.0 -> 2.0 (only a raise resumes)"
    ]
    assert run_changes(run(), run(num_train_epochs=1.0))[0] == []  # max_steps decides the length


def test_data_content_and_plan_decisions():
    new = run()
    new["data"] = {"dataset:a/a.json": "22"}
    new["decisions"] = {"world_size": 2, "micro_batch": 2, "checkpointing": True}
    unsafe, safe = run_changes(run(), new)
    assert unsafe == ["run plan micro_batch: 4 -> 2", 'data file dataset:a/a.json: "11" -> "22"']
    assert safe == ["run plan checkpointing: false -> true", "run plan world_size: 1 -> 2"]


def test_fields_newer_than_the_checkpoint_at_their_default_are_safe():
    old = run()
    del old["config"]["seed"]
    assert run_changes(old, run(seed=42)) == ([], ['seed: "(absent)" -> 42'])  # at its schema default
    assert run_changes(old, run(seed=7))[0] == ['seed: "(absent)" -> 7']
    trainer_without_plan = {**run(), "decisions": None}
    assert run_changes(trainer_without_plan, run()) == ([], [])


def test_tokenized_key_changes_name_the_dataset_and_ignore_the_lmstack_version():
    def key(cutoff: int, version: str, names: str = "a") -> dict:
        part = {
            "options": {"cutoff_len": cutoff},
            "lmstack": version,
            "code": version,
            "data": {"a.json": "1"},
        }
        return {"datasets": names, "dataset": {n: part for n in names.split(",")}, "seed": 0}

    assert key_changes(key(64, "1"), key(64, "2")) == (
        [],
        ["dataset a code: '1' -> '2'", "dataset a lmstack: '1' -> '2'"],
    )
    assert key_changes(key(64, "1"), key(32, "1"))[0] == ["dataset a options.cutoff_len: 64 -> 32"]
    assert key_changes(key(64, "1"), key(64, "1", "a,b"))[0] == [
        "datasets: 'a' -> 'a,b'",
        "dataset b: not in the saved data",
    ]
