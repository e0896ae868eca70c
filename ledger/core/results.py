"""Typed results of the calibration and of the estimator scoreboard: what ``vram calibrate
--json`` prints, what the site's templates read, and what ``vram.json`` publishes under
``derived`` (so ``vram.schema.json`` describes all of it). Units live in field names; a figure
that could not be computed is null."""

from __future__ import annotations

from typing import Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid", serialize_by_alias=True, validate_by_name=True)


def _plain(cls: type[BaseModel]) -> bool:
    """Whether a model's object is its fields' values and nothing more (no aliases, no post-init
    hook, not a root model): what ``maker`` and ``typed_rows`` may build without ``model_construct``."""
    return not cls.__pydantic_post_init__ and not cls.__pydantic_root_model__ and all(
        f.alias is None and f.validation_alias is None for f in cls.__pydantic_fields__.values())


def maker(cls: type[BaseModel]) -> Callable[[dict], BaseModel]:
    """A function making ``cls.model_construct(**values)`` from a dict that gives every field of
    ``cls`` by its name and nothing else (values the project computed and typed itself: the fit
    table's some 70,000 cells, a ceiling scan's intervals): the same object, without
    ``model_construct``'s per-field alias and default lookups (a tenth of its cost). A dict that
    does not give exactly the fields, or a model with aliases or a post-init hook, goes through
    ``model_construct`` itself; ``tests/test_build_scale.py`` compares the two."""
    names = list(cls.__pydantic_fields__)
    plain = _plain(cls)
    keys = set(names)
    new, set_attr = cls.__new__, object.__setattr__

    def make(values: dict) -> BaseModel:
        if not plain or values.keys() != keys:
            return cls.model_construct(**values)
        m = new(cls)
        set_attr(m, "__dict__", {n: values[n] for n in names})
        set_attr(m, "__pydantic_fields_set__", set(names))
        set_attr(m, "__pydantic_extra__", None)
        set_attr(m, "__pydantic_private__", None)
        return m
    return make


def typed_rows(cls: type[BaseModel], rows) -> list:
    """``maker(cls)`` of each row given as a tuple of every field's value in the model's order
    (the fit table's 70,000 cells: no dict of names to look each value up in)."""
    names = tuple(cls.__pydantic_fields__)
    if not _plain(cls):
        make = maker(cls)
        return [make(dict(zip(names, row))) for row in rows]
    new, set_attr = cls.__new__, object.__setattr__
    out = []
    for row in rows:
        if len(row) != len(names):
            raise ValueError(f"{cls.__name__}: {len(row)} values for {len(names)} fields")
        m = new(cls)
        set_attr(m, "__dict__", dict(zip(names, row)))
        set_attr(m, "__pydantic_fields_set__", set(names))
        set_attr(m, "__pydantic_extra__", None)
        set_attr(m, "__pydantic_private__", None)
        out.append(m)
    return out


# -- calibration -------------------------------------------------------------------------------


class ProbeRealPair(_Result):
    """A probe and the real runs of its recipe measured after it: the probe's over-estimate."""

    probe: str = Field(description="Id of the probe.")
    reals: list[str] = Field(description="Ids of the real runs it is paired with.")
    probe_mib: float = Field(description="The probe's peak allocated, MiB.")
    real_mib: float = Field(description="The highest peak allocated of the real runs, MiB.")
    overestimate_pct: float = Field(description="(core - real) / core x 100, core = the probe's peak less the fp32 "
                                                "logits of the positions it kept (the peak itself when unknown).")
    key: list[Union[bool, int, str, None]] = Field(description="The recipe key: card, model, quant, rank, dropout, "
                                                               "DoRA, memory fixes.")
    probe_seq_len: Optional[int] = Field(description="Tokens the probe ran on.")
    on: str = Field(description="Date of the probe.")
    kept_positions: Optional[int] = Field(None, description="Positions the probe's lm_head kept logits for "
                                                            "(logits_to_keep), when known.")
    logits_mib: Optional[float] = Field(None, description="Those logits in fp32 (vocabulary x 4 bytes each), MiB.")
    core_mib: Optional[float] = Field(None, description="The probe's peak less those logits, MiB.")
    raw_overestimate_pct: Optional[float] = Field(None, description="(probe - real) / probe x 100, on the raw peak.")


