"""Request builders for the RPC fuzz test (`test_fuzz.py`): random field values from message
descriptors (extreme, negative, NaN/inf, non-UTF-8, long, deeply nested JSON), near-valid token
batches, tensors, prompts and weight pushes with one thing wrong, raw bytes that are not a message,
and a one-line summary of a request for the failure list."""

import hashlib
import math
import random
import re
import struct
import zlib

import numpy as np
from google.protobuf import descriptor as pbd
from google.protobuf import message_factory, text_format

FLOAT32_MAX = 3.4028234663852886e38
NP_NAMES = {
    "float32": "float32",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
    "int16": "bfloat16",
}
DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def message_class(desc: pbd.Descriptor):
    return message_factory.GetMessageClass(desc)


# ------------------------------------------------------------------ random values
INT_RANGES = {
    pbd.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    pbd.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    pbd.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    pbd.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
FLOATS = [
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1e-45,
    1e-30,
    1e-8,
    0.5,
    1.0,
    1.5,
    10.0,
    11.0,
    -1.0,
    3.4e38,
    1e30,
    -1e30,
    65504.0,
]
STRINGS = [
    "",
    " ",
    "abc=",
    "hgfed=",
    "a",
    "\x00",
    "\n",
    "é☃𝄞",
    "user",
    "assistant",
    "system",
    "float32",
    "bfloat16",
    "int64",
    "complex64",
    "{}",
    "[]",
    "null",
    '{"a": 1}',
    '{"a": {"b": [1, 2]}}',
    "{",
    '"x"',
    "NaN",
    "1e999",
    "<s>",
    "</s>",
    "<pad>",
    "answer: 7",
    "\\boxed{3}",
    "full",
    "partial",
    "model.embed_tokens.weight",
]


def _deep_json(rng):
    return rng.choice(["[", '{"a":', '[{"a":']) * rng.choice([200, 1000, 5000, 50000])


def rand_int(rng, lo, hi, small_hi=100):
    r = rng.random()
    if r < 0.45:
        return max(lo, min(hi, rng.randint(-3, small_hi)))
    if r < 0.75:
        return rng.choice(
            [v for v in (lo, hi, -1, 0, 1, 2, 2**31 - 1, -(2**31), 2**32, 2**53, 2**62, -(2**62)) if lo <= v <= hi]
        )
    return rng.randint(lo, hi)


def rand_float(rng):
    return rng.choice(FLOATS) if rng.random() < 0.6 else rng.uniform(-100, 100)


def rand_str(rng):
    r = rng.random()
    if r < 0.35:
        return rng.choice(STRINGS)
    if r < 0.6:
        return "".join(rng.choice("abcdefghij0123456789=+ ") for _ in range(rng.randint(1, 40)))
    if r < 0.75:  # any code point but surrogates
        return "".join(
            chr(rng.choice([rng.randint(1, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])) for _ in range(rng.randint(1, 30))
        )
    if r < 0.85:
        return "a" * rng.choice([33, 500, 5000, 50_000])
    if r < 0.95:
        return _deep_json(rng)
    return rng.choice(STRINGS) + "\x00" + rng.choice(STRINGS)


def rand_bytes(rng):
    return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 16, 64, 1000]))


def rand_len(rng, big=64):
    r = rng.random()
    return 0 if r < 0.2 else rng.randint(1, 3) if r < 0.7 else rng.randint(4, 16) if r < 0.9 else rng.randint(17, big)


