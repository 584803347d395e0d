"""The `preference` stage: DPO-family losses on pairwise (or, for `requires_labels`, unpaired) rows, and on
ranked lists (`ranked` rows: m completions of a prompt, best first) for an algorithm that `accepts_lists`.

The loop is the shared offline one; this file only says how rows become a batch: the policy is run
once per sequence set of a micro-batch and `build_batch` asks for what the algorithm's flags need.
The frozen reference's summed completion log-probs (and, for `needs_token_logprobs`, its per-token
ones) are computed once per dataset before training and kept in the checkpoint folder, so a resumed
run reads them back instead of recomputing. Only KTO-style mismatched pairs ("kl") change with the
micro-batch and run the reference live.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from alignflow.core.errors import DataError
from alignflow.core.spec.kinds import preference_rows
from alignflow.core.train.batching import collate
from alignflow.core.train.datasets import IGNORE_INDEX, candidate, truncate
from alignflow.core.train.engine import Engine, frozen
from alignflow.core.train.adapters import AdaptersOff
from alignflow.core.train.models import token_logprobs
from alignflow.core.train.offline import NllScope, SequenceLogps, TokenLogps, build_batch, mismatched_pairs
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.evaluation import evaluate_model
from alignflow.flows.stages.offline_loop import (Feed, eval_rows, final_metrics, held_out_metrics, micro_batches,
                                            split_rows, train_loop)
from alignflow.flows.stages.training import (load_model_for, load_policy, load_tokenizer_for, lora_rank,
                                             model_source, save_pretrained, total_steps)



def prefix(name: str) -> str:
    """The prefix of a Scorer set's columns in a collated micro-batch: `chosen_input_ids`, `input_ids`, ..."""
    return "" if name == "completion" else name + "_"


REFERENCE_CACHE = "reference_logps.pt"
# Cache keys of a set's per-token reference log-probs: every row's completion tokens end to end, and
# where each row starts in them ([rows + 1]).
TOKENS, OFFSETS = "{}/tokens", "{}/offsets"


def scored_mask(micro: dict, name: str, scope: NllScope) -> torch.Tensor:
    """The tokens of set `name` whose log-probs a scope sums: completion tokens, or all real tokens.

    The first token has no prefix to be predicted from, so no scope scores it (rows are right-padded).
    """
    p = prefix(name)
    mask = micro[p + "labels"] != IGNORE_INDEX if scope == "completion" else micro[p + "attention_mask"] != 0
    mask[:, 0] = False
    return mask


@dataclass
class SequenceScorer:
    """A `Scorer` over one micro-batch: one forward pass per sequence set, summed under any scope."""

    model: torch.nn.Module
    micro: dict
    widest: NllScope  # the widest scope asked for: "sequence" also computes prompt logits
    device: torch.device
    entropy: bool = False  # also the per-token entropy, for `tokens`
    token_logps: dict[str, torch.Tensor] = field(default_factory=dict)
    entropies: dict[str, torch.Tensor] = field(default_factory=dict)

    def _forward(self, name: str) -> torch.Tensor:
        if name not in self.token_logps:
            p, to = prefix(name), self.device
            ids, attn = self.micro[p + "input_ids"].to(to), self.micro[p + "attention_mask"].to(to)
            wanted = scored_mask(self.micro, name, self.widest).to(to)
            out = token_logprobs(self.model, ids, attn, wanted, return_entropy=self.entropy)
            if self.entropy:
                out, ent = out
                self.entropies[name] = ent.detach()  # frees the entropy's graph (a [N, T, V] softmax)
            self.token_logps[name] = out
        return self.token_logps[name]

    def __call__(self, name: str, scope: NllScope) -> SequenceLogps:
        return SequenceLogps.of(self._forward(name), scored_mask(self.micro, name, scope).to(self.device))

    def tokens(self, name: str) -> TokenLogps:
        logps = self._forward(name)
        mask = scored_mask(self.micro, name, "completion").to(self.device)
        return TokenLogps(torch.where(mask, logps, 0.0), mask, self.entropies.get(name))


