"""lm-eval adapter: `HLDStudyLM`, registered with lm-eval as model type `hldstudy`.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from hldstudy import rundir
from hldstudy.errors import InputError
from hldstudy.eval import packing
from hldstudy.eval.head import target_logprobs
from hldstudy.family import family_of
from hldstudy.model.attention import BranchSegments
from hldstudy.model.loading import load_model
from hldstudy.numerics import softcap

MIN_BUCKET = 32
# Scored positions per head call: the head's weight (Gemma's: 671 MB) is read once per
# call whatever its rows, so the scored positions of several batches are packed into
# one call (no per-row padding); 128 x Gemma's 262k vocabulary stays one matmul.
HEAD_ROWS = 128
# Fewest scored positions per row the scorer pads to (lm-eval continuations are short).
MIN_SCORED = 8
# Default model length for imported checkpoints (Gemma 3 allows 32k; the study's
# evaluations and CPU memory for [B, T, T] masks do not need more); max_length= overrides.
IMPORT_MAX_LENGTH = 2048


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """{model, tokenizer, max_length, add_bos, config, kind} for a run dir or an import."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"--checkpoint {path} does not exist")
    loaded = load_model(path)
    model, cfg = loaded.model, loaded.config
    if loaded.tokenizer is None:
        if cfg is not None:
            looked = " and ".join(str(p) for p in rundir.tokenizer_candidates(path, cfg))
            raise InputError(f"{path}: checkpoint has no tokenizer (looked for {looked}); copy "
                             "the run's SentencePiece model there")
        raise InputError(f"{path}: checkpoint has no tokenizer (no tokenizer.model next to the "
                         "weights / no tokenizer metadata in the GGUF file)")
    if cfg is not None:
        return {"model": model, "tokenizer": loaded.tokenizer, "config": cfg, "kind": "run",
                "max_length": min(cfg.data.seq_len, cfg.model.max_seq_len),
                "add_bos": bool(cfg.data.add_bos)}
    return {"model": model, "tokenizer": loaded.tokenizer, "config": None, "kind": "import",
            "max_length": min(int(model.cfg.max_seq_len), IMPORT_MAX_LENGTH), "add_bos": True}


# --------------------------------------------------------------------------- #
# Jitted scoring
# --------------------------------------------------------------------------- #


def length_buckets(max_length: int, min_bucket: int = MIN_BUCKET) -> list[int]:
    """Padded lengths the scorer compiles for: 2^k and 3 * 2^(k-1) (at most a third of
    a row is padding) from min_bucket below max_length, and max_length itself."""
    out, b = [], min_bucket
    while b < max_length:
        out.append(b)
        if b * 3 // 2 < max_length:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_length)
    return out


def scored_buckets(max_length: int) -> list[int]:
    """Numbers of scored positions per row the scorer compiles for: powers of two from
    MIN_SCORED below max_length, and max_length itself."""
    out, k = [], MIN_SCORED
    while k < max_length:
        out.append(k)
        k *= 2
    out.append(max_length)
    return out


def _bucket(length: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if length <= b), None)


# Module-level jits with the graph definition static: every model of one
# architecture shares the compiled scorers (one compile per padded shape per
# process, whatever the number of checkpoints).
def _lm_head(m) -> tuple[jax.Array, bool]:
    """The LM head and whether it is vocabulary-major: a tied embedding as stored [V, D]
    (no transposed copy per call), else the head's own [D, V]."""
    if m.cfg.tie_embeddings:
        return m.embedding[...], True
    return m.head_weight(), False


@partial(jax.jit, static_argnums=0)
def _score(graphdef, state, tokens, targets, positions, segment_ids):
    """(log p(target), target == argmax) at every position, [B, T] each (corpus perplexity)."""
    m = nnx.merge(graphdef, state)
    h = m(tokens, positions, segment_ids, return_logits=False).final_hidden
    b, t, d = h.shape
    w, vocab_major = _lm_head(m)
    logp, greedy = target_logprobs(h.reshape(b * t, d), w, targets.reshape(-1),
                                   cap=m.cfg.final_softcap, vocab_major=vocab_major)
    return logp.reshape(b, t), greedy.reshape(b, t)