class OverestimatePct(_Result):
    """The probe's over-estimate of a real run's peak: the anchors' median and every pair's range."""

    median: Optional[float] = Field(description="Median over the anchors, %, of the probes' cores.")
    low: Optional[float] = Field(description="Lowest over every pair, %.")
    high: Optional[float] = Field(description="Highest over every pair, %.")
    kept_positions_max: Optional[int] = Field(None, description="The longest response span (kept positions) a "
                                                                "pair covered: a prediction subtracts logits up "
                                                                "to it, no further.")


class RankCost(_Result):
    """MiB per unit of LoRA rank for one card and group of probes."""

    gpu: str
    quant: Optional[str]
    seq_len: Optional[int] = Field(description="Tokens.")
    dropout: bool
    dora: bool
    fixes: str = Field(description="Memory fixes (canonical key).")
    mib_per_rank: float = Field(description="Slope of peak allocated over rank, MiB per rank unit.")
    rows: list[str] = Field(description="Ids of the probes it rests on.")


class PairedCost(_Result):
    """Two probes identical but for one switch (dropout or DoRA): what switching it on costs."""

    gpu: str
    rank: int
    seq_len: Optional[int] = Field(description="Tokens.")
    quant: Optional[str]
    cost_mib: float = Field(description="Peak with the switch on minus off, MiB.")
    rows: list[str] = Field(description="Ids of the two probes (off, on).")


class CostSummary(_Result):
    """A switch's cost over every pair."""

    median_mib: Optional[float]
    min_mib: Optional[float]
    max_mib: Optional[float]
    pairs: list[PairedCost]


class SeqCoefficients(_Result):
    """peak = c0 + c1 x tokens + c2 x tokens^2."""

    c0_mib: float
    c1_mib_per_token: float
    c2_mib_per_token2: float


class SeqStep(_Result):
    """The slope between two probed lengths."""

    from_tokens: int = Field(alias="from", description="Shorter length, tokens.")
    to: int = Field(description="Longer length, tokens.")
    mib_per_token: float


class SeqCost(_Result):
    """Peak allocated against sequence length for one card, quant and rank (four lengths or more)."""

    gpu: str
    quant: Optional[str]
    rank: int
    fit: str = Field(description="The curve fitted: quadratic.")
    coefficients: SeqCoefficients
    max_residual_mib: float = Field(description="Largest distance of a probe from the curve, MiB.")
    piecewise: list[SeqStep]
    rows: list[str]


class RealRankCost(_Result):
    """What a higher rank cost in real runs (mean peak per rank)."""

    gpu: str
    dropout: bool
    from_rank: int
    to_rank: int
    cost_mib: float
    mib_per_rank: float
    rows: list[str]


class Costs(_Result):
    """Marginal costs from the data, each with the rows it rests on."""

    rank: list[RankCost]
    dropout: CostSummary
    dora: CostSummary
    seq_len: list[SeqCost]
    real_rank: list[RealRankCost]


class CardLimit(_Result):
    """A card's effective limit for peak allocated: between the largest peak that fit and the
    smallest that did not (an OOM is censored: it needed more than the card could give)."""

    gpu: str
    kind: str = Field(description="probe or real: each gets its own interval.")
    low_mib: Optional[float] = Field(description="Largest peak allocated known to fit, MiB.")
    high_mib: Optional[float] = Field(description="Smallest peak (or lower bound) known not to fit, MiB.")
    fit_id: Optional[str]
    exceeded_id: Optional[str]
    card_mib: Optional[float] = Field(description="The card's capacity as torch reports it, MiB.")
    note: Optional[str]


