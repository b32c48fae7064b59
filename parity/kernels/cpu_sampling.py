"""The sampler's Gumbel-max draw on CPU, batch-invariant: span by span (`sampling.HASH_SPAN` tokens of
the flat [N, V] grid, in cache), u from the exact hash (`sampling.HashSpans`), then the noise's two
float64 logs in place over aligned pieces (`cpu.pointwise_`), so every element goes through the vector
body. Exact and correctly rounded ops (the hash, negation, the score sum, the maxima) run over whole
spans and may split across threads anywhere. The draw keeps one span's values and each row's best so
far, not the [N, V] float64 noise (12 MB of fresh pages a step at 32 x 49k).
"""

from __future__ import annotations

import math

import torch

from parity.kernels.cpu import POINTWISE_ALIGN, log_softmax, pointwise_, scratch
from parity.kernels.sampling import HASH_SPAN, HashSpans, log_softmax_then_draw


class _Spans(HashSpans):
    """`HashSpans` over the flat [N, vocab] grid padded to POINTWISE_ALIGN: spans start at multiples of
    HASH_SPAN (of POINTWISE_ALIGN) and the grid ends aligned, so each span is a `pointwise_` buffer."""

    def __init__(self, state: torch.Tensor, vocab: int) -> None:
        super().__init__(state, vocab)
        self.total = state.shape[0] * vocab
        self.padded = self.total + (-self.total) % POINTWISE_ALIGN

    def starts(self) -> range:
        return range(0, self.padded, HASH_SPAN)

    def values(self, out: torch.Tensor, start: int, scores: torch.Tensor | None) -> torch.Tensor:
        """The noise of the span at `start` into out [L] float64, or its flat `scores` + noise."""
        pointwise_(torch._foreach_log_, self.uniform_(out, start)).neg_()
        pointwise_(torch._foreach_log_, out)
        if scores is None or start >= self.total:
            return out.neg_()
        # score - log(-log(u)) is score + noise bit for bit: x - y is x + (-y), and + commutes;
        # float32 -> float64 first, exact (a float32 - float64 op takes a slow mixed-type loop)
        own = out[:min(out.numel(), self.total - start)]
        wide = self.spare[:own.numel()].copy_(scores[start:start + own.numel()])
        torch.sub(wide, own, out=own)
        return out


def gumbel_noise(state: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] float64, -log(-log(u)); row i depends on state[i] only."""
    spans = _Spans(state, vocab)
    flat = torch.empty(spans.padded, dtype=torch.float64)
    for start in spans.starts():
        spans.values(flat[start:start + HASH_SPAN], start, None)
    return flat[:spans.total].view(state.shape[0], vocab)


def _row_parts(start: int, stop: int, vocab: int) -> list[tuple[int, int, int, int]]:
    """The flat range [start, stop) of a row-major [N, vocab] grid as blocks (first row, rows, first
    column, columns): a partial first row, the whole rows, a partial last row."""
    parts = []
    while start < stop:
        row, column = divmod(start, vocab)
        if column or stop - start < vocab:
            parts.append((row, 1, column, min(vocab - column, stop - start)))
        else:
            parts.append((row, (stop - start) // vocab, 0, vocab))
        start += parts[-1][1] * parts[-1][3]
    return parts


def _first_max(values: list[float], columns: list[int], rows: list[int], n: int) -> torch.Tensor:
    """Per row, the column of its first largest candidate, NaN the largest as in `argmax` -> [n]
    int64; the candidates come in increasing (row, column) order."""
    best = [(-math.inf, 0)] * n  # a row of -inf alone: its first column, 0, as argmax gives
    for value, column, row in zip(values, columns, rows):
        top = best[row][0]
        if top == top and (value > top or value != value):  # once NaN, a row's best stays
            best[row] = (value, column)
    return torch.tensor([column for _, column in best], dtype=torch.int64)


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores [N, V] + `gumbel_noise`) per row -> [N] int64, ties to the lower id; rows not
    `noisy` (greedy) add no noise. Each span's row blocks give their first maxima (`Tensor.max`: ties
    to the lower index, NaN largest, as `argmax`), combined per row in column order.
    """
    if not bool(noisy.any()):
        return scores.argmax(dim=-1)
    n, vocab = scores.shape
    spans = _Spans(state, vocab)
    flat_scores = scores.reshape(-1)
    buffer, _ = scratch("span values", (HASH_SPAN,), scores.device, dtype=torch.float64)
    maxima, positions, rows = [], [], []
    for start in spans.starts():
        out = buffer[:min(HASH_SPAN, spans.padded - start)]
        spans.values(out, start, flat_scores)
        for row, count, column, width in _row_parts(start, min(start + out.numel(), spans.total), vocab):
            offset = row * vocab + column - start
            top, where = out[offset:offset + count * width].view(count, width).max(dim=-1)
            maxima.append(top)
            positions.append(where + column)
            rows.extend(range(row, row + count))
    drawn = _first_max(torch.cat(maxima).tolist(), torch.cat(positions).tolist(), rows, n)
    if bool(noisy.all()):
        return drawn
    # A greedy row's argmax over float64(score) + 0 is its argmax over the scores: the same order,
    # equal values (-0.0 and +0.0 too) stay equal and go to the lower id, NaN first.
    return torch.where(noisy, drawn, scores.argmax(dim=-1))


def log_softmax_draw(logits: torch.Tensor, state: torch.Tensor,
                     noisy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's fused draw is the two kernels: `cpu.log_softmax` of the float32 logits [N, V], then
    `gumbel_argmax`; tokens [N] and their log-probs [N]."""
    return log_softmax_then_draw(logits, state, noisy, log_softmax, gumbel_argmax)