@partial(jax.jit, static_argnums=0)
def _hidden_at(graphdef, state, tokens_BxT, index_BxK, positions_BxT=None, segments=None):
    """The final hidden states at input positions index [B, K] only: [B, K, D]
    (`segments`: the rows' `BranchSegments`, or None for plain sequences)."""
    m = nnx.merge(graphdef, state)
    h = m(tokens_BxT, positions_BxT, segments, return_logits=False).final_hidden
    return jnp.take_along_axis(h, index_BxK[:, :, None], axis=1)


@partial(jax.jit, static_argnums=0)
def _head_at(graphdef, state, h_RxD, targets_R):
    """(log p(target), target == argmax) of HEAD_ROWS gathered rows: one head call (the
    weight read once) for the scored positions of several batches."""
    m = nnx.merge(graphdef, state)
    w, vocab_major = _lm_head(m)
    return target_logprobs(h_RxD, w, targets_R, cap=m.cfg.final_softcap,
                           vocab_major=vocab_major)


@partial(jax.jit, static_argnums=0)
def _next_token(graphdef, state, tokens, last):
    """Greedy next token after position last[b] of each row."""
    m = nnx.merge(graphdef, state)
    h = m(tokens, return_logits=False).final_hidden
    h_last = h[jnp.arange(h.shape[0]), last]
    z = softcap(jnp.einsum("nd,dv->nv", h_last, m.head_weight().astype(h_last.dtype),
                           preferred_element_type=jnp.float32), m.cfg.final_softcap)
    return jnp.argmax(z, axis=-1)


def compiled_scorers() -> int:
    """How many (architecture, padded shape) loglikelihood scorers this process has compiled."""
    return (int(_score._cache_size()) + int(_hidden_at._cache_size())
            + int(_head_at._cache_size()))


