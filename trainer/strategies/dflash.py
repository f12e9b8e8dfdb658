"""DFlash objective (seed §4.3): random anchors, strict context boundary, position-weighted CE.

Per sequence of a TrainBatch:

1. **Anchors.** A position ``a`` can anchor a block iff ``loss_mask[a]`` and ``loss_mask[a+1]``
   (the anchor is a real answer token — at inference it is the token the target just
   produced — and the first prediction has a supervised label). Up to ``num_anchors`` are
   drawn without replacement, uniformly, from a generator seeded by (seed, step, micro-batch
   index), so a resumed run draws the same anchors.
2. **Blocks** ``[x_a, MASK × (B−1)]`` at positions ``a … a+B−1``; the drafter sees target
   context only at positions ``< a`` (``drafters/dflash.py::BlockLayout``).
3. **Loss.** Block position ``j = 1 … m`` predicts ``x[a+j]``, supervised where ``a+j`` is in the
   sequence and ``loss_mask[a+j]`` (``M``) — and, with a draft vocabulary, where ``x[a+j]`` is in
   it (a token the drafter cannot propose has no target in its softmax)::

       L = − Σ_{n,j} M_{n,j} w_j log q_{n,j}(x_{a_n+j}) / Σ_{n,j} M_{n,j} w_j,   w_j = exp(−(j−1)/γ)

   ``γ`` (``gamma``) is the decay scale of the position weights, named apart from the block
   size on purpose: early mistakes waste the whole suffix, so early positions weigh more.
   DFlash's published settings grow it with the block (4 for B = 8, 5 for 10, 7 for 16);
   the default here is 4 for the default B = 8. The LM head and the CE run a chunk of rows at a
   time (``head_ce``, ``trainer/vocab_loss.py``).

Metrics are returned as sums (so they add over micro-batches, steps and ranks): per position
``j`` the supervised count, correct top-1 count (a label outside the draft vocabulary is a miss,
so accuracy is comparable with and without one), the count inside the draft vocabulary and the
CE sum over those, plus the teacher-forced accepted
length: the number of leading positions whose top-1 is correct, per block (``tau_tf − 1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specray.drafters.common import ATTENTION_QUERY_CHUNK
from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.trainer.loader import TrainBatch
from specray.trainer.memory import ActivationMemory, StepShape, chunked_attention, chunked_vocab, rmsnorm, rope, swiglu
from specray.trainer.vocab_loss import over_rows


class DFlashObjective(BaseModel):
    """The manifest's ``objective`` section when ``drafter.algorithm`` is dflash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_anchors: int = Field(16, gt=0, description="blocks sampled per sequence per step")
    gamma: float = Field(4.0, gt=0, description="position-weight decay w_j = exp(-(j-1)/gamma)")


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[Bt, T] bool: positions whose token and next token are both supervised."""
    valid = torch.zeros_like(loss_mask)
    valid[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return valid


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator,
                   allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[Bt, N] sorted anchor positions, −1 where a sequence has fewer than N valid anchors (valid:
    ``valid_anchor_mask``, and ``allowed`` [Bt, T] when given — a batch's ``anchor_mask``).

    Drawn on the CPU from the (CPU) ``generator`` whatever device ``loss_mask`` is on, so a CUDA
    run draws the same anchors as a CPU run; returned on ``loss_mask``'s device."""
    valid = valid_anchor_mask(loss_mask.cpu())
    if allowed is not None:
        valid &= allowed.cpu()
    anchors = torch.full((loss_mask.shape[0], num_anchors), -1, dtype=torch.long)
    for row in range(loss_mask.shape[0]):
        candidates = valid[row].nonzero().flatten()
        if len(candidates) > num_anchors:
            pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
            candidates = candidates[pick].sort().values
        anchors[row, : len(candidates)] = candidates
    return anchors.to(loss_mask.device)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Labels [Bt, N, m] (token at anchor + j, j = 1..m) and their supervision mask M [Bt, N, m]."""
    Bt, T = input_ids.shape
    offsets = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + offsets  # [Bt, N, m]
    inside = (anchors[..., None] >= 0) & (pos < T)
    pos = pos.clamp(0, T - 1)
    labels = torch.gather(input_ids, 1, pos.flatten(1)).view_as(pos)
    supervised = torch.gather(loss_mask, 1, pos.flatten(1)).view_as(pos) & inside
    return labels, supervised


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_j = exp(−(j−1)/γ) for j = 1..m."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def weighted_block_ce(logits: torch.Tensor, labels: torch.Tensor, supervised: torch.Tensor, weights: torch.Tensor):
    """Seed §4.3 loss. logits [Bt, N, m, V]; labels/supervised [Bt, N, m]; weights [m].

    Returns (loss, per-token CE [Bt, N, m]).
    """
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return position_weighted(ce, supervised, weights), ce


def position_weighted(ce: torch.Tensor, supervised: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ M w_j CE / Σ M w_j over ce/supervised [Bt, N, m] and weights [m] (0, still in the graph, when
    nothing is supervised)."""
    w = weights.to(ce.device)[None, None, :] * supervised
    denom = w.sum()
    return (ce * w).sum() / denom if denom > 0 else ce.sum() * 0.0


