"""Deterministic generator for the tiny GGUF models used by the speculative-decoding tests.

Usage:
    python tests/models/make_models.py OUT_DIR

or from Python:
    from tests.models.make_models import build_all
    paths = build_all(pathlib.Path("some/dir"))   # name -> path

All weights are produced from fixed numpy seeds, so the output files are byte-identical
between runs.  A stamp file (``.make_models.stamp``) in the output directory records
``VERSION``; files that already exist are reused only when the stamp matches, so bumping
``VERSION`` (or changing the generator and bumping it) rebuilds everything.

Layout conventions: shapes in comments are ggml ``ne`` order, numpy arrays are the reverse
(``ne = {E, V}`` is a numpy array of shape ``(V, E)``).  Layer matrices are F32.  In the
big-vocab models ``token_embd`` is F16 (``get_rows`` converts it exactly to F32, so it does
not affect numeric stability) while ``output`` stays F32, which keeps every target under
~65 MB.  What llama.cpp requires of each kind of file (metadata keys, tensor shapes) is
noted at its writer below. ``llama-q8`` stores every matrix as Q8_0 (and ties its output to
``token_embd``, as Gemma 3 does), so that tests reach the quantized CPU kernels; ``llama-q4``
the same as Q4_0, which the CPU backend repacks for its gemm/gemv kernels.

"Walk" models: the greedy next token after token t is sigma(t) for a fixed permutation
sigma of WALK_N ordinary word tokens (" the"-like tokens: 'Ġ' + lowercase letters, never
special / EOG tokens).  Every other token id shares the embedding of some walk token, so it
is also mapped into the walk.  The construction is

    E[t]           random, ||E[t]|| = sqrt(n_embd) (rms 1)        for t in the walk set
    E[u]           = E[walk[u % WALK_N]]                           for every other token u
    output[sigma(t)] = WALK_C * E[t],  all other output rows 0
    layers: random, with attn_output / ffn_down (and ssm_out) scaled by WALK_LAYER_SCALE

so after the final RMSNorm the hidden state is ~E[t] and the logit of sigma(t) beats every
other logit by ~8.5 nats (checked with numpy forward passes by check_models.py).

Oracles: walk-llama-eagle3 (fc = [I,0,0], zero attn_output / ffn_down, own head with
row sigma^2(t) = WALK_C*E[t]) gets the first draft token of every round right;
walk-qwen35-mtp (nextn.eh_proj = [I|0], zero MTP attn_output / ffn_down) makes the MTP head
predict sigma(token) for every token, so every MTP draft is accepted.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

VERSION = "tiny-gguf-v6"

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
VENDOR = REPO_ROOT / "vendor" / "llama.cpp"
if str(VENDOR / "gguf-py") not in sys.path:
    sys.path.insert(0, str(VENDOR / "gguf-py"))

from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter  # noqa: E402
from gguf.quants import quantize  # noqa: E402

STAMP_NAME = ".make_models.stamp"

VOCAB_LLAMA = VENDOR / "models" / "ggml-vocab-llama-bpe.gguf"
VOCAB_QWEN35 = VENDOR / "models" / "ggml-vocab-qwen35.gguf"
#: a chat template with tool calls (Qwen 2.5's: Hermes-style <tool_call> tags), from the pinned tree
TOOLS_TEMPLATE = VENDOR / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"

# ---- model dimensions ---------------------------------------------------------------
E = 64  # n_embd of every target / draft (except the deliberately broken ones)
H, HKV, D = 4, 2, 16
FF = 128
N_LAYER = 4
CTX = 4096
RMS_EPS = 1e-5
ROPE_BASE = 500000.0
LOGIT_STD = 16.0  # random targets: std of output logits (sharp, untied head)

WALK_N = 96
WALK_C = 0.25
WALK_LAYER_SCALE = 0.05

EAGLE3_TARGET_LAYERS = [1, 2, 3]
DFLASH_TARGET_LAYERS = [1, 3]
DFLASH_BLOCK_SIZE = 8
DFLASH_MASK_ID = 128002  # <|reserved_special_token_0|> in llama-bpe

# qwen35 (4 trunk layers: 3 gated-delta-net + 1 full attention, then 1 NextN/MTP layer)
Q_TRUNK = 4
Q_SECTIONS = [2, 3, 3, 0]  # sum == n_rot / 2 == D / 2
Q_CONV_K = 4
Q_S, Q_G, Q_R = 16, 2, 4  # ssm state size, group count (k heads), time_step_rank (v heads)


# ---- vocab handling -----------------------------------------------------------------


class _Prepacked:
    """Already-serialised GGUF array payload (element type, count, items)."""

    def __init__(self, data: bytes):
        self.data = data

    def __len__(self) -> int:  # GGUFWriter.add_array-style checks
        return 1


class _Writer(GGUFWriter):
    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if isinstance(val, _Prepacked):
            return (self._pack("I", vtype) if add_vtype else b"") + val.data
        return super()._pack_val(val, vtype, add_vtype, sub_type)


_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _read_kv_raw(path: pathlib.Path) -> list[tuple[str, int, bytes]]:
    """(key, value type, raw value bytes) for every KV pair of a GGUF file.

    A minimal parser: GGUFReader takes ~8 s on the 400k-string vocab files, this takes ~0.3 s."""
    buf = memoryview(path.read_bytes())
    assert bytes(buf[:4]) == b"GGUF", path
    (version,) = struct.unpack_from("<I", buf, 4)
    assert version == 3, (path, version)
    _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24
    out = []

    def skip_val(vt: int, off: int) -> int:
        if vt == 8:
            (n,) = struct.unpack_from("<Q", buf, off)
            return off + 8 + n
        if vt == 9:
            lt, n = struct.unpack_from("<IQ", buf, off)
            off += 12
            if lt in _SCALAR_SIZE:
                return off + n * _SCALAR_SIZE[lt]
            for _ in range(n):
                off = skip_val(lt, off)
            return off
        return off + _SCALAR_SIZE[vt]

    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", buf, off)
        key = bytes(buf[off + 8 : off + 8 + klen]).decode()
        off += 8 + klen
        (vt,) = struct.unpack_from("<I", buf, off)
        off += 4
        end = skip_val(vt, off)
        out.append((key, vt, bytes(buf[off:end])))
        off = end
    return out


class Vocab:
    """All tokenizer.* keys of a vocab-only GGUF, copied byte-for-byte into the models."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.kv: list[tuple[str, int, bytes]] = [
            kv for kv in _read_kv_raw(path) if kv[0].startswith("tokenizer.")
        ]
        raw = {k: (vt, data) for k, vt, data in self.kv}
        vt, data = raw["tokenizer.ggml.tokens"]
        lt, n = struct.unpack_from("<IQ", data, 0)
        assert vt == 9 and lt == 8
        toks, off = [], 12
        for _ in range(n):
            (ln,) = struct.unpack_from("<Q", data, off)
            toks.append(data[off + 8 : off + 8 + ln].decode("utf-8", errors="replace"))
            off += 8 + ln
        self.tokens: list[str] = toks
        vt, data = raw["tokenizer.ggml.token_type"]
        lt, n = struct.unpack_from("<IQ", data, 0)
        assert vt == 9 and lt == 5 and n == len(toks)
        self.token_types = np.frombuffer(data, dtype="<i4", count=n, offset=12).astype(np.int64)
        self.n_vocab = len(self.tokens)
        assert self.n_vocab > 0

    def special_ids(self) -> np.ndarray:
        """Ids of non-normal tokens (control / user-defined / unused...)."""
        return np.nonzero(self.token_types != 1)[0]

    def word_tokens(self, n: int) -> list[int]:
        """n ordinary word tokens ('Ġ' + 3..8 lowercase ascii letters), lowest ids first."""
        pat = re.compile(r"^\u0120[a-z]{3,8}$")
        out = [
            i
            for i, (s, t) in enumerate(zip(self.tokens, self.token_types, strict=False))
            if t == 1 and pat.match(s) and s[1:] not in _WORD_EXCLUDE
        ]
        assert len(out) >= n, (self.path, len(out))
        return out[:n]

    def add_to(self, w: GGUFWriter, skip: tuple[str, ...] = ()) -> None:
        for name, vt, data in self.kv:
            if name not in skip:
                w.add_key_value(name, _Prepacked(data), GGUFValueType(vt))


