"""The benchmark's language model and data: a large sparse embedding (tied input/output, sampled softmax)
and a dense LSTM, fed Zipf-distributed tokens or the words of real text files."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sparsync.plan.detect import ParamStats
from sparsync.plan.planner import zipf_row_fraction


class SampledLM(nn.Module):
    """emb (vocab x dim, sparse gradient) -> LSTM (dim -> hidden) -> proj (hidden -> dim); logits against the
    embeddings of the step's targets plus shared negative samples (sampled softmax, as Parallax's LM). The
    embedding is called once per step, so a parameter server pulls each needed row once."""

    def __init__(self, vocab: int, dim: int, hidden: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim, sparse=True)
        nn.init.normal_(self.emb.weight, std=0.05)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, tokens: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
        inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        cand = torch.unique(torch.cat([tgt, negatives]))
        e = self.emb(torch.cat([inp.reshape(-1), cand]))
        B, T = inp.shape
        x = e[: B * T].reshape(B, T, -1)
        h = self.proj(self.lstm(x)[0]).reshape(B * T, -1)
        logits = h @ e[B * T :].T
        return nn.functional.cross_entropy(logits, torch.searchsorted(cand, tgt))


class Corpus:
    """Token stream: Zipf(s) over ``vocab`` ids, the words of text files (the ``vocab - 1`` most frequent
    words, the rest mapped to id vocab-1), or ``.npy`` token ids from ``sparsync_bench.corpus``."""

    def __init__(self, vocab: int, *, files: Sequence[Path] = (), zipf: float = 1.0, seed: int = 0) -> None:
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.stream: np.ndarray | None = None
        if files and all(Path(f).suffix == ".npy" for f in files):
            # token ids prepared by ``sparsync_bench.corpus.prepare_corpus``; ids past this vocab share the last
            self.stream = np.minimum(np.concatenate([np.load(f).astype(np.int64) for f in files]), vocab - 1)
            if self.stream.size < 2 or self.stream.min() < 0:
                raise ValueError(f"token files {list(map(str, files))}: need >= 2 non-negative ids")
        elif files:
            words: list[str] = []
            for f in files:
                words.extend(Path(f).read_text(errors="replace").split())
            if len(words) < 2:
                raise ValueError(f"text files {list(map(str, files))} hold fewer than 2 words")
            ids = {w: i for i, (w, _) in enumerate(Counter(words).most_common(vocab - 1))}
            self.stream = np.array([ids.get(w, vocab - 1) for w in words], dtype=np.int64)
        else:
            p = 1.0 / np.arange(1, vocab + 1, dtype=float) ** zipf
            self.cdf = np.cumsum(p / p.sum())

    def sample(self, n: int) -> np.ndarray:
        if self.stream is not None:
            start = int(self.rng.integers(0, max(1, self.stream.size - n)))
            out = self.stream[start : start + n]
            return np.resize(out, n)
        return np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), self.vocab - 1).astype(np.int64)

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        return torch.from_numpy(self.sample(batch * (seq + 1)).reshape(batch, seq + 1))

    def negatives(self, k: int) -> torch.Tensor:
        return torch.from_numpy(self.rng.integers(0, self.vocab, k))


def lm_stats(
    vocab: int, dim: int, hidden: int, tokens: int, procs_per_machine: int = 1, zipf: float = 1.0
) -> list[ParamStats]:
    """``SampledLM``'s parameters as the planner sees them (``sparsync plan --model lm``): a sparse embedding
    (vocab x dim, also the tied output layer) read by ``tokens`` Zipf tokens per worker per step, an LSTM
    (dim -> hidden) and a projection hidden -> dim."""
    a = zipf_row_fraction(vocab, tokens, zipf)
    am = zipf_row_fraction(vocab, tokens * procs_per_machine, zipf)
    return [
        ParamStats("emb.weight", (vocab, dim), a, True, am),
        ParamStats("lstm.weight_ih_l0", (4 * hidden, dim), 1.0, False),
        ParamStats("lstm.weight_hh_l0", (4 * hidden, hidden), 1.0, False),
        ParamStats("lstm.bias_ih_l0", (4 * hidden,), 1.0, False),
        ParamStats("lstm.bias_hh_l0", (4 * hidden,), 1.0, False),
        ParamStats("proj.weight", (dim, hidden), 1.0, False),
        ParamStats("proj.bias", (dim,), 1.0, False),
    ]
