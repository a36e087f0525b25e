"""``sparsync reproduce``: the corpus, the OmniReduce-style baseline, each section's tables and
verdicts from known rows, the CLI; one tiny end-to-end run of every section behind ``-m large``."""

from __future__ import annotations

import gzip
import math
from dataclasses import replace
from pathlib import Path

import _reproduce_workers as rw
import numpy as np
import pytest
import torch
from rich.console import Console

from sparsync import launch
from sparsync_bench import corpus as corpus_mod
from sparsync_bench import reproduce as rp
from sparsync_bench.cli import build_parser
from sparsync_bench.corpus import prepare_corpus, read_words
from sparsync_bench.lm import Corpus
from sparsync_bench.omnireduce import from_blocks, to_blocks

TEXT = "The cat sat. The cat ran!  A dog's bone \\A*buse\"\\ [1913 Webster]\nthe END"


# --- corpus ---------------------------------------------------------------------------------------------------
def test_read_words_lowercases_and_drops_dictionary_apparatus(tmp_path: Path) -> None:
    plain, packed = tmp_path / "t.txt", tmp_path / "t.txt.gz"
    plain.write_text(TEXT)
    with gzip.open(packed, "wt") as f:
        f.write(TEXT)
    want = ["the", "cat", "sat", "the", "cat", "ran", "a", "dog's", "bone", "the", "end"]
    assert read_words(plain) == want
    assert read_words(packed) == want