def head_ce(drafter: DFlashDrafter, states: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CE of the drafter's logits on final states [..., D] against ``labels`` [...] (draft ids),
    and the logits' argmax [...] (draft ids): the LM head applied a chunk of rows at a time
    (``trainer/vocab_loss.py``), so no ``[rows, V]`` tensor of every row exists."""
    flat, targets = states.reshape(-1, states.shape[-1]), labels.reshape(-1)

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = drafter.logits(flat[start:stop])
        return F.cross_entropy(logits.float(), targets[start:stop], reduction="none"), logits.argmax(-1)

    ce, top = over_rows(rows, flat.shape[0], drafter.config.draft_vocab_size or drafter.config.vocab_size)
    return ce.view_as(labels), top.view_as(labels)


class DFlashStrategy:
    """Builds the DFlash drafter and computes its loss and metrics on a TrainBatch."""

    algorithm = "dflash"
    objective = DFlashObjective
    model_class = DFlashDrafter  # a variant on the DFlash backbone (DFlash 2) builds its own
    evaluation = {"num_anchors": 64}  # held-out evaluation samples more blocks per sequence than a step

    def __init__(self, objective: DFlashObjective = DFlashObjective(), *, seed: int = 0):
        self.num_anchors = objective.num_anchors
        self.gamma = objective.gamma
        self.seed = seed

    def build_model(self, config: DFlashConfig, *, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                    final_norm: nn.Module | None = None) -> DFlashDrafter:
        """A fresh drafter whose first logits are near-uniform.

        At init every MASK row's hidden state is dominated by the MASK embedding, so a unit-scale
        final norm makes the shared LM head confidently predict tokens that look like MASK
        (initial CE far above log V). Starting the final norm at a tenth of the target's keeps
        the first logits small; the norm learns its scale back within a few steps.
        """
        model = self.model_class(config, embed_tokens=embed_tokens, lm_head=lm_head)
        if final_norm is not None:
            with torch.no_grad():
                model.norm.weight.copy_(final_norm.weight * 0.1)
        return model

    def generator(self, step: int, micro_index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + micro_index)

    def forward_loss(self, model: nn.Module, config: DFlashConfig, batch: TrainBatch, generator: torch.Generator):
        """(loss, metric sums) for one micro-batch; ``model`` may be DDP-wrapped."""
        B = config.block_size
        anchors = sample_anchors(batch.loss_mask, self.num_anchors, generator, batch.anchor_mask)  # [Bt, N]
        anchor_ids = torch.gather(batch.input_ids, 1, anchors.clamp(min=0))
        states = model(batch.hidden_states, batch.attention_mask, anchor_ids, anchors, head=False)  # [Bt, N, m, D]
        labels, supervised = block_labels(batch.input_ids, batch.loss_mask, anchors, B)
        drafter = getattr(model, "module", model)  # unwrap DDP
        draft_labels = drafter.target_to_draft(labels)  # = labels without a draft vocabulary
        covered = supervised & (draft_labels >= 0)
        ce, top = head_ce(drafter, states, draft_labels.clamp(min=0))  # [Bt, N, m] each
        loss = position_weighted(ce, covered, position_weights(B, self.gamma))
        with torch.no_grad():
            # A label outside the draft vocabulary cannot be drafted: it counts as a miss.
            correct = (drafter.draft_to_target(top) == labels) & supervised
            # leading run of correct predictions per block (blocks with a first label only)
            accepted = torch.cumprod(correct.long(), dim=-1).sum(-1)
            has_first = supervised[..., 0]
            metrics = {
                "count": supervised.sum((0, 1)).double(),  # [m]
                "correct": correct.sum((0, 1)).double(),  # [m]
                "ce": (ce.detach() * covered).sum((0, 1)).double(),  # [m]
                "covered": covered.sum((0, 1)).double(),  # [m] labels inside the draft vocabulary
                "blocks": has_first.sum().double().reshape(1),
                "accepted": (accepted * has_first).sum().double().reshape(1),
            }
        return loss, metrics

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict:
        """Turn accumulated sums into per-position accuracy/loss and teacher-forced tau."""
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
    def activation_memory(config: DFlashConfig, objective: DFlashObjective, shape: StepShape) -> ActivationMemory:
        """What one micro-batch's ``forward_loss`` keeps for its backward (``trainer/memory.py``): the
        backbone over its blocks (``backbone_memory``), then the logits of the ``B − 1`` drafted rows
        per block and the cross-entropy's log-softmax."""
        out = ActivationMemory()
        blocks = backbone_memory(config, min(objective.num_anchors, shape.seq_len - 1), shape, out)
        rows = blocks * (config.block_size - 1)  # the anchor row predicts nothing
        out.keep("layers", rows * config.hidden_size * shape.act_bytes)  # the drafted rows' states, gathered
        # logits and log-softmax kept; the loss's gradient
        kept, short = chunked_vocab(rows, config.draft_vocab_size or config.vocab_size, kept=2, short=1)
        out.keep("vocab", kept)
        out.spike(short)
        return out


def backbone_memory(config: DFlashConfig, anchors: int, shape: StepShape, out: ActivationMemory,
                    *, layer_extra: float = 0.0) -> int:
    """Count into ``out`` what the DFlash backbone (``DFlashDrafter.block_hidden``) keeps for ``anchors``
    blocks per sequence: the context's projection and per-layer K/V over all ``S`` positions, the
    block attention per layer (``Q = anchors × block_size`` queries over ``S + block_size`` keys, in
    chunks of whole blocks), the block rows' activations, plus ``layer_extra`` bytes per block row and
    layer (a variant's additions). Returns the number of blocks (``Bt × anchors``)."""
    Bt, S, a, R = shape.batch, shape.seq_len, shape.act_bytes, shape.rows
    D, H, Hkv, hd, I = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                        config.intermediate_size)
    Q = anchors * config.block_size
    BQ = Bt * Q
    out.keep("layers", R * D * a + rmsnorm(R, D, a))  # fc output, context norm
    for _ in range(config.num_layers):
        k = R * Hkv * hd * a + rmsnorm(R * Hkv, hd, a) + rope(R, Hkv, hd, a)  # context K: proj, k_norm, RoPE
        out.keep("layers", k + R * Hkv * hd * a)  # + context V
        q = BQ * H * hd * a + rmsnorm(BQ * H, hd, a) + rope(BQ, H, hd, a)
        k_d = BQ * Hkv * hd * a + rmsnorm(BQ * Hkv, hd, a) + rope(BQ, Hkv, hd, a)
        norms = 2 * rmsnorm(BQ, D, a) + 2 * BQ * D * a  # input and post norms, the layer's input and residual
        out.keep("layers", norms + q + k_d + BQ * Hkv * hd * a + 2 * BQ * H * hd * a + swiglu(BQ, I, a)
                 + BQ * layer_extra)
        chunk = max(1, ATTENTION_QUERY_CHUNK // config.block_size) * config.block_size  # whole blocks
        out.attention(chunked_attention(Bt, H, Q, S + config.block_size, a, chunk=chunk, mask_rows=BQ))
    out.keep("layers", BQ * D * a + rmsnorm(BQ, D, a))  # the final norm
    return Bt * anchors