@dataclass
class CachedReference:
    """A `Scorer` reading the reference's cached log-probs by row; "kl" sets run the reference live."""

    cache: dict[str, torch.Tensor]  # set name -> [rows] summed completion log-probs
    micro: dict
    live: SequenceScorer | None  # the reference model, kept only when an algorithm needs "kl" sets
    device: torch.device

    def __call__(self, name: str, scope: NllScope) -> SequenceLogps:
        if name not in self.cache:
            with torch.no_grad():
                return self.live(name, scope)
        if scope != "completion":
            raise ValueError(f"only completion log-probs of the reference are cached, not {scope!r} ones")
        lengths = scored_mask(self.micro, name, scope).sum(-1)
        return SequenceLogps(self.cache[name][self.micro["row"]].to(self.device), lengths.to(self.device))

    def tokens(self, name: str) -> TokenLogps:
        """The cached per-token log-probs of the micro-batch's rows, laid out on its completion tokens."""
        if TOKENS.format(name) not in self.cache:
            raise ValueError(f"per-token reference log-probs of {name!r} sequences are not cached")
        flat, offsets = self.cache[TOKENS.format(name)], self.cache[OFFSETS.format(name)]
        mask = scored_mask(self.micro, name, "completion")
        rows = self.micro["row"].tolist()
        if mask.sum(-1).tolist() != [int(offsets[r + 1] - offsets[r]) for r in rows]:
            raise ValueError(f"cached reference tokens of {name!r} do not match the micro-batch's completions")
        out = torch.zeros(mask.shape, dtype=flat.dtype)
        out[mask] = torch.cat([flat[offsets[r]:offsets[r + 1]] for r in rows])  # row-major, as cached
        return TokenLogps(out.to(self.device), mask.to(self.device))


