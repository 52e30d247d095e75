"""Trace repeated blocks once: two short traces, the full depth rebuilt from their difference.

Most of a transformer's trace is one block again and again. For a run of ``L`` structurally
identical blocks (same class, parameter shapes and dtypes, settings) in one ``ModuleList``
or ``nn.Sequential``, the model is traced with 2 and with 3 of them. The 3-block trace is
the 2-block one with one block's events inserted in each stretch where the blocks run
(forward, backward, each per-parameter list of the optimizer step, ...): those inserted
runs are the pattern of a middle block. The full trace repeats each run ``L - 2`` times,
and every storage a middle block allocates is freed where the same storage of the traced
middle block was freed, shifted by the same number of blocks (activations of block ``i``
die in the backward of block ``i``, a block's output in the next block, its gradients in
``zero_grad``; under FSDP2 a block's gathered parameters in the next block's pre-forward).
The first and last blocks are matched to the middle one event for event by a diff: they
may lack some of its events (FSDP2's last block prefetches no next block's parameters).

It is exact or it is not used: the rebuilt stream must account for every event exactly
once, and the same rules must rebuild the 2-block trace event for event; otherwise
``expand`` raises ``NotRepeatable`` and the caller traces the whole model::

    run = find_run(model)               # BlockRun('model.layers', 0, 32)
    t2 = trace(truncated(model, run, 2)); t3 = trace(truncated(model, run, 3))
    full = expand(t2, t3, run, run.length)
"""

from __future__ import annotations

import bisect
import copy
import difflib
import itertools
import json
import re
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

from vramplan.collector import quiet
from vramplan.recipe import Recipe
from vramplan.sources.base import BuiltModel
from vramplan.sources.blocks import block_containers
from vramplan.trace import tricks
from vramplan.trace.events import Allocation, PhaseMark, Trace
from vramplan.trace.modules import ModuleStack
from vramplan.trace.repeat_plan import CHECK, Segment, recomputed, segments, short_recipe
from vramplan.trace.storage import cast_parameters

MIN_BLOCKS = 16
"""Fewer repeated blocks than this are traced as they are: the 2-, 3- and 4-block traces
that find and check the pattern cost as much as a full trace of a 12-block model."""
SHORT = (2, 3)
"""The depths traced: the pattern is their difference."""
SHORTER = 0.6
"""Stretches (some blocks checkpointed) are repeated for one estimate only when their short
traces hold at most this share of the blocks (32 blocks checkpointed 12 and 20 plain take
five short traces of 4-8 blocks: tracing all 32 costs less); ``plan``, which shares the
short traces between its estimates, always repeats them."""
MAX_PERIOD = 8
"""The longest pattern of unlike blocks looked for in a run (Gemma 2: 2; Gemma 3: 6)."""
PERIODS = 12
"""A run whose blocks repeat a pattern is traced short when it holds this many patterns or
more: its short traces hold 9 patterns (2, 3 and 4), so fewer would save little."""
DEFAULT_SOURCES = ("hf:", "diffusers:")
"""Models repeated by default: those whose exactness the tests prove (GPT-2, BERT, ViT,
Llama; diffusers' DiT, whose UNets have no run long enough); any other model is traced
whole."""
_INDEX_WORDS = ("idx", "index", "layer_id", "layer_number", "layer_num")
_PLAIN = (int, float, str, bool, type(None))


class NotRepeatable(Exception):  # noqa: N818 - a reason, not an error to the user
    """The short traces do not repeat exactly; the message says where."""


@dataclass(frozen=True)
class BlockRun:
    """Blocks ``start .. end - 1`` of the container at ``path`` are identical; with
    ``width`` above one, what repeats is a unit of that many consecutive blocks (every
    second block checkpointed: a plain block and a checkpointed one)."""

    path: str
    start: int
    end: int
    width: int = 1

    @property
    def length(self) -> int:
        return self.end - self.start


# -- finding and cutting the run -----------------------------------------------------------


def _settings(module: nn.Module) -> tuple:
    """A module's plain settings (not its position in the stack)."""
    items = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or any(word in key.lower() for word in _INDEX_WORDS):
            continue
        if isinstance(value, _PLAIN) or (
            isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)
        ):
            items.append((key, value))
    return tuple(items)


def signature(block: nn.Module) -> tuple:
    """What makes two blocks trace alike: classes, settings, parameter and buffer shapes,
    dtypes and trainability, hooks and forward overrides."""
    modules = tuple(
        (name, type(m).__qualname__, m.extra_repr(), _settings(m), "forward" in vars(m))
        for name, m in block.named_modules()
    )
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    hooks = tuple(
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in block.modules()
    )
    return modules, params, buffers, hooks


def find_run(model: nn.Module, containers: list[tuple[str, nn.Module]]) -> BlockRun | None:
    """The longest run of identical consecutive blocks among ``containers`` (qualified
    name, container) — at least ``MIN_BLOCKS`` long — or None."""
    return _longest(_alike_runs(containers))


def _alike_runs(containers: list[tuple[str, nn.Module]]) -> list[tuple[BlockRun, int]]:
    """Every maximal run of identical consecutive blocks in ``containers``, with the number
    of blocks its container holds."""
    runs = []
    for path, container in containers:
        children = list(container.children())
        if len(children) != len(container._modules):
            continue
        signatures = [signature(child) for child in children]
        start = 0
        for end in range(1, len(children) + 1):
            if end == len(children) or signatures[end] != signatures[start]:
                runs.append((BlockRun(path, start, end), len(children)))
                start = end
    return runs


def _longest(runs: list[tuple[BlockRun, int]]) -> BlockRun | None:
    """The longest of ``runs`` (the first of equal ones) of at least ``MIN_BLOCKS``."""
    long = [run for run, _ in runs if run.length >= MIN_BLOCKS]
    return max(long, key=lambda run: run.length, default=None)


def _unlike_note(runs: list[tuple[BlockRun, int]]) -> str:
    """Why a model with ``MIN_BLOCKS`` blocks or more in one container is traced whole: its
    blocks are not alike (Gemma 2's and 3's sliding-window and global layers). Empty where
    no container holds that many.

    >>> runs = [(BlockRun("model.layers", i, i + 1), 26) for i in range(26)]
    >>> _unlike_note(runs)
    'full trace: the 26 model.layers blocks are not alike (at most 1 identical in a row; \
runs of 16 or more are traced once and repeated)'
    """
    many = [(total, run) for run, total in runs if total >= MIN_BLOCKS]
    if not many:
        return ""
    total, path = max((total, run.path) for total, run in many)
    longest = max(run.length for run, _ in runs if run.path == path)
    return (
        f"full trace: the {total} {path} blocks are not alike (at most {longest} identical in "
        f"a row; runs of {MIN_BLOCKS} or more are traced once and repeated)"
    )