class LooVerdict(_Result):
    """A probe's verdict, predicted without it by the one predictor (ledger.predictor)."""

    id: str
    verdict: str = Field(description="fits, tight, won't fit or unknown.")
    method: Optional[str] = Field(description="The evidence-ladder rung that answered.")
    predicted_mib: Optional[float]
    high_mib: Optional[float] = Field(description="The predicted interval's top, MiB.")
    fits_actual: bool
    limit: list[Optional[float]] = Field(description="The limit interval used, MiB (low, high).")


class LooReal(_Result):
    """A real run's peak, predicted without it from its probe."""

    id: str
    probe: str
    predicted_mib: float
    actual_mib: float
    error_pct: float


class LeaveOneOut(_Result):
    """Leave-one-out scores."""

    verdict_correct: int = Field(description="Decisive verdicts that were right: fits for a probe that fit, won't "
                                             "fit for one that ran out of memory.")
    verdict_total: int = Field(description="Decisive verdicts (fits or won't fit).")
    verdict_tight: int = Field(description="Probes answered tight (the interval crosses the limit): safe, not decisive.")
    verdict_costly: int = Field(description="Probes answered fits that ran out of memory (the costly mistake).")
    verdict_unaddressed: int = Field(description="Probes answered unknown.")
    verdict_pct: Optional[float] = Field(description="verdict_correct / verdict_total, %.")
    real_median_abs_err_pct: Optional[float]
    real_n: int
    verdicts: list[LooVerdict]
    reals: list[LooReal]


class CeilingCell(_Result):
    """The largest rank that fits one configuration, and the largest that is tight."""

    status: str
    rank: Optional[int] = Field(description="The largest rank whose verdict is fits.")
    tight_rank: Optional[int] = Field(description="The largest rank whose verdict is tight or fits.")
    at_least: bool = Field(description="True when the ceiling is at least the largest rank searched.")


class CeilingRow(_Result):
    """Rank ceilings of one card, model, quant, fixes and length: without dropout, with it, with DoRA."""

    gpu: str
    model: Optional[str]
    quant: Optional[str]
    fixes: str
    seq_len: int
    ceilings: dict[str, CeilingCell]


class Calibration(_Result):
    """``vram calibrate``: pairs and anchors, the over-estimate, marginal costs, card limits,
    leave-one-out scores (and, on the site, the ceiling table)."""

    ceilings: list[CeilingRow] = Field(default_factory=list, description="The site's rank-ceiling table.")
    as_of: Optional[str] = Field(description="Rows measured on or before this date only.")
    excluded: list[str] = Field(description="Ids left out.")
    calibration_hash: str = Field(description="Hash of the rows the calibration rests on.")
    anchors: list[ProbeRealPair]
    pairs: list[ProbeRealPair]
    overestimate_pct: OverestimatePct
    costs: Costs
    limits: list[CardLimit]
    loo: Optional[LeaveOneOut]
    loo_skipped: Optional[bool] = Field(None, description="True when the ledger was too large for leave-one-out.")

    def document(self) -> dict:
        """As ``--json`` prints it: the keys that were computed."""
        return self.model_dump(mode="json", exclude_unset=True)


# -- the estimator scoreboard -----------------------------------------------------------------


class SliceScore(_Result):
    median_abs_err_pct: float
    n: int


class Confusion(_Result):
    """Fit verdicts against what happened; fits_but_oom is the costly cell."""

    fits_but_oom: int
    fits_and_fit: int
    oom_but_fit: int
    oom_and_oom: int


class ScoredRow(_Result):
    """One measured row as an estimator saw it."""

    id: str
    status: str
    allocated_mib: Optional[float]
    reserved_mib: Optional[float]
    estimate_mib: float
    low_mib: Optional[float]
    high_mib: Optional[float]
    measured_mib: Optional[float] = Field(description="The measured quantity the estimator claims to predict, MiB.")
    measured_quantity: Optional[str] = Field(description="allocated or reserved.")
    error_pct: Optional[float]
    fits_predicted: Optional[bool]
    fits_actual: Optional[bool]
    verdict: Optional[str] = Field(None, description="vram-ledger only: fits, tight, won't fit or unknown.")
    slices: dict[str, str]