class Scorer:
    """Per-token target log-probs and greedy flags for padded [B, L] batches."""

    def __init__(self, model, *, batch_size: int, max_length: int, pad_id: int = 0):
        if batch_size <= 0:
            raise InputError(f"--batch-size must be > 0, got {batch_size}")
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.pad_id = int(pad_id)
        self.vocab_size = int(model.cfg.vocab_size)
        self.buckets = length_buckets(self.max_length)
        self.scored = scored_buckets(self.max_length)
        graphdef, state = nnx.split(model)
        self._graphdef, self._state = graphdef, state
        # Shared contexts are scored as branches of one row where every layer is attention
        # (a recurrent layer cannot keep branches apart), rows within the sliding window.
        cfg = model.cfg
        window = cfg.sliding_window if cfg.sliding_window else self.max_length
        self.branch_limit = 0 if family_of(cfg).has_linear_attention else \
            min(self.max_length, window)

    def bucket(self, length: int) -> int:
        b = _bucket(length, self.buckets)
        if b is None:
            raise InputError(f"a sequence of {length} tokens exceeds the model length "
                             f"{self.max_length}")
        return b

    def score_batch(self, tokens: np.ndarray, targets: np.ndarray,
                    positions: np.ndarray | None = None,
                    segment_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(log p(target), greedy) at every position of a [B, T] batch."""
        b, t = tokens.shape
        if positions is None:
            positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
        if segment_ids is None:
            segment_ids = np.ones((b, t), np.int32)
        logp, greedy = _score(self._graphdef, self._state, jnp.asarray(tokens, jnp.int32),
                              jnp.asarray(targets, jnp.int32), jnp.asarray(positions, jnp.int32),
                              jnp.asarray(segment_ids, jnp.int32))
        return np.asarray(logp), np.asarray(greedy)

    def share_prefixes(self, rows: list[tuple[list[int], int]]) -> list[list[int]]:
        """`packing.prefix_groups` at this scorer's most scored positions per row."""
        return packing.prefix_groups(rows, self.scored[-1])

    def pack(self, rows: list[tuple[list[int], int]]) -> list[packing.Packed]:
        """The model rows of `rows`: shared contexts as branches where the model can mask
        them apart (attention layers only), else shared prefixes."""
        if self.branch_limit:
            return packing.branch_rows(rows, limit=self.branch_limit,
                                       max_scored=self.scored[-1])
        return packing.prefix_rows(rows, self.scored[-1])

    def score_rows(self, rows: list[tuple[list[int], int]], *, progress: bool = False,
                   desc: str = "loglikelihood") -> list[tuple[float, bool]]:
        """rows: (tokens, n) — score the last n tokens of `tokens` given the ones before.

        Returns (sum of log-probs, all greedy) per row, in input order. Rows are laid
        into model rows (`pack`), sorted longest first and batched within one length
        bucket; each batch's final hidden states are gathered at its scored positions,
        and those of several batches go through the head together, HEAD_ROWS at a time
        (`_head_at`).
        """
        for toks, n in rows:
            if not 1 <= n < len(toks) or len(toks) - 1 > self.max_length:
                raise ValueError(f"bad row: {len(toks)} tokens, score {n}")
        packed = sorted(self.pack(rows), key=lambda p: -len(p.tokens))
        first = packing.slots(rows)
        logp = np.zeros(sum(n for _, n in rows))
        greedy = np.zeros(len(logp), bool)
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (h, targets, where)
        B = self.batch_size
        bar = tqdm(total=len(rows), desc=desc, disable=not progress, leave=False)
        i = 0
        while i < len(packed):
            L = self.bucket(len(packed[i].tokens))
            # Only rows of this bucket share the batch (rows are sorted by length).
            batch = [p for p in packed[i:i + B] if self.bucket(len(p.tokens)) == L]
            K = _bucket(max(len(p.index) for p in batch), self.scored)
            tokens = np.full((B, L), self.pad_id, np.int32)
            positions = np.zeros((B, L), np.int32)
            bits = np.zeros((B, L), np.int32)
            index = np.zeros((B, K), np.int32)
            take = []  # the scored (row, slot)s of the batch, in order
            for r, p in enumerate(batch):
                tokens[r, :len(p.tokens)] = p.tokens
                positions[r, :len(p.tokens)] = p.positions
                if p.bits is not None:
                    bits[r, :len(p.tokens)] = p.bits
                index[r, :len(p.index)] = p.index
                take += [r * K + c for c in range(len(p.index))]
            segments = BranchSegments(jnp.asarray(bits)) if self.branch_limit else None
            h = np.asarray(_hidden_at(self._graphdef, self._state, jnp.asarray(tokens),
                                      jnp.asarray(index), jnp.asarray(positions), segments))
            pending.append((h.reshape(B * K, -1)[take],
                            np.asarray([t for p in batch for t in p.targets], np.int32),
                            np.asarray([w for p in batch for w in p.where])))
            if sum(len(p[1]) for p in pending) >= HEAD_ROWS:
                pending = self._head(pending, logp, greedy, final=False)
            i += len(batch)
            bar.update(sum(p.requests for p in batch))
        if pending:
            self._head(pending, logp, greedy, final=True)
        bar.close()
        first.append(len(logp))
        return [(float(logp[first[j]:first[j + 1]].sum()), bool(greedy[first[j]:first[j + 1]].all()))
                for j in range(len(rows))]

    def _head(self, pending, logp: np.ndarray, greedy: np.ndarray, final: bool) -> list:
        """The head over the pending scored positions, HEAD_ROWS per call, written into
        `logp` / `greedy` at their places; returns what is left for the next call (less
        than HEAD_ROWS rows), or, `final`, nothing (the last call padded with zero rows to a
        power of two)."""
        h = np.concatenate([p[0] for p in pending])
        targets = np.concatenate([p[1] for p in pending])
        where = np.concatenate([p[2] for p in pending])
        done = len(targets) if final else len(targets) // HEAD_ROWS * HEAD_ROWS
        for s in range(0, done, HEAD_ROWS):
            n = min(HEAD_ROWS, len(targets) - s)
            # The last call of a pass: padded to a power of two from 16, not to HEAD_ROWS
            # (its padding rows cost what scored rows do; at most 4 shapes compile).
            rows = HEAD_ROWS if n == HEAD_ROWS else min(HEAD_ROWS, max(16, 1 << (n - 1).bit_length()))
            h_R = np.zeros((rows, h.shape[1]), h.dtype)
            t_R = np.zeros(rows, np.int32)
            h_R[:n], t_R[:n] = h[s:s + n], targets[s:s + n]
            lp, gr = _head_at(self._graphdef, self._state, jnp.asarray(h_R), jnp.asarray(t_R))
            logp[where[s:s + n]] = np.asarray(lp, np.float64)[:n]
            greedy[where[s:s + n]] = np.asarray(gr)[:n]
        return [(h[done:], targets[done:], where[done:])] if done < len(targets) else []

    def next_tokens(self, tokens: np.ndarray, last: np.ndarray) -> np.ndarray:
        return np.asarray(_next_token(self._graphdef, self._state, jnp.asarray(tokens, jnp.int32),
                                     jnp.asarray(last, jnp.int32)))


# --------------------------------------------------------------------------- #
# The lm-eval model
# --------------------------------------------------------------------------- #


@register_model("hldstudy")
class HLDStudyLM(LM):
    """lm-eval model over an hldstudy Transformer.

    Build from a checkpoint (`HLDStudyLM(checkpoint=DIR)`, or lm-eval's
    `--model hldstudy --model_args checkpoint=DIR,batch_size=8`) or from
    objects (`HLDStudyLM(model=..., tokenizer=..., max_length=...)`).
    """

    def __init__(self, checkpoint: str | Path | None = None, *, model=None, tokenizer=None,
                 max_length: int | None = None, batch_size: int | str = 8,
                 add_bos: bool | None = None, rolling_context: int | None = None,
                 max_gen_toks: int = 256, progress: bool = True, **unused):
        super().__init__()
        ignored = set(unused) - {"device", "max_batch_size", "dtype", "trust_remote_code"}
        if ignored:
            warnings.warn(f"HLDStudyLM ignores model_args {sorted(ignored)}", stacklevel=2)
        info: dict[str, Any] = {"config": None, "kind": "objects", "add_bos": False,
                                "max_length": None}
        if checkpoint is not None:
            info = load_checkpoint(checkpoint)
            model, tokenizer = info["model"], info["tokenizer"]
        if model is None or tokenizer is None:
            raise InputError("HLDStudyLM needs checkpoint=DIR, or model= and tokenizer=")
        self.model = model
        self.tokenizer = tokenizer
        self.config = info["config"]
        self.kind = info["kind"]
        limit = int(model.cfg.max_seq_len)
        self.max_length = int(max_length or info["max_length"] or limit)
        if self.max_length > limit:
            raise InputError(f"max_length={self.max_length} exceeds model.max_seq_len={limit}")
        self.add_bos = bool(info["add_bos"] if add_bos is None else add_bos)
        self.rolling_context = int(rolling_context or max(1, self.max_length // 2))
        if not 1 <= self.rolling_context <= self.max_length:
            raise InputError(f"rolling_context={self.rolling_context} must be in "
                             f"1..max_length={self.max_length}")
        self.max_gen_toks = int(max_gen_toks)
        self.progress = bool(progress)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.scorer = Scorer(model, batch_size=self.batch_size, max_length=self.max_length,
                             pad_id=tokenizer.pad_id)
        self._warned_sampling = False

    # -- tokenization ------------------------------------------------------ #
    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.add_bos else self.tokenizer.eos_id

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def encode_context(self, context: str) -> list[int]:
        ids = list(self.tokenizer.encode(context)) if context else []
        if self.add_bos or not ids:
            ids = [self.prefix_token_id] + ids
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) the lm-eval way (see the module docstring)."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        ctx_ids = self.encode_context(context)
        cont_ids: list[int] | None = None
        if context:
            raw_ctx = list(self.tokenizer.encode(context))
            whole = list(self.tokenizer.encode(context + continuation))
            if len(whole) > len(raw_ctx) and whole[:len(raw_ctx)] == raw_ctx:
                cont_ids = whole[len(raw_ctx):]
        if cont_ids is None:
            cont_ids = list(self.tokenizer.encode(continuation))
        return ctx_ids, cont_ids

    def _row(self, ctx_ids: list[int], cont_ids: list[int]) -> tuple[list[int], int]:
        if not cont_ids:
            raise InputError("loglikelihood: the continuation encodes to zero tokens")
        if len(cont_ids) > self.max_length:
            raise InputError(f"loglikelihood: a continuation of {len(cont_ids)} tokens does not "
                             f"fit the model length {self.max_length}; score long texts with "
                             "loglikelihood_rolling")
        # Left-truncate the context: at most max_length inputs.
        full = (ctx_ids + cont_ids)[-(self.max_length + 1):]
        return full, len(cont_ids)

    # -- lm-eval API ------------------------------------------------------- #
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows = [self._row(*self.encode_pair(*req.args)) for req in requests]
        out = self.scorer.score_rows(rows, progress=self.progress and not disable_tqdm)
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        return self.scorer.score_rows([self._row(c, x) for c, x in pairs], progress=False)

    def rolling_windows(self, ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) token windows covering `ids` once (see module docstring)."""
        if not ids:
            return []
        return [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=list(ids), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=self.rolling_context)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args[:1]
            ids = list(self.tokenizer.encode(text))
            if self.add_bos and ids[:1] == [self.tokenizer.bos_id]:
                ids = ids[1:]
            for ctx, cont in self.rolling_windows(ids):
                rows.append((list(ctx) + list(cont), len(cont)))
                owner.append(k)
        scores = self.scorer.score_rows(rows, progress=self.progress and not disable_tqdm,
                                        desc="loglikelihood_rolling")
        out = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, scores, strict=True):
            out[k] += lp
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        parsed = []
        for i, req in enumerate(requests):
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if (kwargs.get("do_sample") or float(kwargs.get("temperature", 0) or 0) > 0) \
                    and not self._warned_sampling:
                warnings.warn("hldstudy generate_until decodes greedily; sampling arguments "
                              "are ignored", stacklevel=2)
                self._warned_sampling = True
            max_gen = max(1, min(max_gen, self.max_length - 1))
            ids = self.encode_context(context)[-(self.max_length - max_gen):]
            parsed.append((ids, tuple(until), max_gen))
            groups.setdefault((tuple(until), max_gen), []).append(i)
        bar = tqdm(total=len(requests), desc="generate_until",
                   disable=not self.progress or disable_tqdm, leave=False)
        for (until, max_gen), idx in groups.items():
            idx = sorted(idx, key=lambda i: -len(parsed[i][0]))
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                texts = self._generate([parsed[i][0] for i in chunk], list(until), max_gen)
                for i, t in zip(chunk, texts, strict=True):
                    out[i] = t
                    self.cache_hook.add_partial("generate_until", requests[i].args, t)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    def _generate(self, contexts: list[list[int]], until: list[str], max_gen: int) -> list[str]:
        """Greedy decoding of a batch: re-runs the padded forward per new token (no KV cache)."""
        B = self.batch_size
        n = len(contexts)
        seqs = [list(c) for c in contexts]
        gen: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        texts = [""] * n
        eos = self.tokenizer.eos_id
        for _ in range(max_gen):
            active = [j for j in range(n) if not done[j]]
            if not active:
                break
            L = self.scorer.bucket(max(len(seqs[j]) for j in active))
            tokens = np.full((B, L), self.tokenizer.pad_id, np.int32)
            last = np.zeros(B, np.int32)
            for r, j in enumerate(active):
                tokens[r, :len(seqs[j])] = seqs[j]
                last[r] = len(seqs[j]) - 1
            nxt = self.scorer.next_tokens(tokens, last)
            for r, j in enumerate(active):
                t = int(nxt[r])
                if t == eos:
                    done[j] = True
                    continue
                seqs[j].append(t)
                gen[j].append(t)
                texts[j] = self.tokenizer.decode(gen[j])
                if any(u and u in texts[j] for u in until) or len(seqs[j]) >= self.max_length:
                    done[j] = True
        out = []
        for text in texts:
            cut = len(text)
            for u in until:
                if u:
                    k = text.find(u)
                    if k != -1:
                        cut = min(cut, k)
            out.append(text[:cut])
        return out

    # lm-eval calls these on some code paths.
    @property
    def tokenizer_name(self) -> str:
        return "hldstudy-sentencepiece"

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens)


def token_perplexity(total_logprob: float, n_tokens: int) -> float:
    return math.exp(-total_logprob / max(n_tokens, 1))
