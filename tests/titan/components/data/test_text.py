"""Packed and streamed text loaders: next-token labels, one global order split by rank, exact resume on any layout."""

import json

import numpy as np
import pytest
import torch

from titan.components.data import PackedTextLoader, StreamingTextLoader, build_text_dataloader, build_tokenizer
from titan.components.data.text import load_documents, split_documents
from titan.config import JobConfig
from titan.tools.cli import UserError


def make_loader(tokens, dp_rank=0, dp_degree=1, batch=2, seq_len=8, shuffle=True):
    return PackedTextLoader(tokens, seq_len=seq_len, local_batch_size=batch, dp_rank=dp_rank, dp_degree=dp_degree,
                            seed=3, shuffle=shuffle, infinite=True)


TOKENS = np.arange(1000, dtype=np.int32)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def eval_labels_are_inputs_shifted_by_one():
    for inputs, labels in take(make_loader(TOKENS), 3):
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        assert torch.equal(labels - inputs, torch.ones_like(inputs))


def test_ranks_split_the_same_global_batches():
    # One process accumulating 2 micro-batches sees exactly what 2 ranks see in one step.
    single = take(make_loader(TOKENS, batch=2), 4)
    rank0 = take(make_loader(TOKENS, 0, 2, batch=2), 2)
    rank1 = take(make_loader(TOKENS, 1, 2, batch=2), 2)
    for step in range(2):
        together = torch.cat([single[2 * step][0], single[2 * step + 1][0]])
        assert torch.equal(together, torch.cat([rank0[step][0], rank1[step][0]]))


def test_epoch_covers_every_block_once_then_reshuffles():
    loader = make_loader(TOKENS, batch=1)
    n = loader.num_blocks
    firsts = [int(x[0, 0]) // 8 for x, _ in take(loader, 2 * n)]
    assert sorted(firsts[:n]) == list(range(n))
    assert sorted(firsts[n:]) == list(range(n)) and firsts[n:] != firsts[:n]


def test_resume_on_another_layout_continues_with_the_next_block():
    uninterrupted = take(make_loader(TOKENS, batch=2), 6)
    first = make_loader(TOKENS, 0, 1, batch=2)
    take(first, 2)
    state = first.state_dict()
    ranks = [make_loader(TOKENS, r, 2, batch=1) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    step = [next(iter(loader))[0] for loader in ranks]
    assert torch.equal(torch.cat(step), uninterrupted[2][0])


def test_resume_refuses_another_seq_len():
    with pytest.raises(ValueError, match="same training.seq_len"):
        make_loader(TOKENS, seq_len=16).load_state_dict(make_loader(TOKENS, seq_len=8).state_dict())


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one round"):
        make_loader(np.arange(20, dtype=np.int32), dp_degree=4, batch=2)


def test_validation_split_is_disjoint_and_fixed():
    docs = [f"doc {i}" for i in range(100)]
    train, val = split_documents(docs, 0.1, "train"), split_documents(docs, 0.1, "validation")
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 100
    assert val == split_documents(docs, 0.1, "validation")


@pytest.mark.parametrize("suffix", ["jsonl", "json", "txt", "parquet"])
def test_local_files_of_each_type(tmp_path, suffix):
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(5)]
    if suffix == "txt":
        for i, t in enumerate(texts):
            (tmp_path / f"{i}.txt").write_text(t)
    elif suffix == "parquet":
        import datasets

        datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "d.parquet"))
    elif suffix == "json":
        (tmp_path / "d.json").write_text(json.dumps([{"body": t} for t in texts]))
    else:
        (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    cfg = JobConfig()
    cfg.training.dataset_path = str(tmp_path)
    cfg.training.text_field = "body"
    assert sorted(load_documents(cfg.training)) == sorted(texts)


def test_missing_data_path():
    cfg = JobConfig()
    cfg.training.dataset_path = "/nonexistent/corpus"
    with pytest.raises(UserError, match="does not exist"):
        load_documents(cfg.training)


def test_empty_data_folder(tmp_path):
    cfg = JobConfig()
    cfg.training.dataset_path = str(tmp_path)
    with pytest.raises(UserError, match="holds no .json"):
        load_documents(cfg.training)


def test_empty_documents(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "  "}\n{"text": ""}\n')
    cfg = JobConfig()
    cfg.training.dataset_path = str(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="no non-empty documents"):
        load_documents(cfg.training)


@pytest.mark.parametrize("name, content, message", [
    ("d.jsonl", b"", "{path} is empty; remove it or fill it with documents"),
    ("d.json", b"\n \n", "{path} is empty; remove it or fill it with documents"),
    ("d.jsonl", b"\x89PNG\r\n\x1a\n" + bytes(8), "{path} is not JSON lines (line 1: 'utf-8' codec can't decode"),
    ("d.jsonl", b'{"text": "a"}\n\nnot json\n', None),  # only the first line is read: datasets names the rest
    ("d.jsonl", b'\n\n{"text": "a"\n', "{path} is not JSON lines (line 3: "),
])
def test_an_empty_or_binary_json_file_is_named(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    cfg = JobConfig()
    cfg.training.dataset_path = str(tmp_path)
    with pytest.raises(UserError) as info:
        load_documents(cfg.training)
    if message:
        assert str(info.value).startswith("training.dataset_path: " + message.format(path=path))
    else:
        assert "cannot read" in str(info.value)


def test_wrong_text_field(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "hello"}\n')
    cfg = JobConfig()
    cfg.training.dataset_path = str(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="set --training.text_field"):
        load_documents(cfg.training)


def test_bundled_corpus_loader_end_to_end():
    cfg = JobConfig()
    cfg.training.seq_len = 64
    tok = build_tokenizer(cfg)
    loader = build_text_dataloader(cfg, 0, 1, tok, "train")
    inputs, labels = next(iter(loader))
    assert inputs.shape == (cfg.training.local_batch_size, 64) and inputs.dtype == torch.int64
    assert int(inputs.max()) < tok.vocab_size
    assert (inputs == tok.eos_id).any() or (inputs == tok.bos_id).any()
    assert loader.num_blocks > 10_000


def local_stream(tmp_path, n_docs=40):
    import datasets

    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps({"text": f"streamed document {i} " * (i % 5 + 1)}) + "\n"
                            for i in range(n_docs)))
    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