class EstimatorScore(_Result):
    """One estimator against the ledger."""

    name: str
    predicts: str = Field(description="The quantity it claims to predict.")
    leaves_out: str
    available: bool
    skipped: Optional[str]
    n: int
    median_abs_err_pct: Optional[float]
    median_signed_err_pct: Optional[float]
    slices: dict[str, dict[str, SliceScore]]
    confusion: Optional[Confusion]
    rows: list[ScoredRow]
    rows_kept: bool


class TableCell(_Result):
    estimate_mib: float
    error_pct: Optional[float]


class TableRow(_Result):
    id: str
    model: Optional[str] = None
    status: str
    allocated_mib: Optional[float]
    reserved_mib: Optional[float]
    cells: list[Optional[TableCell]]


class DryBoardRow(_Result):
    model: str
    quant: str
    rank: Optional[int] = Field(description="LoRA's rank (none for full fine-tuning).")
    size: Optional[str] = Field(None, description="Full fine-tuning: the model's size band (a slice).")
    seq_len: int = Field(description="Tokens in the longest example.")
    reference_mib: float = Field(description="This project's dry-run answer of the quantity the estimator predicts.")
    estimate_mib: float
    error_pct: float = Field(description="(estimate - reference) / reference x 100.")


class MeasuredBoardRow(_Result):
    id: str
    gpu: str
    measured_mib: float = Field(description="The row's measured figure of the quantity the estimator predicts.")
    estimate_mib: float
    error_pct: float = Field(description="(estimate - measured) / measured x 100.")


class DryBoardScore(_Result):
    """One estimator against this project's dry runs (and any measured row of the kind)."""

    name: str
    predicts: str = Field(description="The quantity it claims to predict.")
    available: bool
    n: int
    median_abs_err_pct: Optional[float]
    median_signed_err_pct: Optional[float]
    slices: dict[str, dict[str, SliceScore]] = Field(description="MoE: by model and by quant; full fine-tuning: by "
                                                                   "quant (precision) and by model size.")
    rows: list[DryBoardRow]
    measured: list[MeasuredBoardRow] = Field(default_factory=list, description="The ledger's measured rows of the "
                                                                                "kind (on their own cards), scored.")
    measured_median_abs_err_pct: Optional[float] = Field(None, description="Median |error| over them, %.")


class DryRunBoard(_Result):
    """The estimators against this project's dry runs where no card has measured: mixtures of
    experts, full fine-tuning (``ledger.report.dry_board``). A dry run is the reference here, not a
    measurement."""

    reference_card: str = Field(description="The card the reserved figures and canifinetune's overhead are for.")
    optimizer: str = Field(description="The optimizer whose state the training run holds.")
    recipes: int = Field(description="Recipes the project's dry runs answer.")
    estimators: list[DryBoardScore]


class WorldBoardRow(_Result):
    model: str
    method: str = Field(description="lora (QLoRA at rank 16) or full (bf16).")
    gpus: int
    strategy: str
    unsloth_mib: float = Field(description="Unsloth Studio's one-GPU estimate (reserved), MiB.")
    unsloth_share_mib: float = Field(description="That estimate over its pool of N cards (1 + 0.85 x (N - 1)), MiB.")
    unsloth_verdict: Optional[str] = Field(description="Whether its rule says the run fits the N cards.")
    per_gpu_mib: float = Field(description="This project's predicted peak allocated of one rank, MiB.")
    verdict: str = Field(description="This project's per-GPU verdict.")
    share_err_pct: float = Field(description="(Unsloth's share - per_gpu_mib) / per_gpu_mib, %.")


class WorldBoard(_Result):
    """Unsloth Studio's multi-GPU rule against one rank's answer under FSDP (``dry_board.world_board``)."""

    card: str = Field(description="The card of each GPU.")
    seq_len: int
    share: float = Field(description="The share of each GPU past the first its rule adds to one pool.")
    rows: list[WorldBoardRow]
    median_signed_err_pct: float
    median_abs_err_pct: float
    below: int = Field(description="Rows where its share a GPU is below the rank's figure.")
    optimistic: list[str] = Field(description="Runs its rule says fit where the rank's answer is won't fit.")