def truncated(model: nn.Module, run: BlockRun, blocks: int) -> nn.Module:
    """A copy of the (meta) ``model`` with only ``blocks`` of the run; an HF config's
    layer count (and per-layer lists) follow."""
    container = model.get_submodule(run.path)
    saved = container._modules
    items = list(saved.values())
    kept = items[: run.start + blocks] + items[run.end :]
    container._modules = OrderedDict((str(i), m) for i, m in enumerate(kept))
    try:
        short = copy.deepcopy(model)
    finally:
        container._modules = saved
    config = getattr(short, "config", None)
    total = len(items)
    if config is not None:
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if getattr(config, key, None) == total:
                setattr(config, key, len(kept))
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == total:
            config.layer_types = types[: run.start + blocks] + types[run.end :]
    return short


# -- the expansion ---------------------------------------------------------------------------


class _Names:
    """Module names: ``path.i`` of a short trace, normalised (for matching) or renamed
    (for the full depth). ``blocks`` and ``full`` count units of ``run.width`` blocks."""

    def __init__(self, run: BlockRun, blocks: int, full: int) -> None:
        self.run, self.blocks, self.full = run, blocks, full
        self.pattern = re.compile(rf"^{re.escape(run.path)}\.(\d+)(?=\.|$)")
        self._normal: dict[str, str] = {}  # a trace names few modules, each many times
        self._renamed: dict[tuple[str, int | None], str] = {}

    def index(self, module: str) -> int | None:
        match = self.pattern.match(module)
        return int(match.group(1)) if match else None

    def normal(self, module: str) -> str:
        known = self._normal.get(module)
        if known is None:
            known = self._normal[module] = self._normalised(module)
        return known

    def _normalised(self, module: str) -> str:
        i = self.index(module)
        if i is None or i < self.run.start:
            return module
        width, offset = self.run.width, i - self.run.start
        if offset < self.blocks * width:
            return self.pattern.sub(f"{self.run.path}.#{offset % width}", module)
        return self.pattern.sub(f"{self.run.path}.+{offset - self.blocks * width}", module)

    def renamed(self, module: str, shift: int | None) -> str:
        """``module`` of the 3-block trace as named at full depth; ``shift`` moves a unit
        of the run (None: a module outside the run's middle)."""
        known = self._renamed.get((module, shift))
        if known is None:
            known = self._renamed[module, shift] = self._moved_name(module, shift)
        return known

    def _moved_name(self, module: str, shift: int | None) -> str:
        i = self.index(module)
        if i is None or i < self.run.start:
            return module
        width, offset = self.run.width, i - self.run.start
        unit, within = divmod(offset, width)
        if unit >= self.blocks:
            new = i + (self.full - self.blocks) * width
        elif shift is not None:
            new = i + shift * width
        elif unit == 0:
            new = i
        elif unit == self.blocks - 1:
            new = self.run.start + (self.full - 1) * width + within
        else:
            raise NotRepeatable(f"{module} is used outside its block")
        return self.pattern.sub(f"{self.run.path}.{new}", module)


def _slots(trace: Trace) -> list[tuple[Allocation, bool] | None]:
    """Every event index of ``trace``: (allocation, is_alloc), or None for a gap."""
    slots: list[tuple[Allocation, bool] | None] = [None] * trace.event_count
    for a in trace.allocations:
        slots[a.alloc_index] = (a, True)
        if a.free_index is not None:
            slots[a.free_index] = (a, False)
    return slots


def _kind(a: Allocation, names: _Names) -> tuple:
    return (a.nbytes, a.category, a.phase, a.iteration, a.op, a.stream, names.normal(a.module))


def _tokens(slots, names: _Names) -> list[tuple]:
    return [() if s is None else (s[1], *_kind(s[0], names)) for s in slots]


@dataclass
class _Region:
    """One inserted run ``[q, q + d)`` of the 3-block trace, its orientation (+1: blocks
    in forward order, -1: reversed, as in backward)."""

    q: int
    d: int
    sign: int = 1
    start: int = 0
    end: int = 0
    """The periods around the run stand for the first and the last block in ``[start,
    end)``: they stop where the next iteration's storages begin."""
    low: int = 0
    high: int = 0
    """Where the run may sit: cutting ``[q, q + d)`` out of the 3-block trace leaves the
    2-block one for every ``q`` in ``[low, high]``."""
    edges: dict[str, dict[int, int]] = field(default_factory=dict)
    """The first ('-') and last ('+') blocks' events matched to the run's: position →
    offset in the run, and back (``_settle``)."""
    places: dict[str, dict[int, int]] = field(default_factory=dict)

    def short_block(self, window: str) -> int:
        """The window's block number in the 3-block trace (0, 1 or 2)."""
        if window == "x":
            return 1
        return 0 if (window == "-") == (self.sign > 0) else 2

    def at(self, window: str, offset: int) -> int:
        """The position of the event of the run's ``offset`` in the ``window`` block."""
        found = self.places[window].get(offset)
        if found is None:
            raise NotRepeatable(f"a middle block's event {offset} is not in the {window} block")
        return found


def _regions(
    tok2: list[tuple], tok3: list[tuple], slots3, units: list[int | None], side: int = 0
) -> list[_Region]:
    """The inserted runs, each moved (where the tokens allow) so that the period before and
    after it repeat it. With ``side`` (+1: blocks that look alike sit only before the run,
    -1: only after it; gradients freed by ``zero_grad`` carry no module name), runs are put
    as late (early) as that allows, and a run of frees where the storages born in the other
    runs die (``_follow_births``)."""
    regions = []
    spans: list[tuple[_Region, int, int]] = []
    for j1, j2 in _insertions(tok2, tok3):
        kinds = [bool(t) and t[0] for t in tok3[j1:j2]]
        turn = kinds.index(False) if False in kinds else len(kinds)
        split = _straddle(tok3, j1, j2)
        if 0 < turn < len(kinds) and not any(kinds[turn:]):
            # a list allocated then freed in reverse (foreach): two stretches, not one
            regions += [_Region(j1, turn), _Region(j1 + turn, j2 - j1 - turn)]
        elif split is not None:
            regions += [_Region(j1, split), _Region(j1 + split, j2 - j1 - split)]
        else:
            regions.append(_Region(j1, j2 - j1))
    for region in regions:
        # The run may sit anywhere in the stretch where the tokens repeat with its period:
        # put it in the middle, one period from either end (the first and last blocks differ
        # from a middle one at their boundaries).
        q, d = region.q, region.d
        low = q
        while low - 1 >= 0 and tok3[low - 1] == tok3[low - 1 + d]:
            low -= 1
        high = q
        while high + 2 * d < len(tok3) and tok3[high] == tok3[high + d]:
            high += 1
        region.q, region.low, region.high = (low + high) // 2, low, high
        if side and low + d <= high - d:
            region.q = high - d if side > 0 else low + d
            spans.append((region, low + d, high - d))
    if spans:
        _follow_births(spans, regions, tok3, slots3)
    for region in regions:
        _settle(region, tok3, units)
    _place(regions, tok3, slots3, units)
    return regions


