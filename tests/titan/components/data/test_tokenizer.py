"""Tokenizers: the official Llama 3 vocabulary and the corpus-trained BPE."""

import pytest

from titan.components.data import BPETokenizer, Llama3Tokenizer, build_tokenizer
from titan.config import JobConfig

TEXT = "Ada Lovelace wrote the first program in 1843 — for Babbage's Analytical Engine. Ünïcödé ✓"


@pytest.fixture(scope="module")
def llama3():
    return Llama3Tokenizer()


def test_llama3_known_ids(llama3):
    assert llama3.vocab_size == 128256
    assert llama3.encode("Hello world") == [9906, 1917]
    assert (llama3.bos_id, llama3.eos_id) == (128000, 128001)


def test_llama3_round_trip_with_specials(llama3):
    ids = llama3.encode(TEXT, bos=True, eos=True)
    assert ids[0] == llama3.bos_id and ids[-1] == llama3.eos_id
    assert llama3.decode(ids[1:-1]) == TEXT


def test_corpus_bpe_round_trip_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document number {i} about trains and ships"}}\n' for i in range(200)))
    cfg = JobConfig()
    cfg.training.dataset_path = str(docs)
    cfg.model.bpe_vocab_size = 300
    tok = build_tokenizer(cfg)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
    assert tok.decode(tok.encode(TEXT, bos=True, eos=True)) == TEXT
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1
    assert build_tokenizer(cfg).encode(TEXT) == tok.encode(TEXT)


def test_auto_tokenizer_follows_flavor():
    cfg = JobConfig()
    cfg.model.flavor = "8B"
    assert isinstance(build_tokenizer(cfg), Llama3Tokenizer)