class Scoreboard(_Result):
    """Every VRAM estimator scored against the ledger's measured peaks."""

    addressable: int = Field(description="Measured rows whose model, recipe and length are known.")
    estimators: list[EstimatorScore]
    fit_rule: str
    slice_values: dict[str, list[str]]
    table: list[TableRow] = Field(default_factory=list)
    moe: Optional[DryRunBoard] = Field(None, description="Mixtures of experts: the estimators against this "
                                                         "project's dry runs (no measured MoE row yet).")
    full: Optional[DryRunBoard] = Field(None, description="Full fine-tuning: the estimators against this project's "
                                                          "dry runs (no measured full fine-tuning row yet).")
    world: Optional[WorldBoard] = Field(None, description="Several GPUs: Unsloth Studio's 85% rule against one "
                                                          "rank's dry-run answer under FSDP.")


class FitCellResult(_Result):
    """One cell of the fit table: the largest rank that fits and the largest that is tight."""

    model: str
    gpu: str
    quant: str
    fixes: str
    setting: str = Field(description="plain, dropout or DoRA.")
    seq_len: int = Field(description="Tokens in the longest example.")
    fits_rank: Optional[int]
    tight_rank: Optional[int]
    status: str = Field(description="ok, none-fits or unknown.")
    at_least: bool = Field(description="True when the ceiling is at least the largest rank searched (512).")
    method: str = Field(description="'dry run' (the calibrated dry run) or 'ledger' (the whole evidence ladder, "
                                    "with measured rows).")
    measured: list[str] = Field(description="Ids of the ledger's probes of this card, model, quant, fixes and setting "
                                            "with a length in (the previous column's, this column's].")
    label: str = Field(description="The cell as the pages show it.")
    run: str = Field("real", description="What is judged: 'real' (a training run's step, with the optimizer's state) "
                                         "or 'probe' (a one-step probe, no optimizer step).")
    optimizer: Optional[str] = Field(None, description="The optimizer whose state a training run holds, by its "
                                                       "TrainingArguments name; none: the program's preset, whose "
                                                       "measured runs hold their own.")
    checkpointing: bool = Field(True, description="Gradient checkpointing on (off: every layer's activations kept).")


class FullCellResult(_Result):
    """Full fine-tuning on a card at one length: every weight trained, a training run's step with the
    optimizer's state, stock, gradient checkpointing on; the verdict and the peak allocated."""

    model: str
    gpu: str
    quant: str = Field(description="bf16 (weights, gradients and optimizer state in bf16) or fp32 (fp32 master "
                                   "weights under bf16 autocast).")
    seq_len: int = Field(description="Tokens in the longest example.")
    verdict: str = Field(description="fits, tight, won't fit or unknown.")
    mib: Optional[float] = Field(description="Predicted peak allocated, MiB (none: past any device, or unknown).")
    high_mib: Optional[float] = Field(description="The top of its interval, MiB.")
    method: str = Field(description="'dry run' (the calibrated dry run of this recipe) or a measured row's kind.")
    evidence: list[str] = Field(description="Ids of the rows it rests on.")
    optimizer: str = Field(description="The optimizer whose step and state the training run holds.")


class WorldCellResult(_Result):
    """One rank of a run on several GPUs (``--gpus N --strategy S``) at one length, on N of a card:
    a training run with AdamW, stock, micro-batch 1, from the calibrated dry run of that rank."""

    model: str
    gpus: int = Field(description="GPUs of the run; every figure is one GPU's.")
    strategy: str = Field(description="How the GPUs split the model: fsdp (FSDP2 fully_shard, FULL_SHARD).")
    gpu: str = Field(description="The card, one of each GPU.")
    method: str = Field(description="lora (QLoRA: LoRA on 4-bit nf4 weights, plain adapter) or full (every weight "
                                    "trained, bf16).")
    quant: str
    seq_len: int = Field(description="Tokens in the longest example.")
    fits_rank: Optional[int] = Field(description="LoRA: the largest rank (steps of 8, up to 512) whose per-GPU "
                                                 "verdict is fits; none for full fine-tuning or where none fits.")
    tight_rank: Optional[int] = Field(description="LoRA: the largest rank at worst tight.")
    verdict: str = Field(description="LoRA: at rank 16; full: the step's. fits, tight, won't fit or unknown.")
    mib: Optional[float] = Field(description="Predicted peak allocated per GPU, MiB (LoRA: at rank 16).")
    high_mib: Optional[float] = Field(description="The top of its interval, MiB.")
    dry_runs: list[str] = Field(description="Ids of the rank's dry runs it rests on.")
    label: str = Field(description="The cell as the pages show it: LoRA's rank ceiling per GPU, 'N (tight ≤ M)' or "
                                   "'none'; full fine-tuning's verdict.")