def _settle(region: _Region, tok3: list[tuple], units: list[int | None]) -> None:
    """The first and last blocks of ``region`` where it sits: each the stretch next to the
    run (a quarter of a period longer, within the run's iteration) matched to the run
    event for event. They may lack some of a middle block's events (in FSDP2's backward
    the first block frees no earlier block's reduce-scatter input, the last one prefetches
    no next block's all-gather), so the match is a diff, not an offset. An event matched to
    the run's is the next block's only if their modules (``units``: the unit of the run
    each event's module is in) are one unit apart: diffusers' DiT runs its first block's
    ``norm1.emb`` again after the last block (``DiTTransformer2DModel.forward``), events
    alike a block's first ones that belong to no block."""
    q, d = region.q, region.d
    region.start, region.end = _same_iteration(tok3, region)
    run = tok3[q : q + d]
    region.edges, region.places = {}, {}
    for window, lo, hi in (("-", region.start, q), ("+", q + d, region.end)):
        matcher = difflib.SequenceMatcher(None, tok3[lo:hi], run, autojunk=False)
        edges = {
            lo + i + k: j + k
            for i, j, n in matcher.get_matching_blocks()
            for k in range(n)
            if _neighbours(units[lo + i + k], units[q + j + k])
        }
        region.edges[window] = edges
        region.places[window] = {off: pos for pos, off in edges.items()}


def _neighbours(a: int | None, b: int | None) -> bool:
    """Events of units ``a`` and ``b`` of the run (None: no module of the run) can be the
    same event of two consecutive units."""
    return a is None or b is None or abs(a - b) == 1


def _units(slots, names: _Names) -> list[int | None]:
    """Each event's unit of the run: where its storage's module sits (None: outside)."""
    units: list[int | None] = []
    for s in slots:
        i = None if s is None else names.index(s[0].module)
        if i is None or i < names.run.start:
            units.append(None)
            continue
        unit = (i - names.run.start) // names.run.width
        units.append(unit if unit < names.blocks else None)
    return units


def _place(regions: list[_Region], tok3: list[tuple], slots3, units: list[int | None]) -> None:
    """Move each run that storages cross from outside its blocks (born before the first
    block and freed in the run, or born in the run and freed after the last one) so that
    their births fall in the block before or after it, where that leaves fewer crossing:
    FSDP2 gathers a block's parameters in its pre-forward hook and frees the gathered
    buffer in the next block's, so the run must start at a block's all-gather, not
    anywhere in the stretch where the tokens repeat."""
    crossing = _crossing(regions, slots3, len(tok3))
    for j, region in enumerate(regions):
        middle = region.q
        wanted = {pos + region.d * (1 if inward else -1) for k, pos, inward in crossing if k == j}
        best = (len(crossing), 0, middle)
        for q in sorted(wanted):
            if region.low <= q <= region.high:
                region.q = q
                _settle(region, tok3, units)
                best = min(best, (len(_crossing(regions, slots3, len(tok3))), abs(q - middle), q))
        region.q = best[2]
        _settle(region, tok3, units)
        crossing = _crossing(regions, slots3, len(tok3))


def _crossing(regions: list[_Region], slots3, size: int) -> list[tuple[int, int, bool]]:
    """The storages that cross a run from outside the blocks: (the run, the birth, whether
    it is born outside); one for each event where the runs overlap."""
    try:
        labels = _label(regions, size)
    except NotRepeatable:
        return [(-1, pos, True) for pos in range(size)]
    crossing = []
    for s in slots3:
        if s is None or not s[1] or s[0].free_index is None:
            continue
        born, died = labels[s[0].alloc_index], labels[s[0].free_index]
        if born is None and died is not None and died[1] == "x":
            crossing.append((died[0], s[0].alloc_index, True))
        elif died is None and born is not None and born[1] == "x":
            crossing.append((born[0], s[0].alloc_index, False))
    return crossing


def _insertions(tok2: list[tuple], tok3: list[tuple]) -> list[tuple[int, int]]:
    """The runs ``[j1, j2)`` of the 3-block trace that the 2-block one lacks: the diff's
    insertions, two of them merged where one insertion explains both (``_joined``)."""
    matcher = difflib.SequenceMatcher(None, tok2, tok3, autojunk=False)
    runs: list[tuple[int, int]] = []
    for tag, _i1, _i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise NotRepeatable(f"the 3-block trace differs from the 2-block one at {j1}")
        joined = _joined(tok3, *runs[-1], j1, j2) if runs else None
        if joined is not None:
            runs[-1] = joined
        else:
            runs.append((j1, j2))
    return runs


def _joined(tok3: list[tuple], p1: int, p2: int, j1: int, j2: int) -> tuple[int, int] | None:
    """One insertion in place of two, ``[p1, p2)`` and ``[j1, j2)`` with the events between
    them kept, where the same events can be kept around a single run; else None.

    The diff aligns repeats as it finds its longest matches first, so one block's events
    can come out split: a tied Llama's ``zero_grad`` frees the gradients of the embedding,
    the blocks (``mm`` x7, ``sum`` x2 each) and the final norm (``sum``, like a block's),
    and the diff keeps the 2-block trace's last ``sum`` inside the inserted block.

    >>> t = list("e" "mmss" "mmss" "mmss" "s")  # the 2-block trace "emmssmmsss" and a block
    >>> _joined(t, 9, 11, 12, 14)  # the diff inserts "mm" and, one "s" later, "ss"
    (9, 13)
    """
    gap, d = j1 - p2, (p2 - p1) + (j2 - j1)
    if gap > d:
        return None
    window, kept = tok3[p1:j2], tok3[p2:j1]
    for k in range(gap + 1):
        if window[:k] + window[k + d :] == kept:
            return p1 + k, p1 + k + d
    return None


def _follow_births(spans, regions: list[_Region], tok3: list[tuple], slots3) -> None:
    """Move each run of frees (within its ``(region, lowest, highest)`` span) to where the
    most storages born in another run's window die: a list freed in reverse, or gradients
    freed in parameter order, belong to the block whose storages they free."""
    born_in_run = [False] * len(tok3)
    for region in regions:
        run = tok3[region.q : region.q + region.d]
        if sum(1 for t in run if t and t[0]) * 2 > region.d:
            born_in_run[region.q : region.q + region.d] = [True] * region.d
    hit = [0] * (len(tok3) + 1)  # prefix sums: frees of storages born in a run
    for pos, s in enumerate(slots3):
        freed = s is not None and not s[1] and born_in_run[s[0].alloc_index]
        hit[pos + 1] = hit[pos] + freed
    for region, lowest, highest in spans:
        run = tok3[region.q : region.q + region.d]
        if sum(1 for t in run if t and not t[0]) * 2 <= region.d:
            continue
        d = region.d
        best = hit[region.q + d] - hit[region.q]
        for q in range(lowest, highest + 1):
            if hit[q + d] - hit[q] > best:
                region.q, best = q, hit[q + d] - hit[q]


