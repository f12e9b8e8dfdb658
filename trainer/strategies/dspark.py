"""DSpark objective (seed §5.3–§5.4): CE on the data, L1 to the teacher, confidence against overlap.

Per sequence of a TrainBatch (anchors drawn as DFlash draws them, ``strategies/dflash.py``):

1. **Labels.** Block row ``k = 0 … B−1`` (at position ``a + k``) predicts ``x[a+k+1]``: labels sit at
   offsets ``1 … B`` from the anchor, each row's previous token is ``x[a+k]`` (row 0: the anchor),
   teacher-forced. A row is supervised while every label up to it is in the sequence and in
   ``loss_mask`` (``M``): the first unsupervised label stops the block's supervision (a draft after
   a gap would be verified after a token the drafter never proposed).
2. **Teacher.** ``p_k`` is the target's frozen LM head on ``last_hidden_states`` at the label's
   predecessor ``a + k`` (the position whose target forward predicts ``x[a+k+1]``; seed §5.3's
   ``safe_label_indices − 1``), under no_grad: the target's probabilities over its whole
   vocabulary, read on the draft vocabulary's rows when there is one (their sum is then < 1).
3. **Loss.** With the drafter's corrected ``q_k``, the position weights ``w_k = exp(−k/γ)`` and
   ``Σ_M`` a sum over supervised rows::

       L_CE   = −Σ_M w_k log q_k(x[a+k+1]) / Σ_M w_k        (labels inside the draft vocabulary)
       L_L1   =  Σ_M w_k ‖p_k − q_k‖₁ / Σ_M w_k              (mass of p outside V_d counts in full)
       c*_k   =  1 − ½‖p_k − q_k‖₁, detached                 (the expected acceptance, seed §5.3)
       L_conf =  Σ_M w_k BCE(c_k, c*_k) / Σ_M w_k
       L      = (α L_CE + β L_L1 + λ L_conf) / (α + β + λ)    defaults α, β, λ = 0.1, 0.9, 1.0

   The target is detached so the confidence loss cannot move its own label; the L1 term still
   trains the drafter's q. The teacher is computed only when a term reads it (``l1_weight`` or
   ``confidence_weight`` > 0): a CE-only run needs no ``last_hidden_states`` and computes no
   full-vocabulary head, and its metrics leave out what the teacher gives (overlap, calibration).

Metric sums (they add over micro-batches, steps and ranks): per position the supervised count,
the top-1 correct count (of the corrected logits), CE over the labels inside the draft vocabulary,
the overlap ``Σ c*``, the confidence ``Σ c``, and a calibration histogram (confidence bins ×
count / Σ c / Σ c*) from which ``summarize`` computes the expected calibration error per
position; plus the teacher-forced accepted length (``tau_tf − 1``).

**Sequential Temperature Scaling** (seed §5.4; ``specray calibrate``, ``pipeline/jobs/calibrate.py``).
The scheduler reads the predicted survival ``A_k = ∏_{i<=k} σ(z_i / T_i)`` as an absolute number, so
slight over-confidence compounds along the block. What survives depends on the serving mode, so
each mode has its own table (``CALIBRATION_MODES``), fitted on the same held-out blocks
(``confidence_rows``: the confidence logits ``z`` and one survival target per mode):

- ``sampling``: a draft drawn from q survives rejection sampling with probability ``c*_k = 1 − TV``
  (the overlap above);
- ``greedy``: a draft is the corrected q's argmax and survives iff it is the target's argmax,
  ``m_k = 1[argmax q_k = argmax p_k]`` (over the target's whole vocabulary).

The observed survival is ``S_k = ∏_{i<=k} t_i`` of the mode's target ``t``, and ``fit_sts`` picks
``T_1``, then ``T_2`` with ``T_1`` fixed, and so on, each minimising the cross-entropy between ``A_k``
and ``S_k`` over the blocks supervised at ``k`` (a search over log T). ``survival_ece`` is the
calibration error of ``A_k`` against ``S_k`` per position.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from specray.drafters.dspark import CALIBRATION_MODES, DSparkConfig, DSparkDrafter
from specray.trainer.loader import TrainBatch
from specray.trainer.memory import ActivationMemory, StepShape, vocab_rows
from specray.trainer.strategies.dflash import (DFlashStrategy, backbone_memory, block_labels, position_weights,
                                               sample_anchors)


class DSparkObjective(BaseModel):
    """The manifest's ``objective`` section when ``drafter.algorithm`` is dspark."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_anchors: int = Field(16, gt=0, description="blocks sampled per sequence per step")
    gamma: float = Field(4.0, gt=0, description="position-weight decay w_k = exp(-k/gamma), k = 0 … B-1")
    ce_weight: float = Field(0.1, ge=0, description="weight of the CE on data tokens")
    l1_weight: float = Field(0.9, ge=0, description="weight of the L1 between teacher p and draft q")
    confidence_weight: float = Field(1.0, ge=0, description="weight of the confidence BCE against c* = 1 - |p-q|_1/2")
    calibration_bins: int = Field(10, gt=0, description="confidence bins of the expected calibration error metric")

    @model_validator(mode="after")
    def _some_weight(self) -> "DSparkObjective":
        if self.ce_weight + self.l1_weight + self.confidence_weight <= 0:
            raise ValueError("objective: ce_weight + l1_weight + confidence_weight must be > 0 (defaults 0.1/0.9/1.0)")
        return self