def split_row(row: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a tokenised row: the prompt is the labels' -100 prefix."""
    k = next((i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX), len(row["labels"]))
    return row["input_ids"][:k], row["input_ids"][k:]


def with_kl_rows(rows: list[dict], max_length: int) -> list[dict]:
    """Add each row's mismatched pair: its prompt with the completion of row `mismatched_pairs(n)[i]`."""
    parts = [split_row(r) for r in rows]
    out = []
    for row, (prompt, _), j in zip(rows, parts, mismatched_pairs(len(rows)).tolist()):
        ids, labels, _ = truncate(prompt, parts[j][1], max_length)
        out.append({**row, "kl_input_ids": ids, "kl_labels": labels})
    return out


def reference_sets(algo, candidates: list[str] | None = None) -> list[str]:
    """The sequence sets whose reference log-probs are fixed per row, hence cacheable."""
    return ["completion"] if algo.requires_labels else candidates or ["chosen", "rejected"]


@torch.no_grad()
def reference_logps(reference, rows, sets: list[str], micro: int, pad_id: int, device,
                    tokens: bool = False) -> dict[str, torch.Tensor]:
    """Summed completion log-probs of every row under the reference, one [rows] tensor per set; with
    `tokens`, also each set's per-token log-probs (`TOKENS`, `OFFSETS`)."""
    keys = [key.format(name) for name in sets for key in (["{}", TOKENS, "{}/lengths"] if tokens else ["{}"])]
    out: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    for m in micro_batches(rows, list(range(len(rows))), micro, lambda r: collate(r, pad_id)):
        score = SequenceScorer(reference, m, "completion", device)
        for name in sets:
            out[name].append(score(name, "completion").logps.float().cpu())
            if tokens:
                per_token = score.tokens(name)
                out[TOKENS.format(name)].append(per_token.logps[per_token.mask].float().cpu())
                out[f"{name}/lengths"].append(per_token.mask.sum(-1).cpu())
    caches = {key: torch.cat(parts) for key, parts in out.items()}
    for name in sets if tokens else []:
        lengths = caches.pop(f"{name}/lengths")
        caches[OFFSETS.format(name)] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return caches


def cached_reference(ctx: StageContext, reference, splits: dict, sets: list[str], pad_id: int, device,
                     tokens: bool = False):
    """{split: {set: log-probs}} from the checkpoint folder, else computed once and saved there."""
    path = ctx.checkpoint_dir / REFERENCE_CACHE
    found = path.is_file()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every rank has looked before rank 0 writes: they all compute, or all load
    if found:
        return torch.load(path)
    caches = {k: reference_logps(reference, rows, sets, ctx.settings.micro_batch_size, pad_id, device, tokens)
              for k, rows in splits.items() if rows is not None}
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(caches, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a crash mid-write leaves no partial cache
    return caches


def list_candidates(ctx: StageContext, train, held_out) -> list[str]:
    """The sequence sets of tokenised ranked lists, best first: as many in the held-out rows as in training."""
    m = sum(name.endswith("_input_ids") for name in train.column_names)
    held = m if held_out is None else sum(name.endswith("_input_ids") for name in held_out.column_names)
    if held != m:
        raise DataError(f"stage {ctx.name!r}: eval_dataset {ctx.inputs['eval_dataset']}: lists of {held} "
                        f"completions, but the training lists have {m}")
    return [candidate(k) for k in range(m)]


def preference_feed(algo, engine, pad_id: int, max_length: int, cache: dict | None, reference,
                    candidates: list[str] | None = None) -> Feed:
    """Rows -> the algorithm's batch: the policy scored live, the reference from `cache`; ranked lists as the
    sequence sets `candidates`, best first."""
    main = "completion" if algo.requires_labels else candidates[0] if candidates else "chosen"
    widest = "sequence" if algo.nll_scope == "sequence" else "completion"

    def collate_rows(rows: list[dict]) -> dict:
        return collate(with_kl_rows(rows, max_length) if algo.needs_kl_pairs else rows, pad_id)

    def batch(micro: dict):
        policy = SequenceScorer(engine.model, micro, widest, engine.device, algo.needs_token_logprobs)
        live = SequenceScorer(reference, micro, "completion", engine.device) if reference is not None else None
        ref = CachedReference(cache, micro, live, engine.device) if cache is not None else None
        return build_batch(algo, policy, ref, micro.get("label"), candidates, micro.get("scores"))

    return Feed(collate_rows, batch, lambda micro: scored_mask(micro, main, algo.nll_scope or "completion"))


def load_reference(ctx: StageContext, src: str):
    """The frozen reference's weights: the `reference` input, else the initial policy; None for a LoRA policy
    without a `reference` input, whose base (its adapters switched off) is that initial policy."""
    if "reference" not in ctx.inputs:
        return None if lora_rank(ctx.settings) else load_model_for(ctx, src)
    with model_source(ctx, "reference") as ref_src:
        return load_model_for(ctx, ref_src)


def run_preference(ctx: StageContext) -> StageResult:
    """Train on preferences, report held-out preference or task accuracy, save the policy."""
    s = ctx.settings
    algo = ctx.resolved.algorithm.build()
    schema = preference_rows(algo, ctx.inputs["dataset"])
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_policy(ctx, src)
        reference = load_reference(ctx, src) if algo.requires_reference else None
    eval_prefs = eval_rows(ctx, schema)
    train, held_out = split_rows(ctx, tokenizer, schema, eval_prefs)
    pad_id = tokenizer.pad_token_id
    candidates = list_candidates(ctx, train, held_out) if schema == "ranked" else None

    steps = total_steps(len(train), s)
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, s, steps, ctx.checkpoint_dir.parent, auto_precision=ctx.options.auto_precision)
    caches = {}
    if algo.requires_reference:
        reference = engine.match(frozen(reference, s)) if reference is not None else AdaptersOff(engine.module)
        splits = {"train": train, "eval": held_out}
        with engine.autocast():  # the policy's precision, so that at policy == reference both score alike
            caches = cached_reference(ctx, reference, splits, reference_sets(algo, candidates), pad_id,
                                      engine.device, algo.needs_token_logprobs)
        if not algo.needs_kl_pairs:
            reference = None  # every reference log-prob it needs is cached: free the model

    def feed(split: str) -> Feed:
        return preference_feed(algo, engine, pad_id, s.max_length, caches.get(split), reference, candidates)

    last = train_loop(ctx, engine, algo, train, feed("train"))
    held = held_out_metrics(engine, algo, held_out, feed("eval"), s.micro_batch_size)
    final = final_metrics(last, held, steps)
    out = save_pretrained(engine, tokenizer, ctx.work_dir / "model")
    if eval_prefs is None:  # eval_dataset holds prompt+answer rows: task accuracy with the stage's rewards
        final.update(evaluate_model(ctx, engine.module, tokenizer))
    ctx.log_metrics(final, engine.step_count)
    headline = next((k for k in ("eval/accuracy", "eval/rewards/accuracies") if k in final), "train/loss")
    return StageResult(outputs={"model": out}, metrics=final, headline=headline, fingerprint=engine.fingerprint())
