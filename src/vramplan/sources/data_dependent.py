"""Answer the data-dependent steps of a detection model's training step under a stated policy.

Fake tensors have shapes but no values, so ``nonzero``, boolean-mask indexing, ``.item()``,
non-maximum suppression and ``unique`` cannot know how many elements they return. While a
detection model runs, ``CountMode`` answers each of them with the number the policy gives:

- ``max`` (the default): every count at the most the model's settings allow. Every
  mask is all true (every proposal survives NMS and the small-box filter, up to
  ``rpn_post_nms_top_n_train``), so the samplers keep their caps: ``batch_size_per_image x
  positive_fraction`` positives per image (128 in the RPN, 128 of 512 in the box head), the
  rest of ``batch_size_per_image`` negatives, and the mask and keypoint heads run on all
  the positives. This is what ``max_memory_allocated`` over
  a training run reaches on its busiest images.
- ``min``: each ground-truth box matched once (the fewest positives a step can have: the
  ground truth is always among the proposals, and every box keeps its best anchor); the
  samplers fill the rest of their batch with negatives as they do.

An image without objects (``--boxes-per-image 0``, COCO's background images; torchvision
then matches every anchor and proposal to the background) has no positive under either
policy: the samplers take negatives only, and the foreground selections of RetinaNet's,
FCOS's and SSD's losses (and SSD's hard negatives, three per positive) select nothing.

Both policies answer the other counts alike: NMS keeps every box, a low-quality match
adds one anchor per ground-truth box, ``unique`` finds one class, RoIAlign puts every
region on one pyramid level, and ``.any()`` of a check finds nothing wrong.

PyTorch's unbacked SymInts (a ``ShapeEnv``) cannot carry these steps: torchvision turns
the counts into Python ints (``min(positive.numel(), num_pos)``, ``int(x.item())``), which
stop on a guard; concrete counts from a policy can be traced and replayed.

>>> policy = CountPolicy("min", boxes_per_image=3)
>>> policy.positives(2000, 0, 1), CountPolicy("max", 3).positives(2000, 0, 1)
(3, 2000)
"""

from __future__ import annotations

import contextlib
import linecache
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vramplan.errors import UserError

POLICIES = ("max", "min")
aten = torch.ops.aten


