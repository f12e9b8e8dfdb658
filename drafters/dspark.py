"""DSpark drafter (seed §5): the DFlash backbone, the anchor-predict layout, a sequence head that
corrects each position with the previous draft token, and a confidence head.

**Backbone and layout (§5.2).** The block ``[a, MASK × (B−1)]`` at positions ``p_a … p_a + B−1``
runs through the DFlash backbone (``drafters/dflash.py``: KV injection of the target features,
context strictly before the anchor, the frozen shared embedding and LM head). Unlike DFlash,
every row predicts: row ``k`` (at position ``a + k``) predicts token ``a + k + 1``, so B rows
give ``m = B`` drafts, and verification runs ``[a, d1 … dm]`` (m + 1 target rows).

**Sequence head (§5.1).** Row ``k``'s backbone logits ``U_k`` (over V, or the draft vocabulary's
V_d) get a bias from the previous token ``d_k`` (``d_0 = a``, the anchor)::

    e_k = W1[d_k]                                    W1 [V, r] (``markov_w1``, target ids)
    vanilla  b_k = W2 e_k                            W2 [V_d, r] (``markov_w2``)
    gated    b_k = W2 (σ(G [h_k; e_k]) ⊙ e_k)        G  [r, D + r] + bias (``gate_proj``)
    rnn      [g; c; o] = J [s_{k−1}; e_k; h_k]        J  [3r, 2r + D] + bias (``joint_proj``)
             s_k = σ(g) ⊙ s_{k−1} + (1 − σ(g)) ⊙ tanh(c),   b_k = W2 tanh(o),   s_{−1} = 0
    q_k = softmax(U_k + b_k)                         the corrected distribution

``h_k`` is row k's final (normed) backbone hidden state. ``W2`` starts at zero: a fresh head gives
the backbone's distribution. Training feeds the data's previous tokens (teacher forcing);
drafting (``draft``) runs left to right, each draft the previous token of the next row, and the
``q`` it returns is the corrected distribution each draft was actually drawn from (seed §1.2:
never the backbone's softmax).

**Confidence head (§5.4).** ``c_k = σ(w · [h_k; e_k] + b)`` (``confidence_head.proj``; without
``confidence_head_with_markov`` the input is ``h_k`` alone): the predicted probability that draft
``k + 1`` survives verification given that the ones before it did; ``∏ c`` is the predicted
survival of a prefix.

**Calibration (§5.4).** ``specray calibrate`` fits one temperature per position on held-out features
(``trainer/strategies/dspark.py``, Sequential Temperature Scaling), once per serving mode
(``CALIBRATION_MODES``: ``greedy`` calibrates the survival of an argmax draft, ``sampling`` that of a
sampled one), and writes both tables into the export's ``calibration.json``; loading the export reads
it (``attach_export``) into ``confidence_temperature`` [2, B] (row ``CALIBRATION_MODES.index(mode)``),
and drafting returns ``σ(z_k / T_k)`` with each request's mode's row. Training and the teacher-forced
``corrected`` read the raw logits. A calibration file fitted for another block size or another export,
or one without a table per mode, is refused.

Module names are the speculators ``dspark`` model's (``markov_head.*``, ``confidence_head.proj.*``),
so the peer export (``drafters/peer.py``) renames only the backbone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from specray.drafters import dflash
from specray.drafters.common import MAX_RANK_MULTIPLE, Linear
from specray.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashSection

HEAD_TYPES = ("vanilla", "gated", "rnn")
CALIBRATION_FILE = "calibration.json"  # in an export directory, written by `specray calibrate`
CALIBRATION_MODES = ("greedy", "sampling")  # serving modes, each with its own temperature table


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash's config (``block_size`` = B = m drafts here) plus the sequence and confidence heads."""

    markov_rank: int = 256  # r: rank of the sequence head's W1 / W2
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head_with_markov: bool = True  # confidence input [h; W1[prev]] (False: h alone)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 (the sequence head's rank), got {self.markov_rank}")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {HEAD_TYPES}, got {self.markov_head_type!r}")

    @property
    def num_draft_tokens(self) -> int:  # m = B: the anchor row predicts too
        return self.block_size

    @classmethod
    def limits(cls, hidden_size: int, vocab_size: int) -> dict[str, tuple[float, float]]:
        """DFlash's bounds and the sequence head's rank (at most MAX_RANK_MULTIPLE · D)."""
        return {**super().limits(hidden_size, vocab_size), "markov_rank": (1, MAX_RANK_MULTIPLE * hidden_size)}