class CharTokenizer:
    bos_id, eos_id, vocab_size = 1, 2, 300

    def encode(self, text, bos=False, eos=False):
        return [self.bos_id] * bos + [ord(c) for c in text] + [self.eos_id] * eos


def test_streaming_loader_packs_the_whole_stream_in_order(tmp_path):
    tok = CharTokenizer()
    loader = StreamingTextLoader(local_stream(tmp_path), tok, "text", seq_len=16, local_batch_size=2,
                                 dp_rank=0, dp_degree=1)
    expected = [t for i in range(40) for t in tok.encode(f"streamed document {i} " * (i % 5 + 1), True, True)]
    got = []
    for inputs, labels in loader:
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        got.extend(inputs.flatten().tolist())
    assert got == expected[: len(got)] and len(expected) - len(got) <= 2 * 16 + 1


def streaming(tmp_path, dp_rank=0, dp_degree=1, batch=2):
    return StreamingTextLoader(local_stream(tmp_path), CharTokenizer(), "text", 16, batch, dp_rank, dp_degree)


def test_streaming_loader_resumes_with_the_next_block(tmp_path):
    full = [x for x, _ in streaming(tmp_path)]
    first = streaming(tmp_path)
    take(first, 3)
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())  # checkpointed as plain integers, nothing pickled
    resumed = streaming(tmp_path)
    resumed.load_state_dict(state)
    rest = [x for x, _ in resumed]
    assert len(rest) == len(full) - 3 >= 2
    for a, b in zip(rest, full[3:]):
        assert torch.equal(a, b)


def test_streaming_ranks_split_the_same_global_batches(tmp_path):
    single = take(streaming(tmp_path, batch=2), 4)
    ranks = [take(streaming(tmp_path, r, 2, batch=2), 2) for r in range(2)]
    for step in range(2):
        together = torch.cat([single[2 * step][0], single[2 * step + 1][0]])
        assert torch.equal(together, torch.cat([ranks[0][step][0], ranks[1][step][0]]))


def test_streaming_resume_on_another_layout_continues_with_the_next_block(tmp_path):
    uninterrupted = take(streaming(tmp_path, batch=2), 6)
    first = streaming(tmp_path, batch=2)
    take(first, 3)
    ranks = [streaming(tmp_path, r, 2, batch=1) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(first.state_dict())
    steps = [take(loader, 2) for loader in ranks]
    for step in range(2):
        assert torch.equal(torch.cat([steps[0][step][0], steps[1][step][0]]), uninterrupted[3 + step][0])


def test_streaming_resume_refuses_another_seq_len(tmp_path):
    other = StreamingTextLoader(local_stream(tmp_path), CharTokenizer(), "text", 8, 2, 0, 1)
    with pytest.raises(ValueError, match="same training.seq_len"):
        other.load_state_dict(streaming(tmp_path).state_dict())
