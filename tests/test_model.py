"""Models and contexts: metadata, vocabulary, chat template, zero-copy outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine.session import (
    Batch,
    Context,
    ContextConfig,
    InitError,
    InvalidArgumentError,
    Model,
    Runtime,
)
from tests.conftest import ModelCache
from tests.helpers import OneTokenRows


def test_metadata_and_vocab(models: ModelCache) -> None:
    m = models("llama")
    info = m.info
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 4, 64, 128256)
    assert info.metadata["general.architecture"] == "llama"
    assert info.file_size > 0 and info.n_params > 0
    assert info.eos in info.eog_tokens and m.is_eog(info.eos)
    eagle = models("llama-eagle3")
    assert eagle.info.facts.target_layers == [1, 2, 3]
    assert eagle.info.facts.target_hidden_size == 64
    q = models("qwen35-mtp", mtp=True)
    assert q.info.n_layer_nextn == 1 and q.info.is_hybrid


def test_tokenize_detokenize_and_pieces(models: ModelCache) -> None:
    m = models("llama")
    text = "Hello world, naïve café — 日本語"
    toks = m.tokenize(text)
    assert toks[0] == m.info.bos  # add_special
    assert m.detokenize(toks[1:]) == text
    assert b"".join(m.token_to_piece(t) for t in toks[1:]).decode() == text
    assert m.tokenize(text, add_special=False) == toks[1:]
    with pytest.raises(InvalidArgumentError):
        m.detokenize([m.n_vocab])
    with pytest.raises(InvalidArgumentError):
        m.token_to_piece(-1)


def test_chat_template(models: ModelCache) -> None:
    m = models("llama")
    text = m.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert "Be brief." in text and "Hi" in text
    assert text != m.apply_chat_template([{"role": "user", "content": "Hi"}], add_assistant=False)
    for bad in ([], [{"role": "user"}], [{"role": 1, "content": "x"}], ["hello"]):
        with pytest.raises(InvalidArgumentError):
            m.apply_chat_template(bad)  # type: ignore[arg-type]


def test_logits_and_embeddings_are_zero_copy_views(models: ModelCache) -> None:
    m = models("llama")
    ctx = Context.create(m, ContextConfig(n_ctx=256, n_seq=2, embeddings=True))
    b = Batch()
    b.add_sequence([10, 20, 30], 0, 0, logits="all")
    b.add_sequence([40, 50], 0, 1, logits="last")
    assert ctx.decode(b) == 4
    a, again = ctx.logits, ctx.logits
    assert a.shape == (4, m.n_vocab) and a.dtype == np.float32
    assert not a.flags.owndata and not a.flags.writeable
    assert a.__array_interface__["data"][0] == again.__array_interface__["data"][0]
    first = a[0].copy()
    emb = ctx.embeddings
    assert emb.shape == (4, m.info.n_embd) and not emb.flags.owndata
    # the same token at the same position in another sequence gives the same logits
    b2 = Batch()
    b2.add(10, 0, 1, True)
    ctx.kv_remove(1)
    ctx.decode(b2)
    np.testing.assert_allclose(ctx.logits[0], first, rtol=1e-3, atol=1e-3)
    ctx_no_emb = Context.create(m, ContextConfig(n_ctx=256))
    b3 = Batch()
    b3.add(10, 0, 0, True)
    ctx_no_emb.decode(b3)
    with pytest.raises(InvalidArgumentError, match="embeddings"):
        _ = ctx_no_emb.embeddings


def test_kv_bookkeeping(models: ModelCache) -> None:
    ctx = Context.create(models("llama"), ContextConfig(n_ctx=256, n_seq=2))
    assert ctx.seq_pos_max(0) == -1
    b = Batch()
    b.add_sequence(list(range(100, 110)), 0, 0, logits="none")
    ctx.decode(b)
    assert (ctx.seq_pos_min(0), ctx.seq_pos_max(0)) == (0, 9)
    assert ctx.kv_remove(0, 5, None)
    assert ctx.seq_pos_max(0) == 4
    assert ctx.kv_remove(None)
    assert ctx.seq_pos_max(0) == -1


def test_vocab_only_models_tokenize_but_cannot_back_a_context(
    runtime: Runtime, model_paths: dict[str, Path]
) -> None:
    m = Model.load(runtime, model_paths["llama"], vocab_only=True)
    assert m.tokenize("hi", add_special=False)
    with pytest.raises(InitError, match="vocab-only"):
        Context.create(m, ContextConfig(n_ctx=64))


def test_type_stubs_are_shipped() -> None:
    spec = importlib.util.find_spec("engine._nb_spec")
    assert spec is not None and spec.origin is not None
    folder = Path(spec.origin).parent
    stub = folder / "_nb_spec.pyi"
    assert stub.is_file() and "class SpecSession" in stub.read_text()
    assert (folder / "py.typed").is_file()


def test_many_sequences_in_one_batch_attend_only_to_their_own_cells(models: ModelCache) -> None:
    """A batch of 64+ rows from 16 sequences (llama.cpp's CPU flash attention then works in
    64-row tiles that span many sequences, see vendor/patches/0003): every sequence's logits
    equal those it gets decoded alone. Three times: rows only, rows beside a prompt chunk, and
    one row a sequence (fewer than 64 rows: the one-row kernel, which skips 64-cell blocks of
    other sequences' cells, see vendor/patches/0011)."""
    m = models("llama")
    n_seq, hist, rows = 16, 40, 4
    rng = np.random.default_rng(7)
    histories = [rng.integers(10, m.n_vocab, hist).tolist() for _ in range(n_seq)]
    steps = [rng.integers(10, m.n_vocab, rows).tolist() for _ in range(n_seq)]
    prompt = rng.integers(10, m.n_vocab, 70).tolist()

    def prefill(ctx: Context, seqs: range) -> None:
        for s in seqs:
            b = Batch()
            b.add_sequence(histories[s], 0, s, logits="none")
            ctx.decode(b)

    together = Context.create(
        m, ContextConfig(n_ctx=256 * (n_seq + 1), n_seq=n_seq + 1, n_batch=512, kv_unified=True)
    )
    prefill(together, range(n_seq))
    alone = Context.create(m, ContextConfig(n_ctx=256, n_seq=1))
    expected = []
    for s in range(n_seq):
        alone.kv_remove(None)
        b = Batch()
        b.add_sequence(histories[s] + steps[s], 0, 0, logits="none")
        b.logits[-rows:] = [True] * rows
        alone.decode(b)
        expected.append(alone.logits.copy())
    for with_prompt, each in ((False, rows), (True, rows), (False, 1)):
        b = Batch()
        for s in range(n_seq):
            for i, t in enumerate(steps[s][:each]):
                b.add(t, hist + i, s, True)
        if with_prompt:
            b.add_sequence(prompt, 0, n_seq, logits="none")
        assert (len(b) >= 64) == (each == rows)
        together.decode(b)
        got = together.logits.copy()
        for s in range(n_seq):
            # (alone, 44 tokens take the one-row kernel, which rounds Q to f16: ~5e-4 apart)
            mine, want = got[s * each : (s + 1) * each], expected[s][:each]
            np.testing.assert_allclose(mine, want, rtol=0, atol=2e-3 * np.abs(want).max())
            assert (mine.argmax(axis=1) == want.argmax(axis=1)).all()
        for s in range(n_seq):
            together.kv_remove(s, hist, None)
        together.kv_remove(n_seq)


def test_a_q8_0_target_gives_every_batch_size_the_same_logits(models: ModelCache) -> None:
    """llama.cpp's CPU kernel for Q8_0 (Q4_0, Q5_0) weights multiplies a batch's tokens in
    tiles of four, and vendor/patches/0007 computes a partial last tile in the same sweep
    over the weights as the whole ones: the logits of sequences decoded in batches of 5, 6,
    7, 17, 18 and 19 rows (a partial tile of 1, 2 and 3 rows) equal, bit for bit, those of
    the same sequences decoded four at a time."""
    n_seq = 20
    step = OneTokenRows(models("llama-q8"), n_seq, hist=12, seed=11)
    expected = np.concatenate([step(range(i, i + 4)) for i in range(0, n_seq, 4)])
    for n in (5, 6, 7, 17, 18, 19):
        np.testing.assert_array_equal(step(range(n)), expected[:n], err_msg=f"{n} rows")


def test_an_f32_target_gives_the_same_logits_on_one_thread_and_two(models: ModelCache) -> None:
    """llama.cpp's CPU kernel for F32 weights (llamafile's tinyBLAS) gives each thread one
    contiguous run of its jobs, blocks of the output (vendor/patches/0008; it drew them
    from a shared counter): every block is computed, each by the same instructions whichever
    thread takes it, so a prompt's logits with two threads equal, bit for bit, those with
    one (decoded beside one-token rows of other sequences: every matmul has several jobs
    per thread). Only the prompt's rows are compared: a one-token row attending to its
    sequence's cache may round differently with the thread count (1 of 8 rows here did,
    before the patch as after)."""
    m = models("llama")
    n_seq, hist = 8, 12
    rng = np.random.default_rng(5)
    histories = [rng.integers(10, m.n_vocab, hist).tolist() for _ in range(n_seq)]
    chunk = rng.integers(10, m.n_vocab, 40).tolist()

    def logits(threads: int) -> np.ndarray:
        cfg = ContextConfig(
            n_ctx=64 * (n_seq + 1), n_seq=n_seq + 1, n_batch=512, threads=threads, kv_unified=True
        )
        ctx = Context.create(m, cfg)
        b = Batch()
        for s in range(n_seq):
            b.add_sequence(histories[s], 0, s, logits="none")
        ctx.decode(b)
        b = Batch()
        for s in range(n_seq):
            b.add(histories[s][0], hist, s, True)
        b.add_sequence(chunk, 0, n_seq, logits="all")
        ctx.decode(b)
        return ctx.logits.copy()

    np.testing.assert_array_equal(logits(2)[n_seq:], logits(1)[n_seq:])


def test_a_hybrid_target_rolls_back_verifications_decoded_beside_prompt_chunks(models: ModelCache) -> None:
    """A recurrent/hybrid target (Qwen3.5) keeps rollback snapshots (``n_rs_seq``): a step
    that verifies drafts of different lengths beside a short prompt chunk, then rolls every
    verification back to its accepted tokens, continues exactly as if only the accepted
    tokens had been decoded. llama.cpp keeps each verification's rows in one ubatch, but not
    a prompt chunk's (vendor/patches/0006): the slice that one holds back costs a ubatch."""
    m = models("qwen35-mtp", mtp=True)
    n_seq, hist, k = 6, 12, 4
    rng = np.random.default_rng(11)
    histories = [rng.integers(10, m.n_vocab, hist).tolist() for _ in range(n_seq)]
    rows = [1 + s % (k + 1) for s in range(n_seq)]  # [last, drafts...]: 1..5 rows
    steps = [rng.integers(10, m.n_vocab, r).tolist() for r in rows]
    kept = [min(r, 1 + s % 2) for s, r in enumerate(rows)]  # rows that survive: up to 4 rolled back
    nxt = rng.integers(10, m.n_vocab, n_seq).tolist()
    prompt_seq, prompt = 3, rng.integers(10, m.n_vocab, 3).tolist()  # in the middle of the ids
    cfg = ContextConfig(n_ctx=64 * n_seq, n_seq=n_seq, n_batch=64, kv_unified=True)
    together = Context.create(m, cfg, n_rs_seq=k, n_outputs_max=n_seq * (k + 1), n_outputs_max_per_seq=k + 1)
    for s in range(n_seq):
        b = Batch()
        b.add_sequence(histories[s], 0, s, logits="none")
        together.decode(b)
    b = Batch()
    for s in range(n_seq):
        for i, t in enumerate(steps[s]):
            b.add(t, hist + i, s, True)
        if s == prompt_seq:
            b.add_sequence(prompt, hist + rows[s], s, logits="last")
    together.decode(b)
    for s in range(n_seq):
        n_decoded = rows[s] + (len(prompt) if s == prompt_seq else 0)
        if s != prompt_seq and kept[s] < rows[s]:
            assert together.kv_remove(s, hist + kept[s], None), s  # the rejected drafts
        else:
            kept[s] = n_decoded  # (a prompt chunk is never rolled back)
    b = Batch()
    for s in range(n_seq):
        b.add(nxt[s], hist + kept[s], s, True)
    together.decode(b)
    got = together.logits.copy()
    alone = Context.create(m, ContextConfig(n_ctx=64, n_seq=1))
    for s in range(n_seq):
        assert alone.kv_remove(0)
        accepted = (steps[s] + prompt)[: kept[s]] if s == prompt_seq else steps[s][: kept[s]]
        b = Batch()
        b.add_sequence(histories[s] + accepted + [nxt[s]], 0, 0, logits="last")
        alone.decode(b)
        exp = alone.logits[0]
        np.testing.assert_allclose(
            got[s], exp, rtol=0, atol=2e-3 * np.abs(exp).max(), err_msg=f"sequence {s}"
        )