class FitCard(_Result):
    key: str
    name: str
    usable_mib: Optional[float] = Field(description="What PyTorch reports as usable, MiB.")
    limit_low_mib: Optional[float] = Field(description="Low end of the effective limit for peak allocated, MiB.")
    limit_high_mib: Optional[float]
    in_ledger: bool
    source: str = Field(description="Where the limit comes from.")
    common: bool = Field(True, description="One of the common cards the site's fit pages and picker show; every card "
                                           "is in the fit table (here, fits.md, fits.csv).")


class Fits(_Result):
    """The fit table (site/fits.html, fits.md, fits.csv): models x cards x quant x fixes x setting x length."""

    lengths: list[int]
    models: list[str]
    cards: list[FitCard]
    cells: list[FitCellResult]
    dry_run_median_abs_err_pct: Optional[float] = Field(
        description="The calibrated dry run's leave-one-out median |error| over the ledger's measured probes, %.")
    dry_run_max_abs_err_pct: Optional[float] = Field(description="Its largest |error|, %.")
    dry_run_n: int = Field(description="Measured probes the dry run's accuracy rests on.")
    dry_run_fitted_on: list[str] = Field(description="Models whose measured probes the remainder is fitted on.")
    derivation_max_abs_err_pct: Optional[float] = Field(
        None, description="Largest error of deriving (from the other rows) a dry run the grid did compute, %: the "
                          "width a derived cell's interval gets on top of the dry run's own.")
    derivation_n: int = Field(0, description="Dry runs that error is measured on.")
    derivation_by_kind: dict[str, float] = Field(
        default_factory=dict, description="Largest error of deriving the dry runs of one kind (memory fixes, "
        "gradient checkpointing), %, for each kind with enough of them: the width that kind's derived cells get "
        "instead of derivation_max_abs_err_pct.")
    stale: list[str] = Field(default_factory=list, description="Dry-run rows computed with other library versions "
                                                               "than the build's (none when the build has no torch).")
    full_cells: list[FullCellResult] = Field(
        default_factory=list, description="Full fine-tuning (every weight trained) on the common cards, by model, "
                                          "precision and length: `vram fit --method full`'s answers.")
    world_cells: list[WorldCellResult] = Field(
        default_factory=list, description="One GPU's answer for runs on 2, 4 and 8 GPUs under FSDP, of the models "
                                          "no listed card holds whole: `vram fit --gpus N --strategy fsdp`'s answers.")
    derive: Optional[dict[str, float]] = Field(
        None, description="How a card known by its nvidia-smi total alone gets its limit (vram fit --gpu-mib): usable = "
                          "total x usable_low (low end) .. usable_high, rounded to 0.1 MiB; limit low end = (usable low "
                          "- context_high_mib) / ratio_high, high end = min((usable high - context_low_mib) / "
                          "ratio_low, usable high), each rounded to 0.1 MiB.")

    #: ``by_row`` and ``table_lengths``, made once (every model's page reads them; cells are not changed).
    _views: dict = PrivateAttr(default_factory=dict)

    def common_cards(self) -> list[FitCard]:
        """The cards the fit pages and the picker show (the rest are in the whole table)."""
        return [c for c in self.cards if c.common]

    def by_row(self) -> dict[tuple[str, str, str, str, str], list[FitCellResult]]:
        """The cells of each table row, (model, quant, fixes, setting, card) -> cells by length:
        the pages look rows up here rather than filtering every cell for every row."""
        if "rows" not in self._views:
            rows: dict[tuple[str, str, str, str, str], list[FitCellResult]] = {}
            for c in self.cells:
                rows.setdefault((c.model, c.quant, c.fixes, c.setting, c.gpu), []).append(c)
            self._views["rows"] = {k: sorted(v, key=lambda c: c.seq_len) for k, v in rows.items()}
        return self._views["rows"]

    def settings(self, model: str) -> list[str]:
        """The adapter settings a model's tables have (plain, dropout, DoRA; plain only for a
        mixture of experts, whose fused experts peft adapts without either)."""
        if "settings" not in self._views:
            found: dict[str, set] = {}
            for c in self.cells:
                found.setdefault(c.model, set()).add(c.setting)
            self._views["settings"] = {m: [s for s in ("plain", "dropout", "DoRA") if s in v] for m, v in found.items()}
        return self._views["settings"].get(model, [])

    def full_rows(self, model: str) -> dict[tuple[str, str], list[FullCellResult]]:
        """A model's full fine-tuning cells by (precision, card), by length."""
        if "full" not in self._views:
            rows: dict[str, dict[tuple[str, str], list[FullCellResult]]] = {}
            for c in self.full_cells:
                rows.setdefault(c.model, {}).setdefault((c.quant, c.gpu), []).append(c)
            self._views["full"] = {m: {k: sorted(v, key=lambda c: c.seq_len) for k, v in r.items()}
                                   for m, r in rows.items()}
        return self._views["full"].get(model, {})

    def world_rows(self, model: str) -> dict[tuple[str, str, int, str, str], list[WorldCellResult]]:
        """A model's several-GPU cells by (method, quant, GPUs, strategy, card), by length."""
        if "world" not in self._views:
            rows: dict[str, dict[tuple[str, str, int, str, str], list[WorldCellResult]]] = {}
            for c in self.world_cells:
                rows.setdefault(c.model, {}).setdefault((c.method, c.quant, c.gpus, c.strategy, c.gpu), []).append(c)
            self._views["world"] = {m: {k: sorted(v, key=lambda c: c.seq_len) for k, v in r.items()}
                                    for m, r in rows.items()}
        return self._views["world"].get(model, {})

    def world_kinds(self, model: str) -> list[tuple[str, str, str, list[int]]]:
        """A model's several-GPU tables: (method, quant, strategy, lengths) each."""
        kinds: dict[tuple[str, str, str], set[int]] = {}
        for (method, quant, _, strategy, _), cells in self.world_rows(model).items():
            kinds.setdefault((method, quant, strategy), set()).update(c.seq_len for c in cells)
        return [(*k, sorted(v)) for k, v in kinds.items()]

    def world_models(self) -> list[str]:
        """The models with several-GPU cells, in the table's order."""
        return list(dict.fromkeys(c.model for c in self.world_cells))

    def full_fits_somewhere(self, model: str) -> bool:
        """Whether full fine-tuning of the model fits any of the cards at any length."""
        return any(c.verdict == "fits" for cells in self.full_rows(model).values() for c in cells)

    def full_smallest(self, model: str) -> Optional[FullCellResult]:
        """The model's smallest full fine-tuning step (its shortest length, bf16) with a figure."""
        cells = [c for cells in self.full_rows(model).values() for c in cells if c.mib is not None]
        return min(cells, key=lambda c: (c.seq_len, c.mib), default=None)

    def table_lengths(self) -> dict[tuple[str, str, str], list[int]]:
        """The lengths each table has, (model, quant, fixes) -> lengths: a model's stop at its
        context, the program's preset's at the grid's reach for it (the pages' column heads)."""
        if "lengths" not in self._views:
            found: dict[tuple[str, str, str], set[int]] = {}
            for c in self.cells:
                found.setdefault((c.model, c.quant, c.fixes), set()).add(c.seq_len)
            self._views["lengths"] = {k: sorted(v) for k, v in found.items()}
        return self._views["lengths"]
