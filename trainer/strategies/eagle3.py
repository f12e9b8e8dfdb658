"""EAGLE-3 objective (seed §3.2–3.3): the training-time test, soft teacher targets, decayed steps.

Per sequence of a TrainBatch (``x`` tokens, ``h`` captured features, ``y`` the target's final-norm
output — the exact input of its LM head, ``capture/contract.py``):

1. **Unroll.** ``ttt_length`` steps over every row at once (``drafters/eagle3.py::forward``).
   Step ``i``, row ``t`` reads token ``x_{t+1+i}`` (teacher-forced: the data token, never the
   drafter's argmax) at position ``t + 1 + i``; step 0 reads the target state ``g_t = fc(h_t)``,
   step ``i > 0`` the drafter's own output state of step ``i − 1`` at the same row, and every
   step attends under ``ttt_attention_mask`` (its row's context, then its own chain). No
   stop-gradient between steps (seed §3.3): the gradient runs through the self-fed states.
2. **Teacher.** Step ``i`` row ``t`` predicts ``x_{t+2+i}``, so its teacher is the target's
   distribution at position ``t + 1 + i``: ``p = softmax(lm_head(y_{t+1+i}))`` over the draft
   vocabulary's rows (renormalised there; all of V without a draft vocabulary). The target is
   frozen and the teacher carries no gradient (``Teacher``).
3. **Supervision.** A row is supervised at step ``i`` iff its chain starts on an answer token
   (``loss_mask[t+1]``: at inference the chain starts at the anchor, a token the target
   produced) and stays in that answer up to the predicted token (``loss_mask[t+2 … t+2+i]``,
   past the end = no), so supervised rows shrink with depth. The loss
   also skips rows whose teacher argmax is outside the draft vocabulary (the drafter could not
   propose it; SpecForge's position mask), which accuracy counts as misses.
4. **Loss.** Soft cross-entropy per step, mean over its covered rows, steps weighted by
   ``ploss_decay ** i``::

       L = Σ_i ploss_decay^i · mean_{covered rows} ( − Σ_v p_v log q_v )

   The LM head, the teacher's rows and the CE run a chunk of rows at a time (``step_ce``,
   ``trainer/vocab_loss.py``).

Metrics are sums (they add over micro-batches, steps and ranks), per TTT depth ``i``: the
supervised count, top-1 agreement with the target's argmax (over the whole vocabulary), the
covered count and its CE sum; per chain (a row supervised at depth 0) the teacher-forced
accepted length, the leading run of correct depths, so ``tau_tf = 1 + mean accepted``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specray.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specray.trainer.loader import TrainBatch
from specray.drafters.common import ATTENTION_QUERY_CHUNK
from specray.trainer.memory import (ActivationMemory, StepShape, chunked_attention, chunked_vocab, rmsnorm, rope, swiglu,
                                    vocab_rows)
from specray.trainer.vocab_loss import fits_one_chunk, over_rows

TEACHER_CHUNK = 1024  # rows per full-vocabulary product when taking the teacher's argmax


class Eagle3Objective(BaseModel):
    """The manifest's ``objective`` section when ``drafter.algorithm`` is eagle3."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttt_length: int = Field(7, gt=0, description="training-time test steps unrolled (draft depths trained)")
    ploss_decay: float = Field(0.8, gt=0, le=1, description="weight of TTT step i: ploss_decay ** i")


def step_weights(ttt_length: int, ploss_decay: float) -> torch.Tensor:
    """[ttt_length] the loss weight of each TTT step: ``ploss_decay ** i``."""
    return ploss_decay ** torch.arange(ttt_length, dtype=torch.float64)


def shifted(mask: torch.Tensor, shift: int) -> torch.Tensor:
    """``mask[:, t + shift]`` at column ``t`` of [B, T], False past the end."""
    return F.pad(mask[:, shift:], (0, min(shift, mask.shape[1])))


