"""Click-prediction metrics: log loss and exact ROC AUC, in torch only.

These are what DLRM papers and MLPerf report, so a training run on recc can be judged against
them. AUC is computed exactly (Mann-Whitney rank statistic with tied scores sharing their mean
rank) rather than by binning, so small evaluation sets in tests give the true value.
"""

from __future__ import annotations

import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to("cpu", torch.float64)


def log_loss(pred: torch.Tensor, y: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``pred`` (clamped to [eps, 1-eps]) against 0/1 ``y``."""
    p, t = _flat(pred).clamp(eps, 1.0 - eps), _flat(y)
    return float(-(t * p.log() + (1.0 - t) * (-p).log1p()).mean())


def auc(pred: torch.Tensor, y: torch.Tensor) -> float:
    """Exact ROC AUC of scores ``pred`` for 0/1 labels ``y`` (1-D or [B, 1]); ties count half.

    NaN when ``y`` holds a single class, where AUC is undefined.
    """
    p, t = _flat(pred), _flat(y) > 0.5
    n_pos = int(t.sum())
    n_neg = t.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_p, order = torch.sort(p)
    _, counts = torch.unique_consecutive(sorted_p, return_counts=True)
    # 1-based ranks; a group of tied scores takes the mean of the ranks it spans.
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1.0) / 2.0
    ranks = torch.repeat_interleave(mean_rank, counts)
    pos_rank_sum = float(ranks[t[order]].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


class Metrics:
    """Accumulates predictions and labels over batches; ``compute()`` scores all of them at once."""

    def __init__(self):
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def update(self, pred: torch.Tensor, y: torch.Tensor) -> None:
        self._preds.append(_flat(pred))
        self._labels.append(_flat(y))

    def compute(self) -> dict[str, float]:
        """``{"log_loss": ..., "auc": ...}`` over everything passed to ``update``."""
        if not self._preds:
            raise ValueError("Metrics.compute() called before any update()")
        pred, y = torch.cat(self._preds), torch.cat(self._labels)
        return {"log_loss": log_loss(pred, y), "auc": auc(pred, y)}

    def reset(self) -> None:
        self._preds.clear()
        self._labels.clear()
