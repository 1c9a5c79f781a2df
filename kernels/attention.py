"""Fused dequant-attention over a packed KV cache, decode and (chunked) prefill.

One kernel serves both: a program owns ``BLOCK_M`` query rows of one (batch, KV head) pair
(rows are ``(token, head of the GQA group)`` pairs, token-major, so each K/V block is
loaded once for all query heads sharing it) and one split of the keys. It dequantizes
K/V blocks in registers, keeps an online softmax in fp32, and writes an unnormalised
partial result; a second kernel combines the splits (flash-decoding). Splitting the keys
is what fills the GPU at decode, where there are only ``batch x kv_heads`` row tiles.

The stored past and the exact new tokens are launched separately (same kernel, codes
compiled out for the new tokens): they use differently rotated queries when
``k_spec.rotate``, and their partial outputs live in different bases when
``v_spec.rotate``, which the launcher undoes on the stored splits' partials before the
combine (rotation is linear, so rotating each split's numerator is exact).

An asymmetric spec's ``scales`` carries the zero point at ``[..., 1]`` (see
:mod:`kvpass.reference`); the kernel loads it next to the scale and dequantizes
``code * scale + zero`` in registers.

fp sinks (``QuantSpec.sinks``) are the first tokens of the stored past, before the codes, read
like the residual; a centered spec's offset (``QuantSpec.center``) is added to every dequantized
code of its head.

Each block loads its mask tile first and skips its K/V when no row of the tile attends to
any of its keys (a ``False`` or ``-inf`` mask entry, or the causal mask): a static cache
is attended over its whole buffer, and the unwritten tail then costs only its mask bytes.
The decision is a device value, so there is no host sync and CUDA graphs can replay it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvpass import reference
from kvpass.config import QuantSpec

IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_MASK_NONE, _MASK_BOOL, _MASK_ADDITIVE = 0, 1, 2


def _keep(config: triton.Config) -> bool:
    # Eight warps only pay for themselves on blocks big enough to give each warp work.
    return not (config.kwargs["BLOCK_N"] < 64 and config.num_warps == 8)


if _INTERPRET:
    # The interpreter runs every config it benchmarks; one small block keeps tests fast.
    _CONFIGS = [triton.Config({"BLOCK_N": 32}, num_warps=1, num_stages=1)]
elif os.environ.get("KVPASS_AUTOTUNE", "1") == "0":
    # Every new shape class otherwise compiles all configs; correctness checks over many
    # shapes set KVPASS_AUTOTUNE=0 to stay fast.
    _CONFIGS = [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2)]
else:
    _CONFIGS = [
        config
        for config in [
            triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
            for block_n in (32, 64, 128)
            for warps in (4, 8)
            for stages in (2, 3)
        ]
        if _keep(config)
    ]

# Keys per split are a multiple of this, so every split is whole blocks of every config.
# Under the interpreter a small value makes small test shapes exercise many splits.
_SPLIT_ALIGN = 32 if _INTERPRET else 256


@triton.jit
def _unpack(packed, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """``int32 [N, D // (8 // BITS)]`` packed bytes -> codes ``[N, D]``, lowest field first:
    signed (the field minus ``2**(BITS-1)``) when ``SIGNED``, else the unsigned field."""
    if BITS == 8:
        codes = packed
    elif BITS == 4:
        codes = tl.interleave(packed & 15, packed >> 4)
    else:
        # interleave(interleave(f0, f2), interleave(f1, f3)) orders the fields f0 f1 f2 f3.
        codes = tl.interleave(
            tl.interleave(packed & 3, (packed >> 4) & 3),
            tl.interleave((packed >> 2) & 3, packed >> 6),
        )
    if SIGNED:
        codes = codes - (1 << (BITS - 1))
    return codes


@triton.jit
def _load_block(
    C, stride_cs, stride_cd,
    SC, stride_ss, stride_sd, stride_sz,
    RES, stride_rs, stride_rd,
    FC, stride_fcs, stride_fcd,
    FSC, stride_fss, stride_fsd, stride_fsz,
    HD, stride_hs, stride_hd,
    OFF, stride_od,
    pos, key_ok, n_head, n_quant, n_fine, dim,
    HAS_CODES: tl.constexpr, BITS: tl.constexpr, CHANNEL: tl.constexpr, GROUP: tl.constexpr,
    ASYM: tl.constexpr, FINE: tl.constexpr, HEAD: tl.constexpr, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Tokens ``pos`` of one head as fp32 ``[BLOCK_N, BLOCK_D]``: with ``HEAD``, the
    unquantized sinks ``HD`` below ``n_head``; then codes x scales (+ zero points, ``stride_sz``
    past each scale, when ``ASYM``; + the offset ``OFF`` when ``OFFSET``) for ``n_quant``
    tokens; the unquantized tensor ``RES`` after them; zero where not ``key_ok``. With ``FINE``
    (per-token groups), the newest ``n_fine`` quantized tokens add their second code plane ``FC x FSC``."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    code_pos = pos - n_head
    in_res = key_ok & (code_pos >= n_quant)
    x = tl.load(
        RES + (code_pos - n_quant)[:, None] * stride_rs + offs_d[None, :] * stride_rd,
        mask=in_res[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HEAD:
        in_head = key_ok & (pos < n_head)
        # Disjoint from the residual's rows, which loaded zeros here.
        x += tl.load(
            HD + pos[:, None] * stride_hs + offs_d[None, :] * stride_hd,
            mask=in_head[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
    if HAS_CODES:
        PER_BYTE: tl.constexpr = 8 // BITS
        in_codes = key_ok & (code_pos >= 0) & (code_pos < n_quant)
        offs_byte = tl.arange(0, BLOCK_D // PER_BYTE)
        packed = tl.load(
            C + code_pos[:, None] * stride_cs + offs_byte[None, :] * stride_cd,
            mask=in_codes[:, None] & (offs_byte < dim // PER_BYTE)[None, :],
            other=0,
        ).to(tl.int32)
        if CHANNEL:
            scale_ptrs = SC + (code_pos // GROUP)[:, None] * stride_ss + offs_d[None, :] * stride_sd
        else:
            scale_ptrs = SC + code_pos[:, None] * stride_ss + (offs_d // GROUP)[None, :] * stride_sd
        param_ok = in_codes[:, None] & d_ok[None, :]
        scale = tl.load(scale_ptrs, mask=param_ok, other=0.0).to(tl.float32)
        deq = _unpack(packed, BITS, not ASYM).to(tl.float32) * scale
        if ASYM:
            deq += tl.load(scale_ptrs + stride_sz, mask=param_ok, other=0.0).to(tl.float32)
        if FINE:
            fine_pos = code_pos - (n_quant - n_fine)
            in_fine = in_codes & (fine_pos >= 0)
            fine_packed = tl.load(
                FC + fine_pos[:, None] * stride_fcs + offs_byte[None, :] * stride_fcd,
                mask=in_fine[:, None] & (offs_byte < dim // PER_BYTE)[None, :],
                other=0,
            ).to(tl.int32)
            fine_scale_ptrs = FSC + fine_pos[:, None] * stride_fss + (offs_d // GROUP)[None, :] * stride_fsd
            fine_ok = in_fine[:, None] & d_ok[None, :]
            fine = _unpack(fine_packed, BITS, not ASYM).to(tl.float32) * tl.load(
                fine_scale_ptrs, mask=fine_ok, other=0.0
            ).to(tl.float32)
            if ASYM:
                fine += tl.load(fine_scale_ptrs + stride_fsz, mask=fine_ok, other=0.0).to(tl.float32)
            deq += tl.where(fine_ok, fine, 0.0)
        if OFFSET:
            deq += tl.load(OFF + offs_d * stride_od, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = tl.where(in_codes[:, None], deq, x)
    return x


@triton.autotune(
    configs=_CONFIGS,
    key=[
        "BLOCK_M", "BLOCK_D", "BLOCK_DV", "HAS_CODES", "K_BITS", "V_BITS", "K_CHANNEL", "V_CHANNEL",
        "K_ASYM", "V_ASYM", "K_FINE", "V_FINE", "K_HEAD", "V_HEAD", "K_OFFSET", "V_OFFSET", "MASK_KIND", "IS_CAUSAL",
        "SOFTCAP",
    ],
)
@triton.jit
def _partial_attention_kernel(
    Q, stride_qb, stride_qh, stride_qt, stride_qd,
    KC, stride_kcb, stride_kch, stride_kcs, stride_kcd,
    KS, stride_ksb, stride_ksh, stride_kss, stride_ksd, stride_ksz,
    KR, stride_krb, stride_krh, stride_krs, stride_krd,
    VC, stride_vcb, stride_vch, stride_vcs, stride_vcd,
    VS, stride_vsb, stride_vsh, stride_vss, stride_vsd, stride_vsz,
    VR, stride_vrb, stride_vrh, stride_vrs, stride_vrd,
    KF, stride_kfb, stride_kfh, stride_kfs, stride_kfd,
    KFS, stride_kfsb, stride_kfsh, stride_kfss, stride_kfsd, stride_kfsz,
    VF, stride_vfb, stride_vfh, stride_vfs, stride_vfd,
    VFS, stride_vfsb, stride_vfsh, stride_vfss, stride_vfsd, stride_vfsz,
    KH, stride_khb, stride_khh, stride_khs, stride_khd,
    KO, stride_kob, stride_koh, stride_kod,
    VH, stride_vhb, stride_vhh, stride_vhs, stride_vhd,
    VO, stride_vob, stride_voh, stride_vod,
    MASK, stride_mb, stride_mh, stride_mt, stride_mn,
    M_OUT, L_OUT, ACC_OUT,
    n_kv_heads, rep, n_rows, head_dim, head_dim_v,
    n_keys, n_head_k, n_head_v, n_quant_k, n_quant_v, n_fine_k, n_fine_v, col_offset, split_len, split_base,
    n_splits_total, sm_scale, softcap,
    HAS_CODES: tl.constexpr, SOFTCAP: tl.constexpr,
    K_BITS: tl.constexpr, K_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr, K_ASYM: tl.constexpr, K_FINE: tl.constexpr,
    K_HEAD: tl.constexpr, K_OFFSET: tl.constexpr,
    V_BITS: tl.constexpr, V_CHANNEL: tl.constexpr, V_GROUP: tl.constexpr, V_ASYM: tl.constexpr, V_FINE: tl.constexpr,
    V_HEAD: tl.constexpr, V_OFFSET: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kv_head = (pid_bh % n_kv_heads).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = rows // rep
    q_head = kv_head * rep + rows % rep
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + q_head[:, None] * stride_qh + tok[:, None] * stride_qt + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    KC += b * stride_kcb + kv_head * stride_kch
    KS += b * stride_ksb + kv_head * stride_ksh
    KR += b * stride_krb + kv_head * stride_krh
    VC += b * stride_vcb + kv_head * stride_vch
    VS += b * stride_vsb + kv_head * stride_vsh
    VR += b * stride_vrb + kv_head * stride_vrh
    KF += b * stride_kfb + kv_head * stride_kfh
    KFS += b * stride_kfsb + kv_head * stride_kfsh
    VF += b * stride_vfb + kv_head * stride_vfh
    VFS += b * stride_vfsb + kv_head * stride_vfsh
    KH += b * stride_khb + kv_head * stride_khh
    KO += b * stride_kob + kv_head * stride_koh
    VH += b * stride_vhb + kv_head * stride_vhh
    VO += b * stride_vob + kv_head * stride_voh
    mask_rows = MASK + b * stride_mb + q_head * stride_mh + tok * stride_mt

    lo = pid_split * split_len
    hi = tl.minimum(lo + split_len, n_keys)
    if IS_CAUSAL:
        # Top-left causal: no row of this tile sees a column past its last token.
        last_tok = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // rep
        hi = tl.minimum(hi, last_tok + 1 - col_offset)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        cols = col_offset + pos
        attend = key_ok[None, :]
        if IS_CAUSAL:
            attend = attend & (cols[None, :] <= tok[:, None])
        mask_ptrs = mask_rows[:, None] + cols[None, :] * stride_mn
        tile_ok = row_ok[:, None] & key_ok[None, :]
        if MASK_KIND == 1:
            attend = attend & (tl.load(mask_ptrs, mask=tile_ok, other=0) != 0)
        seen = attend & tile_ok
        if MASK_KIND == 2:
            bias = tl.load(mask_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
            seen = seen & (bias != float("-inf"))
        # Decided on the device from the mask tile (no host sync): a block no row of this tile
        # attends to, such as a static cache's unwritten tail, is never loaded nor dequantized.
        if tl.max(seen.to(tl.int32)) != 0:
            k = _load_block(
                KC, stride_kcs, stride_kcd, KS, stride_kss, stride_ksd, stride_ksz, KR, stride_krs, stride_krd,
                KF, stride_kfs, stride_kfd, KFS, stride_kfss, stride_kfsd, stride_kfsz,
                KH, stride_khs, stride_khd, KO, stride_kod,
                pos, key_ok, n_head_k, n_quant_k, n_fine_k, head_dim,
                HAS_CODES, K_BITS, K_CHANNEL, K_GROUP, K_ASYM, K_FINE, K_HEAD, K_OFFSET, BLOCK_D,
            ).to(DOT_DTYPE)
            if DOT_DTYPE == tl.float32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale
            if SOFTCAP:
                # softcap * tanh(s / softcap), with tanh from one exp of a non-positive number
                e = tl.exp(-2.0 * tl.abs(s) / softcap)
                s = tl.where(s >= 0, 1.0, -1.0) * softcap * (1.0 - e) / (1.0 + e)
            s = tl.where(attend, s, float("-inf"))
            if MASK_KIND == 2:
                s += bias

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen only -inf keeps m = -inf; exp(-inf - -inf) would be NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            correction = tl.exp(m_i - m_safe)
            l_i = l_i * correction + tl.sum(p, axis=1)
            v = _load_block(
                VC, stride_vcs, stride_vcd, VS, stride_vss, stride_vsd, stride_vsz, VR, stride_vrs, stride_vrd,
                VF, stride_vfs, stride_vfd, VFS, stride_vfss, stride_vfsd, stride_vfsz,
                VH, stride_vhs, stride_vhd, VO, stride_vod,
                pos, key_ok, n_head_v, n_quant_v, n_fine_v, head_dim_v,
                HAS_CODES, V_BITS, V_CHANNEL, V_GROUP, V_ASYM, V_FINE, V_HEAD, V_OFFSET, BLOCK_DV,
            ).to(DOT_DTYPE)
            if DOT_DTYPE == tl.float32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(DOT_DTYPE), v)
            acc = acc * correction[:, None] + pv
            m_i = m_new

    slot = (pid_bh * n_splits_total + split_base + pid_split).to(tl.int64) * n_rows + rows
    tl.store(M_OUT + slot, m_i, mask=row_ok)
    tl.store(L_OUT + slot, l_i, mask=row_ok)
    tl.store(
        ACC_OUT + slot[:, None] * head_dim_v + offs_dv[None, :],
        acc,
        mask=row_ok[:, None] & (offs_dv < head_dim_v)[None, :],
    )


@triton.jit
def _combine_kernel(
    M_IN, L_IN, ACC_IN,
    OUT, stride_ob, stride_oh, stride_ot, stride_od,
    n_kv_heads, rep, n_rows, head_dim_v, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kv_head = (pid_bh % n_kv_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    offs_dv = tl.arange(0, BLOCK_DV)
    tile_ok = row_ok[:, None] & (offs_dv < head_dim_v)[None, :]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for split in range(0, n_splits):
        slot = (pid_bh * n_splits + split).to(tl.int64) * n_rows + rows
        m_split = tl.load(M_IN + slot, mask=row_ok, other=float("-inf"))
        l_split = tl.load(L_IN + slot, mask=row_ok, other=0.0)
        acc_split = tl.load(ACC_IN + slot[:, None] * head_dim_v + offs_dv[None, :], mask=tile_ok, other=0.0)
        m_new = tl.maximum(m, m_split)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old_weight = tl.exp(m - m_safe)
        split_weight = tl.exp(m_split - m_safe)
        l = l * old_weight + l_split * split_weight
        acc = acc * old_weight[:, None] + acc_split * split_weight[:, None]
        m = m_new

    # A row with no key to attend (l = 0) is zero, as in torch's SDPA and the reference;
    # a NaN sum (a poisoned stored group) stays NaN.
    has_keys = l != 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l, 1.0)[:, None], 0.0)
    tok = rows // rep
    q_head = kv_head * rep + rows % rep
    tl.store(
        OUT + b * stride_ob + q_head[:, None] * stride_oh + tok[:, None] * stride_ot + offs_dv[None, :] * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=tile_ok,
    )


def _check_stored(name, codes, scales, residual, spec: QuantSpec, B, Hkv, dim, device):
    """Validate one stored tensor against the reference layout; returns its token count."""
    per_byte = 8 // spec.bits
    if codes.dtype != torch.uint8 or codes.dim() != 4 or tuple(codes.shape[:2]) != (B, Hkv) or codes.shape[3] * per_byte != dim:
        raise ValueError(
            f"{name}_codes must be uint8 [{B}, {Hkv}, S, {dim * spec.bits // 8}] for {spec.bits}-bit codes "
            f"of head_dim {dim}, got {codes.dtype} {list(codes.shape)}"
        )
    n_quant = codes.shape[2]
    if spec.scheme == "token":
        scales_shape = (B, Hkv, n_quant, dim // spec.token_group(dim))
    else:
        if n_quant % spec.group:
            raise ValueError(f"{name}_codes holds {n_quant} tokens, not whole groups of {spec.group} (scheme 'channel')")
        scales_shape = (B, Hkv, n_quant // spec.group, dim)
    if not spec.symmetric:
        scales_shape = (*scales_shape, 2)  # (scale, zero point)
    if tuple(scales.shape) != scales_shape or not scales.is_floating_point():
        raise ValueError(f"{name}_scales must be float {list(scales_shape)}, got {scales.dtype} {list(scales.shape)}")
    if residual.dim() != 4 or tuple(residual.shape[:2]) != (B, Hkv) or residual.shape[3] != dim:
        raise ValueError(f"{name}_residual must be [{B}, {Hkv}, R, {dim}], got {list(residual.shape)}")
    for tensor_name, tensor in (("codes", codes), ("scales", scales), ("residual", residual)):
        if tensor.device != device:
            raise ValueError(f"{name}_{tensor_name} is on {tensor.device}, q on {device}; all must share a device")
    return n_quant + residual.shape[2]


def _check_fine(name, fine_codes, fine_scales, codes, scales, spec: QuantSpec):
    """Validate a second code plane against its codes and scales; ``(codes, scales)`` or None."""
    if fine_codes is None and fine_scales is None:
        return None
    if fine_codes is None or fine_scales is None or spec.scheme != "token":
        raise ValueError(f"{name}_fine_codes and {name}_fine_scales come together, for per-token groups only")
    rows = fine_codes.shape[2] if fine_codes.dim() == 4 else -1
    for plane, whole in ((fine_codes, codes), (fine_scales, scales)):
        expected = (*whole.shape[:2], rows, *whole.shape[3:])
        if tuple(plane.shape) != expected or plane.dtype != whole.dtype or plane.device != whole.device or rows > codes.shape[2]:
            raise ValueError(
                f"{name}'s second code plane must be laid out like its codes and scales for at most "
                f"{codes.shape[2]} tokens: got {list(fine_codes.shape)} / {list(fine_scales.shape)} "
                f"for {list(codes.shape)} / {list(scales.shape)}"
            )
    return fine_codes, fine_scales


def _check_sinks(name, head, offset, B, Hkv, dim, device):
    """Validate fp sinks and a centered spec's offset; ``(head, offset)``, None where absent. Either
    with no rows (a cache whose first append took none) reads as absent: decode blocks then skip
    the head's masked loads and the offset's add."""
    if head is not None:
        if head.dim() != 4 or tuple(head.shape[:2]) != (B, Hkv) or head.shape[3] != dim or not head.is_floating_point():
            raise ValueError(f"{name}_head must be float [{B}, {Hkv}, S_h, {dim}], got {head.dtype} {list(head.shape)}")
        if head.device != device:
            raise ValueError(f"{name}_head is on {head.device}, q on {device}; all must share a device")
        head = head if head.shape[2] else None
    if offset is not None:
        rows = offset.shape[2] if offset.dim() == 4 else -1
        if tuple(offset.shape) != (B, Hkv, rows, dim) or rows not in (0, 1):
            raise ValueError(
                f"{name}_offset must be [{B}, {Hkv}, 1, {dim}] ([{B}, {Hkv}, 0, {dim}] where the cache has none), "
                f"got {list(offset.shape)}"
            )
        if offset.device != device:
            raise ValueError(f"{name}_offset is on {offset.device}, q on {device}; all must share a device")
        offset = offset if rows else None
    return head, offset


def _head_args(head, fallback: torch.Tensor) -> tuple:
    """Pointer and strides of fp sinks (``fallback``, never read, without them)."""
    return (fallback, 0, 0, 0, 0) if head is None else (head, *head.stride())


def _offset_args(offset, fallback: torch.Tensor) -> tuple:
    """Pointer and (batch, head, channel) strides of an offset (``fallback``, never read, without one)."""
    return (fallback, 0, 0, 0) if offset is None else (offset, offset.stride(0), offset.stride(1), offset.stride(3))


def _rows(t) -> int:
    return 0 if t is None else t.shape[2]


def _fine_rows(fine) -> int:
    return 0 if fine is None else fine[0].shape[2]


def _fine_args(fine, spec: QuantSpec, codes: torch.Tensor, scales: torch.Tensor) -> tuple:
    """Pointers and strides of a second code plane (of ``codes``/``scales``, never read, without one)."""
    if fine is None:
        return (codes, 0, 0, 0, 0, scales, 0, 0, 0, 0, 0)
    fine_codes, fine_scales = fine
    return (fine_codes, *fine_codes.stride(), fine_scales, *_scale_strides(fine_scales, spec))


def _scale_strides(scales: torch.Tensor, spec: QuantSpec) -> tuple[int, ...]:
    """Strides of ``scales`` over (B, H, S or S // g, D // g or D, scale/zero); the last is 0
    (never used) for a symmetric spec, whose scales have no zero points."""
    return scales.stride() if not spec.symmetric else (*scales.stride(), 0)


def _num_programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        # Two resident programs per SM hide the latency of one's loads behind the other's math.
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _split(n_keys: int, programs_per_split: int, wanted: int) -> tuple[int, int]:
    """``(keys per split, number of splits)`` for ``n_keys`` keys."""
    if n_keys == 0:
        return _SPLIT_ALIGN, 0
    splits = max(1, triton.cdiv(wanted, programs_per_split))
    split_len = triton.cdiv(triton.cdiv(n_keys, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN
    return split_len, triton.cdiv(n_keys, split_len)


def attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    k_residual: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    v_residual: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    softcap: float = 0.0,
    k_fine_codes: torch.Tensor | None = None,
    k_fine_scales: torch.Tensor | None = None,
    v_fine_codes: torch.Tensor | None = None,
    v_fine_scales: torch.Tensor | None = None,
    k_head: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    v_head: torch.Tensor | None = None,
    v_offset: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of ``q`` over ``[stored past, new]``, as :func:`kvpass.reference.attention`.

    ``q [B, Hq, T, D]``; the stored past (codes/scales/residual of K and V in the layouts of
    :mod:`kvpass.reference`) holds ``P`` tokens; ``k_new``/``v_new [B, Hkv, T_new, D]`` are
    exact. ``Hq`` a multiple of ``Hkv``; ``attn_mask`` (bool: True attends; float: added)
    broadcasts to ``[B, Hq, T, P + T_new]``; ``is_causal`` is SDPA's top-left causal mask.
    ``softcap > 0`` soft-caps the scaled scores. ``*_fine_*``: the second code plane of a
    refined per-token spec, laid out like its codes and scales, for the newest quantized tokens.
    ``*_head`` (fp sinks, before the codes) and ``*_offset`` (``[B, Hkv, 1, D]``, added to every
    dequantized code): see :func:`kvpass.reference.attention`.
    ``out [B, Hq, T, Dv]`` (any strides, dtype of ``q``) receives the result if given.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, T, D], got shape {list(q.shape)}")
    if q.dtype not in IO_DTYPES:
        raise ValueError(f"q dtype must be one of {IO_DTYPES}, got {q.dtype}")
    B, Hq, T, D = q.shape
    for spec in (k_spec, v_spec):
        if spec.span_heads:
            raise ValueError(
                f"{spec.tag}: groups spanning heads are read by kvpass.reference; the kernel's are within a head"
            )
    if k_new.dim() != 4 or v_new.dim() != 4 or k_new.shape[:3] != v_new.shape[:3] or k_new.shape[0] != B or k_new.shape[3] != D:
        raise ValueError(
            f"k_new must be [{B}, Hkv, T_new, {D}] and v_new [{B}, Hkv, T_new, Dv] with the same Hkv and "
            f"T_new, got {list(k_new.shape)} and {list(v_new.shape)}"
        )
    Hkv, T_new, Dv = k_new.shape[1], k_new.shape[2], v_new.shape[3]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    k_head, k_offset = _check_sinks("k", k_head, k_offset, B, Hkv, D, q.device)
    v_head, v_offset = _check_sinks("v", v_head, v_offset, B, Hkv, Dv, q.device)
    past_k = _rows(k_head) + _check_stored("k", k_codes, k_scales, k_residual, k_spec, B, Hkv, D, q.device)
    past_v = _rows(v_head) + _check_stored("v", v_codes, v_scales, v_residual, v_spec, B, Hkv, Dv, q.device)
    if past_k != past_v:
        raise ValueError(f"stored K holds {past_k} tokens and stored V {past_v}; they must match")
    k_fine = _check_fine("k", k_fine_codes, k_fine_scales, k_codes, k_scales, k_spec)
    v_fine = _check_fine("v", v_fine_codes, v_fine_scales, v_codes, v_scales, v_spec)
    past = past_k
    total = past + T_new
    rep = Hq // Hkv
    n_rows = rep * T

    if out is None:
        out = torch.empty(B, Hq, T, Dv, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (B, Hq, T, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} [{B}, {Hq}, {T}, {Dv}] on {q.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if out.numel() == 0:
        return out

    if attn_mask is None:
        mask_kind, mask = _MASK_NONE, q
        mask_strides = (0, 0, 0, 0)
    else:
        try:
            mask = attn_mask.expand(B, Hq, T, total)
        except RuntimeError as err:
            raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to {[B, Hq, T, total]}") from err
        if mask.device != q.device:
            raise ValueError(f"attn_mask is on {mask.device}, q on {q.device}")
        if mask.dtype == torch.bool:
            # Triton loads bool tensors as bytes; a same-size view keeps the broadcast strides.
            mask_kind, mask = _MASK_BOOL, mask.view(torch.uint8)
        elif mask.is_floating_point():
            mask_kind = _MASK_ADDITIVE
        else:
            raise ValueError(f"attn_mask must be bool or floating point, got {mask.dtype}")
        mask_strides = mask.stride()

    block_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(Dv))
    row_tiles = triton.cdiv(n_rows, block_m)
    wanted = _num_programs_wanted(q.device)
    past_split_len, past_splits = _split(past, row_tiles * B * Hkv, wanted)
    new_split_len, new_splits = _split(T_new, row_tiles * B * Hkv, wanted)
    n_splits = past_splits + new_splits

    partial_m = torch.empty(B * Hkv, n_splits, n_rows, dtype=torch.float32, device=q.device)
    partial_l = torch.empty_like(partial_m)
    partial_acc = torch.empty(B * Hkv, n_splits, n_rows, Dv, dtype=torch.float32, device=q.device)
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q.dtype]
    if _INTERPRET and dot_dtype == tl.bfloat16:
        # Triton 3.9's interpreter returns garbage for bf16 tl.dot; fp32 operands are the
        # closest it can check (the bf16 rounding of the operands is then only on GPU).
        dot_dtype = tl.float32
    common = dict(
        MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), DOT_DTYPE=dot_dtype, SOFTCAP=softcap > 0,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_DV=block_dv,
        K_BITS=k_spec.bits, K_CHANNEL=k_spec.scheme == "channel", K_ASYM=not k_spec.symmetric,
        V_BITS=v_spec.bits, V_CHANNEL=v_spec.scheme == "channel", V_ASYM=not v_spec.symmetric,
    )
    sizes = (Hkv, rep, n_rows, D, Dv)

    if past_splits:
        # Scores are invariant under rotating q and k alike, so the stored (rotated) keys
        # meet a rotated query.
        q_stored = reference.rotate(q.float()) if k_spec.rotate else q
        _partial_attention_kernel[(row_tiles, B * Hkv, past_splits)](
            q_stored, *q_stored.stride(),
            k_codes, *k_codes.stride(), k_scales, *_scale_strides(k_scales, k_spec), k_residual, *k_residual.stride(),
            v_codes, *v_codes.stride(), v_scales, *_scale_strides(v_scales, v_spec), v_residual, *v_residual.stride(),
            *_fine_args(k_fine, k_spec, k_codes, k_scales), *_fine_args(v_fine, v_spec, v_codes, v_scales),
            *_head_args(k_head, k_codes), *_offset_args(k_offset, k_codes),
            *_head_args(v_head, v_codes), *_offset_args(v_offset, v_codes),
            mask, *mask_strides,
            partial_m, partial_l, partial_acc,
            *sizes,
            past, _rows(k_head), _rows(v_head), k_codes.shape[2], v_codes.shape[2], _fine_rows(k_fine),
            _fine_rows(v_fine), 0, past_split_len, 0, n_splits, float(scale), float(softcap),
            HAS_CODES=True, K_FINE=k_fine is not None, V_FINE=v_fine is not None,
            K_HEAD=k_head is not None, K_OFFSET=k_offset is not None,
            V_HEAD=v_head is not None, V_OFFSET=v_offset is not None,
            K_GROUP=k_spec.token_group(D) if k_spec.scheme == "token" else k_spec.group,
            V_GROUP=v_spec.token_group(Dv) if v_spec.scheme == "token" else v_spec.group,
            **common,
        )
        if v_spec.rotate:
            stored_acc = partial_acc[:, :past_splits]
            stored_acc.copy_(stored_acc @ reference.hadamard(Dv, q.device))
    if new_splits:
        # The new tokens are an unquantized "residual" with no codes before it.
        _partial_attention_kernel[(row_tiles, B * Hkv, new_splits)](
            q, *q.stride(),
            k_new, 0, 0, 0, 0, k_new, 0, 0, 0, 0, 0, k_new, *k_new.stride(),
            v_new, 0, 0, 0, 0, v_new, 0, 0, 0, 0, 0, v_new, *v_new.stride(),
            *_fine_args(None, k_spec, k_new, k_new), *_fine_args(None, v_spec, v_new, v_new),
            *_head_args(None, k_new), *_offset_args(None, k_new), *_head_args(None, v_new), *_offset_args(None, v_new),
            mask, *mask_strides,
            partial_m, partial_l, partial_acc,
            *sizes,
            T_new, 0, 0, 0, 0, 0, 0, past, new_split_len, past_splits, n_splits,
            float(scale), float(softcap),
            HAS_CODES=False, K_GROUP=1, V_GROUP=1, K_FINE=False, V_FINE=False,
            K_HEAD=False, K_OFFSET=False, V_HEAD=False, V_OFFSET=False,
            **common,
        )

    _combine_kernel[(row_tiles, B * Hkv)](
        partial_m, partial_l, partial_acc,
        out, *out.stride(),
        Hkv, rep, n_rows, Dv, n_splits,
        BLOCK_M=block_m, BLOCK_DV=block_dv,
    )
    return out