def supervised_rows(loss_mask: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """[ttt_length, B, T] bool: row ``t`` supervised at step ``i`` iff ``loss_mask`` holds on all of
    ``t+1 … t+2+i`` (the chain's tokens and its label are one answer run; a chain never crosses a
    user turn). Example, loss_mask ``[0 1 1 1 0 1 1]``, 2 steps: step 0 ``[1 1 0 0 1 0 0]`` (chains
    from x_1, x_2, x_5 predicting x_2, x_3, x_6), step 1 ``[1 0 0 0 0 0 0]``."""
    rows = [shifted(loss_mask, 1) & shifted(loss_mask, 2)]
    for i in range(1, ttt_length):
        rows.append(rows[-1] & shifted(loss_mask, 2 + i))
    return torch.stack(rows)


class Teacher:
    """The target at the positions a micro-batch's steps read (module docstring, 2), exact (float32
    whatever autocast is on) and without gradient.

    ``argmax`` [B, T]: its argmax over the whole vocabulary (target ids; −1 where not asked), computed
    once. ``probs(b, t)``: its distribution over the draft vocabulary (all of V without one) at
    positions (b, t) [n] -> [n, V_d], read from ``[B, T, V_d]`` computed once when that is one
    vocabulary chunk (``trainer/vocab_loss.py``), else computed for the rows asked (a loss chunk,
    and again in its backward's recomputation), so no ``[B, T, V_d]`` tensor exists.

    last_hidden [B, T, D] (the final norm's output), rows [B, T] bool: the positions to compute."""

    @torch.no_grad()
    def __init__(self, drafter: Eagle3Drafter, last_hidden: torch.Tensor, rows: torch.Tensor):
        self.drafter, self.last_hidden = drafter, last_hidden
        B, T, _ = last_hidden.shape
        weight, _ = drafter.head()
        self.argmax = torch.full((B, T), -1, dtype=torch.long, device=last_hidden.device)
        self.cached: torch.Tensor | None = None
        if fits_one_chunk(B * T, weight.shape[0]):
            self.cached = torch.zeros(B, T, weight.shape[0], device=last_hidden.device)
            self.cached[rows] = self._probs(last_hidden[rows])
        if drafter.draft_vocab is None and self.cached is not None:
            self.argmax[rows] = self.cached[rows].argmax(-1)
            return
        full, bias = drafter.lm_head.weight.float(), drafter.lm_head.bias
        with torch.autocast(last_hidden.device.type, enabled=False):
            y = last_hidden[rows].float()
            if len(y):
                self.argmax[rows] = torch.cat([F.linear(chunk, full, None if bias is None else bias.float()).argmax(-1)
                                               for chunk in y.split(TEACHER_CHUNK)])

    @torch.no_grad()
    def probs(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[n, V_d] float32: the distribution at positions (b, t), b/t [n]."""
        return self.cached[b, t] if self.cached is not None else self._probs(self.last_hidden[b, t])

    def _probs(self, y: torch.Tensor) -> torch.Tensor:
        weight, bias = self.drafter.head()
        with torch.autocast(y.device.type, enabled=False):
            return F.linear(y.float(), weight.float(), None if bias is None else bias.float()).softmax(-1)


def soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """−Σ_v p_v log softmax(logits)_v per row: logits/p [N, V_d] -> [N]."""
    return -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def step_ce(drafter: Eagle3Drafter, states: torch.Tensor, target: Teacher, b: torch.Tensor,
            position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's soft CE against the teacher at (b, position) and its logits' argmax (draft ids),
    states [n, D] (normed), b/position [n] -> ([n], [n]): the LM head, the teacher and the CE a
    chunk of rows at a time (``trainer/vocab_loss.py``)."""

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = drafter.logits(states[start:stop])
        return soft_ce(logits, target.probs(b[start:stop], position[start:stop])), logits.argmax(-1)

    return over_rows(rows, len(b), drafter.config.draft_vocab_size or drafter.config.vocab_size)


class Eagle3Strategy:
    """Builds the EAGLE-3 drafter and computes its training-time-test loss and metrics on a TrainBatch."""

    algorithm = "eagle3"
    objective = Eagle3Objective
    evaluation: dict = {}  # every row is supervised: held-out evaluation needs no other setting

    def __init__(self, objective: Eagle3Objective = Eagle3Objective(), *, seed: int = 0):
        self.ttt_length = objective.ttt_length
        self.ploss_decay = objective.ploss_decay
        self.seed = seed

    def build_model(self, config: Eagle3Config, *, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                    final_norm: nn.Module | None = None) -> Eagle3Drafter:
        """A fresh drafter whose final norm starts as the target's: its output state feeds the
        target's LM head, which expects the target's normalisation."""
        model = Eagle3Drafter(config, embed_tokens=embed_tokens, lm_head=lm_head)
        if final_norm is not None:
            with torch.no_grad():
                model.norm.weight.copy_(final_norm.weight)
        return model

    def generator(self, step: int, micro_index: int) -> torch.Generator:
        """The strategy protocol's per-micro-batch generator; the objective draws nothing from it."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + micro_index)

    def forward_loss(self, model: nn.Module, config: Eagle3Config, batch: TrainBatch, generator: torch.Generator):
        """(loss, metric sums) for one micro-batch; ``model`` may be DDP-wrapped."""
        if batch.last_hidden_states is None:
            raise ValueError("EAGLE-3 trains on the target's last_hidden_states: capture the features with "
                             "capture.algorithm=eagle3")
        drafter = getattr(model, "module", model)  # unwrap DDP
        supervised = supervised_rows(batch.loss_mask, self.ttt_length)  # [N, B, T]
        if batch.anchor_mask is not None:  # row t's chain starts at the anchor x[t + 1]
            supervised &= shifted(batch.anchor_mask, 1)
        # the teacher of step i row t sits at t + 1 + i, inside the row's answer run: there
        # loss_mask holds at that position and the next (a superset of what the steps read)
        needed = batch.loss_mask & shifted(batch.loss_mask, 1)
        target = Teacher(drafter, batch.last_hidden_states, needed)
        states = model(batch.hidden_states, batch.input_ids, supervised, head=False)  # per step [rows_i, D]
        weights = step_weights(self.ttt_length, self.ploss_decay)
        loss = states[0].sum() * 0.0  # keeps every step's graph (and DDP) alive when a step has no rows
        sums = {name: torch.zeros(self.ttt_length, dtype=torch.float64) for name in ("count", "correct", "ce", "covered")}
        correct = torch.zeros_like(supervised)
        for i, step_states in enumerate(states):
            b, t = supervised[i].nonzero(as_tuple=True)
            step_argmax = target.argmax[b, t + 1 + i]  # the teacher at position t + 1 + i
            covered = drafter.target_to_draft(step_argmax) >= 0
            ce, top = step_ce(drafter, step_states, target, b, t + 1 + i)  # [rows_i] each
            if covered.any():
                loss = loss + float(weights[i]) * (ce * covered).sum() / covered.sum()
            with torch.no_grad():
                correct[i][b, t] = drafter.draft_to_target(top) == step_argmax
                sums["count"][i] = len(b)
                sums["correct"][i] = float(correct[i].sum())
                sums["ce"][i] = float((ce.detach() * covered).sum())
                sums["covered"][i] = float(covered.sum())
        accepted = torch.cumprod(correct.long(), dim=0).sum(0)  # [B, T] leading correct depths per chain
        sums["blocks"] = supervised[0].sum().double().reshape(1)  # chains: rows supervised at depth 0
        sums["accepted"] = (accepted * supervised[0]).sum().double().reshape(1)
        return loss, {name: value.to(loss.device) for name, value in sums.items()}

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict:
        """Accumulated sums -> per-depth accuracy and CE, and the teacher-forced tau (``blocks`` = chains)."""
        count = sums["count"].clamp(min=1)
        blocks = sums["blocks"].clamp(min=1)
        return {
            "acc_by_pos": (sums["correct"] / count).tolist(),
            "ce_by_pos": (sums["ce"] / sums["covered"].clamp(min=1)).tolist(),
            "coverage": float(sums["covered"].sum() / count.sum()),
            "acc": float(sums["correct"].sum() / count.sum()),
            "tau_tf": float(1 + sums["accepted"].sum() / blocks.sum()),
            "blocks": int(sums["blocks"].sum()),
        }

    @staticmethod
    def activation_memory(config: Eagle3Config, objective: Eagle3Objective, shape: StepShape) -> ActivationMemory:
        """What one micro-batch's ``forward_loss`` keeps for its backward (``trainer/memory.py``): the
        teacher, then per TTT step the layers' activations, the attention over the row's context and
        chain (``ttt_attention``, in chunks of rows), and the step's log-softmax and teacher rows."""
        B, S, a, R = shape.batch, shape.seq_len, shape.act_bytes, shape.rows
        D, H, Hkv, hd, I = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                            config.intermediate_size)
        V_d, V = config.draft_vocab_size or config.vocab_size, config.vocab_size
        out = ActivationMemory()
        argmax_product = vocab_rows(min(R, TEACHER_CHUNK), V, 1)
        if fits_one_chunk(R, V_d):
            out.keep("teacher", vocab_rows(R, V_d, 1), forward_only=True)  # p [B, S, V_d]; its rows are gathered
            out.spike(vocab_rows(R, V_d, 2) + argmax_product)  # its product and softmax
        else:  # the argmax only; p is computed per loss chunk
            out.keep("teacher", R * 8)
            out.spike(argmax_product)
        out.keep("layers", R * D * a)  # the fused target state
        for step in range(objective.ttt_length):
            for layer in range(config.num_layers):
                width = 2 * D if layer == 0 else D
                norms = (3 if layer == 0 else 2) * rmsnorm(R, D, a)  # hidden + input (first layer), post-attention
                qkv = R * (H + 2 * Hkv) * hd * a + rope(R, H, hd, a) + rope(R, Hkv, hd, a)
                out.keep("layers", norms + R * (width + 2 * D + H * hd) * a  # qkv input, state, y, o_proj input
                         + qkv + swiglu(R, I, a))
                out.attention(chunked_attention(B, H, S, S + step, a, chunk=ATTENTION_QUERY_CHUNK))
            rows = B * max(S - 2 - step, 0)  # supervised rows at this depth
            out.keep("layers", rmsnorm(rows, D, a) + rows * D * a)
            # log-softmax and the teacher's rows kept, the logits short-lived (the step's loss is
            # computed before the next step runs); then the loss's gradient through the log-softmax
            kept, short = chunked_vocab(rows, V_d, kept=2, short=1)
            out.spike(short)
            out.keep("vocab", kept)
        out.spike(chunked_vocab(B * S, V_d, kept=2, short=1)[1])
        return out
