"""A real word-level text corpus for the language-model benchmarks, available offline from a
package registry: GCIDE, the GNU Collaborative International Dictionary of English (Debian package
``dict-gcide``: 40 MB of English definitions and quotations, 4.8M words, 216k word types). Any other text
file works the same way (``prepare_corpus(path, ...)``).

The text is turned into token ids once and cached as ``.npy`` (id = frequency rank among the ``vocab - 1``
most frequent words, ``vocab - 1`` for the rest), so P ranks do not each re-tokenize 40 MB;
``sparsync_bench.lm.Corpus`` reads such a file directly.
"""

from __future__ import annotations

import gzip
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GCIDE = Path("/usr/share/dictd/gcide.dict.dz")  # dictzip = gzip with an index: gzip reads it
GCIDE_PACKAGE = "dict-gcide"
# Dictionary apparatus that is not running text: source tags ("[1913 Webster]") and pronunciations (\A*buse"\).
_APPARATUS = re.compile(r"\[(?:1913 Webster|WordNet 1\.5|PJC|Webster 1913 Suppl\.)\]|\\[^\\\n]*\\")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@dataclass(frozen=True)
class PreparedCorpus:
    path: Path  # the .npy of token ids
    source: str
    words: int  # tokens in the stream
    types: int  # distinct words in the source
    vocab: int  # ids in use: the vocab - 1 most frequent words + one id for the rest
    oov: float  # share of tokens mapped to the rest id


def read_words(path: Path) -> list[str]:
    """Lower-cased words of a text file (gzip/dictzip when it ends in .gz or .dz)."""
    opener = gzip.open if path.suffix in (".gz", ".dz") else open
    with opener(path, "rt", errors="replace") as f:
        text = f.read()
    return _WORD.findall(_APPARATUS.sub(" ", text).lower())


def prepare_corpus(source: Path, vocab: int, out: Path) -> PreparedCorpus:
    """Tokenize ``source`` into ``out`` (.npy of int64 ids, see the module doc); reuses ``out`` when it exists
    and is newer than ``source``."""
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    if not source.is_file():
        hint = f" (install it: apt-get install {GCIDE_PACKAGE})" if source == GCIDE else ""
        raise FileNotFoundError(f"corpus {source} not found{hint}")
    meta = out.with_suffix(".meta.npy")
    if out.is_file() and meta.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        m = np.load(meta)
        if int(m[2]) == vocab:
            ids = np.load(out, mmap_mode="r")
            return PreparedCorpus(out, str(source), int(ids.size), int(m[0]), vocab, int(m[1]) / ids.size)
    words = read_words(source)
    if len(words) < 2:
        raise ValueError(f"corpus {source} holds fewer than 2 words")
    counts = Counter(words)
    index = {w: i for i, (w, _) in enumerate(counts.most_common(vocab - 1))}
    ids = np.fromiter((index.get(w, vocab - 1) for w in words), dtype=np.int64, count=len(words))
    n_oov = int(np.count_nonzero(ids == vocab - 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, ids)
    np.save(meta, np.array([len(counts), n_oov, vocab], dtype=np.int64))
    return PreparedCorpus(out, str(source), int(ids.size), len(counts), vocab, n_oov / ids.size)