def _straddle(tok3: list[tuple], j1: int, j2: int) -> int | None:
    """Where an inserted run ``[j1, j2)`` that is no period of its own splits into the end
    of one repeated stretch and the start of the next one, or None.

    Two per-block lists that meet (the optimizer's temporaries of every block, then every
    block's gradients in ``zero_grad``, when only blocks train: LoRA) let the diff insert
    the last block's tail of the first list and the first block's head of the second as
    one run. Its first ``k`` events repeat the ``k`` before it, its other ones the events
    after it.

    >>> t = list("aaaabbbb")  # a 2-block trace "aaabbb" with one more block: "a" and "b"
    >>> _straddle(t, 3, 5)
    1
    """
    d = j2 - j1
    run = tok3[j1:j2]
    if run == tok3[max(j1 - d, 0) : j1] or run == tok3[j2 : j2 + d]:
        return None
    for k in range(1, d):
        if tok3[j1 : j1 + k] == tok3[j1 - k : j1] and tok3[j1 + k : j2] == tok3[j2 : j2 + d - k]:
            return k
    return None


def _same_iteration(tok3: list[tuple], region: _Region) -> tuple[int, int]:
    """How far the periods around ``region``'s run (a quarter of a period more than one
    period each way) reach before a storage of another iteration is born (the run's last
    block is not followed by the next iteration's)."""
    q, d = region.q, region.d
    iterations = {t[4] for t in tok3[q : q + d] if t and t[0]}

    def foreign(pos: int) -> bool:
        t = tok3[pos]
        return bool(t) and t[0] and t[4] not in iterations

    slack = d // 4
    start = q
    while start > max(q - d - slack, 0) and not foreign(start - 1):
        start -= 1
    end = q + d
    while end < min(q + 2 * d + slack, len(tok3)) and not foreign(end):
        end += 1
    return start, end


def _label(regions: list[_Region], size: int) -> list[tuple[int, str, int] | None]:
    """Each event's (region, window, offset). A region's own run wins over the periods
    around another one, and the periods of a shorter stretch over those of a longer one (a
    cache's frees sit between forward and backward, inside the periods around both);
    periods of two stretches of one length that meet are nobody's."""
    labels: list[tuple[int, str, int] | None] = [None] * size
    owner_length = [0] * size
    order = sorted(range(len(regions)), key=lambda j: -regions[j].d)
    for j in order:
        region = regions[j]
        for window, edges in region.edges.items():
            for pos, offset in edges.items():
                if owner_length[pos] == region.d and labels[pos] is not None:
                    labels[pos] = None  # contested: stays nobody's
                    continue
                if owner_length[pos] != region.d:
                    labels[pos] = (j, window, offset)
                    owner_length[pos] = region.d
    for j, region in enumerate(regions):
        for pos in range(region.q, region.q + region.d):
            if labels[pos] is not None and labels[pos][1] == "x":
                raise NotRepeatable("repeated stretches overlap")
            labels[pos] = (j, "x", pos - region.q)
    return labels


def _orient(regions: list[_Region], slots3, labels, units: list[int | None]) -> None:
    """Blocks run forward in some stretches and backward in others: find each stretch's
    direction from the storages that cross between stretches (the same allocation slot in
    the three windows must die the same number of blocks later). Each connected set of
    stretches then takes the direction its events' module names give (``_named_votes``):
    with checkpointing and activation offloading nothing a block saves in forward lives on
    the card into backward, so no storage ties the backward stretch to the forward one."""
    groups: dict[tuple[int, int, int], list[tuple[str, str]]] = defaultdict(list)
    for s in slots3:
        if s is None or not s[1] or s[0].free_index is None:
            continue
        a = s[0]
        la, lf = labels[a.alloc_index], labels[a.free_index]
        if la is None or lf is None or la[0] == lf[0]:
            continue
        groups[(la[0], la[2], lf[0])].append((la[1], lf[1]))
    votes: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for (ja, _, jf), pairs in groups.items():
        if len(pairs) < 2:
            continue
        for k, relative in enumerate((1, -1)):
            probe_a, probe_f = _Region(0, 0, 1), _Region(0, 0, relative)
            deltas = {probe_f.short_block(wf) - probe_a.short_block(wa) for wa, wf in pairs}
            if len(deltas) == 1:
                votes[(ja, jf)][k] += 1
    known: dict[int, int] = {}
    named = _named_votes(regions, labels, units)
    for seed in range(len(regions)):  # each connected set of stretches, from its first
        if seed in known:
            continue
        known[seed] = 1
        frontier, members = [seed], [seed]
        while frontier:
            j = frontier.pop()
            for (ja, jf), (same, opposite) in votes.items():
                if same == opposite or j not in (ja, jf):
                    continue
                other = jf if ja == j else ja
                if other not in known:
                    known[other] = known[j] * (1 if same > opposite else -1)
                    frontier.append(other)
                    members.append(other)
        if sum(known[j] * named[j] for j in members) < 0:
            for j in members:
                known[j] = -known[j]
    for j, region in enumerate(regions):
        region.sign = known.get(j, 1)


def _named_votes(regions: list[_Region], labels, units: list[int | None]) -> list[int]:
    """For each stretch, how many events of its first and last blocks name the module of
    the block they would be in forward order (+1 each) or in reverse order (-1 each): a
    checkpointed block's recomputed forward in backward runs in the last block first.
    Events with no module of the run (backward's own ops, the optimizer's) do not vote."""
    votes = [0] * len(regions)
    for label, unit in zip(labels, units, strict=True):
        if label is None or label[1] == "x" or unit is None:
            continue
        first = 0 if label[1] == "-" else SHORT[1] - 1
        votes[label[0]] += (unit == first) - (unit == SHORT[1] - 1 - first)
    return votes


def expand(t2: Trace, t3: Trace, run: BlockRun, full: int, side: int = 0) -> Trace:
    """The trace of the model with ``full`` blocks (units) in the run, from its 2- and
    3-block traces; raises ``NotRepeatable`` unless the rebuild is exact. ``side``: +1
    when alike blocks come only before the run, -1 only after it (``_regions``)."""
    names = _Names(run, 3, full)
    slots2, slots3 = _slots(t2), _slots(t3)
    tok2, tok3 = _tokens(slots2, _Names(run, 2, full)), _tokens(slots3, names)
    units = _units(slots3, names)
    regions = _regions(tok2, tok3, slots3, units, side)
    if sum(r.d for r in regions) != len(tok3) - len(tok2):
        raise NotRepeatable("the extra block is not one insertion per stretch")
    regions.sort(key=lambda r: r.q)
    labels = _label(regions, len(tok3))
    _orient(regions, slots3, labels, units)
    check = _rebuild(t3, slots3, tok3, labels, regions, names, 2, _Names(run, 3, 2))
    if _tokens(_slots(check), _Names(run, 2, 2)) != tok2 or _links(check) != _links(t2):
        raise NotRepeatable("the pattern does not rebuild the 2-block trace")
    return _rebuild(t3, slots3, tok3, labels, regions, names, full, names)


