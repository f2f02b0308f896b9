"""The checkpoint's own tokenizer: ``tiktoken.model`` (BPE ranks) + Kimi's pre-tokenizer + 256 specials.

``tiktoken.model`` holds one ``<base64 token> <rank>`` pair per line. Kimi checkpoints add 256 reserved
special tokens right after the BPE ranks (ids n_ranks .. n_ranks+255); their names come from
``tokenizer_config.json`` (``added_tokens_decoder``) when present, else ``[BOS]``, ``[EOS]``,
``<|reserved_token_i|>``. The pre-tokenizer keeps runs of Han characters as their own pieces, splits
Latin-style words with an optional leading punctuation/space character and English contractions,
digits in groups of up to three, punctuation runs, and whitespace.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

from ..errors import KimiQuantError

log = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
#: a BPE rank is an id: tiktoken keeps it in 32 bits
MAX_RANK = 2**31
NUM_SPECIAL = 256

# Letters other than Han, split into "upper-ish" and "lower-ish" classes (lookahead instead of class
# intersection so both the Rust engine in tiktoken and Python's `regex` accept it).
_NOT_HAN = r"(?!\p{Han})"
_UPPER = _NOT_HAN + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = _NOT_HAN + r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?(?:" + _UPPER + r")*(?:" + _LOWER + r")+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?(?:" + _UPPER + r")+(?:" + _LOWER + r")*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (``base64 rank`` per line)."""
    ranks: dict[bytes, int] = {}
    path = Path(path)
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            rank = int(rank)
            if not 0 <= rank < MAX_RANK:
                raise ValueError("rank out of range")
            ranks[base64.b64decode(tok, validate=True)] = rank
        except ValueError:
            raise KimiQuantError(f"{path}:{lineno}: not a '<base64 token> <rank>' line (rank: an integer from 0 "
                                 f"below {MAX_RANK})") from None
    if not ranks:
        raise KimiQuantError(f"{path}: holds no BPE ranks")
    if len(set(ranks.values())) != len(ranks):
        raise KimiQuantError(f"{path}: two tokens share a rank; a BPE file gives each token its own")
    return ranks


def write_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    lines = [base64.b64encode(t).decode() + " " + str(r) for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


def default_special_names(n: int = NUM_SPECIAL) -> list[str]:
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]
    return (names + [f"<|reserved_token_{i}|>" for i in range(len(names), n)])[:n]


class Tokenizer:
    """tiktoken-backed encoder with Kimi's specials; ``encode`` never emits specials from plain text."""

    def __init__(self, ranks: dict[bytes, int], special_names: list[str] | None = None, name: str = "kimi"):
        import tiktoken

        self.n_ranks = max(ranks.values()) + 1
        names = special_names or default_special_names()
        self.special = {s: self.n_ranks + i for i, s in enumerate(names)}
        self.enc = tiktoken.Encoding(name=name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.special)
        self.bos_id = self.special.get("[BOS]")
        self.eos_id = self.special.get("[EOS]")

    @property
    def vocab_size(self) -> int:
        return self.n_ranks + len(self.special)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer shipped in ``model_dir`` (source or ascendV1 output), or a one-line KimiQuantError."""
    d = Path(model_dir)
    path = d / TIKTOKEN_FILE
    if not path.is_file():
        raise KimiQuantError(f"{d}: no {TIKTOKEN_FILE} found (validation needs the checkpoint's own tiktoken "
                             f"tokenizer; Kimi repos ship one)")
    ranks = read_ranks(path)
    names = None
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        names = _special_names(tc, max(ranks.values()) + 1)
    return Tokenizer(ranks, names, name=d.name or "kimi")


def _special_names(tc: Path, n_ranks: int) -> list[str] | None:
    """The specials' names from ``tokenizer_config.json``'s ``added_tokens_decoder`` (None: the default
    names). Entries that are not a numeric id with a non-empty string content, or that repeat a name,
    are skipped; a file that is not a JSON object of that shape gives the defaults, with one warning."""
    try:
        added = json.loads(tc.read_bytes().decode("utf-8")).get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise ValueError("added_tokens_decoder is not an object")
    except (ValueError, AttributeError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError included
        why = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:80]
        log.warning("kimi-quant: warning: %s ignored (%s): the special tokens get their default names", tc, why)
        return None
    by_id: dict[int, str] = {}
    for k, v in added.items():
        content = v.get("content") if isinstance(v, dict) else None
        if k.isdigit() and isinstance(content, str) and content and content not in by_id.values():
            by_id[int(k)] = content
    if not by_id:
        return None
    names = [by_id.get(n_ranks + i) or f"<|reserved_token_{i}|>" for i in range(NUM_SPECIAL)]
    return names if len(set(names)) == len(names) else None


def tokenizer_config(n_ranks: int, names: list[str] | None = None) -> dict:
    """A tokenizer_config.json naming the specials (as Kimi repos do)."""
    names = names or default_special_names()
    return {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[EOS]",
        "model_max_length": 1048576,
        "added_tokens_decoder": {str(n_ranks + i): {"content": s, "special": True} for i, s in enumerate(names)},
    }


# ------------------------------------------------------------------------------------------------
# a small byte-level BPE trainer (for the tiny fixture's own tokenizer)
# ------------------------------------------------------------------------------------------------
def train_bpe(texts: list[str], n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE with the Kimi pre-tokenizer: 256 byte tokens + (n_ranks - 256) merges.

    Deterministic (ties broken by the smallest pair of token ids). Incremental pair counts keep
    it fast enough for a few hundred KB of text.
    """
    import heapq
    from collections import Counter, defaultdict

    import regex

    pat = regex.compile(KIMI_PATTERN)
    counts: Counter[bytes] = Counter()
    for t in texts:
        for piece in pat.findall(t):
            counts[piece.encode("utf-8")] += 1
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    words = [list(w) for w in counts]
    freq = list(counts.values())
    pairs: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += freq[wi]
            where[(a, b)].add(wi)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    seen = set(vocab)
    while len(seen) < n_ranks and heap:
        negc, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -negc or -negc <= 0:
            continue  # stale entry
        new = len(vocab)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        seen.add(vocab[-1])
        touched: set[tuple[int, int]] = set()
        for wi in list(where.pop(pair, ())):
            w, f = words[wi], freq[wi]
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] -= f
                touched.add((a, b))
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == pair[0] and w[j + 1] == pair[1]:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[wi] = out
            for a, b in zip(out, out[1:]):
                pairs[(a, b)] += f
                where[(a, b)].add(wi)
                touched.add((a, b))
        pairs.pop(pair, None)
        for p in touched:
            c = pairs.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pairs.pop(p, None)
    ranks: dict[bytes, int] = {}
    for tok in vocab:
        if tok not in ranks:
            ranks[tok] = len(ranks)
    return ranks
