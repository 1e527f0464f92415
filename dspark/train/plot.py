"""Training curves from the JSONL log: loss, per-slot acceptance, τ and throughput in one PNG."""

from __future__ import annotations

import json
import os


def read_log(path: str) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) in file order."""
    train, evals = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                (evals if record.get("type") == "eval" else train).append(record)
    return train, evals


def plot_training(log_path: str, png_path: str | None = None) -> str:
    """Write the curves next to the log (or to `png_path`); returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_log(log_path)
    if not train:
        raise ValueError(f"{log_path} holds no training records yet")
    png_path = png_path or os.path.join(os.path.dirname(log_path) or ".", "training_curves.png")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _loss_panel(axes[0, 0], train, evals)
    _accept_panel(axes[0, 1], evals or train, "held-out" if evals else "train")
    _tau_panel(axes[1, 0], train, evals)
    _speed_panel(axes[1, 1], train)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _xs(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def _loss_panel(ax, train: list[dict], evals: list[dict]) -> None:
    ax.plot(_xs(train), [r["loss"] for r in train], label="train loss", alpha=0.7)
    if evals:
        ax.plot(_xs(evals), [r["loss"] for r in evals], "o-", label="held-out loss")
        ax.plot(_xs(evals), [r["l1"] for r in evals], "--", label="held-out L1 (2·TV)")
    ax.set_xlabel("step")
    ax.set_title("loss = 0.1 CE + 0.9 L1 + BCE")
    ax.legend()
    ax.grid(alpha=0.3)


def _accept_panel(ax, records: list[dict], which: str) -> None:
    gamma = len(records[0]["accept"])
    for k in range(gamma):
        ax.plot(_xs(records), [r["accept"][k] for r in records], label=f"slot {k + 1}")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.set_title(f"{which} acceptance estimate 1 - TV per draft slot")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)


def _tau_panel(ax, train: list[dict], evals: list[dict]) -> None:
    ax.plot(_xs(train), [r["tau"] for r in train], label="train τ (T=1)", alpha=0.6)
    if evals:
        ax.plot(_xs(evals), [r["tau"] for r in evals], "o-", label="held-out τ (T=1)")
        ax.plot(_xs(evals), [r["tau_greedy"] for r in evals], "s-", label="held-out τ (argmax match)")
    ax.set_xlabel("step")
    ax.set_title("τ = 1 + Σ_k Π_{j≤k} acc_j")
    ax.legend()
    ax.grid(alpha=0.3)


def _speed_panel(ax, train: list[dict]) -> None:
    ax.plot(_xs(train), [r["tok_s"] for r in train], color="tab:green", label="target tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput and learning rate")
    twin = ax.twinx()
    twin.plot(_xs(train), [r["lr"] for r in train], color="tab:red", alpha=0.6, label="lr")
    twin.set_ylabel("lr")
    ax.grid(alpha=0.3)
