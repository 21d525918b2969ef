"""decoder_attention: the attention half of a Llama-family decoder layer for one decode token, fused into one call.

The op: schema, checks (worded as the native kernel words them, csrc/common/decoder_attention_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test oracle),
fake kernel, and the typed wrapper the lean decoder calls (flashllm_ext/decoder/llama.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashllm_ext.ops.blocks import BLOCK_FORMATS
from flashllm_ext.ops.library import LIB
from flashllm_ext.ops.linear import quantized_linear_reference

# ------------------------------------------------------------------------------------------------ decoder_attention
# For one token x [1, d] at `position` of a sequence whose keys/values fill k_cache, v_cache [S_max, 1, Hkv, D]
# (token-major, flashllm::decode_attention's layout) up to that position:
#   h = rms_norm(x) * norm_weight;  q | k | v = h qkv_weight^T (+ qkv_bias)   (Hq + 2 Hkv heads of D)
#   q, k per-head rms-normed by q_norm / k_norm when given (Qwen3), then rotated by RoPE in the half-split form with
#   cos and the signed sin of this position ([D]: cos, and -sin | +sin over the two halves of a head);
#   k, v written at k_cache[position], v_cache[position] (in the caches' dtype);
#   attn = softmax(scale q.k) v over positions (position - window, position] (window <= 0: every position);
#   out = x + attn o_weight^T (+ o_bias);  returns (out, rms_norm(out) * ffn_norm_weight), both float32 [1, d].
# Every norm uses `eps`. Weights float32 / float16 / bfloat16 (one dtype, their biases too), norms and tables float32;
# or, where qkv_format / o_format names a block format, that weight is uint8 rows of GGUF blocks (a quantized store's
# attention), its product flashllm::quantized_linear's (x rounded per block of 32 to int8) and its bias float32.
LIB.define(
    "decoder_attention(Tensor x, Tensor norm_weight, Tensor qkv_weight, Tensor? qkv_bias, Tensor? q_norm, "
    "Tensor? k_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor o_weight, "
    "Tensor? o_bias, Tensor ffn_norm_weight, int position, int window, float eps, float scale, "
    "str? qkv_format=None, str? o_format=None) -> (Tensor, Tensor)"
)

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_decoder_attention_metadata(
    x,
    norm_weight,
    qkv_weight,
    qkv_bias,
    q_norm,
    k_norm,
    cos,
    sin,
    k_cache,
    v_cache,
    o_weight,
    o_bias,
    ffn_norm_weight,
    position,
    qkv_format=None,
    o_format=None,
) -> tuple[int, int, int]:
    """The metadata checks of csrc/common/decoder_attention_checks.h. Returns (Hq, Hkv, D)."""
    name = "decoder_attention"
    for format_name, fmt in (("qkv_format", qkv_format), ("o_format", o_format)):
        torch._check(
            fmt is None or fmt in BLOCK_FORMATS,
            lambda: f"{name}: {format_name} must be one of {tuple(BLOCK_FORMATS)} or None, got {fmt!r}",
        )
    torch._check(
        x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] == 1,
        lambda: f"{name}: x must be a float32 tensor [1, d], got {x.dtype} of shape {list(x.shape)}",
    )
    d = x.shape[1]
    torch._check(
        k_cache.dim() == 4
        and k_cache.shape[1] == 1
        and k_cache.shape == v_cache.shape
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in WEIGHT_DTYPES,
        lambda: (
            f"{name}: k_cache and v_cache must be float tensors [S, 1, Hkv, D] of one shape and dtype, got "
            f"{k_cache.dtype} {list(k_cache.shape)} and {v_cache.dtype} {list(v_cache.shape)}"
        ),
    )
    n_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = qkv_weight.shape[0] if qkv_weight.dim() == 2 else -1
    n_q = (rows - 2 * n_kv * head_dim) // head_dim if head_dim else 0
    torch._check(
        _is_weight(qkv_weight, qkv_format, d)
        and n_q >= n_kv >= 1
        and n_q % n_kv == 0
        and rows == (n_q + 2 * n_kv) * head_dim,
        lambda: (
            f"{name}: qkv_weight must be {_weight_kind(qkv_format)} [(Hq + 2 Hkv) D, d={d}] with Hq a multiple of "
            f"Hkv={n_kv} and D={head_dim}, got {qkv_weight.dtype} of shape {list(qkv_weight.shape)}"
        ),
    )
    floats = qkv_format is None and o_format is None  # float weights are one dtype
    torch._check(
        _is_weight(o_weight, o_format, n_q * head_dim)
        and (not floats or o_weight.dtype == qkv_weight.dtype)
        and o_weight.shape[0] == d,
        lambda: (
            f"{name}: o_weight must be {qkv_weight.dtype if floats else _weight_kind(o_format)} "
            f"[d={d}, Hq D={n_q * head_dim}], got {o_weight.dtype} of shape {list(o_weight.shape)}"
        ),
    )
    for bias_name, bias, weight, fmt, n in (
        ("qkv_bias", qkv_bias, qkv_weight, qkv_format, rows),
        ("o_bias", o_bias, o_weight, o_format, d),
    ):
        dtype = weight.dtype if fmt is None else torch.float32
        torch._check(
            bias is None or (bias.dtype == dtype and list(bias.shape) == [n]),
            lambda: f"{name}: {bias_name} must be {dtype} [{n}], got {bias.dtype} of shape {list(bias.shape)}",
        )
    for vec_name, vec, n in (
        ("norm_weight", norm_weight, d),
        ("ffn_norm_weight", ffn_norm_weight, d),
        ("q_norm", q_norm, head_dim),
        ("k_norm", k_norm, head_dim),
        ("cos", cos, head_dim),
        ("sin", sin, head_dim),
    ):
        torch._check(
            vec is None or (vec.dtype == torch.float32 and list(vec.shape) == [n]),
            lambda: f"{name}: {vec_name} must be float32 [{n}], got {vec.dtype} of shape {list(vec.shape)}",
        )
    torch._check((q_norm is None) == (k_norm is None), lambda: f"{name}: give both q_norm and k_norm or neither")
    torch._check(head_dim % 2 == 0, lambda: f"{name}: the head size D={head_dim} must be even (RoPE pairs halves)")
    torch._check(
        0 <= position < k_cache.shape[0],
        lambda: f"{name}: position {position} is outside the cache's {k_cache.shape[0]} tokens",
    )
    tensors = [
        t
        for t in (
            norm_weight,
            qkv_weight,
            qkv_bias,
            q_norm,
            k_norm,
            cos,
            sin,
            k_cache,
            v_cache,
            o_weight,
            o_bias,
            ffn_norm_weight,
        )
        if t is not None
    ]
    torch._check(
        all(t.device == x.device for t in tensors), lambda: f"{name}: every tensor must be on x's device {x.device}"
    )
    return n_q, n_kv, head_dim


def _is_weight(weight: torch.Tensor, fmt: str | None, cols: int) -> bool:
    """Whether `weight` holds `cols` columns as `fmt` says: floats [., cols], or contiguous uint8 rows of blocks."""
    if fmt is None:
        return weight.dim() == 2 and weight.dtype in WEIGHT_DTYPES and weight.shape[1] == cols
    width = BLOCK_FORMATS[fmt].row_bytes(cols)
    return weight.dim() == 2 and weight.dtype == torch.uint8 and weight.is_contiguous() and weight.shape[1] == width


def _weight_kind(fmt: str | None) -> str:
    return "a float tensor" if fmt is None else f"uint8 rows of {fmt} blocks"


def _project(x: torch.Tensor, weight: torch.Tensor, fmt: str | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] float32 times a projection weight (floats, or rows of blocks in `fmt`) -> float32 [1, out]."""
    if fmt is not None:
        return quantized_linear_reference(x, weight, fmt, bias)
    return F.linear(x, weight.float(), None if bias is None else bias.float())


