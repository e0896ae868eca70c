"""The fit table: for each model with dry-run rows, each card, quant, memory fixes, dropout / DoRA
and sequence length, the largest LoRA rank whose training run fits (by default; a one-step probe
with ``run="probe"``) and the largest that is tight. Pure: no torch.

Every cell is the one predictor's answer (``ledger.answer.predictor``). Where the ledger measured the
model on the card, the whole evidence ladder answers (``Predictor.ceiling``) and the cell names
its measured rows; elsewhere the calibrated dry run does, and its ceiling is found by bisection
over ranks (a larger rank never needs less), a handful of evaluations of arithmetic on the
committed dry-run rows per cell.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional
from weakref import WeakKeyDictionary

from ledger.core.models import Gpu
from ledger.vocab.cards import card_table
from ledger.vocab.model_configs import model_name
from ledger.vocab.optimizers import optimizer_for
from ledger.fit.dry_table import MIN_KIND_ROWS
from .predictor import Predictor
from .rank_judge import card_limits, dry_ceilings_many
from ledger.vocab.adapter import ALL_LINEAR, experts_adapted
from ledger.vocab.recipe import Recipe, recipe_of, row_keys_cached
from ledger.fit.response_span import answerable, batch_err
from ledger.vocab.recipe import fixes_key

LENGTHS = (512, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: The program's memory-fixes preset is in the grid up to this length (its runs were at most 7,177 tokens).
PRESET_MAX_LEN = 16384
#: The fit grid's models (shipped configs, ledger/model_configs/), smallest first.
GRID_MODELS = ("qwen2.5-0.5b", "gemma-3-1b-it", "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b", "llama-3.2-3b",
               "phi-3.5-mini", "gemma-3-4b-it", "qwen3-4b", "mistral-7b", "qwen2.5-7b", "deepseek-r1-distill-qwen-7b",
               "llama-3.1-8b", "qwen3-8b", "gemma-3-12b-it", "mistral-nemo-12b", "qwen2.5-14b",
               "deepseek-r1-distill-qwen-14b", "qwen3-14b", "phi-4", "gpt-oss-20b", "mistral-small-24b",
               "gemma-3-27b-it", "qwen3-30b-a3b", "qwen2.5-32b", "qwen3-32b", "mixtral-8x7b", "llama-3.3-70b",
               "qwen2.5-72b")
GRID_RESPONSE_LEN = 256
#: From this length on, the stock step of a model whose every layer attends to the whole
#: sequence peaks in exact proportion to the length (affine: weights plus tokens x a constant,
#: checkpointing on or off): the committed rank-8 rows of 22 such models (six families, both
#: weights) interpolate from 2,048 tokens to their context with 0.000% error. The grid computes
#: rank 8 there only at this length, 16,384 and the longest, and the table interpolates the rest.
AFFINE_FROM = 2048
#: The projections LoRA targets in an architecture that fuses them (Phi-3 and Phi-4: qkv_proj and
#: gate_up_proj), by model_type; the others have the default seven.
FUSED_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def target_option(model: str, targets: tuple[str, ...] = ALL_LINEAR) -> dict:
    """A dry-run point's target_modules: the projections as the model names them (its fused
    modules where its architecture fuses them); none for all 7 of an unfused model."""
    from ledger.vocab.model_configs import model_type
    from ledger.vocab.recipe import module_names

    fused = bool(FUSED_TARGETS.get(model_type(model) or ""))
    if not fused and targets == ALL_LINEAR:
        return {}
    return {"target_modules": module_names(targets, fused)}
SETTINGS = (("plain", False, False), ("dropout", True, False), ("DoRA", False, True))
STEP, MAX_RANK = 8, 512


class FitCell(NamedTuple):
    """One cell of the fit table (a named tuple: the site's tables make some 200,000)."""

    model: str
    gpu: str
    quant: str
    fixes: str
    setting: str  # plain | dropout | DoRA
    seq_len: int
    fits_rank: Optional[int]
    tight_rank: Optional[int]
    status: str  # ok | none-fits | unknown
    at_least: bool
    method: str  # "dry run" | "ledger" (the whole ladder, with measured rows)
    #: The ledger's probes of this card, model, quant, fixes and setting whose length is in
    #: (the previous column's length, this one's]: the measured rows nearest the cell.
    measured: tuple[str, ...]
    #: What is judged: a training run ("real": its steady state with ``optimizer``'s state; the
    #: program's preset with its measured runs' own), or a one-step probe ("probe").
    run: str = "real"
    optimizer: Optional[str] = None
    checkpointing: bool = True

    def label(self) -> str:
        return cell_label(self.status, self.fits_rank, self.tight_rank, self.at_least)


def cell_label(status: str, fits_rank: Optional[int], tight_rank: Optional[int], at_least: bool) -> str:
    """A cell's words: its ceiling, "≥" when it is at least that, the tight ceiling beside it."""
    if status == "unknown":
        return "unknown"
    if fits_rank is None:
        return "none" + (f" (tight ≤ {tight_rank})" if tight_rank else "")
    text = ("≥ " if at_least else "") + str(fits_rank)
    if tight_rank and tight_rank != fits_rank:
        text += f" (tight ≤ {tight_rank})"
    return text


class CellLabels(dict):
    """Cells' words by (status, fits, tight, at least), each made once: a table of 70,000 cells
    has a few hundred. Indexed by a cell (a ``FitCell`` or its plain tuple)."""

    def of(self, c: tuple) -> str:
        key = (c[8], c[6], c[7], c[9])
        found = self.get(key)
        if found is None:
            found = self[key] = cell_label(*key)
        return found


def model_lengths(model: str, lengths: Iterable[int] = LENGTHS) -> list[int]:
    """The lengths of ``lengths`` the model's config allows (``max_position_embeddings``; all
    without a config)."""
    from ledger.vocab.model_configs import max_length

    top = max_length(model)
    return sorted(s for s in lengths if top is None or s <= top)


def grid_points(model: str, lengths: Optional[Iterable[int]] = None, checkpointing: bool = True,
                fixes_settings: Optional[tuple[str, ...]] = None, batch: int = 1) -> list[dict]:
    """A model's dry-run points for the fit table (sweep options): rank 8 at every length the
    model allows (``model_lengths``) - for the stock recipe of a model without sliding layers, only
    up to ``AFFINE_FROM``, at 16,384 tokens and at the longest, the rest being affine in length;
    rank 64, dropout and DoRA at the shortest, at 16,384 tokens and at the longest (see
    ``DryTable.raw`` for how the rest is derived). The program's
    preset (fixes "all") up to ``PRESET_MAX_LEN``; any other set of fixes (``fixes_settings``
    holds fixes keys) rank 8 at every length, its physics not known to be affine in length.
    ``checkpointing=False``: the same points without gradient checkpointing (the shipped grid's
    without it are stock only: ``fixes_settings`` defaults to ("none", "all") with checkpointing,
    ("none",) without, and any set given is made). ``batch``: the points of that micro-batch for the fixes whose batch is not
    one longer sequence (``response_span.answerable``: the program's preset); the others answer a
    batch from their micro-batch-1 points."""
    from ledger.fit.response_span import answerable
    from ledger.vocab.recipe import Recipe
    from ledger.vocab.model_configs import full_attention

    allowed = model_lengths(model, LENGTHS if lengths is None else lengths)
    affine = full_attention(model)
    out = []
    if fixes_settings is None:
        fixes_settings = ("none", "all") if checkpointing else ("none",)
    for quant in ("4bit", "bf16"):
        for fixes in fixes_settings:
            seqs = [s for s in allowed if fixes != "all" or s <= PRESET_MAX_LEN]
            if not seqs:
                continue
            own_batch = batch != 1 and answerable(Recipe(model=model, fixes=fixes, batch=batch, seq_len=seqs[0],
                                                         checkpointing=checkpointing))[0].batch != 1
            base = {"model": model, "quant": quant, "fixes": fixes, "response_len": GRID_RESPONSE_LEN,
                    **({} if checkpointing else {"no_gradient_checkpointing": True}),
                    **({"batch_size": batch} if own_batch else {}), **target_option(model)}
            ends = sorted({seqs[0], seqs[-1]} | ({PRESET_MAX_LEN} & set(seqs)))
            # The program's preset (its chunked MLP and kept logits) and a model with sliding
            # layers are not affine in length: rank 8 at every length there.
            rank8 = [s for s in seqs if fixes != "none" or not affine or s <= AFFINE_FROM or s in ends]
            out += [{**base, "seq_len": seq, "rank": 8} for seq in rank8]
            for seq in ends:
                out += [{**base, "seq_len": seq, "rank": 64}]
                if len(settings_of(model)) > 1:
                    out += [{**base, "seq_len": seq, "rank": 8, "dropout": 0.1},
                            {**base, "seq_len": seq, "rank": 8, "dora": True}]
    return out


def lora_point(recipe: Recipe, model_rows: str) -> dict:
    """A LoRA recipe's dry-run point, rank left out: the sweep options of its quant, fixes, length
    and response, dropout, DoRA, checkpointing, micro-batch and target modules."""
    return {"model": model_rows, "quant": recipe.quant, "fixes": recipe.fixes, "seq_len": recipe.seq_len,
            "response_len": recipe.response_len or min(GRID_RESPONSE_LEN, recipe.seq_len - 1),
            **({"dropout": 0.1} if recipe.dropout else {}), **({"dora": True} if recipe.dora else {}),
            **({} if recipe.checkpointing else {"no_gradient_checkpointing": True}),
            **({"batch_size": recipe.batch} if recipe.batch != 1 else {}),
            **target_option(recipe.model, recipe.targets)}


def full_point(recipe: Recipe, model_rows: str) -> dict:
    """A full fine-tune's dry-run point, optimizer left out."""
    return {"model": model_rows, "method": "full", "quant": recipe.quant, "fixes": recipe.fixes,
            "seq_len": recipe.seq_len,
            "response_len": recipe.response_len or min(GRID_RESPONSE_LEN, recipe.seq_len - 1),
            **({} if recipe.checkpointing else {"no_gradient_checkpointing": True}),
            **({"batch_size": recipe.batch} if recipe.batch != 1 else {})}


#: Full fine-tuning's precisions in the fit table: bf16 weights (gradients and the optimizer's state
#: in bf16) and fp32 master weights under bf16 autocast (what the Trainer's bf16=True runs on fp32
#: weights: FT01's 16 bytes a parameter with AdamW).
FULL_QUANTS = ("bf16", "fp32")


def full_grid_points(model: str, lengths: Optional[Iterable[int]] = None, checkpointing: bool = True,
                     optimizer: str = "adamw_torch") -> list[dict]:
    """A model's full fine-tuning points for the fit table: the training run's steady state with
    ``optimizer``'s step, stock, in each of ``FULL_QUANTS``, at every length the model allows. The
    step's peak switches from the optimizer's step (weights, gradients and state) to the
    activations somewhere between two lengths, so no length is left to a chord: between grid
    lengths (a ceiling's scan) the full table reads the chord, at or above the step
    (``ledger.fit.full_table``; ``benchmarks/full_ft_accuracy.py --chord``)."""
    seqs = model_lengths(model, LENGTHS if lengths is None else lengths)
    return [{"model": model, "method": "full", "quant": q, "fixes": "none", "response_len": GRID_RESPONSE_LEN,
             "seq_len": s, "optim": optimizer, **({} if checkpointing else {"no_gradient_checkpointing": True})}
            for q in FULL_QUANTS for s in seqs]


class FullCell(NamedTuple):
    """Full fine-tuning's answer for a model on a card at one length, in one precision: a training
    run with ``optimizer``'s step, stock, checkpointing on (``ledger.answer.full_ft``)."""

    model: str
    gpu: str
    quant: str  # bf16 | fp32 (master weights)
    seq_len: int
    verdict: str
    mib: Optional[float]
    high_mib: Optional[float]
    method: str
    evidence: tuple[str, ...]
    optimizer: str = "adamw_torch"


def full_table(p: Predictor, gpus: Optional[list[str]] = None, models: Optional[list[str]] = None,
               optimizer: str = "adamw_torch") -> list[FullCell]:
    """Full fine-tuning's cells: every model with full fine-tuning dry runs (the grid's order), on
    ``gpus`` (default the site's, ``page_cards``), in ``FULL_QUANTS``, at each length the model
    allows: ``Predictor.predict``'s answer for the training run (its figure and verdict,
    ``FullAnswers.cell``, without the ``Answer`` around them), as ``vram fit --method full`` gives it."""
    from ledger.vocab.recipe import full_recipe

    all_cards = cards(p)
    gpus = gpus if gpus is not None else page_cards(p)
    have = {k.model for k in p.full.table.rows}
    names = models if models is not None else [m for m in GRID_MODELS if m in have] + sorted(
        m for m in have - set(GRID_MODELS) if m)
    out = []
    for model in names:
        for gpu in gpus:
            entry = all_cards.get(gpu)
            for quant in FULL_QUANTS:
                for seq in model_lengths(model):
                    fig, method, _, ids, verdict, _, _, _ = p.full.cell(
                        full_recipe(model=model, quant=quant, seq_len=seq, fixes="none", optimizer=optimizer),
                        gpu, entry, "real")
                    out.append(FullCell(model, gpu, quant, seq, verdict, fig.mib if fig else None,
                                        fig.high_mib if fig else None, method or "", tuple(ids), optimizer))
    return out


def settings_of(model: str) -> tuple[tuple[str, bool, bool], ...]:
    """The table's adapter settings for a model: plain, dropout and DoRA; plain only for a mixture
    of experts, whose adapted expert weights take neither (``adapter.experts_adapted``)."""
    return SETTINGS[:1] if experts_adapted(model) else SETTINGS


def sweep_toml(points: list[dict], name: str, header: str = "") -> str:
    """A dry-run sweep file (device = "dry") with these points."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    lines = [header, "[sweep]", f"name = {value(name)}", 'device = "dry"', "", "[base]", "random_weights = true", ""]
    for p in points:
        lines += ["[[points]]", *(f"{k} = {value(v)}" for k, v in p.items()), ""]
    return "\n".join(lines)


def dry_models(p: Predictor) -> list[str]:
    """Models with committed dry-run rows: the grid's in its order (smallest first), then others."""
    names = {model_name(d.model) for d in p.dry if d.model}
    return [m for m in GRID_MODELS if m in names] + sorted(names - set(GRID_MODELS))


def cards(p: Predictor) -> dict[str, Gpu]:
    """The ledger's cards and the card table's, by key (the ledger's entry wins)."""
    out = {k: c.gpu for k, c in card_table().items()}
    out.update(p.ledger.gpus)
    return dict(sorted(out.items(), key=lambda kv: (kv[1].total_mib or 0, kv[0])))


def page_cards(p: Predictor) -> list[str]:
    """The cards the site's fit pages and picker show: the ledger's and the card table's common
    ones (``fit_page``). A model's page and its picker figures hold a table per card (and the
    picker's nine other recipes), so each card costs every page; the whole fit table (fits.md,
    fits.csv, vram.json) has every card, and ``vram fit --gpu`` answers each all the same."""
    table = card_table()
    return [k for k in cards(p) if k in p.ledger.gpus or (k in table and table[k].fit_page)]


def _as_asked(recipe: Recipe) -> tuple[Optional[Recipe], float]:
    """A micro-batch is answered as ``predict`` answers it: the single sequence of batch x length
    tokens (``response_span.answerable``), its interval widened by that derivation's error. The
    recipe names no optimizer: ``optimizer``'s state is added by the judge. (None: not answerable.)"""
    one, _ = answerable(recipe)
    return one, batch_err(recipe)


def _entry_key(entry: Optional[Gpu]):
    return None if entry is None else (entry.name, entry.vendor, entry.total_mib, entry.usable_gib_torch)


def _dry_cells(p: Predictor, asks: list[tuple[Optional[Recipe], float, Optional[str]]], cards_key: tuple,
               limits: list[tuple], run: str) -> list[list[tuple]]:
    """The dry run's ceilings of each of ``asks`` ((recipe as asked, widening, optimizer)) on each
    card of ``limits`` (``rank_judge.card_limits`` of the cards ``cards_key`` names, with the
    budget), in their order; the ones not yet known computed together (``dry_ceilings_many``)."""
    memo = p.dry_ceilings
    unknown = [(None, None, "unknown", False)] * len(limits)
    # B sequences of L tokens and B' of L' with B x L = B' x L' are one question: asked once per fit.
    keys = [None if one is None else (one, cards_key, widened, run, optimizer) for one, widened, optimizer in asks]
    todo = list(dict.fromkeys(k for k in keys if k is not None and k not in memo))
    for key, found in zip(todo, dry_ceilings_many(p, [(k[0], k[2], k[4]) for k in todo], limits, run,
                                                   STEP, MAX_RANK)):
        memo[key] = found
    return [unknown if k is None else memo[k] for k in keys]


#: ``_row_index`` of each predictor (made once: a build asks ten fit tables of one predictor).
_ROW_INDEX: "WeakKeyDictionary[Predictor, tuple]" = WeakKeyDictionary()


def _row_index(p: Predictor) -> tuple[set, dict[str, set], dict[tuple, list[tuple[int, str]]]]:
    """What a fit table reads of the predictor's rows, grouped once per predictor (a 100k-row
    ledger's ten fit tables each walked every row three times): the (card, model) pairs the
    ledger measured; each model's spellings in the ledger (the ladder asks by them); and the
    probes a ladder cell cites, by card and recipe, as (length, id) in the rows' order."""
    found = _ROW_INDEX.get(p)
    if found is None:
        measured = {(m.gpu, model_name(m.model)) for m in p.ms if m.kind in ("probe", "real") and m.lora}
        spellings: dict[str, set] = {}
        probes: dict[tuple, list[tuple[int, str]]] = {}
        for m in p.ms:
            spellings.setdefault(model_name(m.model), set()).add(m.model)
            if m.kind == "probe" and m.lora and m.seq_len:
                probes.setdefault((m.gpu, model_name(m.model), m.quant, fixes_key(m.memory_fixes),
                                   bool(m.lora.dropout), bool(m.lora.dora)), []).append((m.seq_len, m.id))
        found = _ROW_INDEX[p] = (measured, spellings, probes)
    return found


@row_keys_cached()
def fit_table(p: Predictor, *, models: Optional[Iterable[str]] = None, gpus: Optional[Iterable[str]] = None,
              lengths: Iterable[int] = LENGTHS, ladder: bool = True,
              extra_cards: Optional[dict[str, Gpu]] = None, budget_mib: Optional[float] = None,
              batch: int = 1, fixes_settings: Optional[tuple[str, ...]] = None, run: str = "real",
              optimizer: Optional[str] = None, checkpointing: bool = True) -> list[FitCell]:
    """Every cell of the fit table (see the module docstring). ``ladder=False``: the calibrated
    dry run answers every cell (a site built from a very large ledger). ``extra_cards``: cards by
    key beside the ledger's and the card table's (a card given by its total, ``--gpu-mib``).
    ``budget_mib``: every cell judged against it instead of its card's limit. ``batch``: a
    micro-batch of that many sequences of each length (the fixes ``fixes_settings`` names).
    ``run``: "real" judges a training run, its optimizer ``optimizer_for(fixes, optimizer)``
    (stock: AdamW unless ``optimizer`` names another; the program's preset: its runs' own);
    "probe" a one-step probe (no optimizer step). ``checkpointing=False``: gradient checkpointing
    off, answered by the dry runs of it alone (by default stock only, as the shipped grid has it;
    ``fixes_settings`` given, those). A model's cells stop at its context (``max_position_embeddings``), the program's preset's
    at ``PRESET_MAX_LEN`` (the grid's reach for it)."""
    lengths = sorted(lengths)
    all_cards = {**cards(p), **{k: v for k, v in (extra_cards or {}).items() if v is not None}}
    models = list(models) if models is not None else dry_models(p)
    gpus = list(gpus) if gpus is not None else page_cards(p)
    measured_models, spellings, probes = _row_index(p)
    out = []
    if fixes_settings is None:  # the shipped grid has the preset with checkpointing only
        fixes_settings = ("none", "all") if checkpointing else ("none",)
    for model in models:
        # The model's recipes in the table's order (quant, fixes, setting, length), made once for every card.
        recipes = []
        allowed = model_lengths(model, lengths)  # none past the model's context
        for quant in ("4bit", "bf16"):
            for fixes in fixes_settings:
                optim = optimizer_for(fixes, optimizer) if run == "real" else None
                for setting, dropout, dora in settings_of(model):
                    for seq in allowed if fixes != "all" else [s for s in allowed if s <= PRESET_MAX_LEN]:
                        recipe = Recipe(model=model, quant=quant, dropout=dropout, dora=dora, seq_len=seq,
                                        fixes=fixes_key(fixes), batch=batch, checkpointing=checkpointing)
                        recipes.append((quant, fixes, optim, setting, dropout, dora, seq, recipe, *_as_asked(recipe)))
        # The dry run answers every card the ledger did not measure the model on: each recipe's
        # ceilings on all of them at once (one profile per remainder).
        dry_cards = tuple((g, all_cards.get(g)) for g in gpus
                          if not (ladder and checkpointing and (g, model) in measured_models))
        cards_key = (tuple((g, _entry_key(e)) for g, e in dry_cards), budget_mib)
        limits = card_limits(p, list(dry_cards), budget_mib, run)
        dry = _dry_cells(p, [(one, widened, optim) for _, _, optim, _, _, _, _, _, one, widened in recipes],
                         cards_key, limits, run)
        column = {g: i for i, (g, _) in enumerate(dry_cards)}
        known = sorted(spellings.get(model, ())) if len(dry_cards) < len(gpus) else []
        plan = monotone_plan([(quant, fixes, setting, seq) for quant, fixes, _, setting, _, _, seq, *_ in recipes])
        for gpu in gpus:
            start = len(out)  # the card's cells, one per recipe in order: made monotone together
            if gpu in column:  # the dry run answers (every measured row has checkpointing on: without it, always)
                at = column[gpu]
                for (quant, fixes, optim, setting, _, _, seq, _, _, _), found in zip(recipes, dry):
                    fits, tight, status, more = found[at]
                    out.append(FitCell(model, gpu, quant, fixes, setting, seq, fits, tight, status,
                                       more or (fits is not None and fits + STEP > MAX_RANK), "dry run", (), run,
                                       optim, checkpointing))
                raise_block(out, range(start, len(out)), plan)
                continue
            entry = all_cards.get(gpu)
            for quant, fixes, optim, setting, dropout, dora, seq, recipe, one, widened in recipes:  # the whole ladder
                asked = recipe.replace(model=known[0], optimizer=optim)
                # A micro-batch is asked as its one sequence of B x L tokens: the same
                # total from another batch and length is one question (asked once).
                one = one and one.replace(model=asked.model, optimizer=optim)
                key = ("ladder", one if recipe.batch != 1 else asked, recipe.batch != 1, gpu,
                       budget_mib, run)
                if key not in p.dry_ceilings:
                    c = p.ceiling(asked, gpu, entry=entry, budget_mib=budget_mib, run=run, verdicts_only=True)
                    p.dry_ceilings[key] = (c.fits_rank, c.tight_rank, c.status, c.at_least)
                fits, tight, status, more = p.dry_ceilings[key]
                lower = max([s for s in lengths if s < seq], default=0)
                rows = tuple(sorted({i for length, i in probes.get((gpu, model, quant, fixes, dropout, dora), ())
                                     if lower < length <= seq}))
                out.append(FitCell(model, gpu, quant, fixes, setting, seq, fits, tight, status,
                                   more or (fits is not None and fits + STEP > MAX_RANK), "ledger", rows, run,
                                   optim, checkpointing))
            raise_block(out, range(start, len(out)), plan)
    return out


def monotone(cells: list[FitCell]) -> list[FitCell]:
    """What fits a harder recipe fits an easier one: a cell is raised (and says "at least") to the
    ceiling of a longer sequence, and the plain recipe's to its dropout's or DoRA's, same card."""
    blocks: dict[tuple, list[int]] = {}  # a card's cells of one model: every raise stays inside one
    for i, c in enumerate(cells):
        blocks.setdefault(c[:2], []).append(i)
    for at in blocks.values():
        raise_block(cells, at, monotone_plan([cells[i][2:6] for i in at]))
    return cells


def monotone_plan(keys: list[tuple]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """How ``monotone`` raises one card's cells of one model, given their (quant, fixes, setting,
    seq_len) in order (the last of equal keys is the one that counts): the plain cells to raise to
    a dropout or DoRA cell of the same length, as (plain, other) positions, then each recipe's
    cells from its longest sequence down. A fit table's cards share one plan per model."""
    index = {k: j for j, k in enumerate(keys)}
    pairs = [(j, index[other]) for (quant, fixes, setting, seq), j in index.items() if setting == "plain"
             for other in ((quant, fixes, "dropout", seq), (quant, fixes, "DoRA", seq)) if other in index]
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for key, j in index.items():
        groups.setdefault(key[:3], []).append((key[3], j))
    return pairs, [[j for _, j in sorted(members, reverse=True)] for members in groups.values()]


def raise_block(cells: list[FitCell], at, plan) -> None:
    """``monotone`` on the cells at positions ``at`` (one card, one model), by ``monotone_plan``
    of their keys, in place."""
    pairs, chains = plan
    fits = [cells[i].fits_rank for i in at]
    raised: set[int] = set()
    for j, k in pairs:  # the dropout and DoRA cells are not raised here: their own ceilings count
        if fits[k] is not None and (fits[j] is None or fits[j] < fits[k]):
            fits[j] = fits[k]
            raised.add(j)
    for chain in chains:  # the longest sequence first
        floor = None
        for j in chain:
            if floor is not None and (fits[j] is None or fits[j] < floor):
                fits[j] = floor
                raised.add(j)
            floor = fits[j] if fits[j] is not None else floor
    for j in raised:
        i = at[j]
        c = cells[i]
        cells[i] = c._replace(fits_rank=fits[j], tight_rank=max(fits[j], c.tight_rank or 0), status="ok",
                              at_least=True)


CSV_FIELDS = ("model", "gpu", "quant", "fixes", "setting", "seq_len", "fits_rank", "tight_rank", "status", "at_least",
              "method", "measured", "run", "optimizer", "checkpointing")


def fits_document(p: Predictor, cells: Optional[list[FitCell]] = None, ladder: bool = True,
                  world_cells: Optional[Callable[[list[str], dict], list]] = None) -> dict:
    """The fit table as ``results.Fits`` validates it (derived.fits in vram.json), its cells still
    ``FitCell``s (``cell_results`` types them): by default every card (the ledger's and the card
    table's), the common ones (``page_cards``) marked; ``world_cells(common cards, card entries)``:
    the several-GPU cells (``worlds.world_table``)."""

    all_cards = cards(p)
    cells = cells if cells is not None else fit_table(p, ladder=ladder, gpus=list(all_cards))
    used = list(dict.fromkeys(c.gpu for c in cells))
    common = set(page_cards(p))
    card_rows = []
    run = cells[0].run if cells else "real"
    for key in used:
        low, high, source = p.card_limit(key, all_cards[key], run)
        from ledger.vocab.recipe import capacity_mib

        card_rows.append({"key": key, "name": all_cards[key].name, "usable_mib": capacity_mib(all_cards[key]),
                          "limit_low_mib": low, "limit_high_mib": high, "in_ledger": key in p.ledger.gpus,
                          "source": source, "common": key in common})
    acc = p.dry_loo
    return {"lengths": sorted({c.seq_len for c in cells}), "models": list(dict.fromkeys(c.model for c in cells)),
            "cards": card_rows, "cells": cells,
            "dry_run_median_abs_err_pct": acc["median_abs_err_pct"], "dry_run_max_abs_err_pct": acc["max_abs_err_pct"],
            "dry_run_n": acc["n"], "dry_run_fitted_on": p.dry_fitted_on,
            "derivation_max_abs_err_pct": p.dry_derivation["max_abs_err_pct"],
            "derivation_n": len(p.dry_derivation["errors_pct"]),
            "derivation_by_kind": {k: v["max_abs_err_pct"] for k, v in p.dry_derivation["by_kind"].items()
                                   if v["n"] >= MIN_KIND_ROWS},
            "stale": stale_rows(p.dry), "derive": p.limits.derive_rule(),
            "full_cells": full_table(p, gpus=[k for k in used if k in common]),
            "world_cells": world_cells([k for k in used if k in common], all_cards) if world_cells else []}


def cell_results(cells: list) -> list:
    """The cells (``FitCell``s or their plain tuples) as ``results.FitCellResult`` (vram.json's derived.fits.cells): made from the
    project's own typed cells without validating each of some 70,000 again (``results.typed_rows``;
    the published vram.json is checked against its schema all the same)."""
    from ledger.core.results import FitCellResult, typed_rows

    at = CSV_FIELDS.index("measured")
    assert list(FitCellResult.model_fields) == [*CSV_FIELDS[:at + 1], "label", *CSV_FIELDS[at + 1:]]
    labels = CellLabels()
    return typed_rows(FitCellResult, [(*c[:at], list(c[at]), labels.of(c), *c[at + 1:]) for c in cells])


#: Libraries whose versions a dry-run row records and a build compares (``stale_rows``).
LIBRARIES = ("torch", "transformers", "peft")
#: The versions a build compares the dry-run rows with, given instead of the installed ones
#: ("torch=2.13.0+cpu,transformers=5.24.0,peft=0.21.2"): a reproducible build's, as
#: SOURCE_DATE_EPOCH gives its date (the golden site is built with its rows' own).
LIBRARY_VERSIONS_ENV = "VRAM_LEDGER_LIBRARY_VERSIONS"


def library_versions() -> Optional[dict[str, str]]:
    """The torch / transformers / peft versions dry-run rows are compared with: those
    ``LIBRARY_VERSIONS_ENV`` names, else the installed ones (read from the package metadata:
    torch is not imported); None when one is not installed."""
    import os
    from importlib import metadata

    given = os.environ.get(LIBRARY_VERSIONS_ENV)
    if given is not None:
        from ledger.core.errors import Issue, UserError

        pairs = [part.partition("=") for part in given.split(",")]
        versions = {name.strip(): version.strip() for name, _, version in pairs}
        if sorted(versions) != sorted(LIBRARIES) or not all(versions.values()) or len(pairs) != len(LIBRARIES):
            raise UserError(Issue(LIBRARY_VERSIONS_ENV, "", f"must name each of {', '.join(LIBRARIES)} once as "
                                  f"name=version, comma-separated; got {given!r}"))
        return versions
    installed = {}
    for name in LIBRARIES:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return installed


def stale_rows(rows) -> list[str]:
    """Ids of dry-run rows whose torch / transformers / peft versions differ from
    ``library_versions()`` (none known: nothing to say)."""
    installed = library_versions()
    if installed is None:
        return []
    out = []
    for m in rows:
        env = m.environment
        if env is None:
            continue
        if any(getattr(env, k) not in (None, v) for k, v in installed.items()):
            out.append(m.id)
    return out


GRID_RANKS = (8, 16, 32, 64, 96, 112, 128, 192, 256)


def ledger_grids(p: Predictor, ranks: Iterable[int] = GRID_RANKS) -> list[dict]:
    """For the site's first section: per card of the ledger and each model, quant and fixes measured
    on it, a grid of rank x sequence length (the lengths measured there) for the plain recipe, with
    dropout and with DoRA. A cell is a measured outcome where a probe ran exactly that, else the
    predictor's verdict; each with its peak (MiB), method and evidence."""
    out = []
    combos: dict[tuple, set] = {}
    measured: dict[tuple, object] = {}
    for m in p.ms:
        if m.kind != "probe" or not m.gpu or m.lora is None or not m.seq_len:
            continue
        r = recipe_of(m)
        combos.setdefault((m.gpu, m.model, r.quant, r.fixes), set()).add(m.seq_len)
        if m.outcome.status in ("ok", "oom", "spilled"):
            measured[(m.gpu, m.model, r.quant, r.fixes, r.dropout, r.dora, m.seq_len, m.lora.rank)] = m
    for (gpu, model, quant, fixes), seqs in sorted(combos.items(), key=lambda kv: tuple(map(str, kv[0]))):
        settings = []
        for setting, dropout, dora in SETTINGS:
            rows = []
            for rank in sorted(set(ranks) | {k[7] for k in measured if k[:6] == (gpu, model, quant, fixes, dropout, dora)}):
                cells = []
                for seq in sorted(seqs):
                    m = measured.get((gpu, model, quant, fixes, dropout, dora, seq, rank))
                    if m is not None:
                        o = m.outcome
                        kind = {"ok": "measured-fit", "oom": "measured-oom", "spilled": "measured-spilled"}[o.status]
                        label = {"ok": "fit", "oom": "OOM", "spilled": "spilled"}[o.status]
                        cells.append({"seq_len": seq, "kind": kind, "label": label, "mib": o.peak_allocated_mib,
                                      "method": "measured", "evidence": [m.id]})
                        continue
                    a = p.predict(Recipe(model=model, rank=rank, quant=quant, dropout=dropout, dora=dora, seq_len=seq,
                                         fixes=fixes), gpu)
                    fig = a.probe_allocated
                    cells.append({"seq_len": seq, "kind": a.verdict.replace("'", "").replace(" ", "-"),
                                  "label": a.verdict, "mib": fig.mib if fig else None, "method": a.method or "",
                                  "evidence": a.evidence[:4]})
                rows.append({"rank": rank, "cells": cells})
            settings.append({"setting": setting, "rows": rows})
        out.append({"gpu": gpu, "model": model, "quant": quant, "fixes": fixes, "lengths": sorted(seqs),
                    "settings": settings})
    return out