class DSparkSection(DFlashSection):
    """The manifest's ``drafter`` section for ``algorithm: dspark`` (sizes left unset are the target's)."""

    algorithm: Literal["dspark"] = Field("dspark", description="drafter to train; its features must be captured "
                                                               "with capture.algorithm=dspark")
    block_size: int = Field(8, description="B: block rows, each predicting one draft (m = B drafts; >= 2)")
    markov_rank: int = Field(256, gt=0, description="rank r of the sequence head (W1 [V, r], W2 [V_d, r])")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla", description="sequence head: vanilla (bias W2 W1[prev]), gated (hidden-gated), rnn (state over "
                               "the block)")
    confidence_head_with_markov: bool = Field(True, description="confidence head input [h; W1[prev]] (False: h)")

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        if value < 2:
            raise ValueError("block_size must be >= 2 (B rows, each drafting one token)")
        return value

    def drafter_config(self, target: Any, layer_ids: tuple[int, ...]) -> DSparkConfig:
        """The model config of this section for ``target``, reading the captured ``layer_ids``."""
        backbone = super().drafter_config(target, layer_ids)
        return DSparkConfig(**backbone.to_dict(), markov_rank=self.markov_rank,
                            markov_head_type=self.markov_head_type,
                            confidence_head_with_markov=self.confidence_head_with_markov)


def debug_config(target: Any, layer_ids: tuple[int, ...] | None = None) -> DSparkConfig:
    """A tiny DSpark config for tests on ``target``: DFlash's debug backbone (B = 4), rank 16."""
    return DSparkConfig(**dflash.debug_config(target, layer_ids).to_dict(), markov_rank=16)