def same_events(a: Trace, b: Trace) -> bool:
    """The same storages born and freed at the same events, in the same phases."""

    def rows(t: Trace) -> list[tuple]:
        return sorted(
            (x.alloc_index, x.free_index, x.nbytes, x.category, x.phase, x.iteration, x.op)
            + (x.module, x.stream)
            for x in t.allocations
        )

    return (
        a.event_count == b.event_count
        and rows(a) == rows(b)
        and a.phases == b.phases
        and a.markers == b.markers
    )


def _links(trace: Trace) -> list[tuple[int, int | None]]:
    return sorted((a.alloc_index, a.free_index) for a in trace.allocations)


def _moved(a: Allocation, id_: int, module: str, born: int, died: int | None) -> Allocation:
    """``a`` renumbered, renamed and moved (``dataclasses.replace`` is slow on long traces)."""
    return Allocation(
        id_, a.nbytes, a.category, a.phase, a.iteration, module, a.op, born, died, a.stream
    )


def _rebuild(t3, slots3, tok3, labels, regions, names, full, renamer) -> Trace:  # noqa: C901
    """The events of the run at depth ``full`` (>= 2): each region's run repeated
    ``full - 2`` times, every storage freed the same number of blocks later as in the
    3-block trace."""
    extra = full - 3
    ends = sorted((r.q + r.d, r.d) for r in regions)
    end_positions = [end for end, _ in ends]
    inserted_before = [0, *itertools.accumulate(d for _, d in ends)]
    starts = {id(r): None for r in regions}

    def place(pos: int) -> int:
        """Where a 3-block event lands (the inserted run as copy 0)."""
        if extra < 0:
            return None
        return pos + extra * inserted_before[bisect.bisect_right(end_positions, pos)]

    if extra >= 0:
        for r in regions:
            starts[id(r)] = place(r.q)
    size = len(tok3) + extra * sum(r.d for r in regions)

    def block_of(region: _Region, window: str) -> int:
        b3 = region.short_block(window)
        return {0: 0, 1: None, 2: full - 1}[b3]

    def slot(j: int, block: int, off: int) -> int:
        region = regions[j]
        if not 0 <= block < full:
            raise NotRepeatable("a storage outlives the blocks around it")
        first, last = (0, full - 1) if region.sign > 0 else (full - 1, 0)
        if block == first:
            return position(region.at("-", off))
        if block == last:
            return position(region.at("+", off))
        copy_ = block - 1 if region.sign > 0 else full - 2 - block
        return starts[id(region)] + copy_ * region.d + off

    def position(pos: int) -> int:
        if extra >= 0:
            return place(pos)
        # depth 2: the inserted runs removed
        if labels[pos] is not None and labels[pos][1] == "x":
            raise NotRepeatable("an event of the middle block is needed at depth 2")
        return pos - sum(r.d for r in regions if r.q + r.d <= pos)

    source: list[int | None] = [None] * size
    for pos in range(len(tok3)):
        label = labels[pos]
        if label is not None and label[1] == "x":
            if extra < 0:
                continue
            region = regions[label[0]]
            for c in range(full - 2):
                source[starts[id(region)] + c * region.d + label[2]] = pos
        else:
            source[position(pos)] = pos

    def target(la, lf, block: int) -> int:
        """The event where a storage born in ``block`` (window ``la``) dies (window ``lf``)."""
        ra, rf = regions[la[0]], regions[lf[0]]
        ba, bf = ra.short_block(la[1]), rf.short_block(lf[1])
        if ba != 1 and bf != 1:
            return slot(lf[0], 0 if bf == 0 else full - 1, lf[2])
        return slot(lf[0], block + bf - ba, lf[2])

    rows: list[tuple[int, int | None, str, Allocation]] = []  # born, died, module, source
    claimed: set[int] = set()
    for s in slots3:
        if s is None or not s[1]:
            continue
        a = s[0]
        la = labels[a.alloc_index]
        lf = labels[a.free_index] if a.free_index is not None else None
        births: list[tuple[int, int, int | None]] = []  # (block, alloc slot, shift)
        if la is None:
            births.append((-1, position(a.alloc_index), None))
        elif la[1] == "x":
            births += [(b, slot(la[0], b, la[2]), b - 1) for b in range(1, full - 1)]
        else:
            b = block_of(regions[la[0]], la[1])
            births.append((b, position(a.alloc_index), b - regions[la[0]].short_block(la[1])))
        for block, born, shift in births:
            if a.free_index is None:
                died = None
            elif lf is None:
                if la is not None and la[1] == "x" and full != 3:
                    raise NotRepeatable(f"a middle block's {a.op} dies outside the blocks")
                died = position(a.free_index)
            elif la is None:
                if lf[1] == "x" and full != 3:
                    raise NotRepeatable(f"{a.op} from outside the blocks dies in a middle one")
                died = slot(lf[0], block_of(regions[lf[0]], lf[1]), lf[2])
            else:
                died = target(la, lf, block)
            if died is not None:
                if died in claimed or died <= born:
                    raise NotRepeatable(f"{a.op}'s storage dies twice or before it is born")
                src = source[died]
                freed = slots3[src] if src is not None else None
                if freed is None or freed[1] or _kind(freed[0], names) != _kind(a, names):
                    raise NotRepeatable(f"{a.op}'s storage dies where another one did")
            if died is not None:
                claimed.add(died)
            rows.append((born, died, renamer.renamed(a.module, shift), a))
    frees = sum(1 for s in source if s is not None and slots3[s] is not None and not slots3[s][1])
    if len(claimed) != frees or len({row[0] for row in rows}) != len(rows):
        raise NotRepeatable("the rebuilt events do not add up")
    return _finish(t3, rows, size, labels, position)