def decoder_attention_reference(
    x,
    norm_weight,
    qkv_weight,
    qkv_bias,
    q_norm,
    k_norm,
    cos,
    sin,
    k_cache,
    v_cache,
    o_weight,
    o_bias,
    ffn_norm_weight,
    position,
    window,
    eps,
    scale,
    qkv_format=None,
    o_format=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch decoder_attention (see the schema's comment): float32 math, the caches written in place."""
    n_q, n_kv, head_dim = _check_decoder_attention_metadata(
        x,
        norm_weight,
        qkv_weight,
        qkv_bias,
        q_norm,
        k_norm,
        cos,
        sin,
        k_cache,
        v_cache,
        o_weight,
        o_bias,
        ffn_norm_weight,
        position,
        qkv_format,
        o_format,
    )
    h = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    qkv = _project(h, qkv_weight, qkv_format, qkv_bias)[0]
    qk = qkv[: (n_q + n_kv) * head_dim].view(n_q + n_kv, head_dim)
    if q_norm is not None:
        qk = torch.cat(
            (F.rms_norm(qk[:n_q], q_norm.shape, q_norm, eps), F.rms_norm(qk[n_q:], k_norm.shape, k_norm, eps))
        )
    half = head_dim // 2
    qk = qk * cos + torch.cat((qk[:, half:], qk[:, :half]), dim=-1) * sin
    k_cache[position, 0] = qk[n_q:]
    v_cache[position, 0] = qkv[(n_q + n_kv) * head_dim :].view(n_kv, head_dim)
    first = 0 if window <= 0 else max(0, position + 1 - window)
    keys, values = k_cache[first : position + 1, 0].float(), v_cache[first : position + 1, 0].float()
    group = n_q // n_kv
    q = qk[:n_q].to(k_cache.dtype).float().view(n_kv, group, head_dim)  # q meets the keys in their dtype
    weights = torch.softmax(torch.einsum("hgd,shd->hgs", q, keys) * scale, dim=-1)
    attn = torch.einsum("hgs,shd->hgd", weights, values).reshape(1, n_q * head_dim)
    out = x + _project(attn, o_weight, o_format, o_bias)
    return out, F.rms_norm(out, ffn_norm_weight.shape, ffn_norm_weight, eps)


@torch.library.impl(LIB, "decoder_attention", "CompositeExplicitAutograd")
def _decoder_attention_default(*args):
    return decoder_attention_reference(*args)


@torch.library.register_fake("flashllm::decoder_attention")
def _decoder_attention_fake(x, *rest):
    _check_decoder_attention_metadata(x, *rest[:13], *rest[16:])  # the tensors, the position and the formats
    return torch.empty_like(x), torch.empty_like(x)


def decoder_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    qkv_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o_weight: torch.Tensor,
    ffn_norm_weight: torch.Tensor,
    *,
    position: int,
    eps: float,
    scale: float,
    window: int = 0,
    qkv_bias: torch.Tensor | None = None,
    o_bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qkv_format: str | None = None,
    o_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a Llama-family decoder layer for one decode token (see the schema's comment).

    x: float32 [1, d]; norm_weight, ffn_norm_weight: float32 [d]; qkv_weight: [(Hq + 2 Hkv) D, d], o_weight
    [d, Hq D] (float32 / float16 / bfloat16, one dtype; biases of it); cos, sin: float32 [D] of this position (sin
    signed: -sin on a head's first half); k_cache, v_cache: [S, 1, Hkv, D], written at `position`; q_norm, k_norm:
    float32 [D] or None; window <= 0: attend to every position <= `position`; qkv_format / o_format: that weight is
    uint8 rows of blocks in this format (ops.BLOCK_FORMATS), its bias float32.
    Returns (x + attention output, its rms_norm by ffn_norm_weight), float32 [1, d] each.
    """
    return torch.ops.flashllm.decoder_attention.default(
        x,
        norm_weight,
        qkv_weight,
        qkv_bias,
        q_norm,
        k_norm,
        cos,
        sin,
        k_cache,
        v_cache,
        o_weight,
        o_bias,
        ffn_norm_weight,
        position,
        window,
        eps,
        scale,
        qkv_format,
        o_format,
    )