class SequenceHead(nn.Module):
    """The sequence head (module docstring): a logit bias [..., V_d] from the previous token."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        D, r = cfg.hidden_size, cfg.markov_rank
        self.head_type, self.rank = cfg.markov_head_type, r
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = Linear(r, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh head gives the backbone's distribution
        if self.head_type == "gated":
            self.gate_proj = Linear(D + r, r)
        elif self.head_type == "rnn":
            self.joint_proj = Linear(2 * r + D, 3 * r)

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1 rows of the previous tokens (target ids) [...] -> [..., r]."""
        return self.markov_w1(prev_ids)

    def initial_state(self, like: torch.Tensor) -> torch.Tensor | None:
        """The rnn state before row 0, zeros [..., r] for ``like`` [..., *]; None for a stateless head."""
        return like.new_zeros(*like.shape[:-1], self.rank) if self.head_type == "rnn" else None

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One row: prev_emb [..., r], hidden [..., D], state [..., r] or None -> (bias [..., V_d], state)."""
        if self.head_type == "vanilla":
            return self.markov_w2(prev_emb), state
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return self.markov_w2(gate * prev_emb), state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state

    def block(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced rows: prev_ids [..., B], hidden [..., B, D] -> (bias [..., B, V_d], prev_emb [..., B, r])."""
        prev_emb = self.prev_embeddings(prev_ids).to(hidden.dtype)
        if self.head_type != "rnn":  # stateless: every row at once
            return self.step(prev_emb, hidden, None)[0], prev_emb
        state, biases = self.initial_state(hidden[..., 0, :]), []
        for k in range(hidden.shape[-2]):
            bias, state = self.step(prev_emb[..., k, :], hidden[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2), prev_emb


class ConfidenceHead(nn.Module):
    """``c = σ(proj(features))``: features [..., F] -> confidence logits [...]."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = Linear(input_dim, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# pick(logits [Bt, V_d] corrected, row k) -> (draft-vocabulary indices [Bt], q [Bt, V_d] they were drawn
# from, or None when every row took its argmax)
Pick = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


class DSparkDrafter(DFlashDrafter):
    """The DSpark draft model: ``DFlashDrafter``'s backbone plus ``markov_head`` and ``confidence_head``."""

    algorithm = "dspark"

    def __init__(self, config: DSparkConfig, *, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__(config, embed_tokens=embed_tokens, lm_head=lm_head)
        self.markov_head = SequenceHead(config)
        extra = config.markov_rank if config.confidence_head_with_markov else 0
        self.confidence_head = ConfidenceHead(config.hidden_size + extra)
        # [modes, B] per-mode, per-position temperatures of the confidence logits (rows in CALIBRATION_MODES
        # order); not in the state dict (calibration.json)
        self.register_buffer("confidence_temperature", torch.ones(len(CALIBRATION_MODES), config.block_size),
                             persistent=False)

    def attach_export(self, export_dir: str | Path) -> None:
        """Read ``calibration.json`` of the export this drafter was loaded from, if there is one."""
        path = Path(export_dir) / CALIBRATION_FILE
        if path.is_file():
            tables = read_calibration(export_dir, self.config.block_size)
            self.confidence_temperature.copy_(torch.tensor([tables[mode] for mode in CALIBRATION_MODES],
                                                            device=self.confidence_temperature.device))

    def confidence_logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """hidden [..., D], prev_emb [..., r] -> confidence logits [...]."""
        features = torch.cat([hidden, prev_emb], dim=-1) if self.config.confidence_head_with_markov else hidden
        return self.confidence_head(features)

    def corrected(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced heads: hidden [..., B, D], prev_ids [..., B] target ids (row k's previous token)
        -> (corrected logits [..., B, V_d], confidence logits [..., B])."""
        bias, prev_emb = self.markov_head.block(prev_ids, hidden)
        return self.logits(hidden) + bias, self.confidence_logits(hidden, prev_emb)

    def forward(self, hidden_states, context_valid, anchor_ids, anchors, prev_ids):
        """Training forward over many blocks per sequence (the backbone's arguments as
        ``DFlashDrafter.block_hidden``; prev_ids [Bt, N, B] the data's token at ``anchor + k``).

        Returns (logits [Bt, N, B, V_d], confidence logits [Bt, N, B]): row k predicts ``anchor + k + 1``."""
        hidden = self.block_hidden(hidden_states, context_valid, anchor_ids, anchors)  # [Bt, N, B, D]
        return self.corrected(hidden, prev_ids)

    def draft(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, pick: Pick, greedy: torch.Tensor | bool):
        """Draft left to right through the heads.

        hidden [Bt, k, D]: the block's first k rows; anchor_ids [Bt] (target ids); ``pick`` draws each
        row's draft from its corrected logits; ``greedy`` [Bt] bool (or one bool for all): which rows
        are greedy requests, whose confidences use the greedy table (the others the sampling one).
        Returns (drafts [Bt, k] target ids, q [Bt, k, V_d] the distributions they were drawn from
        (None when ``pick`` gave none), calibrated confidence [Bt, k] in (0, 1): ``c_{j+1}`` reads the
        drafts before ``d_{j+1}``, never ``d_{j+1}`` itself)."""
        base = self.logits(hidden)  # [Bt, k, V_d]
        mode = (~torch.as_tensor(greedy, device=hidden.device).bool()).long().expand(hidden.shape[0])  # [Bt] row
        temperature = self.confidence_temperature[mode]  # [Bt, B]
        prev, state = anchor_ids, self.markov_head.initial_state(hidden[:, 0])
        drafts, qs, confidence = [], [], []
        for k in range(hidden.shape[1]):
            prev_emb = self.markov_head.prev_embeddings(prev).to(hidden.dtype)  # [Bt, r]
            bias, state = self.markov_head.step(prev_emb, hidden[:, k], state)
            z = self.confidence_logits(hidden[:, k], prev_emb) / temperature[:, k]  # [Bt]
            confidence.append(torch.sigmoid(z))
            index, q = pick(base[:, k] + bias, k)
            prev = self.draft_to_target(index)
            drafts.append(prev)
            qs.append(q)
        q = None if qs[0] is None else torch.stack(qs, dim=1)
        return torch.stack(drafts, dim=1), q, torch.stack(confidence, dim=1)


def export_identity(export_dir: str | Path) -> dict:
    """What a calibration file is checked against: the export's fingerprints and weights' sha256."""
    path = Path(export_dir)
    config = json.loads((path / "config.json").read_text())
    export = json.loads((path / "export.json").read_text())
    return {"target_fingerprint": config["target_fingerprint"], "template_fingerprint": config["template_fingerprint"],
            "weights_sha256": export["weights_sha256"]}


def write_calibration(export_dir: str | Path, tables: dict[str, list[float]], report: dict) -> Path:
    """Write ``calibration.json``: per mode of ``CALIBRATION_MODES`` its temperatures [B] (and its part of
    ``report["modes"]``), the export's identity and the rest of ``report``."""
    if sorted(tables) != sorted(CALIBRATION_MODES) or len({len(t) for t in tables.values()}) != 1:
        raise ValueError(f"calibration needs one table per mode {list(CALIBRATION_MODES)}, all of one block size; "
                         f"got {({m: len(t) for m, t in tables.items()})}")
    per_mode = report.get("modes", {})
    path = Path(export_dir) / CALIBRATION_FILE
    body = {"method": "sequential_temperature_scaling", "block_size": len(next(iter(tables.values()))),
            **export_identity(export_dir), **{k: v for k, v in report.items() if k != "modes"},
            "modes": {mode: {**per_mode.get(mode, {}), "temperatures": [float(t) for t in tables[mode]]}
                      for mode in CALIBRATION_MODES}}
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def read_calibration(export_dir: str | Path, block_size: int) -> dict[str, list[float]]:
    """The temperature table [B] of each serving mode in ``export_dir``'s calibration file, checked against
    the export's block size and identity (ValueError naming the file and the fix otherwise)."""
    path = Path(export_dir) / CALIBRATION_FILE
    fix = (f"re-run `specray calibrate {export_dir} --manifest HELDOUT` to fit it for this export "
           f"(or delete {path} to serve uncalibrated confidences)")
    body = json.loads(path.read_text())
    modes = body.get("modes")
    if not isinstance(modes, dict) or sorted(modes) != sorted(CALIBRATION_MODES):
        raise ValueError(f"{path} has no temperature table per serving mode {list(CALIBRATION_MODES)} (greedy "
                         "survival is an argmax match, sampling survival the overlap 1 - TV: one table cannot "
                         f"serve both): {fix}")
    tables = {mode: modes[mode].get("temperatures") if isinstance(modes[mode], dict) else None
              for mode in CALIBRATION_MODES}
    if body.get("block_size") != block_size or any(not isinstance(t, list) or len(t) != block_size
                                                   for t in tables.values()):
        raise ValueError(f"{path} was fitted for block_size {body.get('block_size')}, the export has "
                         f"{block_size}: {fix}")
    identity = export_identity(export_dir)
    wrong = sorted(key for key, value in identity.items() if body.get(key) != value)
    if wrong:
        raise ValueError(f"{path} was fitted for another export ({', '.join(wrong)} differ): {fix}")
    tables = {mode: [float(t) for t in temps] for mode, temps in tables.items()}
    bad = {mode: temps for mode, temps in tables.items() if not all(math.isfinite(t) and t > 0 for t in temps)}
    if bad:
        raise ValueError(f"{path}: temperatures must be finite and > 0, got {bad}: {fix}")
    return tables
