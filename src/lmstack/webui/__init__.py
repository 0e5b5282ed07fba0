"""`lmstack webui`: the browser UI (Gradio, the `webui` extra).

fields      the schema as form fields (kinds, choices, defaults, help) and form <-> flat YAML
catalog     datasets of dataset_info.json with record counts, built-in templates
runs        runs tracked on disk by output_dir (run.json, train.log, exit_code), progress from
            trainer_log.jsonl; `child` keeps one `lmstack train` process and records its exit code
actions     preview data (`lmstack check`), plan (`lmstack plan`), export, the chat model
i18n        English / Chinese words (locales/)
ui, train_tab, runs_tab, chat_tab, app   the Gradio layout and wiring (only these import gradio)
"""
