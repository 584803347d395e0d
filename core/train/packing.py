"""Packed trainer forwards: a micro-batch's real tokens end to end in few rows, and each distinct prompt once.

A GRPO group is G completions of one prompt. Padded, a micro-batch computes every prompt G times and every
row to the longest one's width. Packed, the rows' real tokens sit end to end in rows of at least
`pack_width` tokens (256 on a GPU, less on a CPU); rows that share their prompt (the tokens before their
first scored one) share one copy of it, per unit of at most that many tokens: the unit [prompt, completion 1,
..., completion k] costs P + sum(C_i) tokens instead of k * P + sum(C_i). Each completion attends to its prompt
and to itself (a 4D mask; its positions continue from the prompt's), so every log-prob and gradient is the padded
batch's (tested to float rounding); the shared prompt's gradient is the sum over its completions, as it is when
the prompt is repeated.

Without shared prompts (or for a model whose attention ignores a 4D mask) the units are single rows and
the separation is transformers' own: position ids that restart at each sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from alignflow.core.train import varlen
from alignflow.core.train.logits import logprobs_and_entropy, logprobs_from_logits

log = logging.getLogger(__name__)

CPU_ROWS = 4  # packed rows on a CPU come in multiples of this (pack_shape)
PACK_WIDTH = 256  # tokens per packed row at least (on a GPU): attention over it costs little beside the matmuls


def pack_shape(model) -> tuple[int, int]:
    """(width, row multiple) of the packed rows. On a CPU the rows are padded to a multiple of CPU_ROWS: the CPU's
    matmul library (oneDNN) builds and keeps kernels for each matrix shape it meets (~0.5 MB each here, ~13 per
    row count), so a row count free to take any value grew a stage's memory by ~90 MB over 10 steps and spent
    time building kernels; padded, the tiny model's step took no longer."""
    return pack_width(model), 1 if _on_gpu(model) else CPU_ROWS


