"""The resolver: a training YAML to its run plan (runplan, decide, rules, auto), and the bridge
(from_config, lengths) that reads the config, model folder and data into the memory model's request
(`lmstack.memory`)."""
