"""Data pipeline: sources, SentencePiece tokenizer, packing, resumable batch streams.

Entry point: `prepare_data(cfg.data, workdir) -> DataBundle(tokenizer, train, valid)`.
See `packing` for the batch layout and `streams` for determinism and resume.
"""

from hldstudy.data.packing import BATCH_KEYS, pack_first_fit, rows_to_batch
from hldstudy.data.pipeline import (
    DataBundle,
    bigram_conditional_entropy,
    encode_documents,
    make_batches,
    prepare_data,
    unigram_entropy,
)
from hldstudy.data.streams import BatchStream, RowsBatchStream, StreamingBatchStream
from hldstudy.data.synthetic import generate_documents, make_cloze, make_multiple_choice
from hldstudy.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "BATCH_KEYS", "BatchStream", "DataBundle", "RowsBatchStream", "StreamingBatchStream",
    "Tokenizer", "bigram_conditional_entropy", "encode_documents", "generate_documents",
    "make_batches", "make_cloze", "make_multiple_choice", "pack_first_fit", "prepare_data",
    "rows_to_batch", "train_tokenizer", "unigram_entropy",
]
