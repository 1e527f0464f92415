"""Drafter training (`dspark train-draft`): data from the target itself, the DSpark objective,
a resumable CPU training loop and export to the speculators format.

Nothing outside this package imports it; it builds on the engine's model, drafter and loader code
so that a trained drafter sees exactly the inputs inference gives it.

    prompts.py / topics.py   prompt sources available on every machine (no downloads)
    self_prompts.py          user turns, conversations and coding requests the target writes itself
    packages.py              installed third-party packages: their functions and their prose
    doc_prompts.py           chat requests about installed packages' prose
    ood.py                   the out-of-distribution evaluation set (assets/ood_prompts.jsonl)
    data.py                  target responses -> token shards with loss masks; reading them back
    loss.py                  anchor sampling, block layout, the loss terms and diagnostics
    features.py              the frozen target's aux hidden states and teacher logits
    forward.py               one training forward through the drafter's inference modules
    trainer.py               TrainConfig, Trainer (loop, eval, checkpoints, export)
    export.py                the speculators-format writer (config.json + model.safetensors)
    schedule.py              warmup-stable-decay (or cosine) learning rate, kept across resumes
    prune_vocab.py           reduced draft vocabularies: chosen, coverage, pruned drafters
    step_timing.py           seconds per training step and supervised slots per second
    plot.py                  training curves from the JSONL log
    cli.py                   add_train_args / run_train for the `train-draft` subcommand
"""