def test_prepare_corpus_ids_by_frequency_and_cache(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    c = prepare_corpus(src, 3, tmp_path / "ids.npy")
    ids = np.load(c.path)
    # "the" (3) -> 0, "cat" (2) -> 1, everything else -> the rest id 2
    assert ids.tolist() == [0, 1, 2, 0, 1, 2, 2, 2, 2, 0, 2]
    assert (c.words, c.types, c.vocab) == (11, 8, 3)
    assert c.oov == pytest.approx(6 / 11)
    again = prepare_corpus(src, 3, tmp_path / "ids.npy")  # from the cache
    assert again == c
    other = prepare_corpus(src, 4, tmp_path / "ids.npy")  # another vocab: re-tokenized
    assert other.vocab == 4 and np.load(other.path).max() == 3
    stream = Corpus(3, files=[c.path], seed=0)  # the LM benchmark reads the ids directly
    assert stream.stream is not None and stream.stream.tolist() == ids.tolist()
    assert Corpus(2, files=[c.path]).stream.max() == 1  # type: ignore[union-attr]  # ids past vocab share the last


def test_prepare_corpus_errors_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = tmp_path / "gcide.dict.dz"
    monkeypatch.setattr(corpus_mod, "GCIDE", absent)  # as on a machine without the package
    with pytest.raises(FileNotFoundError, match="apt-get install dict-gcide"):
        prepare_corpus(absent, 100, tmp_path / "x.npy")
    with pytest.raises(ValueError, match="vocab must be >= 2"):
        prepare_corpus(tmp_path / "x.txt", 1, tmp_path / "x.npy")
    (tmp_path / "one.txt").write_text("word")
    with pytest.raises(ValueError, match="fewer than 2 words"):
        prepare_corpus(tmp_path / "one.txt", 10, tmp_path / "one.npy")


def test_missing_corpus_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nothing\.txt not found"):
        prepare_corpus(tmp_path / "nothing.txt", 10, tmp_path / "x.npy")


# --- OmniReduce-style block-sparse allreduce -------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 64, 100, 300])
def test_blocks_round_trip(dim: int) -> None:
    g = rw.grad(0, 0.3, dim)
    blocks, per = to_blocks(g)
    assert per == max(1, 256 // dim) and blocks.shape == (math.ceil(rw.ROWS / per), per * dim)
    touched = torch.unique(g.coalesce().indices()[0])
    assert blocks._nnz() == torch.unique(touched // per).numel()  # only blocks with a touched row travel
    # to_blocks coalesces (sums repeated rows) in another order than to_dense: equal to rounding
    assert torch.allclose(from_blocks(blocks, per, g.shape).to_dense(), g.to_dense(), rtol=0, atol=1e-12)


def test_blocks_reject_what_is_not_row_sparse() -> None:
    with pytest.raises(ValueError, match="block must be >= 1"):
        to_blocks(rw.grad(0, 0.1, 4), 0)
    with pytest.raises(ValueError, match="one sparse dim"):
        to_blocks(torch.zeros(3, 3).to_sparse(2))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [1, 3, 5])
def test_omnireduce_equals_the_exact_sum(P: int) -> None:
    res = launch(rw.omnireduce_worker, nprocs=P, args=((0.0, 0.01, 0.3, 1.0), (64, 300)))
    for per_rank in zip(*res, strict=True):
        for r in per_rank:
            assert r["equal"], r
            assert r["rows"] == r["ref_rows"]  # rows of a block nobody touched are not in the result
        assert len({tuple(r["rows"]) for r in per_rank}) == 1
        if per_rank[0]["density"] == 0.0 or P == 1:
            continue
        assert all(r["bytes"] > 0 for r in per_rank)


# --- section tables from known rows --------------------------------------------------------------------------
def _ar_row(d: float, m: str, s: float, chosen: str = "") -> dict[str, object]:
    return {"density": d, "method": m, "median_s": s, "chosen": chosen, "world_size": 4}


def test_sparcml_markdown_tables_winners_and_claims() -> None:
    rows = [
        _ar_row(1e-3, "gloo_dense", 0.100), _ar_row(1e-3, "gloo_sparse_coo", 0.020),
        _ar_row(1e-3, "ssar_recursive_double", 0.004), _ar_row(1e-3, "ssar_split_allgather", 0.005),
        _ar_row(1e-3, "dsar_split_allgather", 0.050), _ar_row(1e-3, "auto", 0.004, "ssar_recursive_double"),
        _ar_row(1.0, "gloo_dense", 0.100), _ar_row(1.0, "gloo_sparse_coo", 0.900),
        _ar_row(1.0, "ssar_recursive_double", 0.400), _ar_row(1.0, "ssar_split_allgather", 0.300),
        _ar_row(1.0, "dsar_split_allgather", 0.120), _ar_row(1.0, "auto", 0.105, "dense"),
    ]  # fmt: skip
    md = rp.sparcml_markdown(rows, rp.QUICK, "loopback")
    assert "| 0.001 | 100.0 | 20.0 | 4.0 | 5.0 | 50.0 | 4.0 |" in md
    assert "density 0.001: fastest SparCML algorithm ssar_recursive_double (4.0 ms); auto chose" in md
    assert "density 1: fastest SparCML algorithm dsar_split_allgather (120.0 ms); auto chose dense" in md
    assert "at density 0.001: 0.10x" in md and "at density 1: 2.50x" in md
    assert "at density 1 auto takes 1.05x of gloo's dense allreduce" in md
    assert "density 0.001: torch COO / auto 5.00x, torch dense / auto 25.00x" in md


def test_s2_markdown_against_omnireduce() -> None:
    base = {"world_size": 4, "rows": 1000, "dim": 64, "tokens": 100, "zipf": 1.1, "k_mean": 50.0, "union": 150,
            "note": "", "sketch_rel_error": None}  # fmt: skip
    rows = [
        {**base, "method": "torch_coo", "median_s": 0.02, "bytes_sent_per_rank": 2e5},
        {**base, "method": "omnireduce", "median_s": 0.01, "bytes_sent_per_rank": 4e5},
        {**base, "method": "sketch@1", "median_s": 0.015, "bytes_sent_per_rank": 1e5, "sketch_rel_error": 1.5},
    ]
    md = rp.s2_markdown(rows)
    assert "| torch_coo | 20.0 | 0.20 | 0.50x | 2.00x | 0 (exact) |  |" in md
    assert "| sketch@1 | 15.0 | 0.10 | 0.25x | 1.50x | 1.50 |  |" in md
    assert "k = 50 rows per rank, union U = 150" in md


def test_dlrm_markdown_bytes_and_wall_clock_ratios() -> None:
    def row(m: str, s: float, b: float, loss: float) -> dict[str, object]:
        return {"method": m, "step_s": s, "bytes_per_step": b, "loss": loss, "loss_rel_diff": loss / 0.5 - 1,
                "speedup_vs_ddp_sparse": 0.1 / s}  # fmt: skip

    md = rp.dlrm_markdown([row("torch_ddp_dense", 0.5, 1e8, 0.5), row("torch_ddp_sparse", 0.1, 1e6, 0.5),
                           row("sparsync", 0.02, 1e6, 0.5), row("sparsync_dct", 0.05, 1e5, 0.5005)])  # fmt: skip
    assert "| sparsync_dct | 50.0 | 0.10 | 0.50050 | 0.100% | 2.00x |" in md
    assert "DCT-DP sends 1000.00x fewer bytes than torch_ddp_dense" in md
    assert "DCT-DP sends 10.00x fewer bytes than sparsync" in md
    assert "DCT-DP wall clock / uncompressed sparsync: 2.50x" in md


def test_lifespan_rows_recompute_less_as_l_grows() -> None:
    rows = rp.lifespan_rows(20_000, 8, (1, 1000))
    assert [r["lifespan"] for r in rows] == [1, 1000] and all(r["ms_per_call"] > 0 for r in rows)


def test_table3_formulas() -> None:
    wd, ws, P, a = 1000.0, 1e6, 4, 0.01
    assert rp.table3_bytes("allreduce", P, a, wd, ws) == pytest.approx(4 * (wd + ws) * 3 / 4)
    assert rp.table3_bytes("ddp_sparse", P, a, wd, ws) == pytest.approx(4 * wd * 3 / 4 + 2 * a * ws * 3)
    for m in ("ps", "ps_split", "hybrid"):
        assert rp.table3_bytes(m, P, a, wd, ws) == pytest.approx(4 * wd * 3 / 4 + 4 * a * ws * 3 / 4)
    assert rp.table3_bytes("hybrid_sketch", P, a, wd, ws) is None


def test_parallax_markdown_ordering_verdict() -> None:
    def row(m: str, wps: float) -> dict[str, object]:
        return {"method": m, "P": 4, "alpha": 0.01, "words_per_s": wps, "bytes_per_step_per_machine": 8e4,
                "loss": 5.0}  # fmt: skip

    good = [row("allreduce", 1), row("ddp_sparse", 2), row("ps", 3), row("ps_split", 4), row("hybrid", 5)]
    md = rp.parallax_markdown(good, 1000.0, 1e6)
    assert "AR 1 < PS 3 < OptPS 4 < HYB 5: **holds**" in md
    # Table 3: 4·1000·3/4 + 4·0.01·1e6·3/4 = 33,000 bytes against 80,000 measured
    assert "| hybrid | 5 | 2.50x | 0.08 | 0.03 | +142.4% | 5.0000 |" in md
    bad = [row("allreduce", 9), row("ps", 3), row("hybrid", 5)]
    assert "AR 9 < PS 3 < HYB 5: **does not hold** (without OptPS)" in rp.parallax_markdown(bad, 1000.0, 1e6)
    # no ordering is claimed over fewer than two measured methods
    for few in ([], [row("ddp_sparse", 2)], [row("hybrid", 5)]):
        md = rp.parallax_markdown(few, 1000.0, 1e6)
        assert "holds" not in md and "**not checked**" in md, md


def test_replicator_markdown_compares_curves() -> None:
    md = rp.replicator_markdown({"1 local replica": [2.0, 1.0], "2 local replicas": [2.0, 1.0 + 1e-6],
                                 "torchrun": [2.0]})  # fmt: skip
    assert "| 2 local replicas | 2 | 2.0000 | 1.0000 | 1.00e-06 |" in md
    assert "| torchrun | 1 | 2.0000 | 2.0000 | - |" in md  # a different length is shown, not compared


def test_root_is_the_checkout_with_the_examples_the_sections_run() -> None:
    assert (rp.ROOT / "examples" / "dlrm_hybrid.py").is_file()
    assert (rp.ROOT / "examples" / "replicator_digits_cnn.py").is_file()


def test_cli_parses_and_rejects_unknown_sections(tmp_path: Path) -> None:
    args = build_parser().parse_args(["reproduce", "--quick", "--sections", "s2,dct", "--out", str(tmp_path)])
    assert args.quick and args.sections == ("s2", "dct") and args.out == tmp_path
    with pytest.raises(SystemExit):
        build_parser().parse_args(["reproduce", "--sections", "sparcml,nope"])
    with pytest.raises(ValueError, match="unknown sections"):
        rp.run_reproduce(tmp_path, sections=("nope",))
    with pytest.raises(FileNotFoundError, match="needs a text corpus"):
        rp.run_reproduce(tmp_path, sections=("parallax",), corpus=tmp_path / "none.txt")


TINY = replace(
    rp.QUICK, name="tiny", ar_procs=3, ar_n=4096, ar_densities=(1e-2, 1.0), ar_repeats=1, emb_procs=3,
    emb_rows=5000, emb_tokens=256, emb_lambdas=(1.0,), emb_repeats=1, dlrm_procs=2, dlrm_steps=12, dlrm_batch=16,
    dlrm_rows=1000, dct_wall_procs=(2,), dct_wall_mlp="small", dct_wall_dim=16, lifespan_n=10000, lifespan_calls=5,
    dctmp=False, bias_seeds=20, lm_procs=2, lm_vocab=2000,
    lm_seq=5, lm_steps=4, lm_warmup=1, lm_dim=16, lm_hidden=16, lm_batch=4, replicas=(1, 2), torchrun_procs=2,
)  # fmt: skip


@pytest.mark.large
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_every_section_end_to_end_tiny(tmp_path: Path) -> None:
    corpus = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    corpus.write_text(" ".join(letters[i % 26] + letters[i // 26 % 26] for i in rng.zipf(1.3, 50_000) % 600))
    report = rp.run_reproduce(tmp_path / "r", scale=TINY, corpus=corpus)
    md = report.read_text()
    assert "failed" not in md, [line for line in md.splitlines() if "failed" in line]
    for title in ("## SparCML", "## S2 Reducer", "## DCT", "## Parallax", "## TF-Replicator"):
        assert title in md
    for png in ("sparcml.png", "s2_embedding.png", "parallax_lm.png", "replicator/curves.png"):
        assert (tmp_path / "r" / png).read_bytes()[:4] == b"\x89PNG"
    assert "| torchrun --nproc-per-node 2 | 120 |" in md
    assert "| torch DDP, torchrun --nproc-per-node 2 | 120 |" in md
    assert "Unbiasedness (S2 Thm. 1)" in md and "Table 4's ordering" in md


def test_sketch_bias_averages_out() -> None:
    b = rp.sketch_bias(rows=2000, dim=8, tokens=128, seeds=40)
    assert b["one_rel_error"] > 0.1  # collisions: the check is not trivial
    assert b["mean_rel_error"] < b["one_rel_error"] / 3  # ≈ 1/√40 of it when unbiased
    assert b["max_abs_z"] < 6 and "unbiased" in rp.s2._bias_text(b)


def test_lm_alpha_is_the_share_of_rows_a_step_touches(tmp_path: Path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1000, dtype=np.int64) % 50)  # 50 distinct words in the text
    a = rp.lm_alpha(ids, 1000, batch=4, seq=10, negatives=0)
    assert 0 < a <= 50 / 1000  # at most the 50 words the text holds
    assert rp.lm_alpha(ids, 1000, batch=4, seq=10, negatives=2000) > a  # negatives add rows


def test_parallax_ordering_on_dlrm_from_the_dct_rows() -> None:
    def row(m: str, s: float) -> dict[str, object]:
        return {"method": m, "step_s": s}

    rows = [row("torch_ddp_dense", 1.0), row("sparsync_ps", 0.5), row("sparsync_ps_split", 0.25),
            row("sparsync_hybrid", 0.2), row("sparsync", 0.1)]  # fmt: skip
    md = rp.parallax_dlrm_markdown(rows)
    assert "AR 1.00 < PS 2.00 < OptPS 4.00 < HYB 5.00: **holds** (beside them: sparsync 10.00)" in md
    assert "does not hold" in rp.parallax_dlrm_markdown([*rows[:3], row("sparsync_hybrid", 2.0)])
    assert rp.parallax_dlrm_markdown(rows[:2]) == ""  # a run without the PS methods says nothing


def test_replicator_commands_name_the_script_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way of running the digits script passes it once (torchrun once got it twice: argparse refused)."""
    seen: list[list[str]] = []

    def fake(cmd: list[str], path: Path, env: dict[str, str] | None = None) -> list[float]:
        seen.append(cmd)
        return [1.0]

    monkeypatch.setattr(rp.replicator, "_curve", fake)
    ctx = rp.Ctx(tmp_path, replace(TINY, replicas=(1, 2)), None, tmp_path / "c.txt", Console(quiet=True))
    curves = rp.replicator_curves(ctx)
    assert len(seen) == len(curves) == 4
    script = str(rp.ROOT / "examples" / "replicator_digits_cnn.py")
    for cmd in seen:
        assert cmd.count(script) == 1, cmd
    assert any("--nproc-per-node=2" in c and "--ddp" in c for c in seen)