_WORD_EXCLUDE = {"ass"}

_VOCABS: dict[str, Vocab] = {}


def vocab(kind: str) -> Vocab:
    if kind not in _VOCABS:
        _VOCABS[kind] = Vocab({"llama": VOCAB_LLAMA, "qwen35": VOCAB_QWEN35}[kind])
    return _VOCABS[kind]


# ---- writing ------------------------------------------------------------------------


def _write_gguf(
    path: pathlib.Path,
    arch: str,
    kv: dict[str, Any],
    tensors: dict[str, np.ndarray | _Quantized],
    voc: Vocab | None,
    vocab_skip: tuple[str, ...] = (),
    extra_kv: Callable[[GGUFWriter], None] | None = None,
) -> None:
    """Write atomically: <path>.tmp then rename."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    w = _Writer(tmp, arch)
    w.add_name(f"tiny-{path.stem}")
    for key, val in kv.items():
        key = key.replace("{arch}", arch)
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, (list, tuple)):
            w.add_key_value(key, [int(x) for x in val], GGUFValueType.ARRAY, GGUFValueType.INT32)
        else:
            raise TypeError(key)
    if voc is not None:
        voc.add_to(w, vocab_skip)
    if extra_kv is not None:
        extra_kv(w)
    for name, arr in tensors.items():
        if isinstance(arr, _Quantized):
            w.add_tensor(name, arr.data, raw_dtype=arr.qtype)
            continue
        assert arr.dtype in (np.float32, np.float16, np.int64), (name, arr.dtype)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


class _Quantized:
    """A matrix written as Q8_0 or Q4_0 (blocks of 32 along rows, each with an f16 scale)."""

    def __init__(self, arr: np.ndarray, qtype: GGMLQuantizationType) -> None:
        assert arr.ndim == 2 and arr.shape[1] % 32 == 0, arr.shape
        self.qtype = qtype
        self.data = quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)


def _rng(name: str) -> np.random.Generator:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


def _mat(rng: np.random.Generator, n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
    """numpy (n_out, n_in) == ggml ne {n_in, n_out}; std 1/sqrt(n_in)."""
    return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _base_kv(
    n_layer: int,
    n_embd: int = E,
    n_head: int = H,
    n_head_kv: int = HKV,
    n_ff: int = FF,
    head_dim: int | None = None,
) -> dict[str, Any]:
    hd = head_dim if head_dim is not None else n_embd // n_head
    return {
        "{arch}.context_length": CTX,
        "{arch}.embedding_length": n_embd,
        "{arch}.block_count": n_layer,
        "{arch}.feed_forward_length": n_ff,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head_kv,
        "{arch}.attention.layer_norm_rms_epsilon": RMS_EPS,
        "{arch}.attention.key_length": hd,
        "{arch}.attention.value_length": hd,
        "{arch}.rope.dimension_count": hd,
        "{arch}.rope.freq_base": ROPE_BASE,
    }


# ---- embeddings / heads ------------------------------------------------------------


def _random_embd(rng: np.random.Generator, n_vocab: int, n_embd: int) -> np.ndarray:
    return rng.standard_normal((n_vocab, n_embd)).astype(np.float16)


def _random_head(
    rng: np.random.Generator, voc: Vocab, n_embd: int, dtype=np.float32, logit_std: float = LOGIT_STD
) -> np.ndarray:
    """Untied output with logit std ~LOGIT_STD; special-token rows are zero, so a random
    target never emits EOS/EOT or other control tokens (their logit 0 is far below the max)."""
    out = rng.standard_normal((voc.n_vocab, n_embd)).astype(np.float32) * (logit_std / np.sqrt(n_embd))
    out[voc.special_ids()] = 0.0
    return out.astype(dtype)


class Walk:
    """A permutation walk over WALK_N word tokens of a vocab."""

    def __init__(self, voc: Vocab, name: str, n_embd: int = E, cycle: int | None = None):
        rng = _rng("walk-" + name)
        self.voc = voc
        self.ids = np.array(voc.word_tokens(WALK_N), dtype=np.int64)
        order = rng.permutation(WALK_N)
        sig = np.empty(WALK_N, dtype=np.int64)  # sig[k] = index (in ids) of sigma(ids[k])
        period = cycle or WALK_N
        assert WALK_N % period == 0
        for c0 in range(0, WALK_N, period):
            cyc = order[c0 : c0 + period]
            for a, b in zip(cyc, np.roll(cyc, -1), strict=False):
                sig[a] = b
        self.sig_idx = sig
        self.sigma = {int(self.ids[k]): int(self.ids[sig[k]]) for k in range(WALK_N)}
        # walk embeddings with rms exactly 1 (norm sqrt(n_embd)), rounded to f16 (token_embd dtype)
        we = rng.standard_normal((WALK_N, n_embd))
        we = we / np.linalg.norm(we, axis=1, keepdims=True) * np.sqrt(n_embd)
        self.walk_embd = we.astype(np.float16)
        # every token id u gets the embedding of walk token  rep(u)
        rep = np.arange(voc.n_vocab) % WALK_N
        rep[self.ids] = np.arange(WALK_N)
        self.rep = rep
        self.n_embd = n_embd

    def token_embd(self) -> np.ndarray:
        return self.walk_embd[self.rep]  # (V, E) f16

    def head(self, power: int = 1) -> np.ndarray:
        """output rows: row sigma^power(t) = WALK_C * E[t] for every walk token t."""
        out = np.zeros((self.voc.n_vocab, self.n_embd), dtype=np.float32)
        idx = np.arange(WALK_N)
        for _ in range(power):
            idx = self.sig_idx[idx]
        out[self.ids[idx]] = WALK_C * self.walk_embd.astype(np.float32)
        return out

    def next_of(self, tok: int, power: int = 1) -> int:
        k = int(self.rep[tok])
        for _ in range(power):
            k = int(self.sig_idx[k])
        return int(self.ids[k])


# ---- llama --------------------------------------------------------------------------


def _llama_layers(
    rng: np.random.Generator,
    n_layer: int,
    n_embd: int = E,
    n_head: int = H,
    n_head_kv: int = HKV,
    n_ff: int = FF,
    out_scale: float = 1.0,
) -> dict[str, np.ndarray]:
    hd = n_embd // n_head
    t: dict[str, np.ndarray] = {}
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _ones(n_embd)
        t[p + "attn_q.weight"] = _mat(rng, n_head * hd, n_embd)  # ne {E, H*D}
        t[p + "attn_k.weight"] = _mat(rng, n_head_kv * hd, n_embd)  # ne {E, Hkv*D}
        t[p + "attn_v.weight"] = _mat(rng, n_head_kv * hd, n_embd)
        t[p + "attn_output.weight"] = _mat(rng, n_embd, n_head * hd, out_scale)  # ne {H*D, E}
        t[p + "ffn_norm.weight"] = _ones(n_embd)
        t[p + "ffn_gate.weight"] = _mat(rng, n_ff, n_embd)  # ne {E, F}
        t[p + "ffn_up.weight"] = _mat(rng, n_ff, n_embd)
        t[p + "ffn_down.weight"] = _mat(rng, n_embd, n_ff, out_scale)  # ne {F, E}
    return t


def _write_llama(
    path: pathlib.Path,
    name: str,
    voc: Vocab,
    *,
    n_layer: int = N_LAYER,
    n_embd: int = E,
    n_head: int = H,
    n_head_kv: int = HKV,
    n_ff: int = FF,
    walk: Walk | None = None,
    head_dtype=np.float32,
    logit_std: float = LOGIT_STD,
    seed_name: str | None = None,
    quant: GGMLQuantizationType | None = None,
    chat_template: str | None = None,
) -> None:
    rng = _rng(seed_name or name)
    if walk is None:
        tok = _random_embd(rng, voc.n_vocab, n_embd)
        out = _random_head(rng, voc, n_embd, head_dtype, logit_std)
        layers = _llama_layers(rng, n_layer, n_embd, n_head, n_head_kv, n_ff)
    else:
        tok = walk.token_embd()
        out = walk.head(1).astype(head_dtype)
        layers = _llama_layers(rng, n_layer, n_embd, n_head, n_head_kv, n_ff, WALK_LAYER_SCALE)
    tensors = {"token_embd.weight": tok, "output_norm.weight": _ones(n_embd), "output.weight": out}
    tensors.update(layers)
    if quant is not None:  # (the output tied to token_embd, as in Gemma 3)
        del tensors["output.weight"]
    written = {
        k: _Quantized(v, quant) if quant is not None and v.ndim == 2 else v for k, v in tensors.items()
    }
    kv = _base_kv(n_layer, n_embd, n_head, n_head_kv, n_ff)
    kv["{arch}.vocab_size"] = voc.n_vocab
    if chat_template is not None:
        kv["tokenizer.chat_template"] = chat_template
    _write_gguf(path, "llama", kv, written, voc)


# ---- gemma3 (sliding-window attention) ------------------------------------------------

#: the tiny gemma3's window: positions a token attends back over in its SWA layers
GEMMA_SWA = 8


def _write_gemma3(path: pathlib.Path, name: str, voc: Vocab, n_layer: int = 6) -> None:
    """A random gemma3: 5 of every 6 layers attend over a GEMMA_SWA-token window."""
    rng = _rng(name)
    hd = E // H
    tensors = {
        "token_embd.weight": _random_embd(rng, voc.n_vocab, E),
        "output_norm.weight": _ones(E),
        "output.weight": _random_head(rng, voc, E),
    }
    tensors.update(_llama_layers(rng, n_layer))
    for i in range(n_layer):
        p = f"blk.{i}."
        for norm, n in (
            ("post_attention_norm", E),
            ("post_ffw_norm", E),
            ("attn_q_norm", hd),
            ("attn_k_norm", hd),
        ):
            tensors[p + norm + ".weight"] = _ones(n)
    kv = _base_kv(n_layer)
    kv["{arch}.vocab_size"] = voc.n_vocab
    kv["{arch}.attention.sliding_window"] = GEMMA_SWA
    _write_gguf(path, "gemma3", kv, tensors, voc)


# ---- eagle3 -------------------------------------------------------------------------


def _eagle3_tensors(
    rng: np.random.Generator,
    n_layer: int = 1,
    n_embd_tgt: int = E,
    n_tgt_feats: int = 3,
    oracle: Walk | None = None,
) -> dict[str, np.ndarray]:
    t: dict[str, np.ndarray] = {}
    if oracle is None:
        t["fc.weight"] = _mat(rng, E, n_tgt_feats * n_embd_tgt)  # ne {3*E_t, E}
    else:
        fc = np.zeros((E, n_tgt_feats * n_embd_tgt), dtype=np.float32)
        fc[:, :n_embd_tgt] = np.eye(E, n_embd_tgt, dtype=np.float32)  # g = first feature
        t["fc.weight"] = fc
    t["output_norm.weight"] = _ones(E)
    if oracle is not None:
        t["output.weight"] = oracle.head(2)  # own head: E[sigma^2]
    zero_out = 0.0 if oracle is not None else 1.0
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _ones(E)
        t[p + "attn_norm_2.weight"] = _ones(E)
        t[p + "attn_q.weight"] = _mat(rng, H * D, 2 * E)  # ne {2E, H*D}
        t[p + "attn_k.weight"] = _mat(rng, HKV * D, 2 * E)
        t[p + "attn_v.weight"] = _mat(rng, HKV * D, 2 * E)
        t[p + "attn_output.weight"] = _mat(rng, E, H * D, zero_out)
        t[p + "ffn_norm.weight"] = _ones(E)
        t[p + "ffn_gate.weight"] = _mat(rng, FF, E)
        t[p + "ffn_up.weight"] = _mat(rng, FF, E)
        t[p + "ffn_down.weight"] = _mat(rng, E, FF, zero_out)
    return t


def _write_eagle3(
    path: pathlib.Path,
    name: str,
    voc: Vocab,
    *,
    n_layer: int = 1,
    target_layers: list[int] = EAGLE3_TARGET_LAYERS,
    target_hidden: int = E,
    oracle: Walk | None = None,
) -> None:
    rng = _rng(name)
    tensors = _eagle3_tensors(rng, n_layer, target_hidden, len(target_layers), oracle)
    kv = _base_kv(n_layer)
    kv["{arch}.target_layers"] = list(target_layers)
    kv["{arch}.target_hidden_size"] = target_hidden
    _write_gguf(path, "eagle3", kv, tensors, voc)


# ---- dflash -------------------------------------------------------------------------


def _write_dflash(
    path: pathlib.Path,
    name: str,
    voc: Vocab,
    *,
    n_embd: int = E,
    n_layer: int = 2,
    target_layers: list[int] = DFLASH_TARGET_LAYERS,
    mask_id: int | None = DFLASH_MASK_ID,
) -> None:
    rng = _rng(name)
    n_head, n_head_kv = (H, HKV) if n_embd == E else (n_embd // D, max(1, n_embd // D // 2))
    hd = D
    t: dict[str, np.ndarray] = {
        "fc.weight": _mat(rng, n_embd, len(target_layers) * n_embd),  # ne {k*E, E}
        "enc.output_norm.weight": _ones(n_embd),
        "output_norm.weight": _ones(n_embd),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _ones(n_embd)
        t[p + "attn_q.weight"] = _mat(rng, n_head * hd, n_embd)
        t[p + "attn_k.weight"] = _mat(rng, n_head_kv * hd, n_embd)
        t[p + "attn_v.weight"] = _mat(rng, n_head_kv * hd, n_embd)
        t[p + "attn_output.weight"] = _mat(rng, n_embd, n_head * hd)
        t[p + "attn_q_norm.weight"] = _ones(hd)
        t[p + "attn_k_norm.weight"] = _ones(hd)
        t[p + "ffn_norm.weight"] = _ones(n_embd)
        t[p + "ffn_gate.weight"] = _mat(rng, FF, n_embd)
        t[p + "ffn_up.weight"] = _mat(rng, FF, n_embd)
        t[p + "ffn_down.weight"] = _mat(rng, n_embd, FF)
    kv = _base_kv(n_layer, n_embd, n_head, n_head_kv, FF, hd)
    kv["{arch}.target_layers"] = list(target_layers)
    kv["{arch}.block_size"] = DFLASH_BLOCK_SIZE

    def extra(w: GGUFWriter) -> None:
        if mask_id is not None:
            w.add_uint32("tokenizer.ggml.mask_token_id", mask_id)

    _write_gguf(path, "dflash", kv, t, voc, vocab_skip=("tokenizer.ggml.mask_token_id",), extra_kv=extra)


def _write_dflash_oracle(path: pathlib.Path, name: str, voc: Vocab, walk: Walk) -> None:
    """A DFlash draft whose FIRST draft token is always the walk target's next token.

    DFlash decodes the block [id_last, MASK, MASK, ...]; the token at MASK position 1 must be
    sigma(id_last). Construction (one working layer, four heads of 16 with as many KV heads):
    the draft's own embeddings are E[t] + c*u for every token (u a unit direction, c above
    every |u . E[t]|) and 0.01*v for the mask (v a unit direction orthogonal to u). Each
    head's query is the v-component (dimension 15 of the head: the lowest RoPE frequency, so
    positions barely rotate it) and its key the u-component; after the per-head norms the
    mask's query matches id_last's key with a score of 36 and every mask's key (0) and every
    injected context key (fc = 0 gives K = V = 0) with 0: a mask attends to id_last alone.
    V is the whole normed input and W_o removes the u-component, so the mask position's
    hidden state is ~E[id_last] and the target's walk head (shipped as the draft's own
    output) predicts sigma(id_last). Later masks predict the same token: drafts after the
    first are wrong, so verification accepts exactly one token per step, as the EAGLE-3 oracle.
    """
    rng = _rng(name)
    basis = np.linalg.qr(rng.standard_normal((E, 2)))[0].T.astype(np.float32)
    u, v = basis[0], basis[1]
    walk_e = walk.token_embd().astype(np.float32)
    c = 1.5 * float(np.abs(walk.walk_embd.astype(np.float32) @ u).max())
    tok = walk_e + c * u
    tok[DFLASH_MASK_ID] = 0.01 * v
    n_head = n_head_kv = H
    hd = D
    q = np.zeros((n_head * hd, E), dtype=np.float32)
    k = np.zeros((n_head_kv * hd, E), dtype=np.float32)
    for h in range(n_head):
        q[h * hd + hd - 1] = v
        k[h * hd + hd - 1] = u
    t: dict[str, np.ndarray] = {
        "token_embd.weight": tok.astype(np.float16),
        "output.weight": walk.head(1).astype(np.float16),
        "fc.weight": np.zeros((E, len(DFLASH_TARGET_LAYERS) * E), dtype=np.float32),
        "enc.output_norm.weight": _ones(E),
        "output_norm.weight": _ones(E),
    }
    for i in range(2):
        p = f"blk.{i}."
        working = i == 0  # the second layer is the identity (zero outputs)
        t[p + "attn_norm.weight"] = _ones(E)
        t[p + "attn_q.weight"] = q if working else _mat(rng, n_head * hd, E)
        t[p + "attn_k.weight"] = k if working else _mat(rng, n_head_kv * hd, E)
        t[p + "attn_v.weight"] = (
            np.eye(n_head_kv * hd, E, dtype=np.float32) if working else _mat(rng, n_head_kv * hd, E)
        )
        t[p + "attn_output.weight"] = (
            (np.eye(E) - np.outer(u, u)).astype(np.float32) if working else _mat(rng, E, E, 0.0)
        )
        t[p + "attn_q_norm.weight"] = np.full(hd, 3.0, dtype=np.float32)
        t[p + "attn_k_norm.weight"] = np.full(hd, 3.0, dtype=np.float32)
        t[p + "ffn_norm.weight"] = _ones(E)
        t[p + "ffn_gate.weight"] = _mat(rng, FF, E)
        t[p + "ffn_up.weight"] = _mat(rng, FF, E)
        t[p + "ffn_down.weight"] = _mat(rng, E, FF, 0.0)
    kv = _base_kv(2, E, n_head, n_head_kv, FF, hd)
    kv["{arch}.target_layers"] = list(DFLASH_TARGET_LAYERS)
    kv["{arch}.block_size"] = DFLASH_BLOCK_SIZE

    def extra(w: GGUFWriter) -> None:
        w.add_uint32("tokenizer.ggml.mask_token_id", DFLASH_MASK_ID)

    _write_gguf(path, "dflash", kv, t, voc, vocab_skip=("tokenizer.ggml.mask_token_id",), extra_kv=extra)


# ---- qwen35 (+ NextN / MTP) ---------------------------------------------------------


class QDims:
    def __init__(
        self,
        n_embd=E,
        n_head=H,
        n_head_kv=HKV,
        head_dim=D,
        n_ff=FF,
        s=Q_S,
        g=Q_G,
        r=Q_R,
        sections=tuple(Q_SECTIONS),
        n_trunk=Q_TRUNK,
    ):
        self.E, self.H, self.HKV, self.D, self.FF = n_embd, n_head, n_head_kv, head_dim, n_ff
        self.S, self.G, self.R = s, g, r
        self.sections = list(sections)
        assert sum(self.sections) == head_dim // 2
        self.n_trunk = n_trunk
        self.conv_dim = 2 * s * g + s * r


Q_DEFAULT = QDims()
Q_SMALL = QDims(n_embd=16, n_head=2, n_head_kv=1, head_dim=8, n_ff=32, s=8, g=1, r=2, sections=(1, 1, 2, 0))


def _qwen35_is_recurrent(il: int, n_trunk: int, interval: int = 4) -> bool:
    return il < n_trunk and (il + 1) % interval != 0


def _write_qwen35(
    path: pathlib.Path,
    name: str,
    voc: Vocab,
    *,
    dims: QDims = Q_DEFAULT,
    walk: Walk | None = None,
    conv_dtype=np.float32,
    head_dtype=np.float32,
) -> None:
    rng = _rng(name)
    d = dims
    out_scale = WALK_LAYER_SCALE if walk is not None else 1.0
    t: dict[str, np.ndarray] = {}
    if walk is None:
        t["token_embd.weight"] = _random_embd(rng, voc.n_vocab, d.E)
        t["output.weight"] = _random_head(rng, voc, d.E, head_dtype)
    else:
        t["token_embd.weight"] = walk.token_embd()
        t["output.weight"] = walk.head(1).astype(head_dtype)
    t["output_norm.weight"] = _ones(d.E)

    def attn_block(p: str, wo_scale: float) -> None:
        t[p + "attn_q.weight"] = _mat(rng, 2 * d.H * d.D, d.E)  # ne {E, 2*H*D}: query + gate
        t[p + "attn_k.weight"] = _mat(rng, d.HKV * d.D, d.E)
        t[p + "attn_v.weight"] = _mat(rng, d.HKV * d.D, d.E)
        t[p + "attn_output.weight"] = _mat(rng, d.E, d.H * d.D, wo_scale)
        t[p + "attn_q_norm.weight"] = _ones(d.D)
        t[p + "attn_k_norm.weight"] = _ones(d.D)

    def ffn_block(p: str, down_scale: float) -> None:
        t[p + "ffn_gate.weight"] = _mat(rng, d.FF, d.E)
        t[p + "ffn_up.weight"] = _mat(rng, d.FF, d.E)
        t[p + "ffn_down.weight"] = _mat(rng, d.E, d.FF, down_scale)

    for il in range(d.n_trunk):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = _ones(d.E)
        t[p + "post_attention_norm.weight"] = _ones(d.E)
        if _qwen35_is_recurrent(il, d.n_trunk):
            t[p + "attn_qkv.weight"] = _mat(rng, d.conv_dim, d.E)  # ne {E, 2SG+SR}
            t[p + "attn_gate.weight"] = _mat(rng, d.S * d.R, d.E)  # ne {E, SR}
            conv = (rng.standard_normal((d.conv_dim, Q_CONV_K)) / np.sqrt(Q_CONV_K)).astype(np.float32)
            t[p + "ssm_conv1d.weight"] = conv.astype(conv_dtype)  # ne {K, 2SG+SR}
            t[p + "ssm_dt.bias"] = (rng.standard_normal(d.R) * 0.5).astype(np.float32)
            t[p + "ssm_a"] = (-rng.uniform(0.5, 2.0, d.R)).astype(np.float32)  # -exp(A_log)
            t[p + "ssm_beta.weight"] = _mat(rng, d.R, d.E)  # ne {E, R}
            t[p + "ssm_alpha.weight"] = _mat(rng, d.R, d.E)
            t[p + "ssm_norm.weight"] = _ones(d.S)
            t[p + "ssm_out.weight"] = _mat(rng, d.E, d.S * d.R, out_scale)  # ne {SR, E}
        else:
            attn_block(p, out_scale)
        ffn_block(p, out_scale)

    # NextN / MTP block
    il = d.n_trunk
    p = f"blk.{il}."
    mtp_out_scale = 0.0 if walk is not None else 1.0
    t[p + "attn_norm.weight"] = _ones(d.E)
    t[p + "post_attention_norm.weight"] = _ones(d.E)
    attn_block(p, mtp_out_scale)
    ffn_block(p, mtp_out_scale)
    if walk is not None:
        eh = np.zeros((d.E, 2 * d.E), dtype=np.float32)
        eh[:, : d.E] = np.eye(d.E, dtype=np.float32)  # [I | 0]: keep only enorm(E[token])
    else:
        eh = _mat(rng, d.E, 2 * d.E)
    t[p + "nextn.eh_proj.weight"] = eh  # ne {2E, E}
    t[p + "nextn.enorm.weight"] = _ones(d.E)
    t[p + "nextn.hnorm.weight"] = _ones(d.E)

    kv = _base_kv(d.n_trunk + 1, d.E, d.H, d.HKV, d.FF, d.D)
    kv.update(
        {
            "{arch}.nextn_predict_layers": 1,
            "{arch}.rope.dimension_sections": d.sections,
            "{arch}.rope.freq_base": 10000000.0,
            "{arch}.ssm.conv_kernel": Q_CONV_K,
            "{arch}.ssm.inner_size": d.S * d.R,
            "{arch}.ssm.state_size": d.S,
            "{arch}.ssm.time_step_rank": d.R,
            "{arch}.ssm.group_count": d.G,
            "{arch}.full_attention_interval": 4,
        }
    )
    _write_gguf(path, "qwen35", kv, t, voc)


# ---- bad: unknown arch ----------------------------------------------------------------


def _write_unknown_arch(path: pathlib.Path, name: str, voc: Vocab) -> None:
    rng = _rng(name)
    kv = _base_kv(1, 16, 2, 1, 32)
    t = {"token_embd.weight": _random_embd(rng, voc.n_vocab, 16), "output_norm.weight": _ones(16)}
    _write_gguf(path, "nosucharch", kv, t, voc)


# ---- registry -----------------------------------------------------------------------


def _walks() -> dict[str, Walk]:
    if not hasattr(_walks, "cache"):
        _walks.cache = {  # type: ignore[attr-defined]
            "walk-llama": Walk(vocab("llama"), "walk-llama"),
            "walk-llama-cycle6": Walk(vocab("llama"), "walk-llama-cycle6", cycle=6),
            "walk-qwen35": Walk(vocab("qwen35"), "walk-qwen35"),
        }
    return _walks.cache  # type: ignore[attr-defined]


def _builders() -> dict[str, Callable[[pathlib.Path], None]]:
    L = lambda: vocab("llama")  # noqa: E731
    Q = lambda: vocab("qwen35")  # noqa: E731
    W = lambda k: _walks()[k]  # noqa: E731
    return {
        # targets and drafts
        "llama": lambda p: _write_llama(p, "llama", L()),
        "llama-q8": lambda p: _write_llama(p, "llama-q8", L(), quant=GGMLQuantizationType.Q8_0),
        # Q4_0 matrices: the CPU repacks them (interleaved rows, gemm and gemv kernels)
        "llama-q4": lambda p: _write_llama(
            p, "llama-q4", L(), seed_name="llama-q8", quant=GGMLQuantizationType.Q4_0
        ),
        # llama's weights with a chat template that calls tools
        "llama-tools": lambda p: _write_llama(
            p, "llama-tools", L(), seed_name="llama", chat_template=TOOLS_TEMPLATE.read_text()
        ),
        "gemma3-swa": lambda p: _write_gemma3(p, "gemma3-swa", L()),
        # softer logits (std 8): at temperature 1 a handful of tokens share the mass
        "llama-soft": lambda p: _write_llama(p, "llama-soft", L(), logit_std=8.0),
        # llama-soft's weights with twice its logits: a draft whose greedy token is the
        # target's, whose distribution is sharper (the target's at temperature 0.5)
        "llama-soft-sharp": lambda p: _write_llama(
            p, "llama-soft-sharp", L(), logit_std=16.0, seed_name="llama-soft"
        ),
        "llama-eagle3": lambda p: _write_eagle3(p, "llama-eagle3", L()),
        "llama-dflash": lambda p: _write_dflash(p, "llama-dflash", L()),
        "qwen35-mtp": lambda p: _write_qwen35(p, "qwen35-mtp", Q()),
        # walk models
        "walk-llama": lambda p: _write_llama(p, "walk-llama", L(), walk=W("walk-llama")),
        "walk-llama-eagle3": lambda p: _write_eagle3(p, "walk-llama-eagle3", L(), oracle=W("walk-llama")),
        "walk-llama-dflash": lambda p: _write_dflash(p, "walk-llama-dflash", L()),
        "walk-llama-dflash-oracle": lambda p: _write_dflash_oracle(
            p, "walk-llama-dflash-oracle", L(), W("walk-llama")
        ),
        "walk-qwen35-mtp": lambda p: _write_qwen35(p, "walk-qwen35-mtp", Q(), walk=W("walk-qwen35")),
        "walk-llama-cycle6": lambda p: _write_llama(p, "walk-llama-cycle6", L(), walk=W("walk-llama-cycle6")),
        # broken variants
        "bad-eagle3-2layers": lambda p: _write_eagle3(p, "bad-eagle3-2layers", L(), n_layer=2),
        "bad-eagle3-layer-range": lambda p: _write_eagle3(
            p, "bad-eagle3-layer-range", L(), target_layers=[1, 2, 9]
        ),
        "bad-eagle3-two-layers-ids": lambda p: _write_eagle3(
            p, "bad-eagle3-two-layers-ids", L(), target_layers=[1, 2]
        ),
        "bad-eagle3-hidden": lambda p: _write_eagle3(p, "bad-eagle3-hidden", L(), target_hidden=32),
        "bad-eagle3-vocab": lambda p: _write_eagle3(p, "bad-eagle3-vocab", Q()),
        "bad-dflash-layer": lambda p: _write_dflash(p, "bad-dflash-layer", L(), target_layers=[1, N_LAYER]),
        "bad-dflash-nomask": lambda p: _write_dflash(p, "bad-dflash-nomask", L(), mask_id=None),
        "bad-dflash-embd": lambda p: _write_dflash(p, "bad-dflash-embd", L(), n_embd=32),
        "bad-qwen35-conv-f16": lambda p: _write_qwen35(
            p, "bad-qwen35-conv-f16", Q(), dims=Q_SMALL, conv_dtype=np.float16, head_dtype=np.float16
        ),
        "llama-other-vocab": lambda p: _write_llama(
            p,
            "llama-other-vocab",
            Q(),
            n_layer=2,
            n_embd=16,
            n_head=2,
            n_head_kv=1,
            n_ff=32,
            head_dtype=np.float16,
        ),
        "bad-unknown-arch": lambda p: _write_unknown_arch(p, "bad-unknown-arch", L()),
    }


MODEL_NAMES = tuple(_builders().keys())


def build_all(out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write every model into out_dir (created if needed); return name -> path of '<name>.gguf'.

    Existing files are reused when the stamp file in out_dir records the current VERSION."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / STAMP_NAME
    stamp_ok = stamp.is_file() and stamp.read_text().strip() == VERSION
    if not stamp_ok and stamp.exists():
        stamp.unlink()
    result: dict[str, pathlib.Path] = {}
    for name, build in _builders().items():
        path = out_dir / f"{name}.gguf"
        if not (stamp_ok and path.is_file()):
            build(path)
        result[name] = path
    if not stamp_ok:
        tmp = stamp.with_name(f"{STAMP_NAME}.{os.getpid()}.tmp")
        tmp.write_text(VERSION + "\n")
        os.replace(tmp, stamp)
    return result


def walk_sigma(name: str) -> dict[int, int]:
    """sigma of a walk target ('walk-llama', 'walk-llama-cycle6', 'walk-qwen35-mtp'): token -> next token."""
    key = {"walk-qwen35-mtp": "walk-qwen35"}.get(name, name)
    return dict(_walks()[key].sigma)


def walk_next(name: str, tok: int, steps: int = 1) -> int:
    """Greedy token `steps` positions after token `tok` (any id) in walk target `name`."""
    key = {"walk-qwen35-mtp": "walk-qwen35"}.get(name, name)
    return _walks()[key].next_of(tok, steps)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    t0 = time.time()
    paths = build_all(pathlib.Path(argv[1]))
    for _name, p in paths.items():
        print(f"{p}  {p.stat().st_size / 1e6:.1f} MB")
    print(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
