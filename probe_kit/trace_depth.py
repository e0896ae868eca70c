"""A step's allocation trace at a model's whole depth, from the traces of four short stacks.

The allocator's simulation (``probe_kit.allocator``) replays every allocation and free of the step
in order, and what it gives (the cache above allocated, the OOM point) does not extrapolate in
depth as the tracker's figures do: the cached blocks' splits depend on the whole order. But the
order itself is periodic in depth. Adding one period of layers (one layer for a model of one layer
type; the pattern's period for a model whose types repeat, as Gemma's sliding and global layers
do) inserts the same events at the same places of the trace: that layer's weights as they load,
its forward, its backward, its parameters' slots in the optimizer's step and in ``zero_grad``.

So the trace of ``m``, ``m + p``, ``m + 2p`` and ``m + 3p`` layers is recorded (``m``: the
model's depth modulo the period, at least two), and:

1. ``insertions``: the events the ``m + p`` trace inserts into the ``m`` trace, as blocks at
   positions (each allocation read as its size, each free as the size it frees, so the trace of
   fewer layers is a subsequence of the trace of more);
2. the ``m + 2p`` trace must be the ``m`` trace with each block twice at its place, event for
   event;
3. ``learn``: which allocation each free frees, as a rule of the block's copy (the same copy, the
   one below or above, the mirror copy as the backward runs the layers in reverse, the first or
   the last copy, or an allocation outside the blocks), fitted to the ``m + p`` and ``m + 2p``
   traces;
4. ``extend`` with those rules must give the ``m + 3p`` trace exactly, event for event, before it
   is trusted to give the model's whole depth.

Any step that fails returns None: the caller runs every layer. No torch here: the traces are
lists of integers as ``probe_kit.allocator.replay`` reads them.

Measured (``tests/test_trace_depth.py``; 4-bit QLoRA r16, 1,024 tokens, on this project's 2-core
CPU): tiny configs of 8 and 9 layers, the trace is every layer's event for event. qwen2.5-14b (48
layers) in 10.9 s against 17.1 s for every layer, llama-3.3-70b (80 layers) in 28.9 s against
92.9 s: the same number of events and the same simulated peak allocated and reserved (16,075.3 /
17,154 and 48,221.4 / 49,494 MiB), but from the backward on a few frees come in another order than
every layer's run gives them (objects that Python's cycle collector frees at counts that do not
grow with the depth), so deep in a model the trace is periodic only up to that order. A step whose
stacks do not agree (measured: Gemma's and gpt-oss's alternating layer types; a tiny Qwen2
without gradient checkpointing) is refused at the fourth stack and every layer runs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from .allocator import RESET_PEAK

def tokens(trace: list[int]) -> list[int]:
    """Each event as a number that does not name an allocation: an allocation of ``s`` bytes is
    ``2s``, a free of an allocation of ``s`` bytes ``-(2s + 1)``, a code (``EMPTY_CACHE``,
    ``RESET_PEAK``) itself."""
    sizes: list[int] = []
    out: list[int] = []
    for e in trace:
        if e >= 0:
            sizes.append(e)
            out.append(2 * e)
        elif e <= RESET_PEAK:
            out.append(e)
        else:
            out.append(-2 * sizes[-e - 1] - 1)
    return out


@dataclass(frozen=True)
class Block:
    """Events the longer trace inserts before event ``at`` of the shorter one."""

    at: int
    events: tuple[int, ...]  # tokens


def insertions(short: list[int], long: list[int]) -> Optional[list[Block]]:
    """The blocks ``long`` (tokens) inserts into ``short``, or None when ``short`` is not ``long``
    with blocks taken out. ``difflib`` matches them (junk heuristic off); a run of insertions
    with a few matched events between them is placed again as whole copies of the events beside
    it where it can be, and a block that copies the events before it and then those after it (the
    end of one layer-by-layer section and the start of the next) is cut in two."""
    ops = difflib.SequenceMatcher(None, short, long, autojunk=False).get_opcodes()
    if any(op not in ("insert", "equal") for op, *_ in ops):
        return None
    found: list[Block] = []
    k = 0
    while k < len(ops):
        if ops[k][0] != "insert":
            k += 1
            continue
        end = k
        while end + 2 < len(ops) and ops[end + 2][0] == "insert" and ops[end + 1][2] - ops[end + 1][1] <= SPLIT:
            end += 2
        i1, i2, j1, j2 = ops[k][1], ops[end][2], ops[k][3], ops[end][4]
        found.extend(_tandem(short, i1, i2, long[j1:j2]) or
                     [Block(op[1], tuple(long[op[3]:op[4]])) for op in ops[k:end + 1] if op[0] == "insert"])
        k = end + 1
    return [part for b in found for part in _split(short, b)]


#: Matched events between two insertions that may still be one block's cut (a layer's events
#: that the matching split around an event equal to one of them).
SPLIT = 8


def _is_tandem(short: list[int], at: int, events: tuple[int, ...]) -> bool:
    """Whether a block inserted before event ``at`` repeats events beside it (a copy of the
    neighbouring layer's, rotated at most by its own length)."""
    n = len(events)
    return any(tuple(short[at - n + r:at + r]) == events for r in range(n + 1) if at - n + r >= 0)


def _tandem(short: list[int], i1: int, i2: int, span: list[int]) -> Optional[list[Block]]:
    """``span`` (of the longer trace) as ``short[i1:i2]`` placed whole inside it with a tandem
    block on either side, or None when no placement makes both sides tandem copies."""
    middle = short[i1:i2]
    for q in range(len(span) - len(middle), -1, -1):
        if span[q:q + len(middle)] != middle:
            continue
        before, after = tuple(span[:q]), tuple(span[q + len(middle):])
        if (not before or _is_tandem(short, i1, before)) and (not after or _is_tandem(short, i2, after)):
            return [b for b in (Block(i1, before), Block(i2, after)) if b.events]
    return None


def _split(short: list[int], block: Block) -> list[Block]:
    at, events = block.at, block.events
    n = len(events)
    if tuple(short[max(at - n, 0):at]) == events or tuple(short[at:at + n]) == events:
        return [block]
    for cut in range(1, n):
        if tuple(short[at - cut:at]) == events[:cut] and tuple(short[at:at + n - cut]) == events[cut:]:
            return [Block(at, events[:cut]), Block(at, events[cut:])]
    return [block]


def expand_tokens(short: list[int], blocks: list[Block], k: int) -> list[int]:
    """``short`` with each block ``k`` times at its place."""
    out: list[int] = []
    b = 0
    for i in range(len(short) + 1):
        while b < len(blocks) and blocks[b].at == i:
            out.extend(blocks[b].events * k)
            b += 1
        if i < len(short):
            out.append(short[i])
    return out


@dataclass(frozen=True)
class Section:
    """A block and the copies of it in the short trace on either side (the layers the short
    stack has of that section): ``left`` copies end at the block's place, ``right`` begin there.
    With ``k`` copies inserted it has ``left + k + right`` chunks, one a layer."""

    left: int
    right: int

    def chunks(self, k: int) -> int:
        return self.left + k + self.right


def sections(short: list[int], blocks: list[Block]) -> list[Section]:
    out = []
    taken: set[int] = set()
    for b in blocks:
        n = len(b.events)
        left = 0
        while b.at - (left + 1) * n >= 0 and tuple(short[b.at - (left + 1) * n:b.at - left * n]) == b.events \
                and not taken & set(range(b.at - (left + 1) * n, b.at - left * n)):
            left += 1
        right = 0
        while tuple(short[b.at + right * n:b.at + (right + 1) * n]) == b.events \
                and not taken & set(range(b.at + right * n, b.at + (right + 1) * n)):
            right += 1
        taken |= set(range(b.at - left * n, b.at + right * n))
        out.append(Section(left, right))
    return out


def identities(n: int, blocks: list[Block], secs: list[Section], k: int) -> list[tuple]:
    """Who each event of the expansion is: ``("s", i)``, event i of the short trace outside every
    section, or ``(b, chunk, o)``, event o of chunk ``chunk`` of block b's section (its short
    trace's copies to the left, the k inserted, its copies to the right)."""
    where: dict[int, tuple] = {}
    for b, (blk, sec) in enumerate(zip(blocks, secs)):
        size = len(blk.events)
        for t in range(sec.left):
            for o in range(size):
                where[blk.at - (sec.left - t) * size + o] = (b, t, o)
        for t in range(sec.right):
            for o in range(size):
                where[blk.at + t * size + o] = (b, sec.left + k + t, o)
    out: list[tuple] = []
    b = 0
    for i in range(n + 1):
        while b < len(blocks) and blocks[b].at == i:
            size = len(blocks[b].events)
            out.extend((b, secs[b].left + c, o) for c in range(k) for o in range(size))
            b += 1
        if i < n:
            out.append(where.get(i, ("s", i)))
    return out


def _references(trace: list[int], ids: list[tuple]) -> dict[tuple, tuple]:
    """Each free's identity mapped to the identity of the allocation it frees."""
    made: list[tuple] = []
    out: dict[tuple, tuple] = {}
    for e, who in zip(trace, ids):
        if e >= 0:
            made.append(who)
        elif e > RESET_PEAK:
            out[who] = made[-e - 1]
    return out


#: How a free in chunk c of its section finds its allocation's chunk: the same chunk shifted, the
#: mirror chunk shifted (the backward runs the layers in the reverse order), the first or the last
#: chunk of the allocation's section shifted.
_FORMS = ("same", "mirror", "first", "last")
_SHIFTS = (0, -1, 1, -2, 2, -3, 3)


@dataclass(frozen=True)
class Rule:
    """Which allocation a free frees: event ``o`` of a chunk of block ``b``'s section, or
    ``outside`` (an event outside the sections) when there is no such chunk (or always, with
    ``b`` None)."""

    b: Optional[int]
    form: str
    shift: int
    o: int
    outside: Optional[tuple]

    def target(self, c: Optional[int], k: int, secs: list[Section], own: Optional[int]) -> Optional[tuple]:
        if self.b is None:
            return self.outside
        total = secs[self.b].chunks(k)
        if self.form == "same":
            t = None if c is None else c + self.shift
        elif self.form == "mirror":
            t = None if c is None or own is None else secs[own].chunks(k) - 1 - c + self.shift
        elif self.form == "first":
            t = self.shift
        else:
            t = total - 1 + self.shift
        if t is None or not 0 <= t < total:
            return self.outside
        return (self.b, t, self.o)


@dataclass(frozen=True)
class Piecewise:
    """A section's free with its own rule at the section's first and last chunk (the bottom and
    the top layer, whose neighbours are the embeddings and the head), ``middle`` elsewhere."""

    first: Optional[Rule]
    middle: Rule
    last: Optional[Rule]

    def target(self, c: Optional[int], k: int, secs: list[Section], own: Optional[int]) -> Optional[tuple]:
        rule = self.middle
        if c is not None and own is not None:
            if c == 0 and self.first is not None:
                rule = self.first
            elif c == secs[own].chunks(k) - 1 and self.last is not None:
                rule = self.last
        return rule.target(c, k, secs, own)


def _rule(obs: list, secs: list[Section], own: Optional[int]) -> Optional[Rule]:
    """One rule consistent with every observation, or None."""
    outside = next((ref for _, _, ref in obs if ref[0] == "s"), None)
    if all(ref[0] == "s" for _, _, ref in obs):
        return Rule(None, "", 0, 0, outside) if all(ref == outside for _, _, ref in obs) else None
    b, _, o = next(ref for _, _, ref in obs if ref[0] != "s")
    for form in _FORMS if own is not None else ("first", "last"):
        for shift in _SHIFTS:
            rule = Rule(b, form, shift, o, outside)
            if all(rule.target(c, k, secs, own) == ref for c, k, ref in obs):
                return rule
    return None


def learn(seen: dict[tuple, list], secs: list[Section]) -> Optional[dict[tuple, object]]:
    """A rule for each free (keyed ``("s", i)`` or ``(b, o)``) consistent with every observation
    ``(chunk or None, k, referenced identity)``: one rule, else one for the section's first
    chunk, one for its last and one between (``Piecewise``); None when a free has none."""
    rules: dict[tuple, object] = {}
    for key, obs in seen.items():
        own = None if key[0] == "s" else key[0]
        found = _rule(obs, secs, own)
        if found is None and own is not None:
            first = [x for x in obs if x[0] == 0]
            last = [x for x in obs if x[0] != 0 and x[0] == secs[own].chunks(x[1]) - 1]
            middle = [x for x in obs if x not in first and x not in last]
            parts = [_rule(group, secs, own) if group else None for group in (first, middle, last)]
            if middle and parts[1] is not None and all(p is not None for p, g in zip(parts, (first, middle, last)) if g):
                found = Piecewise(parts[0], parts[1], parts[2])
        if found is None:
            return None
        rules[key] = found
    return rules


def observe(trace: list[int], blocks: list[Block], secs: list[Section], n: int, k: int, seen: dict) -> None:
    """Add what ``trace`` (the short trace with each block ``k`` times) says of its frees."""
    for who, ref in _references(trace, identities(n, blocks, secs, k)).items():
        if who[0] == "s":
            seen.setdefault(who, []).append((None, k, ref))
        else:
            seen.setdefault((who[0], who[2]), []).append((who[1], k, ref))


def extend(short: list[int], blocks: list[Block], secs: list[Section], rules: dict[tuple, object],
           k: int) -> Optional[list[int]]:
    """The short trace with each block ``k`` times, its frees by ``rules``; None when a rule names
    an allocation not made, or freed already."""
    number: dict[tuple, int] = {}
    live: set[int] = set()
    out: list[int] = []
    made = 0
    for tok, who in zip(expand_tokens(tokens(short), blocks, k), identities(len(short), blocks, secs, k)):
        if tok >= 0:
            number[who] = made
            live.add(made)
            out.append(tok // 2)
            made += 1
        elif tok <= RESET_PEAK:
            out.append(tok)
        else:
            rule = rules.get(who if who[0] == "s" else (who[0], who[2]))
            if rule is None:
                return None
            ref = rule.target(None if who[0] == "s" else who[1], k, secs, None if who[0] == "s" else who[0])
            num = number.get(ref) if ref is not None else None
            if num is None or num not in live:
                return None
            live.discard(num)
            out.append(-(num + 1))
    return out


def whole_depth(traces: list[list[int]], k: int) -> tuple[Optional[list[int]], str]:
    """The trace with ``k`` periods over the first of ``traces`` (those of ``m``, ``m + p``,
    ``m + 2p`` and ``m + 3p`` layers), and how it was found; None (and why) when the traces are
    not periodic in depth as the module docstring describes."""
    t0, t1, t2, t3 = traces
    s0 = tokens(t0)
    blocks = insertions(s0, tokens(t1))
    if blocks is None:
        return None, "the longer stack's events are not the shorter one's with blocks inserted"
    if expand_tokens(s0, blocks, 2) != tokens(t2):
        return None, "two periods do not insert each block twice"
    secs = sections(s0, blocks)
    seen: dict[tuple, list] = {}
    observe(t1, blocks, secs, len(t0), 1, seen)
    observe(t2, blocks, secs, len(t0), 2, seen)
    rules = learn(seen, secs)
    if rules is None:
        return None, "a free's allocation follows no rule of the layers"
    if extend(t0, blocks, secs, rules, 3) != t3:
        return None, "the rules did not give the fourth stack's trace event for event"
    out = extend(t0, blocks, secs, rules, k)
    if out is None:
        return None, "the rules name an allocation the whole depth does not make"
    return out, f"{len(blocks)} blocks of {sum(len(b.events) for b in blocks)} events a period"