def _finish(t3: Trace, rows, size, labels, position) -> Trace:
    """The rebuilt storages (born, died, module, the 3-block trace's allocation) numbered
    in allocation order, with phase marks and library markers at the new depth."""
    for mark in t3.phases:
        label = labels[mark.index] if mark.index < len(labels) else None
        if label is not None and label[1] == "x":
            raise NotRepeatable("a phase changes inside a block")
    phases = tuple(
        PhaseMark(position(m.index) if m.index < len(labels) else size, m.phase, m.iteration)
        for m in t3.phases
    )
    markers = []
    for marker in t3.markers:
        label = labels[marker.index] if 0 <= marker.index < len(labels) else None
        if label is not None and label[1] == "x":
            raise NotRepeatable("library calls inside the blocks are not repeated yet")
        if marker.index >= 0:
            marker = replace(marker, index=position(marker.index))
        markers.append(marker)
    rows.sort(key=lambda row: row[0])
    return replace(
        t3,
        allocations=tuple(
            _moved(a, i, module, born, died) for i, (born, died, module, a) in enumerate(rows)
        ),
        phases=phases,
        event_count=size,
        markers=tuple(markers),
    )


def scaled_counts(c2: dict, c3: dict, full: int) -> dict:
    """Op counts at depth ``full``: linear in the number of blocks."""
    keys = set(c2) | set(c3)
    counts = {k: c3.get(k, 0) + (full - 3) * (c3.get(k, 0) - c2.get(k, 0)) for k in keys}
    return {k: v for k, v in counts.items() if v}


def _check_recomputed(model: nn.Module, run: BlockRun, built: BuiltModel, recipe: Recipe) -> None:
    """The blocks the recipe checkpoints are the run's, in order: on a copy with
    checkpointing applied, blocks meant to recompute alike and the others alike."""
    if not recipe.is_training or recipe.checkpointing in ("none", "full", "op"):
        return
    copied = shell(model)
    built.enable_checkpointing(
        copied, recipe.checkpoint_blocks, recipe.checkpoint_every, recipe.checkpoint_ops
    )
    children = list(copied.get_submodule(run.path).children())[run.start : run.end]
    seen: dict[bool, tuple] = {}
    for flag, child in zip(recomputed(recipe, run.length), children, strict=True):
        if seen.setdefault(flag, signature(child)) != signature(child):
            raise NotRepeatable("the checkpointed blocks are not the repeated ones")
    if len(seen) == 2 and seen[True] == seen[False]:
        raise NotRepeatable("checkpointing leaves no mark on the blocks")


