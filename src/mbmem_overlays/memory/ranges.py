"""How far the plan's peak could move where its own assumptions leave it unsure, from the configuration.

Each :class:`Range` re-plans the most-loaded GPU with one assumption pushed to the end the configuration allows
(a worst-case expert load at the capacity factor, the GPU generation's FP8 weight layout, the one-time eager
warm-up and CUDA graph capture before training, an unknown vocabulary) and says which plan assumption it qualifies
(``model.MOE_BALANCE`` ...), so the plan's assumptions always list every component that has a range. The fit
verdict then reads "fits unless ..." instead of a bare yes (``verdict``). Pure functions over the model's frozen
dataclasses, like model.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import model as P


@dataclass(frozen=True)
class Range:
    component: str            # the plan component that moves ("activations", "parameters", ...)
    reason: str               # what the plan cannot know, from this configuration
    assumption: str           # the plan assumption it qualifies (one of model.ASSUMPTIONS)
    unless: str               # the verdict's clause: "fits unless <unless>"
    low: float                # the most-loaded GPU's footprint at the low end, bytes
    high: float | None        # at the high end (None: no bound from the configuration)
    per_unit: float = 0.0     # for an open range: bytes per unit of the unknown (see unit)
    unit: str = ""
    if_low: str = ""          # the clause when the low end would make a plan that does not fit fit

    def as_dict(self) -> dict:
        d = {"component": self.component, "reason": self.reason, "assumption": self.assumption,
             "unless": self.unless, "low_bytes": int(self.low),
             "high_bytes": None if self.high is None else int(self.high)}
        if self.per_unit:
            d["bytes_per_unit"], d["unit"] = int(self.per_unit), self.unit
        if self.if_low:
            d["if_low"] = self.if_low
        return d


def moe_worst_load(s: P.Shape, lay: P.Layout, st: P.Settings) -> float:
    """Tokens one GPU's experts can receive, relative to a balanced load (Settings.moe_load = 1).

    With a capacity factor every source rank sends each expert at most ceil(tokens x topk / experts x c)
    tokens (moe_utils.py get_capacity; apply_router_token_dropping), so a GPU's experts take at most c times
    their balanced share. Dropless, in the worst case every token of the expert-parallel group picks this GPU's
    experts, each token at most min(topk, local experts) of them.
    """
    if not s.moe_layers or not s.topk or not s.experts:
        return 1.0
    if st.moe_rank_capacity:
        # HybridEP's static per-rank budget (moe_expert_rank_capacity_factor): the experts always run on it
        return max(1.0, st.moe_rank_capacity)
    if st.moe_capacity_factor:
        return max(1.0, st.moe_capacity_factor)
    local = max(1, s.experts // max(1, lay.ep))
    return max(1.0, lay.ep * min(s.topk, local) / s.topk)


def uncertainty(s: P.Shape, lay: P.Layout, st: P.Settings, base: P.Breakdown | None = None) -> tuple[Range, ...]:
    """The ranges that apply to this configuration (empty when the plan is sure of every component)."""
    base = base or P.estimate(s, lay, st)
    mid = base.footprint
    out: list[Range] = []
    worst = moe_worst_load(s, lay, st)
    if worst > st.moe_load:
        high = P.estimate(s, lay, replace(st, moe_load=worst)).footprint
        if st.moe_capacity_factor:
            why, unless = (f"capacity factor {st.moe_capacity_factor:g}: a GPU's experts take up to {worst:g}x "
                           "their share", f"MoE routing fills experts to capacity factor {worst:g}")
        else:
            why, unless = (f"dropless routing, EP {lay.ep}: in the worst case one GPU's experts take {worst:g}x the "
                           "balanced load; moe_expert_capacity_factor bounds it",
                           "MoE routing is imbalanced, which dropless routing does not bound")
        out.append(Range("activations (routed MoE tokens)", f"MoE token imbalance ({why})", P.MOE_BALANCE,
                         unless, mid, high))
    if st.fp8_weight_copy_bytes and st.param_bytes == P.FP8:
        low = P.estimate(s, lay, replace(st, fp8_weight_copy_bytes=0)).footprint
        out.append(Range("parameters (FP8 transposed copies)", "GPU generation: Hopper keeps a transposed FP8 copy "
                         "of every layer weight, Blackwell does not", P.FP8_TRANSPOSE, "", low, mid,
                         if_low="it would on a GPU with non-TN FP8 GEMMs (Blackwell)"))
    once = P.one_time_peak(s, lay, st)
    if once is not None and once.total > mid:
        warmup = st.graph_warmup_steps
        if warmup:
            why = (f"{warmup} eager warm-up iteration{'s' if warmup > 1 else ''} hold every activation; the capture "
                   "runs beside the last warm-up step's fp32 gradient copies")
        else:
            why = "the capture holds every in-flight microbatch's graphed activations (before the first step)"
        out.append(Range("activations (before CUDA graphs replay)", why, P.GRAPH_WARMUP,
                         f"the one-time {once.phase} (pipeline rank {once.rank}) counts", mid, once.total))
    if st.attn_softcap == "flex":
        # Gemma 2's FlexAttention path needs torch's flex_attention (gemma2_provider.py :57-72 fall back to the
        # materialized scores when it does not import): that fallback is the other end
        fallback = replace(st, attn_softcap="unfused", attention_scores=st.attn_softcap_scores or "torch_softmax",
                           mcore_attention=True)
        out.append(Range("activations (Gemma 2's core attention)", "Gemma 2's attention runs torch's FlexAttention "
                         "with its softcap as a score_mod where the job's torch has it (2.5 and later), else it "
                         "materializes the softcapped s x s scores", P.ATTENTION_KERNEL,
                         "Gemma 2's attention materializes its scores (no FlexAttention in the job's torch)", mid,
                         P.estimate(s, lay, fallback).footprint))
    outside = P.flex_outside_torch_bytes(s, lay, st)
    if outside:
        # not in torch's allocated memory (the plan's figure), but on the GPU beside it: the fit's high end
        name = {"deepep": "DeepEP", "hybridep": "HybridEP"}.get(st.flex_backend, st.flex_backend)
        out.append(Range("outside torch's allocator (flex dispatcher buffers)",
                         f"{name}'s communication buffers ({outside / 2**30:.2f} GiB per GPU) are allocated outside "
                         "torch's caching allocator, so max_memory_allocated does not show them", P.OUTSIDE_TORCH,
                         f"{name}'s buffers outside torch's allocator count", mid, mid + outside))
    v = s.vision
    if v is not None and v.image_tokens_high > v.image_tokens:
        # the images a microbatch carries (model.VISION_IMAGES): up to the sequence's bound
        end = P.estimate(replace(s, vision=replace(v, image_tokens=v.image_tokens_high)), lay, st).footprint
        out.append(Range("activations (vision encoder: image patches)",
                         f"images: {v.images_from}; the processor may resize them, and a microbatch holds at most "
                         f"{int(v.image_tokens_high):,} image tokens (seq_length x micro_batch_size)",
                         P.VISION_IMAGES, "the images fill the sequence", mid, end))
    if v is not None and v.image_tokens_low < v.image_tokens:
        # down to the fewest image tokens the configuration allows (none, where nothing states the images)
        end = P.estimate(replace(s, vision=replace(v, image_tokens=v.image_tokens_low)), lay, st).footprint
        out.append(Range("activations (vision encoder: image patches)",
                         f"images: {v.images_from}; the plan sizes that bound, a microbatch with fewer image tokens "
                         "keeps less of the encoder's activations", P.VISION_IMAGES, "", end, mid,
                         if_low="it would with fewer image tokens per microbatch"))
    if not s.vocab:
        per_token = _per_vocab_token(s, lay, st)
        out.append(Range("embedding, output layer and logits", "vocabulary unknown (model.vocab_size unset and the "
                         "tokenizer's not readable here)", P.VOCAB_FROM_TOKENIZER, "the vocabulary is larger",
                         mid, None, per_token, "vocabulary token"))
    return tuple(r for r in out if r.high is None or r.low < mid or r.high > mid)


def _per_vocab_token(s: P.Shape, lay: P.Layout, st: P.Settings) -> float:
    """Bytes the most-loaded GPU gains per vocabulary token (embedding, output layer, logits: linear in vocab)."""
    step = 1024 * lay.tp
    return (P.estimate(replace(s, vocab=step), lay, st).footprint - P.estimate(s, lay, st).footprint) / step


verdict = P.fit_verdict   # the fit verdict over these ranges (model.py, where Plan uses it)