def pack_width(model) -> int:
    """Tokens per packed row. A packed row's attention is dense over its whole width (the 4D mask only hides
    what a token may not see), so it costs ~4·W·H FLOPs a token per layer against ~24·H² for the matmuls. GPU
    kernels make that small at PACK_WIDTH; on a CPU W = H/2 holds it near 8% (tiny model: 64, not 256:
    its packed update ran 1.2-1.5x slower at 256 than unpacked). Groups longer than W are split into units
    that each hold a copy of the prompt."""
    model = _unwrap(model)
    if _on_gpu(model):
        return PACK_WIDTH
    hidden = getattr(getattr(model, "config", None), "hidden_size", 2 * PACK_WIDTH)
    return max(32, min(PACK_WIDTH, hidden // 2))


def _unwrap(model):
    return getattr(model, "module", model)  # a DeepSpeed engine's module


def _on_gpu(model) -> bool:
    return next(_unwrap(model).parameters()).device.type != "cpu"


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Items into bins of `width` tokens, first fit in decreasing length: each bin's items, in order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        slot = next((i for i, free in enumerate(room) if free >= lengths[row]), None)
        if slot is None:
            bins.append([])
            room.append(width)
            slot = len(bins) - 1
        bins[slot].append(row)
        room[slot] -= lengths[row]
    return bins


@dataclass
class Layout:
    """Where every real token of a [B, T] batch sits in the packed [R, W] rows."""

    rows: int
    width: int
    source: Tensor  # [N] flat [B*T] index of each packed token's id
    target: Tensor  # [N] flat [R*W] packed index it goes to
    positions: Tensor  # [R*W] position ids
    at: Tensor  # [B*T] flat packed index of each real token (a shared prompt's tokens: the shared copy), else -1
    unit: Tensor | None = None  # [R*W] which unit (prompt + its completions) a packed token belongs to
    segment: Tensor | None = None  # [R*W] -1 on a unit's prompt, else the completion's own row


def units_of(ids: list[list[int]], starts: list[int], lengths: list[int], prompts: list[int] | None,
             width: int = 1 << 30):
    """Rows grouped by equal prompt tokens (`prompts`: each row's prompt length; None: no sharing), a group
    split into units of at most `width` tokens (its prompt once, then its completions) where it is longer."""
    if prompts is None:
        return [[b] for b in range(len(lengths))]
    found: dict[tuple, list[int]] = {}
    for b, (s, p) in enumerate(zip(starts, prompts)):
        found.setdefault((p, tuple(ids[b][s: s + p])), []).append(b)
    units: list[list[int]] = []
    for group in found.values():
        p, size = prompts[group[0]], None
        for b in group:
            if size is None or size + lengths[b] - p > width:
                units.append([])
                size = p
            units[-1].append(b)
            size += lengths[b] - p
    return units


def layout(input_ids: Tensor, attention_mask: Tensor, prompts: list[int] | None, width: int = PACK_WIDTH,
           row_multiple: int = 1) -> Layout:
    """Pack the rows in rows of `width` tokens (wider where one sequence is), a multiple of `row_multiple` rows;
    with `prompts` (each row's prompt length) rows with equal prompts share one copy per unit of at most `width`
    tokens. Built in Python lists (a micro-batch's few thousand indices), then moved to the device at once."""
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    starts = attention_mask.int().argmax(-1).tolist()  # first real token of each row
    units = units_of(input_ids.tolist() if prompts is not None else [], starts, lengths, prompts, width)
    shared = [0 if len(u) == 1 else prompts[u[0]] for u in units]  # prompt tokens stored once per unit
    sizes = [p + sum(lengths[b] - p for b in u) for u, p in zip(units, shared)]
    W = max(max(sizes), width)
    bins = pack_rows(sizes, W)
    bins += [[] for _ in range(-len(bins) % row_multiple)]  # empty rows: each one causal sequence of padding
    src, dst, pos, unit_of, seg = [], [], [], [], []
    at = [-1] * (B * T)

    def put(first: int, n: int, offset: int, position: int, u: int, segment: int) -> None:
        src.extend(range(first, first + n)), dst.extend(range(offset, offset + n))
        pos.extend(range(position, position + n)), unit_of.extend([u] * n), seg.extend([segment] * n)

    for r, members in enumerate(bins):
        offset = r * W
        for u in members:
            p = shared[u]
            if p:
                first = units[u][0] * T + starts[units[u][0]]
                put(first, p, offset, 0, u, -1)
                for b in units[u]:
                    at[b * T + starts[b]: b * T + starts[b] + p] = range(offset, offset + p)
                offset += p
            for b in units[u]:
                n, rest = lengths[b] - p, b * T + starts[b] + p
                put(rest, n, offset, p, u, b)
                at[rest: rest + n] = range(offset, offset + n)
                offset += n
        free = (r + 1) * W - offset  # the free tail: one more causal sequence of its own
        pos.extend(range(free)), unit_of.extend([-1 - r] * free), seg.extend([-1] * free)
    long = dict(dtype=torch.long, device=input_ids.device)
    out = Layout(len(bins), W, torch.tensor(src, **long), torch.tensor(dst, **long), torch.tensor(pos, **long),
                 torch.tensor(at, **long))
    if any(shared):
        out.unit, out.segment = torch.tensor(unit_of, **long), torch.tensor(seg, **long)
    return out


def attention_bias(lay: Layout, dtype: torch.dtype) -> Tensor:
    """[R, 1, W, W] additive mask: a token sees the earlier tokens of its unit's prompt and of its own segment."""
    unit, seg = lay.unit.view(lay.rows, lay.width), lay.segment.view(lay.rows, lay.width)
    index = torch.arange(lay.width, device=unit.device)
    allowed = (unit[:, :, None] == unit[:, None, :]) & (index[None, :, None] >= index[None, None, :])
    allowed &= (seg[:, None, :] == -1) | (seg[:, :, None] == seg[:, None, :])
    bias = torch.zeros(allowed.shape, dtype=dtype, device=unit.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def packed_token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, mask: Tensor, temperature: float,
                          return_entropy: bool, share_prompts: bool = True):
    """`token_logprobs` on packed rows (see the module docstring). `mask` [B, T]: the scored tokens; a row's
    prompt is its real tokens before its first scored one. Real tokens of a row must be contiguous."""
    B, T = input_ids.shape
    device = input_ids.device
    prompts = None
    if share_prompts and masks_work(model):
        start = attention_mask.int().argmax(-1)
        first = torch.where(mask.any(-1), mask.int().argmax(-1), attention_mask.sum(-1) + start)
        prompts = (first - start).tolist()
    lay = layout(input_ids, attention_mask, prompts, *pack_shape(model))
    # A scored token t of row b is predicted by the logits where its row's token t-1 sits.
    target = mask.reshape(-1).nonzero().flatten()
    picked = packed_logits(model, input_ids, lay, lay.at[target - 1])
    if temperature != 1.0:
        picked = picked / temperature
    out = torch.zeros(B * T, dtype=torch.float32, device=device)
    tokens = input_ids.reshape(-1)[target]
    if not return_entropy:
        return out.index_put((target,), logprobs_from_logits(picked, tokens)).view(B, T)
    logprobs, entropy = logprobs_and_entropy(picked, tokens)
    return out.index_put((target,), logprobs).view(B, T), torch.zeros_like(out).index_put((target,), entropy).view(B, T)


def packed_logits(model, input_ids: Tensor, lay: Layout, slots: Tensor) -> Tensor:
    """The logits [len(slots), V] at packed `slots` of `input_ids` laid out by `lay`: with a 4D mask, by the
    forward on real tokens only (core/train/varlen.py) where the model allows it, else transformers' forward of
    the padded rows."""
    bias = None if lay.unit is None else attention_bias(lay, next(model.parameters()).dtype)
    if bias is not None and varlen.unsupported(model) is None:
        count = len(lay.target)
        hidden = varlen.hidden_states(model, input_ids.reshape(-1)[lay.source], lay.positions[lay.target],
                                      lay.target, lay.rows, lay.width, bias)
        token = torch.full((lay.rows * lay.width,), -1, dtype=torch.long, device=hidden.device)
        token[lay.target] = torch.arange(count, device=hidden.device)  # packed slot -> its real token's row
        return varlen.logits_at(model, hidden, token[slots])
    packed = torch.zeros(lay.rows * lay.width, dtype=input_ids.dtype, device=input_ids.device)
    packed[lay.target] = input_ids.reshape(-1)[lay.source]
    kwargs = dict(position_ids=lay.positions.view(lay.rows, lay.width), use_cache=False)
    if bias is not None:
        kwargs["attention_mask"] = bias
    logits = model(packed.view(lay.rows, lay.width), **kwargs).logits
    # index_select, not `logits[...]`: a shared prompt's last position is picked once per completion, and the
    # backward of advanced indexing accumulates those duplicates with atomic adds across threads (order, so
    # rounding, varies run to run); index_select's backward (index_add) sums them in a fixed order.
    return logits.view(-1, logits.shape[-1]).index_select(0, slots)


_PACKING: dict[type, bool] = {}
_MASKS: dict[type, bool] = {}


def _probe(model, cache: dict, what: str, check) -> bool:
    """check(model) once per model class, False with a warning naming `what` the model does not honour."""
    model = getattr(model, "module", model)  # a DeepSpeed engine's module
    kind = type(model)
    if kind not in cache:
        with torch.no_grad():
            cache[kind] = bool(check(model))
        if not cache[kind]:
            log.warning("%s does not honour %s: %s", kind.__name__, what,
                        "padded batches instead" if cache is _PACKING else "packed rows do not share prompts")
    return cache[kind]


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding of the logits' dtype (bf16 keeps 8 bits: 1e-3 would fail a model that works)."""
    tol = max(1e-3, 8 * torch.finfo(a.dtype).eps) if a.is_floating_point() else 1e-3
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


def packing_works(model) -> bool:
    """Whether `model`'s attention separates packed sequences by position ids that restart (transformers' own
    detection): two short sequences, packed against apart, once per model class."""
    def check(m):
        ids = torch.arange(1, 9, device=m.device).remainder(m.config.vocab_size)[None]
        apart = torch.cat([m(ids[:, :5], use_cache=False).logits, m(ids[:, 5:], use_cache=False).logits], 1)
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=m.device)
        return _same(apart, m(ids, position_ids=positions, use_cache=False).logits)
    return _probe(model, _PACKING, "restarting position ids", check)


def masks_work(model) -> bool:
    """Whether `model` honours a 4D additive attention mask (prompt sharing needs one): a 3-token prompt with
    completions of 2 and 3 tokens, packed as one unit, against each sequence apart; once per model class."""
    def check(m):
        ids = torch.arange(1, 9, device=m.device).remainder(m.config.vocab_size)
        lay = Layout(1, 8, ids, ids, torch.tensor([0, 1, 2, 3, 4, 3, 4, 5], device=m.device), ids,
                     unit=torch.zeros(8, dtype=torch.long, device=m.device),
                     segment=torch.tensor([-1, -1, -1, 0, 0, 1, 1, 1], device=m.device))
        bias = attention_bias(lay, next(m.parameters()).dtype)
        packed = m(ids[None], position_ids=lay.positions[None], attention_mask=bias, use_cache=False).logits[0]
        first = m(ids[None, :5], use_cache=False).logits[0]
        second = m(torch.cat([ids[:3], ids[5:]])[None], use_cache=False).logits[0]
        return _same(packed[:5], first) and _same(packed[5:], second[3:])
    return _probe(model, _MASKS, "a 4D attention mask", check)
