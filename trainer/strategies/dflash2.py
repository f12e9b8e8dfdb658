"""DFlash 2 objective (seed §6.4): the DFlash objective plus a strict top-K selector CE.

Anchors, blocks, labels and the position-weighted CE of the unary logits are DFlash's
(``trainer/strategies/dflash.py``): that term trains the backbone, which decides whether the
label is among the K candidates at all. The selector term, per draft position ``j`` of a block
with label ``x_j`` and true predecessor ``x_{j−1}`` (the anchor for ``j = 1``)::

    L_sel = − Σ M_j w_j 1[x_j ∈ C_j] log q_j(x_j | x_{j−1}) / Σ M_j w_j 1[x_j ∈ C_j]
    q_j(· | p) = softmax over the K candidates C_j of the edge scores S_j(p, ·)

Strict: a label outside the unary top-K is not inserted into the candidates; that position adds
nothing to ``L_sel`` (the backbone's CE still applies). The predecessor is the data's token, not
the drafted one, so the teacher-forced selector accuracy and the walked path's acceptance are
reported apart. ``L = L_DFlash + λ(step) · L_sel`` with ``λ`` ramping linearly from 0 to
``selector_weight`` over ``selector_ramp_steps`` optimizer steps (0: full weight from the first
step; held-out evaluation uses step 0's weight for the loss, its metrics do not depend on it).
``selector_stop_gradient`` detaches the hidden states and unary logits the selector reads, so the
selector term trains only the selector (the DFlash term still trains the backbone).
``freeze_conv`` keeps the convolutions where they start (the identity, or a warm start's), and
``selector_weight = 0`` leaves the selector untrained (its walk stays the unary argmax): the
two ablations of which part buys what.

Metric sums per draft position (what ``summarize`` turns into rates):

- DFlash's: ``acc_by_pos`` (unary top-1), ``ce_by_pos``, ``tau_tf`` (teacher-forced, unary);
- conditional ``recall1_by_pos`` / ``recallk_by_pos``: the label is the unary top-1 / in the
  top-K, counted where every earlier position of the block was drafted right by the walk;
- ``selector_acc_by_pos``: teacher-forced selector top-1 among positions whose label is a candidate;
- ``tau_walk``: 1 + the accepted length of the greedy walk through the selector (free-running:
  each step's predecessor is the walk's own choice), what greedy serving drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from specray.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from specray.kernels.selector_walk import selector_walk
from specray.trainer.loader import TrainBatch
from specray.trainer.memory import FP32, ActivationMemory, StepShape, vocab_rows
from specray.trainer.strategies.dflash import (DFlashObjective, DFlashStrategy, backbone_memory, block_labels,
                                               position_weights,
                                               sample_anchors, weighted_block_ce)


class DFlash2Objective(DFlashObjective):
    """The manifest's ``objective`` section when ``drafter.algorithm`` is dflash2 (DFlash's fields and these)."""

    selector_weight: float = Field(1.0, ge=0, description="weight λ of the selector CE (after its ramp)")
    selector_ramp_steps: int = Field(0, ge=0, description="steps over which λ rises linearly from 0 (0: no ramp)")
    selector_stop_gradient: bool = Field(False, description="detach the hidden states and unary logits the "
                                                            "selector reads (its CE then trains the selector only)")
    freeze_conv: bool = Field(False, description="keep the grouped dynamic convolutions at their initial (identity) "
                                                 "or warm-started weights: the selector-only ablation (selector_weight=0 "
                                                 "is the convolution-only one: an untrained selector walks the unary argmax)")


def selector_ce(scores: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, covered: torch.Tensor,
                weights: torch.Tensor):
    """Strict top-K CE. scores / candidates [Bt, N, m, K]; labels (draft indices) / covered [Bt, N, m]; weights [m].

    Returns (loss, in_top [Bt, N, m] where the label is a candidate, target index [Bt, N, m])."""
    hit = candidates == labels[..., None]  # [Bt, N, m, K]
    in_top = hit.any(-1) & covered
    target = hit.long().argmax(-1)  # the label's candidate index (0 where it is no candidate: unused)
    ce = F.cross_entropy(scores.float().flatten(0, 2), target.flatten(), reduction="none").view_as(target)
    w = weights.to(scores.device)[None, None, :] * in_top
    denom = w.sum()
    loss = (ce * w).sum() / denom if denom > 0 else scores.sum() * 0.0
    return loss, in_top, target


class DFlash2Strategy(DFlashStrategy):
    """Builds the DFlash 2 drafter and computes its loss and metrics on a TrainBatch."""

    algorithm = "dflash2"
    objective = DFlash2Objective
    model_class = DFlash2Drafter

    def __init__(self, objective: DFlash2Objective = DFlash2Objective(), *, seed: int = 0):
        super().__init__(objective, seed=seed)
        self.selector_weight = objective.selector_weight
        self.ramp_steps = objective.selector_ramp_steps
        self.stop_gradient = objective.selector_stop_gradient
        self.freeze_conv = objective.freeze_conv
        self.step = 0

    def build_model(self, config: DFlash2Config, *, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                    final_norm: nn.Module | None = None) -> DFlash2Drafter:
        """DFlash's fresh drafter; with ``freeze_conv`` its convolutions take no gradient (the
        optimizer holds only parameters that require one)."""
        model = super().build_model(config, embed_tokens=embed_tokens, lm_head=lm_head, final_norm=final_norm)
        if self.freeze_conv:
            for layer in model.layers:
                layer.attention_conv.requires_grad_(False)
                layer.mlp_conv.requires_grad_(False)
        return model

    def generator(self, step: int, micro_index: int) -> torch.Generator:
        self.step = step  # the selector weight's ramp reads the step of the micro-batch about to run
        return super().generator(step, micro_index)

    def weight(self) -> float:
        """λ at the current step."""
        if self.ramp_steps == 0:
            return self.selector_weight
        return self.selector_weight * min(1.0, self.step / self.ramp_steps)

    def forward_loss(self, model: nn.Module, config: DFlash2Config, batch: TrainBatch, generator: torch.Generator):
        """(loss, metric sums) for one micro-batch; ``model`` may be DDP-wrapped."""
        B = config.block_size
        anchors = sample_anchors(batch.loss_mask, self.num_anchors, generator, batch.anchor_mask)  # [Bt, N]
        anchor_ids = torch.gather(batch.input_ids, 1, anchors.clamp(min=0))
        labels, supervised = block_labels(batch.input_ids, batch.loss_mask, anchors, B)  # [Bt, N, m]
        predecessors = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)  # true predecessors
        out = model(batch.hidden_states, batch.attention_mask, anchor_ids, anchors, predecessors, self.stop_gradient)
        drafter = getattr(model, "module", model)  # unwrap DDP
        draft_labels = drafter.target_to_draft(labels)
        covered = supervised & (draft_labels >= 0)
        weights = position_weights(B, self.gamma)
        loss, ce = weighted_block_ce(out.logits, draft_labels.clamp(min=0), covered, weights)
        sel_loss, in_top, target = selector_ce(out.scores, out.candidates, draft_labels, covered, weights)
        with torch.no_grad():
            metrics = self._metrics(drafter, out, anchor_ids, labels, supervised, covered, ce, in_top, target)
        return loss + self.weight() * sel_loss, metrics

    @staticmethod
    def activation_memory(config: DFlash2Config, objective: DFlash2Objective, shape: StepShape) -> ActivationMemory:
        """What one micro-batch's ``forward_loss`` keeps for its backward (``trainer/memory.py``): the DFlash
        backbone with four grouped convolutions per layer (each tap's shifted rows and coefficients),
        the drafted rows' logits and log-softmax, the selector's scores after the true predecessors,
        and the metrics' lattice of every candidate pair."""
        out = ActivationMemory()
        a, D, K, r = shape.act_bytes, config.hidden_size, config.num_candidates, config.selector_rank
        V_d = config.draft_vocab_size or config.vocab_size
        conv = 4 * (2 * config.conv_kernel_size + 1) * D * a  # per block row and layer
        blocks = backbone_memory(config, min(objective.num_anchors, shape.seq_len - 1), shape, out, layer_extra=conv)
        rows = blocks * (config.block_size - 1)
        out.keep("layers", rows * D * a)  # the drafted rows' states, gathered
        out.keep("vocab", vocab_rows(rows, V_d, 2))  # unary logits, log-softmax
        out.keep("selector", rows * (K * r + 2 * r + K) * FP32)  # successor rows, projected hidden, context
        out.spike(rows * (3 * K * r + K * K) * FP32)  # the metrics' lattice: K predecessors per position
        out.spike(vocab_rows(rows, V_d, 1))  # the loss's gradient
        return out

    @staticmethod
    def _metrics(drafter, out, anchor_ids, labels, supervised, covered, ce, in_top, target) -> dict:
        """Metric sums (module docstring); tensors [m] per position or [1]."""
        Bt, N, m = labels.shape
        unary_top1 = drafter.draft_to_target(out.logits.argmax(-1))
        correct = (unary_top1 == labels) & supervised
        index, ids, lattice = drafter.lattice(out.logits, out.hidden, anchor_ids)
        K = ids.shape[-1]
        path, _ = selector_walk(lattice.float().reshape(Bt * N, m, K, K).contiguous(),
                                torch.zeros(Bt * N, device=labels.device),
                                torch.zeros(Bt * N, m, device=labels.device))
        walked = ids.gather(-1, path.view(Bt, N, m, 1))[..., 0]  # [Bt, N, m] the walk's drafts
        walk_ok = (walked == labels) & supervised
        prefix = torch.cat([torch.ones_like(walk_ok[..., :1]), walk_ok.long().cumprod(-1)[..., :-1].bool()], dim=-1)
        cond = prefix & supervised  # every earlier position drafted right by the walk
        has_first = supervised[..., 0]
        return {
            "count": supervised.sum((0, 1)).double(),
            "correct": correct.sum((0, 1)).double(),
            "ce": (ce.detach() * covered).sum((0, 1)).double(),
            "covered": covered.sum((0, 1)).double(),
            "blocks": has_first.sum().double().reshape(1),
            "accepted": (correct.long().cumprod(-1).sum(-1) * has_first).sum().double().reshape(1),
            "cond_count": cond.sum((0, 1)).double(),
            "cond_recall1": (cond & correct).sum((0, 1)).double(),
            "cond_recallk": (cond & in_top).sum((0, 1)).double(),
            "in_top": in_top.sum((0, 1)).double(),
            "selector_correct": (in_top & (out.scores.argmax(-1) == target)).sum((0, 1)).double(),
            "walk_accepted": (walk_ok.long().cumprod(-1).sum(-1) * has_first).sum().double().reshape(1),
        }

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict:
        """DFlash's summary plus conditional recall, teacher-forced selector accuracy and the walk's tau."""
        summary = DFlashStrategy.summarize(sums)
        cond = sums["cond_count"].clamp(min=1)
        summary.update({
            "recall1_by_pos": (sums["cond_recall1"] / cond).tolist(),
            "recallk_by_pos": (sums["cond_recallk"] / cond).tolist(),
            "selector_acc_by_pos": (sums["selector_correct"] / sums["in_top"].clamp(min=1)).tolist(),
            "topk_coverage": float(sums["in_top"].sum() / sums["count"].sum().clamp(min=1)),
            "tau_walk": float(1 + sums["walk_accepted"].sum() / sums["blocks"].sum().clamp(min=1)),
        })
        return summary