@dataclass(frozen=True)
class CountPolicy:
    """How many elements a data-dependent step returns: ``max`` or ``min`` (see above)."""

    name: str = "max"
    boxes_per_image: int = 20
    busiest_image_boxes: int | None = None
    """The last image's boxes (``--busiest-image-boxes``): the per-image loops reach it when
    the others' tensors are already held, so it peaks there."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise UserError(
                f"unknown detection count policy {self.name!r}; choose one of: max, min"
            )

    def boxes(self, image: int, images: int) -> int:
        """The ground-truth boxes of the ``image``-th of ``images`` images.

        >>> [CountPolicy("min", 3, busiest_image_boxes=93).boxes(i, 2) for i in (0, 1)]
        [3, 93]
        """
        if image == images - 1 and self.busiest_image_boxes is not None:
            return self.busiest_image_boxes
        return self.boxes_per_image

    def positives(self, candidates: int, image: int, images: int) -> int:
        """Positive matches among ``candidates`` anchors or proposals of the ``image``-th of
        ``images`` images (none without a ground-truth box)."""
        boxes = self.boxes(image, images)
        if boxes == 0:
            return 0
        if self.name == "max":
            return candidates
        return min(candidates, boxes)

    def note(self) -> str:
        if self.boxes_per_image == 0:
            return (
                f"images without objects (policy {self.name} alike): every anchor and "
                "proposal is background, so the samplers take negatives only, the mask/"
                "keypoint heads and the one-stage losses' foreground terms run on none; NMS "
                "keeps every proposal up to rpn_post_nms_top_n_train"
            )
        if self.name == "max":
            return (
                "data-dependent steps at their configured maxima (policy max): every "
                "proposal kept through NMS up to rpn_post_nms_top_n_train, the samplers' "
                "positive caps reached, mask/keypoint heads on every sampled positive"
            )
        return (
            "data-dependent steps at their fewest (policy min): each image's ground-truth "
            "boxes matched once, the samplers filled with negatives, NMS keeping every "
            "proposal up to rpn_post_nms_top_n_train"
        )


@dataclass
class Ledger:
    """What the samplers chose in this step: (positives, negatives) per image, by head;
    ``boxes``: the ground-truth boxes per image (None where the caller does not say)."""

    sampled: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    boxes: int | None = None

    def positives(self, head: str, image: int | None = None) -> int:
        counts = self.sampled.get(head, [])
        if image is not None:
            return counts[image][0] if image < len(counts) else 0
        return sum(p for p, _ in counts)

    def negatives(self, head: str) -> int:
        return sum(n for _, n in self.sampled.get(head, []))


class PolicySampler:
    """torchvision's ``BalancedPositiveNegativeSampler`` with the policy's counts: the same
    caps (``batch_size_per_image``, ``positive_fraction``) and mask outputs, no ``nonzero``.

    >>> from torchvision.models.detection._utils import BalancedPositiveNegativeSampler
    >>> ledger = Ledger()
    >>> sampler = PolicySampler(BalancedPositiveNegativeSampler(256, 0.5),
    ...                         CountPolicy("min", 4), ledger, "rpn")
    >>> pos, neg = sampler([torch.zeros(1000, dtype=torch.int64)])
    >>> int(pos[0].sum()), int(neg[0].sum()), ledger.sampled["rpn"]
    (4, 252, [(4, 252)])
    >>> sampler.policy = CountPolicy("max", 4)
    >>> _ = sampler([torch.zeros(1000, dtype=torch.int64)]); ledger.sampled["rpn"]
    [(128, 128)]
    """

    def __init__(self, original, policy: CountPolicy, ledger: Ledger, head: str) -> None:
        self.batch_size_per_image = original.batch_size_per_image
        self.positive_fraction = original.positive_fraction
        self.policy = policy
        self.ledger = ledger
        self.head = head

    def __call__(self, matched_idxs: list[torch.Tensor]):
        positive_masks, negative_masks, counts = [], [], []
        for image, matched in enumerate(matched_idxs):
            candidates = matched.numel()
            positive = min(self.policy.positives(candidates, image, len(matched_idxs)), candidates)
            num_pos = min(positive, int(self.batch_size_per_image * self.positive_fraction))
            # the batch's rest is negatives where the candidates have them: a busy image's
            # positives past the cap still leave the proposals far from every box
            room = self.batch_size_per_image - num_pos
            positive = min(positive, max(num_pos, candidates - room))
            num_neg = min(candidates - positive, room)
            # the index tensors torchvision's sampler holds: torch.where and randperm of each
            torch.empty(positive, dtype=torch.int64)
            torch.empty(candidates - positive, dtype=torch.int64)
            # the labels the policy's counts stand for (a real run then agrees with them)
            matched[:num_pos] = 1
            matched[num_pos : num_pos + num_neg] = 0
            pos = torch.zeros_like(matched, dtype=torch.uint8)
            pos[:num_pos] = 1
            neg = torch.zeros_like(matched, dtype=torch.uint8)
            neg[num_pos : num_pos + num_neg] = 1
            positive_masks.append(pos)
            negative_masks.append(neg)
            counts.append((num_pos, num_neg))
        self.ledger.sampled[self.head] = counts
        return positive_masks, negative_masks


def _caller() -> tuple[str, str, dict]:
    """The innermost torchvision frame on the stack: (function, source line, locals)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "torchvision" in filename and "_python_dispatch" not in filename:
            line = linecache.getline(filename, frame.f_lineno).strip()
            return frame.f_code.co_name, line, frame.f_locals
        frame = frame.f_back
    return "", "", {}


Rule = Callable[[torch.Tensor, Ledger, dict], int]

# Where torchvision's count follows what a sampler chose: (function, text of the line).
SITE_RULES: dict[tuple[str, str], Rule] = {
    ("compute_loss", "sampled_pos_inds = torch.where"): lambda m, led, _: led.positives("rpn"),
    ("compute_loss", "sampled_neg_inds = torch.where"): lambda m, led, _: led.negatives("rpn"),
    ("subsample", "torch.where(pos_inds_img | neg_inds_img)"): lambda m, led, local: sum(
        led.sampled["roi"][local["img_idx"]]
    ),
    ("fastrcnn_loss", "torch.where(labels > 0)"): lambda m, led, _: led.positives("roi"),
    ("forward", "torch.where(labels[img_id] > 0)"): lambda m, led, local: led.positives(
        "roi", local["img_id"]
    ),
    # one best anchor per ground-truth box
    ("set_low_quality_matches_", "torch.where(match_quality_matrix =="): lambda m, led, _: m.shape[
        0
    ],
    # every region on the first pyramid level
    ("_multiscale_roi_align", "torch.where(levels == level)"): lambda m, led, local: (
        m.numel() if local.get("level") == 0 else 0
    ),
}


