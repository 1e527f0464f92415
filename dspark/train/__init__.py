"""Drafter training (`dspark train-draft`): data from the target itself, the DSpark objective,
a resumable CPU training loop and export to the speculators format.

Nothing outside this package imports it; it builds on the engine's model, drafter and loader code
so that a trained drafter sees exactly the inputs inference gives it.

    prompts.py / topics.py   prompt sources available on every machine (no downloads)
    data.py                  target responses -> token shards with loss masks; reading them back
    loss.py                  anchor sampling, block layout, the loss terms and diagnostics
    features.py              the frozen target's aux hidden states and teacher logits
    forward.py               one training forward through the drafter's inference modules
    trainer.py               TrainConfig, Trainer (loop, eval, checkpoints, export)
    plot.py                  training curves from the JSONL log
    cli.py                   add_train_args / run_train for the `train-draft` subcommand
"""