def shell(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A copy of ``module``'s tree to switch checkpointing on: new module objects with
    their own attributes and containers (children, parameters, buffers, hooks), sharing
    the tensors and every other value. Enabling checkpointing sets attributes and hooks
    (Hugging Face's flags, a block's ``forward``), so the model is left as it was; a deep
    copy of a large model copies hundreds of thousands of objects, this a few a module.

    >>> block = nn.Sequential(nn.Linear(2, 2))
    >>> copied = shell(block)
    >>> copied[0].forward = None
    >>> copied[0] is block[0], copied[0].weight is block[0].weight, "forward" in vars(block[0])
    (False, True, False)
    """
    memo = {} if memo is None else memo
    if id(module) in memo:  # a module held twice stays one
        return memo[id(module)]
    clone = memo[id(module)] = copy.copy(module)
    attributes = vars(clone)
    for name, value in list(attributes.items()):
        if isinstance(value, (dict, set, list)):
            attributes[name] = copy.copy(value)
    children = attributes["_modules"]
    for name, child in children.items():
        children[name] = None if child is None else shell(child, memo)
    return clone


class _Rebuilder:
    """Short traces of the model cut to a few units of each stretch (memoised), and the
    full depth rebuilt from them one long stretch at a time."""

    def __init__(self, built, recipe, run, parts, trace_model, kind) -> None:
        self.built, self.recipe, self.run, self.parts = built, recipe, run, parts
        self.trace_model, self.kind = trace_model, kind
        shared = built.short_traces is not None
        self.expanding = [  # shared, a short stretch is rebuilt from its family's traces too
            j for j, part in enumerate(parts) if part.expands or (shared and part.units >= SHORT[0])
        ]
        self.traces: dict[tuple[int, ...], Trace] = {}
        self.kept = built.short_traces if built.short_traces is not None else {}

    def _blocks(self, units: tuple[int, ...]) -> int:
        return sum(u * part.width for u, part in zip(units, self.parts, strict=True))

    def _key(self, units: tuple[int, ...]) -> tuple:
        shape = json.dumps(short_recipe(self.recipe, units).to_json(), sort_keys=True)
        return (self.built.name, self.run, self._blocks(units), self.kind, shape)

    def short(self, units: tuple[int, ...]) -> Trace:
        if units not in self.traces:
            key = self._key(units)
            if key not in self.kept:
                cut = truncated(self.built.model, self.run, self._blocks(units))
                self.kept[key] = self.trace_model(
                    replace(self.built, model=cut, notes=list(self.built.notes)),
                    short_recipe(self.recipe, units),
                )
            self.traces[units] = self.kept[key]
        return self.traces[units]

    def trace_shared(self) -> None:
        """Where the kept short traces are shared with other processes (``claim``:
        ``planner/shared_traces.py``), trace those of ``leaves`` no other process has
        claimed, the longest first, then wait for the rest: workers tracing recipes of one
        family side by side split its short traces. Nothing where they are not shared."""
        claim = getattr(self.kept, "claim", None)
        if claim is None:
            return
        claimed_elsewhere = []
        for units in sorted(
            set(leaves(self.parts, self.expanding)), key=self._blocks, reverse=True
        ):
            key = self._key(units)
            if key in self.kept:
                continue
            if not claim(key):
                claimed_elsewhere.append(key)
                continue
            try:
                self.short(units)
            except BaseException:
                self.kept.release(key)  # the others trace it themselves
                raise
        for key in claimed_elsewhere:
            self.kept.wait(key)

    def rebuilds_check(self) -> bool:
        """Whether the short traces rebuild the one with each long stretch at ``CHECK``
        units event for event; kept with the short traces, whose family (``repeat_plan``:
        the recipes that differ only in how many leading blocks recompute) checks the same
        rebuild."""
        targets = {j: CHECK for j in self.expanding}
        wanted = tuple(CHECK if j in targets else p.units for j, p in enumerate(self.parts))
        widths = tuple(part.width for part in self.parts)
        key = ("check", self._key(wanted), tuple(self.expanding), widths)
        if key not in self.kept:
            self.kept[key] = same_events(self.rebuilt(targets), self.short(wanted))
        return self.kept[key]

    def rebuilt(self, targets: dict[int, int]) -> Trace:
        """The trace with each long stretch ``j`` at ``targets[j]`` units."""
        return self._level(0, [part.units for part in self.parts], targets)

    def _level(self, k: int, units: list[int], targets: dict[int, int]) -> Trace:
        if k == len(self.expanding):
            return self.short(tuple(units))
        j = self.expanding[k]
        t2, t3 = (self._level(k + 1, units[:j] + [n] + units[j + 1 :], targets) for n in SHORT)
        width = self.parts[j].width
        before_run = zip(units[:j], self.parts[:j], strict=True)
        start = self.run.start + sum(u * p.width for u, p in before_run)
        run = BlockRun(self.run.path, start, start + targets[j] * width, width)
        before, after = j > 0, j < len(self.parts) - 1
        with quiet():  # pure Python: no storages, no collections
            full = expand(t2, t3, run, targets[j], side=int(before) - int(after))
        return replace(
            full,
            op_counts=scaled_counts(t2.op_counts, t3.op_counts, targets[j]),
            host_bytes=scaled_counts(t2.host_bytes, t3.host_bytes, targets[j]),
            notes=scaled_notes(t2.notes, t3.notes, targets[j]),
        )


def scaled_notes(n2: tuple[str, ...], n3: tuple[str, ...], full: int) -> tuple[str, ...]:
    """The notes at depth ``full``: those that count blocks (FSDP2's ``fully_shard on 3
    blocks``) counted again, linear in the number of blocks; others as they are.

    >>> scaled_notes(("on 2 blocks", "bf16"), ("on 3 blocks", "bf16"), 32)
    ('on 32 blocks', 'bf16')
    """
    if len(n2) != len(n3):
        raise NotRepeatable("the short traces have different notes")
    notes = []
    for a, b in zip(n2, n3, strict=True):
        words_a, words_b = re.split(r"(\d+)", a), re.split(r"(\d+)", b)
        if len(words_a) != len(words_b) or words_a[::2] != words_b[::2]:
            raise NotRepeatable("a note changes with the depth")
        words = [
            y if x == y else str(int(y) + (full - 3) * (int(y) - int(x)))
            for x, y in zip(words_a, words_b, strict=True)
        ]
        notes.append("".join(words))
    return tuple(notes)


def repeat_built(
    built: BuiltModel,
    recipe: Recipe,
    trace_model: Callable[[BuiltModel, Recipe], Trace],
    kind: tuple = (),
) -> tuple[Trace | None, str]:
    """The full trace of ``built`` from short ones (``trace_model(built, recipe)``), and a
    note; ``(None, reason)`` when the model has no run to repeat (reason empty, or why its
    many blocks are not alike: ``_unlike_note``) or the rebuild is not exact. Checkpointing
    some of the blocks splits the run into stretches (``repeat_plan.segments``), each
    repeated on its own. Short traces are kept in
    ``built.short_traces`` (when given) under ``kind`` (what else shapes a trace: the
    policy, a distributed engine) and the short recipe, so that estimates which differ only
    in how many blocks are checkpointed share them."""
    model = built.model
    if not built.name.startswith(DEFAULT_SOURCES):
        return None, ""
    containers = block_containers(model)
    runs = _alike_runs(containers)
    run, period = _longest(runs), 1
    if run is None:
        run, period = _periodic_run(containers)
    if run is None:
        return None, _unlike_note(runs)
    label = f"{run.length} {run.path} blocks"
    parts = segments(recipe, run.length)
    stash = _stash_reason(recipe)
    if stash:
        parts = _stash_units(recipe, run.length)
        if parts is None:
            return None, f"full trace: {label} do not repeat exactly ({stash})"
    if period > 1:
        parts = _period_units(parts, period, stash)
        if parts is None:
            return None, (
                f"{_unlike_note(runs)} (they repeat every {period} blocks, which is traced "
                "short only with every block recomputed or none, without offloading, and "
                f"{PERIODS} or more times over)"
            )
    stack = ModuleStack()
    stack.name_modules(model)
    rebuilder = _Rebuilder(built, recipe, run, parts, trace_model, kind)
    if not rebuilder.expanding:
        return None, f"full trace: {label} have no stretch of more than {CHECK} alike"
    traces = len(set(leaves(parts, rebuilder.expanding)))
    if _whole_is_cheaper(run, containers, blocks_traced(parts), traces):
        return None, (
            f"full trace: each of the {traces} short traces of the {label} would also run "
            "the rest of the model (another stack of blocks), more than tracing it once"
        )
    if len(parts) > 1 and built.short_traces is None:
        short = blocks_traced(parts)
        if short > SHORTER * run.length:
            return None, (
                f"full trace: {label} checkpointed in part would take short traces of "
                f"{short} blocks in all, more than {SHORTER:.0%} of them: tracing every block "
                "is quicker (plan, which shares short traces, repeats them)"
            )
    try:
        _check_recomputed(model, run, built, recipe)
        rebuilder.trace_shared()
        if not rebuilder.rebuilds_check():
            raise NotRepeatable(f"the pattern does not rebuild the {CHECK}-block trace")
        trace = rebuilder.rebuilt({j: parts[j].units for j in rebuilder.expanding})
    except NotRepeatable as exc:
        return None, f"full trace: {label} do not repeat exactly ({exc})"
    except Exception as exc:  # a model that cannot be cut: trace it whole
        return None, f"full trace: {label} cannot be traced cut short ({type(exc).__name__})"
    cast_parameters(model, recipe)  # as the traced copies were
    trace = replace(trace, module_kinds=dict(stack.kinds))
    why = "checkpointed or not"
    if period > 1:
        why = f"the blocks repeat a pattern of {period}, as sliding-window and global layers do"
    if stash:
        why = f"an offloaded block input stays on the card up to {tricks.FORWARD_STASH} blocks"
    return trace, _note(label, parts, len(rebuilder.traces), why)


def _periodic_run(containers: list[tuple[str, nn.Module]]) -> tuple[BlockRun | None, int]:
    """The container of ``MIN_BLOCKS`` or more blocks whose blocks repeat a pattern of a
    few unlike ones from its first block to its last (Gemma 2: a sliding-window layer,
    then a global one), as a run, with the pattern's length; (None, 1) where none does.

    >>> alternating = nn.Sequential(*[nn.Linear(2, 2 + i % 2) for i in range(20)])
    >>> _periodic_run([("layers", alternating)])
    (BlockRun(path='layers', start=0, end=20, width=1), 2)
    """
    found: tuple[BlockRun | None, int] = (None, 1)
    for path, container in containers:
        children = list(container.children())
        if len(children) < MIN_BLOCKS or len(children) != len(container._modules):
            continue
        signatures = [signature(child) for child in children]
        for period in range(2, MAX_PERIOD + 1):
            if all(signatures[i] == signatures[i - period] for i in range(period, len(children))):
                if found[0] is None or len(children) > found[0].length:
                    found = (BlockRun(path, 0, len(children)), period)
                break
    return found


def _period_units(
    parts: tuple[Segment, ...], period: int, stash: str
) -> tuple[Segment, ...] | None:
    """Units of one ``period`` of blocks for a run whose blocks repeat in that pattern, the
    blocks left over a tail traced as they are; None where the recipe already cuts the run
    otherwise (some blocks recomputed, offloading's units) or the run holds fewer than
    ``PERIODS`` patterns (the short traces would hold too many of its blocks).

    >>> _period_units((Segment(1, 42),), 2, "")
    (Segment(width=2, units=21),)
    >>> _period_units((Segment(1, 34),), 6, "") is None
    True
    """
    if stash or len(parts) != 1 or parts[0].width != 1:
        return None
    units, tail = divmod(parts[0].units, period)
    if units < PERIODS:
        return None
    return (Segment(period, units),) + ((Segment(1, tail),) if tail else ())


def _whole_is_cheaper(
    run: BlockRun,
    containers: list[tuple[str, nn.Module]],
    short_blocks: int,
    traces: int,
) -> bool:
    """Whether one trace of the whole model costs less than ``traces`` short ones holding
    ``short_blocks`` of the run's blocks in all, because each short trace runs the other
    stacks of blocks in ``containers`` whole: the text stack beside a vision tower, a
    decoder beside its encoder. Costs are counted in leaf modules, which trace about alike
    (what lies outside every stack, run by either way, is left out: a single stack keeps
    its short traces).

    >>> encoder = nn.Sequential(*[nn.Linear(2, 2) for _ in range(24)])
    >>> decoder = nn.Sequential(*[nn.Linear(2, 2) for _ in range(24)])
    >>> _whole_is_cheaper(BlockRun("e", 0, 24), [("e", encoder), ("d", decoder)], 9, 3)
    True
    >>> _whole_is_cheaper(BlockRun("e", 0, 24), [("e", encoder)], 9, 3)
    False
    """

    def leaf_modules(module: nn.Module) -> int:
        return sum(1 for m in module.modules() if next(m.children(), None) is None)

    def nested(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    run_blocks = dict(containers)[run.path]
    per_block = leaf_modules(list(run_blocks.children())[run.start])
    other = sum(leaf_modules(c) for path, c in containers if not nested(path, run.path))
    return other > 0 and (traces - 1) * other >= (run.length - short_blocks) * per_block


def _stash_reason(recipe: Recipe) -> str:
    """Why offloading with checkpointing cannot repeat block by block (empty when it can).

    The offloader keeps the card copy of the last ``FORWARD_STASH`` offloaded saved tensors
    while the side stream copies them (``tricks.Offloader.pack``). A checkpointed block
    saves its inputs through it (``torch.utils.checkpoint``'s ``save_inputs``: the block's
    own saved tensors go to checkpoint's hooks), at least one tensor (PyTorch 2.1 to 2.11
    an empty one first), so a block's input dies up to ``FORWARD_STASH`` blocks later.
    Traces of fewer blocks than that (the 2-, 3- and 4-block ones) see every input die
    after the last block, a deeper model sees them die in the blocks: the pattern holds for
    the short traces and not for the model.
    ``_stash_units`` repeats units of ``FORWARD_STASH`` blocks instead.
    """
    if not (recipe.activation_offload and recipe.checkpointing != "none"):
        return ""
    if tricks.FORWARD_STASH <= 1:
        return ""
    return (
        f"with --activation-offload the last {tricks.FORWARD_STASH} offloaded saved tensors "
        f"stay on the card; a checkpointed block saves one or more, so each block's input "
        f"dies up to {tricks.FORWARD_STASH} blocks later, deeper than the short traces reach"
    )


def _stash_units(recipe: Recipe, blocks: int) -> tuple[Segment, ...] | None:
    """The stretches that repeat under activation offloading with every block
    checkpointed: units of ``FORWARD_STASH`` blocks, so that a block's input, which dies
    at most that many blocks later (``_stash_reason``), dies in its own unit or the next,
    as the rebuild needs; the blocks left over are a tail traced as it is. None where the
    short traces (2, 3 and 4 units, each with the tail) would hold more than ``SHORTER``
    of the model's blocks (the 32 of Llama-3-8B: tracing every block is quicker) or the
    checkpointing is partial.

    >>> _stash_units(Recipe(activation_offload=True, checkpointing="full"), 80)
    (Segment(width=5, units=16),)
    >>> _stash_units(Recipe(activation_offload=True, checkpointing="full"), 126)
    (Segment(width=5, units=25), Segment(width=1, units=1))
    >>> _stash_units(Recipe(activation_offload=True, checkpointing="full"), 32) is None
    True
    """
    if recipe.checkpointing != "full":
        return None
    width = tricks.FORWARD_STASH
    units, tail = divmod(blocks, width)
    parts = (Segment(width, units),) + ((Segment(1, tail),) if tail else ())
    if units <= CHECK or blocks_traced(parts) > SHORTER * blocks:
        return None
    return parts


def leaves(parts: tuple[Segment, ...], expanding: list[int] | None = None) -> list[tuple[int, ...]]:
    """The units of each stretch in every short trace that rebuilds ``parts`` and checks
    the rebuild: each stretch that expands (``expanding``; by default those longer than
    ``CHECK``) at 2 and 3 units (every combination of them), then all of them at
    ``CHECK``; the others as they are.

    >>> leaves((Segment(1, 12), Segment(1, 3)))
    [(2, 3), (3, 3), (4, 3)]
    >>> leaves((Segment(1, 12), Segment(1, 3)), [0, 1])
    [(2, 2), (2, 3), (3, 2), (3, 3), (4, 4)]
    """
    if expanding is None:
        expanding = [j for j, part in enumerate(parts) if part.expands]
    shapes: list[tuple[int, ...]] = [()]
    for j, part in enumerate(parts):
        counts = SHORT if j in expanding else (part.units,)
        shapes = [(*shape, n) for shape in shapes for n in counts]
    return [*shapes, tuple(CHECK if j in expanding else p.units for j, p in enumerate(parts))]


def blocks_traced(parts: tuple[Segment, ...]) -> int:
    """Blocks in all the short traces of ``parts`` (``leaves``, the check's included).

    >>> blocks_traced((Segment(5, 16),)), blocks_traced((Segment(1, 12), Segment(1, 20)))
    (45, 28)
    """
    return sum(
        sum(u * p.width for u, p in zip(units, parts, strict=True)) for units in leaves(parts)
    )


def _note(label: str, parts: tuple[Segment, ...], traces: int, why: str) -> str:
    if parts == (Segment(1, parts[0].units),):
        return (
            f"repeated blocks: traced {SHORT[0]} and {SHORT[1]} of the {label} and repeated "
            f"the block's events (rebuilds the {CHECK}-block trace exactly; --full-trace "
            "traces all)"
        )
    stretches = " and ".join(
        f"{p.units} units of {p.width} blocks"
        if p.width > 1
        else f"{p.units} block" + "s" * (p.units > 1)
        for p in parts
    )
    return (
        f"repeated blocks: the {label} are stretches of {stretches} ({why}); "
        f"traced {traces} short versions and repeated each stretch's events (rebuilds the "
        f"{CHECK}-unit trace exactly; --full-trace traces all)"
    )