# What a one-stage loss selects through its anchors' matches (RetinaNet's and SSD's
# ``foreground_idxs_per_image``, FCOS's ``foregroud_mask``, SSD's ``foreground_idxs`` and its
# hard negatives ``background_idxs``, three per positive): nothing without a ground-truth box.
NO_BOX_SITES = ("foreground", "foregroud", "matched_idxs_per_image >= 0", "background_idxs")
NO_BOX_STATEMENT = "gt_classes_target["
"""RetinaNet's ``gt_classes_target[foreground_idxs_per_image, ...] = 1.0`` spans four lines;
its store is reported on this, the first (the line alone, not its valid-anchors index)."""


def _count(mask: torch.Tensor, ledger: Ledger) -> int:
    function, line, local = _caller()
    if ledger.boxes == 0 and (
        line == NO_BOX_STATEMENT or any(site in line for site in NO_BOX_SITES)
    ):
        return 0
    for (name, text), rule in SITE_RULES.items():
        if function == name and text in line:
            return min(int(rule(mask, ledger, local)), mask.numel())
    return mask.numel()  # every element true: the most a mask can select


def _indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """What ``nonzero`` of ``mask`` returns when ``count`` elements are true."""
    return torch.zeros((count, mask.dim()), dtype=torch.int64, device=mask.device)


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _long_indices(indices, ledger: Ledger) -> list:
    """Boolean masks among ``indices`` turned into the long indices they select."""
    out = []
    for index in indices:
        if _is_mask(index):
            out.extend(_indices(index, _count(index, ledger)).unbind(1))
        else:
            out.append(index)
    return out


def _has_value(tensor: torch.Tensor) -> bool:
    """A real tensor, or a fake one whose value fake tensors track (a small constant)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(tensor, FakeTensor) or tensor.constant is not None


_NEAREST_2D = (aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default)


class CountMode(TorchDispatchMode):
    """Answer data-dependent ops with the policy's counts (see the module docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            return _indices(args[0], _count(args[0], self.ledger))
        if func is aten.index.Tensor and any(_is_mask(i) for i in args[1]):
            return func(args[0], _long_indices(args[1], self.ledger))
        if func in (aten.index_put_.default, aten.index_put.default) and any(
            _is_mask(i) for i in args[1]
        ):
            return func(args[0], _long_indices(args[1], self.ledger), *args[2:], **kwargs)
        if func is aten._local_scalar_dense.default and not _has_value(args[0]):
            # `if check.any():` finds nothing; a count read as a number is one
            return False if args[0].dtype == torch.bool else 1
        if func is torch.ops.torchvision.nms.default:
            return torch.zeros(args[0].shape[0], dtype=torch.int64, device=args[0].device)
        if func in _NEAREST_2D and args[0].numel() == 0:
            # an image's masks without a box (0xHxW) resized with it: the meta kernel's
            # `torch._check(input.numel() != 0 or multiply_integers(...))` hands an int to
            # torch._check ("cond must be a bool"); the CPU and CUDA kernels return the
            # empty batch at the new size
            return args[0].new_empty((*args[0].shape[:2], *args[1]))
        if func is aten._unique2.default:
            values = args[0].new_zeros(min(1, args[0].numel()))
            inverse = torch.zeros(args[0].shape, dtype=torch.int64, device=args[0].device)
            counts = torch.zeros(values.shape, dtype=torch.int64, device=args[0].device)
            return values, inverse, counts
        return func(*args, **kwargs)


def _expanded(index, ledger: Ledger):
    """An indexing key with its boolean masks replaced by the long indices they select."""
    if _is_mask(index):
        return tuple(_indices(index, _count(index, ledger)).unbind(1))
    if isinstance(index, tuple) and any(_is_mask(i) for i in index):
        parts = []
        for part in index:
            converted = _expanded(part, ledger)
            parts.extend(converted if _is_mask(part) else (converted,))
        return tuple(parts)
    return index


class MaskIndexMode(TorchFunctionMode):
    """``x[mask]`` and ``x[mask] = y`` with the mask's long indices, before autograd sees
    them: the backward then needs no count of its own."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            args = (args[0], _expanded(args[1], self.ledger), *args[2:])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted(ledger: Ledger) -> Iterator[None]:
    """Run data-dependent steps with the policy's counts (both modes above)."""
    with MaskIndexMode(ledger), CountMode(ledger):
        yield