class Fuzz:
    """Random messages from descriptors, with near-valid builders for the messages the servers
    check most (token batches, tensors, prompts, sampling parameters, weight pushes)."""

    def __init__(self, pb, rng: random.Random, vocab: int, prompt_len: int, response_len: int, state):
        self.pb, self.rng = pb, rng
        self.vocab, self.prompt_len, self.response_len, self.state = vocab, prompt_len, response_len, state
        self.policy_version = 0  # the generation server's policy version as far as the pushes know
        self.near = {
            "rlhf.v1.Tensor": self.tensor,
            "rlhf.v1.TokenBatch": self.token_batch,
            "rlhf.v1.TrainRequest": self.train_request,
            "rlhf.v1.Prompt": self.prompt,
            "rlhf.v1.SamplingParams": self.params,
            "rlhf.v1.CheckpointRequest": self.checkpoint_request,
            "rlhf.v1.RewardSample": self.reward_sample,
        }

    # ---- generic
    def message(self, desc: pbd.Descriptor, depth: int = 0):
        near = self.near.get(desc.full_name)
        if near is not None and self.rng.random() < 0.7:
            return near()
        msg = message_class(desc)()
        if depth > 4:
            return msg
        chosen = {o.name: self.rng.choice(list(o.fields) + [None]) for o in desc.oneofs}
        for f in desc.fields:
            if f.containing_oneof is not None and chosen[f.containing_oneof.name] is not f:
                continue
            if self.rng.random() < 0.25:
                continue
            self.set_field(msg, f, depth)
        return msg

    def scalar(self, f: pbd.FieldDescriptor):
        t = f.type
        if t in INT_RANGES:
            return rand_int(self.rng, *INT_RANGES[t], small_hi=self.vocab + 3)
        if t in (f.TYPE_FLOAT, f.TYPE_DOUBLE):
            v = rand_float(self.rng)
            return v if t == f.TYPE_DOUBLE or abs(v) <= FLOAT32_MAX or math.isnan(v) else math.copysign(math.inf, v)
        if t == f.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == f.TYPE_STRING:
            return rand_str(self.rng)
        if t == f.TYPE_BYTES:
            return rand_bytes(self.rng)
        if t == f.TYPE_ENUM:  # a known value, or any int32 (proto3's enums are open: unknown values travel)
            if self.rng.random() < 0.7:
                return self.rng.choice([v.number for v in f.enum_type.values])
            return rand_int(self.rng, -(2**31), 2**31 - 1, small_hi=8)
        raise AssertionError(f"no generator for field type {t} of {f.full_name}")

    def set_field(self, msg, f: pbd.FieldDescriptor, depth: int):
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            m = getattr(msg, f.name)
            for _ in range(rand_len(self.rng)):
                k = self.scalar(key_f)
                if val_f.message_type is not None:
                    m[k].CopyFrom(self.message(val_f.message_type, depth + 1))
                else:
                    m[k] = self.scalar(val_f)
        elif f.is_repeated:
            field = getattr(msg, f.name)
            for _ in range(rand_len(self.rng)):
                if f.message_type is not None:
                    field.add().CopyFrom(self.message(f.message_type, depth + 1))
                else:
                    field.append(self.scalar(f))
        elif f.message_type is not None:
            getattr(msg, f.name).CopyFrom(self.message(f.message_type, depth + 1))
        else:
            setattr(msg, f.name, self.scalar(f))

    # ---- near-valid builders: mostly right, one or two things wrong
    def raw_tensor(self, array: np.ndarray, dtype: str | None = None):
        dtype = dtype or NP_NAMES[array.dtype.name]
        return self.pb["common"].Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())

    def tensor(self):
        rng = self.rng
        dtype = rng.choice(list(DTYPES) + ["", "complex64", "float", "FLOAT32", "int4", "x" * 100])
        ndim = rng.choice([0, 1, 2, 2, 2, 3, 4])
        shape = [
            rng.choice([0, 1, 2, 3, 5, 8, -1, -(2**63), 2**31, 2**40, 2**62, 2**63 - 1])
            if rng.random() < 0.2
            else rng.randint(1, 6)
            for _ in range(ndim)
        ]
        try:
            expected = math.prod(shape) * DTYPES.get(dtype, 4)
        except OverflowError:
            expected = -1
        n = rng.choice([expected, expected, expected + 1, expected - 1, 0, rng.randint(0, 64)])
        n = n if 0 <= n <= 1 << 16 else rng.randint(0, 64)
        if dtype.startswith("float") and rng.random() < 0.5 and n % 4 == 0:  # non-finite values on purpose
            data = struct.pack(
                f"<{n // 4}f", *[rng.choice([math.nan, math.inf, -math.inf, 1.0]) for _ in range(n // 4)]
            )
        else:
            data = rng.randbytes(n)
        return self.pb["common"].Tensor(dtype=dtype, shape=shape, data=data)

    def valid_batch(self, B=None, P=None, T=None):
        rng = self.rng
        B = B or rng.randint(1, 4)
        P = P or rng.randint(1, self.prompt_len)
        T = T or rng.randint(1, self.response_len)
        ids = np.array([[rng.randint(3, self.vocab - 1) for _ in range(P + T)] for _ in range(B)], dtype=np.int32)
        attn = np.ones((B, P + T), dtype=np.int8)
        pos = np.tile(np.arange(P + T, dtype=np.int32), (B, 1))
        rmask = np.ones((B, T), dtype=np.int8)
        return ids, attn, pos, rmask, P

    def token_batch(self):
        rng = self.rng
        ids, attn, pos, rmask, P = self.valid_batch(
            B=rng.choice([None] * 4 + [64]),
            T=rng.choice([None] * 9 + [self.response_len + 1]),
            P=rng.choice([None] * 9 + [self.prompt_len + 1]),
        )
        arrays = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "response_mask": rmask}
        dtypes = {}
        for _ in range(rng.choice([0, 1, 1, 2])):
            what = rng.randrange(12)
            name = rng.choice(list(arrays))
            a = arrays[name]
            if what == 0 and a.size:  # ids outside the vocabulary
                a = a.astype(np.int64)
                a.flat[rng.randrange(a.size)] = rng.choice(
                    [-1, self.vocab, self.vocab + 1, 2**31 - 1, -(2**31), 2**40, 2**62]
                )
            elif what == 1:  # another dtype
                dtypes[name] = rng.choice(["float32", "float64", "bool", "uint8", "int8", "int64", "bfloat16"])
                a = a.astype(
                    {
                        "float32": np.float32,
                        "float64": np.float64,
                        "bool": np.bool_,
                        "uint8": np.uint8,
                        "int8": np.int8,
                        "int64": np.int64,
                        "bfloat16": np.int16,
                    }[dtypes[name]]
                )
            elif what == 2 and a.ndim == 2 and a.size:  # a column short, or transposed, or one more dimension
                a = rng.choice([a[:, :-1], a.T.copy(), a[None], a[0]])
            elif what == 3:  # values of a mask outside {0, 1}
                a = a.astype(np.int8)
                a[...] = rng.choice([0, 2, -1, 127])
            elif what == 4:  # positions far outside the model's range, or negative
                a = a.astype(np.int64) + rng.choice([-(10**6), 10**6, 2**40, 2**62 - 100])
            elif what == 5 and a.size:  # non-finite floats
                a = a.astype(np.float32)
                a.flat[rng.randrange(a.size)] = rng.choice([math.nan, math.inf, -math.inf, 1e30])
                dtypes[name] = "float32"
            elif what == 6 and a.ndim:  # empty batch
                a = a[:0]
            arrays[name] = a
        msg = self.pb["common"].TokenBatch(prompt_width=P)
        for name, a in arrays.items():
            if rng.random() < 0.03:
                continue  # missing
            tensor = (
                self.raw_tensor(np.ascontiguousarray(a), dtypes.get(name)) if rng.random() > 0.05 else self.tensor()
            )
            getattr(msg, name).CopyFrom(tensor)
        if rng.random() < 0.15:
            msg.prompt_width = rng.choice([0, -1, P - 1, P + 1, ids.shape[1], 2**31 - 1, -(2**31)])
        return msg

    def train_request(self):
        rng = self.rng
        batch = self.token_batch()
        B, T = ([min(max(int(d), 1), 64) for d in batch.response_mask.shape] + [1, 1])[:2]

        def target():
            r = rng.random()
            if r < 0.1:
                return self.tensor()
            shape = (B, T) if r < 0.85 else rng.choice([(B, T + 1), (T, B), (B,), (B, T, 1)])
            a = np.array([rng.uniform(-2, 2) for _ in range(math.prod(shape))], dtype=np.float32).reshape(shape)
            if rng.random() < 0.3:
                a.flat[rng.randrange(a.size)] = rng.choice([math.nan, math.inf, -math.inf, 1e30, -3e38, 1e7, 1e6])
            if rng.random() < 0.1:
                a = a.astype(rng.choice([np.float64, np.int64, np.int16]))
            return self.raw_tensor(a)

        msg = self.pb["critic"].TrainRequest(batch=batch)
        if rng.random() > 0.05:
            msg.returns.CopyFrom(target())
        if rng.random() > 0.05:
            msg.old_values.CopyFrom(target())
        return msg

    def prompt(self):
        rng, gpb = self.rng, self.pb["generation"]
        kind = rng.choice(["tokens", "tokens", "text", "text", "chat", "none"])
        if kind == "tokens":
            n = rng.choice([0, 1, 4, self.prompt_len, self.prompt_len + 1, 200])
            ids = [rng.randint(3, self.vocab - 1) for _ in range(n)]
            if ids and rng.random() < 0.3:
                ids[rng.randrange(n)] = rng.choice([-1, self.vocab, 2**31 - 1, -(2**31), 0, 1, 2])
            return gpb.Prompt(tokens=gpb.TokenIds(ids=ids))
        if kind == "text":
            return gpb.Prompt(text=rand_str(rng) if rng.random() < 0.6 else "abc=")
        if kind == "chat":
            return gpb.Prompt(
                chat=gpb.Chat(
                    messages=[
                        gpb.ChatMessage(
                            role=rand_str(rng) if rng.random() < 0.3 else "user",
                            content=rand_str(rng) if rng.random() < 0.5 else "ab",
                        )
                        for _ in range(rng.choice([0, 1, 1, 2, 5]))
                    ]
                )
            )
        return gpb.Prompt()

    def params(self):
        rng, gpb = self.rng, self.pb["generation"]
        m = gpb.SamplingParams()
        picks = {
            "n": [0, 1, 2, 8, 9, -1, 2**31 - 1, -(2**31)],
            "temperature": [0.0, 1.0, 0.7, 1e-30, 1e-8, 1e-45, 10.0, 10.1, -1.0, math.nan, math.inf, 3.4e38],
            "top_p": [1.0, 0.5, 1e-30, 1e-45, 0.0, 1.01, -0.5, math.nan, math.inf],
            "top_k": [0, 1, 2, self.vocab, self.vocab + 1, -1, 2**31 - 1, -(2**31)],
            "max_new_tokens": [0, 1, self.response_len, self.response_len + 1, -1, 2**31 - 1, -(2**31)],
            "seed": [0, 1, -1, 2**32, 2**63 - 1, -(2**63), 2**53 + 1],
        }
        for name, values in picks.items():
            if rng.random() < 0.6:
                setattr(m, name, rng.choice(values))
        if rng.random() < 0.3:
            m.stop_token_ids.extend(rng.choice([-1, 0, 2, self.vocab, 2**31 - 1]) for _ in range(rand_len(rng)))
        return m

    def generate_request(self):
        gpb = self.pb["generation"]
        n = self.rng.choice([0, 1, 1, 2, 3, 4, 16, 64])
        return gpb.GenerateRequest(prompts=[self.prompt() for _ in range(n)], params=self.params())

    def reward_sample(self):
        rng, rpb = self.rng, self.pb["reward"]
        s = rpb.RewardSample(prompt=rand_str(rng), response=rand_str(rng))
        if rng.random() < 0.8:
            s.label = rand_str(rng)
        if rng.random() < 0.5:
            s.metadata_json = rng.choice(
                ['{"k": 1}', "", "[]", "{", "null", "1e999", '{"a": NaN}', _deep_json(rng), rand_str(rng)]
            )
        return s

    def checkpoint_request(self):
        """Paths that stay inside the temp cwd (a/b/c) whatever the server does with them."""
        rng = self.rng
        name = "".join(rng.choice("abcdef0123") for _ in range(6))
        path = rng.choice(
            [
                "",
                ".",
                "..",
                "ck",
                f"ck-{name}",
                "ck/sub/deeper",
                "../up",
                "../../up2",
                "a-file",
                "a-file/sub",
                "a\x00b",
                "x" * 300,
                f"ck/{'y' * 300}",
                " ",
                "\n",
                "~",
                "é☃",
                "ck\\..\\x",
                "./ck",
                "ck/",
                "//",
                "../..",
                "../../../fuzz-cwd-escape",
            ]
        )
        return self.pb["critic"].CheckpointRequest(path=path)

    # ---- weight pushes
    def chunks(self, state, policy_version, fmt="full", chunk_bytes=1 << 16):
        cpb = self.pb["common"]
        out = [
            cpb.WeightChunk(
                header=cpb.WeightHeader(
                    policy_version=policy_version,
                    format=fmt,
                    num_tensors=len(state),
                    total_bytes=sum(a.nbytes for a, _ in state.values()),
                )
            )
        ]
        for name, (a, dtype) in state.items():
            raw = a.tobytes()
            for off in range(0, max(len(raw), 1), chunk_bytes):
                data = raw[off : off + chunk_bytes]
                out.append(
                    cpb.WeightChunk(
                        piece=cpb.TensorPiece(
                            name=name, dtype=dtype, shape=list(a.shape), offset=off, total_bytes=len(raw), data=data
                        )
                    )
                )
        out.append(cpb.WeightChunk(footer=cpb.WeightFooter()))
        return self.reseal(out)

    @staticmethod
    def reseal(chunks):
        """Every piece's crc32 and the footer's sha256 made right for the data as it is now."""
        digest = hashlib.sha256()
        for c in chunks:
            if c.WhichOneof("payload") == "piece":
                c.piece.crc32 = zlib.crc32(c.piece.data)
                digest.update(c.piece.data)
            elif c.WhichOneof("payload") == "footer":
                c.footer.sha256 = digest.hexdigest()
        return chunks

    def push(self):
        """A weight push: random chunks, or the real weights with one thing wrong."""
        rng, cpb = self.rng, self.pb["common"]
        if rng.random() < 0.4:
            return [self.message(cpb.WeightChunk.DESCRIPTOR) for _ in range(rng.choice([0, 1, 2, 3, 5]))]
        names = list(self.state)
        if rng.random() < 0.3:  # a partial push of a few tensors
            names = rng.sample(names, rng.randint(1, min(3, len(names))))
        state = {k: (self.state[k], "float32") for k in names}
        policy_version = self.policy_version + 1
        what = rng.randrange(16)
        fmt = "partial" if len(names) < len(self.state) else "full"
        if what == 0:
            policy_version = rng.choice([0, -1, self.policy_version, -(2**63)])
        elif what == 1:
            fmt = rng.choice(["", "garbage", "partial" if fmt == "full" else "full"])
        chunks = self.chunks(state, policy_version, fmt)
        pieces = [c for c in chunks if c.WhichOneof("payload") == "piece"]
        p = rng.choice(pieces).piece
        if what == 2:
            chunks = rng.choice(
                [
                    chunks[1:],
                    chunks[:-1],
                    chunks[:1] + chunks,
                    chunks + chunks[-1:],
                    chunks + [chunks[1]],
                    chunks[:1] + [cpb.WeightChunk()] + chunks[1:],
                    [],
                    chunks[::-1],
                ]
            )
        elif what == 3:
            p.crc32 ^= 1
        elif what == 4:
            chunks[-1].footer.sha256 = rng.choice(["", "0" * 64, "zz"])
        elif what == 5:
            p.offset = rng.choice([-1, -(2**63), p.total_bytes, p.total_bytes - 1, 2**62])
        elif what == 6:
            p.total_bytes = rng.choice([0, p.total_bytes - 1, p.total_bytes + 1, -1, 2**62])
        elif what == 7:
            p.shape[:] = rng.choice([[], [1], list(p.shape)[::-1] + [1], [-1, 1], [2**62, 0]])
        elif what == 8:
            p.dtype = rng.choice(["float16", "bfloat16", "int64", "", "garbage"])
        elif what == 9:
            p.name = rng.choice(["", "nope", p.name + ".x", "\x00"])
        elif what == 10:
            chunks[0].header.num_tensors = rng.choice([0, -1, len(state) + 1, 2**31 - 1])
        elif what == 11:
            chunks[0].header.total_bytes = rng.choice([0, -1, 2**62, 2**63 - 1])
        elif what == 12:  # data cut short or grown, checksums redone: only the sizes are wrong
            p.data = p.data[:-4] if rng.random() < 0.5 else p.data + b"\x00\x00\x80\x7f"
            self.reseal(chunks)
        elif what == 13:
            p.data = b""
            self.reseal(chunks)
        elif what == 14:
            chunks.insert(rng.randrange(len(chunks) + 1), cpb.WeightChunk(header=chunks[0].header))
        # what == 15: valid (a new version of the same weights)
        return chunks

    # ---- declared shapes whose product overflows (int64 numel, strides, C multiplication)
    OVERFLOW_DIMS = (2**31, 2**32, 2**33, 2**40, 2**61, 2**62, 2**63 - 1)

    def overflow_shape(self, ndim=None):
        """A shape whose product (or whose non-zero dimensions' product, for an empty tensor)
        overflows 64 bits, or wraps to a small number in 64-bit arithmetic."""
        rng = self.rng
        big = lambda: rng.choice(self.OVERFLOW_DIMS)  # noqa: E731
        kind = rng.randrange(6)
        if kind == 0:  # empty, the other dimensions overflow together (strides, numel)
            shape = [0, big(), big()]
        elif kind == 1:  # the product overflows int64
            shape = [big(), big()]
        elif kind == 2:  # wraps to 0 modulo 2**64: [2**32, 2**32], [2**62, 4], [2**61, 8]
            shape = rng.choice([[2**32, 2**32], [2**62, 4], [2**61, 8], [2**33, 2**31], [4, 2**62]])
        elif kind == 3:  # one huge dimension beside an empty one
            shape = rng.choice([[2**63 - 1, 0], [0, 2**63 - 1], [0, 2**63 - 1, 2], [2**62, 0, 2**62]])
        elif kind == 4:  # many large dimensions
            shape = [rng.choice([2**16, 2**20, 2**31]) for _ in range(rng.randint(3, 6))]
        else:  # small dimensions, too many of them, one of them huge
            shape = [rng.randint(1, 3) for _ in range(rng.randint(2, 12))]
            shape[rng.randrange(len(shape))] = big()
        if ndim is not None:
            shape = (shape + [1] * ndim)[:ndim] if len(shape) != ndim else shape
            if ndim == 2 and math.prod(shape) < 2**63 and 0 not in shape:
                shape = [big(), big()]
        return shape

    def wrapped_size(self, shape, itemsize):
        """The byte count 64-bit arithmetic gets for `shape` (the product wrapped modulo 2**64),
        when small enough to send: data that a check done in C integers would accept."""
        n = (math.prod(shape) * itemsize) % 2**64
        return n if n <= 1 << 16 else 0

    def overflow_tensor(self, ndim=None):
        rng = self.rng
        dtype = rng.choice(["float32", "int64", "int32", "int8", "bfloat16", "bool"])
        shape = self.overflow_shape(ndim)
        n = rng.choice([self.wrapped_size(shape, DTYPES[dtype]), 0, rng.randint(1, 64)])
        return self.pb["common"].Tensor(dtype=dtype, shape=shape, data=rng.randbytes(n))

    def overflow_critic(self, desc):
        """A Values or Train request, valid but for one tensor whose declared shape overflows."""
        msg = self.valid(desc)
        fields = ["batch.input_ids", "batch.attention_mask", "batch.position_ids", "batch.response_mask"]
        if desc.full_name == "rlhf.v1.TrainRequest":
            fields += ["returns", "old_values"] * 2
        for name in self.rng.sample(fields, self.rng.choice([1, 1, 2])):
            owner = msg
            *path, last = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            getattr(owner, last).CopyFrom(self.overflow_tensor(ndim=2 if self.rng.random() < 0.8 else None))
        return msg

    def overflow_generate(self):
        """A Generate whose sizes multiply past 64 bits: n, max_new_tokens, prompt lengths."""
        rng, gpb = self.rng, self.pb["generation"]
        req = self.valid(gpb.GenerateRequest.DESCRIPTOR)
        p = req.params
        for field, values in (
            ("n", [2**31 - 1, -(2**31), 2**30]),
            ("max_new_tokens", [2**31 - 1, -1, 2**30]),
            ("top_k", [2**31 - 1, -(2**31)]),
        ):
            if rng.random() < 0.6:
                setattr(p, field, rng.choice(values))
        if p.n <= 8 and 0 < p.max_new_tokens <= self.response_len:  # still valid: a prompt too long, or n too big
            if rng.random() < 0.5:
                req.prompts[0].tokens.ids[:] = [5] * rng.choice([self.prompt_len + 1, 4096, 65536])
            else:
                p.n = rng.choice([2**31 - 1, 2**20, 9])
        return req

    def overflow_push(self):
        """A weight push, valid but for one piece whose declared shape overflows (and whose
        total_bytes is the wrapped product, or 0, or the real size), checksums made right."""
        rng = self.rng
        names = list(self.state)
        state = {k: (self.state[k], "float32") for k in names}
        chunks = self.chunks(state, self.policy_version + 1, "full")
        pieces = [c.piece for c in chunks if c.WhichOneof("payload") == "piece"]
        for p in rng.sample(pieces, rng.choice([1, 1, 2])):
            shape = self.overflow_shape()
            p.shape[:] = shape
            p.total_bytes = rng.choice([self.wrapped_size(shape, 4), 0, p.total_bytes, 2**63 - 1])
            if rng.random() < 0.3:
                p.data = b""
            if rng.random() < 0.3:
                p.name = "not-a-tensor-of-the-model"
        if rng.random() < 0.3:
            chunks[0].header.total_bytes = rng.choice([2**63 - 1, 2**62, 0])
        return self.reseal(chunks)

    # ---- valid requests, and valid ones with exactly one field replaced or cleared
    def short_text(self, lo=1, hi=8):
        return "".join(self.rng.choice("abcdefgh=") for _ in range(self.rng.randint(lo, hi)))

    def valid(self, desc: pbd.Descriptor):
        rng, name = self.rng, desc.full_name
        gpb, rpb, cpb, common = self.pb["generation"], self.pb["reward"], self.pb["critic"], self.pb["common"]
        if name == "rlhf.v1.GenerateRequest":
            prompts = []
            for _ in range(rng.randint(1, 4)):
                kind = rng.choice(["tokens", "text", "chat"])
                if kind == "tokens":
                    prompts.append(
                        gpb.Prompt(
                            tokens=gpb.TokenIds(
                                ids=[rng.randint(3, self.vocab - 1) for _ in range(rng.randint(1, self.prompt_len))]
                            )
                        )
                    )
                elif kind == "text":
                    prompts.append(gpb.Prompt(text=self.short_text()))
                else:
                    message = gpb.ChatMessage(role="user", content=self.short_text(1, 4))
                    prompts.append(gpb.Prompt(chat=gpb.Chat(messages=[message])))
            params = gpb.SamplingParams(
                n=rng.randint(1, 4), max_new_tokens=rng.randint(1, self.response_len), top_k=rng.choice([0, 0, 5])
            )
            for field, values in (("temperature", [0.0, 0.7, 1.0]), ("top_p", [0.5, 0.9, 1.0]), ("seed", [1, 2**40])):
                if rng.random() < 0.5:
                    setattr(params, field, rng.choice(values))
            return gpb.GenerateRequest(prompts=prompts, params=params)
        if name == "rlhf.v1.ScoreRequest":
            return rpb.ScoreRequest(
                samples=[
                    rpb.RewardSample(
                        prompt=self.short_text(),
                        response=self.short_text(0, 8),
                        label=self.short_text(0, 8),
                        metadata_json=rng.choice(["", "{}", '{"k": 1}']),
                    )
                    for _ in range(rng.randint(1, 8))
                ]
            )
        if name in ("rlhf.v1.ValuesRequest", "rlhf.v1.TrainRequest"):
            ids, attn, pos, rmask, P = self.valid_batch()
            batch = common.TokenBatch(
                input_ids=self.raw_tensor(ids),
                attention_mask=self.raw_tensor(attn),
                position_ids=self.raw_tensor(pos),
                response_mask=self.raw_tensor(rmask),
                prompt_width=P,
            )
            if name == "rlhf.v1.ValuesRequest":
                return cpb.ValuesRequest(batch=batch)
            targets = [
                np.array([rng.uniform(-2, 2) for _ in range(rmask.size)], dtype=np.float32).reshape(rmask.shape)
                for _ in range(2)
            ]
            return cpb.TrainRequest(
                batch=batch, returns=self.raw_tensor(targets[0]), old_values=self.raw_tensor(targets[1])
            )
        if name == "rlhf.v1.CheckpointRequest":
            return cpb.CheckpointRequest(path="ck-" + self.short_text(1, 3).replace("=", "e"))
        if name == "rlhf.v1.PullWeightsRequest":
            return self.pb["learner"].PullWeightsRequest(have_policy_version=rng.choice([-1, 0, 2, 3, 4]))
        return message_class(desc)()

    def mutate_one(self, msg):
        """`msg` with one field anywhere in it cleared or given a random value."""
        sites = []

        def walk(m):
            for f in m.DESCRIPTOR.fields:
                sites.append((m, f))
                if f.message_type is None or f.message_type.GetOptions().map_entry:
                    continue
                if f.is_repeated:
                    for sub in getattr(m, f.name):
                        walk(sub)
                elif m.HasField(f.name):
                    walk(getattr(m, f.name))

        walk(msg)
        if sites:
            m, f = self.rng.choice(sites)
            m.ClearField(f.name)
            if self.rng.random() < 0.8:
                self.set_field(m, f, depth=3)
        return msg

    def request(self, desc: pbd.Descriptor):
        """A request for a unary method: valid, valid with one thing wrong, or random."""
        r = self.rng.random()
        if r < 0.2:
            return self.valid(desc)
        if r < 0.6:
            return self.mutate_one(self.valid(desc))
        if desc.full_name == "rlhf.v1.GenerateRequest" and r < 0.8:
            return self.generate_request()
        return self.message(desc)

    def garbage(self, desc):
        """Bytes that are not a message, or a serialized message cut, flipped or extended."""
        rng = self.rng
        r = rng.random()
        if r < 0.3:
            return rng.randbytes(rng.choice([1, 2, 5, 17, 100, 1000]))
        valid = self.message(desc).SerializeToString() or b"\x08\x01"
        b = bytearray(valid)
        if r < 0.5:
            return bytes(b[: rng.randrange(len(b))] + b"\xff")
        if r < 0.7:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            return bytes(b)
        if r < 0.85:  # a length-delimited field claiming more bytes than there are / deep nesting
            return rng.choice(
                [b"\x0a\xff\xff\xff\xff\x0f" + bytes(b), b"\x0a\x02" * 200 + b"\x00", b"\x0a\x80\x01" + bytes(b)]
            )
        return bytes(b) + b"\xa0\x06" + rng.randbytes(8)  # unknown field 100


def summary(payload) -> str:
    if isinstance(payload, (bytes, bytearray)):
        return f"raw bytes ({len(payload)}): {bytes(payload[:40])!r}"
    if isinstance(payload, list):
        return "stream [" + "; ".join(summary(p) for p in payload[:4]) + (" ..." if len(payload) > 4 else "") + "]"
    text = text_format.MessageToString(payload, as_one_line=True, as_utf8=False)
    text = re.sub(r'(data: ")((?:[^"\\]|\\.){60})(?:[^"\\]|\\.)*"', r'\1\2..."', text)
    return f"{type(payload).__name__} {text[:400]}" + (" ..." if len(text) > 400 else "")