def dspark_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Labels [Bt, N, B] (token at anchor + k + 1), previous tokens [Bt, N, B] (token at anchor + k)
    and supervision [Bt, N, B] (stopping at the block's first unsupervised label)."""
    labels, supervised = block_labels(input_ids, loss_mask, anchors, block_size + 1)  # offsets 1 … B
    anchor_ids = torch.gather(input_ids, 1, anchors.clamp(min=0))  # [Bt, N]
    prev_ids = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    supervised = torch.cumprod(supervised.long(), dim=-1).bool()
    return labels, prev_ids, supervised


@torch.no_grad()
def teacher(drafter: DSparkDrafter, last_hidden: torch.Tensor, positions: torch.Tensor,
            rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's probabilities p [Bt, N, B, V_d] (float32, 0 where not ``rows``) of the token after
    each of ``positions`` [Bt, N, B]: its LM head on last_hidden [Bt, T, D] there, softmax over the
    whole vocabulary, read on the draft vocabulary's rows; and its argmax over the whole vocabulary
    [Bt, N, B] (target ids, −1 where not ``rows``): the token greedy verification accepts."""
    weight, bias = drafter.head()  # [V_d, D]
    p = torch.zeros(*positions.shape, weight.shape[0], device=last_hidden.device)
    top = torch.full(positions.shape, -1, dtype=torch.long, device=last_hidden.device)
    batch_index = torch.arange(positions.shape[0], device=positions.device)[:, None, None].expand_as(positions)
    with torch.autocast(last_hidden.device.type, enabled=False):
        y = last_hidden[batch_index[rows], positions[rows]].float()  # [R, D]
        logits = F.linear(y, weight.float(), None if bias is None else bias.float())  # [R, V_d]
        if drafter.draft_vocab is None:
            norm, top[rows] = logits.logsumexp(-1), logits.argmax(-1)
        else:
            full_bias = drafter.lm_head.bias
            full = F.linear(y, drafter.lm_head.weight.float(), None if full_bias is None else full_bias.float())
            norm, top[rows] = full.logsumexp(-1), full.argmax(-1)  # [R]
        p[rows] = (logits - norm[:, None]).exp()
    return p, top


def overlap_l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """‖p − q‖₁ per row over the whole vocabulary, p/q [..., V_d] (q sums to 1 on V_d; p's mass
    outside V_d, ``1 − Σ p``, is all difference) -> [...]."""
    return (p - q).abs().sum(-1) + (1.0 - p.sum(-1)).clamp(min=0.0)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·v / Σ w (0, still in the graph, when no weight)."""
    denom = weights.sum()
    return (values * weights).sum() / denom if denom > 0 else values.sum() * 0.0


class Heads(NamedTuple):
    """The teacher-forced forward of one micro-batch, each [Bt, N, B] or [Bt, N, B, V_d]; the teacher's
    parts are None when no loss term reads it (a CE-only objective)."""

    drafter: DSparkDrafter
    labels: torch.Tensor  # target ids at anchor + k + 1
    supervised: torch.Tensor  # bool
    logits: torch.Tensor  # corrected logits [.., V_d]
    log_q: torch.Tensor  # [.., V_d] float32
    conf_logits: torch.Tensor
    c_star: torch.Tensor | None  # 1 − ½‖p − q‖₁, detached
    l1: torch.Tensor | None  # ‖p − q‖₁
    match: torch.Tensor | None  # float 1 where q's argmax is the target's argmax


class DSparkStrategy(DFlashStrategy):
    """Builds the DSpark drafter and computes its loss and metrics on a TrainBatch."""

    algorithm = "dspark"
    objective = DSparkObjective
    model_class = DSparkDrafter  # built as DFlash builds its drafter (final norm at a tenth of the target's)
    evaluation = {"num_anchors": 64}  # held-out evaluation samples more blocks per sequence than a step

    def __init__(self, objective: DSparkObjective = DSparkObjective(), *, seed: int = 0):
        super().__init__(objective, seed=seed)
        self.weights = (objective.ce_weight, objective.l1_weight, objective.confidence_weight)
        self.bins = objective.calibration_bins
        self.uses_teacher = objective.l1_weight > 0 or objective.confidence_weight > 0

    def forward_loss(self, model: nn.Module, config: DSparkConfig, batch: TrainBatch, generator: torch.Generator):
        """(loss, metric sums) for one micro-batch; ``model`` may be DDP-wrapped."""
        h = self._heads(model, config, batch, generator, teacher_needed=self.uses_teacher)
        B = config.block_size
        draft_labels = h.drafter.target_to_draft(h.labels)  # = labels without a draft vocabulary
        covered = h.supervised & (draft_labels >= 0)
        w = position_weights(B + 1, self.gamma).to(h.logits.device) * h.supervised  # [Bt, N, B]
        ce = -h.log_q.gather(-1, draft_labels.clamp(min=0)[..., None]).squeeze(-1)
        terms = [weighted_mean(ce, w * covered)]
        if self.uses_teacher:
            bce = F.binary_cross_entropy_with_logits(h.conf_logits.float(), h.c_star, reduction="none")
            terms += [weighted_mean(h.l1, w), weighted_mean(bce, w)]
        loss = sum(a * t for a, t in zip(self.weights, terms)) / sum(self.weights)
        if not self.uses_teacher:  # the confidence head stays in the graph (a zero gradient): DDP reduces every parameter
            loss = loss + 0.0 * h.conf_logits.sum()
        with torch.no_grad():
            correct = (h.drafter.draft_to_target(h.logits.argmax(-1)) == h.labels) & h.supervised
            metrics = self._sums(correct, h.supervised, covered, ce, h.c_star, torch.sigmoid(h.conf_logits.float()))
        return loss, metrics

    @torch.no_grad()
    def confidence_rows(self, model: nn.Module, config: DSparkConfig, batch: TrainBatch,
                        generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """What Sequential Temperature Scaling fits on: per block, the confidence logits [n, B], the
        survival target of each of ``CALIBRATION_MODES`` ({mode: [n, B]}: the argmax match for greedy,
        c* for sampling) and supervision [n, B] (a prefix of each block), blocks that supervise their
        first row only."""
        h = self._heads(model, config, batch, generator, teacher_needed=True)
        keep = h.supervised[..., 0]  # [Bt, N]
        targets = {"greedy": h.match[keep], "sampling": h.c_star[keep]}
        assert tuple(targets) == CALIBRATION_MODES
        return h.conf_logits.float()[keep], targets, h.supervised[keep]

    def _heads(self, model, config: DSparkConfig, batch: TrainBatch, generator: torch.Generator, *,
               teacher_needed: bool) -> Heads:
        """The teacher-forced forward of one micro-batch (``Heads``); the teacher only when ``teacher_needed``."""
        if teacher_needed and batch.last_hidden_states is None:
            raise ValueError("DSpark's L1 and confidence terms read the target's last_hidden_states: capture the "
                             "features with capture.algorithm=dspark (or train with objective.l1_weight=0 and "
                             "objective.confidence_weight=0, the CE term alone)")
        B = config.block_size
        drafter = getattr(model, "module", model)  # unwrap DDP
        anchors = sample_anchors(batch.loss_mask, self.num_anchors, generator, batch.anchor_mask)  # [Bt, N]
        labels, prev_ids, supervised = dspark_labels(batch.input_ids, batch.loss_mask, anchors, B)  # [Bt, N, B]
        predecessors = anchors.clamp(min=0)[..., None] + torch.arange(B, device=anchors.device)  # [Bt, N, B]
        if teacher_needed:
            p, top = teacher(drafter, batch.last_hidden_states, predecessors, supervised)  # [Bt, N, B, V_d], [Bt, N, B]
        logits, conf_logits = model(batch.hidden_states, batch.attention_mask, prev_ids[..., 0], anchors, prev_ids)
        log_q = F.log_softmax(logits.float(), dim=-1)  # [Bt, N, B, V_d]
        if not teacher_needed:
            return Heads(drafter, labels, supervised, logits, log_q, conf_logits, None, None, None)
        l1 = overlap_l1(p, log_q.exp())
        c_star = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        match = (drafter.draft_to_target(logits.detach().argmax(-1)) == top).float()
        return Heads(drafter, labels, supervised, logits, log_q, conf_logits, c_star, l1, match)

    @staticmethod
    def activation_memory(config: DSparkConfig, objective: DSparkObjective, shape: StepShape) -> ActivationMemory:
        """What one micro-batch's ``forward_loss`` keeps for its backward (``trainer/memory.py``): the
        teacher ``p`` over every block row, the DFlash backbone, the sequence and confidence heads,
        then the corrected logits, log q, q and ``p − q`` over the draft vocabulary."""
        out = ActivationMemory()
        a, D, r = shape.act_bytes, config.hidden_size, config.markov_rank
        V_d, V = config.draft_vocab_size or config.vocab_size, config.vocab_size
        rows = shape.batch * min(objective.num_anchors, shape.seq_len - 1) * config.block_size  # every row drafts
        out.keep("teacher", vocab_rows(rows, V_d, 1), forward_only=True)  # saved by no backward
        out.spike(vocab_rows(rows, V_d, 1) + (vocab_rows(rows, V, 1) if config.draft_vocab_size else 0))
        backbone_memory(config, min(objective.num_anchors, shape.seq_len - 1), shape, out)
        heads = rows * (r + (D + r if config.confidence_head_with_markov else D)) * a  # W1[prev], [h; W1[prev]]
        out.keep("layers", heads)
        out.spike(vocab_rows(rows, V_d, 2))  # base logits and the sequence head's bias, before their sum
        recurrent = 1 if config.markov_head_type == "rnn" else 0  # per-row biases stacked
        out.keep("vocab", vocab_rows(rows, V_d, 4 + recurrent))  # corrected logits, log q, q, p - q
        out.spike(vocab_rows(rows, V_d, 1))  # |p - q|, then the loss's gradients
        return out

    def _sums(self, correct, supervised, covered, ce, c_star, confidence) -> dict[str, torch.Tensor]:
        """Per-position metric sums of [Bt, N, B] rows (module docstring); without a teacher (``c_star``
        None) no overlap and no calibration histogram."""
        accepted = torch.cumprod(correct.long(), dim=-1).sum(-1)  # leading correct rows per block
        has_first = supervised[..., 0]
        sums = {
            "count": supervised.sum((0, 1)).double(),  # [B]
            "correct": correct.sum((0, 1)).double(),  # [B]
            "ce": (ce.detach() * covered).sum((0, 1)).double(),  # [B]
            "covered": covered.sum((0, 1)).double(),  # [B] labels inside the draft vocabulary
            "confidence": (confidence * supervised).sum((0, 1)).double(),  # [B]
            "blocks": has_first.sum().double().reshape(1),
            "accepted": (accepted * has_first).sum().double().reshape(1),
        }
        if c_star is None:
            return sums
        B = supervised.shape[-1]
        bins = (confidence * self.bins).long().clamp(max=self.bins - 1)  # [Bt, N, B]
        flat = (torch.arange(B, device=bins.device) * self.bins + bins)[supervised]  # position-major bin index
        histogram = {name: torch.zeros(B * self.bins, dtype=torch.float64, device=bins.device).index_add_(
            0, flat, values[supervised].double()).view(B, self.bins)
            for name, values in (("cal_count", torch.ones_like(confidence)), ("cal_conf", confidence),
                                 ("cal_target", c_star))}
        return {**sums, "overlap": (c_star * supervised).sum((0, 1)).double(), **histogram}  # [B], [B, bins] each

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict:
        """Accumulated sums -> per-position accuracy, CE, confidence, tau_tf, and (with a teacher) overlap
        and calibration error."""
        count = sums["count"].clamp(min=1)
        blocks = sums["blocks"].clamp(min=1)
        summary = {
            "acc_by_pos": (sums["correct"] / count).tolist(),
            "ce_by_pos": (sums["ce"] / sums["covered"].clamp(min=1)).tolist(),
            "confidence_by_pos": (sums["confidence"] / count).tolist(),
            "coverage": float(sums["covered"].sum() / count.sum()),
            "acc": float(sums["correct"].sum() / count.sum()),
            "tau_tf": float(1 + sums["accepted"].sum() / blocks.sum()),
            "blocks": int(sums["blocks"].sum()),
        }
        if "overlap" in sums:
            gap = (sums["cal_conf"] - sums["cal_target"]).abs().sum(-1)  # [B]
            summary.update({"overlap_by_pos": (sums["overlap"] / count).tolist(),
                            "ece_by_pos": (gap / count).tolist(), "ece": float(gap.sum() / count.sum())})
        return summary


STS_LOG_T = torch.linspace(math.log(0.05), math.log(20.0), 401, dtype=torch.float64)  # temperatures searched


def fit_sts(conf_logits: torch.Tensor, c_star: torch.Tensor, supervised: torch.Tensor) -> list[float]:
    """Sequential Temperature Scaling (module docstring): conf_logits, c_star, supervised [n, B] ->
    one temperature per position [B]. A position no block supervises is an error."""
    z, observed = conf_logits.double(), torch.cumprod(c_star.double(), dim=-1)  # [n, B]
    prefix = torch.ones(z.shape[0], dtype=torch.float64)  # [n] ∏ of the calibrated positions before k
    temperatures = []
    for k in range(z.shape[1]):
        rows = supervised[:, k]
        if not rows.any():
            raise ValueError(f"no held-out block supervises draft position {k + 1}: calibrate on a manifest "
                             "with sequences longer than the block (or more samples)")
        log_t = _best_log_temperature(z[rows, k], observed[rows, k], prefix[rows])
        temperatures.append(math.exp(log_t))
        prefix = prefix * torch.sigmoid(z[:, k] / temperatures[-1])
    return temperatures


def _best_log_temperature(z: torch.Tensor, target: torch.Tensor, prefix: torch.Tensor) -> float:
    """argmin over log T of the mean BCE(prefix · σ(z / T), target), z/target/prefix [n]: a grid, then
    a finer grid around its best point."""

    def loss(log_t: torch.Tensor) -> torch.Tensor:  # [G] -> [G]
        survival = (prefix * torch.sigmoid(z[None] / log_t.exp()[:, None])).clamp(1e-9, 1 - 1e-9)  # [G, n]
        return -(target * survival.log() + (1 - target) * (1 - survival).log()).mean(-1)

    best = STS_LOG_T[loss(STS_LOG_T).argmin()]
    step = float(STS_LOG_T[1] - STS_LOG_T[0])
    fine = torch.linspace(float(best) - step, float(best) + step, 41, dtype=torch.float64)
    return float(fine[loss(fine).argmin()])


def survival_ece(conf_logits: torch.Tensor, c_star: torch.Tensor, supervised: torch.Tensor,
                 temperatures: list[float] | None = None, bins: int = 10) -> tuple[list[float], float]:
    """Calibration error of the predicted survival ``∏ σ(z / T)`` against the observed ``∏ c*``
    (inputs [n, B]; ``temperatures`` None = 1): per position ``Σ_bins |Σ (A − S)| / n_k`` over bins
    of A, and the same pooled over positions."""
    T = torch.tensor(temperatures or [1.0] * conf_logits.shape[1], dtype=torch.float64)
    predicted = torch.cumprod(torch.sigmoid(conf_logits.double() / T), dim=-1)  # [n, B]
    observed = torch.cumprod(c_star.double(), dim=-1)
    gaps, counts = [], []
    for k in range(predicted.shape[1]):
        rows = supervised[:, k]
        a, o = predicted[rows, k], observed[rows, k]
        index = (a * bins).long().clamp(max=bins - 1)
        gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, a - o).abs().sum()
        gaps.append(float(gap))
        counts.append(int(rows.sum()))
    return [g / max(c, 1) for g, c in zip(gaps, counts)], sum(gaps) / max(sum(counts), 1)
